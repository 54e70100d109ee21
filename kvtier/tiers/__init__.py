"""Storage tiers behind one interface (base.Tier): memory (RAM slab), disk (local SSD dir)."""

from kvtier.tiers.base import Tier, TierUsage

__all__ = ["Tier", "TierUsage"]
