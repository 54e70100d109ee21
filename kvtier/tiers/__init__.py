"""Storage tiers behind one interface (``base.Tier``): ``memory`` (RAM slab), ``disk`` (local SSD
directory), and the shared backends as subpackages: ``sharedfs``, ``valkey``, ``mooncake``
(imported only when configured, ``registry``)."""

from kvtier.tiers.base import Tier, TierUsage

__all__ = ["Tier", "TierUsage"]
