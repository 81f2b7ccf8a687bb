"""`--dense-prefill paged` (attention/dense.py: a chunk's cached prefix read in place by the block-sparse kernel, every
causal key block selected) computes what the default SDPA path computes.

CPU: the index itself, and whole engines (dense; infinitehip's dense fallback; fp8 KV; an offloaded store's staged
prefill), where the paged path runs the PyTorch reference executor over the same index. Kernel: the Triton launch
the engine makes on CUDA, in Triton's interpreter (TRITON_INTERPRET=1, set by conftest) in fp16/fp32, against the
SDPA path on the same cache. tests/gpu/test_engine.py runs the engine comparison in bf16 on a GPU.
"""
import pytest
import torch

from longreach.attention import dense
from longreach.attention.dense import (causal_attention, paged_prefix_attention, prefix_index, prefix_splits)
from longreach.kvcache.paged import gather_tokens
from longreach.sampling_params import SamplingParams
from tests.test_kernel_bsa import _cache  # a paged cache of scattered pages, NaN in every unowned slot

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ---- the index ------------------------------------------------------------------------------------------------------
def test_prefix_index_selects_every_key_up_to_each_row():
    """Sequences with a prefix get position-aligned query blocks, each selecting key blocks 0 .. the one holding its
    last row (ascending, -1 padded), and every row reads exactly keys [0, its position]; a sequence without a prefix
    gets no block (SDPA's), and a step without any prefix no index."""
    query_lens, context_lens = [50, 30, 20], [37, 0, 130]
    idx = prefix_index(query_lens, context_lens, "cpu", block=16)
    assert (idx.n_sink, idx.n_window, idx.groups) == (0, 0, 1)
    assert set(idx.queries.seq) == {0, 2}
    rows = {}
    for b in range(idx.queries.num_blocks):
        pos, n = idx.queries.pos[b], idx.queries.length[b]
        count = int(idx.counts[b, 0])
        assert count == -(-(pos + n) // 16)
        assert idx.blocks[b, 0, :count].tolist() == list(range(count))
        assert (idx.blocks[b, 0, count:] == -1).all()
        for r in range(n):
            assert idx.attended_positions(b, 0, pos + r).tolist() == list(range(pos + r + 1))
            rows[idx.queries.start[b] + r] = pos + r
    assert sorted(rows) == list(range(50)) + list(range(80, 100))  # every row of the prefixed sequences, once
    assert prefix_index([8, 9], [0, 0], "cpu") is None


def test_prefix_splits_fill_the_gpu_only_for_long_prefixes():
    """Split-K grows with the prefix up to filling the SMs about twice, never past 32 or for a short prefix."""
    assert prefix_splits(4, 8, 131072, 132) == 9  # a 256-token chunk at 128K: 32 programs a split
    assert prefix_splits(32, 8, 131072, 132) == 2
    assert prefix_splits(4, 8, 3000, 132) == 1  # fewer than 2 x KEYS_PER_SPLIT keys: no merge
    assert prefix_splits(1, 1, 1 << 20, 132) == 32


# ---- the engine on CPU ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


HIP_DENSE = '{"dense_below": 10000}'  # infinitehip whose prefill goes through the dense fallback
SETUPS = {
    "dense": dict(attention="dense"),
    "infinitehip-fallback": dict(attention="infinitehip", attention_config=HIP_DENSE),
    "dense-fp8-kv": dict(attention="dense", kv_cache_dtype="fp8"),
    "infinitehip-offloaded": dict(attention="infinitehip", attention_config=HIP_DENSE,
                                  kv_cache_memory_gb=12 * 2 * 16 * 2 * 16 * 4 / 2**30, kv_offloading_size=0.004),
}


def _llm(path, dense_prefill, **kw):
    from longreach.engine.llm import LLM

    kw.setdefault("kv_cache_memory_gb", 0.01)
    return LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=48, dense_prefill=dense_prefill, **kw)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_engine_paged_prefill_equals_sdpa(tiny, setup, monkeypatch):
    """48-token steps (chunks whose prefixes end off the 64-row query blocks and the 16-token pages): three prompts
    of odd lengths, the longest over ten pages, prefilled with --dense-prefill paged and with sdpa. Asserted: the
    paged path ran on chunks with a prefix, every prompt row's logits agree within 1e-4 (fp32), and the greedy
    tokens of the prompts generated together (steps holding chunks with and without a prefix) are equal."""
    calls = []
    inner = dense.paged_prefix_attention
    monkeypatch.setattr(dense, "paged_prefix_attention", lambda *a, **k: calls.append(1) or inner(*a, **k))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (163, 71, 29)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for mode in ("sdpa", "paged"):
        llm = _llm(tiny, mode, **SETUPS[setup])
        logits = [llm.engine.prompt_logits(p) for p in prompts[:2]]
        tokens = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                    use_tqdm=False)]
        runs[mode] = (logits, tokens, len(calls))
        del llm
    (logits, tokens, sdpa_calls), (got_logits, got_tokens, paged_calls) = runs["sdpa"], runs["paged"]
    assert sdpa_calls == 0 and paged_calls > 0
    for a, b in zip(logits, got_logits):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4
    assert got_tokens == tokens


def test_dense_prefill_setting_is_checked():
    from longreach.config import EngineConfig

    assert EngineConfig().dense_prefill == "sdpa"
    with pytest.raises(ValueError, match="dense_prefill must be one of sdpa, paged.*got 'flash'"):
        EngineConfig(dense_prefill="flash")


# ---- the kernel, in the interpreter ---------------------------------------------------------------------------------


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype, kv", [(torch.float32, None), (torch.float16, None), (torch.float32, "fp8")],
                         ids=["fp32", "fp16", "fp32-fp8kv"])
def test_kernel_paged_prefill_equals_sdpa(dtype, kv, splits):
    """The Triton launch of the paged path (4 query heads on 2 KV heads, 16-token pages) for a step of three
    chunks: one at a 37-token prefix (not a multiple of the page or the query block), one without a prefix, one at
    130, against the SDPA path (gathered prefix, bottom-right causal mask) in fp32 on the same cache values. Every
    row of the prefixed chunks is written (the output is poisoned first) and agrees within 1e-5 (fp32) / 2e-3 (fp16
    output rounding); the rows of the chunk without a prefix are the engine's SDPA's (not compared). With an fp8
    cache (rows quantised with their scales, kernels/fp8.py) both paths read the same dequantised values."""
    Hq, Hkv, D, page = 4, 2, 32, 16
    g = torch.Generator().manual_seed(7 + splits)
    query_lens, context_lens = [50, 30, 20], [37, 0, 130]
    kc, vc, tables = _cache([c + n for c, n in zip(context_lens, query_lens)], Hkv, D, page, dtype, g)
    if kv == "fp8":
        from longreach.kernels.fp8 import quantize

        kc, vc = quantize(kc), quantize(vc)
    q = torch.randn(sum(query_lens), Hq, D, generator=g).to(dtype).to(DEV)
    scale = D ** -0.5
    index = prefix_index(query_lens, context_lens, DEV)
    out = torch.full_like(q, float("nan"))
    paged_prefix_attention(q, kc, vc, tables, index, scale, num_splits=splits, out=out, kernel=True)
    start = 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        rows = slice(start, start + n)
        start += n
        if ctx == 0:
            continue
        ki = gather_tokens(kc, tables[i], ctx + n).float()
        vi = gather_tokens(vc, tables[i], ctx + n).float()
        ref = causal_attention(q[rows].float(), ki, vi, scale)
        assert not torch.isnan(out[rows]).any()
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert (out[rows].float() - ref).abs().max() <= tol
