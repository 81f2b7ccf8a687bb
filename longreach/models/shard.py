"""Which part of the model one tensor-parallel rank holds, and how a checkpoint tensor is cut to it.

Megatron's split (docs/design-tensor-parallel.md, "What is split"):
  * attention heads: rank r of N holds query heads [r Hq/N, (r+1) Hq/N) and the KV heads of their groups. With N
    above the model's KV heads each rank holds one KV head, `r * Hkv // N` (vLLM's rule): the KV heads are replicated,
    each replica's cache kept by the ranks that share it;
  * q/k/v and gate/up are column-parallel (each rank its output rows); o_proj and down_proj row-parallel (each rank
    its input columns, the partial outputs summed by an all-reduce; a bias is added once, by rank 0);
  * embedding and LM head: vocab-parallel, rank r holds rows [r Vp, (r+1) Vp) with Vp = ceil(V / N), the last rank's
    rows past V zero (so every rank's shard has the same shape for the gather);
  * norms and RoPE: replicated.

`ModelShard.cut` takes one checkpoint tensor (HF name, after the GGUF K-quants are dequantised) and returns this
rank's part: a rank holds one full tensor at a time while loading, never the full model. A safetensors checkpoint
is read lazily under tensor parallelism (`LazyTensor`): only the rank's rows or columns come off the disk, so N ranks
read the split weights once in all, not N times.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .config import ModelConfig


def allowed_sizes(cfg: ModelConfig) -> list[int]:
    """The tensor-parallel sizes that split `cfg`: they divide the query heads and the MLP's width, and divide the
    KV heads or are a multiple of them."""
    return [n for n in range(1, cfg.num_heads + 1)
            if cfg.num_heads % n == 0 and cfg.intermediate_size % n == 0
            and (cfg.num_kv_heads % n == 0 or n % cfg.num_kv_heads == 0)]


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming the allowed sizes unless `size` ranks can split `cfg`."""
    if size not in allowed_sizes(cfg):
        raise ValueError(
            f"tensor_parallel_size={size} cannot split {cfg.name or 'this model'} ({cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads, MLP width {cfg.intermediate_size}): the size must divide the query heads "
            f"and the MLP width, and divide the KV heads or be a multiple of them; allowed: "
            f"{', '.join(map(str, allowed_sizes(cfg)))}")


class LazyTensor:
    """A checkpoint tensor not read yet (a safetensors `get_slice` handle): `shape`, and indexing by slices (`t[a:b]`,
    `t[:, a:b]`) reads that part only, converted to `dtype` and moved to `device` (`to(device)` sets it, as a tensor's
    would move it); `whole()` reads it all. Valid while its file is open (models/loader.py yields one at a time and
    reads the next only after it was used)."""

    def __init__(self, handle, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self._handle, self.dtype, self.device = handle, dtype, torch.device(device)
        self.shape = torch.Size(handle.get_shape())

    def to(self, device: torch.device | str) -> "LazyTensor":
        return LazyTensor(self._handle, self.dtype, device)

    def __getitem__(self, index) -> torch.Tensor:
        return self._handle[index].to(device=self.device, dtype=self.dtype)

    def whole(self) -> torch.Tensor:
        return self[tuple(slice(None) for _ in self.shape)]


def materialize(tensor) -> torch.Tensor:
    """`tensor` itself, or all of a LazyTensor read."""
    return tensor.whole() if isinstance(tensor, LazyTensor) else tensor


@dataclass(frozen=True)
class ModelShard:
    rank: int
    size: int
    q_heads: range  # the query heads this rank holds (global indices)
    kv_heads: range  # the KV heads it holds (one replicated head when size > the model's KV heads)
    inter: range  # its columns of the MLP's intermediate dim
    vocab_start: int
    vocab_rows: int  # rows of its embedding / LM-head shard, Vp = ceil(V / size) (padding rows past V are zero)
    head_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> "ModelShard":
        check_tensor_parallel(cfg, size)
        hq, hkv = cfg.num_heads // size, max(cfg.num_kv_heads // size, 1)
        kv0 = rank * cfg.num_kv_heads // size
        width = cfg.intermediate_size // size
        vp = -(-cfg.vocab_size // size)
        return cls(rank, size, range(rank * hq, (rank + 1) * hq), range(kv0, kv0 + hkv),
                   range(rank * width, (rank + 1) * width), rank * vp, vp, cfg.head_dim)

    @property
    def whole(self) -> bool:
        return self.size == 1

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` as this rank's attention backend and KV cache see it: its query and KV heads only."""
        return dataclasses.replace(cfg, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   whole_heads=(cfg.num_heads, cfg.num_kv_heads),
                                   first_heads=(self.q_heads.start, self.kv_heads.start))

    def _head_rows(self, heads: range) -> slice:
        return slice(heads.start * self.head_dim, heads.stop * self.head_dim)

    def cut(self, module: str, slot: int | None, tensor: torch.Tensor, is_bias: bool) -> torch.Tensor:
        """This rank's part of the full checkpoint tensor for `module` ("self_attn.qkv_proj", "mlp.down_proj",
        "embed_tokens", ...; `slot`: q/k/v 0/1/2, gate/up 0/1). A view where it can be one; from a LazyTensor, only
        the part is read (a replicated tensor whole)."""
        if self.whole:
            return materialize(tensor)
        if module == "self_attn.qkv_proj":  # column-parallel by heads
            return tensor[self._head_rows(self.q_heads if slot == 0 else self.kv_heads)]
        if module == "mlp.gate_up_proj":  # column-parallel, gate and up alike
            return tensor[self.inter.start:self.inter.stop]
        if module in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: input columns; the bias added once
            if is_bias:
                return materialize(tensor) if self.rank == 0 else torch.zeros(tensor.shape, dtype=tensor.dtype,
                                                                             device=tensor.device)
            cols = self._head_rows(self.q_heads) if module == "self_attn.o_proj" else slice(self.inter.start,
                                                                                           self.inter.stop)
            return tensor[:, cols]
        if module in ("embed_tokens", "lm_head"):  # vocab-parallel, zero rows past the vocab
            part = tensor[self.vocab_start:self.vocab_start + self.vocab_rows]
            if part.shape[0] < self.vocab_rows:
                part = torch.cat([part, part.new_zeros(self.vocab_rows - part.shape[0], *part.shape[1:])])
            return part
        return materialize(tensor)  # norms: replicated
