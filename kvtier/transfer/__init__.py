"""Moving KV blocks between an engine's paged caches and host chunk buffers, on any device.

Torch only (no vLLM import), so ``kvtier doctor --gpu`` runs on a GPU machine without vLLM and the
CPU test suite runs the code a GPU runs:

- ``page_layout``  which of vLLM's ``KVCacheLayout`` s kvtier serves, and the payload layout's name
- ``views``        derive the block axis, the page order and the page size from the views vLLM registers
- ``streams``      the stream/event interface: ``NoStreams`` (CPU: every operation immediate), ``CudaStreams``
- ``host_buffers`` chunk buffers in host memory (pinned for a device), each with the event of its last copy
- ``blocks``       ``BlockCopier``: gather blocks into a chunk and scatter a chunk into blocks, ordered
"""
