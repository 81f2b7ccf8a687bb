"""Failure isolation inside one engine step: find the request a failure belongs to, so only that one fails.

`LLMEngine.step` calls these only off the happy path, except `sample_isolated`, whose first try is the ordinary
batched sampling (its usability check rides on the same host transfer as the tokens: engine/sampler.py). Each records
the failing requests in the step's `failed` map (request id -> `RequestFailure`); the engine then stops those requests
and frees their pages (`LLMEngine._fail_request`).

Why re-running a step's sequence alone is safe (`execute_alone`): the retry first drops whatever the attention
backend keeps for the sequence (`free_sequence`, as a preemption does), then feeds the same tokens again.
  * the engine advances a sequence (`num_computed`, its tokens) only after the forward returned, and the pages the
    scheduler reserved for the step stay reserved, so the retry feeds exactly the tokens the step fed, into the same
    pages;
  * the forward's writes to the KV cache are idempotent: each new token's K/V goes to the slot fixed by its position
    and page table, so a second run writes the same values to the same slots, whatever the failed run half wrote;
  * the backends' per-sequence state is what a failed run may leave half advanced (attention/*/backend.py
    `begin_step`: the sparse methods' decode-step counter and masks, InfiniteHiP's boxed chunks, committed at the
    step's first layer; PSA's built pages; cascading's rings). Dropped, it is rebuilt from the KV cache by the retry
    as after a prefill that kept no state (the sparse methods refresh their masks, InfiniteHiP and PSA catch up from
    chunk / page 0), so nothing half done survives. Cascading's cache cannot be rebuilt that way: its retry at a
    context > 0 finds no rings and raises, so its requests fail loudly instead of attending a corrupted cache (a
    step of several sequences then fails for all of them, which `execute_alone` treats as the engine's failure).
  * the offloaded store may install a few pages the failed run marked as read (cache policy, not contents).
A dense model's retried sequences compute what they would have in the batch; a sparse method's refresh their
selection one step off its cadence (tests/test_engine_failures.py: with InfiniteHiP, Quest and PSA the survivors'
greedy tokens still equal a clean run's).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .model_runner import ModelRunner
from .outputs import RequestFailure
from .sampler import Sampler
from .scheduler import ScheduledBatch
from .scoring import PromptScorer
from .sequence import Sequence

logger = logging.getLogger("longreach")


def execute_alone(runner: ModelRunner, batch: ScheduledBatch, error: Exception, failed: dict[str, RequestFailure],
                  engine_runs: Callable[[], bool]) -> tuple[torch.Tensor | None, list[int]]:
    """The step's batched forward raised `error`: run each of its sequences alone with the same tokens (safe: the
    module docstring says why) and put the requests whose sequence raises again in `failed`. Returns the survivors'
    logits (N, V) and their indices into `batch.seqs`, as `runner.execute` does.

    Re-raises `error` when no sequence survives and that says the engine, not a request, is broken: two or more
    sequences all failing alone, or a lone one failing while `engine_runs()` (a canary forward: `canary_runs`) fails
    too, e.g. after a sticky CUDA error, which makes every later op raise.
    """
    logger.error("a %s step of %d sequences failed (%s: %s); running each alone to find the failing ones",
                 "prefill" if batch.is_prefill else "decode", len(batch.seqs), type(error).__name__, error,
                 exc_info=error)
    rows, sample_idx, tried, survived = [], [], 0, 0
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
        if seq.request_id in failed:  # a sibling sample already failed its request
            continue
        tried += 1
        try:
            runner.backend.free_sequence(seq.seq_id)  # whatever the failed run half advanced (module docstring)
            prefill = batch.is_prefill and i >= batch.num_decodes  # a mixed step's leading rows decode
            logits, idx = runner.execute(ScheduledBatch(prefill, [seq], [n]))
        except Exception as e:  # noqa: BLE001 -- this request's failure
            logger.error("request %s failed alone too (%s: %s); failing it", seq.request_id, type(e).__name__, e)
            failed[seq.request_id] = RequestFailure("forward_error", f"the model's forward pass raised "
                                                    f"{type(e).__name__}: {e}")
            continue
        survived += 1
        if idx:
            rows.append(logits)
            sample_idx.append(i)
    if not survived and (tried > 1 or not engine_runs()):
        raise error
    return (torch.cat(rows) if rows else None), sample_idx


def canary_runs(scorer: PromptScorer) -> bool:
    """Does a one-token prefill of a throw-away sequence run (engine/scoring.py's kind: its own sequence id and page,
    freed after)? It tells an engine that is broken for everyone from one request's fault. Without a free page it
    falls back to a trivial op on the device."""
    seq = scorer.new_sequence([0])
    try:
        if not scorer.blocks.ensure(seq.seq_id, 1):
            torch.ones(1, device=scorer.device).add_(1).item()
            return True
        scorer.run_chunk(seq, False)
        return True
    except Exception:  # noqa: BLE001
        logger.exception("the canary forward failed too: the engine is broken, not one request")
        return False
    finally:
        try:
            scorer.release(seq)
        except Exception:  # noqa: BLE001
            pass


def sample_isolated(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], failed: dict[str, RequestFailure],
                    engine_runs: Callable[[], bool]) -> list[int | None]:
    """One token per sequence (logits (N, V), one row each). A sequence whose row is unusable (NaN / inf) or that the
    sampler raises on puts its request in `failed`; its token is then None or meaningless. The batched call is the
    normal path; only when it raises is each row sampled alone (an unseeded random row then draws other noise than
    it would have in the batch; greedy and seeded rows draw the same). If every row raises alone too, re-raises as
    `execute_alone` does: a CUDA error of the step's forward surfaces here, at the first host transfer."""
    try:
        tokens, usable = sampler.sample(logits, seqs)
    except Exception as error:  # noqa: BLE001 -- find the row(s) it was
        logger.error("sampling a step of %d sequences failed (%s: %s); sampling each alone", len(seqs),
                     type(error).__name__, error, exc_info=error)
        tokens, usable, errors = [], [], {}
        for i, seq in enumerate(seqs):
            try:
                tok, ok = sampler.sample(logits[i:i + 1], [seq])
            except Exception as e:  # noqa: BLE001
                errors[i] = (seq.request_id, RequestFailure("sampling_error", f"sampling its next token raised "
                                                            f"{type(e).__name__}: {e}"))
                tok, ok = [None], [True]
            tokens += tok
            usable += ok
        if len(errors) == len(seqs) and (len(seqs) > 1 or not engine_runs()):
            raise error from None
        for rid, why in errors.values():
            failed.setdefault(rid, why)
    for seq, ok in zip(seqs, usable):
        if not ok:
            logger.error("request %s: NaN or infinite logits; failing it alone", seq.request_id)
            failed.setdefault(seq.request_id, RequestFailure("non_finite_logits", "the model produced NaN or "
                                                             "infinite logits for it"))
    return tokens
