"""`longreach serve` with faults injected by prompt, and a trace of every forward pass (tests/test_server_failures.py).

Run as `python -m serve_with_faults serve ARGS...` with tests/ on PYTHONPATH (server_harness.RemoteServer's `module`).
It wraps `ModelRunner.execute` in the server process; a request whose token-id prompt starts with MARK, a fault code
and a count k gets the fault once its sample has k generated tokens:

  NAN    its logits rows become NaN (the engine fails it alone: non_finite_logits)
  RAISE  the forward raises whenever its sequence is in the step, alone too (forward_error)
  KILL   this forward and every later one raise, the canary too: the engine is broken and the loop dies

With $LONGREACH_TEST_TRACE set, each forward appends one JSON line there: start and end time (time.time()), whether
it was a scoring pass (`score`), and its sequences as [request id, the prompt's first 5 tokens, tokens fed]; and each
accepted submission appends {"submit": time}.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from longreach.engine import model_runner
from longreach.server import engine_loop

MARK = (48000, 48001)
OK, NAN, RAISE, KILL = 0, 1, 2, 3

_real_execute = model_runner.ModelRunner.execute
_real_submit = engine_loop.EngineLoop.submit
_TRACE = os.environ.get("LONGREACH_TEST_TRACE")
_state = {"killed": False}


def marked(code: int, after: int, tag: int, n: int) -> list[int]:
    """A prompt of n tokens carrying fault `code` after `after` generated tokens; `tag` tells prompts apart."""
    return [*MARK, code, after, tag] + [300 + (i * 7 + tag) % 1000 for i in range(n - 5)]


def _fault(seq) -> int | None:
    ids = seq.prompt_token_ids
    if len(ids) < 4 or tuple(ids[:2]) != MARK or len(seq.output_token_ids) < ids[3]:
        return None
    return ids[2]


def _trace(record: dict) -> None:
    if _TRACE:
        with open(_TRACE, "a") as f:
            f.write(json.dumps(record) + "\n")


def execute(self, batch, all_logits: bool = False):
    t0 = time.time()
    faults = [_fault(s) for s in batch.seqs]
    try:
        if KILL in faults:
            _state["killed"] = True
        if _state["killed"]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        if RAISE in faults:
            raise RuntimeError("injected kernel error")
        logits, idx = _real_execute(self, batch, all_logits)
        if not all_logits:
            with torch.inference_mode():
                for row, i in enumerate(idx):
                    if faults[i] == NAN:
                        logits[row] = float("nan")
        return logits, idx
    finally:
        _trace({"start": t0, "end": time.time(), "score": all_logits,
                "seqs": [[s.request_id, s.prompt_token_ids[:5], n] for s, n in zip(batch.seqs, batch.num_tokens)]})


def submit(self, sub, prompts):
    _real_submit(self, sub, prompts)
    _trace({"submit": time.time(), "heads": [p.token_ids[:5] for p in prompts]})


model_runner.ModelRunner.execute = execute
engine_loop.EngineLoop.submit = submit

if __name__ == "__main__":
    from longreach.cli import main

    sys.exit(main(sys.argv[1:]))
