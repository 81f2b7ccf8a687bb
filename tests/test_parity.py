"""Logits parity with transformers, fp32 on CPU: every supported architecture and rope scaling, and SmolLM2's GGUF."""
import pytest
import torch

from longreach.config import EngineConfig
from longreach.engine.llm_engine import LLMEngine

from conftest import greedy_vs_transformers, make_tiny_hf_model

CASES = {
    "llama": dict(arch="llama"),
    "llama-tied-llama3rope": dict(arch="llama", tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}),
    "llama-linear": dict(arch="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama-yarn": dict(arch="llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 64}),
    "llama-bias-sharded": dict(arch="llama", attention_bias=True, mlp_bias=True, shard=True),
    "mistral": dict(arch="mistral", num_key_value_heads=1),
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", num_key_value_heads=4),
}


def _engine(path, **kw):
    cfg = dict(model=path, device="cpu", dtype="float32", kv_cache_memory_gb=0.05, max_model_len=256)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", sorted(CASES))
def test_tiny_architecture_matches_transformers(tmp_path, name):
    spec = dict(CASES[name])
    path, hf = make_tiny_hf_model(tmp_path / name, **spec)
    ids = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _hf_logits(hf, ids)
    assert ref.std() > 0.5, "random logits too flat to be a meaningful comparison"
    whole = _engine(path).prompt_logits(ids)
    assert (whole - ref).abs().max().item() <= 1e-3
    chunked = _engine(path, max_num_batched_tokens=32, block_size=8).prompt_logits(ids)
    assert (chunked - ref).abs().max().item() <= 1e-3


def test_dynamic_ntk_beyond_trained_length(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path / "dyn", arch="llama", max_position_embeddings=64,
                                  rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    ids = torch.randint(3, 256, (120,), generator=torch.Generator().manual_seed(2)).tolist()  # longer than 64
    ref = _hf_logits(hf, ids)
    ours = _engine(path).prompt_logits(ids)  # one chunk: the base follows the whole sequence, as in transformers
    assert (ours - ref).abs().max().item() <= 1e-3


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_gguf_loader(smollm2, smollm2_gguf_path):
    import os

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf_path),
                                              gguf_file=os.path.basename(smollm2_gguf_path), dtype=torch.float32)
    ids = smollm2.tokenizer.encode("Paul Graham wrote that the way to get startup ideas is to look for problems, "
                                   "preferably problems you have yourself. " * 6)
    ref = _hf_logits(hf, ids)
    ours = smollm2.prompt_logits(ids)
    assert (ours - ref).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_qwen_coder_05b_gguf_matches_transformers_gguf_loader():
    """The first real long-context model (Q4_K/Q6_K/Q5_0/Q8_0 tensors, q/k/v bias, tied embeddings), fetched by its
    alias on first use: prompt logits and greedy tokens equal transformers' GGUF loader, fp32 on CPU."""
    import os

    from transformers import AutoModelForCausalLM

    from longreach import LLM
    from longreach.models.loader import resolve_model_path

    path = resolve_model_path("qwen2.5-coder-0.5b")
    llm = LLM("qwen2.5-coder-0.5b", device="cpu", dtype="float32", max_model_len=512, kv_cache_memory_gb=0.1)
    ids = llm.get_tokenizer().encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
                                "The capital of France is Paris. The capital of Italy is")
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    ref = _hf_logits(hf, ids)
    mine = llm.engine.prompt_logits(ids)
    assert ref.std() > 0.5
    assert (mine - ref).abs().max().item() <= 2e-3
    want, got = greedy_vs_transformers(llm, hf, ids)
    assert got[:len(want)] == want
