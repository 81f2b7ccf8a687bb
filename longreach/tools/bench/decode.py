"""`longreach bench decode`: decode speed at 128K-3M tokens through the whole engine, sparse (+ KV offload) vs dense.

Default model: `random:llama-3.1-8b`, random bf16 weights in the Llama-3.1-8B shape (models/random_init.py); every
report made with a random model says so. For each context length and attention method the engine is built with
max_model_len = context + decode tokens (+ the catch-up tokens of a batch, below), `batch` prompts of random token
ids of that length are prefilled and decode `decode_tokens` tokens together (ignore_eos). A batch's first prompts
done decode while the others are prefilled (in mixed steps, or in decode steps alternating with an offloaded
prefill's): those requests may generate up to `catch_up_tokens` more, the rate counts only the `decode_tokens - 1`
steps after the last prompt is prefilled (every row of the batch in each), and the requests are aborted after them
(bench/decode_steps.py). Reported per run:
  prefill    seconds of the prefill steps, the first to the last (every step timed between synchronizations of the
             engine's stream: a background copy on another, kvcache/prefetch.py's, runs on past its step;
             an offloaded batch's decode steps between them are decode steps, left out as `prefill_pending`);
             the first run of a process also pays for compiling its prefill kernels (`prefill_first_step_s`);
             kernels compiled inside the timed prefill (a length bucket the warm-up prompt did not reach) are
             counted, timed and named in `prefill_jit`, and a note says so (kernels/jit_watch.py);
  decode     tok/s = generated tokens / wall time of the decode steps, leaving out warm-up steps: those in which a
             CUDA-graph variant was captured (sparse methods capture theirs on first use, e.g. at steps 0, 1, 8 and
             16 for infinitehip 3k-fast), those in which a Triton kernel compiled (`decode_jit`) and, without
             graphs, the first decode step (kernel compilation), and profiled steps (--profile-steps);
             `steps_counted` and `steps_excluded` ({reason: step indices}) say which, and the printed line names
             them. The JSON also has the rate with them (`decode_tok_s_with_warmup`) and every step's seconds.
             Bias: a captured step is often a mask-refresh step, the most expensive kind, so leaving it out
             flatters the rate by about (t_refresh - t_step) / steps (~1% at 128 steps);
  GPU memory weights (the model's parameters), the KV store's GPU tier (`gpu_nbytes`, else `nbytes`),
             its prefill staging area (`staging_nbytes`) and its host tier (`host_nbytes`, else 0),
             the peak allocated during prefill + decode, and workspace = peak - weights - GPU tier - staging;
  host       the process RSS after decode (psutil, else /proc/self/status) and its peak (VmHWM);
  offload    when the engine has `kv_cache_stats()` (a dict with cumulative `pages_hit`, `pages_missed`,
             `pages_evicted`, `bytes_h2d` and the gauges `gpu_pages_*`, `host_pages_*`): hit ratio and host->GPU
             GB/s over the steady decode steps, from counter deltas, and the same deltas over the prefill.
Dense baseline in the same run: the same model with attention="dense", no offload, the same KV dtype, at each of
`dense_lengths` (default: the measured lengths plus a 4K anchor below them) where it fits: the KV bytes
2 * layers * kv_heads * head_dim * elem * tokens (+ fp8 scales), the weights, the last prefill chunk's gathered and
head-expanded prefix 2 * tokens * head_dim * (kv_heads + q_heads) * elem, and 2 GiB of workspace are compared with
the free GPU memory before trying; an out-of-memory error is caught and recorded as "does not fit".
Where dense did not run, its decode step time is extrapolated (marked `*` in the table; in the JSON the row's
`dense_source` is "extrapolated" and its `extrapolated` lists the fields that are not measured), linear in the
context for the attention part, through the largest (L0) and smallest (L1) dense contexts measured:
  t(L) = t(L0) + (L - L0) * (t(L0) - t(L1)) / (L0 - L1),   dense tok/s(L) = batch / t(L).
KV sizes: with offloading, each run's host tier is what its context needs (+2%), at most `kv_offloading_size`, so a
128K run does not pin the 1M run's memory; without it, on a GPU and with no `kv_cache_memory_gb`, the GPU KV is sized
the same way (not to the free memory), so the memory split shows what the context takes.
Each engine is freed (del, gc, torch.cuda.empty_cache) before the next; the JSON is rewritten after every run. After
its warm-up each engine's heap is frozen out of garbage collection (engine/heap.py, as the server does) and unfrozen
when it is freed; the collections inside decode steps that still take >= 1 ms are in each row's `gc_pauses`.
"""
from __future__ import annotations

import gc
import json
import statistics
import time
import traceback

from .decode_memory import (
    GiB,
    _estimate_weights_bytes,
    _host_memory,
    _kv_budget_gb,
    _kv_need_bytes,
    _kv_store_bytes,
    _offload_summary,
    _weights_bytes,
)
from .decode_report import _fill_dense_column, _fmt_len, _one_line, _summary, format_table
from .decode_steps import _drive, _note, _prompts, _sync, _text_ids, _warmup_len, catch_up_tokens, steps_excluded

WORKSPACE_MARGIN = 2 * GiB  # activations of a prefill chunk, CUDA graphs, allocator slack (dense fit estimate)
ANCHOR = 4096  # a short dense context, so that two dense points fix the extrapolation's slope


# ---- one run ---------------------------------------------------------------------------------------------------------
def _measure(model: str, context: int, spec, engine_kwargs: dict, batch: int, decode_tokens: int, seed: int,
             state: dict) -> dict:
    """Build one engine, run it, free it; the row of the report (raises what the engine raises)."""
    import torch

    from ...engine.heap import freeze_heap, pauses
    from ...engine.llm import LLM
    from ..eval.common import reads_between

    label = f"{_fmt_len(context)} {spec.label}"
    _note(f"{label}: building the engine")
    catch_up = catch_up_tokens(batch, context, engine_kwargs)
    llm = LLM(model, attention=spec.name, preset=spec.preset, max_model_len=context + decode_tokens + catch_up,
              max_num_seqs=batch, **engine_kwargs)
    try:
        engine = llm.engine
        dev = engine.device
        state.setdefault("model_config", engine.model_config)
        state.setdefault("weights_bytes", _weights_bytes(engine.model))
        if "text_ids" not in state:
            state["text_ids"] = _text_ids(engine, state.get("text"))
        warm = _warmup_len(context, engine, state.get("warmup_tokens"))
        warmup_s = None
        if warm:  # compile this engine's kernels outside the timed run (a fresh process JIT-compiles for ~30-50 s)
            _sync(dev)
            t0 = time.perf_counter()
            _drive(engine, _prompts(engine.model_config.vocab_size, warm, 1, seed + 1, state["text_ids"]), 4,
                   f"{label} warm-up", timed=False)
            engine.capture_warm_graphs()  # as the server's warm-up: every context bucket's selection kernels
            _sync(dev)
            warmup_s = time.perf_counter() - t0
        freeze_heap()  # as the server after its warm-up: the engine's objects leave garbage collection
        # the measured prompts come after it, as a server's requests do (the collector walks their token lists)
        prompts = _prompts(engine.model_config.vocab_size, context, batch, seed, state["text_ids"])
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        reads0 = engine.backend.decode_reads()
        run = _drive(engine, prompts, decode_tokens, label, state.get("profile_steps") or 0,
                     state.get("profile_prefill_steps") or 0, catch_up=catch_up,
                     profile_prefill_at=state.get("profile_prefill_at") or 0.0,
                     trace=_trace_path(state.get("profile_trace"), label))
        reads = reads_between(reads0, engine.backend.decode_reads())
        from .profile import format_report

        if run["prefill_profile"]:
            print(format_report(f"{label} prefill", run["prefill_profile"]), flush=True)
        if run["profile"]:
            print(format_report(label, run["profile"]), flush=True)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        kv_gpu, kv_staging, kv_staging_decode, kv_host = _kv_store_bytes(engine)
        weights = _weights_bytes(engine.model)
        steps = run["steps"]
        steady = [s for s in steps if not s["warmup"]]
        steady_s = sum(s["s"] for s in steady)
        all_s = sum(s["s"] for s in steps)
        cfg = engine.config
        kv_dtype = getattr(cfg, "kv_cache_dtype", "auto")
        offload = getattr(cfg, "kv_offloading_size", None)
        row = {
            "context": context, "attention": spec.label, "batch": batch,
            "kv_cache_dtype": kv_dtype if kv_dtype != "auto" else str(engine.dtype).replace("torch.", ""),
            "offload": bool(offload), "kv_offloading_size_gib": offload,
            "kv_cache_memory_gb": cfg.kv_cache_memory_gb, "attention_config": _json_text(cfg.attention_config),
            "decode_attention": getattr(cfg, "decode_attention", None),
            "backend": engine.backend.name,  # "A+B" when composed: B decodes
            "prefill_s": run["prefill_s"], "prefill_tok_s": run["prefill_tokens"] / run["prefill_s"],
            "prefill_first_step_s": run["prefill_first_step_s"],
            # Triton compilations inside the timed prefill (its seconds include them) and decode (those steps are
            # warm-up steps, left out of the rate): {"count", "seconds", "kernels"} (kernels/jit_watch.py)
            "prefill_jit": run["prefill_jit"], "decode_jit": run["decode_jit"],
            "warmup_tokens": warm, "warmup_s": warmup_s,
            "decode_tok_s": sum(s["tokens"] for s in steady) / steady_s if steady_s else None,
            "decode_tok_s_with_warmup": sum(s["tokens"] for s in steps) / all_s if all_s else None,
            "decode_steps": len(steps), "warmup_steps": len(steps) - len(steady),
            # what the rates count: decode_tok_s the steps not excluded (decode_steps.EXCLUDED: {reason: indices});
            # prefill_tok_s every prefill step, compilations inside them included (prefill_jit)
            "steps_counted": len(steady), "steps_excluded": steps_excluded(steps),
            # rows of the counted steps: the batch in each, unless a request ran out of catch-up tokens
            "counted_rows_min": min((s["tokens"] for s in steady), default=None),
            "prefill_steps_counted": run["prefill_steps"],
            "step_s_mean": steady_s / len(steady) if steady else None,
            "step_s_median": statistics.median(s["s"] for s in steady) if steady else None,
            "step_s": [round(s["s"], 6) for s in steps],
            # garbage collections inside decode steps that took >= 1 ms: (step index, generation, ms); the heap
            # alive after the warm-up is frozen out of them (engine/heap.py), as in the server
            "gc_pauses": pauses(st["gc"] for st in steps),
            "warmup_step_indices": [i for i, s in enumerate(steps) if s["warmup"]],
            "cuda_graphs": engine.runner.decode_graphs, "graph_variants": len(engine.runner._graphs),
            "preemptions": engine.scheduler.num_preemptions,
            "decode_reads": reads,  # psa with count_reads: keys per decode query (layer, KV group), share of context
            "memory": {
                "weights_bytes": weights, "kv_gpu_bytes": kv_gpu, "kv_staging_bytes": kv_staging,
                "kv_staging_decode_bytes": kv_staging_decode,
                "kv_host_bytes": kv_host, "peak_allocated_bytes": peak,
                "workspace_bytes": None if peak is None else peak - weights - kv_gpu - kv_staging,
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None,
                "gpu_total_bytes": torch.cuda.mem_get_info(dev)[1] if dev.type == "cuda" else None,
            },
            "host": _host_memory(),
            "offload_stats": _offload_summary(run["snaps"], steps, run["prefill_kv"], steady_s),
            "profile": run["profile"], "prefill_profile": run["prefill_profile"],
            "prefill_profiled_from_token": run["prefill_profiled_from_token"],
        }
        if steady and row["counted_rows_min"] < batch:
            _note(f"WARNING: {label}: a counted decode step had {row['counted_rows_min']} rows of the batch's {batch} "
                  f"(a request finished its catch-up tokens before the last prompt was prefilled)")
    finally:
        llm = engine = None  # drop the engine (KV, graphs) before the next one is built
        _free()
    return row


def _free() -> None:
    import torch

    gc.unfreeze()  # the frozen engine's objects (freeze_heap) back to the collector: its cycles are garbage now
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _dense_plan(context: int, batch: int, decode_tokens: int, engine_kwargs: dict, state: dict, device,
                run_dtype) -> tuple[dict | None, str | None]:
    """(engine kwargs for the dense run, or None and why it does not fit)."""
    import torch

    kw = {**engine_kwargs, "attention_config": None, "kv_cache_memory_gb": None}
    if "kv_offloading_size" in kw:
        kw["kv_offloading_size"] = None
    mc = state.get("model_config")
    if device.type != "cuda" or mc is None:
        return kw, None
    kv = _kv_need_bytes(mc, context, decode_tokens, batch, engine_kwargs, run_dtype)
    weights = state.get("weights_bytes") or _estimate_weights_bytes(mc, run_dtype)
    # the last prefill chunk gathers the prefix's K and V and expands them to every query head (attention/dense.py)
    gather = 2 * context * mc.head_dim * (mc.num_kv_heads + mc.num_heads) * run_dtype.itemsize
    _free()
    free = torch.cuda.mem_get_info(device)[0]
    if kv + weights + gather + WORKSPACE_MARGIN > free:
        return None, (f"KV {kv / GiB:.1f} GiB + weights {weights / GiB:.1f} GiB + prefix gather {gather / GiB:.1f} "
                      f"GiB + {WORKSPACE_MARGIN / GiB:.0f} GiB workspace > {free / GiB:.1f} GiB free")
    kw["kv_cache_memory_gb"] = _kv_budget_gb(kv)
    return kw, None


def _json_text(config: dict | None) -> str | None:
    """A config dict as the report records it: JSON text, as given on the command line (None stays None)."""
    return None if config is None else json.dumps(config)


# ---- the benchmark ---------------------------------------------------------------------------------------------------
def _warn_short_kv(kw: dict, need_gb: float, kv_heads: int, context: int, batch: int, decode_tokens: int) -> None:
    """Say before a run when the KV tier that must hold every token (the host tier when offloading, else the GPU's)
    is smaller than `batch` x (context + decode tokens) need: a sequence will be preempted and its prompt recomputed
    between the decode steps. With tensor parallelism each rank holds its share of the KV heads."""
    tier = "--kv-offloading-size" if kw.get("kv_offloading_size") else "--kv-cache-memory-gb"
    have = kw.get("kv_offloading_size") or kw.get("kv_cache_memory_gb")
    ranks = min(kw.get("tensor_parallel_size") or 1, kv_heads)  # past the KV heads they are replicated
    want = need_gb / ranks
    if have is not None and have < want:
        _note(f"WARNING: {tier} {have:g} GiB is less than {batch} x ({context:,} + {decode_tokens}) tokens need "
              f"({want:.1f} GiB{' per rank' if ranks > 1 else ''}): expect a preemption inside the decode steps")


def _trace_path(directory: str | None, label: str) -> str | None:
    """Where `--profile-trace` writes a run's decode timeline: DIR/<label>-decode.json, the label's spaces as '-'."""
    if not directory:
        return None
    import os

    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, "-".join(label.split()).replace("/", "_") + "-decode.json")


def run(model: str, lengths: list[int], methods: list, engine_kwargs: dict, batch: int = 1, decode_tokens: int = 128,
        dense_lengths: list[int] | None = None, out_path: str | None = None, command: str = "",
        text: str | None = None, text_label: str | None = None, warmup_tokens: int | None = None,
        profile_steps: int = 0, profile_prefill_steps: int = 0, profile_prefill_at: float = 0.0,
        profile_trace: str | None = None) -> dict:
    """Every (context, method) of `lengths` x `methods` (eval.common.RunSpec), then dense at `dense_lengths`
    (None: `lengths` plus the 4K anchor below them; []: no dense). `engine_kwargs`: EngineConfig fields other than
    model / attention / preset / max_model_len / max_num_seqs; its `attention_config` (a dict, or its JSON text) may
    be keyed by method (eval.common.method_config). Prints the table, writes JSON to `out_path` after every run,
    returns the report (configs in it as JSON text)."""
    import torch

    from ... import __version__
    from ...engine.llm_engine import resolve_device, resolve_dtype
    from ...models.random_init import is_random_model, random_shape, weights_note
    from ..eval.common import RunSpec, attention_records, decode_kwargs, eval_config, method_config
    from ..report import provenance, samples, write_json

    if engine_kwargs.get("attention_config") is not None:  # a dict (JSON text from a Python caller: parsed here)
        engine_kwargs = {**engine_kwargs, "attention_config": eval_config(engine_kwargs["attention_config"])}
    lengths = sorted(set(lengths))
    if dense_lengths is None:
        dense_lengths = ([ANCHOR] if ANCHOR < lengths[0] else []) + lengths
    dense_lengths = sorted(set(dense_lengths))
    device = resolve_device(engine_kwargs.get("device", "auto"))
    run_dtype = resolve_dtype(engine_kwargs.get("dtype", "auto"), device)
    state: dict = {"text": text, "warmup_tokens": warmup_tokens, "profile_steps": profile_steps,
                   "profile_prefill_steps": profile_prefill_steps, "profile_prefill_at": profile_prefill_at,
                   "profile_trace": profile_trace}
    if is_random_model(model):
        state["model_config"] = random_shape(model).config
    specs = [*methods, *([RunSpec("dense", None, "dense")] if dense_lengths else [])]
    report = {
        "benchmark": "longreach bench decode",
        "provenance": provenance(command or None, device, attention=attention_records(
            specs, engine_kwargs.get("attention_config"), model), attention_config=engine_kwargs.get("attention_config"),
            samples=samples(batch, "method x context", f"sequences, each {decode_tokens} decode tokens (steps_counted "
                                                       "per row: the steps in the rate)")),
        "note": weights_note(model, run_dtype) if is_random_model(model) else None,
        "model": model, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command, "torch": torch.__version__,
        "longreach": __version__, "dtype": str(run_dtype).replace("torch.", ""),
        "settings": {"batch": batch, "decode_tokens": decode_tokens, "lengths": lengths,
                     "attention": [m.label for m in methods], "dense_lengths": dense_lengths,
                     "prompt": text_label or "random token ids", "warmup_tokens": warmup_tokens,
                     "engine": {k: _json_text(v) if k == "attention_config" else v
                                for k, v in engine_kwargs.items()}},
        "host": _host_memory(), "runs": [], "dense": [], "dense_extrapolation": None,
    }
    if report["note"]:
        _note(report["note"])

    def save() -> None:
        _fill_dense_column(report)
        write_json(report, out_path)

    for context in sorted(set(lengths) | set(dense_lengths)):
        for spec in methods if context in lengths else ():
            kw = {**engine_kwargs, "attention_config": method_config(spec, engine_kwargs.get("attention_config")),
                  **decode_kwargs(spec, engine_kwargs.get("attention_config"))}  # "A+B": B decodes
            mc = state.get("model_config")
            extra = decode_tokens + catch_up_tokens(batch, context, kw)  # what each request may generate
            need = None if mc is None else _kv_budget_gb(_kv_need_bytes(mc, context, extra, batch, kw, run_dtype))
            if kw.get("kv_offloading_size") and need is not None:  # pin what this context needs, at most the flag
                kw["kv_offloading_size"] = min(kw["kv_offloading_size"], need)
            elif device.type == "cuda" and kw.get("kv_cache_memory_gb") is None and need is not None:
                kw["kv_cache_memory_gb"] = need  # the KV sized to the context, so the memory split means something
            if need is not None:
                _warn_short_kv(kw, need, mc.num_kv_heads, context, batch, extra)
            try:
                row = _measure(model, context, spec, kw, batch, decode_tokens, engine_kwargs.get("seed", 0), state)
            except Exception as e:  # noqa: BLE001 - record it and go on with the next context / method
                traceback.print_exc()
                row = {"context": context, "attention": spec.label, "batch": batch, "error": _one_line(e)}
            _free()  # what a failed run left behind
            report["runs"].append(row)
            _note(_summary(row))
            save()
        if context in dense_lengths:
            kw, why = _dense_plan(context, batch, decode_tokens + catch_up_tokens(batch, context, engine_kwargs),
                                  engine_kwargs, state, device, run_dtype)
            entry = {"context": context, "attention": "dense", "batch": batch}
            if kw is None:
                entry.update(status="does not fit", reason=why)
            else:
                try:
                    entry.update(_measure(model, context, RunSpec("dense", None, "dense"), kw, batch,
                                          decode_tokens, engine_kwargs.get("seed", 0), state), status="measured")
                except torch.cuda.OutOfMemoryError as e:
                    entry.update(status="does not fit", reason=f"out of memory: {_one_line(e)}")
                except ValueError as e:
                    fits = "KV cache fits" in str(e)
                    entry.update(status="does not fit" if fits else "error", reason=_one_line(e))
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    entry.update(status="error", reason=_one_line(e))
                _free()
            report["dense"].append(entry)
            _note(_summary(entry) if entry["status"] == "measured" else
                  f"{_fmt_len(context)} dense: {entry['status']} ({entry['reason']})")
            save()
    save()
    print(format_table(report))
    return report
