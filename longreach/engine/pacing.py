"""Prefill chunks sized by time while other sequences decode (`--mixed-step-target-ms`).

Why: a step that carries decode rows and a long prompt's chunk lasts as long as the chunk's GPU work, and that is
every decoding request's inter-token latency while the prompt prefills. The chunk's cost per token grows with the
prompt's context (a 2,048-token chunk of SmolLM2 at 128K is ~57 ms of GPU work on an H200, docs/serving.md), so no
fixed token count suits every length, model and GPU.

Rule (a per-sequence controller, no cost model): a prompt's chunk cap starts at the scheduler's long-prefill
threshold. After each step that carried decode rows and chunks of it, the step's measured time is compared to the
target: above it, the cap halves (to the largest power of two at most half the chunk just run); under half of it,
the cap doubles (up to the threshold). The requests a paced step admits share one cap between them (`ADMISSIONS`,
the sum of their first chunks), so a wave of new prompts arriving together (a closed loop's chats finishing at once)
is spread over steps instead of making one step of the whole budget: a step that admitted 15 short prompts beside
35 decode rows took ~130 ms on an H200 (docs/serving.md, the 1M run). Caps are powers of two of at least MIN_CHUNK
(and never below `min_chunk`, the scheduler's chunk alignment: a bounded cache's stride, whose chunks end on its
multiples), so a chunk keeps a prefill selection graph's shape (attention/sparse/prefill_graph.py) and the number of
distinct shapes stays small. A step without decode rows is not paced (a prompt alone, or only prompts, prefills at
the full budget), and its time is not used. The first step at a new shape may include a graph capture or a kernel
compilation: the cap halves once too often, and grows back only after steps under half the target, which a step of
the smallest chunk may never be (infinitehip's 256-token step beside 32 chats at 128K takes 25-35 ms on an H200: with
a 40 ms target its chunks stay at 256; docs/serving.md).

What it trades: smaller chunks cost more steps (each step's fixed cost: the decode rows, the weights read once), so
the long prompt's own time to first token grows while the others' inter-token latency falls. docs/serving.md has the
measured trade.
"""
from __future__ import annotations

MIN_CHUNK = 256
ADMISSIONS = -1  # the cap key of the new requests a paced step admits, together (sequence ids are >= 0)


def _floor_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


class ChunkPacer:
    def __init__(self, target_s: float, max_chunk: int, min_chunk: int = 1):
        self.target_s = target_s
        self.min_chunk = max(MIN_CHUNK, min_chunk)
        self.max_chunk = max(_floor_pow2(max_chunk), min(max_chunk, self.min_chunk))
        self._cap: dict[int, int] = {}  # seq_id -> its chunk cap while others decode

    def cap(self, seq_id: int) -> int:
        """`seq_id`'s chunk cap while others decode (ADMISSIONS: the new requests' first chunks together)."""
        return self._cap.get(seq_id, self.max_chunk)

    def observe(self, chunks: dict[int, int], seconds: float) -> None:
        """A step that carried decode rows and these prefill chunks ({seq_id or ADMISSIONS: tokens}) took
        `seconds`."""
        for seq_id, n in chunks.items():
            cap = self.cap(seq_id)
            if seconds > self.target_s:
                cap = max(self.min_chunk, _floor_pow2(min(n, cap)) // 2)
            elif seconds < self.target_s / 2 and n >= cap:  # only a chunk that used its whole cap asks for more
                cap = min(self.max_chunk, cap * 2)
            self._cap[seq_id] = min(cap, self.max_chunk)

    def sizes(self) -> list[int]:
        """Every cap the controller can choose (the chunk sizes a warm-up should capture graphs for)."""
        out, n = [], self.max_chunk
        while n >= self.min_chunk:
            out.append(n)
            n //= 2
        return out or [self.max_chunk]

    def forget(self, seq_id: int) -> None:
        self._cap.pop(seq_id, None)
