"""End-to-end engine benchmark: longreach vs transformers on the same GPU, in the same run.

Measures, for both engines with greedy decoding:
  * decode throughput at batch 1 and batch 32: (T(generate N tokens) - T(generate 1 token)) gives the decode time of
    N-1 tokens per sequence, so prefill is excluded the same way for both;
  * prefill throughput on one long prompt (default 8191 tokens): the time to produce the first token;
  * greedy-token agreement on a few chat prompts.
Prints a table and writes JSON with its provenance (tools/report.py), and in it `rates`: which steps each rate
counts. transformers is the baseline here (its default SDPA attention and dynamic KV cache).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 50.",
    "What does a compiler do?",
]


@dataclass
class EngineResult:
    decode_tok_s: dict[int, float] = field(default_factory=dict)  # batch size -> generated tokens / s
    prefill_tok_s: float = 0.0
    prefill_s: float = 0.0


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def greedy_agreement(llm, hf, dev, new_tokens: int = 48) -> list[dict]:
    """Greedy continuations of the chat prompts from both engines; where they part, how close the choice was.

    `transformers_gap` is the logit difference, in transformers' own logits at the first differing position
    (teacher-forced on the common prefix), between its token and longreach's: a gap near the dtype's rounding
    (~0.1 for bf16 logits of magnitude ~20) means a near-tie that rounding order decides.
    """
    import torch

    from ...sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    eos = sorted(llm.engine.eos_token_ids)
    rows = []
    for text in CHAT_PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=new_tokens),
                            use_tqdm=False)[0].token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device=dev), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=0)[0, len(ids):].tolist()
        diff = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if diff is None and len(ours) != len(ref):
            diff = min(len(ours), len(ref))
        row = {"prompt": text, "equal": ours == ref, "first_difference": diff,
               "longreach": tok.decode(ours), "transformers": tok.decode(ref)}
        if diff is not None and diff < min(len(ours), len(ref)):
            with torch.no_grad():
                logits = hf(torch.tensor([ids + ref[:diff]], device=dev), logits_to_keep=1).logits[0, -1].float()
            row["transformers_gap"] = round((logits[ref[diff]] - logits[ours[diff]]).item(), 4)
        rows.append(row)
    return rows


RATES = {  # what each rate of `run` counts, in the report and under the printed table
    "decode_tok_s": {"steps_counted": "decode steps 2..N of every sequence: (N - 1) x batch tokens, N = new_tokens",
                     "steps_excluded": "the prefill and the first token (T(1 token) is subtracted from T(N tokens)); "
                                       "one untimed generate per engine before (compilation, graph capture)",
                     "statistic": "median of the repeats of each of T(N) and T(1)"},
    "prefill_tok_s": {"steps_counted": "the whole prefill of one prompt and its first token's sampling (time to "
                                       "the first token)",
                      "steps_excluded": "one untimed prefill of the same prompt before",
                      "statistic": "median of the repeats"}}


def run(model: str, hf_dir: str, hf_file: str | None, device: str, batch_sizes=(1, 32), new_tokens: int = 256,
        prompt_len: int = 128, prefill_len: int = 8191, repeats: int = 3, out_path: str | None = None,
        compare_fp32: bool = True, command: str | None = None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ...engine.llm import LLM
    from ...sampling_params import SamplingParams
    from ..report import attention_record, provenance, samples, write_json

    dev = torch.device(device)
    max_len = max(prefill_len, prompt_len + new_tokens) + 1
    llm = LLM(model, device=device, max_num_seqs=max(batch_sizes), max_model_len=max_len,
              max_num_batched_tokens=max(8192, prefill_len))
    kwargs = {"gguf_file": hf_file} if hf_file else {}
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=llm.engine.dtype, **kwargs).to(dev).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size

    agreement = greedy_agreement(llm, hf, dev)
    agreement_fp32 = None
    if llm.engine.dtype != torch.float32 and compare_fp32:
        llm32 = LLM(model, device=device, dtype="float32", kv_cache_memory_gb=2)
        hf32 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **kwargs).to(dev).eval()
        agreement_fp32 = greedy_agreement(llm32, hf32, dev)
        del llm32, hf32
        torch.cuda.empty_cache() if dev.type == "cuda" else None

    ours, base = EngineResult(), EngineResult()
    # ---- decode throughput ----
    for bsz in batch_sizes:
        prompts = [torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in range(bsz)]
        batch = torch.tensor(prompts, device=dev)

        def lr(n):
            return lambda: llm.generate([{"prompt_token_ids": p} for p in prompts],
                                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

        def tf(n):
            def go():
                with torch.no_grad():
                    hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
            return go

        for fn in (lr(2), tf(2)):
            fn()  # warm-up
        for result, make in ((ours, lr), (base, tf)):
            full = _median_time(make(new_tokens), repeats)
            one = _median_time(make(1), repeats)
            result.decode_tok_s[bsz] = bsz * (new_tokens - 1) / (full - one)

    # ---- prefill throughput ----
    long_ids = torch.randint(100, vocab, (prefill_len,), generator=gen).tolist()
    lr_prefill = lambda: llm.generate({"prompt_token_ids": long_ids}, SamplingParams(temperature=0, max_tokens=1),  # noqa: E731
                                      use_tqdm=False)

    def tf_prefill():
        with torch.no_grad():
            hf(torch.tensor([long_ids], device=dev), logits_to_keep=1)

    for result, fn in ((ours, lr_prefill), (base, tf_prefill)):
        fn()
        result.prefill_s = _median_time(fn, repeats)
        result.prefill_tok_s = prefill_len / result.prefill_s

    report = {
        "provenance": provenance(command, dev, attention=[attention_record("dense")],
                                 samples=samples(repeats, "rate", "timed repeats, median")),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "model": llm.engine.model_config.name,
        "dtype": str(llm.engine.dtype).replace("torch.", ""),
        "settings": {"new_tokens": new_tokens, "prompt_len": prompt_len, "prefill_len": prefill_len,
                     "repeats": repeats, "cuda_graphs": llm.engine.runner.decode_graphs},
        "longreach": asdict(ours),
        "transformers": asdict(base),
        "greedy_agreement": agreement,
        "greedy_agreement_fp32": agreement_fp32,
        "rates": RATES,
    }
    print(format_table(report))
    write_json(report, out_path, indent=2)
    return report


def format_table(r: dict) -> str:
    lines = [f"{r['model']} on {r['gpu']} ({r['dtype']}, torch {r['torch']}, {r['date']})",
             f"{'metric':<34} {'longreach':>12} {'transformers':>13} {'ratio':>7}"]
    ours, base = r["longreach"], r["transformers"]
    for bsz in ours["decode_tok_s"]:
        a, b = ours["decode_tok_s"][bsz], base["decode_tok_s"][bsz]
        lines.append(f"{f'decode tok/s, batch {bsz}':<34} {a:>12,.0f} {b:>13,.0f} {a / b:>6.1f}x")
    a, b = ours["prefill_tok_s"], base["prefill_tok_s"]
    lines.append(f"{'prefill tok/s, ' + str(r['settings']['prefill_len']) + ' tokens':<34} {a:>12,.0f} {b:>13,.0f} "
                 f"{a / b:>6.1f}x")
    for key, rate in r.get("rates", {}).items():
        lines.append(f"  {key}: counts {rate['steps_counted']}; leaves out {rate['steps_excluded']}")
    for key, label in (("greedy_agreement", r["dtype"]), ("greedy_agreement_fp32", "float32")):
        rows = r.get(key)
        if not rows:
            continue
        eq = sum(x["equal"] for x in rows)
        lines.append(f"greedy tokens equal ({label}) on {eq}/{len(rows)} chat prompts (48 tokens each)")
        for x in rows:
            if not x["equal"]:
                gap = x.get("transformers_gap")
                lines.append(f"  differs at token {x['first_difference']} (transformers' logit gap there: {gap}): "
                             f"{x['prompt']!r}")
    return "\n".join(lines)


LONG_DECODE_RATE = {  # `run_long`'s decode rate (engine/outputs.py's decode_tokens_per_s)
    "steps_counted": "decode steps 2..new_tokens: the tokens after the first over the time since the first",
    "steps_excluded": "the first token (made by the prefill's last step); an untimed generation of the same prompt "
                      "runs before, so compilation and graph capture fall there"}


def run_long(model: str, text: str, lengths: list[int], methods: list[tuple[str, str | None]], new_tokens: int,
             device: str, out_path: str | None, eager_too: bool = False, attention_config: dict | str | None = None,
             command: str | None = None) -> dict:
    """Prefill time and decode tokens/s through the engine for each (method, preset) at each prompt length.

    `eager_too`: also run each one with `enforce_eager` (no CUDA graphs) and report whether its tokens equal the
    graph run's, so the decode speed of graph capture and its exactness are measured in the same run.
    `attention_config`: overrides for every method but dense (a dict; the report records its JSON text)."""
    import gc

    import torch

    from ...engine.llm import LLM
    from ..eval.common import eval_config
    from ...sampling_params import SamplingParams

    from ..report import attention_record, provenance, samples, write_json

    attention_config = eval_config(attention_config)  # a dict (JSON text from a Python caller: parsed once, here)
    report = {"provenance": provenance(command, device if device != "auto" else None, attention=[
                  attention_record(n, p, None if n == "dense" else attention_config, model=model)
                  for n, p in methods],
                  attention_config=attention_config, samples=samples(1, "method x length", "prompt")),
              "date": time.strftime("%Y-%m-%d"), "runs": [],
              "rates": {"decode_tok_s": LONG_DECODE_RATE}}
    ids = None
    for n in lengths:
        for name, preset in methods:
            graph_tokens = None
            for eager in (False, True) if eager_too else (False,):
                llm = LLM(model, attention=name, preset=preset, device=device, max_model_len=n + new_tokens + 1,
                          max_num_seqs=1, gpu_memory_utilization=0.5, enforce_eager=eager,
                          attention_config=None if name == "dense" else attention_config)
                if ids is None:
                    ids = llm.get_tokenizer().encode(text)
                    report["gpu"] = torch.cuda.get_device_name() if llm.engine.device.type == "cuda" else "cpu"
                    report["model"] = llm.engine.model_config.name
                if len(ids) < n:
                    raise ValueError(f"the text has {len(ids)} tokens, fewer than the prompt length {n}")
                prompt = {"prompt_token_ids": ids[:n]}
                params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
                # warm-up: compiles, and captures the graph variants a decode meets (progress: progress.py)
                llm.generate(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
                out = llm.generate(prompt, params)[0]
                m = out.metrics
                graphs = llm.engine.runner.decode_graphs
                row = {"length": n, "attention": f"{name}:{preset}" if preset else name,
                       "attention_config": None if name == "dense" or attention_config is None else
                       json.dumps(attention_config), "prefill_s": m.prefill_seconds,
                       "prefill_tok_s": m.prefill_tokens_per_s, "decode_tok_s": m.decode_tokens_per_s,
                       "steps_counted": new_tokens - 1, "steps_excluded": "the first token (the prefill's step)",
                       "cuda_graphs": graphs, "graph_variants": len(llm.engine.runner._graphs), "text": out.text,
                       "token_ids": out.token_ids}
                if eager and graph_tokens is not None:
                    row["same_tokens_as_graphs"] = out.token_ids == graph_tokens
                if graphs:
                    graph_tokens = out.token_ids
                report["runs"].append(row)
                same = f"  same tokens as graphs: {row['same_tokens_as_graphs']}" if "same_tokens_as_graphs" in row else ""
                print(f"{n:>8} {row['attention']:<22} prefill {row['prefill_s']:8.2f} s "
                      f"({row['prefill_tok_s']:>9,.0f} tok/s)  decode {row['decode_tok_s'] or 0:8.1f} tok/s "
                      f"(steps 2..{new_tokens})  "
                      f"graphs={graphs}{same}  {out.text[:60]!r}", flush=True)
                del llm
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                write_json(report, out_path)
    return report
