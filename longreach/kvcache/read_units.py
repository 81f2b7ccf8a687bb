"""Which units of the offloaded store a decode step reads: flat indices into its page table.

A *unit* is what one GPU slot holds (kvcache/offload.py): a page of every KV head (`units` U = 1, index
layer * P + page) or one KV head's page (U = H_kv, index (layer * P + page) * U + head). Both functions here are
device ops of a width fixed by their inputs' shapes, with no host sync (a captured decode step runs them), and write
`trash` (= L * P * U, the entry past the table's end) where a place reads no unit: a -1 block, a page past the row's
last position, or the scratch page P - 1 of padded graph rows.

  * `attended_units`: what block-sparse attention read (sink, window and selected blocks of each query block): the
    PyTorch path of `OffloadedKVCache.note_reads` (kernels/page_reads.py's `mark_reads` is its GPU kernel, tested
    against it). The sink and window mark every head; a selection group's blocks mark that group's heads.
  * `probe_units`: the head-pages of a selection stage's candidate chunks (`PageReads.probe`), ascending, each once,
    for `OffloadedKVCache.install_reads`.
"""
from __future__ import annotations

import torch

from ..kernels.page_reads import group_heads
from .base import PageReads


def attended_units(num_pages: int, units: int, layer: int, trash: int, tables: torch.Tensor, seq: torch.Tensor,
                   first: torch.Tensor, last: torch.Tensor, max_rows: int, blocks: torch.Tensor, block_k: int,
                   block_size: int, n_sink: int, n_window: int) -> torch.Tensor:
    """Units read by `layer`'s block-sparse attention, (nb, places) or (nb, places, U), `trash` where none.

    Per query block: seq (nb,) its row of `tables` (B, W), on the device; first / last (nb,) the positions of its
    first and last query (last - first < max_rows); blocks (nb, G, K) the selected key blocks of block_k tokens (-1
    padded). The block also reads keys [0, n_sink) and its window [first - n_window + 1, last]."""
    dev, bs, U, P = tables.device, block_size, units, num_pages
    nb = seq.shape[0]
    seq, first, last = seq.long().to(dev), first.long().to(dev), last.long().to(dev)
    last_page = last // bs
    sink = torch.arange(-(-n_sink // bs), device=dev).expand(nb, -1)
    parts, oks = [sink], [sink <= last_page[:, None]]
    if n_window > 0:
        span = torch.arange(-(-(n_window + max_rows - 1) // bs) + 1, device=dev)
        win = (torch.clamp(first - n_window + 1, min=0) // bs)[:, None] + span
        parts.append(win)
        oks.append(win <= last_page[:, None])
    per = max(1, block_k // bs)  # pages per key block (block_k and bs are powers of two)
    G = blocks.shape[1]
    hpg, gph = group_heads(G, U)
    b = blocks.long().to(dev).reshape(nb, -1)
    sel = ((b * block_k) // bs)[:, :, None] + torch.arange(per, device=dev)
    n_fixed = sum(x.shape[1] for x in parts)
    parts.append(sel.reshape(nb, -1))
    oks.append(((b >= 0)[:, :, None] & (sel <= last_page[:, None, None])).reshape(nb, -1))
    ok = torch.cat(oks, dim=1)
    logical = torch.cat(parts, dim=1).clamp(0, tables.shape[1] - 1)
    phys = tables[seq[:, None], logical].long()
    ok = ok & (phys != P - 1)  # the last page is the scratch page of padded graph rows
    if U == 1:
        return torch.where(ok, layer * P + phys, trash)
    # the sink and window: every head; a group's blocks: its heads (kernels/page_reads.py, group_heads)
    g = torch.arange(G, device=dev).repeat_interleave(blocks.shape[2] * per)
    first_head = torch.cat([torch.zeros(n_fixed, dtype=torch.long, device=dev), (g // gph) * hpg])
    count = torch.cat([torch.full((n_fixed,), U, device=dev), torch.full((g.numel(),), hpg, device=dev)])
    j = torch.arange(U, device=dev)
    head = first_head[:, None] + j  # (places, U): the heads each place marks, the first `count`
    use = ok[:, :, None] & (j < count[:, None])[None]
    unit = (layer * P + phys)[:, :, None] * U + head[None].clamp(max=U - 1)
    return torch.where(use, unit, trash)


def probe_units(num_pages: int, units: int, block_size: int, trash: int, reads: PageReads,
                device: torch.device) -> torch.Tensor:
    """The head-page units of a stage's candidate chunks (`reads.blocks` (nb, G, C) of `block_k` tokens, each
    group's heads: kernels/page_reads.py's `group_heads`), ascending, each once, `trash` for the rest (E,)."""
    bs, P, U = block_size, num_pages, units
    b = reads.blocks.long().to(device)
    G = b.shape[1]
    per = max(1, reads.block_k // bs)
    logical = ((b * reads.block_k) // bs)[..., None] + torch.arange(per, device=device)  # (nb, G, C, per)
    tables = reads.block_tables.to(device)
    seq, last = reads.seq.long().to(device), reads.last.long().to(device)
    ok = (b >= 0)[..., None] & (logical <= (last // bs)[:, None, None, None])
    phys = tables[seq[:, None, None, None], logical.clamp(0, tables.shape[1] - 1)].long()
    ok = ok & (phys != P - 1)
    hpg, gph = group_heads(G, U)
    head = ((torch.arange(G, device=device) // gph) * hpg)[:, None] + torch.arange(hpg, device=device)  # (G, hpg)
    unit = (reads.layer * P + phys)[..., None] * U + head[None, :, None, None, :]
    unit = torch.where(ok[..., None], unit, trash).reshape(-1).sort().values
    return torch.where(torch.cat([unit[:1] < trash, unit[1:] != unit[:-1]]), unit, trash)
