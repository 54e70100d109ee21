"""What the Valkey tier asks the servers about themselves: their limits and eviction policy (once,
at open) and their memory use (sampled during writes). One pipeline per node on the lookup
client; errors propagate to the caller, which decides what they mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.tiers.base import TierUsage
from kvtier.tiers.valkey.conn import Connections


@dataclass
class ServerLimits:
    """Per node: ``proto-max-bulk-len`` (where CONFIG answered), ``maxmemory-policy``, ``maxmemory``."""

    max_bulk: list[int] = field(default_factory=list)
    policies: set[str] = field(default_factory=set)
    maxmemory: list[int] = field(default_factory=list)

    def will_not_evict(self) -> bool:
        """A server with ``noeviction`` or without ``maxmemory`` never evicts chunks."""
        return bool(self.policies & {"noeviction"} or (self.maxmemory and min(self.maxmemory) == 0))


def read_limits(conns: Connections) -> ServerLimits:
    """Every node's limits (CONFIG GET; a node that refuses CONFIG adds nothing)."""
    out = ServerLimits()
    for node in conns.all_nodes("lookup"):
        pipe = node.pipeline(transaction=False)
        pipe.config_get("proto-max-bulk-len")
        pipe.config_get("maxmemory*")
        bulk, mem = pipe.execute(raise_on_error=False)
        if isinstance(bulk, dict) and "proto-max-bulk-len" in bulk:
            out.max_bulk.append(int(bulk["proto-max-bulk-len"]))
        if isinstance(mem, dict):
            out.policies.add(mem.get("maxmemory-policy", "?"))
            out.maxmemory.append(int(mem.get("maxmemory", 0) or 0))
    return out


def read_usage(conns: Connections) -> TierUsage:
    """The nodes' ``used_memory``, ``maxmemory`` (at least what is used) and key count, summed."""
    used = cap = count = 0
    for node in conns.all_nodes("lookup"):
        pipe = node.pipeline(transaction=False)
        pipe.info("memory")
        pipe.dbsize()
        info, size = pipe.execute()
        used += int(info.get("used_memory", 0))
        cap += int(info.get("maxmemory", 0))
        count += int(size)
    return TierUsage(used, max(cap, used), count)
