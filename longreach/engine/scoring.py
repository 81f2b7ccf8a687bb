"""Scoring a prompt outside the scheduler: its logits, per-token NLL, or the OpenAI API's `logprobs` / `echo`.

Each runs the prompt as one throw-away sequence through the engine's own runner and backend, one
max_num_batched_tokens chunk at a time, and reduces each chunk's (n, V) logits as soon as they come back, so memory
never holds the whole (T, V). They need an idle engine (no request queued or running) and return its pages when
done or on an error. `LLMEngine.prompt_logprobs` / `prompt_logits` / `prompt_nll` call these through its
`PromptScorer`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..attention.backend import AttentionBackend
from ..config import EngineConfig
from ..kvcache.block_manager import BlockManager
from ..sampling_params import SamplingParams
from .model_runner import ModelRunner
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence


@dataclass
class PromptScorer:
    """The engine's pieces a scoring pass needs (LLMEngine builds one; `next_seq_id` is its id counter)."""
    config: EngineConfig
    scheduler: Scheduler
    blocks: BlockManager
    runner: ModelRunner
    backend: AttentionBackend
    device: torch.device
    next_seq_id: Callable[[], int]

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int], num_top: int = 0, start: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Score `token_ids` as one prompt: for each position t in [start, T), log p(token t | tokens < t) and the
        `num_top` most likely tokens at t (the OpenAI API's `logprobs` / `echo`).

        Returns fp32 / int64 CPU tensors: logprobs (T - start,), top_ids (T - start, num_top), top_logprobs
        (T - start, num_top). The same chunked prefill as `prompt_nll`: needs an idle engine, and holds one chunk's
        (n, V) logits at a time, never the whole (T, V).
        """
        T = len(token_ids)
        if not 1 <= start < T:
            raise ValueError(f"start must be in [1, {T}) for {T} tokens, got {start}")
        targets = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        lps, top_ids, top_lps, row0 = [], [], [], 0
        with contextlib.closing(self.prefill_chunks(token_ids, True)) as chunks:
            for logits in chunks:  # (n, V); row i predicts token row0 + i + 1
                n = logits.shape[0]
                lo, hi = max(start - 1 - row0, 0), min(n, T - 1 - row0)  # rows whose target is in [start, T)
                if lo < hi:
                    lp = torch.log_softmax(logits[lo:hi], dim=-1)
                    lps.append(lp.gather(1, targets[row0 + lo + 1: row0 + hi + 1, None])[:, 0])
                    if num_top:
                        v, i = lp.topk(num_top, dim=-1)
                        top_lps.append(v)
                        top_ids.append(i)
                row0 += n
        out = torch.cat(lps).cpu()
        if not num_top:
            return out, torch.empty(len(out), 0, dtype=torch.long), torch.empty(len(out), 0)
        return out, torch.cat(top_ids).cpu(), torch.cat(top_lps).cpu()

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], return_logits: bool = True) -> torch.Tensor | None:
        """fp32 logits (T, V) of every position of `token_ids`, via chunked prefill through the engine's backend.

        Runs outside the scheduler (call it while no requests are queued); pages are taken and returned here.
        With `return_logits=False` only the forward passes run (e.g. to capture attention inputs).
        """
        chunks = list(self.prefill_chunks(token_ids, return_logits))
        return torch.cat(chunks) if return_logits else None

    @torch.inference_mode()
    def prompt_nll(self, token_ids: list[int], progress=None) -> torch.Tensor:
        """Per-token negative log-likelihood (T-1,) fp32: entry t is -log p(token t+1 | tokens <= t).

        The same chunked prefill as `prompt_logits`, but each chunk's logits are reduced as soon as they come back,
        so memory holds one chunk's (n, V) logits, never the whole (T, V). `progress` (a progress.Progress) counts
        the chunks' tokens.
        """
        if len(token_ids) < 2:
            raise ValueError(f"prompt_nll needs at least 2 tokens (one context, one target), got {len(token_ids)}")
        targets = torch.tensor(token_ids[1:], dtype=torch.long, device=self.device)
        nll, start = [], 0
        with contextlib.closing(self.prefill_chunks(token_ids, True)) as chunks:  # frees the pages on an error here
            for logits in chunks:  # (n, V); row i predicts token start + i + 1
                tgt = targets[start: start + logits.shape[0]]  # the sequence's last row has no target
                nll.append(torch.nn.functional.cross_entropy(logits[: len(tgt)], tgt, reduction="none"))
                start += logits.shape[0]
                if progress is not None:
                    progress.update(logits.shape[0])
        return torch.cat(nll)

    def prefill_chunks(self, token_ids: list[int], all_logits: bool
                       ) -> Iterator[torch.Tensor | None]:
        """Prefill `token_ids` as one throw-away sequence, max_num_batched_tokens at a time, outside the scheduler;
        yields each chunk's fp32 logits (n, V) (None without `all_logits`). Its pages are freed when the generator
        finishes or is closed."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("scoring a prompt needs an idle engine (requests are queued or running)")
        if not 0 < len(token_ids) <= self.config.max_model_len:
            raise ValueError(f"token_ids must have 1..{self.config.max_model_len} tokens, got {len(token_ids)}")
        seq = Sequence(self.next_seq_id(), "score", 0, list(token_ids), SamplingParams(max_tokens=1), frozenset(), 1)
        try:
            while seq.num_computed < seq.num_tokens:
                n = self.scheduler.chunk(seq, self.config.max_num_batched_tokens)
                if not self.blocks.ensure(seq.seq_id, seq.num_computed + n):
                    raise ValueError(f"the KV cache cannot hold {len(token_ids)} tokens")
                logits, _ = self.runner.execute(ScheduledBatch(True, [seq], [n]), all_logits=all_logits)
                seq.num_computed += n
                yield logits if all_logits else None
        finally:
            self.blocks.free(seq.seq_id)
            self.backend.free_sequence(seq.seq_id)
