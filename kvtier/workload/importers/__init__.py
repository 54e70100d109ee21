"""Importers: public datasets and traces -> kvtier workload conversations.

* ``chat``      — ShareGPT and vLLM multi-turn benchmark JSON (chat messages)
* ``mooncake``  — Mooncake FAST'25 traces (hash-id blocks -> token ids)
* ``evalscope`` — evalscope's local perf datasets (openqa JSONL, longalpaca JSON)
"""

from kvtier.workload.importers.chat import ChatImportOptions, import_chat_file
from kvtier.workload.importers.evalscope import EvalscopeOptions, import_evalscope
from kvtier.workload.importers.mooncake import MooncakeOptions, import_mooncake

__all__ = ["ChatImportOptions", "EvalscopeOptions", "MooncakeOptions", "import_chat_file", "import_evalscope",
           "import_mooncake"]
