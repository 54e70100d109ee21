"""Which paged KV layouts kvtier serves, and the name of a chunk payload's layout (no torch).

vLLM 0.32 hands every attention backend per-layer views ``[num_blocks, H, N, C]`` (H heads, N tokens
of a block, C content: K and V side by side, or an MLA latent) whose memory order comes from a
``KVCacheLayout``: a permutation of the logical ``[L, B, H, N, C]`` axes (``vllm/v1/kv_cache_layout.py``).
kvtier copies whole *pages* (one block of one layer) as one dense run of bytes, so it serves the
block-compact layouts, where ``L`` and ``B`` are the two outermost axes: ``LBHNC`` (what the connector
asks for, the CPU backend's own), ``LBNHC`` (CUDA's default), ``BLHNC`` and ``BLNHC``. ``LHBNC`` and
``BHLNC`` interleave a page with other blocks or layers and are refused at start.

A chunk payload holds, for every layer in order, the chunk's pages in the engine's page order:
``[num_layers, blocks_per_chunk, *page]``, named ``lb`` + the page's axis order (``lbhnc``,
``lbnhc``). That name goes into the cache namespace: a payload is never read under another order.
"""

from __future__ import annotations

from dataclasses import dataclass

#: vLLM's ``KVCacheLayout`` members: logical axes [L, B, H, N, C] (0..4) in memory order
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}    # vLLM's legacy names
#: what the connector asks vLLM for (``get_required_kvcache_layout``), as vLLM's OffloadingConnector does
REQUIRED_LAYOUT = "LBHNC"
_AXIS = "lbhnc"


class LayoutError(ValueError):
    """The engine's KV cache cannot be served by kvtier (one-line reason)."""


@dataclass(frozen=True)
class PageLayout:
    """The order of a page's axes in memory, as letters of ``h``, ``n``, ``c`` (``("h", "n", "c")``)."""

    page_order: tuple[str, ...]

    @property
    def name(self) -> str:
        """The payload layout's name in the namespace (``lbhnc``)."""
        return "lb" + "".join(self.page_order)

    @classmethod
    def parse(cls, name: str) -> "PageLayout":
        """The inverse of ``name``; raises LayoutError on anything else."""
        order = tuple(name[2:])
        if not name.startswith("lb") or sorted(order) != ["c", "h", "n"]:
            raise LayoutError(f"unknown payload layout {name!r}; expected lb + an order of h, n, c (e.g. lbhnc)")
        return cls(order)


def vllm_layout(name: str) -> tuple[int, ...]:
    """The stride order of one of vLLM's layout names (aliases accepted); LayoutError when unknown."""
    key = ALIASES.get(name.upper(), name.upper())
    if key not in VLLM_LAYOUTS:
        raise LayoutError(f"unknown vLLM KV cache layout {name!r}; known: {', '.join(VLLM_LAYOUTS)}")
    return VLLM_LAYOUTS[key]


def page_layout_of(name: str) -> PageLayout:
    """The payload layout for vLLM's resolved layout ``name``; LayoutError when kvtier cannot serve it."""
    order = vllm_layout(name)
    if set(order[:2]) != {0, 1}:
        raise LayoutError(
            f"vLLM's KV cache layout {name} does not keep a block of one layer in one dense page; kvtier "
            f"serves LBHNC, LBNHC, BLHNC and BLNHC: unset VLLM_KV_CACHE_LAYOUT (kvtier asks for {REQUIRED_LAYOUT})")
    return PageLayout(tuple(_AXIS[i] for i in order[2:]))


LBHNC = page_layout_of("LBHNC")
