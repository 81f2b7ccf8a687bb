"""`longreach bench mixed`: what a long prompt's prefill costs the requests decoding beside it, offline, step by step.

The serving question of issue 30 without HTTP in the way: one engine per method, `decodes` short requests decoding
(prompts of `decode_prompt` tokens, generating until the long prompt is done), then a `context`-token prompt
arrives. Every engine step is timed between device synchronisations. Reported per method:
  standalone_prefill_s  the long prompt alone (second of two runs: the first compiles), whole-budget chunks;
  mixed_prefill_s       the same prompt while the short requests decode (its chunks capped by the scheduler's
                        long-prefill threshold), and the ratio to the standalone time;
  decode_step_ms        the short requests' steps before the long prompt arrives (median);
  mixed_step_ms         the steps while it is prefilled: median, p99, max (every one of them is an inter-token gap
                        of every short request: a step gives each decode row one token);
  gc_pauses             garbage collections of >= 1 ms inside those steps, (step, generation, ms): after the cold
                        run the engine's heap is frozen (engine/heap.py), as the server's after its warm-up;
  profile               with --profile-steps N, N mixed steps under torch.profiler (bench/profile.py: wall vs
                        device ms, top kernels) and, with --cprofile, the host's Python functions by own time;
                        from the fifth step, or (--profile-at F) from the first step once a share F of the long
                        prompt is prefilled (`profiled_from_token` in the JSON).
`--prefill-graphs off` runs a sparse method's prefill selection eagerly (attention/sparse/prefill_graph.py), `both`
runs each sparse method twice, labelled METHOD and METHOD/eager-selection, so that one run compares them.
Dense runs first when listed, so that the table shows both in one run. The JSON records command, commit and device.
"""
from __future__ import annotations

import statistics
import time

from .decode_steps import _prompts, _sync


def _step(engine) -> tuple[float, object]:
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.step()
    _sync(engine.device)
    return time.perf_counter() - t0, engine.last_step


def _finish(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _alone(engine, prompt: list[int], rid: str) -> float:
    """Seconds until `prompt`, alone, has its first token (prefill steps timed)."""
    from ...sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    total = 0.0
    while engine.has_unfinished_requests():
        dt, _ = _step(engine)
        total += dt
    return total


def run_method(engine, context: int, decodes: int, decode_prompt: int, seed: int, profile_steps: int,
               cprofile: bool, profile_at: float = 0.0) -> dict:
    import cProfile
    import pstats

    from ...engine.heap import GcWatch, freeze_heap, pauses
    from ...sampling_params import SamplingParams
    from .profile import StepProfiler

    vocab = engine.model_config.vocab_size
    cold = _alone(engine, _prompts(vocab, context, 1, seed)[0], "alone-cold")
    # after this warm-up (kernels compiled, graphs captured) the engine's objects leave garbage collection, as the
    # server's do after its warm-up (engine/heap.py); the measured prompts are made after it, as a server's requests
    freeze_heap()
    long_prompt = _prompts(vocab, context, 1, seed)[0]
    standalone = _alone(engine, long_prompt, "alone")
    shorts = _prompts(vocab, decode_prompt, decodes, seed + 7)
    params = SamplingParams(temperature=0, max_tokens=1_000_000, ignore_eos=True)
    for i, p in enumerate(shorts):
        engine.add_request(f"short-{i}", p, params)
    decode_steps = []
    while len(decode_steps) < 24:  # prefill the short prompts, then time decode-only steps (graphs captured first)
        dt, st = _step(engine)
        if not st.is_prefill and st.num_decode_tokens == decodes:
            decode_steps.append(dt)
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prof, host = StepProfiler(engine.device), cProfile.Profile() if cprofile else None
    mixed, chunk_tokens, prefill_s = [], [], 0.0
    first = None  # the first profiled step: past the first four (compilation, captures) and `profile_at` of the prompt
    done = 0  # the long prompt's tokens prefilled so far
    gcs, step_gcs = GcWatch().start(), []  # each mixed step's collections
    while any(s.request_id == "long" for s in [*engine.scheduler.waiting, *engine.scheduler.running]):
        if first is None and len(mixed) >= 4 and done >= profile_at * context:
            first = (len(mixed), done)
        profiled = first is not None and first[0] <= len(mixed) < first[0] + profile_steps
        if profiled:
            prof.start()
            if host is not None:
                host.enable()
        seen = len(gcs.events)
        dt, st = _step(engine)
        step_gcs.append(gcs.events[seen:])
        if profiled:
            prof.record(dt)
            if host is not None:
                host.disable()
        elif prof.steps:
            prof.stop()
        prefill_s += dt
        mixed.append(dt)
        chunk_tokens.append(st.num_tokens - st.num_decode_tokens)
        done += chunk_tokens[-1]
        if len(mixed) > 100_000:
            raise RuntimeError("the long prompt never finished its prefill")
    gcs.stop()
    for i in range(decodes):
        engine.abort_request(f"short-{i}")
    _finish(engine)
    ms = sorted(1e3 * x for x in mixed)
    top_host = None
    if host is not None:
        stats = pstats.Stats(host)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # by own (total) time
        n = max(1, profile_steps)
        top_host = [{"function": f"{fn[0].split('longreach/')[-1]}:{fn[1]}:{fn[2]}", "calls_per_step": v[1] / n,
                     "own_ms_per_step": 1e3 * v[2] / n, "cum_ms_per_step": 1e3 * v[3] / n} for fn, v in rows]
    return {"context": context, "decodes": decodes, "decode_prompt": decode_prompt,
            "standalone_prefill_cold_s": cold, "standalone_prefill_s": standalone, "mixed_prefill_s": prefill_s,
            "mixed_vs_standalone": prefill_s / standalone,
            "decode_step_ms": 1e3 * statistics.median(decode_steps),
            "mixed_steps": len(mixed), "mixed_chunk_tokens_median": statistics.median(chunk_tokens),
            "mixed_step_ms": {"median": statistics.median(ms), "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
                              "max": ms[-1]},
            "step_ms": [round(x * 1e3, 3) for x in mixed], "gc_pauses": pauses(step_gcs), "profile": prof.report(),
            "host_profile": top_host,
            "profiled_from_token": None if first is None or not profile_steps else first[1]}


def run(model: str, methods, engine_kwargs: dict, context: int, decodes: int, decode_prompt: int, seed: int,
        profile_steps: int, cprofile: bool, out_path: str, command: str, prefill_graphs: str = "on",
        profile_at: float = 0.0) -> dict:
    import gc

    from ...attention.sparse.backend import SparseBackend
    from ...engine.llm import LLM
    from ..report import provenance, samples, write_json
    from .profile import format_report

    rows, runs = [], []
    rep = None
    for spec in methods:
        modes = {"on": [True], "off": [False], "both": [True, False]}[prefill_graphs] if spec.name != "dense" else [None]
        runs += [(spec, mode) for mode in modes]
    for spec, graphs in runs:
        llm = LLM(model, attention=spec.name, preset=spec.preset, max_model_len=context + 1024, **engine_kwargs)
        engine = llm.engine
        pg = engine.backend.prefill_graphs if isinstance(engine.backend, SparseBackend) else None
        if pg is not None and graphs is not None:
            pg.enabled = pg.enabled and graphs
        label = spec.label + ("/eager-selection" if graphs is False else "")
        row = {"label": label, "prefill_graphs": None if pg is None else pg.enabled,
               **run_method(engine, context, decodes, decode_prompt, seed, profile_steps, cprofile, profile_at)}
        if pg is not None:
            row.update(prefill_graph_captures=pg.captures, prefill_graph_replays=pg.replays,
                       prefill_graphs_disabled=pg.disabled_why)
        rows.append(row)
        print(f"{label}: standalone {row['standalone_prefill_s']:.2f} s (cold {row['standalone_prefill_cold_s']:.2f}),"
              f" beside {decodes} decodes {row['mixed_prefill_s']:.2f} s ({row['mixed_vs_standalone']:.2f}x) in "
              f"{row['mixed_steps']} steps of ~{row['mixed_chunk_tokens_median']:.0f} prompt tokens; step ms: "
              f"decode-only {row['decode_step_ms']:.1f}, mixed median {row['mixed_step_ms']['median']:.1f} "
              f"p99 {row['mixed_step_ms']['p99']:.1f} max {row['mixed_step_ms']['max']:.1f}", flush=True)
        if row["profile"]:
            print(format_report(f"{label} mixed steps", row["profile"]))
        for h in row["host_profile"] or []:
            print(f"  host {h['own_ms_per_step']:8.2f} ms own {h['cum_ms_per_step']:8.2f} cum "
                  f"{h['calls_per_step']:7.1f}x {h['function']}")
        rep = {"provenance": provenance(command, attention=[
                   {"label": r["label"], "method": m.name, "preset": m.preset} for r, (m, _) in zip(rows, runs)],
                   samples=samples(1, "run", "long prompt per method")), "runs": rows}
        write_json(rep, out_path)
        llm = engine = None
        gc.unfreeze()  # the frozen engine's objects (run_method's freeze_heap) back to the collector
        gc.collect()
        _empty_cache()
    print(f"[longreach] wrote {out_path}")
    return rep


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
