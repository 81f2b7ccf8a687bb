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
from gpu_check_common import _inv_freq, _rel  # noqa: E402
from gpu_check_methods import (  # noqa: E402
    cascading_engine,
    cascading_flash,
    cascading_insert,
    cascading_kernels,
    cascading_passkey,
    cascading_prefill,
    minference_engine,
    minference_matrix,
)
from gpu_check_box import box_engine, box_matrix  # noqa: E402
from gpu_check_psa import psa_matrix, psa_rank_rope, psa_step_times  # noqa: E402
from gpu_check_offload import fused_kernels, offload_engine, offload_kernels  # noqa: E402

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
    from longreach.tools.eval.data import paul_graham_text

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
    check("cascading insert: EMA, rules and moves kernels vs torch (16k preset)")(cascading_insert)
    check("cascading flash: gathered prefill vs block-sparse (16k preset, bf16)")(cascading_flash)
    check("psa decode, metadata, scoring kernels vs reference (bf16, 8B shape, 128K)")(psa_matrix)
    check("psa step times in CUDA graphs (8B shape, 128K, 1M)")(psa_step_times)
    check("psa rank rope: moved metadata and decode kernels vs reference (bf16, 128K)")(psa_rank_rope)
    check("box: stage-0 box build kernel vs reference (bf16, 128K), decode costs")(box_matrix)
    if args.model:
        check("engine: offloaded KV == GPU KV (SmolLM2, 128K)")(lambda: offload_engine(args.model))
        check("engine: CUDA graphs, eager, chunked prefill")(lambda: engine_checks(args.model))
        check("fp32 logits parity on GPU")(lambda: fp32_parity(args.model))
        check("engine: sparse backends through the kernels")(lambda: sparse_engine(args.model))
        check("engine: box stage 0 (3k-box), graph == eager")(lambda: box_engine(args.model))
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
