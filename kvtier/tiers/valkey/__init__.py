"""The Valkey / Redis tier (standalone or cluster): ``ValkeyTier``.

``tier`` is the tier itself; ``conn`` holds the lookup/io clients and routing, ``wire`` packs
the RESP writes. The ``valkey`` client library is optional: without it the package still
imports, and opening the tier raises a one-line ``ConfigError``.
"""

from kvtier.tiers.valkey.tier import ValkeyTier

__all__ = ["ValkeyTier"]
