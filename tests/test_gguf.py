"""GGUF loading: dequantisation against the gguf package, the q/k un-permutation, whole-model parity, tokenizer."""
import os

import numpy as np
import pytest
import torch

import gguf
from longreach.config import EngineConfig
from longreach.engine.llm_engine import LLMEngine
from longreach.models.gguf import read_gguf
from longreach.models.quant import dequantize

from conftest import make_tiny_hf_model

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@pytest.mark.parametrize("kind", TYPES)
def test_dequantize_matches_gguf_reference(kind):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((48, 96)) * rng.uniform(0.1, 3.0, (48, 1))).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        payload = x
    elif kind == "F16":
        payload = x.astype(np.float16)
    else:
        payload = gguf.quants.quantize(x, qtype)
    ref = gguf.quants.dequantize(payload, qtype).astype(np.float32).reshape(x.shape)
    ours = dequantize(kind, payload, x.shape)
    assert torch.equal(ours, torch.from_numpy(ref))
    if kind.startswith("Q"):  # sanity: the quantised weights are close to the originals
        assert np.abs(ref - x).max() < 0.25 * np.abs(x).max()


def test_unsupported_quant_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="Q4_1"):
        dequantize("NOT_A_TYPE", np.zeros(4, np.uint8), (4,))


def test_read_gguf_matches_the_gguf_package_reader(tmp_path):
    """Our container parser: every metadata type, tensor shapes, types and bytes, a non-default alignment."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_custom_alignment(64)
    for key, val, vtype in [("u8", 200, "UINT8"), ("i8", -7, "INT8"), ("u16", 60000, "UINT16"),
                            ("i16", -3000, "INT16"), ("u32", 4_000_000_000, "UINT32"), ("i32", -5, "INT32"),
                            ("f32", 0.1, "FLOAT32"), ("u64", 2**40, "UINT64"), ("i64", -2**40, "INT64"),
                            ("f64", 0.1, "FLOAT64"), ("b", True, "BOOL")]:
        w.add_key_value(f"t.{key}", val, gguf.GGUFValueType[vtype])
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strs", ["a", "", "日本語", "x y"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("a", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((5,)).astype(np.float16))
    w.add_tensor("c", rng.integers(0, 256, (2, 2 * 210), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, tensors = read_gguf(str(tmp_path / "m.gguf"))
    ref = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF.") and key != "t.nested":  # the package reader flattens nested arrays
            assert meta[key] == field.contents() and type(meta[key]) is type(field.contents()), key
    assert set(meta) == {k for k in ref.fields if not k.startswith("GGUF.")}
    assert meta["general.alignment"] == 64 and meta["t.nested"] == [[1, 2], [3]]
    assert [(n, t.type, t.shape) for n, t in tensors.items()] == [("a", "F32", (3, 64)), ("b", "F16", (5,)),
                                                                  ("c", "Q6_K", (2, 512))]
    for t in ref.tensors:
        assert np.array_equal(tensors[t.name].data, np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + bytes([1, 0, 0, 0]) + bytes(16))
    with pytest.raises(ValueError, match="not a little-endian GGUF v2/v3 file"):
        read_gguf(str(tmp_path / "x.gguf"))


def _permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf_model, types, arch="llama"):
    """Write a transformers Llama model as a llama.cpp-style GGUF, cycling matrices through `types`."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    i = 0
    for name, t in hf_model.state_dict().items():
        x = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            part, suffix = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{layer_parts[part]}.{suffix}"
            if part == "self_attn.q_proj":
                x = _permute_like_llama_cpp(x, cfg.num_attention_heads)
            elif part == "self_attn.k_proj":
                x = _permute_like_llama_cpp(x, cfg.num_key_value_heads)
        else:
            gname = names[name]
        if x.ndim == 1:
            w.add_tensor(gname, x)  # norms stay F32, as llama.cpp does
            continue
        kind = types[i % len(types)]
        i += 1
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(gname, x)
        elif kind == "F16":
            w.add_tensor(gname, x.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _engine(path):
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_memory_gb=0.05))


def test_f32_gguf_equals_original_hf_weights(tmp_path):
    """The un-permutation is the exact inverse of llama.cpp's: an F32 GGUF reproduces the HF checkpoint's logits."""
    path, hf = make_tiny_hf_model(tmp_path / "hf", arch="llama", num_key_value_heads=1)
    g = write_gguf(tmp_path / "m.gguf", hf, ["F32"])
    ids = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (_engine(g).prompt_logits(ids) - ref).abs().max().item() <= 1e-3


def test_quantized_gguf_matches_transformers_gguf_loader(tmp_path):
    from transformers import AutoModelForCausalLM

    _, hf = make_tiny_hf_model(tmp_path / "hf", arch="llama")
    g = write_gguf(tmp_path / "q.gguf", hf, ["Q4_1", "Q8_0", "Q4_0", "F16", "Q5_0", "Q5_1", "F32"])
    ref_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf", dtype=torch.float32)
    ids = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    assert (_engine(g).prompt_logits(ids) - ref).abs().max().item() <= 1e-3


def test_unsupported_gguf_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'.*supported: llama, qwen2, qwen3"):
        _engine(str(tmp_path / "x.gguf"))


def test_smollm2_config_and_tokenizer(smollm2):
    cfg = smollm2.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size) == (30, 9, 3, 64, 576)
    assert cfg.rope.theta == 100000.0 and cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.eos_token_id == 2 and 2 in smollm2.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hello?"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2, smollm2_gguf_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf_path),
                                        gguf_file=os.path.basename(smollm2_gguf_path))
    texts = ["Hello world 12345 it's", "  spaces   and\n\nnewlines\t tabs", "<|im_start|>user\nhi<|im_end|>",
             "Ünïcödé 日本語 émoji 🎉", "x=3.14159; y=2e10 // code()", "I'm you're THEY'LL we'd"]
    for text in texts:
        ids = smollm2.tokenizer.encode(text)
        assert ids == ref.encode(text), text
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text
