"""Prefill chunks through piecewise CUDA graphs (engine/chunk_graphs.py), on a CPU through the emulated path: the same
static buffers, padding and slicing, each segment run eagerly in place of its replay.

The split forward pass (models/llama.py's pieces) equals the monolithic one bit for bit; an engine whose prefill steps
go through the chunk graphs gives the eager engine's tokens and every logit exactly (dense, infinitehip, streaming:
chunked prefill with prefixes, steps padded to the next size, mixed decode + prefill steps, with and without the
decode graphs; MInference and an offloaded store for prefill); steps outside the sizes run eagerly; bad sizes and
settings fail clearly. Exact equality holds because every op of a segment works row by row and each step's padded
GEMMs have more than EAGER_MAX_ROWS real rows (a CPU GEMM of 1-4 rows takes a GEMV path that rounds otherwise).
The real capture is tests/gpu/test_engine.py's test_chunk_graphs_equal_eager.
"""
import argparse

import pytest
import torch
from conftest import run_with_joins

from longreach import SamplingParams
from tests.test_offload_engine import _record_logits

# test_sparse.py's small configs: sparse from the first token (dense_below 0), so every chunk selects
METHODS = {
    "dense": None,
    "infinitehip": '{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [128, 32, 8], '
                   '"early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], "dense_below": 0}',
    "streaming": '{"n_sink": 8, "n_window": 24, "block_q": 8, "dense_below": 0}',
}
MINFERENCE = '{"block": 16, "last_q": 16, "pattern": ["vertical_slash", 6, 8], "segment": 64, "dense_below": 0}'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


def _llm(path, attention="dense", config=None, **kw):
    from longreach.engine.llm import LLM

    kw.setdefault("kv_cache_memory_gb", 0.01)
    kw.setdefault("cpu_threads", 1)  # bit-for-bit comparisons: the same threads in both engines, whatever the load
    return LLM(path, device="cpu", dtype="float32", attention=attention, attention_config=config, **kw)


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _watch(graphs):
    """Record every `run` of `graphs`: (rows T, the size it padded to or None when it declined, a mixed step)."""
    seen, inner = [], graphs.run

    def run(input_ids, positions, ctx):
        out = inner(input_ids, positions, ctx)
        T = input_ids.shape[0]
        size = None if out is None else min(s for s in graphs.sizes if s >= T)
        seen.append((T, size, getattr(ctx, "parts", None) is not None))
        return out
    graphs.run = run
    return seen


# ---- the split forward pass -----------------------------------------------------------------------------------------
class CausalContext:
    """A ForwardContext over one sequence and no cache: causal attention over the step's own rows (GQA); records the
    rows of every call."""

    max_position = None

    def __init__(self):
        self.rows = []

    def attention(self, layer, q, k, v):
        self.rows.append(q.shape[0])
        rep = q.shape[1] // k.shape[1]
        q, k, v = (t.transpose(0, 1) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)


def reference_forward(model, input_ids, positions, ctx):
    """models/llama.py's forward pass as written before the split into pieces (attention inside each layer's call)."""
    from longreach.kernels.fused import rope_qk_
    from longreach.rope.scaling import apply_rope

    x = model.embed_tokens(input_ids)
    cos, sin = model.rotary(positions, x.dtype, ctx.max_position)
    residual = None
    for layer in model.layers:
        if residual is None:
            h, residual = layer.input_layernorm(x), x
        else:
            h, residual = layer.input_layernorm(x, residual)
        a, T = layer.self_attn, h.shape[0]
        qkv = a.qkv_proj(h)
        if a.q_norm is None:
            qk = rope_qk_(qkv[:, :a.q_size + a.kv_size].view(T, a.num_heads + a.num_kv_heads, a.head_dim), cos, sin)
            q, k = qk[:, :a.num_heads], qk[:, a.num_heads:]
            v = qkv[:, a.q_size + a.kv_size:].view(T, a.num_kv_heads, a.head_dim)
        else:
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            q = a.q_norm(q.view(T, a.num_heads, a.head_dim))
            k = a.k_norm(k.view(T, a.num_kv_heads, a.head_dim))
            v = v.view(T, a.num_kv_heads, a.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.attention(a.layer, q, k, v)
        h, residual = layer.post_attention_layernorm(a.o_proj(out.reshape(T, a.q_size)), residual)
        x = layer.mlp(h)
    return x if residual is None else residual + x


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # fused RoPE; q/k/v bias; q/k norms
@torch.inference_mode()
def test_split_forward_equals_the_monolithic_one_and_the_padded_pieces(tmp_path, arch):
    """`forward` (the pieces composed) == the old monolithic forward, bit for bit; the chunk graphs' emulated path
    gives the same hidden states for T rows padded to 32 or 64 (attention seeing the T real rows only), the padding
    rows' ids and positions 0 even after a longer step; T above the largest size or of at most EAGER_MAX_ROWS rows:
    None (eager)."""
    from conftest import make_tiny_hf_model

    from longreach.engine.chunk_graphs import EAGER_MAX_ROWS, ChunkGraphs
    from longreach.models.loader import load_model

    path = make_tiny_hf_model(tmp_path / "m", arch=arch)[0]
    model = load_model(path, torch.float32, torch.device("cpu")).model
    g = torch.Generator().manual_seed(3)
    graphs = ChunkGraphs(model, torch.device("cpu"), emulate=True)
    assert graphs.capture([64, 32]) == [64, 32] and graphs.sizes == [32, 64] and graphs.capture([32]) == []
    for T in (40, 64, 17, 32, 60, 21):
        ids = torch.randint(3, 256, (T,), generator=g)
        pos = torch.arange(T) + 5  # a chunk with a prefix
        ref_ctx, ctx, piece_ctx = CausalContext(), CausalContext(), CausalContext()
        expected = reference_forward(model, ids, pos, ref_ctx)
        assert torch.equal(model(ids, pos, piece_ctx), expected)
        got = graphs.run(ids, pos, ctx)
        assert got.shape == expected.shape and torch.equal(got, expected), T
        assert ctx.rows == ref_ctx.rows == [T] * len(model.layers)
        chunk = graphs._chunks[32 if T <= 32 else 64]
        assert not chunk.ids[T:].any() and not chunk.positions[T:].any()
    assert graphs.runs == 6
    for T in (65, EAGER_MAX_ROWS, 1):
        ids = torch.randint(3, 256, (T,), generator=g)
        assert graphs.run(ids, torch.arange(T), CausalContext()) is None
    assert graphs.runs == 6


# ---- through the engine ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager-decode", "graph-decode"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_engine_with_chunk_graphs_gives_the_eager_tokens_and_logits(tiny, method, decode_graphs):
    """Four prompts of odd lengths join while others decode, 64-token steps, chunks of at most 32 beside others: the
    chunk graphs (sizes 64 and 32, the engine's own for these settings) give every step's logits and every token of
    the run without them, exactly. Steps padded to their size, chunks with a prefix, mixed decode + prefill steps
    (with the decode graphs: the decode rows replay, then the prefill part; without: one forward over both) and
    steps too large or too small for the graphs (eager) all occur."""
    from longreach.engine.chunk_graphs import chunk_graph_sizes

    prompts = _prompts(1, (150, 90, 77, 41))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    joins = {0: 0, 2: 1, 5: 2, 9: 3}
    runs = []
    for chunk_graphs in (False, True):
        llm = _llm(tiny, method, METHODS[method], max_num_batched_tokens=64, long_prefill_token_threshold=32)
        engine = llm.engine
        assert engine.runner.chunk_graphs is None  # on a CPU nothing is captured unless emulated
        if decode_graphs:
            engine.runner.capture_graphs(emulate=True)
        seen = []
        if chunk_graphs:
            sizes = chunk_graph_sizes(engine.scheduler.chunk_sizes(), engine.config.chunk_graph_max_tokens,
                                      engine.config.max_num_batched_tokens)
            assert sizes == [64, 32]
            engine.runner.capture_chunk_graphs(sizes, emulate=True)
            seen = _watch(engine.runner.chunk_graphs)
        logits = _record_logits(llm)
        runs.append((run_with_joins(engine, prompts, params, joins, 300), logits, seen))
    (tokens, logits, _), (got_tokens, got_logits, seen) = runs
    assert got_tokens == tokens
    assert len(got_logits) == len(logits) and all(torch.equal(a, b) for a, b in zip(logits, got_logits))
    graphed = [(T, size, mixed) for T, size, mixed in seen if size is not None]
    assert any(T < size for T, size, _ in graphed) and any(T == size for T, size, _ in graphed)  # padded, and not
    assert any(mixed for _, _, mixed in graphed) != decode_graphs  # graph decode: the prefill part runs alone
    assert any(size is None for _, size, _ in seen)  # a step of at most EAGER_MAX_ROWS (a prompt's last tokens)


def test_prompt_logits_past_the_largest_size_run_eagerly(tiny):
    """Scoring (`prompt_logits`: every row's logits) of a 150-token prompt in 64-token steps with only size 32
    captured: the full chunks run eagerly, the 22-token tail through the graphs; the logits are the eager run's."""
    ids = _prompts(2, (150,))[0]
    expected = _llm(tiny, max_num_batched_tokens=64).engine.prompt_logits(ids)
    engine = _llm(tiny, max_num_batched_tokens=64).engine
    engine.runner.capture_chunk_graphs([32], emulate=True)
    seen = _watch(engine.runner.chunk_graphs)
    got = engine.prompt_logits(ids)
    assert seen == [(64, None, False), (64, None, False), (22, 32, False)]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("setup", ["minference", "offloaded"])
def test_prefill_through_chunk_graphs_with_minference_and_an_offloaded_store(tiny, setup):
    """Attention stays eager, so MInference's pattern search and an offloaded store's staged prefill view run
    unchanged under the chunk graphs: the tokens and logits of the run without them (steps alternate prefill and
    decode with both)."""
    if setup == "minference":
        kw = dict(attention="minference", config=MINFERENCE)
    else:
        pool = 12 * 2 * 16 * 2 * 16 * 4 / 2**30  # test_offload.py's 12 GPU slots: most reads miss
        kw = dict(attention="infinitehip", config=METHODS["infinitehip"], kv_cache_memory_gb=pool,
                  kv_offloading_size=0.004)
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, (150, 90))]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    runs = []
    for chunk_graphs in (False, True):
        llm = _llm(tiny, max_num_batched_tokens=64, **kw)
        assert not llm.engine.scheduler.mixed
        seen = []
        if chunk_graphs:
            llm.engine.runner.capture_chunk_graphs([64, 32], emulate=True)
            seen = _watch(llm.engine.runner.chunk_graphs)
        logits = _record_logits(llm)
        runs.append(([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], logits, seen))
    (tokens, logits, _), (got_tokens, got_logits, seen) = runs
    assert got_tokens == tokens and all(torch.equal(a, b) for a, b in zip(logits, got_logits))
    assert len(got_logits) == len(logits) and any(size is not None for _, size, _ in seen)


# ---- sizes and settings ---------------------------------------------------------------------------------------------
def test_sizes_flag_and_clear_errors(tiny):
    """The captured sizes: the scheduler's chunk sizes up to the cap and the powers of two from 256 (none above the
    step budget, none of at most EAGER_MAX_ROWS); the flag; errors that say what is allowed."""
    from longreach.commands.engine_args import add_engine_args, engine_config_from_args
    from longreach.config import EngineConfig
    from longreach.engine.chunk_graphs import ChunkGraphs, chunk_graph_sizes

    assert chunk_graph_sizes([8192, 2048], 2048, 8192) == [2048, 1024, 512, 256]
    assert chunk_graph_sizes([8192, 2048, 1024, 512, 256], 4096, 8192) == [4096, 2048, 1024, 512, 256]
    assert chunk_graph_sizes([3000, 750], 2048, 3000) == [2048, 1024, 750, 512, 256]
    assert chunk_graph_sizes([64, 16], 2048, 64) == [64]
    assert chunk_graph_sizes([8192, 2048], 0, 8192) == []
    assert EngineConfig().chunk_graph_max_tokens == 2048
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--chunk-graph-max-tokens", "512"])).chunk_graph_max_tokens == 512
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_graph_max_tokens must be an integer >= 0"):
            EngineConfig(chunk_graph_max_tokens=bad)
    engine = _llm(tiny).engine
    graphs = ChunkGraphs(engine.model, engine.device, emulate=True)
    for bad in ([], [16], [0, 64], ["64"]):
        with pytest.raises(ValueError, match="prefill chunk graph sizes must be integers > 16"):
            graphs.capture(bad)
    dynamic = _llm(tiny, rope_scaling='{"rope_type": "dynamic", "factor": 2.0}').engine
    with pytest.raises(ValueError, match="dynamic NTK"):
        ChunkGraphs(dynamic.model, dynamic.device, emulate=True)
    engine.runner.capture_chunk_graphs([64])  # not emulated on a CPU: graphs_supported says no, nothing happens
    assert engine.runner.chunk_graphs is None
