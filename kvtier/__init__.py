"""kvtier: a tiered KV-cache layer for LLM serving (RAM -> local SSD -> shared store).

The core (keys, chunk format, tiers, store, workload tools, bench client) imports
without torch or vLLM; ``kvtier.integrations.vllm`` needs the ``vllm`` extra.
"""

__version__ = "0.1.0"
FORMAT_VERSION = 1

__all__ = ["__version__", "FORMAT_VERSION"]
