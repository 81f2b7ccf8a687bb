"""Host time of one graph-decoded step, on a CPU (issue 31): the engine's Python work between graph replays.

Builds an engine on a tiny random model with `--layers` layers (default 32, the 8B shape's count, so per-layer host
loops weigh as they would there), emulates the decode graphs (`capture_graphs(emulate=True)`: the static-buffer path,
each "replay" running the forward eagerly), puts `--seqs` sequences of `--context` tokens straight into the decode
phase (their pages reserved; the KV cache holds zeros: host work does not depend on its contents), and times each part
of `LLMEngine.step` with the emulated forward (the model's CPU compute, on a GPU the graph replay) subtracted.

    PYTHONPATH=$PWD python scripts/profile_host_step.py --context 16384 65536 --attention dense infinitehip

Prints, per attention method and context length, microseconds per step of each part (the median over the timed
steps). The numbers are CPU host time, not measured on a GPU: there the copies are host-to-device transfers.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import time

import torch


def build(attention: str, context: int, layers: int, seqs: int, stub: bool = False):
    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine
    from longreach.models import random_init

    base = random_init.SHAPES["tiny"]
    name = f"tiny{layers}"
    random_init.SHAPES[name] = dataclasses.replace(base, config=dataclasses.replace(
        base.config, num_layers=layers, max_position_embeddings=max(context * 2, 4096), name=f"random:{name}"))
    max_len = 1 << (context + 1024).bit_length() - 1
    max_len = max_len if max_len > context + 512 else max_len * 2
    kw = {}
    if attention == "infinitehip":
        kw = dict(attention_config='{"dense_below": null}')
    cfg = EngineConfig(model=f"random:{name}", device="cpu", dtype="float32", max_model_len=max_len,
                       kv_cache_memory_gb=max(0.25, seqs * max_len * layers * 2 * 2 * 16 * 4 * 1.1 / 2**30),
                       attention=attention, max_num_seqs=max(seqs, 4), cpu_threads=1, **kw)
    engine = LLMEngine(cfg)
    engine.runner.capture_graphs(emulate=True)
    return engine


def start_decoding(engine, context: int, seqs: int, max_tokens: int, stub: bool) -> None:
    """`seqs` requests whose prompts count as prefilled, their first token sampled (the next step decodes it)."""
    from longreach import SamplingParams
    from longreach.engine.sequence import SequenceStatus

    g = torch.Generator().manual_seed(0)
    sched = engine.scheduler
    if not stub:
        engine.kv_cache.kv.zero_()  # torch.empty: whatever was in memory (NaN logits); stubbed: never touched
    for i in range(seqs):
        ids = torch.randint(3, 500, (context,), generator=g).tolist()
        engine.add_request(str(i), ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for seq in list(sched.waiting):
        sched.waiting.remove(seq)
        assert engine.blocks.ensure(seq.seq_id, seq.num_tokens)
        seq.output_token_ids.append(7)  # as if the prefill had sampled it
        seq.num_computed = len(seq.prompt_token_ids)
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)


class Timer:
    """Wraps callables; accumulates their time per step, the forward's excluded from whatever encloses it."""

    def __init__(self):
        self.step: dict[str, float] = collections.defaultdict(float)
        self.stack: list[list[float]] = []  # per open timed call: [time of timed calls nested in it]

    def wrap(self, name: str, fn, exclusive_of_children: bool = True):
        def timed(*a, **k):
            self.stack.append([0.0])
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                nested = self.stack.pop()[0]
                self.step[name] += dt - nested if exclusive_of_children else dt
                if self.stack:
                    self.stack[-1][0] += dt
        return timed


def instrument(engine, timer: Timer, stub: bool) -> None:
    from longreach.engine import llm_engine

    runner, backend = engine.runner, engine.backend
    capture = runner._capture
    vocab = engine.model_config.vocab_size

    def captured(n, key):
        capture(n, key)
        fn = (lambda: torch.zeros(n, vocab)) if stub else runner._graphs[(n, key)]
        runner._graphs[(n, key)] = timer.wrap("forward (graph replay: excluded)", fn)
    runner._capture = captured
    for (n, key), fn in list(runner._graphs.items()):
        fn = (lambda n=n: torch.zeros(n, vocab)) if stub else fn
        runner._graphs[(n, key)] = timer.wrap("forward (graph replay: excluded)", fn)
    engine.scheduler.schedule = timer.wrap("scheduler.schedule", engine.scheduler.schedule)
    runner._replay = timer.wrap("runner._replay (inputs, tables, copies)", runner._replay)
    runner.execute = timer.wrap("runner.execute (rest)", runner.execute)
    step = backend.graph_step

    def graph_step(ids, lens):
        key, load = step(ids, lens)
        return key, None if load is None else timer.wrap("backend load(rows)", load)
    backend.graph_step = timer.wrap("backend.graph_step (plan)", graph_step)
    engine.kv_cache.end_step = timer.wrap("kv_cache.end_step", engine.kv_cache.end_step)
    engine.sampler.sample = timer.wrap("sampler.sample (+ token sync)", engine.sampler.sample)
    llm_engine.append_token = timer.wrap("append_token", llm_engine.append_token)
    engine.step = timer.wrap("LLMEngine.step total", engine.step, exclusive_of_children=False)


def measure(attention: str, context: int, layers: int, seqs: int, warmup: int, steps: int,
            stub: bool) -> dict[str, float]:
    engine = build(attention, context, layers, seqs, stub)
    start_decoding(engine, context, seqs, warmup + steps + 4, stub)
    timer = Timer()
    instrument(engine, timer, stub)
    per: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(warmup + steps):
        timer.step.clear()
        engine.step()
        assert engine.last_step is not None and not engine.last_step.is_prefill
        if i >= warmup:
            for k, v in timer.step.items():
                per[k].append(v)
    out = {k: statistics.median(v) * 1e6 for k, v in per.items()}
    fwd = "forward (graph replay: excluded)"
    out["host total (step - forward)"] = statistics.median(
        [t - f for t, f in zip(per["LLMEngine.step total"], per[fwd])]) * 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--attention", nargs="+", default=["dense", "infinitehip"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--stub-forward", action="store_true",
                   help="replace the forward by zeros (no KV cache behind the pages): long contexts in seconds")
    a = p.parse_args()
    torch.set_num_threads(1)
    results = {(m, c): measure(m, c, a.layers, a.seqs, a.warmup, a.steps, a.stub_forward)
               for m in a.attention for c in a.context}
    for m in a.attention:
        names = list(results[(m, a.context[0])])
        stub = ", forward stubbed" if a.stub_forward else ""
        print(f"\n{m}, {a.layers} layers, {a.seqs} sequence(s){stub}, us per step (median of {a.steps}), CPU")
        print("| part | " + " | ".join(f"{c // 1024}K" for c in a.context) + " |")
        print("|---|" + "---|" * len(a.context))
        for name in names:
            print(f"| {name} | " + " | ".join(f"{results[(m, c)].get(name, 0.0):.0f}" for c in a.context) + " |")


if __name__ == "__main__":
    main()
