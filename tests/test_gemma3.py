"""Gemma 3 (issue 33), fp32 on CPU: a tiny random `Gemma3ForCausalLM` against transformers (logits of a prompt longer
than the sliding window, whole and in chunks; greedy tokens decoded past the window), its config in both spellings,
the sparse methods on its global layers (cascading's: tests/test_cascading_gemma3.py), and the real 270M GGUF
against transformers' GGUF loader (slow, when installed)."""
import json
import os

import pytest
import torch

from longreach import LLM, SamplingParams
from longreach.config import EngineConfig
from longreach.engine.llm_engine import LLMEngine
from longreach.models.config import ModelConfig

from conftest import greedy_vs_transformers

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _tiny_gemma3(path, weight_std: float = 0.15, **overrides):
    """A random 4-layer Gemma 3 (window 8, layers 0, 1, 3 sliding, head_dim 32, GQA 4:2; `overrides` change the
    config) saved as an HF directory. Norm weights are drawn around 0 (Gemma's 1 + w), so a lost offset shows; the
    others with `weight_std`."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, sliding_window=WINDOW, layer_types=LAYER_TYPES,
               max_position_embeddings=512, query_pre_attn_scalar=24, bos_token_id=2, eos_token_id=1,
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    cfg.update(overrides)
    hf = Gemma3ForCausalLM(Gemma3TextConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0, 0.5 if "norm" in name else weight_std)
    hf.save_pretrained(str(path))
    return str(path), hf


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _engine(path, **kw):
    cfg = dict(model=path, device="cpu", dtype="float32", kv_cache_memory_gb=0.02, max_model_len=256)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_tiny_gemma3_matches_transformers(tmp_path, softcap):
    path, hf = _tiny_gemma3(tmp_path / "g3", final_logit_softcapping=softcap)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # 5 windows long
    ref = _hf_logits(hf, ids)
    assert ref.std() > 0.5, "random logits too flat to be a meaningful comparison"
    whole = _engine(path).prompt_logits(ids)
    assert (whole - ref).abs().max().item() <= 1e-4
    # chunks of 16 over pages of 4: later chunks read their window's keys from the paged cache
    chunked = _engine(path, max_num_batched_tokens=16, block_size=4).prompt_logits(ids)
    assert (chunked - ref).abs().max().item() <= 1e-4
    # the window matters: without it the same weights give other logits
    full = _tiny_gemma3(tmp_path / "full", final_logit_softcapping=softcap, sliding_window=1000)[1]
    assert (_hf_logits(full, ids) - ref).abs().max().item() > 0.1


def test_tiny_gemma3_greedy_decode_past_the_window(tmp_path):
    path, hf = _tiny_gemma3(tmp_path / "g3")
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.02, block_size=4)
    got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0].token_ids
    assert got == want
    assert len(set(want)) > 3, "a degenerate continuation would not test much"


def test_tiny_gemma3_graphs_give_the_eager_tokens(tmp_path):
    """The decode graphs and the prefill chunks' piecewise graphs (both emulated on a CPU) carry the two RoPE tables
    and the windowed decode: three prompts longer than the window, two joining while the first decodes, the same
    greedy tokens as eager."""
    from longreach.engine.chunk_graphs import chunk_graph_sizes

    path = _tiny_gemma3(tmp_path / "g3")[0]
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (70, 37, 21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.02, block_size=4,
                  max_num_batched_tokens=64, long_prefill_token_threshold=32)
        if graphs:
            runner = llm.engine.runner
            runner.capture_graphs(emulate=True)
            sizes = chunk_graph_sizes(llm.engine.scheduler.chunk_sizes(), llm.engine.config.chunk_graph_max_tokens,
                                      llm.engine.config.max_num_batched_tokens)
            runner.capture_chunk_graphs(sizes, emulate=True)
            assert runner.chunk_graphs is not None
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if graphs:
            assert runner.chunk_graphs.runs > 0
    assert runs[0] == runs[1]


def test_gemma3_config_spellings_agree(tmp_path):
    """transformers 5's per-layer-type rope_parameters and 4.x's rope_theta / rope_local_base_freq /
    sliding_window_pattern describe the same model."""
    path, _ = _tiny_gemma3(tmp_path / "g3", layer_types=None, sliding_window_pattern=2)
    with open(os.path.join(path, "config.json")) as f:
        new = json.load(f)
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0},
               hidden_activation="gelu_pytorch_tanh")
    a, b = ModelConfig.from_hf(new), ModelConfig.from_hf(old)
    assert a == b
    assert a.sliding_layers == (0, 2) and a.window_of(1) is None and a.window_of(2) == WINDOW
    assert a.rope.theta == 1e6 and a.rope.rope_type == "linear" and a.rope_local.theta == 1e4
    assert a.attn_scale == 24 ** -0.5 and a.norm_offset == 1.0 and a.tie_word_embeddings


def test_sparse_methods_attend_the_global_layers_only(tmp_path):
    """The sliding-window layers are the dense fallback's (attended within their window), the sparse method selects in
    the global ones. Streaming whose window covers the whole prompt is exact attention in the global layer, so its
    logits are transformers' (had it attended a sliding layer, that layer would see the whole prompt, not its 8-token
    window); infinitehip with budgets far below the prompt gives the same greedy tokens through the decode and chunk
    graphs (emulated) as eagerly, and its selection runs in layer 2 only."""
    from longreach.engine.chunk_graphs import chunk_graph_sizes

    path, hf = _tiny_gemma3(tmp_path / "g3")
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    streaming = _engine(path, attention="streaming",
                        attention_config='{"n_sink": 8, "n_window": 64, "block_q": 8, "dense_below": 0}')
    assert streaming.backend.fallback.layers == (0, 1, 3) and streaming.backend.fallback.sparse_layers() == [2]
    assert (streaming.prompt_logits(ids) - _hf_logits(hf, ids)).abs().max().item() <= 1e-4
    cfg = ('{"n_sink": 4, "n_window": 8, "block_q": 8, "chunk_sizes": [16, 8, 2], "budgets": [32, 16, 8], '
           '"early_layers": 0, "refresh": [4, 2, 1], "dense_below": 0}')
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (90, 45)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.02, block_size=4,
                  attention="infinitehip", attention_config=cfg, max_num_batched_tokens=64)
        selected = []
        select = llm.engine.backend.method.select
        llm.engine.backend.method.select = lambda *a, **k: selected.append(a) or select(*a, **k)
        if graphs:
            runner = llm.engine.runner
            runner.capture_graphs(emulate=True)
            runner.capture_chunk_graphs(chunk_graph_sizes(llm.engine.scheduler.chunk_sizes(), 2048, 64), emulate=True)
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if not graphs:
            assert selected and {a[0] for a in selected} == {2}  # the layer, select's first argument
    assert runs[0] == runs[1]
    # the default's stage 0 keeps chunk boxes, for the selecting layer only (not for the three sliding ones)
    boxes = _engine(path, attention="infinitehip").backend.boxes
    assert boxes.slots == {2: 0} and boxes.num_layers == 1
    dense = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.02, block_size=4)
    assert runs[0] != [o.token_ids for o in dense.generate(prompts, params, use_tqdm=False)]  # the pruning acted


def _gemma_gguf():
    from longreach.models.hub import ALIASES, locate

    return locate(ALIASES["gemma3-270m"])


@pytest.mark.slow
@pytest.mark.skipif(_gemma_gguf() is None, reason="gemma3-270m is not downloaded (longreach download gemma3-270m)")
def test_gemma3_270m_gguf_matches_transformers_gguf_loader():
    """The real model (Q4_K_M: Q8_0 embeddings, Q5_0/Q4_K/Q6_K/Q8_0 layers, norms stored as 1 + w): tokenizer, prompt
    logits of 600 tokens (past the 512 window) and greedy tokens equal transformers' GGUF loader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _gemma_gguf()
    folder, name = os.path.dirname(path), os.path.basename(path)
    llm = LLM("gemma3-270m", device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.1)
    tok = llm.get_tokenizer()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for text in ("Hello world!", "  two  spaces\n\nnewlines\ttab", "def f(x):\n    return x**2  # comment",
                 "ünïcödé 日本語 🙂 1234567", "<start_of_turn>user\nhi<end_of_turn>\n"):
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
    ids = tok.encode("The history of the printing press begins in the fifteenth century. " * 50)[:600]
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ref = _hf_logits(hf, ids)
    mine = llm.engine.prompt_logits(ids)
    assert ref.std() > 0.5
    assert (mine - ref).abs().max().item() <= 2e-3
    want, got = greedy_vs_transformers(llm, hf, ids)
    assert got == want


def test_gemma_3_12b_random_shape_is_the_published_one():
    """`random:gemma-3-12b` (issue 33's KV-memory bench): keras-hub's published parameter count of gemma3_12b_text,
    11,765,788,416, from these sizes; layers 5, 11, ..., 47 global, the others over a 1,024-token window."""
    from longreach.models.llama import LlamaForCausalLM
    from longreach.models.random_init import random_shape

    cfg = random_shape("random:gemma-3-12b").config
    with torch.device("meta"):  # shapes only
        assert sum(p.numel() for p in LlamaForCausalLM(cfg).parameters()) == 11_765_788_416
    assert [layer for layer in range(48) if cfg.window_of(layer) is None] == list(range(5, 48, 6))
    assert cfg.sliding_window == 1024 and cfg.attn_scale == 256 ** -0.5 and cfg.rope.factor == 8.0
