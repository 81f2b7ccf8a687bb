"""`longreach eval passkey`: find a 5-digit key hidden at a chosen depth of a long, repetitive filler text.

The prompt (the classic test of Mohtashami & Jaggi, "Landmark Attention", 2023):
  intro + haystack of FILLER sentences, with NEEDLE at `depth` + " What is the pass key? The pass key is"
and the answer is right when the first number generated is the key (`score`).

Decisions:
- Plain completion, not the chat template, and the question follows the haystack after one space: with the chat
  template, or a blank line before the question, SmolLM2-135M-Instruct goes on about "a magical key" instead of
  answering, where this prompt finds the key (docs/quality.md, "The pass-key prompt").
- Prompts are built by token counts, so each has exactly `length` tokens with the model's tokenizer: every filler
  sentence is tokenized once (with its leading space, which is how it tokenizes in running text), repeated and trimmed
  at the end; the needle goes in at the sentence boundary nearest `depth` x the haystack's tokens.
- The key is drawn from a generator seeded with (length, depth, seed): the same cell always gets the same key, and
  lengths, depths and seeds get different ones.
- Every method sees the same prompts; prompts of one length run BATCH at a time in one generate call.

Importing this module imports no torch or matplotlib (the CLI builds its parser from it).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import random
import re
import sys
import time

from ..report import samples
from .common import (
    add_method_args,
    add_share_prefill_arg,
    context_length,
    emit,
    engine_kwargs,
    eval_config,
    format_length,
    make_llm,
    method_config,
    note,
    parse_methods,
    plot_path,
    wilson,
)

HELP = "passkey retrieval: find a 5-digit key hidden at a depth of a long filler text, methods side by side"
DESCRIPTION = (
    "Hide 'The pass key is 12345. Remember it. 12345 is the pass key.' at each --depths fraction of a repeated filler "
    "text of each --lengths tokens, ask for the key, and count an answer right when the first number generated is "
    "the key. Every method answers the same prompts. Prints JSON; draws a depth x length accuracy heatmap per method "
    "(--plot, or next to --out) and prints an accuracy table on stderr.")

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
# needle phrasings (needle, question): seed s of a cell uses phrasing s % len(--needles); "classic" is the paper's
NEEDLES = {
    "classic": (NEEDLE, QUESTION),
    "secret": ("The secret number is {key}. Keep it in mind: {key}.", "What is the secret number? The secret number is"),
    "code": ("Note for later: the access code for the archive is {key}.",
             "What is the access code for the archive? The access code is"),
}
HAYSTACKS = ("filler", "paul-graham", "squad")  # the classic repeated sentences, or natural text (eval/data.py)
BATCH = 4  # prompts per generate call (and the engine's max_num_seqs)
OUTPUT_CHARS = 40  # generated text kept per cell in the report


_SENTENCES: dict[tuple[int, str], list[list[int]]] = {}  # (tokenizer id, haystack) -> tokenized sentences


def haystack_sentences(tokenizer, haystack: str) -> list[list[int]]:
    """The haystack's sentences, each tokenized with its leading space (as in running text); natural texts are split
    after '.', '!' or '?' followed by white space, and the list is cut at ~1.1M tokens (a longer prompt repeats it)."""
    key = (id(tokenizer), haystack)
    if key not in _SENTENCES:
        if haystack == "filler":
            text_sentences = list(FILLER)
        elif haystack in HAYSTACKS:
            from .data import TEXT_SOURCES

            text_sentences = [x for x in re.split(r"(?<=[.!?])\s+", TEXT_SOURCES[haystack]()) if x.strip()]
        else:
            raise ValueError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
        out, total = [], 0
        for t in text_sentences:
            ids = tokenizer.encode(" " + " ".join(t.split()), add_special_tokens=False)
            out.append(ids)
            total += len(ids)
            if total > 1_100_000:
                break
        _SENTENCES[key] = out
    return _SENTENCES[key]


def passkey_prompt(tokenizer, length: int, depth: float, seed: int, haystack: str = "filler",
                   needles: tuple[str, ...] = ("classic",)) -> tuple[list[int], str]:
    """The prompt's token ids (exactly `length` of them) and the key, for one (length, depth, seed) cell.

    `tokenizer` needs `encode(text, add_special_tokens=...)`; the intro gets the tokenizer's special tokens (BOS when
    it adds one), the other parts none. The needle is phrased as NEEDLES[needles[seed % len(needles)]]."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction of the haystack in [0, 1], got {depth}")
    unknown = [n for n in needles if n not in NEEDLES]
    if unknown or not needles:
        raise ValueError(f"unknown needle phrasing(s) {unknown}; choose from {', '.join(NEEDLES)}")
    needle_text, question = NEEDLES[needles[seed % len(needles)]]
    key = str(random.Random(f"passkey:{length}:{depth}:{seed}").randint(10000, 99999))
    head = tokenizer.encode(INTRO)
    needle = tokenizer.encode(" " + needle_text.format(key=key), add_special_tokens=False)
    tail = tokenizer.encode(" " + question, add_special_tokens=False)
    room = length - len(head) - len(needle) - len(tail)  # haystack tokens
    if room < 0:
        raise ValueError(f"a passkey prompt of {length} tokens cannot hold the intro, needle and question "
                         f"({length - room} tokens with this tokenizer); use lengths >= {length - room}")
    sentences = haystack_sentences(tokenizer, haystack)
    hay, bounds = [], [0]  # bounds: token offsets where a sentence starts
    while len(hay) < room:
        for s in sentences:
            hay += s
            bounds.append(len(hay))
            if len(hay) >= room:
                break
    hay = hay[:room]
    at = min((b for b in bounds if b <= room), key=lambda b: abs(b - depth * room))
    return head + hay[:at] + needle + hay[at:] + tail, key


def score(text: str, key: str) -> bool:
    """True when the first number in the generated `text` is the key ("12345." counts, "123456" or "1 2345" not)."""
    m = re.search(r"\d+", text)
    return m is not None and m.group() == key


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_method_args(p)
    p.add_argument("--lengths", type=context_length, nargs="+", default=[4096, 8192, 16384], metavar="L",
                   help="prompt lengths in tokens, k = 1024 and M = 1024^2 (default: 4k 8k 16k)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], metavar="D",
                   help="where the needle goes, as a fraction of the haystack in [0, 1] (default: 0.1 0.5 0.9)")
    p.add_argument("--seeds", type=int, default=1, help="keys per (length, depth) cell (default: 1)")
    p.add_argument("--haystack", default="filler", choices=HAYSTACKS,
                   help="what the needle hides in: the classic repeated sentences (filler, default), Paul Graham's "
                        "essays or SQuAD's Wikipedia paragraphs (natural text, repeated past its end)")
    p.add_argument("--needles", nargs="+", default=["classic"], choices=list(NEEDLES), metavar="PHRASING",
                   help=f"needle phrasings, used in turn over the seeds of a cell ({', '.join(NEEDLES)}; "
                        "default: classic)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens to generate per answer (default: 8)")
    add_share_prefill_arg(p)


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError for settings no run can use (the tokenizer-dependent minimum length is checked by
    `passkey_prompt`)."""
    if not args.lengths or min(args.lengths) < 1:
        raise ValueError(f"--lengths must be positive token counts, got {args.lengths}")
    bad = [d for d in args.depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"--depths must be fractions of the haystack in [0, 1], got {bad}")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1 (keys per length and depth), got {args.seeds}")
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be >= 1, got {args.new_tokens}")


def run_method(llm, prompts: list[dict], new_tokens: int, label: str) -> list[dict]:
    """Answer every prompt ({"length", "depth", "seed", "key", "ids"}) with one engine -> one result per prompt.
    A result's seconds run from its scheduling to its last token, so prompts batched together overlap."""
    from ...sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    results = []
    backend = llm.engine.backend
    for group in _batches(prompts):
        before = backend.decode_reads()
        outs = llm.generate([{"prompt_token_ids": p["ids"]} for p in group], params)  # progress: progress.py
        after = backend.decode_reads()
        for p, out in zip(group, outs):
            m = out.metrics
            cell = _cell(p, out, m.finished_time - m.first_scheduled_time)
            if after is not None:  # metered (psa count_reads): the batch's totals, summed per length by summarize
                cell["decode_reads_batch"] = {k: after[k] - before[k] for k in after}
                cell["batch_size"] = len(group)
            results.append(cell)
            note(f"passkey {label} {format_length(p['length'])} depth {p['depth']} seed {p['seed']}: "
                 f"{'right' if cell['correct'] else 'wrong'} (key {p['key']}, got {out.text.strip()[:20]!r}, "
                 f"{cell['seconds']:.1f} s)")
    return results


def run_variants(llm, prompts: list[dict], new_tokens: int, labels: list[str], variants) -> list[list[dict]]:
    """`run_method` for decode variants of one method (--share-prefill, tools/eval/variants.py): each batch of
    prompts prefilled once and decoded under every variant -> one result list per variant. A result's seconds are
    its variant's pass over the batch (the first variant's includes the prefill), as in eval ruler; no decode reads."""
    from ...sampling_params import SamplingParams
    from .variants import generate_variants

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    results: list[list[dict]] = [[] for _ in labels]
    for group in _batches(prompts):
        outs, seconds = generate_variants(llm, [p["ids"] for p in group], params, variants)
        for label, res, o, secs in zip(labels, results, outs, seconds):
            for p, out in zip(group, o):
                res.append(_cell(p, out, secs))
                note(f"passkey {label} {format_length(p['length'])} depth {p['depth']} seed {p['seed']}: "
                     f"{'right' if res[-1]['correct'] else 'wrong'} (key {p['key']}, got {out.text.strip()[:20]!r})")
    return results


def _cell(p: dict, out, seconds: float) -> dict:
    """One prompt's result: where its needle was, whether the answer holds the key, its output and times."""
    return {"length": p["length"], "depth": p["depth"], "seed": p["seed"], "key": p["key"],
            "correct": score(out.text, p["key"]), "output": out.text[:OUTPUT_CHARS], "seconds": round(seconds, 3),
            "prefill_seconds": round(out.metrics.prefill_seconds, 3)}


def _batches(prompts: list[dict]) -> list[list[dict]]:
    """Runs of up to BATCH consecutive prompts of one length."""
    batches: list[list[dict]] = []
    for p in prompts:
        if batches and len(batches[-1]) < BATCH and batches[-1][0]["length"] == p["length"]:
            batches[-1].append(p)
        else:
            batches.append([p])
    return batches


def summarize(cells: list[dict], lengths: list[int]) -> dict:
    """Accuracy per length and overall, mean prefill seconds per length, and the cells."""
    def mean(xs):
        return sum(xs) / len(xs)

    by_length = {n: [c for c in cells if c["length"] == n] for n in lengths}
    return {"accuracy": {str(n): mean([c["correct"] for c in cs]) for n, cs in by_length.items()},
            "n": {str(n): len(cs) for n, cs in by_length.items()},
            "ci95": {str(n): [round(x, 3) for x in wilson(sum(c["correct"] for c in cs), len(cs))]
                     for n, cs in by_length.items()},
            "overall": mean([c["correct"] for c in cells]),
            "prefill_seconds": {str(n): round(mean([c["prefill_seconds"] for c in cs]), 3)
                                for n, cs in by_length.items()},
            **({"decode_reads": {str(n): _reads(cs) for n, cs in by_length.items()}}
               if any("decode_reads_batch" in c for c in cells) else {}),
            "cells": cells}


def _reads(cells: list[dict]) -> dict | None:
    """Decode reads over the cells' batches (each cell holds its batch's totals: counted once per batch)."""
    from .common import reads_between

    zero = {"keys": 0.0, "queries": 0.0, "context_keys": 0.0}
    total = dict(zero)
    for c in cells:
        for k, v in c.get("decode_reads_batch", zero).items():
            total[k] += v / c["batch_size"]
    return reads_between(zero, total)


def main(args: argparse.Namespace) -> int:
    check_args(args)
    lengths, depths = sorted(set(args.lengths)), sorted(set(args.depths))
    specs = parse_methods(args.attention, args.preset, args.attention_config)
    share = args.share_prefill and len(specs) > 1
    groups = [specs] if share else [[spec] for spec in specs]
    prompts: list[dict] = []
    header: dict = {}
    methods: dict[str, dict] = {}
    for group in groups:
        spec = group[0]
        variants = None
        if share:
            from .variants import check_variants

            configs = [method_config(s, eval_config(args.attention_config)) for s in group]
            check_variants(group, configs)  # before the model loads
        note(f"passkey: loading {args.model} with {spec.label} attention")
        llm = make_llm(args.model, spec, args.attention_config, args.device, args.dtype,
                       max(lengths) + args.new_tokens, max_num_seqs=BATCH, **engine_kwargs(args))
        engine = llm.engine
        if share:
            from .variants import DecodeVariants

            variants = DecodeVariants.install(engine, configs)
        if not prompts:  # built once, with the first engine's tokenizer: every method answers the same prompts
            if engine.tokenizer is None:
                raise ValueError(f"{args.model} carries no tokenizer; eval passkey needs one to build its prompts")
            for n in lengths:
                for d in depths:
                    for s in range(args.seeds):
                        ids, key = passkey_prompt(engine.tokenizer, n, d, s, args.haystack, tuple(args.needles))
                        prompts.append({"length": n, "depth": d, "seed": s, "key": key, "ids": ids})
            header = {"model": engine.model_config.name or args.model, "device": str(engine.device),
                      "dtype": str(engine.dtype).removeprefix("torch.")}
        t0 = time.perf_counter()
        if variants is None:
            methods[spec.label] = summarize(run_method(llm, prompts, args.new_tokens, spec.label), lengths)
            methods[spec.label]["seconds"] = round(time.perf_counter() - t0, 2)
        else:
            runs = run_variants(llm, prompts, args.new_tokens, [s.label for s in group], variants)
            for s, cells in zip(group, runs):  # "seconds": the whole shared run, for each of its variants
                methods[s.label] = {**summarize(cells, lengths), "seconds": round(time.perf_counter() - t0, 2)}
        device = engine.device
        del llm, engine, variants
        gc.collect()  # the engine holds reference cycles; free it before the next one sizes its KV cache
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    report = {**header, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "args": {k: v for k, v in vars(args).items() if k != "func"},
              "lengths": lengths, "depths": depths, "seeds": args.seeds, "new_tokens": args.new_tokens,
              "haystack": args.haystack, "needles": list(args.needles),
              **({"share_prefill": True} if share else {}), "methods": methods}
    emit(report, args.out, args, samples(len(depths) * args.seeds, "method x length", "prompts (depths x seeds)"))
    path = plot_path(args)
    if path:
        plot(report, path)
        note(f"passkey: plot written to {path}")
    print(table(report), file=sys.stderr)
    return 0


def grid(cells: list[dict], lengths: list[int], depths: list[float]) -> list[list[float]]:
    """Accuracy over seeds, as rows of depths x columns of lengths."""
    def acc(n, d):
        hits = [c["correct"] for c in cells if c["length"] == n and c["depth"] == d]
        return sum(hits) / len(hits)

    return [[acc(n, d) for n in lengths] for d in depths]


def plot(report: dict, path: str) -> None:
    """One depth x length accuracy heatmap per method, side by side in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths, methods = report["lengths"], report["depths"], report["methods"]
    fig, axes = plt.subplots(1, len(methods), squeeze=False, sharey=True, layout="constrained",
                             figsize=(1.2 + (0.9 * len(lengths) + 1) * len(methods), 1.6 + 0.5 * len(depths)))
    for ax, (label, m) in zip(axes[0], methods.items()):
        acc = grid(m["cells"], lengths, depths)
        image = ax.imshow(acc, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(acc):
            for j, a in enumerate(row):
                ax.text(j, i, f"{a:.0%}", ha="center", va="center", fontsize=9)
        ax.set_title(f"{label} ({m['overall']:.0%})", fontsize=10)
        ax.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("prompt length (tokens)")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy", shrink=0.9)
    fig.suptitle(f"Passkey retrieval, {report['model']}: {', '.join(methods)}", fontsize=11)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _keys(reads: dict | None) -> str:
    return "-" if not reads or reads["keys_per_query"] is None else f"{reads['keys_per_query']:,.0f}"


def table(report: dict) -> str:
    """Accuracy (%) per method and length, plus overall."""
    lengths = report["lengths"]
    title = "passkey accuracy (%) [95% CI]"
    metered = [f"{label} keys read per decode query" for label, m in report["methods"].items() if "decode_reads" in m]
    width = max(len(label) for label in [title, *report["methods"], *metered]) + 2

    def cell(m, n):
        lo, hi = m["ci95"][str(n)] if "ci95" in m else (float("nan"), float("nan"))
        return f"{100 * m['accuracy'][str(n)]:5.0f} [{100 * lo:3.0f}-{100 * hi:3.0f}]"
    lines = [title.ljust(width) + "".join(f"{format_length(n):>15}" for n in lengths) + "    all"]
    for label, m in report["methods"].items():
        lines.append(label.ljust(width) + "".join(f"{cell(m, n):>15}" for n in lengths) + f"{100 * m['overall']:7.0f}")
    for label, m in report["methods"].items():  # metered decode (psa count_reads): mean keys per query
        if "decode_reads" in m:
            lines.append(f"{label} keys read per decode query".ljust(width) + "".join(
                f"{_keys(m['decode_reads'][str(n)]):>15}" for n in lengths))
    counts = sorted({c for m in report["methods"].values() for c in m.get("n", {}).values()})
    if counts:
        lines.append(f"prompts per cell: {', '.join(map(str, counts))}")
    return "\n".join(lines)
