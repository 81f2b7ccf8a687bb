"""Scoring a prompt outside the scheduler: its logits, per-token NLL, or the OpenAI API's `logprobs` / `echo`.

Each runs the prompt as one throw-away sequence through the engine's own runner and backend, one
max_num_batched_tokens chunk at a time, and reduces each chunk's (n, V) logits as soon as they come back, so memory
never holds the whole (T, V). They need an idle engine (no request queued or running) and return their pages when
done or on an error. `LLMEngine.prompt_logprobs` / `prompt_logits` / `prompt_nll` call these through its
`PromptScorer`.

`LogprobsPass` is `prompt_logprobs` one chunk at a time for a caller that interleaves it with engine steps (the
server's engine loop, so a long logprobs request does not hold up admission); its docstring says why that is safe.
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

    def prompt_logprobs(self, token_ids: list[int], num_top: int = 0, start: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Score `token_ids` as one prompt: for each position t in [start, T), log p(token t | tokens < t) and the
        `num_top` most likely tokens at t (the OpenAI API's `logprobs` / `echo`).

        Returns fp32 / int64 CPU tensors: logprobs (T - start,), top_ids (T - start, num_top), top_logprobs
        (T - start, num_top). The same chunked prefill as `prompt_nll`: needs an idle engine, and holds one chunk's
        (n, V) logits at a time, never the whole (T, V).
        """
        self.check_idle()
        with contextlib.closing(LogprobsPass(self, token_ids, num_top, start)) as p:
            if not p.reserve():
                raise ValueError(f"the KV cache cannot hold {len(token_ids)} tokens")
            while not p.done:
                p.advance()
            return p.result()

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

    def check_idle(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError("scoring a prompt needs an idle engine (requests are queued or running)")

    def new_sequence(self, token_ids: list[int]) -> Sequence:
        """A throw-away sequence of `token_ids` with an id of the engine's counter (no pages yet)."""
        if not 0 < len(token_ids) <= self.config.max_model_len:
            raise ValueError(f"token_ids must have 1..{self.config.max_model_len} tokens, got {len(token_ids)}")
        return Sequence(self.next_seq_id(), "score", 0, list(token_ids), SamplingParams(max_tokens=1), frozenset(), 1)

    def run_chunk(self, seq: Sequence, all_logits: bool) -> torch.Tensor | None:
        """Prefill the next max_num_batched_tokens chunk of `seq` (taking its pages if it has not); its fp32 logits
        (n, V) with `all_logits`, else None."""
        n = self.scheduler.chunk(seq, self.config.max_num_batched_tokens)
        if not self.blocks.ensure(seq.seq_id, seq.num_computed + n):
            raise ValueError(f"the KV cache cannot hold {seq.num_tokens} tokens")
        logits, _ = self.runner.execute(ScheduledBatch(True, [seq], [n]), all_logits=all_logits)
        seq.num_computed += n
        return logits if all_logits else None

    def release(self, seq: Sequence) -> None:
        """Give back `seq`'s pages and the backend's state of it (no-op for what it does not hold)."""
        self.blocks.free(seq.seq_id)
        self.backend.free_sequence(seq.seq_id)

    def prefill_chunks(self, token_ids: list[int], all_logits: bool
                       ) -> Iterator[torch.Tensor | None]:
        """Prefill `token_ids` as one throw-away sequence, max_num_batched_tokens at a time, outside the scheduler;
        yields each chunk's fp32 logits (n, V) (None without `all_logits`). Its pages are freed when the generator
        finishes or is closed."""
        self.check_idle()
        seq = self.new_sequence(token_ids)
        try:
            while seq.num_computed < seq.num_tokens:
                yield self.run_chunk(seq, all_logits)
        finally:
            self.release(seq)


class LogprobsPass:
    """`PromptScorer.prompt_logprobs` one chunk at a time: `reserve()` (all the pages up front), then `advance()`
    until `done`, then `result()`; `close()` gives everything back (also on an error, and if it never ran).

    It may run between the engine's steps while requests run (unlike `prompt_logprobs`, which wants an idle
    engine). That is safe because nothing is shared but what is allocated per sequence: the pass is a sequence of its
    own (an id from the engine's counter, so the backends' per-sequence state, keyed by sequence id, never mixes with
    a request's), its pages come from the same block manager through `ensure` like any sequence's, and each chunk is
    a forward pass of its own (`begin_step` ... layers), never inside a step of the scheduler's. Two conditions are
    the caller's, because the scheduler does not see the pass: (1) a seat: the pass counts as one of max_num_seqs
    sequences (InfiniteHiP's box tables, for one, have a row per sequence), so the engine must hold at most
    max_num_seqs - 1 while it runs; (2) pages: `reserve` takes the pages of all T tokens before the first chunk, so
    the pass never waits for a page halfway (holding some while running requests hold the rest); while it cannot
    reserve, the caller lets running requests drain before admitting new ones. Running requests whose pages then run
    out are preempted by the scheduler as under any KV pressure. tests/test_engine_failures.py runs a pass between
    the steps of running requests with dense, InfiniteHiP, Quest, PSA and cascading attention: the same logprobs as
    on an idle engine, the same tokens for the requests.

    Mutates: the engine's block manager (pages held from `reserve` to `close`) and the backend's state of the pass's
    sequence id.
    """

    def __init__(self, scorer: PromptScorer, token_ids: list[int], num_top: int = 0, start: int = 1):
        T = len(token_ids)
        if not 1 <= start < T:
            raise ValueError(f"start must be in [1, {T}) for {T} tokens, got {start}")
        self.scorer, self.num_top, self.start = scorer, num_top, start
        self.seq = scorer.new_sequence(token_ids)
        self.reserved = False
        self._targets = torch.tensor(token_ids, dtype=torch.long, device=scorer.device)
        self._lps: list[torch.Tensor] = []
        self._top_ids: list[torch.Tensor] = []
        self._top_lps: list[torch.Tensor] = []
        self._row0 = 0  # prompt position of the next chunk's first row

    @property
    def done(self) -> bool:
        return self.seq.num_computed >= self.seq.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    def reserve(self) -> bool:
        """Take the pages of all the pass's tokens now, all or nothing; False (nothing taken): not enough are free."""
        self.reserved = self.reserved or self.scorer.blocks.ensure(self.seq.seq_id, self.seq.num_tokens)
        return self.reserved

    @torch.inference_mode()
    def advance(self) -> None:
        """Prefill and score the next chunk (max_num_batched_tokens tokens)."""
        if not self.reserved:
            raise RuntimeError("LogprobsPass.advance before reserve() succeeded")
        logits = self.scorer.run_chunk(self.seq, True)  # (n, V); row i predicts token row0 + i + 1
        n, row0, T = logits.shape[0], self._row0, self.seq.num_tokens
        lo, hi = max(self.start - 1 - row0, 0), min(n, T - 1 - row0)  # rows whose target is in [start, T)
        if lo < hi:
            lp = torch.log_softmax(logits[lo:hi], dim=-1)
            self._lps.append(lp.gather(1, self._targets[row0 + lo + 1: row0 + hi + 1, None])[:, 0])
            if self.num_top:
                v, i = lp.topk(self.num_top, dim=-1)
                self._top_lps.append(v)
                self._top_ids.append(i)
        self._row0 += n

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprobs (T - start,), top_ids (T - start, num_top), top_logprobs (T - start, num_top)), CPU tensors."""
        if not self.done:
            raise RuntimeError("LogprobsPass.result before the pass is done")
        out = torch.cat(self._lps).cpu()
        if not self.num_top:
            return out, torch.empty(len(out), 0, dtype=torch.long), torch.empty(len(out), 0)
        return out, torch.cat(self._top_ids).cpu(), torch.cat(self._top_lps).cpu()

    def close(self) -> None:
        self.scorer.release(self.seq)
        self.reserved = False
