"""The box-scored stage 0 (kernels/chunk_box.py on kernels/key_boxes.py's kernels, attention/infinitehip/boxes.py) on
the GPU: the box-build kernel against its reference in bf16 at 128K with the decode-step costs it adds, and
`infinitehip:3k-box` through the engine."""
from __future__ import annotations

import gc

import torch

from .common import llama_inv_freq, median_us, two_tier


def test_box_kernels(detail):
    """The box-build kernel against its reference at real sizes in bf16 (8B and SmolLM2 shapes, 128K tokens, every
    chunk of two sequences, stored and moved flavours, one tier and two tiers), then, at the 8B shape, the time of
    what a step adds per layer: boxing one chunk, and stage 0's box scores over 2,048 chunks by the Triton kernel
    against the torch reference (values, top-k sets, time in CUDA graphs), for a decode query and a prefill step."""
    from longreach.kernels.chunk_box import box_move, box_queries
    from longreach.kernels.key_boxes import (BoxView, box_scores_reference, box_scores_triton, build_boxes_reference,
                                             build_boxes_triton)
    from longreach.rope.strategies import RopeArgs

    dev, L, shapes, page, chunk, per = "cuda", 131072 + 37, ((32, 8, 128), (9, 3, 64)), 16, 64, 16
    notes, worst, build_us = [], 0.0, None
    for Hq, Hkv, D in shapes:
        g = torch.Generator(device=dev).manual_seed(Hkv)
        lens = [L, L // 3]
        need = [-(-n // page) for n in lens]
        perm = torch.randperm(sum(need), device=dev, generator=g).int()
        tables = torch.zeros(2, max(need), dtype=torch.int32, device=dev)
        tables[0, :need[0]], tables[1, :need[1]] = perm[:need[0]], perm[need[0]:]
        kc = torch.randn(sum(need), page, Hkv, D, device=dev, generator=g).to(torch.bfloat16)
        chunks = [-(-n // chunk) for n in lens]
        span = -(-max(chunks) // per)
        box_tables = torch.randperm(2 * span, device=dev, generator=g).view(2, span).int()  # disjoint pages
        lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
        lo = torch.zeros(2, dtype=torch.int32, device=dev)
        hi = torch.tensor(chunks, dtype=torch.int32, device=dev)
        for mode, tiered in (("rt", False), (None, False), ("rt", True)):
            rope = None if mode is None else RopeArgs(mode, llama_inv_freq(D), rope_from=0, n_window=1024)
            cache = two_tier(kc, kc, 0.5, g)[0] if tiered else kc
            got = torch.zeros(2 * span * per, 2, 2, Hkv, D, dtype=torch.bfloat16, device=dev)
            build_boxes_triton(cache, tables, lens_t, lo, hi, box_tables, got, per, chunk, "minmax", max(chunks),
                               box_move(rope))
            ref = torch.zeros(got.shape, dtype=torch.float32, device=dev)
            build_boxes_reference(kc, tables, lens_t, lo, hi, box_tables, ref, per, chunk, "minmax", box_move(rope))
            err = ((got.float() - ref).abs() / ref.abs().clamp(min=1.0)).max().item()
            worst = max(worst, err)
            if err > 1e-2:  # bf16 rounding of the stored centre and radius: 2^-8 relative
                raise AssertionError(f"H={Hq}/{Hkv} D={D} rope={mode} tiered={tiered}: box error {err:.3g}")
        notes.append(f"{Hq}/{Hkv}x{D}")
        if build_us is None:  # the first shape (8B's): one chunk per row, as a decode step boxes
            rope = RopeArgs("rt", llama_inv_freq(D), rope_from=0, n_window=1024)
            one_lo = (hi - 1).contiguous()
            build_us = median_us(lambda: build_boxes_triton(kc, tables, lens_t, one_lo, hi, box_tables, got, per,
                                                            chunk, "minmax", 1, box_move(rope)))
    out = f"build kernel == reference at {L} tokens ({', '.join(notes)}; rt/none, 1-2 tiers), worst rel. {worst:.1e}"
    # decode-step costs at the 8B shape, 128K: one chunk boxed per row (above); stage 0's box scores of one query
    # over every chunk, and of a prefill step's 128 blocks of 64 rows, by the kernel and by the torch reference
    Hq, Hkv, D = shapes[0]
    g = torch.Generator(device=dev).manual_seed(0)
    n_chunks = -(-L // chunk)
    span = -(-n_chunks // per)
    pool = torch.randn(span * per, 2, 2, Hkv, D, device=dev, generator=g).to(torch.bfloat16)
    pool[:, :, 1] = pool[:, :, 1].abs()
    view = BoxView(pool, torch.randperm(span, device=dev, generator=g).int(), per, n_chunks)
    rope = RopeArgs("rt", llama_inv_freq(D), rope_from=65536, n_window=1024)
    times, worst_rel, worst_set = {}, 0.0, 1.0
    for nb, rows in ((1, 1), (128, 64)):
        qs = torch.randn(nb, rows, Hq, D, device=dev, generator=g).to(torch.bfloat16)
        ok = torch.ones(nb, rows, dtype=torch.bool, device=dev)
        cand_end = torch.linspace(40000, L - 1024, nb, device=dev).long()  # some blocks inside rope_from, some past
        q32, q_moved, moved = box_queries(qs, ok, cand_end, rope)
        every = torch.full((nb,), n_chunks, dtype=torch.int32, device=dev)  # every chunk a candidate
        args = (q32, pool, view.table, per, 0, every, n_chunks, Hkv, q_moved, moved)
        kern = lambda: box_scores_triton(*args)  # noqa: E731
        ref = lambda: box_scores_reference(*args)  # noqa: E731
        got, want = kern(), ref()
        worst_rel = max(worst_rel, ((got - want).abs() / want.abs().clamp(min=1.0)).max().item())
        k = 512
        a, b = got.topk(k, -1).indices, want.topk(k, -1).indices
        overlap = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)))
        worst_set = min(worst_set, overlap / a.numel())
        for name, fn in (("kernel", kern), ("torch", ref)):
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            times[(nb, name)] = median_us(graph.replay, reps=20)
    if worst_rel > 2e-2 or worst_set < 0.97:
        raise AssertionError(f"score kernel vs torch: rel. error {worst_rel:.2e}, top-512 overlap {worst_set:.3f}")
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    detail(out + (f"; score kernel == torch (tf32 vs fp32: rel. {worst_rel:.1e}, top-512 overlap {worst_set:.3f}); "
                  f"per layer at 8B/128K: box one chunk {build_us:.1f} us; score {n_chunks} chunks, decode "
                  f"{times[(1, 'kernel')]:.1f} us (torch {times[(1, 'torch')]:.1f}), a prefill step of 128 blocks x 64 "
                  f"rows {times[(128, 'kernel')] / 1000:.2f} ms (torch {times[(128, 'torch')] / 1000:.2f}), graphs"))


def test_box_engine(gpu_model, detail):
    """`infinitehip:3k-box` past the model's trained length (1.5x it: 12K tokens on SmolLM2, 48K on Qwen 0.5B):
    CUDA-graph decode (boxes built and scored inside the graph, the last stage's top-k writing the index in place)
    == eager decode, greedy tokens; a batch of two with a second, short prompt (3,320 tokens)."""
    from longreach import LLM, SamplingParams
    from longreach.models.loader import model_config_of
    from longreach.tools.eval.data import paul_graham_text

    trained = model_config_of(gpu_model).max_position_embeddings
    long = trained + trained // 2
    text = paul_graham_text()
    outs = {}
    for eager in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        # decode graphs vs eager, the prefill eager in both: padded chunk graphs may round otherwise in bf16
        # (test_engine.py's test_chunk_graphs_equal_eager checks them in fp32)
        llm = LLM(gpu_model, attention="infinitehip", preset="3k-box", max_model_len=2 * trained,
                  kv_cache_memory_gb=2, max_num_seqs=4, enforce_eager=eager, chunk_graph_max_tokens=0)
        ids = llm.get_tokenizer().encode(text)
        while len(ids) < long:
            ids = ids + ids
        prompts = [{"prompt_token_ids": ids[:long]}, {"prompt_token_ids": ids[:3320]}]
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            variants = {key for _, key in llm.engine.runner._graphs}
        del llm
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(outs[False], outs[True])]
    if same != [48, 48]:
        raise AssertionError(f"graph vs eager greedy tokens equal: {same} of 48 each")
    boxes = sorted({key[4] for key in variants})  # 0: no chunk completed, 1: one each, 2: a catch-up
    detail(f"graph == eager, 48/48 tokens for both prompts ({long:,}; 3,320), box variants that ran: {boxes}")
