"""The cascading cache's config, presets and slot layout (`CascadeLayout`: where a sequence's tokens live among its
own KV slots; the engine's block manager and model runner ask it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CascadingConfig:
    n_sink: int = 64  # first tokens, never evicted
    num_subcaches: int = 8  # N sub-caches (cascading windows); sub-cache j spans ~subcache_size * 2^j tokens
    subcache_size: int = 8184  # tokens per sub-cache (all equal)
    ema: float = 0.999  # importance EMA factor per query token (memory ~ 1 / (1 - ema) tokens)
    stride: int = 4096  # prefill stride: tokens that attend together before entering the cache
    block_q: int = 64  # query rows per block of the attention index (prefill)
    block_k: int = 64  # key-block size of the attention index
    flash_prefill: bool = True  # prefill strides: gather + FlashAttention (CUDA sm80+, fp16/bf16; `_gathered_step`)

    def __post_init__(self) -> None:
        for name, lo in (("n_sink", 0), ("num_subcaches", 1), ("subcache_size", 1), ("stride", 1), ("block_q", 1),
                         ("block_k", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"cascading: {name} must be an integer >= {lo}, got {v!r}")
        if self.num_subcaches > 32:
            raise ValueError(f"cascading: num_subcaches must be <= 32 (sub-cache j spans 2^j times its size), got "
                             f"{self.num_subcaches}")
        if not isinstance(self.flash_prefill, bool):
            raise ValueError(f"cascading: flash_prefill must be true or false, got {self.flash_prefill!r}")
        if isinstance(self.ema, bool) or not isinstance(self.ema, (int, float)) or not 0.0 <= self.ema < 1.0:
            raise ValueError(f"cascading: ema must be a number in [0, 1), got {self.ema!r}")

    @property
    def capacity(self) -> int:
        """Tokens the sub-caches hold (the sink not counted)."""
        return self.num_subcaches * self.subcache_size

    @property
    def cache_tokens(self) -> int:
        """Tokens the cache holds: sink + sub-caches."""
        return self.n_sink + self.capacity


PRESETS = {
    "65k": CascadingConfig(n_sink=64, num_subcaches=8, subcache_size=8184),  # the blog's passkey setting: 65,536
    "16k": CascadingConfig(n_sink=64, num_subcaches=8, subcache_size=2040),  # the blog's 1M-prefill setting: 16,384
    "4k": CascadingConfig(n_sink=64, num_subcaches=4, subcache_size=1008, stride=1024),  # 4,096: small, CPU evals
}
DEFAULT_PRESET = "65k"
PRESET_NOTES = {  # preset -> what it is for (`longreach backends`)
    "65k": "a 65,536-token cache: 64 sink + 8 sub-caches of 8,184 (the blog's passkey setting; default)",
    "16k": "a 16,384-token cache: 8 sub-caches of 2,040 (the blog's 1M-prefill setting)",
    "4k": "a 4,096-token cache: 4 sub-caches of 1,008 (small: CPU evals)",
}


@dataclass(frozen=True)
class CascadeLayout:
    """Where a cascading sequence's tokens live among its own KV slots (local slot i = page table[i // block_size]
    at offset i % block_size):
        [0, n_sink)                      the sink, token t in slot t
        [n_sink, n_sink + capacity)      the sub-caches' rings, sub-cache j at n_sink + j * subcache_size, filled in
                                         order (sub-cache j+1 gets tokens only once sub-cache j is full)
        stage_base(end) + i              the step's i-th new token past the sink, staged right after the rings'
                                         filled part (after the step), until it moves into sub-cache 0
    So a sequence of n tokens uses at most `slots_for(n)` slots: about 2n while short, `max_slots` whatever n."""

    n_sink: int
    capacity: int
    max_step: int  # most tokens one step gives a sequence (max_num_batched_tokens)
    stride: int  # prefill strides cover positions [k * stride, (k + 1) * stride); chunks end on their boundaries
    side_bytes_per_token: int  # importance (fp32) + position (int32) per layer and KV head, beside the K/V rows

    @property
    def max_slots(self) -> int:
        return self.n_sink + self.capacity + self.max_step

    def slots_for(self, num_tokens: int) -> int:
        if num_tokens <= self.n_sink:
            return num_tokens
        past = num_tokens - self.n_sink
        return self.n_sink + min(past, self.capacity) + min(past, self.max_step)

    def stage_base(self, end: int) -> int:
        """First staging slot of a step whose sequence holds `end` tokens after it."""
        return self.n_sink + min(max(end - self.n_sink, 0), self.capacity)

    def slot_index(self, start: int, n: int) -> np.ndarray:
        """Local slots (n,) of tokens [start, start + n) fed in one step."""
        t = np.arange(start, start + n, dtype=np.int64)
        return np.where(t < self.n_sink, t, self.stage_base(start + n) + t - max(start, self.n_sink))
