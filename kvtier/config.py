"""One typed configuration tree for kvtier.

Loaded only here: a YAML file (optional) overlaid with ``KVTIER_*`` environment
variables, then explicit overrides. Nested fields use ``__`` in environment names,
e.g. ``KVTIER_STORE__DISK__PATH=/mnt/nvme/kvtier`` or
``KVTIER_STORE__MEMORY__CAPACITY=4GiB``. Every bad value raises ``ConfigError``
with one line naming the field and the problem.

``KVTIER_CONFIG_FILE`` names the YAML file where no file is given explicitly
(``config_file``): ``kvtier serve`` and the connector in the vLLM process read it,
as LMCache reads ``LMCACHE_CONFIG_FILE``. ``load_config`` itself never does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, model_validator

ENV_PREFIX = "KVTIER_"
CONFIG_FILE_ENV = "KVTIER_CONFIG_FILE"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mi": 2**20, "mib": 2**20, "g": 10**9, "gb": 10**9, "gi": 2**30, "gib": 2**30,
          "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40}


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the field."""


def parse_size(value: Any) -> int:
    """Parse a byte size: an int, or a string like ``512MiB``, ``4GB``, ``1.5GiB``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value >= 0:
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = (m.group(2) or "").lower()
            return int(float(m.group(1)) * _UNITS[unit])
    raise ValueError(f"expected a byte size like 512MiB or 4GB, got {value!r}")


ByteSize = Annotated[int, BeforeValidator(parse_size)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MemoryTierConfig(_Section):
    enabled: bool = True
    capacity: ByteSize = Field(default=2 * 2**30, description="RAM tier byte budget")
    slot_size: ByteSize | None = Field(default=None, description="bytes per RAM slot; default: the first "
                                       "chunk's payload size rounded up to 4 KiB")
    prefault: bool = Field(default=False, description="touch the whole RAM slab when it is allocated")


class DiskTierConfig(_Section):
    enabled: bool = False
    path: Path | None = Field(default=None, description="local SSD directory (required when enabled)")
    capacity: ByteSize = Field(default=20 * 2**30, description="SSD tier byte budget")
    fsync: Literal["never", "file", "always"] = Field(
        default="never", description="never: rely on the page cache; file: fsync each chunk before publish; "
        "always: also fsync the directory")
    o_direct: bool = Field(default=False, description="use O_DIRECT for reads/writes where supported")
    allow_shared_dir: bool = Field(default=False, description="use a directory another user owns or that group/"
                                   "others may write (refused by default: they could read or plant KV)")
    writer_threads: int = Field(default=2, ge=1, le=64)
    queue_depth: int = Field(default=256, ge=1, description="bounded write queue; when full, stores are dropped")
    rescan_interval_s: float = Field(default=5.0, ge=0, description="a background thread re-reads the directory "
                                     "this often, so the index (lookups are index-only) learns other processes' "
                                     "chunks; 0: never")

    @model_validator(mode="after")
    def _path_when_enabled(self) -> "DiskTierConfig":
        if self.enabled and self.path is None:
            raise ValueError("disk tier is enabled but store.disk.path is not set")
        return self


class SharedTierBase(_Section):
    """Fields every shared (many-machine) tier has. Deadlines bound every call the engine waits on."""

    lookup_timeout_s: float = Field(default=0.5, gt=0, description="a batched existence check slower than this "
                                    "answers 'unavailable' (the request proceeds without the shared tier)")
    io_timeout_s: float = Field(default=5.0, gt=0, description="deadline of one batched read or write")
    max_inflight: int = Field(default=8, ge=1, le=256, description="most threads/requests in flight to the backend "
                              "at once: a stalled backend can hold at most this many")
    write_backlog: ByteSize = Field(default=2**30, gt=0, description="bytes of writes queued for the backend "
                                    "beyond those in flight; a write past it is dropped (counted). Counted in "
                                    "bytes, so chunks stored per KV head queue as many chunks as whole ones")
    probe_interval_s: float = Field(default=2.0, gt=0, description="after a timeout the tier is marked "
                                    "unavailable (no new I/O) and probed this often until it answers")
    encoding: Literal["plain", "zstd", "int8"] = Field(default="plain", description="payload encoding in this "
                                                       "tier only: plain (the local tiers' bytes), zstd "
                                                       "(lossless), int8 (lossy per-channel 8-bit K/V); "
                                                       "part of the tier's namespace")


class SharedFsConfig(SharedTierBase):
    """A POSIX directory on a filesystem many machines mount (JuiceFS, 3FS, CephFS, NFS...)."""

    kind: Literal["sharedfs"] = "sharedfs"
    path: Path = Field(description="directory on the shared mount; must exist unless `create` (a missing "
                       "directory usually means a missing mount)")
    capacity: ByteSize = Field(default=100 * 2**30, description="shared byte budget; the elected janitor evicts "
                               "past it (no lock on the write path)")
    create: bool = Field(default=False, description="create `path` if missing (off: kvtier must not fill the "
                         "local disk under an unmounted mount point)")
    dir_levels: int = Field(default=2, ge=1, le=3, description="levels of 256-way directory fan-out under chunks/")
    lookup_threads: int = Field(default=32, ge=1, le=256, description="parallel stat/read threads per process "
                                "(a network filesystem's stat is a metadata round trip)")
    writer_threads: int = Field(default=4, ge=1, le=64, description="background writer threads per process")
    queue_depth: int = Field(default=256, ge=1, description="bounded write queue; when full, stores are dropped")
    fsync: bool = Field(default=False, description="fsync each chunk file before it is renamed into place")
    touch_interval_s: float = Field(default=60.0, ge=0, description="a hit refreshes a chunk's access stamp "
                                    "(mtime) when it is older than this")
    janitor: bool = Field(default=True, description="take part in the janitor election (one process evicts)")
    janitor_interval_s: float = Field(default=30.0, gt=0, description="seconds between janitor lease renewals "
                                      "and eviction passes")
    lease_ttl_s: float = Field(default=90.0, gt=0, description="a janitor lease not renewed for this long "
                               "expires (another process takes over)")
    low_watermark: float = Field(default=0.9, gt=0, le=1, description="an eviction pass frees down to this "
                                 "fraction of capacity")
    overfill: float = Field(default=1.25, ge=1, description="writes are dropped while the janitor's last "
                            "count exceeds capacity x this (a janitor that cannot keep up)")
    temp_ttl_s: float = Field(default=3600.0, gt=0, description="the janitor removes temp files older than this")

    @model_validator(mode="after")
    def _timing(self) -> "SharedFsConfig":
        if self.lease_ttl_s <= self.janitor_interval_s:
            raise ValueError("sharedfs.lease_ttl_s must exceed janitor_interval_s (the lease would lapse "
                             "between renewals)")
        return self


class ValkeyConfig(SharedTierBase):
    """Valkey / Redis, standalone or cluster. Credentials in the URL are moved into ``username`` /
    ``password`` at load time, so no repr, log line or report ever shows them."""

    kind: Literal["valkey"] = "valkey"
    url: str = Field(default="redis://127.0.0.1:6379/0", description="valkey://, redis:// or rediss:// URL "
                     "(credentials may be given here or in username/password; never logged)")
    cluster: bool = Field(default=False, description="Valkey/Redis Cluster: url names one node, the client "
                          "discovers the rest; a chunk's keys share one hash slot")
    username: str | None = Field(default=None, description="ACL user name (default user when unset)")
    password: SecretStr | None = Field(default=None, description="password (or env "
                                       "KVTIER_STORE__SHARED__PASSWORD); shown as ********** everywhere")
    tls: bool = Field(default=False, description="connect with TLS (also implied by a rediss:// url)")
    tls_ca_file: Path | None = Field(default=None, description="CA bundle to verify the server (TLS)")
    ttl_s: float | None = Field(default=None, gt=0, description="expire chunks this long after their write; "
                                "none: only the server's maxmemory policy evicts")
    key_prefix: str = Field(default="kvtier", min_length=1, description="prefix of every key kvtier writes")

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_url(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("url"), str):
            from urllib.parse import unquote, urlsplit, urlunsplit

            parts = urlsplit(data["url"])
            if parts.username or parts.password:
                data = dict(data)
                host = parts.hostname or ""
                netloc = f"[{host}]" if ":" in host else host
                if parts.port:
                    netloc += f":{parts.port}"
                data["url"] = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
                if parts.username and not data.get("username"):
                    data["username"] = unquote(parts.username)
                if parts.password and not data.get("password"):
                    data["password"] = unquote(parts.password)
        return data


class MooncakeConfig(SharedTierBase):
    """Mooncake Store through its Python client (TCP here, RDMA where available)."""

    kind: Literal["mooncake"] = "mooncake"
    master: str = Field(default="127.0.0.1:50051", description="mooncake_master address host:port")
    metadata_server: str = Field(default="http://127.0.0.1:8080/metadata", description="transfer-engine "
                                 "metadata service: the master's built-in HTTP one, etcd://..., or P2PHANDSHAKE")
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="transfer protocol")
    rdma_devices: str = Field(default="", description="RDMA device names (protocol rdma), comma separated")
    local_hostname: str = Field(default="127.0.0.1", description="this client's address as other clients "
                                "reach it (set to the machine's IP on a real cluster)")
    segment_bytes: ByteSize = Field(default=0, description="memory this client lends to the pool; 0: store "
                                    "into other clients' segments (a standalone pool owner), because objects "
                                    "in a client's own segment vanish when it exits")
    local_buffer_bytes: ByteSize = Field(default=16 * 2**20, description="the client's transfer staging buffer")
    replicas: int = Field(default=1, ge=1, le=8, description="replicas per chunk")
    key_prefix: str = Field(default="kvtier", min_length=1, description="prefix of every object key")


SharedTierConfig = Annotated[SharedFsConfig | ValkeyConfig | MooncakeConfig, Field(discriminator="kind")]


class FaultyConfig(_Section):
    """A drill: wrap one tier with injected faults (kvtier.tiers.faulty.FaultyTier). Never for production."""

    kind: Literal["faulty"] = "faulty"
    wraps: Literal["memory", "disk", "shared"] = Field(default="disk", description="the tier that gets the faults")
    latency_ms: float = Field(default=0.0, ge=0, description="added to every read and remote lookup (one "
                              "slower than its deadline answers 'unavailable'); writes are not slowed")
    error_rate: float = Field(default=0.0, ge=0, le=1, description="fraction of calls that fail (unavailable "
                              "lookups, failed reads and writes)")
    corrupt_rate: float = Field(default=0.0, ge=0, le=1, description="fraction of chunk reads whose bytes are "
                                "flipped before verification (must become a miss, never wrong data)")
    stall_after: int | None = Field(default=None, ge=0, description="after this many calls every call stalls "
                                    "for stall_s (a hung backend); none: never")
    stall_s: float = Field(default=30.0, ge=0, description="how long a stalled call blocks (bounded by the "
                           "call's deadline where it has one)")
    seed: int = Field(default=0, description="seed of the fault schedule (same seed, same faults)")


class StoreConfig(_Section):
    chunk_size: int = Field(default=256, ge=1, description="tokens per chunk; a multiple of the engine block size")
    eviction: Literal["lru", "cost"] = "lru"
    write_policy: Literal["write_through", "write_back"] = "write_through"
    promote_on_hit: bool = True
    memory: MemoryTierConfig = MemoryTierConfig()
    disk: DiskTierConfig = DiskTierConfig()
    shared: SharedTierConfig | None = Field(default=None, description="the third tier, read and written by many "
                                           "machines: {kind: sharedfs|valkey|mooncake, ...}; none by default")
    faults: FaultyConfig | None = Field(default=None, description="fault drill: wrap store.faults.wraps with "
                                        "injected latency, errors, corruption and stalls; none by default")
    deployment: str = Field(default="", max_length=128, description="deployment-wide namespace prefix: deployments "
                            "sharing one backend with different values never read each other's chunks")
    max_chunk_bytes: ByteSize | None = Field(default=None, description="largest chunk (4 KiB header + payload + "
                                             "trailer) any tier's reader accepts; a larger file or value is a "
                                             "counted miss (too_large) and nothing is allocated for it. None: 1 MiB "
                                             "per token of chunk_size, at least 64 MiB (above any dense model's KV "
                                             "per token)")
    signing_key: SecretStr | None = Field(default=None, description="deployment secret (>= 16 bytes): every chunk "
                                          "is signed with a keyed BLAKE3 MAC and unsigned or wrongly signed chunks "
                                          "are misses; never logged")
    signing_key_file: Path | None = Field(default=None, description="read the signing secret from this file "
                                          "instead (must not be readable by group or others)")

    def read_limit(self) -> int:
        """``max_chunk_bytes`` or its default (side-effect free)."""
        if self.max_chunk_bytes is not None:
            return self.max_chunk_bytes
        return max(64, self.chunk_size) * 2**20 + 8192     # + room for the 4 KiB header and the trailer

    @model_validator(mode="after")
    def _one_signing_source(self) -> "StoreConfig":
        if self.signing_key is not None and self.signing_key_file is not None:
            raise ValueError("set store.signing_key or store.signing_key_file, not both")
        if self.signing_key is not None and len(self.signing_key.get_secret_value().encode()) < 16:
            raise ValueError("store.signing_key must be at least 16 bytes")
        if self.max_chunk_bytes is not None and self.max_chunk_bytes < 8192:
            raise ValueError("store.max_chunk_bytes must be at least 8KiB (a chunk's header alone is 4 KiB)")
        return self


class ConnectorConfig(_Section):
    load_timeout_s: float = Field(default=30.0, gt=0, description="a load slower than this is a miss")
    load_mode: Literal["whole", "layerwise"] = Field(
        default="whole", description="synchronous (local-tier) loads: whole = every claimed chunk copied into "
        "vLLM's blocks before the forward pass; layerwise = read in the background while the forward pass "
        "runs, each attention layer waiting only for its own blocks (wait_for_layer_load)")
    on_unsupported: Literal["fail", "serve-without-cache"] = Field(
        default="fail", description="an engine kvtier cannot serve (a KV layout that is not block-compact, "
        "kernel block splitting, several KV-cache groups, an unknown device): fail = the engine does not start, "
        "with one error naming the model and what to do; serve-without-cache = it starts without kvtier (logged, "
        "counted as a layout error, nothing claimed)")
    tp_layout: Literal["per-rank", "per-kv-head"] = Field(
        default="per-rank", description="how chunks of a tensor-parallel model are cut: per-rank = one chunk per "
        "rank holding its share of the KV heads (the TP size is in the namespace: only engines of the same TP "
        "size share chunks); per-kv-head = one entry per KV head of the model, the same bytes at any TP size, so "
        "TP = 1 and TP = 2 replicas of a model read each other's chunks (KV heads x more, smaller entries; needs "
        "the head axis outermost in vLLM's KV pages, which kvtier asks for). MLA models are TP-independent either way")
    save: bool = Field(default=True, description="save newly computed full chunks")
    save_generated: bool = Field(
        default=True, description="also save the full chunks that cover generated tokens (as decode fills "
        "them, and at the end of a request), so the next turn of a chat, whose prompt repeats the reply's "
        "token ids, hits them; costs one chunk write per chunk_size generated tokens (needs save)")
    min_hit_chunks: int = Field(default=1, ge=1, description="ignore hits shorter than this many chunks")
    request_log: Path | None = Field(default=None, description="append per-request claim/load events "
                                     "(JSON lines) here; for tests and audits")
    stats_dir: Path | None = Field(default=None, description="where connector processes write JSON metric "
                                   "snapshots; default <store.disk.path>/_stats when the disk tier is on")
    stats_interval_s: float = Field(default=5.0, gt=0, description="seconds between metric snapshots")
    promote: Literal["background", "sync"] = Field(
        default="background", description="how SSD hits reach the worker's RAM tier (store.promote_on_hit): "
        "background = after the load, at idle CPU priority; sync = during the load (on the critical path)")
    promote_min_hits: int = Field(
        default=2, ge=1, description="background promotion copies a chunk into RAM at its n-th SSD hit in this "
        "worker (2: chunks read once are never copied)")
    async_read_depth: int = Field(
        default=2, ge=1, le=32, description="chunk reads in flight per asynchronous (shared-tier) load; each "
        "holds one chunk-sized buffer of the worker's ring (depth + 1 buffers)")
    background_cpus: Literal["any", "inherit"] = Field(
        default="any", description="CPUs for kvtier's background worker threads (disk writes, promotion, RAM "
        "prefault): any = every CPU of the process, not only the cores the engine bound its compute to (they "
        "run while the forward pass holds those); inherit = the engine's binding. Synchronous load reads "
        "always run on the engine's cores, which wait for them")
    prefetch_ram: ByteSize = Field(
        default=0, ge=0, description="queue-time prefetch: RAM the worker may fill, ahead of scheduling, with the "
        "SSD / shared-tier chunks of requests waiting in vLLM's queue (released as they are scheduled); 0: off")


class MetricsConfig(_Section):
    port: int | None = Field(default=None, ge=0, le=65535, description="serve Prometheus metrics on this port (the scheduler; worker r on port + 1 + r); "
                             "absent or 0: off")
    host: str = Field(default="127.0.0.1", min_length=1, description="address the metrics endpoint binds; anything "
                      "but loopback exposes cache statistics to the network and is logged at start")


class ClaimsConfig(_Section):
    """Which stored chunks the scheduler claims (``kvtier.integrations.vllm.claim_policy``)."""

    policy: Literal["always", "pays-off"] = Field(
        default="pays-off", description="always = every chunk any tier holds; pays-off = only the leading "
        "chunks whose expected load time is at most margin x the time computing them would take (tier read "
        "speeds measured by the worker, prefill cost from the engine's forward passes or the calibration below)")
    margin: float = Field(default=1.0, gt=0, description="a chunk is claimed when its expected load time <= margin "
                          "x its expected compute time (< 1: loads must be clearly faster)")
    min_samples: float = Field(default=1.5, gt=0, description="reads of a tier (and forward passes of the engine) "
                               "behind an estimate, each halved every half_life_s, below which it is not used: "
                               "chunks are then claimed (1.5: two reads, trusted until they fade)")
    half_life_s: float = Field(default=60.0, gt=0, description="a read sample's weight halves this often: a tier "
                               "declined as slow is read again once its estimate faded below min_samples")
    unavailable_s: float = Field(default=10.0, ge=0, description="after a read its tier could not answer (timeout, "
                                 "backend down, breaker open), its chunks are declined for this long")
    prefill_per_token_s: float | None = Field(
        default=None, gt=0, description="the engine's prefill seconds per token (kvtier calibrate's b), used until "
        "min_samples forward passes are measured; none: chunks are claimed until then")
    prefill_quadratic_s: float | None = Field(
        default=None, ge=0, description="seconds per token of attention span (the calibration's c); none: "
        "2.5e-4 x prefill_per_token_s, the shape measured for the bundled model")


class KvtierConfig(_Section):
    store: StoreConfig = StoreConfig()
    connector: ConnectorConfig = ConnectorConfig()
    metrics: MetricsConfig = MetricsConfig()
    claims: ClaimsConfig = ClaimsConfig()


def deep_merge(base: Mapping, over: Mapping) -> dict:
    """``base`` updated with ``over``, nested mappings merged key by key (neither input is changed)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml_mapping(path: str | Path) -> dict:
    """A YAML file that must hold a mapping at top level; ConfigError (one line) otherwise."""
    p = Path(path)
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p} must hold a mapping at top level")
    return loaded


def _env_tree(env: Mapping[str, str]) -> dict:
    tree: dict = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue  # only nested KVTIER_SECTION__FIELD names are config; others (KVTIER_HOME) are not
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return tree


def _first_error_line(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "config"
    msg = e["msg"].removeprefix("Value error, ")
    value = e.get("input")
    if "input" in e and not isinstance(value, dict) and repr(value) not in msg:
        return f"invalid config: {loc}: {msg} (got {value!r})"
    return f"invalid config: {loc}: {msg}"


def config_file(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Path | None:
    """The config file to read: ``path`` when given, else ``$KVTIER_CONFIG_FILE`` (unset or empty: None).

    Side-effect free; the file is not opened here (``load_config`` reports a missing one)."""
    if path is not None and str(path) != "":
        return Path(path)
    value = ((os.environ if env is None else env).get(CONFIG_FILE_ENV) or "").strip()
    return Path(value).expanduser() if value else None


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> KvtierConfig:
    """Build the config: defaults <- YAML file <- KVTIER_* env <- overrides. Raises ConfigError."""
    data = read_yaml_mapping(path) if path is not None else {}
    data = deep_merge(data, _env_tree(os.environ if env is None else env))
    if overrides:
        data = deep_merge(data, overrides)
    try:
        return KvtierConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_first_error_line(e)) from None


def kvtier_home() -> Path:
    """Root of kvtier's caches (model folder, default disk tier): $KVTIER_HOME or ~/.cache/kvtier."""
    return Path(os.environ.get("KVTIER_HOME") or Path.home() / ".cache" / "kvtier")
