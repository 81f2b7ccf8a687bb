"""fp8 weights on the GPU (models/fp8.py): `torch._scaled_mm` against the fp32 reference of the same quantised values
in bf16 at an 8B layer's sizes (decode and prefill row counts, including row counts that need padding), its time
against the bf16 layer (reported, not asserted: speed goals live in `bench decode --quantization fp8`), and the engine
with `--quantization fp8` on a real model, greedy tokens against bf16 (reported) and under CUDA graphs == eager."""
from __future__ import annotations

import gc

import pytest
import torch

from .common import median_us


@pytest.mark.parametrize("rows", [1, 7, 64, 2048])
def test_scaled_mm_matches_the_reference(rows, detail):
    from longreach.models.fp8 import Fp8Linear, reference_fp8_linear, scaled_mm_supported

    dev = torch.device("cuda")
    if not scaled_mm_supported(dev):
        pytest.skip("no fp8 tensor cores (compute capability < 8.9)")
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 14336, bias=False, device=dev, dtype=torch.bfloat16)  # an 8B MLP's up projection
    q = Fp8Linear.from_linear(lin)
    assert q._gpu
    x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
    got = q(x).float()
    ref = reference_fp8_linear(x.float(), q.qweight, q.scale, None)  # fp32 accumulation of the same values
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"_scaled_mm vs reference: relative error {rel:.2e}"
    to_bf16 = ((got - lin(x).float()).norm() / lin(x).float().norm()).item()
    t8, t16 = median_us(lambda: q(x)), median_us(lambda: lin(x))
    detail(f"rows {rows}: vs reference {rel:.1e}, vs the bf16 layer {to_bf16:.3f}; {t8:.0f} us vs bf16 {t16:.0f} us "
           f"({t16 / t8:.2f}x)")


def test_engine_fp8_weights(gpu_model, detail):
    """SmolLM2 (or --gpu-model) with --quantization fp8: CUDA graphs == eager token for token; greedy tokens against
    the bf16 engine reported."""
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
    for name, kw in [("bf16", {}), ("fp8", {"quantization": "fp8"}),
                     ("fp8-eager", {"quantization": "fp8", "enforce_eager": True})]:
        llm = fresh(**kw)
        outs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs["fp8"] == outs["fp8-eager"], "fp8 weights: CUDA-graph decode differs from eager"
    same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(outs["fp8"], outs["bf16"])]
    detail(f"fp8 graphs == eager; greedy tokens equal to bf16's: {same} of {params.max_tokens} per prompt")
