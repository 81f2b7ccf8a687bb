"""fp8 weights (`--quantization fp8`, models/fp8.py): the quantisation, the reference products the GPU kernels are
checked against (tests/gpu/test_fp8.py), the weight-only GEMV kernel of decode rows (kernels/fp8_gemv.py) in Triton's
interpreter (TRITON_INTERPRET=1, set by conftest without a GPU: fp16/fp32, small sizes), which product a layer picks
for how many rows, and a model run with it on a CPU."""
import pytest
import torch
from torch import nn

from longreach.config import EngineConfig
from longreach.kernels.fp8_gemv import MAX_ROWS, fp8_gemv, fp8_gemv_reference, gemv_plan
from longreach.models.fp8 import (
    E4M3_MAX,
    GEMV_ROWS,
    Fp8Linear,
    quantize_model_fp8,
    quantize_rows,
    reference_fp8_linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_quantize_rows_scales_each_row_to_the_e4m3_range():
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1, 10, 100, 1e4, 0.0])[:, None]
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1)
    assert torch.allclose(q.float().abs().amax(-1)[:5], torch.full((5,), E4M3_MAX))  # each row's max hits 448
    back = q.float() * s
    assert (back[:5] - x[:5]).abs().max(-1).values.le(x[:5].abs().amax(-1) / 16).all()  # e4m3: 3 mantissa bits
    assert back[5].abs().max() == 0  # an all-zero row stays zero (no division by zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_close_to_the_unquantised_layer(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True).to(dtype)
    x = torch.randn(5, 7, 256, dtype=dtype)  # 35 rows: W8A8
    q = Fp8Linear.from_linear(lin)
    y, ref = q(x), lin(x)
    assert y.shape == ref.shape and y.dtype == dtype
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 0.05, rel  # W8A8 e4m3 rowwise: a few percent
    assert q.qweight.dtype == torch.float8_e4m3fn and q.qweight.element_size() == 1
    assert torch.equal(y, reference_fp8_linear(x, q.qweight, q.scale, q.bias))  # the CPU path is the reference


def _gemv_case(M, N, K, dtype, bias, seed):
    """Random weights quantised per channel (a few channels all zero: scale EPS), activations with a few large
    columns (outliers, as real activations have), on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 4
    w[N // 3] = 0
    qw, s = quantize_rows(w)
    x = torch.randn(M, K, generator=g)
    x[:, torch.randint(0, K, (3,), generator=g)] *= 30
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(x.to(dtype)), to(qw), to(s), to(b)


def _check_gemv(y, x, qw, s, b):
    """The kernel's error against a float64 product is at most twice the fp32 reference's (rounded to x's dtype),
    plus a small atol; nothing left unwritten (outputs poisoned with NaN by the callers)."""
    exact = x.double() @ (qw.double() * s.double()).t() + (0 if b is None else b.double())
    ref = fp8_gemv_reference(x, qw, s, b)
    assert y.shape == ref.shape and y.dtype == x.dtype and not torch.isnan(y).any()
    own = (ref.double() - exact).abs().max().item()
    err = (y.double() - exact).abs().max().item()
    assert err <= 2 * own + 1e-5 * exact.abs().max().item(), (err, own)


def _run_gemv(strategy, M, N, K, dtype, bias, splits, **blocks):
    """One launch on poisoned outputs (and partials, with split-K) against the reference."""
    x, qw, s, b = _gemv_case(M, N, K, dtype, bias, seed=M * 1000 + N + K)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    partials = None
    if splits and splits > 1:
        sp = gemv_plan(N, K, torch.device(DEVICE), blocks["block_n"], blocks["block_k"], splits)[0]
        partials = torch.full((sp, M, N), float("nan"), device=DEVICE)
    y = fp8_gemv(x, qw, s, b, strategy=strategy, splits=splits, out=out, partials=partials, **blocks)
    assert y is out
    _check_gemv(y, x, qw, s, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, N, K, block_n, block_k, splits, bias", [
    (1, 96, 256, 32, 64, 1, True),     # one row, blocks that divide N and K
    (3, 100, 200, 32, 64, 1, False),   # N and K not multiples of the blocks
    (16, 70, 130, 32, 64, 3, True),    # all 16 rows, split-K with a short last tile
    (5, 40, 448, 16, 64, 4, False),    # 7 tiles in 4 splits of 2 (the last one tile)
    (2, 33, 96, 16, 32, 5, True),      # more splits asked than tiles: trimmed to 3, none empty
    (4, 96, 320, 64, None, None, True),  # the default rule (block_k 256 / 128 for fp32)
])
def test_fp8_gemv_matches_the_reference(dtype, M, N, K, block_n, block_k, splits, bias):
    _run_gemv("dot", M, N, K, dtype, bias, splits, block_n=block_n, block_k=block_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, N, K, block_n, block_k, stages, splits, bias", [
    (1, 96, 256, 8, 64, 3, 1, True),      # one row (ROWS 1), blocks that divide N and K (EVEN_K: no masks), cp.async
    (1, 37, 200, 4, 32, 1, 1, False),     # N and K not multiples of the blocks, not pipelined
    (3, 50, 130, 16, 64, 2, 1, True),     # 3 rows padded to 4, a short last tile
    (16, 33, 160, 4, 32, 3, 3, False),    # all 16 rows, split-K: 5 tiles in splits of 2, 2, 1
    (2, 40, 448, 8, 64, 3, 4, True),      # 7 tiles in 4 splits, the bias added by the reduce
    (1, 100, 1100, None, None, None, None, True),  # launch_config's rule: block_k 1024, two tiles (the last masked)
])
def test_fp8_gemv_fma_matches_the_reference(dtype, M, N, K, block_n, block_k, stages, splits, bias):
    """The CUDA-core strategy (products summed along K in registers) on the same cases' kinds as the dot one."""
    _run_gemv("fma", M, N, K, dtype, bias, splits, block_n=block_n, block_k=block_k, num_stages=stages)


def test_fp8_gemv_picks_its_strategy_by_rows(monkeypatch):
    """Without a `strategy`, fp8_gemv runs "fma" up to FMA_ROWS rows and "dot" above (the H200's measurements)."""
    from longreach.kernels import fp8_gemv as mod

    assert [mod.default_strategy(m) for m in (1, 4, 5, 16)] == ["fma", "fma", "dot", "dot"]
    seen = []
    real = mod.launch_config
    monkeypatch.setattr(mod, "launch_config", lambda strategy, *a: seen.append(strategy) or real(strategy, *a))
    for m in (1, 5):
        x, qw, s, _ = _gemv_case(m, 24, 64, torch.float32, False, seed=m)
        y = fp8_gemv(x, qw, s)
        assert torch.allclose(y, fp8_gemv_reference(x, qw, s, None), rtol=1e-5, atol=1e-5)
    assert seen == ["fma", "dot"]


def test_fp8_gemv_refuses_bad_inputs_before_launch():
    x, qw, s, b = _gemv_case(2, 32, 64, torch.float32, True, seed=1)
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} rows"):
        fp8_gemv(x.new_zeros(MAX_ROWS + 1, 64), qw, s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv(x, qw.float(), s)
    with pytest.raises(ValueError, match="unit stride along K"):
        fp8_gemv(x.t().contiguous().t(), qw, s)
    with pytest.raises(ValueError, match="one per output channel"):
        fp8_gemv(x, qw, s[:-1])
    with pytest.raises(ValueError, match="bias"):
        fp8_gemv(x, qw, s, b[:-1])
    with pytest.raises(ValueError, match=r"\(M, K\) and qw \(N, K\)"):
        fp8_gemv(x[:, :48], qw, s)
    with pytest.raises(ValueError, match="known: dot, fma"):
        fp8_gemv(x, qw, s, strategy="simt")
    with pytest.raises(ValueError, match="powers of two"):
        fp8_gemv(x, qw, s, strategy="fma", block_n=12)


def test_a_layer_is_weight_only_up_to_16_rows_and_w8a8_above():
    """Fp8Linear picks the product by the rows of a call (models/fp8.py): up to GEMV_ROWS the weight-only reference
    (on a CPU; the kernel on a GPU), above them W8A8. The two differ (the activations' quantisation), so the test
    tells them apart."""
    torch.manual_seed(0)
    q = Fp8Linear.from_linear(nn.Linear(128, 48, bias=True))
    for rows in (1, GEMV_ROWS, GEMV_ROWS + 1):
        x = torch.randn(rows, 128)
        wo = fp8_gemv_reference(x, q.qweight, q.scale, q.bias)
        w8a8 = reference_fp8_linear(x, q.qweight, q.scale, q.bias)
        assert not torch.equal(wo, w8a8)
        assert torch.equal(q(x), wo if rows <= GEMV_ROWS else w8a8), rows
    x = torch.randn(2, 3, 128)  # leading dimensions: 6 rows
    assert torch.equal(q(x), fp8_gemv_reference(x.reshape(6, 128), q.qweight, q.scale, q.bias).reshape(2, 3, 48))


def test_a_layer_runs_the_gemv_kernel_where_it_may(monkeypatch):
    """The layer's kernel path (a GPU's decode rows), here in the interpreter: (B, T, K) inputs, with a bias, equal to
    the weight-only reference up to the fp32 sums' order."""
    torch.manual_seed(1)
    q = Fp8Linear.from_linear(nn.Linear(96, 40, bias=True)).to(DEVICE)
    monkeypatch.setattr(q, "_gemv", True)
    calls = []
    monkeypatch.setattr("longreach.models.fp8.fp8_gemv", lambda *a, **k: calls.append(1) or fp8_gemv(*a, **k))
    x = torch.randn(2, 3, 96, device=DEVICE)
    y = q(x)
    assert calls and y.shape == (2, 3, 40)
    _check_gemv(y.reshape(6, 40), x.reshape(6, 96), q.qweight, q.scale, q.bias)


def test_a_model_runs_with_fp8_weights(tmp_path):
    """The mechanics on a tiny random model: its projections become Fp8Linear and its logits move, not far."""
    from conftest import make_tiny_hf_model

    from longreach.engine.llm import LLM

    path = make_tiny_hf_model(tmp_path / "m", arch="llama")[0]
    ids = torch.randint(3, 256, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    full = LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01)
    fp8 = LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, quantization="fp8")
    assert sum(isinstance(m, Fp8Linear) for m in fp8.engine.model.modules()) == 4 * fp8.engine.model_config.num_layers
    assert not any(isinstance(m, Fp8Linear) for m in full.engine.model.modules())
    a, b = full.engine.prompt_logits(ids), fp8.engine.prompt_logits(ids)
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.8 and (a - b).abs().max() > 0


def test_smollm2_with_fp8_weights_predicts_what_it_does_unquantised():
    """A real model (SmolLM2-135M, fp32 on a CPU): fp8 weights keep the greedy answer (its decode steps weight-only)
    and the top-1 prediction at >= 90% of a prompt's positions (a prefill of more than 16 tokens: W8A8). Measured at
    writing: 18 of 19 positions, logits' cosine >= 0.87 (per-token activation scales cost most of it: weight-only fp8
    keeps >= 0.96); a small model has the largest activation outliers."""
    from longreach import SamplingParams
    from longreach.engine.llm import LLM

    kw = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.05, max_model_len=1024)
    full, fp8 = LLM("smollm2", **kw), LLM("smollm2", quantization="fp8", **kw)
    ids = full.engine.tokenizer.encode("The capital of France is Paris. The capital of Germany is Berlin. The capital "
                                       "of Italy is")
    a, b = full.engine.prompt_logits(ids), fp8.engine.prompt_logits(ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    params = SamplingParams(temperature=0, max_tokens=6)
    assert (fp8.generate("The capital of France is", params, use_tqdm=False)[0].text
            == full.generate("The capital of France is", params, use_tqdm=False)[0].text)


def test_quantize_model_counts_the_bytes_and_rejects_a_model_without_projections():
    block = nn.Module()
    block.qkv_proj, block.o_proj = nn.Linear(32, 48), nn.Linear(16, 32)
    before, after = quantize_model_fp8(block)
    assert before == (32 * 48 + 16 * 32) * 4 and after == 32 * 48 + 16 * 32 + (48 + 32) * 4
    with pytest.raises(ValueError, match="found no linear layers"):
        quantize_model_fp8(nn.Sequential(nn.ReLU()))


def test_quantization_is_validated():
    with pytest.raises(ValueError, match="quantization must be fp8"):
        EngineConfig(quantization="int4")

