"""Dense attention: every query attends to every earlier key.

Prefill: PyTorch SDPA per sequence (cuDNN first on GPU, then flash / mem-efficient; the math kernel on CPU). A chunk
with a cached prefix gathers the prefix from the paged cache and uses a bottom-right-aligned causal mask. What every
layer of a step shares is built once, at its first layer, and kept on the step's metadata (`SdpaPlan`,
`AttentionMetadata.step_cache`): the pages of every prefixed chunk as one index (a layer gathers them for all chunks
in one gather per K and V), each chunk's rows and key span, its bottom-right mask (torch's `CausalBias` on CUDA,
which runs the flash kernel's own bottom-right causal mode; a boolean tensor on CPU) and whether SDPA reads the KV
heads per GQA group itself (`enable_gqa`; on CUDA only where the flash kernel takes the chunk, else K/V are expanded
over the group as before). The later layers repeat none of it: a layer's own work is two gathers and an SDPA call per
chunk, with no host-to-device copy and no host sync.
With `--dense-prefill paged` chunks with a prefix are read in place instead, by the block-sparse kernel with every
causal key block selected (`prefix_index`; kernels/bsa.py on CUDA, its PyTorch reference elsewhere), GQA-native, all
of them in one launch; measured slower than the SDPA path (docs/design-mixed-graphs.md), so not the default.
Decode: the Triton paged flash-decoding kernel on CUDA (CUDA-graph capturable), its PyTorch reference on CPU.

Sliding-window layers (Gemma 3's local layers, `ModelConfig.window_of`): a query at position p sees the keys at
positions p - window < k <= p (the window counts the current token, as transformers' mask does). Their keys sit in a
ring of `window` rows per sequence (kvcache/window.py), not in pages. Prefill reads the window before a chunk from the
ring (the chunk's own keys directly: the runner stores them after) and runs SDPA under a banded mask; decode is the
paged decode kernel over the sequence's ring (fixed shapes: CUDA-graph capturable).

`DenseFallback` is the sparse methods' shared rule for when they attend densely instead (always-dense layers, short
contexts) and the dense backend that then runs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..kernels import use_triton
from ..kernels.combine import sm_count, split_count
from ..kernels.fp8 import as_bytes, values
from ..kernels.paged_decode import default_num_splits, paged_decode, paged_decode_reference
from .backend import AttentionBackend, AttentionMetadata, Capabilities, GraphSupport
from .executor import block_sparse_attention
from .index import QueryBlocks, SparseIndex

PREFIX_BLOCK = 64  # query rows per query block and keys per key block of the paged prefill's index
KEYS_PER_SPLIT = 2048  # the paged prefill's split-K reads at least this many keys of the longest sequence per split


def _sdpa_context(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H_q, D) are the last n positions of a sequence whose keys are k, v (L, H_kv, D), L >= n -> (n, H_q, D)."""
    mask = None if q.shape[0] == k.shape[0] else bottom_right_mask(q.shape[0], k.shape[0], q.device)
    with _sdpa_context(q.device):
        return _attend(q, k, v, scale, mask, gqa=mask is None or _native_gqa(q, k, v))



WINDOW_BLOCK_MIN = 256  # query rows per block of a blocked sliding-window prefill, at least (and at least the window)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                     k_start: int = 0) -> torch.Tensor:
    """`causal_attention` within a sliding window: the query at position p (q's rows are the last n positions) attends
    to keys p - window < k <= p only; k, v (L, H_kv, D) begin at position `k_start` (the keys before it being out of
    every query's window). SDPA under a banded boolean mask (K/V expanded over the GQA group on CUDA, where the
    kernels that take a mask have no GQA path); a chunk of more than two blocks (`WINDOW_BLOCK_MIN`, or the window)
    runs block by block in one batched call (`_window_blocks`), so its cost grows with n x (block + window), not
    n x (n + window)."""
    n, L = q.shape[0], k.shape[0]
    block = max(window, WINDOW_BLOCK_MIN)
    if n > 2 * block:
        return _window_blocks(q, k, v, scale, window, block)
    qpos = torch.arange(k_start + L - n, k_start + L, device=q.device)[:, None]
    kpos = torch.arange(k_start, k_start + L, device=q.device)[None, :]
    band = (kpos <= qpos) & (kpos > qpos - window)  # (n, L)
    with _sdpa_context(q.device):
        return _attend(q, k, v, scale, band, gqa=q.device.type != "cuda")

def _window_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int,
                   block: int) -> torch.Tensor:
    """`window_attention` in query blocks of `block` rows, each against its own block + window - 1 keys, as one SDPA
    call whose batch is the blocks. The keys are laid out from the window start of the first query (position p0 -
    window + 1, p0 the first query's): keys before `k_start` there are zero padding (masked), keys before the window
    start are dropped, and the end is padded to whole blocks; block b's keys are rows b*block .. b*block + block +
    window - 2 of that layout (an `unfold` view; up to 15 more, masked, so that the mask's rows are whole multiples of
    16 keys, as the mem-efficient kernel reads them), and its query i sees its keys i .. i + window - 1: a band of
    exactly `window` keys, the same in every block, less the front padding in the first."""
    n, L, Hq, D = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
    lead = (window - 1) - (L - n)  # layout rows before the first key present (< 0: keys to drop)
    front, nb = max(0, lead), -(-n // block)
    span = -(-(block + window - 1) // 16) * 16  # a block's keys, rounded up (masked) to whole 16-key rows of the mask
    total = (nb - 1) * block + span

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (L, H, D) -> (nb, H, span, D)
        x = x[max(0, -lead):]
        x = F.pad(x, (0, 0, 0, 0, front, total - front - x.shape[0]))
        return x.unfold(0, span, block).permute(0, 1, 3, 2)

    kb, vb = blocks(k), blocks(v)
    g = Hq // k.shape[1]
    gqa = q.device.type != "cuda"  # as window_attention: the masked kernels on CUDA have no GQA path
    if g > 1 and not gqa:
        kb, vb = kb.repeat_interleave(g, dim=1), vb.repeat_interleave(g, dim=1)
    qb = F.pad(q, (0, 0, 0, 0, 0, nb * block - n)).view(nb, block, Hq, D).transpose(1, 2)  # (nb, H_q, block, D)
    i = torch.arange(block, device=q.device)[:, None]
    j = torch.arange(span, device=q.device)[None, :]
    band = (j >= i) & (j <= i + window - 1)  # (block, span)
    valid = torch.arange(nb, device=q.device)[:, None] * block + j >= front  # (nb, span): not front padding
    mask = (band[None] & valid[:, None, :]).unsqueeze(1)  # (nb, 1, block, span)
    with _sdpa_context(q.device):
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=g > 1 and gqa)
    return out.transpose(1, 2).reshape(nb * block, Hq, D)[:n]


def bottom_right_mask(n: int, length: int, device):
    """The causal mask of the last n of `length` positions (query row i sees keys 0 .. length - n + i), as SDPA takes
    it: on CUDA torch's `CausalBias` (its dispatch runs the flash kernel's bottom-right causal mode, or the
    mem-efficient kernel's, without materialising it), elsewhere a boolean (n, length) tensor (what that dispatch
    would materialise for the CPU kernels at every call)."""
    device = torch.device(device)
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, length)
    return torch.ones(n, length, dtype=torch.bool, device=device).tril(length - n)


def _native_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """May a bottom-right-masked SDPA of q (n, H_q, D) over k, v (·, H_kv, D) read the KV heads per GQA group itself
    (`enable_gqa`)? Off CUDA, yes (the math and CPU kernels take any group). On CUDA, where torch's flash kernel
    takes it (`_flash_takes`): `CausalBias` dispatches to flash (GQA-native), else straight to the mem-efficient
    kernel's op, which it does not hand `enable_gqa`, so K/V are expanded over the group there (fp32, head dims
    flash lacks)."""
    return q.shape[1] == k.shape[1] or q.device.type != "cuda" or _flash_takes(q, k, v)


def _flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Does torch's flash kernel take q (n, H_q, D), k, v (·, H_kv, D) as SDPA inputs with `enable_gqa` and no mask
    (the check `CausalBias`'s dispatch makes)? False off CUDA."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    params = SDPAParams(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), None, 0.0, False, True)
    return can_use_flash_attention(params)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask, gqa: bool) -> torch.Tensor:
    """`causal_attention` with its mask given (None: n == L, SDPA's own causal mode) and its GQA decision made, in
    the caller's `_sdpa_context`."""
    g = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # (1, H_q, n, D)
    kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # (1, H_kv, L, D), views
    if g > 1 and not gqa:  # (1, H_q, L, D): K/V expanded over the GQA group (a copy)
        kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=g > 1)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=g > 1 and gqa)
    return out.squeeze(0).transpose(0, 1)


@dataclass
class SdpaPlan:
    """A prefill step's SDPA work, the same in every layer: built at the step's first layer (`DenseBackend._prefill`),
    kept on its metadata (`step_cache`), read by the others."""

    # per sequence: (its rows of q, the first row of its keys in the layer's gathered prefix or -1 for a chunk
    # without a prefix (its keys are the step's own rows), its key count L, its mask: None where n == L)
    chunks: list[tuple[slice, int, int, object]]
    # (P,) int64: the pages holding every prefixed chunk's keys, chunk after chunk; None: no chunk has a prefix
    pages: torch.Tensor | None
    gqa: bool  # prefixed chunks: SDPA reads the KV heads per GQA group itself (`_native_gqa`)
    square: bool  # some chunk has no prefix (SDPA's own causal mode: the cuDNN-first kernel order applies)

    KEY = "dense.sdpa"  # its key in `AttentionMetadata.step_cache`

    @classmethod
    def build(cls, meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int
              ) -> "SdpaPlan":
        chunks, pages, start, first = [], [], 0, 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            rows = slice(start, start + n)
            start += n
            if ctx == 0:
                chunks.append((rows, -1, n, None))
                continue
            length, num_pages = ctx + n, -(-(ctx + n) // block_size)
            chunks.append((rows, first, length, bottom_right_mask(n, length, q.device)))
            pages.append(meta.block_tables[i, :num_pages])
            first += num_pages * block_size
        index = (pages[0] if len(pages) == 1 else torch.cat(pages)).long() if pages else None
        gqa = index is None or _native_gqa(q, k, v)
        return cls(chunks, index, gqa, any(f < 0 for _, f, _, _ in chunks))


def gather_pages(cache, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pages (P,) of one layer's K or V as one (P * block_size, H_kv, D) tensor in `dtype` (fp8 rows
    dequantised): one gather for every prefixed chunk of a step. cache: (num_blocks, block_size, H_kv, D) or a
    two-tier `TierView` (kernels/kv_layout.py)."""
    if hasattr(cache, "pages"):
        rows = cache.pages(pages)
    else:
        rows = as_bytes(cache).index_select(0, pages).view(cache.dtype)  # fp8 gathered as bytes
    return values(rows.view(-1, *rows.shape[2:]), torch.float32).to(dtype)


def prefix_index(query_lens: list[int], context_lens: list[int], device, block: int = PREFIX_BLOCK
                 ) -> SparseIndex | None:
    """The `SparseIndex` under which block-sparse attention is dense causal attention over each cached prefix: the
    query blocks (`block` rows, position-aligned) of every sequence with a prefix (context > 0; the others get none,
    their rows are left to SDPA), each selecting every key block of `block` keys from 0 to the one holding its last
    row. One selection for all heads (groups 1: a program reads each KV block once for its whole GQA group). No sink
    and no window (n_sink = n_window = 0): the selected part then admits key k for the row at position p iff
    0 <= k <= p, so the diagonal block is masked per row, as SDPA's bottom-right causal mask does (index_types.py).
    None when no sequence has a prefix."""
    qb = QueryBlocks.build(query_lens, context_lens, block)
    keep = [b for b in range(qb.num_blocks) if context_lens[qb.seq[b]] > 0]
    if not keep:
        return None
    qb = QueryBlocks(*([getattr(qb, f)[b] for b in keep] for f in ("seq", "start", "length", "pos")))
    ends = torch.tensor([-(-(p + n) // block) for p, n in zip(qb.pos, qb.length)], dtype=torch.int32).to(device)
    ids = torch.arange(int(ends.max()), dtype=torch.int32, device=device)
    blocks = torch.where(ids[None, :] < ends[:, None], ids[None, :], -1).unsqueeze(1)  # (NQB, 1, most blocks)
    return SparseIndex(block, block, 0, 0, 1, qb, blocks, ends[:, None])


def prefix_splits(num_query_blocks: int, num_kv_heads: int, longest: int, num_sms: int) -> int:
    """Split-K for the paged prefill (kernels/combine.py merges the splits). Without it a launch runs one program per
    query block and KV head (a 256-token chunk of an 8-KV-head model: 4 x 8 = 32 programs, the launcher may halve a
    group's heads over two) while each walks the whole prefix: a 128K prefix would keep a quarter of the SMs busy.
    `split_count` gives enough splits to fill the GPU about twice, capped so that each split still reads at least
    KEYS_PER_SPLIT keys of the longest sequence (`longest` tokens; below that the merge costs more than it spreads)
    and at most 32. A function of shapes only. E.g. 132 SMs: a 256-token chunk at 128K, 8 KV heads: 9 splits; a
    2,048-token chunk (32 query blocks): 1."""
    most = min(32, max(1, longest // KEYS_PER_SPLIT))
    return split_count(num_query_blocks * num_kv_heads, num_sms, most)


def paged_prefix_attention(q, k_cache, v_cache, block_tables, index: SparseIndex, scale: float, num_splits: int = 1,
                           out: torch.Tensor | None = None, plan=None, kernel: bool | None = None) -> torch.Tensor:
    """Attention of the rows of `index`'s query blocks over their sequences' paged K/V (q (T, H_q, D), caches as the
    kernels take them: one tier or two, fp8 or not), written into `out` (T, H_q, D), a new tensor if None. Rows in
    no query block are the caller's to write afterwards: the merge of split-K rewrites every row. `kernel`: the
    Triton kernel (default: on CUDA; tests pass True under the interpreter) or the PyTorch reference (`num_splits`
    and `plan` unused)."""
    if kernel if kernel is not None else use_triton(q):
        from ..kernels.bsa import block_sparse_attention_triton

        out, _ = block_sparse_attention_triton(q, k_cache, v_cache, block_tables, index, scale,
                                               num_splits=num_splits, plan=plan, out=out)
        return out
    ref, _ = block_sparse_attention(q, k_cache, v_cache, block_tables, index, scale, need_lse=False)
    return ref if out is None else out.copy_(ref)


def ring_rows(cache, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows (n,) of a ring layer's K or V (kvcache/window.py: row `slot * window + position % window` of the cache
    flattened over its pages) as one (n, H_kv, D) tensor in `dtype` (fp8 rows dequantised)."""
    flat = as_bytes(cache).flatten(0, 1)  # (pages * page, H_kv, row bytes)
    return values(flat.index_select(0, rows).view(cache.dtype), torch.float32).to(dtype)


@dataclass
class WindowPlan:
    """A prefill step's sliding-window work, the same in every sliding layer (built at the first, kept on the step's
    `step_cache`): per sequence its rows of q, the position of its first key and the ring rows of the window before
    the chunk (positions first .. ctx - 1), None for a chunk without a prefix."""

    chunks: list[tuple[slice, int, torch.Tensor | None]]

    KEY = "dense.window"

    @classmethod
    def build(cls, meta: AttentionMetadata, window: int, device) -> "WindowPlan":
        chunks, start = [], 0
        for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
            rows = slice(start, start + n)
            start += n
            if ctx == 0:
                chunks.append((rows, 0, None))
                continue
            first = max(0, ctx - window + 1)
            ring = meta.window_slots[i] * window + torch.arange(first, ctx, device=device) % window
            chunks.append((rows, first, ring))
        return cls(chunks)


class DenseBackend(AttentionBackend):
    name = "dense"
    capabilities = Capabilities(graph=GraphSupport.STATIC, mixed_batches=True)
    honours_layer_windows = True

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        window = self.model_config.window_of(layer)
        if meta.is_prefill:
            if window is not None:
                return self._window_prefill(q, k, v, k_cache, v_cache, meta, window)
            return self._prefill(q, k, v, k_cache, v_cache, meta)
        if window is not None:
            return self._window_decode(q, k_cache, v_cache, meta, window)
        return self._decode(q, k_cache, v_cache, meta)

    def _window_prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, window: int):
        """A sliding-window layer's prefill over its ring (kvcache/window.py; the chunk is not in it yet: the runner
        stores it after): each chunk over the window before it, read from the ring, and its own keys."""
        plan = meta.step_cache.get(WindowPlan.KEY)
        if plan is None:  # the step's first sliding layer
            plan = meta.step_cache[WindowPlan.KEY] = WindowPlan.build(meta, window, q.device)
        out = torch.empty_like(q)
        for rows, first, ring in plan.chunks:
            if ring is None:
                out[rows] = window_attention(q[rows], k[rows], v[rows], self.scale, window)
            else:
                ki = torch.cat([ring_rows(k_cache, ring, q.dtype), k[rows]])
                vi = torch.cat([ring_rows(v_cache, ring, q.dtype), v[rows]])
                out[rows] = window_attention(q[rows], ki, vi, self.scale, window, first)
        return out

    def _window_decode(self, q, k_cache, v_cache, meta: AttentionMetadata, window: int):
        """A sliding-window layer's decode: the paged decode over the sequence's ring (its `window // page` pages from
        `slot * window // page`, its last min(seq_len, window) tokens; built on the device: graph-capturable). The
        ring's rows hold their keys rotated at their true positions, so their order does not matter."""
        per = window // k_cache.shape[1]
        tables = (meta.window_slots[:, None] * per + torch.arange(per, device=q.device)).to(torch.int32)
        lens = meta.seq_lens.clamp(max=window)
        if use_triton(q):
            splits = default_num_splits(q.shape[0], self.model_config.num_kv_heads, window, num_sms=self._num_sms)
            out, _ = paged_decode(q, k_cache, v_cache, tables, lens, self.scale, num_splits=splits)
        else:
            out, _ = paged_decode_reference(q, k_cache, v_cache, tables, lens, self.scale)
        return out

    def _prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata):
        plan = meta.step_cache.get(SdpaPlan.KEY)
        if plan is None:  # the step's first layer
            plan = meta.step_cache[SdpaPlan.KEY] = SdpaPlan.build(meta, q, k, v, k_cache.shape[1])
        in_place = self.paged_prefill and plan.pages is not None
        alone = len(plan.chunks) == 1 and not in_place  # one chunk: its output is the layer's, no copy
        out = None if alone else torch.empty_like(q)
        if in_place:  # every chunk with a cached prefix in one launch; the rows of the others are SDPA's, below
            index, kplan, splits = self._prefix_plan(meta, q.device)
            paged_prefix_attention(q, k_cache, v_cache, meta.block_tables, index, self.scale, splits, out, kplan)
        elif plan.pages is not None:  # chunked prefill: every prefix (this chunk too was stored) in one gather
            kp, vp = gather_pages(k_cache, plan.pages, q.dtype), gather_pages(v_cache, plan.pages, q.dtype)
        # SDPA's kernel order matters only to chunks without a prefix: a CausalBias dispatches by its own rule
        with _sdpa_context(q.device) if plan.square else contextlib.nullcontext():
            for rows, first, length, mask in plan.chunks:
                if first < 0:
                    o = _attend(q[rows], k[rows], v[rows], self.scale, None, True)
                elif in_place:
                    continue
                else:
                    o = _attend(q[rows], kp[first:first + length], vp[first:first + length], self.scale, mask,
                                plan.gqa)
                if alone:
                    return o
                out[rows] = o
        return out

    def _prefix_plan(self, meta: AttentionMetadata, device):
        """(index, kernel plan or None, splits) of the paged prefill, built once per step and kept on its metadata
        (`step_cache`): one host-to-device copy of the query blocks per step, not per layer."""
        built = meta.step_cache.get("dense.paged")
        if built is not None:
            return built
        index = prefix_index(meta.query_lens, meta.context_lens, device)
        plan, splits = None, 1
        if use_triton(device):
            from ..kernels.bsa import BSAPlan

            mc = self.model_config
            plan = BSAPlan(index, mc.num_heads, mc.num_kv_heads, device)
            splits = prefix_splits(index.queries.num_blocks, mc.num_kv_heads, meta.max_seq_len, self._num_sms)
        built = meta.step_cache["dense.paged"] = (index, plan, splits)
        return built

    @classmethod
    def resolve_config(cls, engine_config) -> None:
        if engine_config.preset or engine_config.attention_config is not None:
            raise ValueError("dense attention (the default --attention) takes no --preset or --attention-config: "
                             "they configure a sparse method, e.g. --attention infinitehip --preset 3k-fast "
                             "(`longreach backends` lists each method's presets)")
        return None

    def __init__(self, model_config, engine_config, device):
        super().__init__(model_config, engine_config, device)
        self._num_sms = sm_count(device)
        self.paged_prefill = engine_config.dense_prefill == "paged"  # config.py: dense_prefill

    def num_splits(self, batch: int) -> int:
        """Split count for the decode kernel: a function of the batch size only, so eager and graph runs agree."""
        return default_num_splits(batch, self.model_config.num_kv_heads, self.engine_config.max_model_len,
                                  num_sms=self._num_sms)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata):
        if use_triton(q):
            out, _ = paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                  num_splits=self.num_splits(q.shape[0]))
        else:
            out, _ = paged_decode_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale)
        return out


class DenseFallback:
    """When a method attends densely instead of by its own rule, and the dense backend that then runs: in its
    always-dense layers, and for a context no longer than the layer's limit (`limit(layer, decoding)` tokens; 0:
    never). Prefill and decode may have different limits (sparse/config.py's `dense_below_decode`): a decode step
    asks with decoding=True, a prefill chunk with False, and decode's CUDA-graph variants are keyed by the decode
    limits (`limits(True)`).

    A model's sliding-window layers (Gemma 3's local layers, `ModelConfig.window_of`) are always-dense layers too: the
    dense backend attends them within their window, so a sparse method selects in the global layers only, and its
    budgets are per global layer."""

    def __init__(self, model_config, engine_config, device: torch.device, dense_layers: tuple[int, ...],
                 limit: Callable[[int, bool], int] = lambda layer, decoding: 0):
        self.backend = DenseBackend(model_config, engine_config, device)
        self.num_layers = model_config.num_layers
        windowed = {layer for layer in range(self.num_layers) if model_config.window_of(layer) is not None}
        self.layers = tuple(sorted(set(dense_layers) | windowed))
        self.limit = limit

    def applies(self, layer: int, length: int, decoding: bool = False) -> bool:
        """Does `layer` attend densely when the longest sequence of the step holds `length` tokens?"""
        return layer in self.layers or length <= self.limit(layer, decoding)

    def sparse_layers(self) -> list[int]:
        return [layer for layer in range(self.num_layers) if layer not in self.layers]

    def limits(self, decoding: bool = False) -> list[int]:
        """The distinct limits over every layer, ascending."""
        return sorted({self.limit(layer, decoding) for layer in range(self.num_layers)})

    def forward(self, layer, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, k_cache, v_cache, meta)
