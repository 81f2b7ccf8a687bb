"""Triton paged decode kernel vs its PyTorch reference (TRITON_INTERPRET=1 on CPU: fp16/fp32, small sizes)."""
import pytest
import torch

from longreach.kernels.combine import combine_splits_reference, combine_splits_triton
from longreach.kernels.paged_decode import paged_decode, paged_decode_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, Hq, Hkv, D, page, dtype, max_len, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (B,), generator=g)
    lens[0] = max_len  # one sequence at the longest length
    pages_per_seq = -(-max_len // page)
    num_pages = B * pages_per_seq + 3
    tables = torch.randperm(num_pages, generator=g)[: B * pages_per_seq].view(B, pages_per_seq)
    k = torch.randn(num_pages, page, Hkv, D, generator=g).to(dtype)
    v = torch.randn(num_pages, page, Hkv, D, generator=g).to(dtype)
    for b in range(B):  # slots past each sequence's end hold NaN, as stale cache memory may
        last = tables[b, (int(lens[b]) - 1) // page]
        k[last, (int(lens[b]) - 1) % page + 1:] = float("nan")
        v[last, (int(lens[b]) - 1) % page + 1:] = float("nan")
        k[tables[b, -(-int(lens[b]) // page):]] = float("nan")
        v[tables[b, -(-int(lens[b]) // page):]] = float("nan")
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(k), to(v), to(tables.int()), to(lens.int())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B, Hq, Hkv, D, page, max_len, splits", [
    (3, 9, 3, 64, 16, 203, 3),   # SmolLM2's shape, odd lengths
    (2, 8, 8, 64, 4, 77, 2),     # MHA (GQA 1)
    (2, 16, 4, 128, 16, 130, 4),  # GQA 4, d=128
    (1, 32, 4, 128, 1, 45, 1),   # GQA 8, one token per page
    (4, 4, 1, 32, 8, 9, 5),      # more splits than tiles: empty splits
])
def test_paged_decode_matches_reference(dtype, B, Hq, Hkv, D, page, max_len, splits):
    q, k, v, tables, lens = _case(B, Hq, Hkv, D, page, dtype, max_len, seed=B * 100 + D + page)
    scale = D ** -0.5
    poison = (torch.full((B, Hq, splits, D), float("nan"), device=DEVICE),
              torch.full((B, Hq, splits), float("nan"), device=DEVICE))
    out, lse = paged_decode(q, k, v, tables, lens, scale, num_splits=splits, block_n=16, workspace=poison)
    ref_out, ref_lse = paged_decode_reference(q, k, v, tables, lens, scale)
    assert out.dtype == dtype and not torch.isnan(out).any() and not torch.isnan(ref_out).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.float() - ref_out.float()).abs().max().item() <= tol
    assert (lse - ref_lse).abs().max().item() <= 1e-4


def test_bad_inputs_raise_before_launch():
    q, k, v, tables, lens = _case(2, 6, 2, 64, 16, torch.float32, 40, seed=0)
    with pytest.raises(ValueError, match="must be int32"):
        paged_decode(q, k, v, tables.long(), lens, 0.1, num_splits=1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode(q[:, :5], k, v, tables, lens, 0.1, num_splits=1)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode(q[..., :48], k[..., :48], v[..., :48], tables, lens, 0.1, num_splits=1)


def test_combine_ignores_empty_splits_and_kernel_matches():
    out = torch.randn(1, 3, 3, 16)
    lse = torch.tensor([[[0.5, float("-inf"), -1.0], [2.0, float("-inf"), float("-inf")],
                         [float("-inf")] * 3]])  # the last row read no key at all
    merged, total = combine_splits_reference(out, lse, torch.float32)
    w = torch.softmax(lse[:, :2], dim=-1)
    assert torch.allclose(merged[:, :2], (out[:, :2] * w[..., None]).sum(-2))
    assert torch.allclose(total[:, :2], torch.logsumexp(lse[:, :2], -1))
    assert torch.equal(merged[:, 2], torch.zeros(1, 16)) and total[0, 2] == float("-inf")
    got = torch.full(merged.shape, float("nan"), device=DEVICE)
    got_lse = torch.full(total.shape, float("nan"), device=DEVICE)
    combine_splits_triton(out.to(DEVICE), lse.to(DEVICE), got, got_lse)
    assert torch.allclose(got.cpu(), merged, atol=1e-6) and torch.equal(got_lse.cpu().isinf(), total.isinf())
