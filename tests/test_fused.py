"""kernels/fused.py: residual add + RMSNorm, RoPE on q and k in place, SiLU * up — Triton kernels (the interpreter on
a CPU) against the PyTorch references the model ran before, on fresh random inputs, odd sizes, fp32 and fp16."""
import pytest
import torch

from longreach.kernels import fused

DTYPES = [torch.float32, torch.float16]


def _close(out, ref, dtype):
    """fp32: a few ulps (the norm's sum order, exp); fp16: at most one unit in the last place on a few elements."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)
    else:
        diff = (out.float() - ref.float()).abs()
        ulp = torch.finfo(dtype).eps * ref.float().abs().clamp(min=torch.finfo(dtype).tiny)
        assert bool((diff <= 1.01 * ulp + 1e-7).all()), diff.max()
        assert (diff > 0).float().mean() < 0.02  # nearly every element bit-equal


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (5, 96), (3, 200)])
def test_add_rms_norm_kernel_matches_the_model_reference(dtype, T, N):
    g = torch.Generator().manual_seed(T * N)
    x = (torch.randn(T, N, generator=g) * 3).to(dtype)
    res = torch.randn(T, N, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype)
    out, s = fused.add_rms_norm(x, res, w, 1e-5, kernel=True)
    ref, s_ref = fused.add_rms_norm_reference(x, res, w, 1e-5)
    assert torch.equal(s, s_ref)  # the residual sum is one rounded add: exact
    _close(out, ref, dtype)
    _close(fused.rms_norm(x, w, 1e-5, kernel=True), fused.rms_norm_reference(x, w, 1e-5), dtype)


def test_add_rms_norm_reads_strided_rows():
    """Rows with a stride (a slice of a wider tensor) are read in place."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 160, generator=g)
    x, res, w = wide[:, :96], torch.randn(4, 96, generator=g), torch.randn(96, generator=g)
    out, s = fused.add_rms_norm(x, res, w, 1e-6, kernel=True)
    ref, s_ref = fused.add_rms_norm_reference(x, res, w, 1e-6)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 4, 2, 64), (7, 9, 3, 64), (3, 6, 2, 32)])
def test_rope_qk_in_place_is_bit_exact_and_leaves_v_alone(dtype, T, Hq, Hkv, D):
    g = torch.Generator().manual_seed(T + Hq + D)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    pos = torch.randint(0, 50000, (T,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None] * inv[None]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    qk = qkv[:, : (Hq + Hkv) * D].view(T, Hq + Hkv, D)
    ref = fused.rope_reference(qk.clone(), cos, sin)
    v_before = qkv[:, (Hq + Hkv) * D:].clone()
    out = fused.rope_qk_(qk, cos, sin, kernel=True)
    assert out.data_ptr() == qk.data_ptr()
    assert torch.equal(qk, ref)  # every op rounded like PyTorch's
    assert torch.equal(qkv[:, (Hq + Hkv) * D:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 128), (5, 1500), (2, 3000)])
def test_silu_mul_kernel_matches_the_model_reference(dtype, T, I):
    g = torch.Generator().manual_seed(T * I)
    gu = (torch.randn(T, 2 * I, generator=g) * 4).to(dtype)
    _close(fused.silu_mul(gu, kernel=True), fused.silu_mul_reference(gu), dtype)


def test_cpu_tensors_take_the_references_by_default():
    """The model calls these on every layer: on a CPU (no `kernel=True`) they are the references, exactly."""
    g = torch.Generator().manual_seed(2)
    x, r, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    a, s = fused.add_rms_norm(x, r, w, 1e-5)
    b, s2 = fused.add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(a, b) and torch.equal(s, s2)
    gu = torch.randn(3, 64, generator=g)
    assert torch.equal(fused.silu_mul(gu), fused.silu_mul_reference(gu))
