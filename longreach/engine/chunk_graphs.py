"""Prefill chunks through CUDA graphs, piecewise: the model's work between two attention calls is replayed from a
graph, and the attention itself runs eagerly between the replays (issue 30; docs/design-mixed-graphs.md).

Why: a prefill step launches ~1,000 small eager ops from Python (GEMMs, norms, RoPE, copies). On an H200 a step of
256 prompt tokens beside 32 decodes took 28-33 ms of wall time for ~5.5 ms of GPU work (docs/serving.md). Attention
is the one part whose launches follow host-side lengths (varlen prefill, a sparse method's selection, MInference's
pattern search, the offloaded store's staging), so it stays an eager `ctx.attention` call: every method runs
unchanged, and it still writes the chunk's K/V into the cache.

What is captured, per padded chunk size P, for a model of L layers: L + 1 segments, made of models/llama.py's pieces
  seg 0       embed + rotary + layer 0's pre_attention (norm, QKV projection, RoPE)
  seg i       layer i-1's post_attention (O projection, residual add + norm, MLP) + layer i's pre_attention
  seg L       layer L-1's post_attention + the final residual add (`finish`)
so a chunk is L + 1 replays and L eager attention calls, in place of ~30 launches per layer. The static inputs of a
size are the token ids (P,), the positions (P,) and the attention output (P, H_q, D) that seg i+1 reads; q/k/v, the
residual stream and cos/sin are graph outputs, kept referenced from one replay to the next.

Padding, for a step of T < P rows: rows past T get token id 0 and position 0, flow through every segment (each op is
row by row: nothing mixes rows) and are dropped (`hidden[:T]`). Attention is called on q/k/v[:T] only, so padding
rows never reach the KV cache or any backend state; its output is copied into the static buffer's first T rows, and
the rows past T keep what an earlier step left there (zeros at first), which reaches only the padding rows' outputs.
A step of at most EAGER_MAX_ROWS rows runs eagerly (the constant says why).

RoPE: the embed segment is captured with `max_position=None`. That is exact because only dynamic NTK reads the step's
largest position (rope/scaling.py), and chunk graphs refuse a dynamic-NTK model (as the decode graphs do:
ModelRunner.graphs_supported).

Memory: all sizes' segments are captured into one private pool (not the decode graphs': what they hold is then
measured on its own, and the decode variants captured later, while serving, do not depend on it). Sharing one pool is
safe because replays never overlap and a size's segments always replay in their capture order, each reading only the
static buffers and earlier segments' outputs; those outputs stay referenced, so the allocator never hands their
memory to a later capture. What a later capture (the next segment, or a smaller size: sizes are captured largest
first) reuses is memory freed inside an earlier one: intermediates, dead once their segment has run. The price of
keeping every segment's outputs, per size: L x P x (QKV width + hidden) activations (more with q/k norms), ~0.19 GB
for SmolLM2 (30 layers) at P = 2,048 in bf16 and ~1.4 GB for a Llama-8B shape (estimates from the shapes,
`estimate_bytes`). Copying each segment's outputs into one static set shared by all layers would hold one layer's
worth, for two more copies per layer and a rule that no attention call keeps q/k/v past its return; not done. The
runner captures only the sizes that fit in half the free GPU memory, smallest first (ModelRunner.capture_chunk_graphs).

`emulate` (tests, any device): the same static buffers, padding and slicing, each segment run eagerly in place of
its replay, so a CPU test checks the path's logic against the eager forward pass.
"""
from __future__ import annotations

import bisect
import dataclasses
import typing

import torch

from ..models.fp8 import GEMV_ROWS
from ..models.llama import ForwardContext, LlamaForCausalLM
from .pacing import MIN_CHUNK

# A step of at most this many rows runs eagerly: that is fp8's weight-only GEMV's range (models/fp8.py), where a padded
# call would take the W8A8 path instead and quantise the activations, so the graphs would change what the model
# computes; a GEMM of so few rows takes other kernels than a padded one elsewhere too (cuBLAS, CPU BLAS). Such steps
# (a prompt's last few tokens alone) are rare.
EAGER_MAX_ROWS = GEMV_ROWS


def chunk_graph_sizes(chunk_sizes: typing.Iterable[int], max_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """The padded sizes worth capturing, largest first: the scheduler's chunk sizes (`Scheduler.chunk_sizes`: a prompt
    alone, beside others, each paced cap) up to `max_tokens`, and the powers of two from the pacer's smallest chunk
    (256) up to it, so that a prompt's last, partial chunk, or a step of several prompts' chunks, pads to a near size
    instead of running eagerly. None above max_num_batched_tokens (no step is larger) or of at most EAGER_MAX_ROWS;
    [] when max_tokens is 0 (off)."""
    cap = min(max_tokens, max_num_batched_tokens)
    sizes = {s for s in chunk_sizes if s <= cap}
    p = MIN_CHUNK
    while p <= cap:
        sizes.add(p)
        p *= 2
    return sorted((s for s in sizes if s > EAGER_MAX_ROWS), reverse=True)


@dataclasses.dataclass
class _Chunk:
    """One padded size's static buffers and its segments' outputs (module docstring)."""

    ids: torch.Tensor  # (P,) long
    positions: torch.Tensor  # (P,) long
    attn: torch.Tensor  # (P, H_q, D): the attention output the next segment reads
    # per segment its outputs: seg 0 (q, k, v, residual, cos, sin), seg i (q, k, v, residual), seg L (hidden,);
    # captured: the graph's own (fixed), emulated: the last run's
    outs: list[tuple | None]
    graphs: list[torch.cuda.CUDAGraph] | None = None  # None: emulated


class ChunkGraphs:
    """The prefill chunks' segments of each captured size (module docstring), owned by the ModelRunner.

    Mutates: `run` overwrites its size's static buffers and segment outputs; the hidden states it returns are a view
    of them, valid until the next `run` that uses the same size."""

    def __init__(self, model: LlamaForCausalLM, device: torch.device, emulate: bool = False):
        if model.rotary.dynamic:
            raise ValueError("prefill chunk graphs need RoPE frequencies that do not depend on the step: dynamic NTK "
                             "recomputes them from the longest sequence (run with --enforce-eager or "
                             "--chunk-graph-max-tokens 0)")
        self.model, self.device, self.emulate = model, device, emulate
        self.sizes: list[int] = []  # captured, ascending
        self.runs = 0  # steps that ran through the graphs
        self._chunks: dict[int, _Chunk] = {}
        self._pool = None

    def estimate_bytes(self, size: int) -> int:
        """What one size's capture keeps, from the shapes: every segment's outputs and the static buffers."""
        attn = self.model.layers[0].self_attn
        qkv = attn.q_size + 2 * attn.kv_size
        if attn.q_norm is not None:  # q and k come out of the norm and RoPE as tensors of their own
            qkv += attn.q_size + attn.kv_size
        hidden = self.model.config.hidden_size
        per_row = len(self.model.layers) * (qkv + hidden) + hidden + attn.head_dim + attn.q_size
        return size * per_row * self.model.embed_tokens.weight.element_size()

    @torch.inference_mode()
    def capture(self, sizes: typing.Iterable[int]) -> list[int]:
        """Capture (emulating: only allocate) the segments of each of `sizes` rows not captured yet, largest first, so
        that smaller sizes reuse the larger ones' freed intermediates. Returns the new sizes."""
        sizes = list(sizes)
        bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s <= EAGER_MAX_ROWS]
        if not sizes or bad:
            raise ValueError(f"prefill chunk graph sizes must be integers > {EAGER_MAX_ROWS} (a step of at most "
                             f"{EAGER_MAX_ROWS} rows runs eagerly), got {sizes!r}")
        new = sorted(set(sizes) - set(self._chunks), reverse=True)
        if new and not self.emulate and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for size in new:
            self._chunks[size] = self._capture(size)
        self.sizes = sorted(self._chunks)
        return new

    @property
    def num_graphs(self) -> int:
        return sum(len(c.graphs or ()) for c in self._chunks.values())

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """A prefill step's final hidden states (T, hidden) for input_ids, positions (T,), through the smallest
        captured size that holds T rows, with `ctx.attention` called eagerly on the T real rows of every layer.
        None when no size holds T rows or T <= EAGER_MAX_ROWS: the caller runs the model eagerly. Under
        torch.inference_mode(), as the runner's `execute` calls it (the static buffers are inference tensors)."""
        T = input_ids.shape[0]
        at = bisect.bisect_left(self.sizes, T)
        if T <= EAGER_MAX_ROWS or at == len(self.sizes):
            return None
        c = self._chunks[self.sizes[at]]
        c.ids[:T].copy_(input_ids)
        c.ids[T:].zero_()
        c.positions[:T].copy_(positions)
        c.positions[T:].zero_()
        layers = self.model.layers
        for i in range(len(layers)):
            q, k, v = self._replay(c, i)[:3]
            c.attn[:T].copy_(ctx.attention(layers[i].self_attn.layer, q[:T], k[:T], v[:T]))  # (T, H_q, D)
        self.runs += 1
        return self._replay(c, len(layers))[0][:T]

    # ---- the segments --------------------------------------------------------------------------------------------
    def _segment(self, c: _Chunk, i: int) -> tuple:
        """Segment i's work (module docstring), reading the static buffers and earlier segments' outputs."""
        m = self.model
        if i == 0:  # max_position None: exact without dynamic NTK (module docstring)
            x, cos, sin = m.embed(c.ids, c.positions, None)
            return (*m.layers[0].pre_attention(x, None, cos, sin), cos, sin)
        x, residual = m.layers[i - 1].post_attention(c.attn, c.outs[i - 1][3])
        if i == len(m.layers):
            return (m.finish(x, residual),)
        cos, sin = c.outs[0][4:]
        return m.layers[i].pre_attention(x, residual, cos, sin)

    def _replay(self, c: _Chunk, i: int) -> tuple:
        if c.graphs is None:
            c.outs[i] = self._segment(c, i)
        else:
            c.graphs[i].replay()
        return c.outs[i]

    def _capture(self, size: int) -> _Chunk:
        """Size `size`'s buffers and, unless emulating, its captured segments: first one eager pass over them on a
        side stream (Triton compilation, cuBLAS handles and workspaces outside the capture, as ModelRunner._capture
        does), then each segment captured in order, reading the previous capture's outputs."""
        attn = self.model.layers[0].self_attn
        dev, dtype = self.device, self.model.embed_tokens.weight.dtype
        n = len(self.model.layers) + 1
        c = _Chunk(torch.zeros(size, dtype=torch.long, device=dev), torch.zeros(size, dtype=torch.long, device=dev),
                   torch.zeros(size, attn.num_heads, attn.head_dim, dtype=dtype, device=dev), [None] * n)
        if self.emulate:
            return c
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for i in range(n):
                c.outs[i] = self._segment(c, i)
                if i > 1:
                    c.outs[i - 1] = None  # read by segment i only (seg 0's cos/sin by every segment)
        torch.cuda.current_stream(dev).wait_stream(side)
        c.outs = [None] * n
        c.graphs = []
        for i in range(n):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                c.outs[i] = self._segment(c, i)
            c.graphs.append(graph)
        return c
