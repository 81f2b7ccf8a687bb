"""Resolve a `--model` argument and build the model: alias, HF directory (safetensors) or GGUF file."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..distributed.group import TPGroup
from .config import ModelConfig
from .gguf import GGUFFile, find_gguf_in_dir
from .hub import ALIASES, DownloadError, resolve_alias
from .llama import LlamaForCausalLM
from .shard import LazyTensor
from .tokenizer import Tokenizer

logger = logging.getLogger("longreach")


def resolve_model_path(model: str) -> str:
    """An alias, a .gguf file, or a directory (HF with config.json, or holding exactly one .gguf) -> a path."""
    if model in ALIASES:
        try:
            return resolve_alias(model)
        except DownloadError as e:
            raise ValueError(f"model alias {model!r}: {e}") from None
    if os.path.isfile(model) and model.endswith(".gguf"):
        return model
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, "config.json")):
            return model
        gguf_file = find_gguf_in_dir(model)
        if gguf_file:
            return gguf_file
    raise ValueError(
        f"model {model!r} not found: expected an alias ({', '.join(ALIASES)}), a Hugging Face model directory "
        "(config.json + *.safetensors), a .gguf file, or random:<shape> (random weights, benchmarks only)"
    )


def _safetensors_weights(path: str, dtype: torch.dtype, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the checkpoint, converted to `dtype`. `lazy` (a tensor-parallel rank): a
    `LazyTensor` each, read only in the part the rank takes (models/shard.py); the file stays open until the next."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():
                yield key, LazyTensor(f.get_slice(key), dtype) if lazy else f.get_tensor(key).to(dtype)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    path: str


def model_config_of(model: str) -> ModelConfig:
    """The model's config, without loading its weights (`load_model` reads the same)."""
    if model.startswith("random:"):
        from .random_init import random_shape

        return random_shape(model).config
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        return GGUFFile(path).model_config()
    with open(os.path.join(path, "config.json")) as f:
        return ModelConfig.from_hf(json.load(f), name=os.path.basename(os.path.normpath(path)))


def load_model(model: str, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None) -> LoadedModel:
    """`tp`: the tensor-parallel group of this rank, which then loads only its part of each tensor (default: one
    rank, the whole model)."""
    if model.startswith("random:"):  # a named shape with random weights, for benchmarks (random_init.py)
        from .random_init import load_random_model

        cfg, net = load_random_model(model, dtype, device, tp)
        return LoadedModel(cfg, net, None, model)
    path = resolve_model_path(model)
    t0 = time.perf_counter()
    if path.endswith(".gguf"):
        gguf = GGUFFile(path)
        cfg = gguf.model_config()
        tokenizer = gguf.tokenizer()
        weights = gguf.weights(cfg, dtype)
    else:
        with open(os.path.join(path, "config.json")) as f:
            cfg = ModelConfig.from_hf(json.load(f), name=os.path.basename(os.path.normpath(path)))
        tokenizer = Tokenizer.from_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
        weights = _safetensors_weights(path, dtype, lazy=tp is not None and tp.world_size > 1)
    net = build_model(cfg, weights, dtype, device, tp)
    if tokenizer is None:
        logger.warning("%s carries no tokenizer: only token-id prompts can be used", path)
    n_params = sum(p.numel() for p in net.parameters())
    part = f", tensor-parallel rank {net.tp.rank} of {net.tp.world_size}" if net.tp.world_size > 1 else ""
    logger.info("loaded %s (%s, %.0fM parameters%s, %s) in %.1f s", cfg.name or path, cfg.architecture,
                n_params / 1e6, part, str(dtype).replace("torch.", ""), time.perf_counter() - t0)
    return LoadedModel(cfg, net, tokenizer, path)


def build_model(cfg: ModelConfig, weights, dtype: torch.dtype, device: torch.device,
                tp: TPGroup | None = None) -> LlamaForCausalLM:
    """Allocate without initialising (meta device), then fill every parameter from `weights` (cut to `tp`'s rank: a
    lazy safetensors tensor is sliced before it is read and moved to `device`; any other is moved whole, then cut)."""
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg, tp)
    net = net.to(dtype).to_empty(device=device)  # allocate in `dtype`: no fp32 copy to convert
    net.load_weights((name, t.to(device)) for name, t in weights)
    net.rotary = type(net.rotary)(cfg.rope, cfg.head_dim).to(device)  # fp32 buffers, rebuilt after to_empty
    if cfg.rope_local is not None:
        net.rotary_local = type(net.rotary)(cfg.rope_local, cfg.head_dim).to(device)
    return net.eval()
