"""fp8 weights on the GPU (models/fp8.py): the two products against their fp32 references in bf16 at an 8B layer's
sizes, each timed against the bf16 matmul (reported, not asserted: speed goals live in `bench decode --quantization
fp8`) -- the weight-only GEMV kernel of decode rows (kernels/fp8_gemv.py, both strategies: 1, 4 and 16 rows, the four
projections, also replayed in a CUDA graph; scripts/fp8_gemv_sweep.py times their block sizes) and `torch._scaled_mm`
(W8A8: decode and prefill row counts, including row counts that need padding) -- and the engine with `--quantization
fp8` on a real model, greedy tokens against bf16 (reported) and under CUDA graphs == eager."""
from __future__ import annotations

import gc

import pytest
import torch

from .common import graph_us, l2_copies, median_us, rel_err

PROJECTIONS_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate_up, down


@pytest.mark.parametrize("N, K", PROJECTIONS_8B)
def test_fp8_gemv_matches_the_reference(N, K, detail):
    """The W8A16 kernel's two strategies (kernels/fp8_gemv.py: "dot", "fma") in bf16 at Llama-8B's projection sizes
    against the float64 product of the same values: each one's error at most twice that of the fp32 reference rounded
    to bf16; the layer runs the default for decode rows; a captured call == the eager one. Timed inside CUDA graphs
    over more weights than the L2 cache holds, against the bf16 matmul (x @ w.t()) of the dequantised weights; GB/s
    counts the weight bytes read."""
    from longreach.kernels.fp8_gemv import STRATEGIES, fp8_gemv, fp8_gemv_reference, gemv_plan, launch_config
    from longreach.models.fp8 import Fp8Linear, quantize_rows, scaled_mm_supported

    dev = torch.device("cuda")
    if not scaled_mm_supported(dev):
        pytest.skip("Triton's fp8 (e4m3) needs compute capability >= 8.9")
    g = torch.Generator(device=dev).manual_seed(N + K)
    qws, scales = zip(*(quantize_rows(torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * 0.02)
                        for _ in range(l2_copies(N * K))))
    qw, s = qws[0], scales[0]
    w16 = [(q.float() * sc).to(torch.bfloat16) for q, sc in zip(qws[:l2_copies(2 * N * K)], scales)]
    bias = torch.randn(N, device=dev, generator=g, dtype=torch.bfloat16)
    layer = Fp8Linear(qw, s, bias)
    assert layer._gemv
    parts = []
    for rows in (1, 4, 16):
        x = torch.randn(rows, K, device=dev, generator=g, dtype=torch.bfloat16)
        for strategy in STRATEGIES:
            for b in (None, bias):
                got = fp8_gemv(x, qw, s, b, strategy=strategy,
                               out=torch.full((rows, N), float("nan"), device=dev, dtype=torch.bfloat16))
                exact = x.double() @ (qw.double() * s.double()).t() + (0 if b is None else b.double())
                err, own = rel_err(got, exact), rel_err(fp8_gemv_reference(x, qw, s, b), exact)
                assert not got.isnan().any() and err <= 2 * own + 1e-4, \
                    f"{strategy}, rows {rows}: {err:.2e} vs reference {own:.2e}"
        assert torch.equal(layer(x[None]), fp8_gemv(x, qw, s, bias)[None])  # the layer's decode path is the kernel
        t16 = graph_us([lambda w=w: x @ w.t() for w in w16])
        timed = []
        for strategy in STRATEGIES:
            t8 = graph_us([lambda q=q, sc=sc: fp8_gemv(x, q, sc, strategy=strategy) for q, sc in zip(qws, scales)])
            e8 = median_us(lambda: fp8_gemv(x, qw, s, strategy=strategy))
            timed.append(f"{strategy} {t8:.1f} us ({N * K / t8 / 1e3:.0f} GB/s, {t16 / t8:.2f}x, eager {e8:.1f})")
        parts.append(f"{rows} rows: " + ", ".join(timed) + f" vs bf16 {t16:.1f} ({2 * N * K / t16 / 1e3:.0f} GB/s, "
                     f"eager {median_us(lambda: x @ w16[0].t()):.1f})")
    x = torch.randn(1, K, device=dev, generator=g, dtype=torch.bfloat16)
    plans = []
    for strategy in STRATEGIES:
        eager = fp8_gemv(x, qw, s, bias, strategy=strategy)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_gemv(x, qw, s, bias, strategy=strategy)
        graph.replay()
        assert torch.equal(captured, eager), f"fp8_gemv {strategy}: a CUDA-graph replay differs from the eager call"
        cfg = launch_config(strategy, 1, N, torch.bfloat16, dev)
        splits = gemv_plan(N, K, dev, cfg["block_n"], cfg["block_k"])[0]
        plans.append(f"{strategy} {cfg['block_n']}x{cfg['block_k']} {splits} split{'s' if splits > 1 else ''}")
    detail(f"{N}x{K} (1 row: {', '.join(plans)}), graphs: " + "; ".join(parts))


@pytest.mark.parametrize("rows", [1, 7, 64, 2048])
def test_scaled_mm_matches_the_reference(rows, detail):
    """W8A8 through `torch._scaled_mm` (the layer's path above 16 rows; called directly here at every row count)."""
    from longreach.models.fp8 import Fp8Linear, reference_fp8_linear, scaled_mm_supported

    dev = torch.device("cuda")
    if not scaled_mm_supported(dev):
        pytest.skip("no fp8 tensor cores (compute capability < 8.9)")
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 14336, bias=False, device=dev, dtype=torch.bfloat16)  # an 8B MLP's up projection
    q = Fp8Linear.from_linear(lin)
    assert q._gpu
    x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
    got = q._scaled_mm(x).float()
    ref = reference_fp8_linear(x.float(), q.qweight, q.scale, None)  # fp32 accumulation of the same values
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"_scaled_mm vs reference: relative error {rel:.2e}"
    to_bf16 = ((got - lin(x).float()).norm() / lin(x).float().norm()).item()
    t8, t16 = median_us(lambda: q._scaled_mm(x)), median_us(lambda: lin(x))
    detail(f"rows {rows}: vs reference {rel:.1e}, vs the bf16 layer {to_bf16:.3f}; {t8:.0f} us vs bf16 {t16:.0f} us "
           f"({t16 / t8:.2f}x)")


def test_engine_fp8_weights(gpu_model, detail):
    """SmolLM2 (or --gpu-model) with --quantization fp8: CUDA-graph decode == eager token for token (decode steps of
    at most 8 rows: the GEMV kernel; prefills: torch._scaled_mm, eager in both: a padded chunk graph's fp8 GEMM may
    round otherwise); with the chunk graphs too, and the bf16 engine, greedy tokens reported."""
    from longreach import LLM, SamplingParams
    from longreach.models.fp8 import scaled_mm_supported

    if not scaled_mm_supported(torch.device("cuda")):
        pytest.skip("no fp8 tensor cores (compute capability < 8.9)")

    def fresh(**kw):
        gc.collect()
        torch.cuda.empty_cache()
        return LLM(gpu_model, max_num_seqs=8, kv_cache_memory_gb=2, **kw)

    prompts = ["The history of the Roman Empire", "def quicksort(arr):", "Photosynthesis is " * 40]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = {}
    for name, kw in [("bf16", {"chunk_graph_max_tokens": 0}),
                     ("fp8", {"quantization": "fp8", "chunk_graph_max_tokens": 0}),
                     ("fp8-eager", {"quantization": "fp8", "enforce_eager": True}),
                     ("fp8-chunk-graphs", {"quantization": "fp8"})]:
        llm = fresh(**kw)
        outs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs["fp8"] == outs["fp8-eager"], "fp8 weights: CUDA-graph decode differs from eager"
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(outs["fp8"], outs["bf16"])]
    chunks = [sum(a == b for a, b in zip(x, y)) for x, y in zip(outs["fp8-chunk-graphs"], outs["fp8-eager"])]
    detail(f"fp8 graphs == eager; greedy tokens equal to bf16's: {same}, with the chunk graphs too to eager's: "
           f"{chunks} of {params.max_tokens} per prompt")
