"""When a sequence stops: a stop token, EOS (after min_tokens), a stop string in the detokenized text, or its length.
Mutates the sequence (its tokens, text, status, finish and stop reason)."""
from __future__ import annotations

from .sequence import Sequence, SequenceStatus


def append_token(seq: Sequence, tok: int) -> None:
    """Record a sampled token and decide whether the sequence stops (EOS, stop token/string, length)."""
    p = seq.params
    seq.output_token_ids.append(tok)
    n_out = len(seq.output_token_ids)
    may_stop = n_out >= p.min_tokens
    if may_stop and tok in p.stop_token_ids:
        finish(seq, "stop", tok)
    elif may_stop and tok in seq.eos_token_ids:
        finish(seq, "stop", None)
    else:
        if seq.decoder is not None:
            new = seq.decoder.push(tok)
            seq.text += new
            if may_stop and p.stop and new:
                check_stop_strings(seq, len(new))
        if not seq.finished and n_out >= seq.max_tokens:
            finish(seq, "length", None)


def check_stop_strings(seq: Sequence, new_len: int) -> None:
    longest = max(len(s) for s in seq.params.stop)
    start = max(0, len(seq.text) - new_len - longest + 1)  # a match must overlap the new text
    hits = [(i, s) for s in seq.params.stop if (i := seq.text.find(s, start)) >= 0]
    if hits:
        i, s = min(hits)
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        finish(seq, "stop", s)


def finish(seq: Sequence, reason: str, stop_reason) -> None:
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason = reason
    seq.stop_reason = stop_reason
