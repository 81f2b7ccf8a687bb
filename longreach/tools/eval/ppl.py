"""`longreach eval ppl`: perplexity of one long text at several context lengths, attention methods side by side.

Definition. The text is tokenized once, without special tokens; when the tokenizer opens every text with BOS (as
it would a prompt given to the engine), a window is BOS + text tokens. For every context length L, `--samples`
windows are cut, and window i ends at the same token for every L: token S + i * stride, S = the longest window's
text span and stride = S (the longest windows are disjoint) when the text holds `samples` of them, else spread so the
last window ends at the end of the text (they then overlap; the report says so). The same tokens close the windows at
every L, and only the context before them grows. A text shorter than the longest length is an error. Each window is
prefilled alone from an empty cache (the engine's chunked prefill, `LLMEngine.prompt_nll`), giving the NLL of its
tokens 1..L-1. Per method and length, over the tokens of all windows pooled (token-weighted means, float64):
  * ppl_all  = exp(mean NLL of all L - 1 predicted tokens);
  * ppl_tail = exp(mean NLL of the last --tail tokens of each window): the same tokens at every L, each predicted
    from at least L - tail tokens of context, so this is the number that shows whether a longer context helps, or
    whether a method breaks down past the model's trained context length.
Every method scores the same windows; a method's ratio to dense (ppl / dense ppl) is reported where dense ran.
Dense beyond --max-dense-length is recorded as skipped.

Importing this module imports no torch or matplotlib (the CLI builds its parser from it).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import sys
import time

from ..report import samples
from .common import (
    add_method_args,
    context_length,
    emit,
    engine_kwargs,
    format_length,
    make_llm,
    note,
    parse_methods,
    plot_path,
)
from .data import TEXT_SOURCES, read_text_file

HELP = "perplexity of a long text at several context lengths, methods side by side"
DESCRIPTION = (
    "Cut --samples windows of each context length from a long text (at every length they end at the same tokens), "
    "score every token of each window with each attention method, and report the perplexity over the whole window "
    "and over its last --tail tokens (the same tokens at every length; they see the full context). Prints JSON; "
    "draws tail perplexity against context length (--plot, or next to --out).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_method_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text-file", metavar="PATH", help="the text to score (UTF-8)")
    src.add_argument("--text-source", choices=sorted(TEXT_SOURCES),
                     help="a built-in text (from the RULER data package)")
    p.add_argument("--lengths", type=context_length, nargs="+", default=[4096, 8192, 16384, 32768], metavar="L",
                   help="context lengths in tokens, k = 1024 and M = 1024^2 (default: 4k 8k 16k 32k)")
    p.add_argument("--samples", type=int, default=1, help="windows per length (default: 1)")
    p.add_argument("--tail", type=int, default=1024,
                   help="report PPL of the last N tokens of each window too; they see the full context (default: 1024)")
    p.add_argument("--max-dense-length", type=context_length, default=None, metavar="L",
                   help="skip dense above this length (recorded as skipped; default: no limit)")


def cut_windows(ids: list[int], lengths: list[int], samples: int, bos: list[int]) -> tuple[dict, dict]:
    """Cut `samples` windows of every length (BOS + text tokens) from the token ids -> ({length: [window ids]},
    layout for the report). Window i of every length ends at the same token, i * stride + the longest window's
    text span, so all lengths score the same tail tokens; stride = that span (disjoint longest windows) when the
    text holds them all, else spread so the last window ends at the end of the text (then they overlap)."""
    span = lengths[-1] - len(bos)
    if len(ids) < span:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the context length {lengths[-1]}"
                         f"{' (BOS + text)' if bos else ''}; give a longer text or smaller --lengths")
    stride = span if samples == 1 else min(span, (len(ids) - span) // (samples - 1))
    if stride < 1:
        raise ValueError(f"the text has {len(ids)} tokens: no room for {samples} different windows of "
                         f"{lengths[-1]}; lower --samples or the longest length")
    ends = [span + i * stride for i in range(samples)]
    windows = {n: [bos + ids[e - (n - len(bos)): e] for e in ends] for n in lengths}
    return windows, {"ends": ends, "overlapping": samples > 1 and stride < span}


def score(engine, windows: list[list[int]], tail: int, label: str = "") -> dict:
    """Score each window (token ids) through `engine`: PPL over all predicted tokens and over the last `tail`."""
    import torch

    from ...progress import Progress

    t0 = time.perf_counter()
    nll_all, nll_tail = [], []
    desc = " ".join(x for x in ("ppl", label, format_length(len(windows[0]))) if x)
    progress = Progress(sum(len(w) for w in windows), desc).follow_layers(engine.model, engine.device)
    with progress:
        for i, ids in enumerate(windows):
            t = time.perf_counter()
            nll = engine.prompt_nll(ids, progress).double().cpu()  # (L-1,)
            nll_all.append(nll)
            nll_tail.append(nll[-tail:])
            note(f"ppl {label} {format_length(len(ids))} window {i + 1}/{len(windows)}: ppl "
                 f"{nll.mean().exp().item():.3f}, tail {nll[-tail:].mean().exp().item():.3f} "
                 f"({time.perf_counter() - t:.1f} s)")
    every, last = torch.cat(nll_all), torch.cat(nll_tail)
    return {"ppl_all": every.mean().exp().item(), "ppl_tail": last.mean().exp().item(),
            "ppl_tail_per_window": [x.mean().exp().item() for x in nll_tail],
            "tokens_all": every.numel(), "tokens_tail": last.numel(), "seconds": round(time.perf_counter() - t0, 2)}


def _read_text(args) -> tuple[str, str]:
    """(text, its name for the report)."""
    if args.text_source:
        return TEXT_SOURCES[args.text_source](), args.text_source
    return read_text_file(args.text_file), args.text_file


def _check_args(args, lengths: list[int]) -> None:
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if not 1 <= args.tail < lengths[0]:
        raise ValueError(f"--tail must be in [1, shortest length) = [1, {lengths[0]}), got {args.tail}")


def _release_memory(device) -> None:
    """Return a dropped engine's memory, so the next one's KV budget (profiled from free GPU memory) gets it."""
    import torch

    gc.collect()  # the engine holds reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(args: argparse.Namespace) -> int:
    lengths = sorted(set(args.lengths))
    _check_args(args, lengths)
    specs = parse_methods(args.attention, args.preset, args.attention_config)
    limit = args.max_dense_length
    runs = {s.label: [n for n in lengths if s.name != "dense" or limit is None or n <= limit] for s in specs}
    if not any(runs.values()):
        raise ValueError(f"nothing to run: every length is above --max-dense-length {limit} and dense is the only "
                         "method")
    text, text_name = _read_text(args)
    header: dict = {}
    windows: dict[int, list[list[int]]] = {}
    methods: dict[str, dict[str, dict]] = {}
    for spec in specs:
        cells = methods[spec.label] = {str(n): {"skipped": f"dense above --max-dense-length {limit}"}
                                       for n in lengths if n not in runs[spec.label]}
        if not runs[spec.label]:
            continue
        note(f"ppl: loading {args.model} with {spec.label} attention")
        llm = make_llm(args.model, spec, args.attention_config, args.device, args.dtype, max(runs[spec.label]),
                       max_num_seqs=1, **engine_kwargs(args))
        if not windows:
            windows, header = _windows(llm.engine, text, lengths, args.samples)
        for n in runs[spec.label]:
            cells[str(n)] = score(llm.engine, windows[n], args.tail, spec.label)
        device = llm.engine.device
        del llm
        _release_memory(device)
    _add_ratios(methods)
    report = {"model": header.pop("model") or args.model, "device": header.pop("device"), "dtype": header.pop("dtype"),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "args": {k: v for k, v in vars(args).items() if k != "func"}, "text": text_name, "lengths": lengths,
              "tail": args.tail, **header,
              "methods": {label: {str(n): cells[str(n)] for n in lengths} for label, cells in methods.items()}}
    emit(report, args.out, args, samples(args.samples, "method x length",
                                         f"windows, each scoring its last {args.tail} tokens (tail)"))
    path = plot_path(args)
    if path:
        _plot(report, path)
        note(f"ppl: plot written to {path}")
    _print_table(report)
    return 0


def _windows(engine, text: str, lengths: list[int], samples: int) -> tuple[dict[int, list[list[int]]], dict]:
    """Tokenize the text and cut the windows of every length -> (windows by length, report fields: model, device,
    dtype, trained context, window layout)."""
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("this model carries no tokenizer; eval ppl needs one to encode the text")
    ids = tok.encode(text, add_special_tokens=False)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and tok.encode("")[:1] == [tok.bos_token_id] else []
    windows, layout = cut_windows(ids, lengths, samples, bos)
    mc = engine.model_config
    return windows, {"model": mc.name, "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
                     "trained_context": mc.max_position_embeddings, "text_tokens": len(ids), "bos": bool(bos),
                     "windows": layout}


def _add_ratios(methods: dict[str, dict[str, dict]]) -> None:
    """Each method's PPL divided by dense's, at the lengths where dense ran."""
    dense = methods.get("dense", {})
    for label, cells in methods.items():
        for n, cell in cells.items():
            ref = dense.get(n, {})
            if label != "dense" and "ppl_tail" in cell and "ppl_tail" in ref:
                cell["ratio_to_dense"] = {k: cell[k] / ref[k] for k in ("ppl_all", "ppl_tail")}


def _plot(report: dict, path: str) -> None:
    """Tail PPL against context length, one line per method; log axes, so a blow-up stays on the chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    lengths, trained = report["lengths"], report["trained_context"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, cells in report["methods"].items():
        points = [(n, cells[str(n)]["ppl_tail"]) for n in lengths if "ppl_tail" in cells[str(n)]]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.axvline(trained, color="gray", linestyle=":", label=f"trained context ({format_length(trained)})")
    ax.set_xscale("log", base=2)
    ticks = sorted(set(lengths) | {trained})
    ax.set_xticks(ticks, [format_length(n) for n in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_yscale("log")
    for axis_formatter in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # plain numbers, not 10^x
        axis_formatter(matplotlib.ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"perplexity of the last {report['tail']} tokens")
    ax.set_title(f"{report['model']} on {report['text']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_table(report: dict) -> None:
    lengths = report["lengths"]
    width = max(12, *(len(label) for label in report["methods"]))
    lines = [f"tail perplexity (last {report['tail']} tokens of each window)",
             f"{'method':<{width}}" + "".join(f"{format_length(n):>10}" for n in lengths)]
    for label, cells in report["methods"].items():
        row = [f"{cells[str(n)]['ppl_tail']:10.3f}" if "ppl_tail" in cells[str(n)] else f"{'skipped':>10}"
               for n in lengths]
        lines.append(f"{label:<{width}}" + "".join(row))
    print("\n".join(f"[longreach] {line}" for line in lines), file=sys.stderr, flush=True)
