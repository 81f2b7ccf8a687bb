"""`longreach bench decode`'s runs, one engine step at a time (bench/decode.py plans them and builds the rows): the
prompts, the untimed warm-up's length, and `_drive`, which prefills and decodes a batch timing every step between
device synchronisations and says of each decode step whether it counts in the rate, and if not, why:
  graph_capture  a CUDA-graph variant was captured in the step;
  jit            a Triton kernel compiled in it (kernels/jit_watch.py);
  first_eager    without CUDA graphs, the first decode step (its kernels' first launch);
  profiled       it ran under torch.profiler (--profile-steps);
  prefill_pending  a step of the sequences already prefilled while the batch's other prompts were still waiting or
                 part-way through theirs (an offloaded store, which mixes no decode rows into prefill steps,
                 alternates such steps with the prefill's): fewer rows than the batch, no steady batch step.
A batch decodes together only once every prompt is prefilled, and the first prompts done decode meanwhile (one token
per prefill step in a mixed step, or per alternating decode step): each request may generate `catch_up_tokens` more
than `decode_tokens`, and the run stops (aborting the requests) after `decode_tokens - 1` decode steps counted from
the moment no prompt was left to prefill, so every batch has that many steps of all its rows.
"""
from __future__ import annotations

import time

from .decode_memory import _kv_stats

EXCLUDED = ("graph_capture", "jit", "first_eager", "profiled", "prefill_pending")  # why a decode step is left out


def catch_up_tokens(batch: int, context: int, engine_kwargs: dict) -> int:
    """Tokens a request of a `batch` of `context`-token prompts may decode while the others are still prefilled: at
    most one per prefill step, and a prefill step carries at least one chunk of min(budget less the other rows,
    long-prefill threshold) tokens (with --mixed-step-target-ms, the pacer's smallest chunk) or a prompt's last
    piece, so there are at most batch x ceil(context / that) of them (0 alone). A prefill that cannot get pages or
    staging room for a step is not bounded by it: `counted_rows_min` then says the counted steps lacked rows."""
    if batch <= 1:
        return 0
    from ...config import EngineConfig
    from ...engine.pacing import MIN_CHUNK

    budget = engine_kwargs.get("max_num_batched_tokens") or EngineConfig().max_num_batched_tokens
    chunk = min(budget - (batch - 1), engine_kwargs.get("long_prefill_token_threshold") or max(budget // 4, 1))
    if engine_kwargs.get("mixed_step_target_ms"):
        chunk = min(chunk, MIN_CHUNK)
    return batch * -(-context // max(1, chunk))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":  # the engine's stream: a background copy (kvcache/prefetch.py) is not the step's time
        torch.cuda.current_stream(device).synchronize()


def _prompts(vocab: int, context: int, batch: int, seed: int, text_ids: list[int] | None = None) -> list[list[int]]:
    """The same prompts for every method at one context: random token ids (skipping the lowest ids: special tokens),
    or with `text_ids` (a tokenized text) that text repeated to `context` tokens, sequence i starting i * 997 tokens
    into it."""
    import torch

    if text_ids:
        reps = -(-(context + batch * 997) // len(text_ids))
        ids = text_ids * reps
        return [ids[i * 997: i * 997 + context] for i in range(batch)]
    g = torch.Generator().manual_seed(seed * 1_000_003 + context)
    low = min(100, vocab // 2)
    return [torch.randint(low, vocab, (context,), generator=g).tolist() for _ in range(batch)]


def _warmup_len(context: int, engine, asked: int | None) -> int:
    """Tokens of the untimed warm-up prompt run on each engine before its measured prompt: `asked`, or by default the
    server's warm-up length (`EngineSetup.warmup_prompt_tokens`: one chunk + 1024 past the longest context the
    backend attends densely at, so that a whole chunk with a prefix runs the sparse kernels, long-prefill layouts
    included), at most half the context. After it the engine captures its graphs at every context bucket
    (`LLMEngine.capture_warm_graphs`, as the server's warm-up); kernels that still compile in the timed run (the
    eager attention's variants of a longer context) are counted, timed and named by `prefill_jit` (a note says so)."""
    if asked is not None:
        return max(0, min(asked, context))
    return min(context // 2, engine.warmup_prompt_tokens())


def _text_ids(engine, text: str | None) -> list[int] | None:
    if text is None:
        return None
    if engine.tokenizer is None:
        raise ValueError(f"{engine.config.model} has no tokenizer: a text prompt needs a real checkpoint "
                         "(random models take random token ids; drop --text-file / --text-source)")
    ids = engine.tokenizer.encode(text)
    if not ids:
        raise ValueError("the prompt text is empty")
    return ids


def _note(msg: str) -> None:
    from ..eval.common import note

    note(f"bench decode: {msg}")


def _drive(engine, prompts: list[list[int]], decode_tokens: int, label: str, profile_steps: int = 0,
           profile_prefill_steps: int = 0, timed: bool = True, catch_up: int = 0,
           profile_prefill_at: float = 0.0, trace: str | None = None) -> dict:
    """Prefill and decode every prompt through `engine`, one timed step at a time; the last `profile_steps` decode
    steps run under the profiler (bench/profile.py) and are left out of the rate; so do the prefill steps from the
    second one on (or from the first that starts past `profile_prefill_at` of the prompt tokens),
    `profile_prefill_steps` of them (their time stays in the prefill seconds, profiler overhead included: a run that
    profiles its prefill says where the time goes, not how much there is). `timed`: False for
    the warm-up run (no note about what compiled in it). `catch_up`: the tokens each request may decode beyond
    `decode_tokens` while others still prefill (`catch_up_tokens`; the engine's max_model_len must allow them).
    `trace`: a path for the profiled decode steps' Chrome trace (`--profile-trace`)."""
    from ...progress import Progress
    from ...sampling_params import SamplingParams
    from ...engine.heap import GcWatch
    from ...kernels.jit_watch import JitWatch, summarize
    from .decode_memory import _counter_deltas
    from .profile import StepProfiler

    dev, runner = engine.device, engine.runner
    if profile_prefill_steps and len(prompts) > 1 and not engine.scheduler.mixed:
        raise ValueError("--profile-prefill-steps profiles consecutive prefill steps, and this batch's store does not "
                         "mix decode rows into prefill steps (offloading): its decode steps would run between them "
                         "under the profiler; profile the prefill with --batch 1")
    params = SamplingParams(temperature=0, max_tokens=decode_tokens + catch_up, ignore_eos=True)
    ids = [f"bench-decode-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    total = sum(len(p) for p in prompts)
    prefill_s, prefill_tokens, first_step = 0.0, 0, None
    steps: list[dict] = []
    snaps: list = []  # offload counters before decode step 0, then after each decode step
    snap = _kv_stats(engine)
    prefill_kv: dict | None = None  # the offload counters' deltas summed over the prefill steps
    prefill_compiles, decode_compiles = [], []  # (kernel, seconds) of the compilations inside each kind of step
    prefill_progress = Progress(total, f"bench decode {label} prefill").follow_layers(engine.model, dev)
    decode_progress = None
    prof, prof_prefill = StepProfiler(dev, trace), StepProfiler(dev)
    prefill_steps = 0
    first_profiled, profiled_from = None, None  # the first profiled prefill step, the prompt tokens before it
    together = 0  # decode steps since no prompt was left to prefill (the batch decoding together)
    jit, gcs = JitWatch(), GcWatch()
    try:
        jit.start()
        gcs.start()
        while engine.has_unfinished_requests() and together < decode_tokens - 1:
            n_graphs, prev = len(runner._graphs), engine.last_step
            pending = engine.scheduler.prefill_pending()
            profiled = profile_steps > 0 and not pending and engine.last_step is not None \
                and not engine.last_step.is_prefill \
                and together >= decode_tokens - 1 - profile_steps  # the prefill samples the first token
            if first_profiled is None and prefill_steps >= 1 and prefill_tokens >= profile_prefill_at * total:
                first_profiled = prefill_steps  # past the first step (compilation) and `profile_prefill_at`
                profiled_from = prefill_tokens
            profiled_prefill = prefill_tokens < total and first_profiled is not None \
                and first_profiled <= prefill_steps < first_profiled + profile_prefill_steps
            if profiled:
                prof.start()
            if profiled_prefill:
                prof_prefill.start()
            _sync(dev)
            compiled, collected = len(jit.events), len(gcs.events)
            t0 = time.perf_counter()
            engine.step()
            _sync(dev)
            dt = time.perf_counter() - t0
            new_compiles = jit.events[compiled:]
            compiled = bool(new_compiles)  # a Triton kernel compiled inside this step
            st = engine.last_step
            if st is prev:
                raise RuntimeError("the engine scheduled nothing: the KV cache cannot hold the batch")
            before, snap = snap, _kv_stats(engine)
            if st.is_prefill:
                prefill_steps += 1
                prefill_compiles += new_compiles
                delta = _counter_deltas(before, snap)
                if delta is not None:
                    prefill_kv = {k: (prefill_kv or {}).get(k, 0) + v for k, v in delta.items()}
                if profiled_prefill:
                    prof_prefill.record(dt)
                    if prefill_steps >= first_profiled + profile_prefill_steps:
                        prof_prefill.stop()
                prefill_s += dt
                prefill_tokens += st.num_tokens - st.num_decode_tokens  # prompt tokens (a mixed step decodes too)
                first_step = dt if first_step is None else first_step
                prefill_progress.update(st.num_tokens - st.num_decode_tokens)
                continue
            decode_compiles += new_compiles
            if decode_progress is None:
                prefill_progress.close()
                decode_progress = Progress(len(prompts) * (decode_tokens - 1), f"bench decode {label} decode")
            decode_progress.update(st.num_tokens)
            prof_prefill.stop()  # a decode step: the prefill's profile ends, whatever it had
            if not snaps:
                snaps.append(before)
            why = [name for name, hit in zip(EXCLUDED, (len(runner._graphs) > n_graphs, compiled,
                                                         not runner.decode_graphs and not steps, profiled, pending))
                   if hit]
            together += not pending
            if profiled:
                prof.record(dt)
            steps.append({"s": dt, "tokens": st.num_tokens, "warmup": bool(why), "profiled": profiled,
                          "excluded": why, "kv": (before, snap), "gc": gcs.events[collected:]})
            snaps.append(snap)
        if engine.has_unfinished_requests():  # the batch's counted steps are done; the catch-up tokens are not wanted
            for rid in ids:
                engine.abort_request(rid)
    except BaseException:
        for rid in ids:
            engine.abort_request(rid)
        raise
    finally:
        jit.stop()
        gcs.stop()
        prefill_progress.close()
        if decode_progress is not None:
            decode_progress.close()
        profile, prefill_profile = prof.report(), prof_prefill.report()
    prefill_jit = summarize(prefill_compiles)
    if profile_prefill_steps and first_profiled is None and timed:
        _note(f"{label}: no prefill step after the first started past {profile_prefill_at:.0%} of the prompt "
              f"tokens: no prefill step was profiled (--profile-prefill-at)")
    if prefill_jit["count"] and timed:  # the warm-up run is there to compile
        _note(f"{label}: {prefill_jit['count']} Triton kernel compilation(s) inside the timed prefill "
              f"({prefill_jit['seconds']:.1f} s of its {prefill_s:.1f} s: "
              f"{', '.join(f'{k} x{n}' for k, n in prefill_jit['kernels'].items())}); the prefill time includes "
              f"them (a repeat in the same process, METHOD@2, runs warm)")
    return {"prefill_s": prefill_s, "prefill_tokens": prefill_tokens, "prefill_first_step_s": first_step,
            "prefill_steps": prefill_steps,
            "steps": steps, "snaps": snaps, "prefill_kv": prefill_kv, "profile": profile,
            "prefill_profile": prefill_profile, "prefill_jit": prefill_jit,
            "prefill_profiled_from_token": profiled_from if profile_prefill_steps else None,
            "decode_jit": summarize(decode_compiles)}


def steps_excluded(steps: list[dict]) -> dict[str, list[int]]:
    """{reason: [decode step indices]} of the steps left out of the rate (`EXCLUDED`; a step may have several)."""
    out: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        for why in step.get("excluded", ()):
            out.setdefault(why, []).append(i)
    return out
