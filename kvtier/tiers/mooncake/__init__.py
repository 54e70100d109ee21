"""The Mooncake Store tier: ``MooncakeTier``.

``tier`` is the tier itself; ``client`` sets up the Mooncake store client (imported only when the
tier opens, so the package imports without the Mooncake library) and maps its error codes.
"""

from kvtier.tiers.mooncake.tier import MooncakeTier

__all__ = ["MooncakeTier"]
