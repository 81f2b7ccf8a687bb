"""PSA: Progressive Sparse Attention (Zhou, Zuo, Yin, Cheng; digest §5) as `--attention psa [--preset EPSILON]`.

A decode-time method whose budget is a threshold on attended attention mass instead of a top-k: per decode query and
KV group, rank the context's blocks by a metadata score, attend to them in rank order in micro-batches of m blocks,
and stop once the estimated attended share P_acc = AS_acc / (AS_acc + AS_min * N_left) reaches epsilon (Alg. 1;
kernels/psa_waves.py has the default decode kernel, ranked blocks read in parallel waves, kernels/psa_decode.py the
loop kernel and the reference; the metadata are key boxes by page id, kernels/key_boxes.py, kept in
attention/box_store.py's PageBoxes as Quest's are). The number of keys read therefore varies per query, layer and KV
head, which is the method's point; `longreach eval recall` reports its distribution.

Decisions on what the paper leaves open (digest §5.3, §8.9; docs/sparse.md has the reasons at length):
  * GQA / heads: one ranking and one loop per (sequence, KV head). A block's score is the max over the group's query
    heads of the metadata score; AS_acc, AS_min and P_acc are kept per query head, and the group stops when every
    one of its heads has P_acc >= epsilon. Each K/V block is loaded once for the whole group (the kernels' rule), and
    no head of the group stops short of epsilon by its own estimate.
  * Blocks: a block is one KV page (`--block-size`; the paper's analysis uses 32, vLLM's default is 16). Metadata is
    per page, so it lives beside the page pool (pages x layers on the GPU, `page_state_bytes`).
  * Metadata: cuboid-mean by default (ArkVale's box: centre (max + min) / 2, radius the keys' mean |k - centre|),
    score q.c + |q|.r; `metadata: "minmax"` gives Quest's upper bound in the same form.
  * AS_min is the smallest *block* mass seen (Alg. 1's m = 1 rule kept for m > 1), N_left counts blocks, and the
    comparison is "P_acc >= epsilon" (the text's "exceeds" or "equals"): epsilon = 1 reads every block (== dense).
  * Always read, outside the ranking: the sink (n_sink tokens, rounded up to whole blocks) and the tail (the last
    n_window tokens extended down to a block boundary, so the partial last page is in it). Their mass counts in
    AS_acc, not in AS_min or N_left: they are read first, before any ranked block. The paper has neither; a few
    sink tokens hold much of the mass in the models measured here (docs/sparse.md).
  * Metadata is built at decode: every decode step first builds the blocks completed since the sequence's last step
    (after a prefill, the whole prompt: one read of its keys), so it does not matter which backend prefilled
    (dense, or any method through `--decode-attention psa`) nor whether the prefill ran on the offloaded staging
    area. Candidate blocks end before the tail, so they are complete before the step's own token is written.
  * Numerics: log-sum-exp throughout (base 2 in the kernel); the stop test is
    log N_left + lse_min - lse_acc <= log((1 - eps) / eps).
  * Prefill is dense (the paper's: prefill unchanged); compose a sparse prefill with `--attention M
    --decode-attention psa`. RoPE positions stay true by default (PSA targets long-context models); see `rope`.
  * Ranking ties go to the lower block id (a stable sort).
  * Positions past the trained length (`rope: rank`; an extension, not the paper's: PSA keeps true positions, and
    past a model's trained length its attention is out of distribution and diffuse, docs/sparse.md). Rows at or
    past rope_from (default: the trained length) attend at rank-order positions: the tail at true distances, the
    ranked block of rank i just before the tail (i + 1 blocks back), clamped nearer than the sink, and the sink
    rope_from - 1 - s back, so every key lies within the trained distance and each block's move is known when the
    kernel reads it (the stop rule's masses and the output use the same positions). Ranking uses boxes of the keys
    moved to position 0 and each query moved to rank 0's distance (every row, so the metadata is built once per
    block). On SmolLM2 past its 8K it answers passkey as infinitehip does to 64K (H100, docs/sparse.md).
Device side (CUDA): metadata build, scoring, sort, the decode kernel and the offloaded store's read report are all
device ops with static shapes, so the decode step is captured in CUDA graphs: variants per context bucket, plus a
"catch-up" variant for steps in which a sequence has more than one block to build (its first decode step). Tested
on CPU through the runner's emulated graph path, and captured through the engine on an H100 (docs/benchmarks.md).
The stop test runs on the device, inside the decode kernels, not in a verifying kernel that signals the host (the
paper's): no host round trip per micro-batch. `decode_kernel: waves` (default) reads a wave of micro-batches in
parallel and merges them in rank order; `loop` walks them in one program per (row, KV head), which is as fast when a
query stops early and 17-20x slower when it reads most blocks (H100, docs/kernel-notes.md v13).
"""
from __future__ import annotations

import torch

from ...kernels.key_boxes import build_page_boxes_reference, page_box_scores_reference, page_box_scores_triton
from ...kernels.psa_decode import psa_decode_reference, psa_decode_triton
from ...kernels.psa_waves import psa_decode_waves
from ...rope.strategies import RopeFrame, rotate
from ..index import QueryBlocks, SparseIndex
from .config import DEFAULT_PRESET, PRESETS, PSAConfig

KERNELS = {"loop": psa_decode_triton, "waves": psa_decode_waves}  # config.DECODE_KERNELS: same results


class PSA:
    """The method apart from the engine: candidates, ranking, the progressive loop, what was read (the backend and
    `longreach eval recall` use it)."""

    name = "psa"
    config_cls = PSAConfig
    presets = PRESETS
    default_preset = DEFAULT_PRESET

    def __init__(self, cfg: PSAConfig, num_heads: int, num_kv_heads: int):
        self.cfg, self.num_heads, self.num_kv_heads = cfg, num_heads, num_kv_heads
        self.groups = num_kv_heads  # one ranking and one loop per KV head (module docstring)
        self.rope_frame: RopeFrame | None = None  # set by the backend (the model's frequencies); None: true positions

    def rope(self) -> tuple[torch.Tensor, int] | None:
        """(inv_freq, rope_from) when `rope: rank` applies (a backend gave the model's frame), else None."""
        f = self.rope_frame
        if self.cfg.rope != "rank" or f is None:
            return None
        return f.inv_freq, f.rope_from

    def sink_blocks(self, page: int) -> int:
        """Blocks of the sink: n_sink tokens rounded up to whole blocks."""
        return -(-self.cfg.n_sink // page)

    def candidates(self, seq_lens: torch.Tensor, page: int) -> tuple[int, torch.Tensor]:
        """(cand_lo, cand_hi (n,) int32): row r ranks blocks [cand_lo, cand_hi[r]); everything else up to its
        position is read always (sink below, tail above)."""
        lo = self.sink_blocks(page)
        hi = torch.div((seq_lens.long() - self.cfg.n_window).clamp(min=0), page, rounding_mode="floor")
        return lo, hi.clamp(min=lo).to(torch.int32)

    def tail_blocks(self, page: int) -> int:
        """Most blocks a row's tail spans: the last n_window keys plus the rest of the block they start in."""
        return (self.cfg.n_window - 1) // page + 2

    def attend(self, q, k_cache, v_cache, block_tables, seq_lens, meta, width: int, scale: float, kernels: bool):
        """One decode query per row: rank the row's blocks [0, width) and run the progressive loop.
        Returns out (n, H_q, D), counts (n, H_kv) blocks read, ranked (n, H_kv, width) int32 and cand_hi (n,)."""
        page = k_cache.shape[1]
        cand_lo, cand_hi = self.candidates(seq_lens, page)
        rope = self.rope()
        qs = q
        if rope is not None:  # moved metadata (keys at position 0): the query at rank 0's distance, page - T0 away
            qs = rotate(q, page - cand_hi.long()[:, None] * page, rope[0]).to(q.dtype)
        score = (page_box_scores_triton if kernels else page_box_scores_reference)(qs, meta, block_tables, cand_lo,
                                                                                  cand_hi, width)
        ranked = score.sort(dim=-1, descending=True, stable=True).indices.to(torch.int32)
        run = KERNELS[self.cfg.decode_kernel] if kernels else psa_decode_reference
        out, _, counts = run(q, k_cache, v_cache, block_tables, seq_lens, ranked, cand_lo, cand_hi,
                             self.cfg.epsilon, self.cfg.microbatch, scale, rope=rope)
        return out, counts, ranked, cand_hi

    def read_blocks(self, ranked: torch.Tensor, counts: torch.Tensor, cand_hi: torch.Tensor, seq_lens: torch.Tensor,
                    page: int) -> torch.Tensor:
        """Blocks each (row, group) read besides the sink, (n, H_kv, W + tail) int32, -1 padded, unordered: the
        ranked blocks it attended and its tail blocks. No host sync (what an offloaded store learns the step read: `PageReads`)."""
        n, G, W = ranked.shape
        sel = torch.where(torch.arange(W, device=ranked.device) < counts[..., None], ranked, -1)
        last = (seq_lens.long() - 1) // page
        tail = cand_hi.long()[:, None] + torch.arange(self.tail_blocks(page), device=ranked.device)
        tail = torch.where(tail <= last[:, None], tail, -1).to(torch.int32)
        return torch.cat([sel, tail[:, None, :].expand(n, G, -1)], dim=2)

    def keys_read(self, counts: torch.Tensor, cand_hi: torch.Tensor, seq_lens: torch.Tensor, page: int) -> torch.Tensor:
        """(n,) keys each row read, summed over its KV groups: the ranked blocks it attended (whole pages), plus the
        sink and the tail, which every group reads (a row shorter than the sink reads its seq_len keys)."""
        lens = seq_lens.long()
        sink = torch.clamp(lens, max=self.sink_blocks(page) * page)
        tail = (lens - cand_hi.long() * page).clamp(min=0)
        return counts.long().sum(-1) * page + counts.shape[-1] * (sink + tail)

    def read_index(self, ranked, counts, cand_hi, seq_lens, page: int) -> SparseIndex:
        """What the rows read as a `SparseIndex` (one query block of one row per sequence, sink as n_sink, the tail
        among the listed blocks, n_window 0): block_sparse_attention over it equals the PSA output (tested)."""
        blocks = self.read_blocks(ranked, counts, cand_hi, seq_lens, page)
        big = torch.iinfo(torch.int32).max
        blocks = torch.where(blocks >= 0, blocks, big).sort(dim=-1).values
        blocks = torch.where(blocks == big, -1, blocks)
        n = ranked.shape[0]
        pos = (seq_lens.long() - 1).tolist()
        qb = QueryBlocks(list(range(n)), list(range(n)), [1] * n, pos)
        counts = (blocks >= 0).sum(-1).to(torch.int32)
        return SparseIndex(1, page, self.sink_blocks(page) * page, 0, self.groups, qb, blocks, counts)

    def selection_mask(self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(R, H_q, L) keys read by each evaluated row, each row run as a decode query at its position (eval recall):
        q (R, H_q, D) of the rows at `positions`, k (L, H_kv, D) every key. Block size: the config's, else 16."""
        page = self.cfg.block_size or 16
        R, (L, Hkv, D) = positions.numel(), k.shape
        n_pages = -(-L // page)
        cache = torch.nn.functional.pad(k.float(), (0, 0, 0, 0, 0, n_pages * page - L)).view(n_pages, page, Hkv, D)
        tables = torch.arange(n_pages, dtype=torch.int32)[None].expand(R, n_pages).contiguous()
        meta = torch.zeros(n_pages, 2, Hkv, D)
        rope = self.rope()
        build_page_boxes_reference(cache, tables[:1], torch.zeros(1, dtype=torch.int32),
                                   torch.tensor([L // page], dtype=torch.int32), meta, self.cfg.metadata,
                                   None if rope is None else rope[0])
        seq_lens = (positions + 1).to(torch.int32)
        scale = D ** -0.5  # the model's softmax scale (AttentionBackend.scale): the stop rule depends on it
        _, counts, ranked, cand_hi = self.attend(q.float(), cache, cache, tables, seq_lens, meta, n_pages, scale,
                                                 False)
        blocks = self.read_blocks(ranked, counts, cand_hi, seq_lens, page).long()  # (R, G, W')
        per_group = torch.zeros(R, Hkv, n_pages + 1, dtype=torch.bool)
        per_group.scatter_(2, torch.where(blocks >= 0, blocks, n_pages), True)
        tokens = per_group[..., :n_pages].repeat_interleave(page, dim=2)[..., :L]  # (R, G, L)
        j = torch.arange(L)
        sink = j[None, :] < self.sink_blocks(page) * page
        mask = (tokens | sink[:, None, :]) & (j[None, None, :] <= positions[:, None, None])
        return mask.repeat_interleave(self.num_heads // Hkv, dim=1)
