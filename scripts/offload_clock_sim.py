"""The offloaded store's install policy at the 8B shape's 1M row, on a CPU: which decode steps install what, inside the
step (`install_reads`'s clock) or after it (`end_step`'s LRU path).

No model and no copies (`copy_chunks` is replaced by nothing): a real `OffloadedKVCache` with head units (1M tokens,
32 layers, 8 KV heads, the 4 GiB pool's 909,489 slots; a head dim of 1 so that the host tier is small) is driven by
selections shaped like infinitehip 3k-box's at 1M: per layer and KV head, stage 0 keeps 512 chunks of 64 tokens (a
share `--keep` of them kept from the refresh before, the rest random, as random weights churn), rescored every 8
steps; stage 1 keeps 256 of their 1,024 chunks of 32 every 4 steps; stage 2 and the attention 256 chunks of 8 every
step, beside the 256-token sink and the 1,024-token window. What each step reads is marked as the engine marks it
(probes and the attention's reads, `note_reads`), so the stamps, the clock and the LRU see what they see on a GPU.
The selections are synthetic: the counts it prints are the policy's behaviour on them, not a measurement.

    python scripts/offload_clock_sim.py [--slots 909489] [--keep 0.23] [--steps 42]
"""
from __future__ import annotations

import argparse
import time

import torch

import longreach.kvcache.offload as off
from longreach.kvcache.base import PageReads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=909489)
    ap.add_argument("--keep", type=float, default=0.23, help="share of stage 0's chunks kept across a refresh")
    ap.add_argument("--steps", type=int, default=42)
    args = ap.parse_args()
    off.copy_chunks = lambda *a, **k: None  # the policy only
    L, U, bs, ctx = 32, 8, 16, 1 << 20
    st = off.OffloadedKVCache(L, ctx // bs + 64 + 1, args.slots, bs, U, 1, torch.float32, torch.device("cpu"),
                              unit="head")
    table = torch.arange(ctx // bs + 64, dtype=torch.int32)[None]
    seq = torch.zeros(1, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    n64 = ctx // 64

    def pick(cands: torch.Tensor, k: int) -> torch.Tensor:  # k random entries of each row, ascending
        return cands.gather(1, torch.rand(cands.shape, generator=g).argsort(-1)[:, :k]).sort(-1).values

    def fresh0(old: torch.Tensor | None) -> torch.Tensor:
        rows = []
        for h in range(U):
            kept = pick(old[h:h + 1], int(512 * args.keep))[0] if old is not None else torch.empty(0, dtype=torch.long)
            new = torch.randperm(n64 - 32, generator=g) + 16  # past the sink, before the window
            new = new[~torch.isin(new, kept)][: 512 - kept.numel()]
            rows.append(torch.cat([kept, new]).sort().values)
        return torch.stack(rows)

    c0, c1 = [None] * L, [None] * L
    for step in range(args.steps):
        t0 = time.perf_counter()
        pos = torch.tensor([ctx + step])
        for layer in range(L):
            if step % 8 == 0:
                c0[layer] = fresh0(c0[layer])
            ids32 = (c0[layer][:, :, None] * 2 + torch.arange(2)).reshape(U, -1)
            if step % 8 == 0:  # stage 1's new candidates installed before they are scored
                st.install_reads(PageReads(layer, table, seq, pos, pos, 1, ids32[None], 32, 0, 0, probe=True))
            if step % 4 == 0:
                st.note_reads(layer, table, seq, pos, pos, 1, ids32[None], 32, 0, 0)  # stage 1's probes
                c1[layer] = pick(ids32, 256)
            ids8 = (c1[layer][:, :, None] * 4 + torch.arange(4)).reshape(U, -1)
            st.note_reads(layer, table, seq, pos, pos, 1, ids8[None], 8, 0, 0)  # stage 2's probes
            st.note_reads(layer, table, seq, pos, pos, 1, pick(ids8, 256)[None], 8, 256, 1024)  # the attention
        early = int(st._now[0])
        c = st.end_step()
        if c["installed"]:
            print(f"step {step}: installed {c['installed']} (inside the step {early}, after it "
                  f"{c['installed'] - early}), evicted {c['evicted']}, clock hand at {int(st._hand)} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
