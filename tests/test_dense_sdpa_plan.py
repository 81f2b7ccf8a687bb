"""The dense backend's SDPA prefill builds what its layers share once per step (attention/dense.py: `SdpaPlan`, kept
on `AttentionMetadata.step_cache`: one page index for every cached prefix, the bottom-right masks, the GQA decision)
and computes what the per-layer code it replaced computed: `_per_layer_prefill` below is that code (each layer, each
chunk: `gather_tokens` of its prefix, K/V expanded over the GQA group, a fresh `causal_lower_right` mask).

Backend level: several layers of one step over a scattered paged cache (NaN in every slot no sequence owns), chunks
with and without a prefix, fp32 and an fp8 cache. Engine level: a GQA model (4 query heads on 2 KV heads), chunked
prefill in 48-token steps, fp32: prompt logits and greedy tokens equal to the per-layer code's. And the plan is
built once per step, not per layer.
"""
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from longreach.attention import dense
from longreach.attention.backend import AttentionMetadata
from longreach.attention.dense import DenseBackend, SdpaPlan
from longreach.kvcache.paged import gather_tokens
from longreach.sampling_params import SamplingParams
from tests.test_kernel_bsa import _cache  # a paged cache of scattered pages, NaN in every unowned slot


def _per_layer_prefill(self, q, k, v, k_cache, v_cache, meta):
    """The SDPA prefill as it was before the per-step plan (sdpa mode), every step's work redone in each layer."""
    from torch.nn.attention.bias import causal_lower_right

    def attend(q, k, v):
        n, Hq, _ = q.shape
        L, Hkv, _ = k.shape
        g = Hq // Hkv
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = k.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
        vh = v.transpose(0, 1).repeat_interleave(g, dim=0).unsqueeze(0)
        if n == L:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, L), scale=self.scale)
        return o.squeeze(0).transpose(0, 1)

    out = torch.empty_like(q)
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        rows = slice(start, start + n)
        start += n
        if ctx == 0:
            out[rows] = attend(q[rows], k[rows], v[rows])
        else:
            ki = gather_tokens(k_cache, meta.block_tables[i], ctx + n).to(q.dtype)
            vi = gather_tokens(v_cache, meta.block_tables[i], ctx + n).to(q.dtype)
            out[rows] = attend(q[rows], ki, vi)
    return out


def _backend(Hq, Hkv, D):
    mc = SimpleNamespace(head_dim=D, num_heads=Hq, num_kv_heads=Hkv, num_layers=3, attn_scale=D ** -0.5,
                         window_of=lambda layer: None)
    ec = SimpleNamespace(dense_prefill="sdpa", max_model_len=4096)
    return DenseBackend(mc, ec, torch.device("cpu"))


def _meta(query_lens, context_lens, tables):
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    return AttentionMetadata(True, list(range(len(query_lens))), query_lens, context_lens, qsl,
                             torch.tensor(seq_lens, dtype=torch.int32), tables,
                             torch.zeros(sum(query_lens), dtype=torch.long), max(seq_lens), max(query_lens))


CASES = {
    "mixed": ([50, 30, 20, 9], [37, 0, 130, 5]),  # prefixes off the 16-token pages, a chunk without one between
    "one-prefixed": ([40], [77]),  # a lone chunk: its output is the layer's
    "no-prefix": ([25, 33], [0, 0]),
    "one-square": ([21], [0]),
}


@pytest.mark.parametrize("kv", [None, "fp8"], ids=["fp32", "fp32-fp8kv"])
@pytest.mark.parametrize("case", list(CASES))
def test_plan_equals_per_layer_prefill(case, kv):
    """Three layers of one step (their own caches and queries, one metadata): each layer's output equals the
    per-layer code's within 1e-5, and the plan the first layer built is the one the others read."""
    Hq, Hkv, D, page = 4, 2, 32, 16
    query_lens, context_lens = CASES[case]
    g = torch.Generator().manual_seed(11)
    backend = _backend(Hq, Hkv, D)
    kf, vf, tables = _cache([c + n for c, n in zip(context_lens, query_lens)], Hkv, D, page, torch.float32, g)
    meta = _meta(query_lens, context_lens, tables)
    for layer in range(3):
        # one block table per step: every layer's values in the same pages (NaN where no sequence owns a slot)
        kc, vc = kf + layer * torch.randn(kf.shape, generator=g), vf + layer * torch.randn(vf.shape, generator=g)
        if kv == "fp8":
            from longreach.kernels.fp8 import quantize

            kc, vc = quantize(kc), quantize(vc)
        # the step's own K/V rows are those the cache holds at the chunk's positions (the engine stores them first)
        k = torch.cat([gather_tokens(kc, tables[i], c + n, start=c) for i, (n, c) in
                       enumerate(zip(query_lens, context_lens))])
        v = torch.cat([gather_tokens(vc, tables[i], c + n, start=c) for i, (n, c) in
                       enumerate(zip(query_lens, context_lens))])
        q = torch.randn(sum(query_lens), Hq, D, generator=g)
        got = backend.forward(layer, q, k, v, kc, vc, meta)
        ref = _per_layer_prefill(backend, q, k, v, kc, vc, meta)
        assert got.shape == ref.shape and not torch.isnan(got).any()
        assert (got - ref).abs().max() <= 1e-5
        plan = meta.step_cache[SdpaPlan.KEY]
        if layer == 0:
            first = plan
        assert plan is first
    assert (plan.pages is None) == (max(context_lens) == 0)


# ---- the engine on CPU ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


def _llm(path, **kw):
    from longreach.engine.llm import LLM

    return LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=48, kv_cache_memory_gb=0.01, **kw)


PROMPT_LENS = (163, 71, 29, 5)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(path, prompts):
    llm = _llm(path)
    logits = [llm.engine.prompt_logits(p) for p in prompts[:2]]
    tokens = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)]
    return logits, tokens


def test_engine_chunked_prefill_equals_per_layer_prefill(tiny, monkeypatch):
    """A GQA model, fp32, 48-token steps: four prompts (the longest over ten pages) prefilled in chunks, steps holding
    chunks with and without a prefix. Prompt logits (every row) within 1e-5 and greedy tokens equal to the engine
    with the per-layer code in place of the plan."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    logits, tokens = _run(tiny, prompts)
    monkeypatch.setattr(DenseBackend, "_prefill", _per_layer_prefill)
    ref_logits, ref_tokens = _run(tiny, prompts)
    for a, b in zip(logits, ref_logits):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5
    assert tokens == ref_tokens


def test_plan_is_built_once_per_step_not_per_layer(tiny, monkeypatch):
    """Counted over a chunked generation: the plan (with its page index, masks and GQA decision) is built once per
    prefill step's metadata, every layer of the step runs the prefill, and masks are made once per prefixed chunk
    per step."""
    seen, builds, masks = [], [], []
    build, prefill, mask = SdpaPlan.build.__func__, DenseBackend._prefill, dense.bottom_right_mask
    monkeypatch.setattr(SdpaPlan, "build", classmethod(lambda cls, meta, *a: builds.append(meta) or
                                                       build(cls, meta, *a)))
    monkeypatch.setattr(DenseBackend, "_prefill", lambda self, q, k, v, kc, vc, meta: seen.append(meta) or
                        prefill(self, q, k, v, kc, vc, meta))
    monkeypatch.setattr(dense, "bottom_right_mask", lambda *a: masks.append(a) or mask(*a))
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    _run(tiny, prompts)
    steps = list({id(m): m for m in seen}.values())
    assert len(steps) > 5 and any(max(m.context_lens) > 0 for m in steps)
    assert len(seen) == 3 * len(steps)  # the tiny model's 3 layers
    assert [id(m) for m in builds] == [id(m) for m in steps]  # once per step, at its first layer
    assert len(masks) == sum(c > 0 for m in steps for c in m.context_lens)


def test_cuda_mask_and_gqa_calls_on_cpu():
    """What the CUDA path calls, as far as a CPU can run it: the flash check (`_flash_takes`, False off CUDA) and
    SDPA with torch's `CausalBias` and `enable_gqa` (its dispatch materialises the mask on CPU), equal to the
    boolean mask and to K/V expanded over the group."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(7, 4, 16, generator=g), torch.randn(19, 2, 16, generator=g), torch.randn(19, 2, 16,
                                                                                                   generator=g)
    assert dense._flash_takes(q, k, v) is False
    ref = dense._attend(q, k, v, 0.25, dense.bottom_right_mask(7, 19, "cpu"), gqa=False)
    for mask in (causal_lower_right(7, 19), dense.bottom_right_mask(7, 19, "cpu")):
        assert (dense._attend(q, k, v, 0.25, mask, gqa=True) - ref).abs().max() <= 1e-6
    assert (dense.causal_attention(q, k, v, 0.25) - ref).abs().max() <= 1e-6
