"""The engine loop: requests in, one scheduled step at a time, finished outputs out.

`LLMEngine` owns the model, the paged KV cache, the attention backend, the scheduler and the sampler. `step()` runs
one prefill or decode step and returns the requests that finished in it. Mutates: every call to `add_request` /
`step` / `abort_request` changes the scheduler's queues and the sequences' state; not thread-safe.

With `tensor_parallel_size` N > 1 the engine built by the user is rank 0: it starts ranks 1..N-1 (engine/tp_workers.py),
each building an `LLMEngine` of its own part of the model, KV heads and backend (under torchrun the ranks exist already
and rank 0 joins them); rank 0 alone schedules and samples, and sends each step's plan before running it
(engine/tp_plan.py). `close()` ends the workers.

The setup steps (the fp8 and RoPE changes to the loaded model, the profiling step that sizes the KV cache, the warm-up
graph capture `capture_warm_graphs`) live in engine/engine_setup.py, in the mixin `EngineSetup` the engine inherits.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from ..attention.compose import make_backend
from ..config import EngineConfig
from ..distributed.group import TPGroup
from ..kvcache.build import build_kv_cache
from ..models.loader import load_model
from ..sampling_params import SamplingParams
from . import cpu_runtime
from .chunk_graphs import chunk_graph_sizes
from .devices import resolve_device, resolve_dtype, resolve_kv_dtype, triton_cache_line
from .engine_setup import EngineSetup
from .isolation import canary_runs, execute_alone, sample_isolated
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestFailure, RequestMetrics, RequestOutput
from .sampler import Sampler, seeded_generator
from .scheduler import Scheduler
from .scoring import LogprobsPass, PromptScorer
from .sequence import Sequence, SequenceStatus
from .stopping import append_token

logger = logging.getLogger("longreach")

# Tests: off a GPU, an engine built with this variable at "1" runs the CUDA-graph paths emulated (ModelRunner's
# `emulate`: the static buffers and variants, each replay run eagerly), as a worker process of a tensor-parallel
# engine does too (the variable passes to it): the graph paths of every rank checked on a CPU.
EMULATE_GRAPHS_ENV = "LONGREACH_EMULATE_GRAPHS"

@dataclass
class StepStats:
    is_prefill: bool  # the step had prefill work
    num_seqs: int
    num_tokens: int
    seconds: float
    num_decode_tokens: int = 0  # of num_tokens, those that decoded (all of a decode step's; a mixed step's decodes)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    keep_kv: bool = False  # finished samples keep their pages for `redecode` until `release_kv`


class LLMEngine(EngineSetup):
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        """`tp`: given to the workers of a tensor-parallel engine (their rank's group); the user leaves it out, and with
        `config.tensor_parallel_size` > 1 this engine becomes rank 0 and starts the others."""
        self.device = resolve_device(config.device)
        self.workers = None  # rank 0 of a tensor-parallel engine: its handle on the other ranks' processes
        if tp is None and config.tensor_parallel_size > 1:
            from ..models.loader import model_config_of
            from ..models.shard import check_tensor_parallel
            from .tp_workers import join_torchrun, start_workers, torchrun_env

            launch = torchrun_env(config.tensor_parallel_size)  # launched by torchrun: its ranks exist already
            check_tensor_parallel(model_config_of(config.model), config.tensor_parallel_size)  # before any spawn
            if launch is None:
                self.workers, tp = start_workers(config, self.device, type(self))
            else:
                self.workers, tp = join_torchrun(launch, self.device)
        self.tp = tp or TPGroup.single()
        if self.tp.world_size > 1:
            from .tp_workers import rank_device

            self.device = rank_device(self.device, self.tp.gpu_index)
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        cpu = self.device.type == "cpu"
        # auto: measure the other processes' load while the model loads, then pick the threads (cpu_runtime.py)
        load = cpu_runtime.LoadSample() if cpu and config.cpu_threads is None else None
        loaded = load_model(config.model, self.dtype, self.device, self.tp)
        if cpu:
            logger.info(cpu_runtime.apply(config.cpu_threads, load))
            if cpu_runtime.keep_freed_memory():
                logger.debug("glibc malloc: large tensors from the heap, freed memory kept (cpu_runtime.py)")
        self.model_config, self.model, self.tokenizer = loaded.config, loaded.model, loaded.tokenizer
        if config.quantization == "fp8":
            self._quantize_fp8()
        if config.rope_scaling:
            self._override_rope(json.loads(config.rope_scaling))
        mc = self.model_config
        trained = mc.max_position_embeddings
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=trained)
        elif config.max_model_len > trained:
            logger.warning("max_model_len %d exceeds the model's trained context (%d): dense attention degrades "
                           "past it", config.max_model_len, trained)
        if mc.sliding_window and not mc.has_layer_windows and config.max_model_len > mc.sliding_window:
            logger.warning("the model was trained with a %d-token sliding window; longreach attends over the full "
                           "context", mc.sliding_window)
        self.config = config
        # what this rank's attention and KV cache see: its query and KV heads (all of them with one rank)
        self.rank_model_config = rank_mc = self.model.shard.local_config(mc)
        # one backend, or prefill + decode (attention/compose.py)
        self.backend = make_backend(rank_mc, config, self.device)
        if self.device.type == "cuda":
            logger.info(triton_cache_line())

        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        layout = self.backend.kv_layout  # a bounded cache's own slot layout (attention/backend.py), or None
        self.blocks, self.kv_cache = build_kv_cache(config, rank_mc, self.kv_dtype, self.device,
                                                    self.backend.kv_needs(self.dtype), self._profile_free_gpu_memory,
                                                    self.tp.min_int)
        self.backend.bind_kv_cache(self.blocks.num_blocks * config.block_size, self.dtype)
        self.runner = ModelRunner(self.model, config, self.kv_cache, self.blocks, self.backend, self.device)
        if self.workers is not None:  # rank 0: every forward pass is announced to the workers first
            from .tp_plan import PlanSender

            self._plans = PlanSender(self.tp, self.blocks, self.workers.check_alive)
            self.runner.before_step = self._plans.send
        emulate = self.device.type != "cuda" and os.environ.get(EMULATE_GRAPHS_ENV) == "1"
        self.runner.capture_graphs(emulate=emulate)
        # one step may carry decode rows and prefill chunks when the backend can attend both in one forward pass and
        # the whole context is on the GPU (an offloaded prefill attends on its staging area: steps of their own)
        mixed = self.backend.capabilities.mixed_batches and self.kv_cache.max_prefill_pages is None
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   on_release=self._release_sequence,
                                   max_prefill_pages=self.kv_cache.max_prefill_pages,
                                   chunk_align=layout.stride if layout else 1, mixed=mixed,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                                   max_num_partial_prefills=config.max_num_partial_prefills,
                                   max_long_partial_prefills=config.max_long_partial_prefills,
                                   mixed_step_target_s=(config.mixed_step_target_ms / 1000
                                                        if config.mixed_step_target_ms else None))
        # after the decode graphs, once the scheduler says which chunk sizes it cuts (engine/chunk_graphs.py)
        self.runner.capture_chunk_graphs(chunk_graph_sizes(self.scheduler.chunk_sizes(), config.chunk_graph_max_tokens,
                                                           config.max_num_batched_tokens),
                                         emulate=emulate and self.runner.decode_graphs)
        self.sampler = Sampler(self.device, config.seed)
        self._requests: dict[str, _Request] = {}
        self._kept: dict[str, _Request] = {}  # finished keep_kv requests, their pages held (redecode / release_kv)
        self._seq_ids = itertools.count()
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer and self.tokenizer.eos_token_id is not None else set())
        self.last_step: StepStats | None = None
        self.scorer = PromptScorer(self.config, self.scheduler, self.blocks, self.runner, self.backend, self.device,
                                   lambda: next(self._seq_ids))

    def _release_sequence(self, seq: Sequence) -> None:
        """The scheduler freed a sequence's pages (it finished or was preempted): drop what was kept for it."""
        self.backend.free_sequence(seq.seq_id)
        self.runner.free_sequence(seq.seq_id)

    # ---- KV (sized and built in kvcache/build.py) ---------------------------------------------------------------
    def kv_cache_stats(self) -> dict:
        """KV-cache occupancy and, with offloading, the cumulative page counters (kvcache/base.py: occupancy)."""
        return self.kv_cache.occupancy(self.blocks)

    # ---- requests ------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, keep_kv: bool = False) -> None:
        """Queue a request. `keep_kv`: when its samples finish, their KV stays in the cache (pages held) so that
        `redecode` can decode them again from their first generated token without prefilling the prompt again;
        `release_kv` frees it. Not with tensor parallelism or a KV store that keeps pages off the GPU (ValueError)."""
        if request_id in self._requests or request_id in self._kept:
            raise ValueError(f"request id {request_id!r} is already in use")
        if keep_kv and (self.tp.world_size > 1 or self.kv_cache.max_prefill_pages is not None):
            raise ValueError("keep_kv (decoding a prompt again from its kept KV) works with one process and a KV "
                             "cache whose pages all stay on the GPU; this engine has "
                             + ("tensor parallelism" if self.tp.world_size > 1 else
                                "a KV cache that stages prefills (pages in host memory)"))
        self.check_prompt(prompt_token_ids)
        n_prompt = len(prompt_token_ids)
        limit = self.config.max_model_len
        room = limit - n_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seqs = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, i, list(prompt_token_ids), params, eos, max_tokens)
            if params.seed is not None:
                seq.generator = seeded_generator(params.seed, i, self.device)
            if self.tokenizer is not None:
                seq.decoder = self.tokenizer.decode_stream(params.skip_special_tokens)
            seqs.append(seq)
            self.scheduler.add(seq)
        self._requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), seqs, keep_kv)

    def redecode(self, request_id: str) -> RequestOutput | None:
        """Queue a finished `keep_kv` request again: each sample restarts from its first generated token (sampled
        from the prefill, kept) with the prompt's KV as the prefill left it, and decodes anew under the engine's
        current decode method and state (its per-sequence decode state dropped). Its pages beyond the prompt are
        overwritten as it goes. Returns None, and the request comes out of `step` again when its samples finish; or,
        when every sample stops at its first token again, its output at once. Either way it stays kept."""
        req = self._kept.pop(request_id, None)
        if req is None:
            raise ValueError(f"request {request_id!r} is not a finished request kept with keep_kv (kept: "
                             f"{sorted(self._kept) or 'none'})")
        for seq in req.seqs:
            self.backend.free_sequence(seq.seq_id)
            self.runner.free_sequence(seq.seq_id)
            decoder = self.tokenizer.decode_stream(seq.params.skip_special_tokens) \
                if self.tokenizer is not None else None
            append_token(seq, seq.rewind_to_first_token(decoder))  # a first-token stop stops again
            if seq.finished:
                seq.times.finished = time.perf_counter()
            else:
                self.scheduler.resume(seq)
        if all(seq.finished for seq in req.seqs):
            self._kept[request_id] = req
            return self._output(req)
        self._requests[request_id] = req
        return None

    def release_kv(self, request_id: str) -> None:
        """Free the pages of a finished `keep_kv` request (it can no longer be redecoded)."""
        req = self._kept.pop(request_id, None)
        if req is None:
            raise ValueError(f"request {request_id!r} is not a finished request kept with keep_kv")
        for seq in req.seqs:
            self.scheduler.finish(seq)

    def check_prompt(self, token_ids: list[int], name: str = "the prompt") -> None:
        """Raise ValueError unless `token_ids` can be served: non-empty, shorter than max_model_len, in the vocab."""
        n, limit = len(token_ids), self.config.max_model_len
        if n == 0:
            raise ValueError(f"{name} is empty: it has no tokens")
        if n >= limit:
            raise ValueError(f"{name} has {n} tokens; max_model_len={limit} allows at most {limit - 1} (one position "
                             "is needed for the first generated token; raise --max-model-len or shorten the prompt)")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"{name}: token ids must be in [0, {vocab}), got {min(token_ids)}..{max(token_ids)}")

    def abort_request(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        for seq in req.seqs if req else ():
            if not seq.finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- serving hooks (longreach/server): streaming progress and prompt scoring ------------------------------------
    def request_progress(self, request_id: str) -> list[CompletionOutput] | None:
        """The samples of an unfinished request as they stand after the last step; None once it has finished (its
        RequestOutput came out of `step`) or was aborted. A sample that already stopped has its finish_reason set.

        For streaming: call between steps. `token_ids` is the engine's own live list, not a copy: read it (e.g. the
        tail past what was already sent) before the next step, never keep or mutate it.
        """
        req = self._requests.get(request_id)
        if req is None:
            return None
        return [CompletionOutput(s.index, s.text, s.output_token_ids, s.finish_reason, s.stop_reason) for s in req.seqs]

    def prompt_logprobs(self, token_ids: list[int], num_top: int = 0, start: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """log p(token t | tokens < t) for t in [start, T) and the `num_top` likeliest tokens (engine/scoring.py)."""
        return self.scorer.prompt_logprobs(token_ids, num_top, start)

    def start_prompt_logprobs(self, token_ids: list[int], num_top: int = 0, start: int = 1) -> LogprobsPass:
        """`prompt_logprobs` as a pass to run one chunk at a time between steps while requests run (the server);
        engine/scoring.py: LogprobsPass says what its caller must keep (a free seat, pages reserved first)."""
        return LogprobsPass(self.scorer, token_ids, num_top, start)

    def num_unfinished_sequences(self) -> int:
        """Sequences queued or running (a request of n samples counts n until each finishes)."""
        return sum(not s.finished for r in self._requests.values() for s in r.seqs)

    def prompt_logits(self, token_ids: list[int], return_logits: bool = True) -> torch.Tensor | None:
        """fp32 logits (T, V) of every position, by chunked prefill outside the scheduler (engine/scoring.py)."""
        return self.scorer.prompt_logits(token_ids, return_logits)

    def prompt_nll(self, token_ids: list[int], progress=None) -> torch.Tensor:
        """Per-token negative log-likelihood (T-1,) fp32 (engine/scoring.py)."""
        return self.scorer.prompt_nll(token_ids, progress)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; returns the requests that finished in it, and those that failed in it.

        Failure isolation: a request whose row of the step cannot be used (NaN / inf logits, the forward raising on
        it alone, the sampler or the stop rules raising on it) is stopped, its pages freed, and comes back with
        `RequestOutput.error` set; the other requests of the step go on unchanged. What still raises from here is
        fatal for the engine: the scheduler's bookkeeping, or a forward that fails for every sequence of the step
        even alone (engine/isolation.py, which also says why re-running a step's sequence is safe).
        """
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        t0 = time.perf_counter()
        for seq in batch.seqs:
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = t0
        if not self.scheduler.prefill_pending():
            self.kv_cache.release_transient()  # no prefill left to stage
        failed: dict[str, RequestFailure] = {}  # request id -> why, this step
        engine_runs = lambda: canary_runs(self.scorer)  # noqa: E731 -- asked only when every sequence failed
        try:
            logits, sample_idx = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001 -- isolated below; re-raised when nothing survives
            if self.workers is not None:  # the ranks are out of step: fatal (a dead worker, named, if one died)
                raise (self.workers.failure(wait_s=2.0) or e) from e
            logits, sample_idx = execute_alone(self.runner, batch, e, failed, engine_runs)
        kv_counts = self.runner.last_kv_counts
        if kv_counts is not None:
            for seq in batch.seqs:
                for key, n in kv_counts.items():
                    seq.kv_counts[key] = seq.kv_counts.get(key, 0) + n
        sampling = [batch.seqs[i] for i in sample_idx]
        tokens = sample_isolated(self.sampler, logits, sampling, failed, engine_runs) if sampling else []
        if self.scheduler.step_paced:  # its chunks' pacer wants the step's whole time, the GPU's work included
            if self.device.type == "cuda":  # its stream's work (not a background copy's: kvcache/prefetch.py)
                torch.cuda.current_stream(self.device).synchronize()
            self.scheduler.observe(time.perf_counter() - t0)
        now = time.perf_counter()
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
        finished: list[RequestOutput] = []
        for seq, tok in zip(sampling, tokens):
            if seq.request_id in failed:
                continue
            if seq.times.first_token is None:
                seq.times.first_token = now
            try:
                append_token(seq, tok)  # detokenizer and stop strings: per-request code
            except Exception as e:  # noqa: BLE001 -- this request's failure, not the engine's
                logger.exception("request %s: recording its token failed; failing it alone", seq.request_id)
                failed[seq.request_id] = RequestFailure("postprocess_error", f"decoding its output or checking its "
                                                        f"stop rules raised {type(e).__name__}: {e}")
                continue
            if seq.finished:
                seq.times.finished = now
                if self._requests[seq.request_id].keep_kv:
                    self.scheduler.retire(seq)  # its pages stay: `redecode` / `release_kv`
                else:
                    self.scheduler.finish(seq)
                out = self._request_output_if_done(seq.request_id)
                if out is not None:
                    finished.append(out)
        finished += [self._fail_request(rid, why, now) for rid, why in failed.items()]
        decoded = batch.num_decodes if batch.is_prefill else len(batch.seqs)
        self.last_step = StepStats(batch.is_prefill, len(batch.seqs), batch.total_tokens, now - t0, decoded)
        if logger.isEnabledFor(logging.DEBUG):
            kind = "Mixed" if batch.mixed else "Prefill" if batch.is_prefill else "Decode"
            kv = ""
            if kv_counts is not None:
                mb = kv_counts["installed"] * self.kv_cache.slot_nbytes / 1e6
                kv = (f", KV pages hit {kv_counts['hit']} missed {kv_counts['missed']} evicted "
                      f"{kv_counts['evicted']} installed {kv_counts['installed']} ({mb:.1f} MB host->GPU)")
            logger.debug("%s batch: %d seqs, %d tokens, %.1f ms, %.0f tok/s, KV pages used %d/%d, queued %d%s", kind,
                         len(batch.seqs), batch.total_tokens, 1e3 * (now - t0), batch.total_tokens / (now - t0),
                         self.blocks.num_blocks - self.blocks.num_free_blocks, self.blocks.num_blocks,
                         len(self.scheduler.waiting), kv)
        return finished

    def check_workers(self) -> None:
        """Raise `WorkerDied` if a tensor-parallel worker process has exited (the server's engine loop asks while
        idle, so that a dead rank is reported before the next request); nothing with one process or under
        torchrun (whose agent watches the ranks)."""
        if self.workers is not None:
            self.workers.check_alive()

    def close(self, stop: bool = True) -> None:
        """Release what outlives the engine object: a tensor-parallel engine's worker processes (stopped, then
        joined; terminated if they do not leave). `stop` False: terminate them without sending the stop plan (another
        thread may still be inside a step, where the workers would never read it). Idempotent; the engine cannot
        step afterwards."""
        workers, self.workers = self.workers, None
        if workers is not None:
            plans = getattr(self, "_plans", None)
            workers.close(plans.stop if plans is not None and stop else None)
            self.tp = TPGroup.single()

    def _fail_request(self, request_id: str, why: RequestFailure, now: float) -> RequestOutput:
        """Stop every unfinished sample of the request (finish_reason "error", pages freed) and return its output
        with `error` set. Its other requests' sequences are untouched."""
        req = self._requests.pop(request_id)
        for seq in req.seqs:
            if not seq.finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "error"
                seq.times.finished = now
                self.scheduler.finish(seq)
        out = self._output(req)
        out.error = why
        return out

    def _request_output_if_done(self, request_id: str) -> RequestOutput | None:
        req = self._requests[request_id]
        if not all(s.finished for s in req.seqs):
            return None
        del self._requests[request_id]
        if req.keep_kv:
            self._kept[request_id] = req
        return self._output(req)

    @staticmethod
    def _output(req: _Request) -> RequestOutput:
        def first(times):  # a failed request's samples may lack some times
            return min((t for t in times if t is not None), default=None)

        metrics = RequestMetrics(
            arrival_time=req.seqs[0].times.arrival,
            first_scheduled_time=first(s.times.first_scheduled for s in req.seqs),
            first_token_time=first(s.times.first_token for s in req.seqs),
            finished_time=max((s.times.finished for s in req.seqs if s.times.finished is not None), default=None),
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generated_tokens=sum(len(s.output_token_ids) for s in req.seqs),
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
            kv_pages_hit=sum(s.kv_counts.get("hit", 0) for s in req.seqs),
            kv_pages_missed=sum(s.kv_counts.get("missed", 0) for s in req.seqs),
            kv_pages_evicted=sum(s.kv_counts.get("evicted", 0) for s in req.seqs),
            kv_pages_installed=sum(s.kv_counts.get("installed", 0) for s in req.seqs),
        )
        outs = [CompletionOutput(s.index, s.text, list(s.output_token_ids), s.finish_reason, s.stop_reason)
                for s in req.seqs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, metrics)
