"""Marking the pages a decode step's block-sparse attention reads (KV offloading): one kernel per layer.

`OffloadedKVCache.note_reads` (kvcache/offload.py) sets `wanted[layer * P + page]` (with head slots:
`wanted[(layer * P + page) * H_kv + head]`) for every page the attention of a query block reads — the sink pages, the
recent window's pages and the pages of its selected key blocks — so that
`end_step` can install the missed ones. Written with PyTorch ops it is ~25 small kernels per layer in a captured decode
step; this is one launch with the same result (docs/kernel-notes.md v10).

Grid (query blocks, groups + 1, slices): program (i, g < G, c) marks slice c (`chunk` pages, 1,024 by default) of
the pages of group g's selected blocks of block i; program (i, G, 0) marks the sink and window pages. Logical pages
past the block's last query are skipped, logical pages are clamped into the block table, and the scratch page (the
last page, where padded graph rows point) is never marked. Several programs may set the same byte: they all write 1.
Tested: the interpreter against the PyTorch path, random blocks and tables, one slice and several
(tests/test_offload.py); on an H100, every offloaded decode at 1M runs it, several slices per selection for psa
(docs/benchmarks.md).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _mark(Wanted, Tables, row, lp, ok, base, W, P, h0, U: tl.constexpr, NH: tl.constexpr):
        """Marks heads h0 .. h0 + NH - 1 of the pages at logical places lp (one entry per page with U = 1)."""
        lp = tl.minimum(tl.maximum(lp, 0), W - 1)
        phys = tl.load(Tables + row + lp, mask=ok, other=0).to(tl.int64)
        for j in tl.static_range(NH):
            tl.store(Wanted + base + phys * U + h0 + j, tl.full(phys.shape, 1, tl.uint8), mask=ok & (phys != P - 1))

    @triton.jit
    def _mark_reads_kernel(Wanted, Tables, Seq, First, Last, Blocks, stride_t, stride_bb, stride_bg,
                           base, P, W, G, K, n_window, block_k,
                           BS: tl.constexpr, PER: tl.constexpr, SINK_PAGES: tl.constexpr, SPAN: tl.constexpr,
                           BLOCK_SEL: tl.constexpr, BLOCK_FIXED: tl.constexpr, U: tl.constexpr, HPG: tl.constexpr,
                           GPH: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        c = tl.program_id(2)  # which BLOCK_SEL-slice of the selected pages (the sink and window: slice 0 only)
        row = tl.load(Seq + i).to(tl.int64) * stride_t
        first = tl.load(First + i).to(tl.int64)
        last_page = tl.load(Last + i).to(tl.int64) // BS
        if g == G and c == 0:  # sink pages, then the window's pages
            f = tl.arange(0, BLOCK_FIXED)
            _mark(Wanted, Tables, row, f, (f < SINK_PAGES) & (f <= last_page), base, W, P, 0, U, U)
            w0 = tl.maximum(first - n_window + 1, 0) // BS
            _mark(Wanted, Tables, row, w0 + f, (f < SPAN) & (w0 + f <= last_page), base, W, P, 0, U, U)
        elif g < G:
            j = c * BLOCK_SEL + tl.arange(0, BLOCK_SEL)
            inside = j < K * PER
            b = tl.load(Blocks + i * stride_bb + g * stride_bg + j // PER, mask=inside, other=-1).to(tl.int64)
            lp = (b * block_k) // BS + j % PER
            _mark(Wanted, Tables, row, lp, inside & (b >= 0) & (lp <= last_page), base, W, P, (g // GPH) * HPG, U,
                  HPG)


def mark_reads(wanted: torch.Tensor, layer: int, num_pages: int, block_tables: torch.Tensor, seq: torch.Tensor,
               first: torch.Tensor, last: torch.Tensor, max_rows: int, blocks: torch.Tensor, block_k: int,
               block_size: int, n_sink: int, n_window: int, chunk: int = 1024, units: int = 1) -> None:
    """The kernel behind `OffloadedKVCache.note_reads` (same arguments; wanted (L * P * units + 1,) bool). A program
    marks at most `chunk` selected pages (a power of two); more go to further programs on grid axis 2: one program
    per selection would make a 1M-token PSA step (65K ranked blocks) a single 131,072-wide block in one warp, whose
    compile alone takes minutes (docs/kernel-notes.md v15). `units` > 1 (head slots, one per KV head): the sink and
    window mark every head of their pages, a selection group's blocks the heads of that group."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two (pages per program), got {chunk}")
    nb = seq.shape[0]
    if nb == 0:
        return
    G, K = blocks.shape[1], blocks.shape[2]
    hpg, gph = group_heads(G, units)
    per = max(1, block_k // block_size)
    sink_pages = -(-n_sink // block_size)
    span = -(-(n_window + max_rows - 1) // block_size) + 1 if n_window > 0 else 0
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    sel = triton.next_power_of_2(max(1, K * per))
    block_sel = min(sel, chunk)
    _mark_reads_kernel[(nb, G + 1, -(-sel // block_sel))](
        wanted.view(torch.uint8), tables, seq, first, last, blocks, tables.stride(0), blocks.stride(0),
        blocks.stride(1), layer * num_pages * units, num_pages, tables.shape[1], G, K, n_window, block_k,
        BS=block_size, PER=per, SINK_PAGES=sink_pages, SPAN=span,
        BLOCK_SEL=block_sel,
        BLOCK_FIXED=triton.next_power_of_2(max(1, sink_pages, span)), U=units, HPG=hpg, GPH=gph, num_warps=1)


def group_heads(groups: int, units: int) -> tuple[int, int]:
    """(heads a selection group's block marks, groups per head) for `units` slots per page: groups of one KV head
    (groups = H_kv), of several (groups = 1: every head), or one query head each (groups = H_q, a multiple of H_kv);
    a group g marks heads (g // groups per head) * heads per group and the next heads per group - 1. Raises
    ValueError when neither divides the other."""
    if units == 1:
        return 1, groups
    if groups <= units and units % groups == 0:
        return units // groups, 1
    if groups % units == 0:
        return 1, groups // units
    raise ValueError(f"{groups} selection groups cannot be mapped onto {units} KV heads")
