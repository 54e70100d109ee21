"""The shared-filesystem tier (JuiceFS, NFS, CephFS, Lustre): ``SharedFsTier``.

``tier`` is the tier itself; ``layout`` names the files, ``io`` reads and writes them under a
deadline, ``writer`` is the background publish queue, ``janitor`` evicts under one lease.
"""

from kvtier.tiers.sharedfs.tier import SharedFsTier

__all__ = ["SharedFsTier"]
