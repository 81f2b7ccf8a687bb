"""A prefill chunk's selection through CUDA graphs: one sequence, one layer, replayed instead of launched op by op.

Why: a sparse method's prefill selection (infinitehip: 3-4 stages of scoring, top-k and candidate arithmetic) is ~80
small torch ops and ~15 Triton launches per layer. On an H200 that is ~2 ms of host time per layer, ~60 ms per chunk
for a 30-layer model whatever the chunk's size, while the GPU work of a 2,048-token chunk at 128K is ~57 ms: a chunk
of a long prompt beside decoding requests was host-bound (docs/serving.md, `bench mixed`). A replay costs ~20 us.

What is captured: the method's prefill selection (`SelectionMethod.select` with no decode state) of one sequence's
chunk in one layer, keyed by
  (layer, rows n, query blocks nb, rows per block, bucket, the layer's key cache and box pool addresses)
with `bucket` a power of two >= the chunk's end (capped at max_model_len), as decode's variants (graph.py): the stage
widths and the box view are sized by it and the candidates past the real end are -1, so the selection is the eager
step's, with more -1 padding (a stage whose exact candidates fit its budget keeps them all either way; top-k keeps
the same set, ties to the lower position). The inputs live in static buffers (the chunk's queries, the blocks'
starts, lengths and ends, the sequence's block-table row and box-table row); the output is cloned after the replay.

When: on CUDA with graphs on (not --enforce-eager), for a method whose decode graphs are supported (graph.py's
`unsupported`), for a chunk of n rows where n is a power of two >= MIN_ROWS (the scheduler's chunks: the token
budget or its long-prefill share); a prompt's last, partial chunk runs eagerly. A key is captured at its first use
(a warm-up run, then the capture: a few ms per layer). A method whose prefill selection cannot be captured (a host
sync inside) is found at the first capture: it is logged and every later chunk runs eagerly. `emulate` runs the same
static-buffer path without capturing (CPU tests).
"""
from __future__ import annotations

import logging
import time

import torch

from .selection import BlockQueries, SelectionMethod, SequenceKeys

logger = logging.getLogger("longreach")

MIN_ROWS = 256


class PrefillGraphs:
    def __init__(self, method: SelectionMethod, max_model_len: int, block_size: int, device: torch.device,
                 enabled: bool, emulate: bool = False):
        self.method, self.max_model_len, self.device = method, max_model_len, device
        self.table_width = -(-max_model_len // block_size) + 1
        self.emulate = emulate
        self.enabled = enabled and (device.type == "cuda" or emulate)
        self.disabled_why: str | None = None
        self._graphs: dict[tuple, tuple] = {}  # key -> (graph or None when emulated, output)
        self._buffers: dict[tuple, dict] = {}  # (n, nb, q's shape and dtype, table widths) -> static inputs
        self._pool = None
        self.captures = 0
        self.replays = 0
        self.dtype: torch.dtype | None = None  # the queries' dtype (the model's), set by the backend

    def applies(self, n: int, keys: SequenceKeys) -> bool:
        return (self.enabled and self.disabled_why is None and n >= MIN_ROWS and n & (n - 1) == 0
                and type(keys.k_cache) is torch.Tensor and keys.block_table.shape[0] <= self.table_width)

    def bucket(self, end: int) -> int:
        return min(1 << (end - 1).bit_length(), max(end, self.max_model_len))

    def select(self, layer: int, q: torch.Tensor, blocks: BlockQueries, keys: SequenceKeys) -> torch.Tensor:
        """The selection `method.select(layer, q, blocks, keys)` gives in prefill (module docstring for the padding),
        replayed from the key's graph (captured now if new); eagerly if capturing fails."""
        n, nb = q.shape[0], blocks.num_blocks
        bucket = self.bucket(blocks.max_end)
        pool = keys.boxes[0] if keys.boxes is not None else None
        key = (layer, n, nb, blocks.max_rows, bucket, keys.k_cache.data_ptr(),
               None if pool is None else pool.data_ptr())
        buf = self._inputs(q, blocks, keys)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, layer, buf, blocks.max_rows, bucket, keys)
            except RuntimeError as e:  # a host sync or an op that cannot be captured: eager from now on
                self.disabled_why = f"{type(e).__name__}: {e}"
                logger.warning("%s's prefill selection cannot be captured in a CUDA graph (%s); prefill chunks select "
                               "eagerly", self.method.name, self.disabled_why.splitlines()[0][:200])
                torch.cuda.synchronize(self.device)
                return self.method.select(layer, q, blocks, keys)
        graph, out = entry
        if graph is None:  # emulated: the static-buffer path, run now
            out = self._run(layer, buf, blocks.max_rows, bucket, keys)
        else:
            graph.replay()
        self.replays += 1
        return out.clone()

    def capture_all(self, layer: int, k_cache: torch.Tensor, boxes, chunk_rows: list[int], block_q: int,
                    dense_below: int, heads: tuple[int, int]) -> None:
        """Capture `layer`'s graphs for block-aligned chunks of each of `chunk_rows` rows (those `applies` takes) at
        every bucket a sparse chunk can end in (its sequence longer than `dense_below`, up to max_model_len), with
        zero queries over the scratch box row: the shapes of the real chunks, nothing real read or written."""
        dev = k_cache.device
        for n in sorted(set(chunk_rows)):
            table = torch.zeros(1, dtype=torch.int32, device=dev)
            if n % block_q or not self.applies(n, SequenceKeys(k_cache, table, n, boxes)):
                continue
            nb = n // block_q
            q = torch.zeros(n, *heads, dtype=self.dtype or torch.bfloat16, device=dev)
            step = torch.arange(nb, dtype=torch.long, device=dev) * block_q
            end = max(n, dense_below + 1)
            while end <= self.max_model_len:
                bucket = self.bucket(end)
                blocks = BlockQueries(step, torch.full_like(step, block_q), step + block_q + (bucket - n), block_q,
                                      bucket)
                self.select(layer, q, blocks, SequenceKeys(k_cache, table, bucket, boxes))
                end = bucket + 1

    def _inputs(self, q: torch.Tensor, blocks: BlockQueries, keys: SequenceKeys) -> dict:
        """The static input buffers of this shape, loaded with this chunk's inputs. The blocks, the block-table row
        and the box-table row are the same in every layer of a step (the backend builds `blocks` once per sequence
        and step): they are copied when `blocks` is a new object, the queries every time."""
        table = keys.block_table
        box_row = keys.boxes[1] if keys.boxes is not None else None
        width = self.table_width
        shape = (q.shape, q.dtype, blocks.num_blocks, width, None if box_row is None else box_row.shape[0])
        buf = self._buffers.get(shape)
        if buf is None:
            dev = q.device
            buf = self._buffers[shape] = {
                "q": torch.empty_like(q), "blocks": torch.zeros(3, blocks.num_blocks, dtype=torch.long, device=dev),
                "table": torch.zeros(width, dtype=table.dtype, device=dev),
                "boxes": None if box_row is None else torch.zeros_like(box_row)}
        buf["q"].copy_(q)
        if buf.get("loaded") is blocks:  # held, so its id cannot be reused by another step's blocks
            return buf
        buf["loaded"] = blocks
        b = buf["blocks"]
        b[0].copy_(blocks.starts)
        b[1].copy_(blocks.lens)
        b[2].copy_(blocks.ends)
        t = buf["table"]
        t[:table.shape[0]].copy_(table)
        t[table.shape[0]:].zero_()  # past the sequence: page 0, never read (its candidates end before)
        if box_row is not None:
            buf["boxes"].copy_(box_row)
        return buf

    def _run(self, layer: int, buf: dict, max_rows: int, bucket: int, keys: SequenceKeys) -> torch.Tensor:
        b = buf["blocks"]
        blocks = BlockQueries(b[0], b[1], b[2], max_rows, bucket)
        boxes = None if keys.boxes is None else (keys.boxes[0], buf["boxes"], keys.boxes[2])
        static_keys = SequenceKeys(keys.k_cache, buf["table"], bucket, boxes)
        return self.method.select(layer, buf["q"], blocks, static_keys)

    def _capture(self, key: tuple, layer: int, buf: dict, max_rows: int, bucket: int, keys: SequenceKeys) -> tuple:
        if self.emulate:
            entry = self._graphs[key] = (None, None)
            return entry
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: kernels compile and allocators settle outside the capture
            self._run(layer, buf, max_rows, bucket, keys)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._run(layer, buf, max_rows, bucket, keys)
        self.captures += 1
        if layer == 0 or self.captures % 64 == 0:
            logger.info("captured the prefill selection of %d rows at bucket %d (layer %d, %.0f ms; %d graphs)",
                        key[1], bucket, layer, 1e3 * (time.perf_counter() - t0), self.captures)
        entry = self._graphs[key] = (graph, out)
        return entry
