"""Token sampling for a batch of sequences with per-sequence parameters.

Greedy rows take the argmax. Other rows: temperature, then top-k, top-p (on the top-k-renormalised distribution) and
min-p (relative to the most likely token), then one draw by the exponential race `argmax(p / E)`, E ~ Exp(1).
A seeded request draws its noise from its own generator, so its samples do not depend on what shares the batch.
"""
from __future__ import annotations

import torch

from .sequence import Sequence


def seeded_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """The generator of sample `index` of a request with `seed` (distinct streams for n > 1)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + index) % (2**63))


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits (N, V) fp32, one row per sequence -> one token id per sequence."""
        return self.sample(logits, seqs)[0]

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[bool]]:
        """logits (N, V) fp32 -> (one token id per sequence, whether its row was usable).

        A row is unusable when its maximum is not finite: a NaN anywhere (max propagates it), +inf, or every entry
        -inf; its token then means nothing and the engine fails that sequence alone. The check is one reduction on
        the device, and its flags come back in the same host transfer as the tokens (no extra sync).
        """
        usable = torch.isfinite(logits.amax(dim=-1))  # (N,)
        tokens = self._tokens(logits, seqs)  # (N,) int64
        host = torch.stack((tokens, usable.to(tokens.dtype))).tolist()
        return host[0], [bool(u) for u in host[1]]

    def _tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        greedy = [s.params.greedy for s in seqs]
        if all(greedy):
            return logits.argmax(dim=-1)
        probs, order = self._filtered_probs(logits, seqs)
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        choice = (probs / noise).argmax(dim=-1, keepdim=True)
        sampled = choice if order is None else order.gather(1, choice)
        sampled = torch.where(torch.tensor(greedy, device=logits.device)[:, None],
                              logits.argmax(dim=-1, keepdim=True), sampled)
        return sampled.squeeze(1)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]):
        """Probabilities after temperature / top-k / top-p / min-p; sorted (with the sort order) when filters apply."""
        dev = logits.device
        temps = torch.tensor([s.params.temperature if not s.params.greedy else 1.0 for s in seqs], device=dev)
        x = logits / temps[:, None]
        V = x.shape[1]
        top_k = [s.params.top_k if 0 < s.params.top_k < V else V for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        if all(k == V for k in top_k) and all(p == 1.0 for p in top_p) and all(m == 0.0 for m in min_p):
            return torch.softmax(x, dim=-1), None
        x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=dev)[None, :]
        x = x.masked_fill(ranks >= torch.tensor(top_k, device=dev)[:, None], float("-inf"))
        probs = torch.softmax(x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop = before >= torch.tensor(top_p, device=dev)[:, None]
        drop |= probs < torch.tensor(min_p, device=dev)[:, None] * probs[:, :1]
        drop[:, 0] = False  # the most likely token always survives
        probs = probs.masked_fill(drop, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True), order
