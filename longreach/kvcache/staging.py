"""A prefill step over the offloaded KV cache (kvcache/offload.py): the batch's prefix gathered per layer from the
host tier into a GPU staging area, where the ordinary attention kernels read it (docs/offload.md, "Prefill: a staging
area")."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .fp8 import as_bytes, encode


MAX_DMA_RUNS = 64  # a prefix in more runs of consecutive pages than this is gathered by the copy kernel instead


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first source page, first place, count) for each run of pages consecutive on both sides, in order (numpy: a
    1M-token prefix is 65,536 pages)."""
    if not src:
        return []
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    starts = np.concatenate([[0], np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1])
    counts = np.diff(np.append(starts, len(s)))
    return [(int(a), int(b), int(n)) for a, b, n in zip(s[starts], d[starts], counts)]


class StagedPrefill:
    """One prefill step over an offloaded cache: the batch's pages get consecutive places in the staging area, each
    layer's prefix is gathered there from the host tier before its attention, and the attention backends run on the
    staging area as on a one-tier cache (remapped block tables and slots). New K/V goes to the staging area and,
    through `store`, to the host tier (and the pool where resident).

    Bytes moved per layer: the batch's prefix (context before this chunk), K and V. For a 1M-token prompt in C-token
    chunks that is sum over chunks of the prefix, ~ 1M^2 / (2 C) tokens per layer (docs/offload.md).

    Overlap: with two staging buffers (the store's `staging_buffers`) layer j reads buffer j % 2, and its attention
    call first starts the gather of layer j + 1's prefix into the other buffer, on the store's copy stream (a GPU) or
    at once (a CPU: the same buffers and order, nothing overlapped). That gather waits for everything the compute
    stream holds so far (the host tier's writes of earlier steps and layer j - 1's attention, the last reader of its
    buffer); layer j + 1's attention waits for it. A prefix in few runs of consecutive pages (`MAX_DMA_RUNS`; one
    long prompt's pages mostly are) is copied run by run, by the copy engines rather than the SMs.
    """

    def __init__(self, store, meta, tables: list[list[int]]):  # store: an OffloadedKVCache (offload.py)
        bs = store.block_size
        self.store, self.meta_in = store, meta
        local_tables, src, dst, n = [], [], [], 0
        for table, ctx, q in zip(tables, meta.context_lens, meta.query_lens):
            need = -(-(ctx + q) // bs)
            local = list(range(n, n + need))
            prefix = -(-ctx // bs)  # pages holding earlier tokens: gathered; the rest get only this chunk's rows
            src += table[:prefix]
            dst += local[:prefix]
            local_tables.append(local)
            n += need
        if n > store.staging_pages:
            raise RuntimeError(f"a prefill step needs {n} staging pages, the staging area has {store.staging_pages}")
        dev = store.device
        bt = np.zeros((len(local_tables), max(len(t) for t in local_tables)), dtype=np.int32)
        slots = []
        for i, (t, ctx, q) in enumerate(zip(local_tables, meta.context_lens, meta.query_lens)):
            bt[i, :len(t)] = t
            pos = np.arange(ctx, ctx + q)
            slots.append(np.asarray(t, dtype=np.int64)[pos // bs] * bs + pos % bs)
        runs = page_runs(src, dst)
        self.runs = runs if len(runs) <= MAX_DMA_RUNS else None
        self.src = torch.tensor(src, dtype=torch.long).to(dev)
        self.dst = torch.tensor(dst, dtype=torch.long).to(dev)
        self.slots = torch.from_numpy(np.concatenate(slots)).to(dev)
        self.meta = dataclasses.replace(meta, block_tables=torch.from_numpy(bt).to(dev), slot_mapping=self.slots,
                                        page_reads=None)
        nbuf = store.staging_buffers
        self.bufs = [store.staging(i) for i in range(nbuf)]  # as the kernels read them: (2, pages, bs, H_kv, row)
        self.raws = [store.staging_pages_raw(i) for i in range(nbuf)]
        self.page, self.off = self.slots // bs, self.slots % bs
        self._ready: dict[int, object] = {}  # store layer -> its prefix's gather: a CUDA event, or True (done)

    def _gather(self, layer: int) -> None:
        """Layer `layer`'s prefix into its buffer, on the current stream."""
        self.store.gather_pages(layer, self.src, self.dst, self.raws[layer % len(self.raws)], self.runs)

    def _prefetch(self, layer: int) -> None:
        stream = self.store.copy_stream()
        if stream is None:
            self._gather(layer)
            self._ready[layer] = True
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            self._gather(layer)
            done = torch.cuda.Event()
            done.record(stream)
        self._ready[layer] = done

    def attention(self, layer: int, q, k, v, backend, cache_layer: int | None = None):
        """Model layer `layer`'s attention on the staging area; `cache_layer`: its layer in the store where that
        differs (the store of a model with sliding layers holds its global layers only: kvcache/window.py)."""
        st = self.store
        j = layer if cache_layer is None else cache_layer
        buf = self.bufs[j % len(self.bufs)]
        if self.src.numel():
            ready = self._ready.pop(j, None)
            if ready is None:
                self._gather(j)
            elif ready is not True:
                torch.cuda.current_stream(buf.device).wait_event(ready)
            if len(self.bufs) > 1 and j + 1 < st.num_layers:
                self._prefetch(j + 1)
        rows = as_bytes(buf)  # (2, pages, block_size, H_kv, row bytes)
        rows[0][self.page, self.off] = as_bytes(encode(k, buf.dtype))
        rows[1][self.page, self.off] = as_bytes(encode(v, buf.dtype))
        st.store(j, k, v, self.meta_in.slot_mapping)
        return backend.forward(layer, q, k, v, buf[0], buf[1], self.meta)
