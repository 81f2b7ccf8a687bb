"""A prefill step over the offloaded KV cache (kvcache/offload.py): the batch's prefix gathered per layer from the
host tier into a GPU staging area, where the ordinary attention kernels read it (docs/offload.md, "Prefill: a staging
area")."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .fp8 import as_bytes, encode


class StagedPrefill:
    """One prefill step over an offloaded cache: the batch's pages get consecutive places in the staging area, each
    layer's prefix is gathered there from the host tier before its attention, and the attention backends run on the
    staging area as on a one-tier cache (remapped block tables and slots). New K/V goes to the staging area and,
    through `store`, to the host tier (and the pool where resident).

    Bytes moved per layer: the batch's prefix (context before this chunk), K and V. For a 1M-token prompt in C-token
    chunks that is sum over chunks of the prefix, ~ 1M^2 / (2 C) tokens per layer (docs/offload.md)."""

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
        self.src = torch.tensor(src, dtype=torch.long).to(dev)
        self.dst = torch.tensor(dst, dtype=torch.long).to(dev)
        self.slots = torch.from_numpy(np.concatenate(slots)).to(dev)
        self.meta = dataclasses.replace(meta, block_tables=torch.from_numpy(bt).to(dev), slot_mapping=self.slots,
                                        page_reads=None)
        self.buf = store.staging()  # as the kernels read it: (2, pages, block_size, H_kv, row), maybe strided
        self.raw = store.staging_pages_raw()
        self.page, self.off = self.slots // bs, self.slots % bs

    def attention(self, layer: int, q, k, v, backend, cache_layer: int | None = None):
        """Model layer `layer`'s attention on the staging area; `cache_layer`: its layer in the store where that
        differs (the store of a model with sliding layers holds its global layers only: kvcache/window.py)."""
        st, buf = self.store, self.buf
        layer_in_store = layer if cache_layer is None else cache_layer
        if self.src.numel():
            st.gather_pages(layer_in_store, self.src, self.dst, self.raw)
        rows = as_bytes(buf)  # (2, pages, block_size, H_kv, row bytes)
        rows[0][self.page, self.off] = as_bytes(encode(k, buf.dtype))
        rows[1][self.page, self.off] = as_bytes(encode(v, buf.dtype))
        st.store(layer_in_store, k, v, self.meta_in.slot_mapping)
        return backend.forward(layer, q, k, v, buf[0], buf[1], self.meta)
