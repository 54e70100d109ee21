"""``kvtier bench encoding``: what each shared-tier encoding (``store.shared.encoding``: plain, zstd, int8)
costs and saves, on real KV of the model, and what int8 does to the model's output.

A run is a list of roles, each in its own process or step, its result a file in ``workdir`` (``--resume``
keeps the directory and takes the roles not run now from an earlier invocation: a long run split into
jobs; with no role at all, only the report of what is there). Roles (default: all, in this order):

  write-DTYPE   an engine in DTYPE with kvtier's RAM + SSD tiers computes every prompt once: the real
                chunks (``encoding_engine``); one per ``dtypes`` (float32 always: the readers load its)
  codec         every encoding on every captured chunk, one thread: ratio, bytes per token, encode and
                decode MB/s, zstd's exactness, int8's error (``encoding_codec``)
  stores        real chunks put into and read back from a real JuiceFS mount and a real Valkey server in
                every encoding, interleaved per round (``encoding_stores``); local throwaway services
                unless ``sharedfs`` / ``valkey`` name others
  vanilla       the reference: vLLM without kvtier, float32, ``max_output_tokens`` greedy tokens per prompt
  read-ENC      a fresh engine loading each prompt's prefix from a sharedfs directory in encoding ENC
                (zstd, int8), filled from write-float32's chunks through the encoded tier's own ``put``
                (``shared_seed``); every prompt's load proved by kvtier's counters

Prompts: ``documents`` long documents of kvtier's long-document workload (``workload.longdoc``, one
question each, lengths uniform in ``doc_tokens * (1 +- spread)``), rendered with the model's chat
template; the same token ids for every engine (``prompts.json``).

The report (``EncodingReport`` as JSON) holds every figure and ``violations``: a zstd round trip or read
that was not exact, a zstd reader whose tokens differ from the reference (lossless must be token-exact),
a load its counters do not prove, a seed that did not reach the tier, a role that failed. Any violation
fails the command.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from kvtier.bench.encoding_engine import DTYPES, QUALITY_DTYPE

STEPS = ("codec", "stores")
ENGINE_ROLES = tuple(f"write-{d}" for d in DTYPES) + ("vanilla", "read-zstd", "read-int8")
ROLES = ENGINE_ROLES[:2] + STEPS + ENGINE_ROLES[2:]
COMPARED = ("zstd", "int8")


@dataclass(frozen=True)
class EncodingOptions:
    model: str
    workdir: Path
    documents: int = 50
    doc_tokens: int = 1400
    spread: float = 0.3
    seed: int = 0
    max_output_tokens: int = 64
    dtypes: tuple[str, ...] = DTYPES
    volume: int = 256 << 20
    repeats: int = 3
    roles: tuple[str, ...] | None = None
    resume: bool = False
    engine_timeout: float = 900.0
    valkey: str = ""
    sharedfs: Path | None = None
    sharedfs_read: Path | None = None
    command: str = ""

    def check(self) -> None:
        """ValueError (one line) naming the first bad option."""
        bad_dt = [d for d in self.dtypes if d not in DTYPES]
        if bad_dt or not self.dtypes:
            raise ValueError(f"--dtypes: {','.join(bad_dt) or 'none given'}; choose from {','.join(DTYPES)}")
        if self.roles is not None:
            bad = [r for r in self.roles if r not in ROLES]
            if bad:
                raise ValueError(f"--roles: unknown {','.join(bad)}; choose from {','.join(ROLES)}")
            if not self.roles and not self.resume:
                raise ValueError("--roles: none given (an empty list only reports an earlier run: add --resume)")
            off = [r for r in self.roles if r.startswith("write-") and r[6:] not in self.dtypes]
            if off:
                raise ValueError(f"--roles {off[0]}: its dtype is not in --dtypes {','.join(self.dtypes)}")
        if QUALITY_DTYPE not in self.dtypes:
            raise ValueError(f"--dtypes must include {QUALITY_DTYPE} (the readers load its chunks)")
        checks = [(self.documents >= 1, "--documents must be >= 1"),
                  (self.max_output_tokens >= 1, "--max-output-tokens must be >= 1"),
                  (self.repeats >= 1, "--repeats must be >= 1"), (self.volume > 0, "--volume must be > 0"),
                  (self.sharedfs_read is None or self.sharedfs is not None, "--sharedfs-read needs --sharedfs")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    def run_roles(self) -> tuple[str, ...]:
        wanted = self.roles if self.roles is not None else ROLES
        return tuple(r for r in ROLES if r in wanted and (not r.startswith("write-") or r[6:] in self.dtypes))

    def prompt_spec(self) -> dict:
        return {"documents": self.documents, "doc_tokens": self.doc_tokens, "spread": self.spread,
                "seed": self.seed, "model": self.model}


@dataclass
class EncodingReport:
    command: str
    machine: dict
    model: str
    options: dict
    prompts: dict = field(default_factory=dict)
    codec: list[dict] = field(default_factory=list)
    stores: list[dict] = field(default_factory=list)
    quality: dict = field(default_factory=dict)
    seeds: dict = field(default_factory=dict)
    roles: dict = field(default_factory=dict)        # role -> "ran" | "resumed" | "failed: ..." | "missing"
    violations: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def make_prompts(opts: EncodingOptions) -> dict:
    """The run's prompts: long documents with one question each, as the model's chat token ids."""
    from kvtier.workload.longdoc import LongDocSpec, generate_longdoc
    from kvtier.workload.tokens import load_tokenizer

    tok = load_tokenizer(opts.model)
    spec = LongDocSpec(documents=opts.documents, doc_tokens=opts.doc_tokens, spread=opts.spread, questions=1,
                       interleave=1, max_prompt_length=3800, seed=opts.seed)
    _, convs = generate_longdoc(spec, tok)
    ids = [tok.render_chat(c.chat_messages(0)) for c in convs]
    return {"spec": opts.prompt_spec(), "prompts": [{"id": c.id, "doc_tokens": c.metadata["doc_tokens"], "ids": p}
                                                   for c, p in zip(convs, ids)]}


def _prompts(opts: EncodingOptions, log: Callable[[str], None]) -> tuple[Path, dict]:
    f = opts.workdir / "prompts.json"
    if f.exists():
        doc = json.loads(f.read_text())
        if doc.get("spec") != opts.prompt_spec():
            raise ValueError(f"{opts.workdir} holds prompts of other options ({doc.get('spec')}); "
                             "give the same --documents/--doc-tokens/--spread/--seed/--model, or drop --resume")
        return f, doc
    doc = make_prompts(opts)
    f.write_text(json.dumps(doc))
    lens = [len(p["ids"]) for p in doc["prompts"]]
    log(f"[encoding] {len(lens)} prompts, {min(lens)}-{max(lens)} tokens (median {statistics.median(lens):.0f})")
    return f, doc


def _engine(role: str, opts: EncodingOptions, prompts: Path, log: Callable[[str], None],
            shared: Path | None = None) -> tuple[dict | None, str | None]:
    from kvtier.bench.ttft import error_line

    out = opts.workdir / f"{role}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kvtier.bench.encoding_engine", role, "--model", opts.model, "--prompts",
           str(prompts), "--dir", str(opts.workdir), "--out", str(out), "--max-output-tokens",
           str(opts.max_output_tokens)] + (["--shared", str(shared)] if shared else [])
    log(f"[encoding] {role}: starting engine")
    t0 = time.time()
    logf = out.with_suffix(".log")
    with open(logf, "w") as lf:
        try:
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=opts.engine_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    res = json.loads(out.read_text()) if out.exists() else None
    log(f"[encoding] {role}: rc={rc} in {time.time() - t0:.0f}s")
    if rc != 0 or not (res or {}).get("complete"):
        return res, f"exit {rc}: {error_line(logf.read_text(errors='replace'))}"
    return res, None


def _seed(enc: str, opts: EncodingOptions, log: Callable[[str], None]) -> tuple[Path, dict]:
    from kvtier.bench.shared_seed import seed_shared

    shared = opts.workdir / f"shared-{enc}"
    shutil.rmtree(shared, ignore_errors=True)
    r = seed_shared(opts.workdir / f"write-{QUALITY_DTYPE}" / "ssd",
                    {"kind": "sharedfs", "path": str(shared), "create": True, "janitor": False, "encoding": enc},
                    log=log)
    return shared, {"chunks": r.chunks, "plain_bytes": r.nbytes, "seconds": round(r.seconds, 2),
                    "readable": r.readable, "refused": r.refused, "skipped": r.skipped[:5], "ok": r.ok and r.chunks > 0}


def run_encoding(opts: EncodingOptions, log: Callable[[str], None] = print) -> EncodingReport:
    """Run the roles of ``opts`` (see the module doc) and assemble the report."""
    from kvtier.bench.ttft_report import machine_description

    opts.check()
    if opts.workdir.exists() and not opts.resume:
        shutil.rmtree(opts.workdir)
    opts.workdir.mkdir(parents=True, exist_ok=True)
    prompts_file, prompts = _prompts(opts, log)
    lens = [len(p["ids"]) for p in prompts["prompts"]]
    report = EncodingReport(command=opts.command, machine=machine_description(), model=opts.model,
                            options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()
                                     if k not in ("command", "workdir")},
                            prompts={"count": len(lens), "min_tokens": min(lens), "max_tokens": max(lens),
                                     "median_tokens": statistics.median(lens), "source": "kvtier workload longdoc "
                                     "(one question per document), the model's chat template"})
    seeds_file = opts.workdir / "seeds.json"
    seeds = json.loads(seeds_file.read_text()) if seeds_file.exists() else {}
    for role in opts.run_roles():
        try:
            if role.startswith("write-") or role == "vanilla":
                _, err = _engine(role, opts, prompts_file, log)
            elif role.startswith("read-"):
                shared, seeds[role[5:]] = _seed(role[5:], opts, log)
                seeds_file.write_text(json.dumps(seeds))
                _, err = _engine(role, opts, prompts_file, log, shared) if seeds[role[5:]]["ok"] else \
                    (None, "the shared directory could not be filled")
            else:
                err = _step(role, opts, log)
        except (OSError, RuntimeError, ValueError) as e:
            err = f"{type(e).__name__}: {e}"
        report.roles[role] = f"failed: {err}" if err else "ran"
    for role in ROLES:
        if role not in report.roles:
            done = (opts.workdir / f"{role}.json").exists()
            report.roles[role] = "resumed" if done else "missing"
    report.seeds = seeds
    _assemble(report, opts)
    return report


def _step(role: str, opts: EncodingOptions, log: Callable[[str], None]) -> str | None:
    if role == "codec":
        from kvtier.bench.encoding_codec import measure_codecs

        rows = []
        for d in opts.dtypes:
            rows += [r.to_json() for r in measure_codecs(opts.workdir / f"write-{d}" / "ssd", log=log)]
        (opts.workdir / "codec.json").write_text(json.dumps(rows))
        return None
    from kvtier.bench.encoding_services import store_targets
    from kvtier.bench.encoding_stores import load_payloads, measure_stores

    payloads = [load_payloads(opts.workdir / f"write-{d}" / "ssd", opts.volume) for d in opts.dtypes]
    with store_targets(opts.workdir / "services", opts.valkey, opts.sharedfs, opts.sharedfs_read, log) as targets:
        rows = measure_stores(targets, payloads, ("plain", "zstd", "int8"), opts.repeats, log)
    (opts.workdir / "stores.json").write_text(json.dumps(rows))
    return None


def _load(opts: EncodingOptions, name: str):
    f = opts.workdir / f"{name}.json"
    return json.loads(f.read_text()) if f.exists() else None


def _assemble(report: EncodingReport, opts: EncodingOptions) -> None:
    """Figures and violations from the role files in ``workdir``."""
    from kvtier.bench.encoding_quality import Generation, agreement

    v = report.violations
    v += [f"{role}: {state}" for role, state in report.roles.items() if state.startswith("failed")]
    report.codec = _load(opts, "codec") or []
    report.stores = _load(opts, "stores") or []
    v += [f"codec {r['dtype']} {r['encoding']}: a round trip was not byte-exact" for r in report.codec
          if r["encoding"] != "int8" and r.get("exact") is False]
    v += [f"seed {k}: not every chunk reached the shared directory" for k, s in report.seeds.items() if not s.get("ok")]
    ref = _load(opts, "vanilla")
    for enc in COMPARED:
        got = _load(opts, f"read-{enc}")
        if got is None or ref is None or not got.get("complete") or not ref.get("complete"):
            continue
        v += [f"read-{enc} {x}" for x in got.get("violations", [])]
        a = agreement([Generation.from_json(o) for o in ref["outputs"]],
                      [Generation.from_json(o) for o in got["outputs"]])
        loaded = [sum(val for k, val in o.get("kvtier", {}).items()
                      if k.startswith("kvtier_connector_loaded_tokens_total")) for o in got["outputs"]]
        report.quality[enc] = {**a.to_json(), "proved_prompts": sum(not o.get("violations") for o in got["outputs"]),
                               "loaded_tokens": int(sum(loaded)), "min_loaded_tokens": int(min(loaded)),
                               "prompt_tokens": sum(o["prompt_tokens"] for o in got["outputs"])}
        if enc == "zstd" and a.identical != a.prompts:
            v.append(f"zstd (lossless) is not token-exact: {a.prompts - a.identical} of {a.prompts} prompts "
                     "differ from the float32 recompute")
