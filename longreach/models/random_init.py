"""Random-weight models of a named shape: `--model random:llama-3.1-8b`, `--model random:tiny`.

For measuring speed and memory where no checkpoint of that shape is available offline (no 8B checkpoint is): the
weights are seeded normal noise, so what the model writes means nothing, and every log line and benchmark report
made with it says so. There is no tokenizer: prompts are token ids (`{"prompt_token_ids": [...]}`).

Initialisation: every matrix (embedding, q/k/v/o, gate/up/down, head) ~ N(0, 0.02^2), biases 0, RMSNorm weights 1,
drawn by a generator seeded with `SEED` on the target device, straight into the run dtype (8B parameters are
allocated once, in bf16, on the GPU: no fp32 copy and no host-to-device transfer). With std 0.02 a projection of a
normalised activation has std ~0.02 * sqrt(fan_in) (~1.3 at hidden 4096), so the residual stream grows slowly and
stays finite over 32 layers. Attention on random weights is close to uniform: for sparse methods and a KV page cache
that is a worst case of locality, not a typical one.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig, RopeConfig

logger = logging.getLogger("longreach")

PREFIX = "random:"
SEED = 0
INIT_STD = 0.02


@dataclass(frozen=True)
class RandomShape:
    title: str  # how reports name the shape: "random bf16 weights in the {title} shape"
    config: ModelConfig
    why: str = ""  # appended to the report line, e.g. why a random model stands in for the real one


SHAPES: dict[str, RandomShape] = {
    # meta-llama/Llama-3.1-8B config.json; no EOS id: random weights have no meaningful end of text
    "llama-3.1-8b": RandomShape("Llama-3.1-8B", ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192),
        tie_word_embeddings=False, name="random:llama-3.1-8b"), "(no 8B checkpoint offline)"),
    # google/gemma-3-12b-pt's text config (the vocabulary without the image tokens: 262,144 rows, which with these
    # sizes gives keras-hub's published 11,765,788,416 parameters of gemma3_12b_text; tests/test_gemma3.py): 48
    # layers, one global in six, the sliding ones over 1,024 tokens (issue 33's KV-memory goal)
    "gemma-3-12b": RandomShape("Gemma-3-12B", dataclasses.replace(ModelConfig.from_hf({
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None, "tie_word_embeddings": True},
        name="random:gemma-3-12b"), bos_token_id=None, eos_token_ids=()), "(no Gemma 3 12B checkpoint offline)"),
    # CPU tests: head_dim 16 is the smallest the kernels take (a power of two >= 16)
    "tiny": RandomShape("tiny Llama", ModelConfig(
        architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=4096, rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=False, name="random:tiny"), "(CPU tests)"),
}


def is_random_model(model: str) -> bool:
    return isinstance(model, str) and model.startswith(PREFIX)


def random_shape(model: str) -> RandomShape:
    """"random:<shape>" -> its RandomShape; ValueError listing the valid names otherwise."""
    shape = model[len(PREFIX):] if is_random_model(model) else model
    if shape not in SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}; available: "
                         f"{', '.join(PREFIX + name for name in SHAPES)}")
    return SHAPES[shape]


def weights_note(model: str, dtype: torch.dtype) -> str:
    """The line every report made with a random model carries, e.g. "random bf16 weights in the Llama-3.1-8B shape
    (no 8B checkpoint offline)"."""
    shape = random_shape(model)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))
    return f"random {name} weights in the {shape.title} shape" + (f" {shape.why}" if shape.why else "")


@torch.no_grad()
def build_random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = SEED, tp=None):
    """A LlamaForCausalLM of shape `cfg` with seeded random weights, allocated in `dtype` directly on `device`.

    With a tensor-parallel group `tp` of several ranks, each matrix is drawn whole (the same draws as one rank makes,
    one matrix at a time) and cut to the rank's part, so every size gives the same model."""
    from .llama import LlamaForCausalLM, RMSNorm

    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, tp)
        whole = dict(LlamaForCausalLM(cfg).named_parameters()) if not net.shard.whole else None  # shapes only
    net = net.to(dtype).to_empty(device=device)  # cast while on meta: the only allocation is in the run dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, module in net.named_modules():  # a fixed order: a seed gives the same weights on every run of a device
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            if whole is None:
                module.weight.normal_(0.0, INIT_STD, generator=gen)
            else:
                pname = f"{name}.weight"
                full = torch.empty(whole[pname].shape, dtype=dtype, device=device).normal_(0.0, INIT_STD,
                                                                                          generator=gen)
                module.weight.copy_(net.cut_fused(pname, full))
                del full
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
    net.rotary = type(net.rotary)(cfg.rope, cfg.head_dim).to(device)  # fp32 buffers, rebuilt after to_empty
    return net.eval()


def load_random_model(model: str, dtype: torch.dtype, device: torch.device, tp=None) -> tuple[ModelConfig, nn.Module]:
    """(config, model) of "random:<shape>", for `loader.load_model`, which wraps them in a LoadedModel with no
    tokenizer (loader imports this module, not the other way round)."""
    shape = random_shape(model)
    t0 = time.perf_counter()
    net = build_random_model(shape.config, dtype, device, tp=tp)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    n_params = sum(p.numel() for p in net.parameters())
    logger.warning("%s: %s (seed %d, normal std %g; %s parameters, made on %s in %.1f s): its outputs mean "
                   "nothing, it is for speed and memory only; no tokenizer: prompts must be token ids", model,
                   weights_note(model, dtype), SEED, INIT_STD, f"{n_params:,}", device, time.perf_counter() - t0)
    return shape.config, net
