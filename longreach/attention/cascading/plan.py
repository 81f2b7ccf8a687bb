"""The cascading cache's per-step plan, made once on the host and shared by every layer: each sequence's strides, each
stride's virtual sequence (sink, cached tokens oldest first, the stride) and attention index, and the insertion plan
of its ring structure (rings.py), packed per stride depth for the whole batch (`SubStride`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..index import QueryBlocks, SparseIndex
from .config import CascadeLayout, CascadingConfig
from .rings import BatchPlan, CascadeRings, batch_plans


@dataclass
class SubStride:
    """One stride of a step for every sequence that has one: everything the layers share (host-planned)."""

    rows: torch.Tensor  # (T_r,) rows of the step's q
    virt_pos: torch.Tensor  # (T_r,) virtual position of each row
    table: torch.Tensor  # (B_r, V_max) int32: virtual position -> flat slot
    index: SparseIndex
    seq_start: torch.Tensor  # (B_r,) first row of each sequence in the stride's compact rows
    seq_len: torch.Tensor  # (B_r,)
    first_pos: torch.Tensor  # (B_r,) virtual position of each sequence's first row
    num_keys: torch.Tensor  # (B_r,) virtual sequence length
    max_keys: int
    max_rows: int
    row_weight: torch.Tensor  # (T_r,) (1 - ema) ema^(n - 1 - i)
    ema_slots: torch.Tensor  # (K,) flat slots whose importance this stride updates (everything but the sink)
    ema_key: torch.Tensor  # (K,) their index in the flattened (B_r * V_max) key mass
    ema_decay: torch.Tensor  # (K,) ema^n for cached tokens, 0 for the stride's new ones
    plan: BatchPlan  # the insertion plan (rings.py: batch_plans)
    prefill: bool
    spans: tuple  # per sequence (first compact row, rows, virtual length), on the host
    bsa_plan: object | None = None  # kernels/bsa.py BSAPlan, built on first use (CUDA)
    singles: list | None = None  # per sequence (seq_start, seq_len, first_pos, num_keys) of one, gathered path


def plan_step(meta, rings_of: dict[int, CascadeRings], tables_seen: dict[int, np.ndarray], cfg: CascadingConfig,
              lay: CascadeLayout, stride: int, block_size: int, device) -> tuple[list[SubStride], torch.Tensor]:
    """Plan the step `meta` (an AttentionMetadata) for every sequence: its strides, each stride's virtual sequence and
    attention index, and the insertion. Mutates `rings_of` (a prefill from token 0 starts a fresh ring structure;
    every sequence's advances past the step's tokens) and `tables_seen` (each sequence's block table). Returns the
    step's sub-strides, one per stride depth, and the rows' true positions (T,)."""
    S, bs = cfg.n_sink, block_size
    sizes = [cfg.subcache_size] * cfg.num_subcaches
    tables = meta.block_tables.cpu().numpy().astype(np.int64)
    per_seq: list[list[dict]] = []
    positions = []
    row0 = 0
    for i, sid in enumerate(meta.seq_ids):
        c, n = meta.context_lens[i], meta.query_lens[i]
        if c == 0:  # a prefill (or re-prefill after preemption) starts a fresh cache
            rings_of[sid] = CascadeRings(S, sizes)
        rings = rings_of.get(sid)
        if rings is None or rings.tokens != c:
            raise RuntimeError(f"cascading: sequence {sid} continues at token {c}, its cache holds "
                               f"{None if rings is None else rings.tokens}")
        table = tables[i]
        tables_seen[sid] = table
        to_flat = (lambda t: lambda loc: t[loc // bs] * bs + loc % bs)(table)
        stage, first_staged = lay.stage_base(c + n), max(c, S)
        subs = []
        for s0 in sorted({c} | set(range(-(-c // stride) * stride, c + n, stride))):
            n_r = min((s0 // stride + 1) * stride, c + n) - s0  # strides aligned to positions
            sink = min(S, s0 + n_r)
            cached = rings.chronological()
            lo = max(s0, S)
            staged = stage + (lo - first_staged) + np.arange(max(0, s0 + n_r - lo), dtype=np.int64)
            virt = np.concatenate([np.arange(sink, dtype=np.int64), cached, staged])
            subs.append(dict(row=row0 + s0 - c, n=n_r, V=len(virt), sink=sink, cached=len(cached),
                             slots=to_flat(virt), plan=rings.plan(n_r, staged), to_flat=to_flat))
        per_seq.append(subs)
        positions.append(np.arange(c, c + n, dtype=np.int64))
        row0 += n
    pos = torch.from_numpy(np.concatenate(positions)).to(device)
    depth = max(len(s) for s in per_seq)
    return [_batch([s[r] for s in per_seq if len(s) > r], meta.is_prefill, cfg, device) for r in range(depth)], pos


def _batch(items: list[dict], prefill: bool, cfg: CascadingConfig, dev) -> SubStride:
    """The stride of depth r of every sequence that has one, packed for the layers."""
    beta = cfg.ema
    B = len(items)
    vmax = max(it["V"] for it in items)
    table = np.zeros((B, vmax), dtype=np.int32)
    rows, virt, weight, e_slots, e_key, e_decay = [], [], [], [], [], []
    for b, it in enumerate(items):
        n, V = it["n"], it["V"]
        table[b, :V] = it["slots"]
        rows.append(it["row"] + np.arange(n))
        virt.append(V - n + np.arange(n))
        weight.append(ema_weights(n, beta))
        keys = np.arange(it["sink"], V)
        e_slots.append(it["slots"][it["sink"]:])
        e_key.append(b * vmax + keys)
        e_decay.append(np.where(keys < it["sink"] + it["cached"], beta ** n, 0.0))
    lens = [it["n"] for it in items]
    bq = cfg.block_q if prefill else 1
    qb = QueryBlocks.build(lens, [it["V"] - it["n"] for it in items], bq)
    # key blocks [n_sink, last row - block_q] of each query block; the window (block_q) covers the rest causally
    lo = cfg.n_sink // cfg.block_k
    last = np.asarray(qb.pos, dtype=np.int64) + np.asarray(qb.length, dtype=np.int64) - 1 - cfg.block_q
    hi = np.where(last >= cfg.n_sink, last // cfg.block_k, lo - 1)
    width = int(max(1, (hi - lo + 1).max(initial=0)))  # at least one (-1) column: no empty tensor for a kernel
    ids = lo + np.arange(width)[None, :]
    ids = np.where(ids <= hi[:, None], ids, -1).astype(np.int32)
    blocks = torch.from_numpy(ids).reshape(qb.num_blocks, 1, width).to(dev)
    index = SparseIndex(bq, cfg.block_k, cfg.n_sink, cfg.block_q, 1, qb, blocks,
                        (blocks >= 0).sum(-1).to(torch.int32))
    starts = np.cumsum([0] + lens[:-1])
    plan = batch_plans([it["plan"] for it in items], [it["to_flat"] for it in items], dev)
    t = lambda x, dt=torch.long: torch.from_numpy(np.concatenate(x)).to(dev, dt)  # noqa: E731
    return SubStride(
        rows=t(rows), virt_pos=t(virt), table=torch.from_numpy(table).to(dev), index=index,
        seq_start=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_len=torch.tensor(lens, dtype=torch.int32, device=dev),
        first_pos=torch.tensor([it["V"] - it["n"] for it in items], dtype=torch.int32, device=dev),
        num_keys=torch.tensor([it["V"] for it in items], dtype=torch.int32, device=dev),
        max_keys=vmax, max_rows=max(lens), row_weight=t(weight, torch.float32),
        ema_slots=t(e_slots), ema_key=t(e_key), ema_decay=t(e_decay, torch.float32),
        plan=plan, prefill=prefill,
        spans=tuple((int(s), it["n"], it["V"]) for s, it in zip(starts, items)))


def ema_weights(n: int, beta: float) -> np.ndarray:
    """Weights of n query rows in one stride's importance update: (1 - beta) beta^(n - 1 - i)."""
    return (1 - beta) * beta ** np.arange(n - 1, -1, -1, dtype=np.float64)
