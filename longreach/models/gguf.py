"""GGUF checkpoints: config from metadata, dequantised weights with HF names, and the embedded tokenizer.

llama.cpp's converter permutes the rows of attn_q / attn_k of `llama`-architecture files for its interleaved rotary
layout; `_unpermute` restores the HF "rotate half" layout (Qwen files are not permuted: llama.cpp treats them as NEOX).
Gemma 3 (`gemma3`): the file leaves the layer pattern, the sliding layers' RoPE base and the softmax scale to
llama.cpp's code, so they are set here as llama.cpp sets them (every sixth layer global, base 10K, head_dim ** -0.5
but for the 62-layer 27B); its norm weights already hold Gemma's 1 + w; its tokenizer is SentencePiece-style BPE
(`tokenizer.ggml.model` "llama"), rebuilt as transformers' GGUF loader rebuilds Gemma's (`_build_gemma_tokenizer`),
and a file without a chat template gets Gemma's turn format (`GEMMA_CHAT_TEMPLATE`).
The container is parsed here (`read_gguf`): the gguf package's reader makes a numpy view per metadata item, which for a
150k-token vocabulary takes seconds.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from .config import ModelConfig, RopeConfig, gemma3_sliding_layers
from .quant import dequantize
from .tokenizer import Tokenizer

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

_LAYER_NAMES = {  # GGUF per-layer name -> HF name (under model.layers.N.)
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES,  # Gemma's four norms per layer (models/llama.py: DecoderLayer)
                      "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# GGUF pre-tokenizer name -> (split regex or None, digits split individually); byte-level BPE for all of them.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "default": (None, False),
    "gpt2": (None, False),
    "smollm": (None, True),
    "llama-bpe": (_LLAMA3_REGEX, False),
    "llama3": (_LLAMA3_REGEX, False),
    "qwen2": (_LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}"), False),
}


# GGUF metadata value type -> struct format (8: string, 9: array, handled in _read_value)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    type: str  # GGML type name: "F32", "Q4_K", ...
    shape: tuple[int, ...]  # logical shape, outermost dimension first
    data: np.ndarray  # (nbytes,) uint8, a copy-on-write view of the file


def _read_string(buf: memoryview, off: int) -> tuple[str, int]:
    (n,) = _U64.unpack_from(buf, off)
    return str(buf[off + 8:off + 8 + n], "utf-8"), off + 8 + n


def _read_value(buf: memoryview, off: int, vtype: int) -> tuple[Any, int]:
    if vtype == 8:
        return _read_string(buf, off)
    if vtype in _SCALARS:
        fmt = struct.Struct("<" + _SCALARS[vtype])
        return fmt.unpack_from(buf, off)[0], off + fmt.size
    if vtype != 9:
        raise ValueError(f"GGUF metadata value type {vtype} is not one GGUF defines")
    (etype,), (n,) = _U32.unpack_from(buf, off), _U64.unpack_from(buf, off + 4)
    off += 12
    if etype in _SCALARS:  # one numpy read for the whole array
        dtype = np.dtype("<" + _SCALARS[etype])
        return np.frombuffer(buf, dtype, n, off).tolist(), off + n * dtype.itemsize
    items = []
    for _ in range(n):
        item, off = _read_value(buf, off, etype)
        items.append(item)
    return items, off


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """A little-endian GGUF v2/v3 file -> (metadata, tensors by name); tensor bytes stay memory-mapped."""
    import gguf

    raw = np.memmap(path, mode="c")  # copy-on-write: torch wraps the tensor bytes writable, without a copy
    buf = memoryview(raw)
    (magic,), (version,) = struct.unpack_from("<4s", buf, 0), _U32.unpack_from(buf, 4)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off, meta = 24, {}
    for _ in range(n_kv):
        key, off = _read_string(buf, off)
        (vtype,) = _U32.unpack_from(buf, off)
        meta[key], off = _read_value(buf, off + 4, vtype)
    infos = []
    for _ in range(n_tensors):
        name, off = _read_string(buf, off)
        (n_dims,) = _U32.unpack_from(buf, off)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
        ttype, t_off = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        infos.append((name, dims, gguf.GGMLQuantizationType(ttype), t_off))
    align = meta.get("general.alignment", 32)
    start = -(-off // align) * align
    tensors = {}
    for name, dims, qtype, t_off in infos:
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // block * block_bytes
        begin = start + t_off
        tensors[name] = GGUFTensor(qtype.name, tuple(reversed(dims)), raw[begin:begin + nbytes])
    return meta, tensors


class GGUFFile:
    """A parsed GGUF file (memory-mapped; tensors are decoded lazily)."""

    def __init__(self, path: str):
        self.path = path
        self.metadata, self.tensors = read_gguf(path)
        arch = self.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.arch = arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def hp(self, key: str, default: Any = None) -> Any:
        """Architecture-scoped hyper-parameter, e.g. hp('block_count') -> llama.block_count."""
        return self.get(f"{self.arch}.{key}", default)

    # ---- config --------------------------------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        heads = self.hp("attention.head_count")
        hidden = self.hp("embedding_length")
        kv_heads = self.hp("attention.head_count_kv", heads)
        head_dim = self.hp("attention.key_length", hidden // heads)
        ctx = self.hp("context_length", 4096)
        rope_kwargs: dict[str, Any] = {"theta": float(self.hp("rope.freq_base", 10000.0))}
        scaling = self.hp("rope.scaling.type", "none")
        if scaling in ("linear", "yarn"):
            rope_kwargs.update(
                rope_type=scaling,
                factor=float(self.hp("rope.scaling.factor", 1.0)),
                original_max_position_embeddings=int(self.hp("rope.scaling.original_context_length", ctx)),
            )
        elif scaling not in ("none", None):
            raise ValueError(f"unsupported GGUF rope scaling {scaling!r}; supported: none, linear, yarn")
        if "rope_freqs.weight" in self.tensors:  # llama3-style scaling baked into per-frequency factors
            rope_kwargs["freq_factors"] = tuple(float(x) for x in self._tensor("rope_freqs.weight").tolist())
        eos = self.get("tokenizer.ggml.eos_token_id")
        eot = self.get("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
        vocab = self.hp("vocab_size") or self.tensors["token_embd.weight"].shape[0]
        gemma = {}
        if self.arch == "gemma3":
            tokens = self.get("tokenizer.ggml.tokens") or []
            if "<end_of_turn>" in tokens:  # a chat turn's end: Gemma's generation config stops there too
                eos_ids = tuple(dict.fromkeys((*eos_ids, tokens.index("<end_of_turn>"))))
            layers = int(self.hp("block_count"))
            window = self.hp("attention.sliding_window")
            gemma = dict(
                sliding_window=int(window) if window else None,
                sliding_layers=gemma3_sliding_layers(layers) if window else (),
                rope_local=RopeConfig(theta=float(self.hp("rope.freq_base_swa", 10000.0))),
                hidden_act="gelu_pytorch_tanh", sandwich_norms=True, scale_embeddings=True,
                query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
                final_logit_softcapping=self.hp("final_logit_softcapping"),
            )
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[self.arch],
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(self.hp("feed_forward_length")),
            num_layers=int(self.hp("block_count")),
            num_heads=int(heads),
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(self.hp("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(ctx),
            rope=RopeConfig(**rope_kwargs),
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            o_bias="blk.0.attn_output.bias" in self.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            name=self.get("general.name", os.path.basename(self.path)),
            **gemma,
        )

    # ---- weights -------------------------------------------------------------------------------------------------
    def _tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self.tensors[name]
        return dequantize(t.type, t.data, t.shape, dtype)

    def weights(self, cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor in `dtype`), one tensor at a time (peak memory: one tensor)."""
        layer_names = _GEMMA_LAYER_NAMES if self.arch == "gemma3" else _LAYER_NAMES
        for name in self.tensors:
            if name == "rope_freqs.weight":
                continue
            base, suffix = name.rsplit(".", 1)  # suffix: weight | bias
            if base.startswith("blk."):
                _, layer, part = base.split(".", 2)
                if part not in layer_names:
                    raise ValueError(f"unexpected GGUF tensor {name!r}")
                hf = f"model.layers.{layer}.{layer_names[part]}.{suffix}"
            elif base in _GLOBAL_NAMES:
                hf = f"{_GLOBAL_NAMES[base]}.{suffix}"
            else:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            w = self._tensor(name, dtype)
            if self.arch == "llama" and base.endswith(("attn_q", "attn_k")):
                heads = cfg.num_heads if base.endswith("attn_q") else cfg.num_kv_heads
                w = _unpermute(w, heads)
            yield hf, w

    # ---- tokenizer -----------------------------------------------------------------------------------------------
    def tokenizer(self) -> Tokenizer | None:
        """The embedded tokenizer, or None if the file carries none."""
        model = self.get("tokenizer.ggml.model")
        if model is None:
            return None
        if model == "llama" and self.arch == "gemma3":
            tokens = self.get("tokenizer.ggml.tokens")
            return _build_gemma_tokenizer(
                tokens, self.get("tokenizer.ggml.token_type") or [1] * len(tokens),
                bos_id=self.get("tokenizer.ggml.bos_token_id"), eos_id=self.get("tokenizer.ggml.eos_token_id"),
                unk_id=self.get("tokenizer.ggml.unknown_token_id"),
                add_bos=bool(self.get("tokenizer.ggml.add_bos_token", True)),
                chat_template=self.get("tokenizer.chat_template") or GEMMA_CHAT_TEMPLATE)
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer type {model!r} is not supported (only byte-level BPE, 'gpt2'); "
                "load the model from its HF directory instead, which carries tokenizer.json"
            )
        pre = self.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(_PRE_TOKENIZERS)}")
        tokens = self.get("tokenizer.ggml.tokens")
        types = self.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in self.get("tokenizer.ggml.merges")]
        return _build_bpe_tokenizer(
            tokens, types, merges, _PRE_TOKENIZERS[pre],
            bos_id=self.get("tokenizer.ggml.bos_token_id"),
            eos_id=self.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(self.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=self.get("tokenizer.chat_template"),
        )


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of q/k (weights (out, in) or biases (out,))."""
    rest = w.shape[1:]
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)


def _build_bpe_tokenizer(tokens, types, merges, pre, *, bos_id, eos_id, add_bos, chat_template) -> Tokenizer:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    regex, individual_digits = pre
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    steps = []
    if individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is not None:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None))
    tk.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    tk.decoder = decoders.ByteLevel()
    return _finish_tokenizer(tk, tokens, types, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos,
                             chat_template=chat_template)


def _finish_tokenizer(tk, tokens, types, *, bos_id, eos_id, add_bos, chat_template) -> Tokenizer:
    """What every GGUF tokenizer shares once its model, normaliser and decoder are set: control (type 3) and
    user-defined (type 4) tokens matched verbatim in text, like llama.cpp and transformers do; BOS prepended when the
    file asks for it; the wrapper with the chat template and the BOS/EOS strings."""
    from tokenizers import AddedToken, processors

    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    if add_bos and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return Tokenizer(tk, chat_template=chat_template, bos_token=bos, eos_token=eos)


# Gemma's turn format (written for longreach after Gemma's documented prompt format): a system message is folded into
# the first user turn, the assistant's role is called "model", every turn ends with <end_of_turn>.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
    "{% else %}"
    "{% if m['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = m['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (ns.system if role == 'user' else '') + m['content'] | trim + "
    "'<end_of_turn>\n' }}"
    "{% if role == 'user' %}{% set ns.system = '' %}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _build_gemma_tokenizer(tokens, types, *, bos_id, eos_id, unk_id, add_bos, chat_template) -> Tokenizer:
    """Gemma's SentencePiece BPE from GGUF metadata: spaces written as U+2581, byte fallback (<0xNN> tokens), no
    prefix space. The file lists no merges: a token's merges are its splits into two vocabulary tokens, ranked by the
    token's place in the vocabulary (Gemma's scores do not follow its merge order; its order does), longer left part
    first; control and byte tokens are never merged into. Tokens of only spaces are stored with real spaces and spelt with U+2581 here, as the normaliser writes
    them. Control tokens (type 3) match as special tokens, user-defined ones (type 4) verbatim."""
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    spelt = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelt)}
    merges = []
    for i, t in enumerate(spelt):
        if types[i] not in (1, 4) or len(t) < 2:  # normal and user-defined tokens (runs of spaces) are merged
            continue
        pairs = [(t[:j], t[j:]) for j in range(len(t) - 1, 0, -1) if t[:j] in vocab and t[j:] in vocab]
        merges.extend(pairs)
    unk = spelt[unk_id] if unk_id is not None else None
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _finish_tokenizer(tk, spelt, types, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos,
                             chat_template=chat_template)


def find_gguf_in_dir(path: str) -> str | None:
    files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    return os.path.join(path, files[0]) if len(files) == 1 else None

