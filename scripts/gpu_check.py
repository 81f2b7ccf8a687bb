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

RESULTS: list[dict] = []


def check(name):
    def wrap(fn):
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
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    check("paged decode kernel vs reference (bf16 matrix)")(kernel_matrix)
    check("engine: CUDA graphs, eager, chunked prefill")(lambda: engine_checks(args.model))
    check("fp32 logits parity on GPU")(lambda: fp32_parity(args.model))
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "results": RESULTS}, f, indent=2)
    print("\n=== gpu_check summary ===")
    for r in RESULTS:
        print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['check']:<48} {r['seconds']:>7.1f}s  {r['detail']}")
    return 0 if all(r["ok"] for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
