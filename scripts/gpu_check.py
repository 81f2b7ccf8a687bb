"""GPU checks in one run: the kernel test matrix in bf16 at real sizes, then engine checks on a real model.

    python scripts/gpu_check.py --model /tmp/m/model.gguf [--out DIR]

Prints a pass/fail table last (the device tool returns the tail of the output) and writes gpu_check.json.
Each check is isolated: a failure is recorded with its error and the next check still runs.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from longreach.kernels.paged_decode import paged_decode, paged_decode_reference  # noqa: E402
from longreach.rope.strategies import RopeArgs  # noqa: E402

RESULTS: list[dict] = []
ONLY: list[str] | None = None  # --only: run just the checks whose names contain one of these


def check(name):
    def wrap(fn):
        if ONLY and not any(o in name for o in ONLY):
            return fn
        t0 = time.perf_counter()
        try:
            detail = fn()
            ok = True
        except Exception as e:  # noqa: BLE001 - every failure is recorded, the run goes on
            detail = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            ok = False
        RESULTS.append({"check": name, "ok": ok, "detail": detail, "seconds": round(time.perf_counter() - t0, 2)})
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        return fn
    return wrap


def kernel_matrix():
    dev = "cuda"
    cases = []
    for (Hq, Hkv, D) in [(9, 3, 64), (32, 8, 128), (8, 8, 64), (32, 4, 128), (12, 4, 64)]:
        for B, max_len in [(1, 32768 + 17), (4, 4099), (32, 1000)]:
            for page in (16, 64):
                cases.append((B, Hq, Hkv, D, page, max_len))
    worst = 0.0
    for (B, Hq, Hkv, D, page, max_len) in cases:
        g = torch.Generator(device=dev).manual_seed(B * 7 + D + page)
        lens = torch.randint(1, max_len + 1, (B,), device=dev, generator=g)
        lens[0] = max_len
        pps = -(-max_len // page)
        n_pages = B * pps + 5
        tables = torch.randperm(n_pages, device=dev, generator=g)[: B * pps].view(B, pps).int()
        k = torch.randn(n_pages, page, Hkv, D, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(n_pages, page, Hkv, D, device=dev, generator=g, dtype=torch.bfloat16)
        q = torch.randn(B, Hq, D, device=dev, generator=g, dtype=torch.bfloat16)
        for splits in (1, 7, 32):
            ws = (torch.full((B, Hq, splits, D), float("nan"), device=dev),
                  torch.full((B, Hq, splits), float("nan"), device=dev))
            out, lse = paged_decode(q, k, v, tables, lens.int(), D ** -0.5, num_splits=splits, workspace=ws)
            # fp64 reference vs bf16 PyTorch reference: the kernel may be at most ~2x as far from fp64 as torch's bf16
            ref64, _ = paged_decode_reference(q.double(), k.double(), v.double(), tables, lens.int(), D ** -0.5)
            ref16, _ = paged_decode_reference(q, k, v, tables, lens.int(), D ** -0.5)
            err = ((out.double() - ref64).norm() / ref64.norm()).item()
            base = ((ref16.double() - ref64).norm() / ref64.norm()).item()
            if torch.isnan(out).any() or err > 2 * base + 1e-3:
                raise AssertionError(f"B={B} H={Hq}/{Hkv} D={D} page={page} len={max_len} splits={splits}: "
                                     f"rel err {err:.2e} vs torch bf16 {base:.2e}")
            worst = max(worst, err)
    return f"{len(cases) * 3} cases, worst relative error {worst:.2e} (bf16)"


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bsa_matrix():
    """Block-sparse attention kernel vs the PyTorch executor (fp32 math on the same bf16 inputs), real sizes."""
    from longreach.attention.executor import block_sparse_attention
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton

    dev = "cuda"
    worst = 0.0
    n = 0
    for (Hq, Hkv, D) in [(32, 8, 128), (9, 3, 64), (8, 8, 128), (32, 4, 128)]:
        for groups in sorted({1, Hkv, Hq}):
            for decode in (False, True):
                g = torch.Generator(device=dev).manual_seed(Hq + D + groups + decode)
                lens_ctx = [20000, 9000] if decode else [16384 + 37, 0]
                lens_q = [1, 1] if decode else [131, 300]
                L = [c + q for c, q in zip(lens_ctx, lens_q)]
                page = 16
                need = [-(-x // page) for x in L]
                kc = torch.randn(sum(need) + 4, page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
                vc = torch.randn_like(kc)
                perm = torch.randperm(kc.shape[0], device=dev, generator=g).int()
                tables = torch.zeros(2, max(need), dtype=torch.int32, device=dev)
                tables[0, : need[0]], tables[1, : need[1]] = perm[: need[0]], perm[need[0]: need[0] + need[1]]
                q = torch.randn(sum(lens_q), Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
                BQ, BK = (1 if decode else 64), 8
                qb = QueryBlocks.build(lens_q, lens_ctx, BQ)
                sels = []
                for b in range(qb.num_blocks):
                    nblk = -(-L[qb.seq[b]] // BK)
                    sels.append(torch.stack([torch.randperm(nblk, device=dev, generator=g)[: min(256, nblk)]
                                             for _ in range(groups)]))
                blocks, counts = SparseIndex.pack(sels, dev)
                idx = SparseIndex(BQ, BK, 256, 1024, groups, qb, blocks, counts)
                for mode in (("none", "st", "il", "de") if groups == Hkv else ("none",)):
                    rope = None if mode == "none" else RopeArgs(mode, _inv_freq(D), rope_from=0, group=4)
                    ref, _ = block_sparse_attention(q, kc, vc, tables, idx, D ** -0.5, rope=rope)
                    for splits in ((1, 8, 32) if decode else (1,)):
                        out = torch.full_like(q, float("nan"))
                        block_sparse_attention_triton(q, kc, vc, tables, idx, D ** -0.5, num_splits=splits, out=out,
                                                      rope=rope)
                        err = _rel(out, ref)
                        n += 1
                        if torch.isnan(out).any() or err > 1e-2:
                            raise AssertionError(f"H={Hq}/{Hkv} D={D} groups={groups} decode={decode} "
                                                 f"splits={splits} rope={mode}: rel err {err:.2e}")
                        worst = max(worst, err)
    return (f"{n} cases (prefill + decode, groups 1/H_kv/H_q, RoPE none/st/il/de), worst relative error {worst:.2e} "
            "vs fp32 reference")


def _inv_freq(D):
    from longreach.models.config import RopeConfig
    from longreach.rope.scaling import rope_inv_freq

    return rope_inv_freq(RopeConfig(theta=500000.0), D)[0].cuda()


def prune_matrix():
    """Chunk-scoring kernel vs its reference, real sizes, bf16: scores and the top-k sets they induce."""
    from longreach.kernels.prune_stage import chunk_scores_reference, chunk_scores_triton
    from longreach.kvcache.paged import gather_tokens

    dev = "cuda"
    worst_val, worst_set, n = 0.0, 1.0, 0
    for (Hq, Hkv, D) in [(32, 8, 128), (9, 3, 64)]:
        for chunk, exact, rows, L in [(256, False, 64, 65536), (32, False, 64, 20000), (8, True, 64, 20000),
                                      (256, False, 1, 131072), (8, True, 1, 20000), (2, True, 32, 20000)]:
            g = torch.Generator(device=dev).manual_seed(chunk + rows + Hq)
            page = 16
            kc = torch.randn(-(-L // page), page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            table = torch.arange(kc.shape[0], device=dev, dtype=torch.int32)
            nb = 4
            q = torch.randn(nb * rows, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
            starts = torch.arange(nb, device=dev) * rows
            lens = torch.full((nb,), rows, device=dev)
            cand_end = torch.full((nb,), L - 1024, device=dev)
            C = min(1024, (L - 1024) // chunk)
            ids = torch.stack([torch.randperm((L - 1024) // chunk, device=dev, generator=g)[:C] for _ in range(nb * Hkv)])
            ids = ids.view(nb, Hkv, C)
            mode = ("rt", "ci", "de")[n % 3] if Hq == 9 else "none"  # SmolLM2's shape with the pruning strategies
            if mode == "ci":
                ids = ids.sort(-1).values  # ci numbers candidates in position order, as the stages produce them
            rope = None if mode == "none" else RopeArgs(mode, _inv_freq(D), rope_from=0, group=4, n_window=1024)
            got = chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, exact, 256, Hkv, rope=rope)
            keys = gather_tokens(kc, table, L)
            r = torch.arange(rows, device=dev)
            qs = q[(starts[:, None] + r)].reshape(nb, rows, Hq, D)
            ref = chunk_scores_reference(qs, torch.ones(nb, rows, dtype=torch.bool, device=dev), keys, ids.long(),
                                         chunk, exact, 256, cand_end, Hkv, rope=rope)
            fin = torch.isfinite(ref)
            if not torch.equal(torch.isfinite(got), fin):
                raise AssertionError(f"chunk={chunk} rows={rows}: different invalid chunks")
            rel = ((got[fin] - ref[fin]).abs() / ref[fin].abs().clamp(min=1.0))
            frac_off = (rel > 0.05).float().mean().item()  # SelectRep branches decided by bf16 near-ties
            k = max(1, C // 8)
            top_got = got.topk(k, dim=-1).indices.sort(-1).values
            top_ref = ref.topk(k, dim=-1).indices.sort(-1).values
            overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in
                          zip(top_got.flatten(0, 1), top_ref.flatten(0, 1))) / top_ref.numel()
            n += 1
            if frac_off > 0.02 or overlap < 0.97:
                raise AssertionError(f"H={Hq}/{Hkv} chunk={chunk} exact={exact} rows={rows} rope={mode}: {frac_off:.1%} scores "
                                     f"off by >5%, top-k overlap {overlap:.3f}")
            worst_val = max(worst_val, frac_off)
            worst_set = min(worst_set, overlap)
    return (f"{n} cases (SmolLM2's shape with rt/ci/de), at most {worst_val:.2%} of scores off by >5% (SelectRep ties), "
            f"top-k overlap >= {worst_set:.3f}")


def minference_matrix():
    """MInference: the range/column kernel vs the PyTorch executor (fp32 math on the same bf16 inputs) at real sizes,
    per head and per KV group, every pattern kind mixed in one layer, a chunk after a long prefix + a whole prompt."""
    from longreach.attention.executor import range_attention
    from longreach.attention.index import QueryBlocks
    from longreach.attention.minference import MInference, MInferenceConfig, index_cost
    from longreach.kernels.vertical_slash import range_attention_triton

    dev = "cuda"
    worst, n, costs = 0.0, 0, []
    for (Hq, Hkv, D) in [(32, 8, 128), (9, 3, 64)]:
        for gran in ("head", "kv_head"):
            G = Hq if gran == "head" else Hkv
            mix = [("vertical_slash", 500, 1500), ("a_shape", 1024, 4096), ("block_sparse", 100),
                   ("vertical_slash", 3000, 200)]
            pats = [mix[i % len(mix)] for i in range(G)]
            g = torch.Generator(device=dev).manual_seed(Hq + G)
            lens_ctx, lens_q = [40000, 0], [2048 + 37, 9000]
            L = [c + q for c, q in zip(lens_ctx, lens_q)]
            page = 16
            need = [-(-x // page) for x in L]
            kc = torch.randn(sum(need) + 4, page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            vc = torch.randn_like(kc)
            perm = torch.randperm(kc.shape[0], device=dev, generator=g).int()
            tables = torch.zeros(2, max(need), dtype=torch.int32, device=dev)
            tables[0, : need[0]], tables[1, : need[1]] = perm[: need[0]], perm[need[0]: need[0] + need[1]]
            q = torch.randn(sum(lens_q), Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
            m = MInference(MInferenceConfig(granularity=gran), Hq, Hkv)
            qb = QueryBlocks.build(lens_q, lens_ctx, 64)
            tiles, cols, row0 = [], [], 0
            for i, nq in enumerate(lens_q):
                blocks = [(qb.start[b] - row0, qb.length[b], qb.pos[b]) for b in qb.of_sequence(i)]
                t, c = m.build(0, q[row0:row0 + nq], blocks, (kc, tables[i]), L[i], D ** -0.5, patterns=pats)
                tiles.append(t)
                cols.append(c)
                row0 += nq
            idx = m.index(qb, tiles, cols)
            ref, _ = range_attention(q, kc, vc, tables, idx, D ** -0.5)
            out = torch.full_like(q, float("nan"))
            range_attention_triton(q, kc, vc, tables, idx, D ** -0.5, out=out)
            err = _rel(out, ref)
            n += 1
            costs.append(index_cost(idx))
            if torch.isnan(out).any() or err > 1e-2:
                raise AssertionError(f"H={Hq}/{Hkv} D={D} granularity={gran}: rel err {err:.2e}")
            worst = max(worst, err)
    return (f"{n} cases (per head / per KV group, Λ + vertical-slash + block-sparse in one layer), worst relative "
            f"error {worst:.2e} vs fp32 reference; kernel keys/row {min(costs):.0f}-{max(costs):.0f}")


def minference_engine(model: str):
    """minference end to end: kernels vs the CPU reference (greedy tokens), and minference prefill + infinitehip
    decode with CUDA graphs == eager."""
    from longreach import LLM, SamplingParams
    from longreach.eval.data import paul_graham_text

    text = open(".carry/b/pg.txt").read() if os.path.exists(".carry/b/pg.txt") else paul_graham_text()
    conf = '{"pattern": ["vertical_slash", 64, 512], "dense_below": 0}'
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for device, dtype in (("cuda", "float32"), ("cpu", "float32")):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention="minference", attention_config=conf, device=device, dtype=dtype,
                  max_model_len=4096, kv_cache_memory_gb=1, max_num_seqs=1)
        ids = llm.get_tokenizer().encode(text)[:3000]
        outs.append(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids)
        del llm
    same = sum(a == b for a, b in zip(*outs))
    if same < 20:
        raise AssertionError(f"minference: GPU kernels and CPU reference agree on only {same}/24 greedy tokens")
    composed = []
    for eager in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention="minference", attention_config=conf, decode_attention="infinitehip",
                  max_model_len=16384, kv_cache_memory_gb=2, max_num_seqs=4, enforce_eager=eager)
        ids = llm.get_tokenizer().encode(text)[:12000]
        composed.append(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids)
        del llm
    if composed[0] != composed[1]:
        raise AssertionError("minference + infinitehip decode: CUDA-graph tokens differ from eager")
    return f"kernels vs CPU reference {same}/24 tokens; minference + infinitehip decode at 12K: graph == eager"


def engine_checks(model: str):
    from longreach import LLM, SamplingParams

    def fresh(**kw):  # a fixed KV pool so that several engines fit on the GPU one after another
        gc.collect()
        torch.cuda.empty_cache()
        return LLM(model, max_num_seqs=32, kv_cache_memory_gb=4, **kw)

    llm = fresh()
    prompts = ["The history of the Roman Empire", "def quicksort(arr):", "Photosynthesis is " * 40,
               "Once upon a time, " * 100]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    graphed = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    eager = fresh(enforce_eager=True)
    eager_out = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(graphed, eager_out))
    if same != len(prompts):
        raise AssertionError(f"CUDA-graph decode differs from eager on {len(prompts) - same}/{len(prompts)} prompts")
    del eager
    chunked = fresh(max_num_batched_tokens=128)
    chunk_out = [o.token_ids for o in chunked.generate(prompts, params, use_tqdm=False)]
    agree = sum(a == b for a, b in zip(graphed, chunk_out))
    return f"graph == eager on {same}/{len(prompts)}; chunked-prefill (128) == unchunked on {agree}/{len(prompts)}"


def sparse_engine(model: str):
    """Each sparse backend end to end on the GPU (kernels) vs the same backend's CPU reference path, 3K-token prompt
    with small budgets so that selection prunes; greedy tokens should agree."""
    from longreach import LLM, SamplingParams
    from longreach.eval.data import paul_graham_text

    cfg = {"infinitehip": '{"n_sink": 64, "n_window": 256, "budgets": [2048, 1024, 256], "early_last_budget": 512}',
           "hip": '{"n_sink": 64, "n_window": 256, "budget": 256}',
           "streaming": '{"n_sink": 64, "n_window": 512}'}
    text = open(".carry/b/pg.txt").read() if os.path.exists(".carry/b/pg.txt") else paul_graham_text()
    rows = []
    for name, conf in cfg.items():
        outs = []
        for device, dtype in (("cuda", "float32"), ("cpu", "float32")):
            gc.collect()
            torch.cuda.empty_cache()
            llm = LLM(model, attention=name, attention_config=conf, device=device, dtype=dtype, max_model_len=4096,
                      kv_cache_memory_gb=1, max_num_seqs=1)
            ids = llm.get_tokenizer().encode(text)[:3000]
            outs.append(llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24,
                                                                               ignore_eos=True), use_tqdm=False)[0])
            del llm
        same = sum(a == b for a, b in zip(outs[0].token_ids, outs[1].token_ids))
        rows.append(f"{name} {same}/24")
        if same < 20:
            raise AssertionError(f"{name}: GPU kernels and CPU reference agree on only {same}/24 greedy tokens")
    return "GPU kernels vs CPU reference, fp32, greedy tokens equal: " + ", ".join(rows)


def fp32_parity(model: str):
    from transformers import AutoModelForCausalLM

    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine

    gc.collect()
    torch.cuda.empty_cache()
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", kv_cache_memory_gb=4))
    ids = eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    ours = eng.prompt_logits(ids)
    d, f = os.path.split(model)
    hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    diff = (ours - ref).abs().max().item()
    if diff > 1e-2:
        raise AssertionError(f"max |logit diff| {diff:.2e}")
    return f"fp32 on GPU, {len(ids)} tokens: max |logit diff| vs transformers {diff:.2e}"


def _tier(kc, vc, share, g):
    """A two-tier copy of one-tier caches kc/vc (P, page, H_kv, D): host pinned, `share` of the pages resident in a
    pool at random slots (the rest read over PCIe)."""
    from longreach.kvcache.offload import TierView

    P = kc.shape[0]
    res = torch.randperm(P, device=kc.device, generator=g)[: int(P * share)]
    S = res.numel() + 3
    slot = torch.randperm(S, device=kc.device, generator=g)[: res.numel()]
    slots = torch.full((P,), -1, dtype=torch.int32, device=kc.device)
    slots[res] = slot.int()
    views = []
    for c in (kc, vc):
        pool = torch.randn(S + 1, *c.shape[1:], device=c.device, generator=g).to(c.dtype)  # other slots: junk
        pool[slot] = c[res]
        views.append(TierView(pool, c.cpu().pin_memory(), slots))
    return views


def offload_kernels():
    """Every kernel reading through the page table (resident slots + pinned host pages over UVA) gives bit-identical
    results to the same kernel on the one-tier cache; the copy kernels are bit-exact; a captured graph reads the
    page table's current contents at replay."""
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import BSAPlan, block_sparse_attention_triton
    from longreach.kernels.offload_copy import copy_chunks, scatter_rows
    from longreach.kernels.prune_stage import chunk_scores_triton
    from longreach.kvcache.fp8 import encode

    dev = "cuda"
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        g = torch.Generator(device=dev).manual_seed(3)
        Hq, Hkv, D, page = 32, 8, 128, 16
        L = [131072 + 5, 40000]
        need = [-(-x // page) for x in L]
        P = sum(need) + 2
        # fp8 caches hold rows of D values + their scale (kvcache/fp8.py): encode() writes that format
        kc = encode(torch.randn(P, page, Hkv, D, device=dev, generator=g), dtype)
        vc = encode(torch.randn(P, page, Hkv, D, device=dev, generator=g), dtype)
        perm = torch.randperm(P, device=dev, generator=g).int()
        tables = torch.zeros(2, max(need), dtype=torch.int32, device=dev)
        tables[0, :need[0]], tables[1, :need[1]] = perm[:need[0]], perm[need[0]:need[0] + need[1]]
        kt, vt = _tier(kc, vc, 0.3, g)
        for decode in (True, False):
            lens_q = [1, 1] if decode else [64, 200]
            ctx = [x - q for x, q in zip(L, lens_q)]
            q = torch.randn(sum(lens_q), Hq, D, device=dev, generator=g, dtype=torch.bfloat16)
            qb = QueryBlocks.build(lens_q, ctx, 1 if decode else 64)
            sels = [torch.stack([torch.randperm(-(-L[qb.seq[b]] // 64), device=dev, generator=g)[:48]
                                 for _ in range(Hkv)]) for b in range(qb.num_blocks)]
            blocks, counts = SparseIndex.pack(sels, dev)
            idx = SparseIndex(1 if decode else 64, 64, 256, 1024, Hkv, qb, blocks, counts)
            for splits in ((1, 8) if decode else (1,)):
                a, _ = block_sparse_attention_triton(q, kc, vc, tables, idx, D ** -0.5, num_splits=splits)
                b, _ = block_sparse_attention_triton(q, kt, vt, tables, idx, D ** -0.5, num_splits=splits)
                if not torch.equal(a, b):
                    raise AssertionError(f"bsa {dtype} decode={decode} splits={splits}: tiered != one-tier")
        if dtype == torch.bfloat16:
            from longreach.kernels.paged_decode import paged_decode

            q = torch.randn(2, Hq, D, device=dev, generator=g, dtype=dtype)
            sl = torch.tensor(L, dtype=torch.int32, device=dev)
            a, _ = paged_decode(q, kc, vc, tables, sl, D ** -0.5, num_splits=16)
            b, _ = paged_decode(q, kt, vt, tables, sl, D ** -0.5, num_splits=16)
            if not torch.equal(a, b):
                raise AssertionError("paged decode: tiered != one-tier")
            ids = torch.arange(0, L[0] // 64, device=dev, dtype=torch.int32)[None, None].expand(1, Hkv, -1)
            qs = torch.randn(1, Hq, D, device=dev, generator=g, dtype=dtype)
            one = torch.zeros(1, dtype=torch.long, device=dev)
            for exact, chunk in ((False, 64), (True, 32)):
                i2 = ids if not exact else torch.arange(0, L[0] // 32, device=dev, dtype=torch.int32)[None, None].expand(
                    1, Hkv, -1)
                a = chunk_scores_triton(qs, kc, tables[0], one, one + 1, torch.tensor([L[0] - 1024], device=dev), i2,
                                        chunk, exact, 256, Hkv, max_rows=1)
                b = chunk_scores_triton(qs, kt, tables[0], one, one + 1, torch.tensor([L[0] - 1024], device=dev), i2,
                                        chunk, exact, 256, Hkv, max_rows=1)
                if not torch.equal(a, b):
                    raise AssertionError(f"chunk scores exact={exact}: tiered != one-tier")
        # copy kernels: host pages -> GPU, GPU rows -> host
        src = kc.cpu().pin_memory()
        si = torch.randperm(P, device=dev, generator=g)[:4096]
        di = torch.randperm(P, device=dev, generator=g)[:4096]
        dst = torch.zeros_like(kc)
        copy_chunks(src, si, dst, di, kc[0].numel())
        if not torch.equal(dst[di].view(torch.uint8), kc[si].view(torch.uint8)):
            raise AssertionError(f"copy_chunks {dtype} not bit-exact")
        host = torch.zeros(P * page, Hkv, D, dtype=dtype).pin_memory()
        r = torch.randperm(P * page, device=dev, generator=g)[:5000]
        new = torch.randn(5000, Hkv, D, device=dev, generator=g).to(dtype)
        scatter_rows(host, r, new)
        torch.cuda.synchronize()
        if not torch.equal(host[r.cpu()].view(torch.uint8), new.cpu().view(torch.uint8)):
            raise AssertionError(f"scatter_rows {dtype} not bit-exact")
        rows.append(str(dtype).replace("torch.", ""))
    # graph capture: the page table is read at replay
    g = torch.Generator(device=dev).manual_seed(4)
    kc = torch.randn(4000, 16, 8, 128, device=dev, generator=g, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kt, vt = _tier(kc, vc, 0.5, g)
    tables = torch.randperm(4000, device=dev, generator=g).int()[None]
    qb = QueryBlocks.build([1], [64000 - 1], 1)
    sel = [torch.stack([torch.randperm(1000, device=dev, generator=g)[:48] for _ in range(8)])]
    blocks, counts = SparseIndex.pack(sel, dev)
    idx = SparseIndex(1, 64, 256, 1024, 8, qb, blocks, counts)
    q = torch.randn(1, 32, 128, device=dev, generator=g, dtype=torch.bfloat16)
    plan = BSAPlan(idx, 32, 8, dev)  # host-to-device copies are not allowed while capturing
    ref, _ = block_sparse_attention_triton(q, kc, vc, tables, idx, 128 ** -0.5, num_splits=8, plan=plan)
    out, _ = block_sparse_attention_triton(q, kt, vt, tables, idx, 128 ** -0.5, num_splits=8, plan=plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = block_sparse_attention_triton(q, kt, vt, tables, idx, 128 ** -0.5, num_splits=8, plan=plan)
    kt.slots[: 2000] = -1  # evict half the table: those pages now come from the host
    graph.replay()
    torch.cuda.synchronize()
    if not torch.equal(out, ref):
        raise AssertionError("captured tiered bsa differs after the page table changed")
    return f"bsa (prefill, decode), paged decode, chunk scores: tiered == one-tier bit for bit ({', '.join(rows)}); " \
           "copy kernels exact; graph replay follows the page table"


def fused_kernels():
    """kernels/fused.py and kernels/kv_store.py at Llama-8B sizes in bf16 against the PyTorch code they replace:
    RoPE and the residual sums bit for bit, RMSNorm and SiLU * up within one bf16 unit on a few elements; the KV
    write (one tier bf16 / fp8, two tiers with pinned host pages over UVA) byte for byte with the CPU path."""
    from longreach.kernels import fused
    from longreach.kvcache.fp8 import FP8
    from longreach.kvcache.offload import OffloadedKVCache
    from longreach.kvcache.paged import PagedKVCache

    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(11)
    worst = {}
    for T in (1, 7, 4096):
        x = torch.randn(T, 4096, device=dev, generator=g).to(bf)
        r = torch.randn(T, 4096, device=dev, generator=g).to(bf)
        w = (1 + 0.1 * torch.randn(4096, device=dev, generator=g)).to(bf)
        out, s = fused.add_rms_norm(x, r, w, 1e-5)
        ref, s_ref = fused.add_rms_norm_reference(x, r, w, 1e-5)
        if not torch.equal(s, s_ref):
            raise AssertionError(f"add_rms_norm T={T}: residual sum differs")
        gu = (torch.randn(T, 2 * 14336, device=dev, generator=g) * 3).to(bf)
        for name, a, b in (("rms_norm", out, ref), ("silu_mul", fused.silu_mul(gu), fused.silu_mul_reference(gu))):
            diff = (a.float() - b.float()).abs()
            ulp = torch.finfo(bf).eps * b.float().abs()
            if bool((diff > 1.01 * ulp + 1e-30).any()):
                raise AssertionError(f"{name} T={T}: beyond one bf16 unit, max |diff| {diff.max():.3g}")
            worst[name] = max(worst.get(name, 0.0), (diff > 0).float().mean().item())
        qkv = torch.randn(T, 48 * 128, device=dev, generator=g).to(bf)
        pos = torch.randint(0, 1 << 20, (T,), device=dev, generator=g).float()
        ang = pos[:, None] * (500000.0 ** (-torch.arange(0, 128, 2, device=dev).float() / 128))[None]
        cos, sin = ang.cos().to(bf), ang.sin().to(bf)
        qk = qkv[:, :40 * 128].view(T, 40, 128)
        ref = fused.rope_reference(qk.clone(), cos, sin)
        fused.rope_qk_(qk, cos, sin)
        if not torch.equal(qk, ref):
            raise AssertionError(f"rope T={T}: not bit-exact")
    # the KV write: the kernel on the GPU vs the PyTorch path on CPU copies
    L, P, S, bs, H, D, T = 2, 300, 40, 16, 8, 128, 1000
    qkv = torch.randn(T, 48 * 128, device=dev, generator=g).to(bf)
    k, v = qkv[:, 32 * 128:40 * 128].view(T, H, D), qkv[:, 40 * 128:].view(T, H, D)
    slots = torch.randperm(P * bs, device=dev, generator=g)[:T]
    for cdt in (bf, FP8):
        gpu = PagedKVCache(L, P, bs, H, D, cdt, torch.device(dev))
        cpu = PagedKVCache(L, P, bs, H, D, cdt, torch.device("cpu"))
        gpu.kv.view(torch.uint8).fill_(3)
        cpu.kv.view(torch.uint8).fill_(3)
        gpu.store(1, k, v, slots)
        cpu.store(1, k.cpu(), v.cpu(), slots.cpu())
        if not torch.equal(gpu.kv.cpu().view(torch.uint8), cpu.kv.view(torch.uint8)):
            raise AssertionError(f"one-tier KV write {cdt}: bytes differ from the PyTorch path")
        off = OffloadedKVCache(L, P, S, bs, H, D, cdt, torch.device(dev))
        ref = OffloadedKVCache(L, P, S, bs, H, D, cdt, torch.device("cpu"))
        res = torch.randperm(P, device=dev, generator=g)[:S]
        for c in (off, ref):
            c.host.view(torch.uint8).fill_(5)
            c.slot_of[1, res.to(c.slot_of.device)] = torch.arange(S, dtype=torch.int32, device=c.slot_of.device)
        off.store(1, k, v, slots)
        ref.store(1, k.cpu(), v.cpu(), slots.cpu())
        torch.cuda.synchronize()
        if not torch.equal(off.host.view(torch.uint8), ref.host.view(torch.uint8)):
            raise AssertionError(f"two-tier KV write {cdt}: host bytes differ")
        if not torch.equal(off.pool[:S].cpu().view(torch.uint8), ref.pool[:S].view(torch.uint8)):
            raise AssertionError(f"two-tier KV write {cdt}: resident slots differ")
    # marking the pages a decode step reads: the GPU kernel vs the PyTorch path on CPU copies
    L, P, W, nb, G, K = 32, 70000, 65536, 64, 8, 256
    tables = torch.randint(0, P - 1, (2, W), device=dev, generator=g, dtype=torch.int32)
    seq = torch.randint(0, 2, (nb,), device=dev, generator=g)
    last = torch.randint(0, W * 16, (nb,), device=dev, generator=g)
    blocks = torch.randint(-1, W * 2, (nb, G, K), device=dev, generator=g, dtype=torch.int32)
    gpu = OffloadedKVCache(L, P, 8, 16, 8, 128, bf, torch.device(dev))
    cpu = OffloadedKVCache(L, P, 8, 16, 8, 128, bf, torch.device("cpu"))
    for st, d in ((gpu, dev), (cpu, "cpu")):
        st.note_reads(5, tables.to(d), seq.to(d), last.to(d), last.to(d), 1, blocks.to(d), 8, 64, 1024)
    want = cpu.wanted.clone()
    want[-1] = False
    if not torch.equal(gpu.wanted.cpu(), want):
        raise AssertionError("note_reads: the GPU kernel marks other pages than the PyTorch path")
    return (f"RoPE and residual sums bit-exact; RMSNorm / SiLU*up within one bf16 unit on "
            f"{100 * worst['rms_norm']:.2f}% / {100 * worst['silu_mul']:.2f}% of elements; KV write bf16 and fp8, "
            "one and two tiers, byte-equal to the PyTorch path; note_reads marks the same pages")


def offload_engine(model: str, length: int = 131072):
    """SmolLM2 at `length` with infinitehip: offloaded (GPU pool = 1/8 of the KV) == not offloaded, greedy tokens and
    prompt logits bit for bit; hit ratio and decode tok/s of both."""
    from longreach import LLM, SamplingParams
    from longreach.eval.data import paul_graham_text

    text = open(".carry/b/pg.txt").read() if os.path.exists(".carry/b/pg.txt") else paul_graham_text()
    res = {}
    kv_gb = length * 30 * 3 * 64 * 2 * 2 / 2**30
    for name, kw in (("gpu", {"kv_cache_memory_gb": kv_gb * 1.1 + 0.2}),
                     ("offload", {"kv_cache_memory_gb": kv_gb / 8, "kv_offloading_size": kv_gb * 1.1 + 0.2}),
                     ("offload-fp8", {"kv_cache_memory_gb": kv_gb / 8, "kv_offloading_size": kv_gb * 1.1 + 0.2,
                                      "kv_cache_dtype": "fp8"})):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention="infinitehip", max_model_len=length + 256, max_num_seqs=2,
                  max_num_batched_tokens=16384, **kw)
        tok = llm.get_tokenizer()
        ids = tok.encode(text)
        ids = (ids * (length // len(ids) + 1))[: length - 64] + tok.encode("\nSummarise the text above.")
        p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        m = out.metrics
        logits = llm.engine.prompt_logits(ids[:20000])[-8:]
        res[name] = dict(tokens=out.token_ids, prefill_s=m.prefill_seconds, tok_s=m.decode_tokens_per_s,
                         wall=wall, hit=m.kv_pages_hit, miss=m.kv_pages_missed, logits=logits.cpu(),
                         stats=llm.engine.kv_cache_stats())
        if name.startswith("offload"):
            llm.engine.kv_cache.check_integrity()
        del llm
    a, b = res["gpu"], res["offload"]
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    if same != len(a["tokens"]) or not torch.equal(a["logits"], b["logits"]):
        raise AssertionError(f"offload differs: {same}/{len(a['tokens'])} tokens equal, logits equal "
                             f"{torch.equal(a['logits'], b['logits'])}")
    hit = b["hit"] / max(1, b["hit"] + b["miss"])
    f8 = res["offload-fp8"]
    f8_same = sum(x == y for x, y in zip(a["tokens"], f8["tokens"]))
    return (f"fp8 offloaded: {f8_same}/{len(a['tokens'])} greedy tokens as bf16, {f8['tok_s']:.1f} tok/s; "
            f"{length} tokens, pool 1/8 of the KV: tokens {same}/{len(a['tokens'])} and logits equal; prefill "
            f"{a['prefill_s']:.2f} s -> {b['prefill_s']:.2f} s, decode {a['tok_s']:.1f} -> {b['tok_s']:.1f} tok/s, "
            f"hit ratio {hit:.3f}, installed {b['stats']['pages_installed']} pages")


def cascading_kernels():
    """Cascading: the block-sparse kernel with RoPE strategy "cache" over one-token pages (a virtual sequence: sink,
    cached tokens, chunk) and the key-mass kernel vs their PyTorch references, bf16 inputs, real sizes."""
    from longreach.attention.executor import block_sparse_attention
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton
    from longreach.kernels.key_mass import key_mass_reference, key_mass_triton

    dev = "cuda"
    worst_o, worst_m, n = 0.0, 0.0, 0
    for (Hq, Hkv, D) in [(9, 3, 64), (32, 8, 128)]:
        for rows, cached, B in [(1024, 16384 + 64, 1), (1, 65536 + 64, 4)]:
            g = torch.Generator(device=dev).manual_seed(Hq + rows)
            V = cached + rows
            nslots = B * V + 7
            kc = torch.randn(nslots, 1, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
            vc = torch.randn_like(kc)
            table = torch.randperm(nslots, device=dev, generator=g)[: B * V].view(B, V).int()
            q = torch.randn(B * rows, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
            bq, S, BK = (64 if rows > 1 else 1), 64, 64
            qb = QueryBlocks.build([rows] * B, [cached] * B, bq)
            sel = [torch.arange(S // BK, max(S // BK, (p + ln - 1 - 64) // BK + 1), device=dev)[None]
                   for p, ln in zip(qb.pos, qb.length)]
            blocks, counts = SparseIndex.pack(sel, dev)
            idx = SparseIndex(bq, BK, S, 64, 1, qb, blocks, counts)
            rope = RopeArgs("cache", _inv_freq(D), 0)
            ref, lse_ref = block_sparse_attention(q, kc, vc, table, idx, D ** -0.5, rope=rope)
            out = torch.full_like(q, float("nan"))
            splits = 1 if rows > 1 else 16
            block_sparse_attention_triton(q, kc, vc, table, idx, D ** -0.5, num_splits=splits, rope=rope, out=out)
            worst_o = max(worst_o, _rel(out, ref))
            args = (q, kc, table, torch.arange(B, device=dev) * rows, torch.full((B,), rows, device=dev),
                    torch.full((B,), cached, device=dev), torch.full((B,), V, device=dev), lse_ref,
                    torch.rand(B * rows, device=dev, generator=g), D ** -0.5, rope)
            mref = key_mass_reference(*args)
            mgot = key_mass_triton(*args)
            worst_m = max(worst_m, _rel(mgot, mref))
            n += 1
            if torch.isnan(out).any() or worst_o > 2e-2 or worst_m > 2e-2:
                raise AssertionError(f"H={Hq}/{Hkv} D={D} rows={rows} keys={V}: attention rel err {worst_o:.2e}, "
                                     f"key mass rel err {worst_m:.2e}")
    return f"{n} cases (prefill 1024 rows x 17K keys, decode x4 over 65K), worst rel err attention {worst_o:.2e}, " \
           f"key mass {worst_m:.2e} (bf16 vs fp32 reference)"


CASCADE_SMALL = '{"n_sink": 64, "num_subcaches": 4, "subcache_size": 256, "stride": 512}'  # 1,088 tokens: drops


def cascading_engine(model: str):
    """Cascading through the engine on the GPU (Triton kernels) vs the CPU reference path: a 3K-token prompt with a
    1,088-token cache (hundreds of drops), 24 greedy tokens."""
    from longreach import LLM, SamplingParams
    from longreach.eval.data import paul_graham_text

    text = open(".carry/b/pg.txt").read() if os.path.exists(".carry/b/pg.txt") else paul_graham_text()
    outs = []
    for device in ("cuda", "cpu"):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention="cascading", attention_config=CASCADE_SMALL, device=device, dtype="float32",
                  max_model_len=4096, max_num_seqs=1, kv_cache_memory_gb=1)
        ids = llm.get_tokenizer().encode(text)[:3000]
        outs.append(llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=24,
                                                                           ignore_eos=True), use_tqdm=False)[0])
        llm.engine.backend.check_integrity()
        del llm
    same = sum(a == b for a, b in zip(outs[0].token_ids, outs[1].token_ids))
    if same < 20:
        raise AssertionError(f"cascading: GPU kernels and CPU reference agree on only {same}/24 greedy tokens")
    return f"GPU kernels vs CPU reference, fp32, {same}/24 greedy tokens equal"


def cascading_passkey(model: str, lengths=(8192, 16384, 32768, 65536), depths=(0.05, 0.25, 0.5, 0.75, 0.95),
                      seeds=2):
    """Passkey: cascading `4k` (64 sink + 4 x 1008) vs streaming with the same memory (64 sink + 4032 window) at
    growing lengths, every depth (the blog's experiment at SmolLM2's scale; the blog: 65K cache to 1M on a larger
    model). Reports accuracy per length and depth and prefill seconds; quality is measured, not asserted."""
    from longreach import LLM, SamplingParams
    from longreach.eval.passkey import passkey_prompt, score

    rows = {}
    for name, conf in (("cascading:4k", ("cascading", None)),
                       ("streaming:4096", ("streaming", '{"n_sink": 64, "n_window": 4032}'))):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(model, attention=conf[0], preset="4k" if conf[0] == "cascading" else None, attention_config=conf[1],
                  max_model_len=max(lengths) + 16, max_num_seqs=4, kv_cache_memory_gb=8 if conf[0] == "streaming"
                  else 2, max_num_batched_tokens=8192)
        tok = llm.get_tokenizer()
        acc, secs = {}, {}
        for n in lengths:
            t0 = time.perf_counter()
            for d in depths:
                prompts, keys = [], []
                for s in range(seeds):
                    ids, key = passkey_prompt(tok, n, d, s)
                    prompts.append({"prompt_token_ids": ids})
                    keys.append(key)
                outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
                acc[(n, d)] = sum(score(o.text, k) for o, k in zip(outs, keys)) / seeds
            secs[n] = round((time.perf_counter() - t0) / (len(depths) * seeds), 2)
        rows[name] = (acc, secs)
        del llm
    lines = []
    for name, (acc, secs) in rows.items():
        per_len = ", ".join(f"{n // 1024}K " + "/".join(f"{acc[(n, d)]:.1f}" for d in depths) +
                            f" ({secs[n]} s)" for n in lengths)
        lines.append(f"{name}: {per_len}")
    return f"depths {list(depths)}, {seeds} keys per cell: " + "; ".join(lines)


def cascading_prefill(model: str, lengths=(131072, 1048576)):
    """Prefill time of cascading `16k` (64 sink + 8 x 2040, stride 4096) through the engine vs dense (cuDNN) at the
    lengths where its KV fits, SmolLM2; the blog: 15% of FlashAttention's time at 1M with a 16K cache (A6000)."""
    from longreach import LLM, SamplingParams

    res = []
    for name in ("cascading", "dense"):
        for n in lengths:
            if name == "dense" and n > 262144:
                continue  # 1M dense: ~23 GB of KV and minutes; extrapolated from 128K below
            gc.collect()
            torch.cuda.empty_cache()
            llm = LLM(model, attention=name, preset="16k" if name == "cascading" else None, max_model_len=n + 16,
                      max_num_seqs=1, max_num_batched_tokens=8192,
                      kv_cache_memory_gb=2 if name == "cascading" else n * 23040 / 2**30 * 1.1 + 0.5)
            ids = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
            out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            res.append((name, n, out[0].metrics.prefill_seconds))
            del llm
    t = {(a, n): s for a, n, s in res}
    dense128 = t.get(("dense", 131072))
    extra = f"; dense at 1M extrapolated x64 from 128K: {dense128 * 64:.0f} s" if dense128 else ""
    return ", ".join(f"{a} {n // 1024}K {s:.1f} s" for a, n, s in res) + extra
def psa_matrix(dev: str = "cuda", lengths=(131072 + 5, 40000, 777), shape=(32, 8, 128), pages=(16, 32),
               dtype=torch.bfloat16, timing: bool = True):
    """PSA at Llama-8B's shape and 128K (attention/psa.py): the metadata, scoring and decode kernels against their
    PyTorch references (fp32 math on the same bf16 inputs), one tier, two tiers (pinned host pages over UVA) and
    fp8 rows; the decode step captured in a CUDA graph == eager; and the time of one decode step (rank + loop)
    next to the dense paged-decode kernel, with the keys it read. (The defaults are the GPU run; the tests'
    smoke run shrinks them on CPU.)"""
    from longreach.attention.psa import PSA, PSAConfig
    from longreach.kernels.block_meta import (block_scores_reference, block_scores_triton,
                                              build_block_meta_reference, build_block_meta_triton)
    from longreach.kernels.psa_decode import psa_decode_reference, psa_decode_triton
    from longreach.kvcache.fp8 import encode

    Hq, Hkv, D = shape
    notes, worst, mismatched, pairs = [], 0.0, 0, 0
    for page in pages:
        g = torch.Generator(device=dev).manual_seed(page)
        need = [-(-x // page) for x in lengths]
        P = sum(need) + 2
        perm = torch.randperm(P, device=dev, generator=g).int()
        tables = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=dev)
        o = 0
        for i, k in enumerate(need):
            tables[i, :k] = perm[o:o + k]
            o += k
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
        kc = torch.randn(P, page, Hkv, D, device=dev, generator=g, dtype=dtype)
        vc = torch.randn(P, page, Hkv, D, device=dev, generator=g, dtype=dtype)
        q = torch.randn(len(lengths), Hq, D, device=dev, generator=g, dtype=dtype)
        u = torch.randn(Hkv, D, device=dev, generator=g, dtype=dtype)
        q += u.repeat_interleave(Hq // Hkv, 0)  # some structure: a shared direction and a few hot blocks
        hot = tables[0, torch.randint(8, need[0] * 3 // 4, (64,), device=dev, generator=g)].long()
        kc[hot] += u * 1.5
        lo = torch.zeros(len(lengths), dtype=torch.int32, device=dev)
        hi = ((seq_lens - 1) // page).int()
        meta = torch.zeros(P, 2, Hkv, D, dtype=dtype, device=dev)
        build_block_meta_triton(kc, tables, lo, hi, int(hi.max()), meta, "cuboid-mean")
        ref_meta = torch.zeros(P, 2, Hkv, D, dtype=torch.float32, device=dev)
        build_block_meta_reference(kc, tables, lo, hi, ref_meta, "cuboid-mean")
        err = _rel(meta.float(), ref_meta)
        if err > 1e-2:
            raise AssertionError(f"page {page}: block metadata rel err {err:.2e}")
        m = PSA(PSAConfig(n_sink=64, n_window=128), Hq, Hkv)
        cand_lo, cand_hi = m.candidates(seq_lens, page)
        W = tables.shape[1]
        scores = block_scores_triton(q, meta, tables, cand_lo, cand_hi, W)
        ref_scores = block_scores_reference(q, meta, tables, cand_lo, cand_hi, W)
        fin = torch.isfinite(ref_scores)
        if not torch.equal(fin, torch.isfinite(scores)) or _rel(scores[fin], ref_scores[fin]) > 1e-3:
            raise AssertionError(f"page {page}: block scores differ from the reference")
        ranked = scores.sort(dim=-1, descending=True, stable=True).indices.int()
        scale = D ** -0.5
        caches = {"one tier": (kc, vc)}
        if dev == "cuda":
            caches["two tiers"] = tuple(_tier(kc, vc, 0.3, g))
        f8 = (encode(kc, torch.float8_e4m3fn), encode(vc, torch.float8_e4m3fn))
        for eps in (0.9, 0.95, 1.0):
            out, _, counts = psa_decode_triton(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, scale)
            _, _, ref_counts = psa_decode_reference(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4,
                                                    scale)
            # a threshold crossing within fp rounding may flip a (row, group): compare outputs on the kernel's reads
            mismatched += int((counts != ref_counts).sum())
            pairs += counts.numel()
            forced, _, _ = psa_decode_reference(q, kc, vc, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, scale,
                                                counts=counts)
            err = _rel(out, forced)
            worst = max(worst, err)
            if torch.isnan(out).any() or err > 1e-2:
                raise AssertionError(f"page {page} eps {eps}: rel err {err:.2e} vs the reference")
            if eps == 1.0 and not torch.equal(counts.long(), (cand_hi.long() - cand_lo)[:, None].expand_as(counts)):
                raise AssertionError("epsilon 1 must read every candidate block")
            for name, (kk, vv) in caches.items():
                if name != "one tier":
                    o2, _, c2 = psa_decode_triton(q, kk, vv, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, scale)
                    if not (torch.equal(o2, out) and torch.equal(c2, counts)):
                        raise AssertionError(f"page {page} eps {eps}: {name} != one tier")
            o8, _, c8 = psa_decode_triton(q, *f8, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, scale)
            r8, _, _ = psa_decode_reference(q, *f8, tables, seq_lens, ranked, cand_lo, cand_hi, eps, 4, scale,
                                            counts=c8)
            if _rel(o8, r8) > 1e-2:
                raise AssertionError(f"page {page} eps {eps}: fp8 rel err {_rel(o8, r8):.2e}")
            if eps == 0.95:
                keys = (counts.float() * page).mean().item()
                notes.append(f"page {page}: eps 0.95 reads {keys:.0f} ranked keys per (row, KV head) of "
                             f"{(cand_hi.float() - cand_lo).mean().item() * page:.0f}")
        if dev == "cuda":  # the decode step (scores, sort, loop) in a CUDA graph, replayed on new queries
            def step():
                return m.attend(q, kc, vc, tables, seq_lens, meta, W, scale, True)[:2]
            step()  # warm-up outside the capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = step()
            q.mul_(-1.0)
            graph.replay()
            torch.cuda.synchronize()
            again = step()
            if not (torch.equal(captured[0], again[0]) and torch.equal(captured[1], again[1])):
                raise AssertionError(f"page {page}: graph replay differs from eager after the query changed")
            q.mul_(-1.0)
            if timing:
                from longreach.kernels.paged_decode import paged_decode

                one = slice(0, 1)  # batch 1 at 128K
                args = (q[one], kc, vc, tables[one], seq_lens[one], meta, W, scale, True)
                t_psa = _median_us(lambda: m.attend(*args))
                t_dense = _median_us(lambda: paged_decode(q[one], kc, vc, tables[one], seq_lens[one], scale,
                                                          num_splits=32))
                notes.append(f"page {page}, batch 1 at {lengths[0]}: psa decode step {t_psa:.0f} us (scores + sort "
                             f"+ loop), dense paged decode {t_dense:.0f} us")
            del eager
    if mismatched > 0.01 * pairs:
        raise AssertionError(f"blocks read differ from the reference in {mismatched}/{pairs} (row, group) pairs")
    gpu_only = "; tiered == one tier; graph replay == eager" if dev == "cuda" else " (CPU smoke run: no tiers, graph)"
    return (f"kernels == references (worst output rel err {worst:.2e}, reads equal in {pairs - mismatched}/{pairs} "
            f"pairs); fp8{gpu_only}. " + "; ".join(notes))


def _median_us(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[reps // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model for the engine checks (skipped without one)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", nargs="*", default=None, help="run only the checks whose names contain one of these")
    args = ap.parse_args()
    global ONLY
    ONLY = args.only
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    check("paged decode kernel vs reference (bf16 matrix)")(kernel_matrix)
    check("block-sparse attention kernel vs reference (bf16)")(bsa_matrix)
    check("chunk-scoring kernel vs reference (bf16)")(prune_matrix)
    check("offload: kernels through the page table, copy kernels")(offload_kernels)
    check("minference range/column kernel vs reference (bf16)")(minference_matrix)
    check("fused model kernels and the fused KV write (bf16, fp8)")(fused_kernels)
    check("cascading kernels: cache-RoPE attention, key mass (bf16)")(cascading_kernels)
    check("psa decode, metadata, scoring kernels vs reference (bf16, 8B shape, 128K)")(psa_matrix)
    if args.model:
        check("engine: offloaded KV == GPU KV (SmolLM2, 128K)")(lambda: offload_engine(args.model))
        check("engine: CUDA graphs, eager, chunked prefill")(lambda: engine_checks(args.model))
        check("fp32 logits parity on GPU")(lambda: fp32_parity(args.model))
        check("engine: sparse backends through the kernels")(lambda: sparse_engine(args.model))
        check("engine: minference kernels, + infinitehip decode")(lambda: minference_engine(args.model))
        check("cascading engine: GPU kernels == CPU reference")(lambda: cascading_engine(args.model))
        check("cascading passkey vs streaming, equal memory")(lambda: cascading_passkey(args.model))
        check("cascading prefill time vs dense (128K, 1M)")(lambda: cascading_prefill(args.model))
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "results": RESULTS}, f, indent=2)
    print("\n=== gpu_check summary ===")
    for r in RESULTS:
        print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['check']:<48} {r['seconds']:>7.1f}s  {r['detail']}")
    return 0 if all(r["ok"] for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
