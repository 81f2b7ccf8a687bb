"""Quest's GPU path (attention/quest/, kernels/key_boxes.py): the page-box build and score kernels in bf16 at 128K
against Quest's bound from every page's min and max, and the engine's Quest (kept page boxes, kernels) against its CPU
reference path. `check_quest_kernels` also runs in the interpreter at small sizes (tests/test_quest.py), so this file's
checks are exercised without a GPU."""
from __future__ import annotations

import gc

import torch

from .common import gpu_and_cpu_tokens, median_us, random_paged_kv, two_tier


def quest_bound_reference(m, q: torch.Tensor, blocks, keys: torch.Tensor) -> torch.Tensor:
    """Quest's page bounds as Quest's paper states them, from every key (L, H_kv, D): per page the element-wise min
    and max, sum_d max(q_d min_d, q_d max_d), max over the block's rows and the group's heads; -inf for pages inside
    the sink or starting at or past the block's window. (nb, G, pages) fp32; `m` a Quest method, blocks its
    BlockQueries."""
    P, L = m.cfg.page_size, keys.shape[0]
    n_pages = -(-L // P)
    padded = torch.cat([keys.float(), keys[-1:].float().expand(n_pages * P - L, *keys.shape[1:])])
    pages = padded.reshape(n_pages, P, *keys.shape[1:])  # padding repeats a real key: the same min and max
    kv = m.kv_of_head.to(keys.device)
    kmin = pages.amin(dim=1)[:, kv].transpose(0, 1)  # (H_q, pages, D)
    kmax = pages.amax(dim=1)[:, kv].transpose(0, 1)
    qs, ok = m.query_rows(q, blocks)  # (nb, R, H_q, D)
    bound = torch.einsum("nrhd,hpd->nhrp", qs.clamp(min=0), kmax) + torch.einsum("nrhd,hpd->nhrp", qs.clamp(max=0),
                                                                                 kmin)
    bound = bound.masked_fill(~ok[:, None, :, None], float("-inf")).amax(dim=2)  # (nb, H_q, pages)
    score = m.group_max(bound)
    ids = torch.arange(n_pages, device=q.device)
    cand_end = m.candidate_end(blocks.ends)
    usable = ((ids + 1) * P > m.cfg.n_sink)[None, :] & (ids[None, :] * P < cand_end[:, None])
    return score.masked_fill(~usable[:, None, :], float("-inf"))


def top_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """The smallest share of the top-k pages by scores a (nb, G, pages) that are among b's, over every (block, group)
    (k at most the row's candidates)."""
    worst = 1.0
    for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)):
        kk = min(k, int(torch.isfinite(y).sum()))
        if kk:
            same = set(x.topk(kk).indices.tolist()) & set(y.topk(kk).indices.tolist())
            worst = min(worst, len(same) / kk)
    return worst


def check_quest_kernels(dev, dtype, L: int, shapes, page: int = 16, prefill: tuple[int, int] = (8, 64),
                        budget: int = 2048, tier=None) -> dict:
    """Per (H_q, H_kv, D) of `shapes`, two sequences of L and L // 3 tokens (partial last pages) in a scrambled paged
    cache in `dtype`: (1) the build kernel boxes pages [0, n) of the first and [n/2, n) of the second, through one tier
    and through `tier(kc, g)` (a two-tier view) when given, against its reference in fp32; (2) Quest's page scores by
    the score kernel from those kept boxes (in `dtype`) against `quest_bound_reference` from the keys, for a decode
    query and a prefill step of prefill[0] blocks of prefill[1] rows then 4 one-row blocks, for each selection
    granularity. Returns the worst relative errors and top-(budget / page) overlap."""
    from longreach.attention.quest import Quest, QuestConfig
    from longreach.attention.sparse.selection import BlockQueries, SequenceKeys
    from longreach.kernels.key_boxes import box_scores_reference, build_boxes_reference, build_boxes_triton

    worst = {"box": 0.0, "bound": 0.0, "kernel": 0.0, "overlap": 1.0}
    for Hq, Hkv, D in shapes:
        g = torch.Generator(device=dev).manual_seed(Hkv)
        lens = [L, L // 3]
        need = [-(-n // page) for n in lens]
        kc, _, tables = random_paged_kv(dev, g, lens, page, Hkv, D, dtype, spare=2)
        args = (torch.tensor(lens, dtype=torch.int32, device=dev), torch.tensor([0, need[1] // 2], dtype=torch.int32,
                device=dev), torch.tensor(need, dtype=torch.int32, device=dev))
        ref = torch.zeros(kc.shape[0], 1, 2, Hkv, D, device=dev)
        build_boxes_reference(kc, tables, *args, tables, ref, 1, page, "minmax")
        written = ref[:, 0, 1].abs().sum((1, 2)) > 0  # the pages boxed (minmax radii are > 0 for random keys)
        for cache in (kc,) if tier is None else (kc, tier(kc, g)):
            store = torch.full(ref.shape, float("nan"), dtype=dtype, device=dev)
            build_boxes_triton(cache, tables, *args, tables, store, 1, page, "minmax", max(need))
            if not torch.equal(torch.isnan(store[:, 0, 0, 0, 0]), ~written):
                raise AssertionError(f"{Hq}/{Hkv}x{D}: the build kernel wrote other pages than its reference")
            err = ((store[written].float() - ref[written]).abs() / ref[written].abs().clamp(min=1.0)).max().item()
            worst["box"] = max(worst["box"], err)
        nb, rows = prefill
        q = torch.randn(nb * rows + 4, Hq, D, device=dev, generator=g).to(dtype)
        starts = [(b * rows, rows, L - nb * rows - 4 + b * rows) for b in range(nb)]  # (first row, rows, position)
        starts += [(nb * rows + i, 1, L - 4 + i) for i in range(4)]
        keys = SequenceKeys(kc, tables[0], L, (store, tables[0], 1))
        dense = SequenceKeys(kc, tables[0], L).dense()
        for gran in ("kv_head", "layer", "head"):
            m = Quest(QuestConfig(page_size=page, budget=budget, n_sink=64, n_window=min(1024, L // 4),
                                  granularity=gran), Hq, Hkv)
            for qq, blocks in ((q[-1:], [(0, 1, L - 1)]), (q, starts)):
                bq = BlockQueries.build(blocks, dev)
                got = m.page_scores(qq, bq, keys)
                want = quest_bound_reference(m, qq, bq, dense)
                fin = torch.isfinite(want)
                if not torch.equal(fin, torch.isfinite(got)):
                    raise AssertionError(f"{Hq}/{Hkv}x{D} {gran}: candidate pages differ from Quest's")
                worst["bound"] = max(worst["bound"], ((got[fin] - want[fin]).abs() /
                                                      want[fin].abs().clamp(min=1.0)).max().item())
                worst["overlap"] = min(worst["overlap"], top_overlap(got, want, budget // page))
                qs, ok = m.query_rows(qq, bq)
                qs = torch.where(ok[:, :, None, None], qs, qs[:, :1]).to(dtype)
                cand_hi = torch.div(m.candidate_end(bq.ends).clamp(min=0) + page - 1, page, rounding_mode="floor")
                view = keys.chunk_boxes(page)
                exact = box_scores_reference(qs, store, tables[0], 1, m.cfg.n_sink // page, cand_hi.int(), view.n,
                                             m.groups)
                exact = exact.reshape(exact.shape[0], m.groups, -1, view.n).amax(dim=2)
                worst["kernel"] = max(worst["kernel"], ((got[fin] - exact[fin]).abs() /
                                                        exact[fin].abs().clamp(min=1.0)).max().item())
    return worst


def test_quest_kernels(detail):
    """Quest's kernels in bf16 at 128K (Llama-8B's and SmolLM2's shapes, pages of 16): the page-box build (one tier
    and two tiers) against its fp32 reference; Quest's page scores from the kept bf16 boxes by the score kernel
    against its reference on the same boxes, and against Quest's bound from the keys' min and max in fp32 (the boxes
    round to bf16: values within 1e-2, top-128 pages of each block and group overlapping >= 0.95); then the time of a
    decode query's scores over 8,192 pages, kernel and reference, at the 8B shape."""
    from longreach.attention.quest import Quest, QuestConfig
    from longreach.attention.sparse.selection import BlockQueries, SequenceKeys

    dev, L, shapes = "cuda", 131072 + 37, ((32, 8, 128), (9, 3, 64))
    worst = check_quest_kernels(dev, torch.bfloat16, L, shapes, tier=lambda kc, g: two_tier(kc, kc, 0.5, g)[0])
    if worst["box"] > 1e-2 or worst["kernel"] > 1e-3 or worst["bound"] > 1e-2 or worst["overlap"] < 0.95:
        raise AssertionError(f"quest kernels: {worst}")
    Hq, Hkv, D = shapes[0]
    g = torch.Generator(device=dev).manual_seed(0)
    n = -(-L // 16)
    kc = torch.randn(n, 16, Hkv, D, device=dev, generator=g).to(torch.bfloat16)
    table = torch.randperm(n, device=dev, generator=g).int()
    store = torch.randn(n, 1, 2, Hkv, D, device=dev, generator=g).to(torch.bfloat16)
    store[:, :, 1] = store[:, :, 1].abs()
    q = torch.randn(1, Hq, D, device=dev, generator=g).to(torch.bfloat16)
    m = Quest(QuestConfig(), Hq, Hkv)
    blocks = BlockQueries.build([(0, 1, L - 1)], dev)
    keys = SequenceKeys(kc, table, L, (store, table, 1))
    kernel_us = median_us(lambda: m.page_scores(q, blocks, keys))
    ref_us = median_us(lambda: quest_bound_reference(m, q, blocks, keys.dense()), reps=10)
    del kc, store
    gc.collect()
    torch.cuda.empty_cache()
    detail(f"bf16 at {L} tokens: box build rel. {worst['box']:.1e} (1-2 tiers), scores kernel vs reference rel. "
           f"{worst['kernel']:.1e}, vs Quest's fp32 bound rel. {worst['bound']:.1e}, top-128 overlap "
           f">= {worst['overlap']:.3f}; a decode query over {n} pages at 8B's shape: {kernel_us:.0f} us (kept boxes, "
           f"kernel) vs {ref_us:.0f} us (bound from the keys, torch)")


def test_quest_engine(gpu_model, detail):
    """Quest end to end on the GPU (page boxes kept per KV page, build and score kernels) vs its CPU reference path
    (the same boxes built and scored by the PyTorch references), fp32, 3K-token prompt with a budget small enough to
    prune; greedy tokens should agree (tests/gpu/test_engine.py's rule for the sparse backends)."""
    from longreach.attention.box_store import PageBoxes

    def kept(llm) -> None:
        if not isinstance(llm.engine.backend.boxes, PageBoxes):
            raise AssertionError("quest with page_size == --block-size keeps no page boxes")
    conf = '{"n_sink": 64, "n_window": 256, "budget": 256, "dense_below": 0}'
    outs = gpu_and_cpu_tokens(gpu_model, "quest", conf, check=kept)
    same = sum(a == b for a, b in zip(*outs))
    if same < 20:
        raise AssertionError(f"quest: GPU kernels and CPU reference agree on only {same}/24 greedy tokens")
    detail(f"quest, kept page boxes: GPU kernels vs CPU reference, fp32, {same}/24 greedy tokens equal")
