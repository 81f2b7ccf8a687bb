"""`longreach eval ruler`: RULER's generators driven with our tokenizer, RULER's metrics, the command end to end."""
import json
import random
import subprocess
import sys

import pytest

from longreach.cli import main
from longreach.tools.eval import ruler, ruler_tasks

ALL_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
             "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


def test_task_table_is_rulers():
    table = ruler_tasks.tasks()
    assert list(table) == ALL_TASKS
    assert table["niah_multikey_1"].args["num_needle_k"] == 4
    assert table["niah_single_3"].args["type_needle_v"] == "uuids"
    assert table["qa_1"].metric == "string_match_part" and table["vt"].metric == "string_match_all"
    assert table["niah_single_1"].tokens_to_generate == 128 and table["qa_2"].args == {"dataset": "hotpotqa"}


@pytest.mark.parametrize("name", ALL_TASKS)
def test_generation_fits_is_deterministic_and_holds_the_answers(tok, name):
    length, task = 2048, ruler_tasks.tasks()[name]
    state = random.getstate()
    a = ruler_tasks.generate(name, length, 2, seed=3, tokenizer=tok, chat=True)
    assert random.getstate() == state  # the scripts' global seeding is undone
    b = ruler_tasks.generate(name, length, 2, seed=3, tokenizer=tok, chat=True)
    assert [s.prompt_ids.tolist() for s in a] == [s.prompt_ids.tolist() for s in b]
    assert [s.outputs for s in a] == [s.outputs for s in b]
    base = ruler_tasks.generate(name, length, 1, seed=3, tokenizer=tok)
    for s, chat in [(a[0], True), (a[1], True), (base[0], False)]:
        assert len(s.prompt_ids) + task.tokens_to_generate <= length
        assert len(s.prompt_ids) > length // 2 or name in ("niah_multikey_3", "qa_1")  # RULER's coarse increments
        text = tok.decode(s.prompt_ids.tolist(), skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") == chat and ("<|im_start|>assistant\n" in text) == chat
        assert "\ue000" not in text
        if task.kind != "qa":  # hotpotqa's yes/no answers need not be quoted
            assert all(ans.lower() in text.lower() for ans in s.outputs), (name, s.outputs)


def test_seed_and_prompt_format(tok):
    one = ruler_tasks.generate("niah_single_2", 2048, 2, seed=1, tokenizer=tok)
    other = ruler_tasks.generate("niah_single_2", 2048, 2, seed=2, tokenizer=tok)
    assert [s.outputs for s in one] != [s.outputs for s in other]
    base = tok.decode(one[0].prompt_ids.tolist(), skip_special_tokens=False)
    assert base.startswith("A special magic number is hidden within the following text.")  # RULER's 'base' template
    assert "provided text? The special magic number for " in base and "<|im_start|>" not in base
    assert base.endswith(" mentioned in the provided text is")
    chat = ruler_tasks.generate("niah_single_2", 2048, 1, seed=1, tokenizer=tok, chat=True)[0]
    chat = tok.decode(chat.prompt_ids.tolist(), skip_special_tokens=False)
    assert "provided text?<|im_end|>\n<|im_start|>assistant\nThe special magic number for " in chat
    assert chat.endswith(" mentioned in the provided text is")


def test_a_task_too_long_for_the_length_says_so(tok):
    with pytest.raises(ValueError, match="qa_1 does not fit in 512 tokens: its smallest prompt plus 32 tokens"):
        ruler_tasks.generate("qa_1", 512, 1, seed=0, tokenizer=tok)


def test_niah_key_list_matches_rulers():
    import wonderwords

    read = wonderwords.random_word._get_words_from_text_file
    adjs, nouns = read("adjectivelist.txt")[:40], read("nounlist.txt")[:50]
    lazy = ruler_tasks._PairWords(adjs, nouns)
    full = sorted({f"{a}-{n}" for a in adjs for n in nouns})  # what niah.py builds, on a slice of its lists
    assert len(lazy) == len(full) and sorted(lazy[i] for i in range(len(lazy))) == full
    assert lazy[-1] == lazy[len(lazy) - 1]


def test_size_search_finds_rulers_size():
    calls = []

    def linear(n):
        calls.append(n)
        return 300 + 7 * n + (n * 7919) % 13  # a fixed part, a per-unit cost and some wobble

    for budget, step, cap in [(100_000, 25, None), (5_000, 500, None), (1_000_000, 10, 20_000), (400, 5, None)]:
        ruler_size = step  # RULER: grow by `step` while the prompt fits
        while linear(ruler_size + step) <= budget and (cap is None or ruler_size + step <= cap):
            ruler_size += step
        calls.clear()
        assert ruler_tasks._largest_fitting(linear, budget, step, cap) == ruler_size
        assert len(calls) <= 12
    assert ruler_tasks._largest_fitting(linear, 200, 10, None) == 0


def test_metrics_are_rulers():
    task = ruler_tasks.tasks()["niah_multivalue"]
    total, per = ruler_tasks.score(task, ["The numbers are 123 and 456.", "only 123", "nothing"],
                                   [["123", "456"], ["123", "456"], ["7"]])
    assert per == [100.0, 50.0, 0.0] and total == 50.0
    qa = ruler_tasks.tasks()["qa_1"]
    total, per = ruler_tasks.score(qa, [" PARIS, of course", "London\x00"], [["Paris", "Lyon"], ["Berlin"]])
    assert per == [100.0, 0.0] and total == 50.0
    assert ruler_tasks.metric("string_match_all")(["a b"], [["A", "c", "b"]]) == 66.67
    assert ruler_tasks.postprocess("  1234\x015678\n ") == "1234\n5678"


def test_eval_ruler_end_to_end(smollm2, tmp_path, capsys, monkeypatch):
    from longreach.engine.llm import LLM

    def session_llm(model, spec, attention_config, device, dtype, max_model_len, **engine_kwargs):  # the loaded
        assert (model, spec.label, device, dtype, max_model_len) == ("smollm2", "dense", "cpu", "float32", 512)  # model
        assert engine_kwargs == {"kv_cache_memory_gb": None, "enforce_eager": False, "kv_cache_dtype": "auto",
                                 "kv_offloading_size": None, "quantization": None, "max_num_batched_tokens": 8192,
                                 "rope_scaling": None, "cpu_threads": None}
        llm = LLM.__new__(LLM)
        llm.engine, llm.config = smollm2, smollm2.config
        return llm

    monkeypatch.setattr(ruler, "make_llm", session_llm)
    out, png = tmp_path / "ruler.json", tmp_path / "ruler.png"
    rc = main(["eval", "ruler", "--tasks", "niah_single_1", "--lengths", "512", "--samples", "2", "--prompt-format",
               "chat", "--attention", "dense", "--device", "cpu", "--dtype", "float32", "--out", str(out),
               "--plot", str(png)])
    assert rc == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert report["model"] and report["device"] == "cpu" and report["dtype"] == "float32" and report["date"]
    assert report["args"]["tasks"] == ["niah_single_1"] and report["lengths"] == [512]
    assert report["prompt_format"] == "chat"  # the model stops at <|im_end|>: a few decode steps, not 128
    cell = report["methods"]["dense"]["tasks"]["niah_single_1"]["512"]
    assert cell["n"] == 2 and 0 <= cell["score"] <= 100 and len(cell["per_sample"]) == 2
    assert len(cell["examples"]) == 2 and {"prediction", "answers"} <= set(cell["examples"][0])
    # every prompt below 100 is kept with its prediction, and only those
    assert [m["sample"] for m in cell["misses"]] == [i for i, v in enumerate(cell["per_sample"]) if v < 100]
    assert all(m["prediction"] == cell["examples"][m["sample"]]["prediction"] for m in cell["misses"])
    assert report["methods"]["dense"]["average"] == cell["score"]
    assert report["prompt_tokens"]["niah_single_1"]["512"]["max"] <= 512 - 128
    assert png.stat().st_size > 1000
    assert "niah_single_1" in captured.err and "average" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "niah_single_1", "needle"], "unknown RULER task(s) needle; available: niah_single_1, "),
    (["--tasks", "vt", "vt"], "--tasks lists a task twice"),
    (["--lengths", "4x"], "--lengths: expected a token count like 4096, 4k or 1M"),
    (["--lengths", "256"], "--lengths must be at least 512 tokens"),
    (["--samples", "0"], "--samples must be at least 1"),
    (["--attention", "nope"], "unknown attention backend 'nope'"),
])
def test_eval_ruler_bad_arguments(argv, message, capsys):
    assert main(["eval", "ruler", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_lengths_are_1024_based():
    assert [ruler.parse_length(x) for x in ("4k", "16K", "1M", "2048")] == [4096, 16384, 1 << 20, 2048]
    assert ruler.length_label(131072) == "128K" and ruler.length_label(1 << 20) == "1M"


def test_import_is_light():
    code = ("import sys, longreach.tools.eval.ruler; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'nltk', 'numpy', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
