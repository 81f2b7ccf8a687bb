"""`longreach eval passkey`: prompt construction and scoring on the real tokenizer, argument checks, and one short
end-to-end run through the CLI on the real default model."""
import argparse
import json
import re

import pytest

from longreach.tools.eval.passkey import (
    INTRO,
    NEEDLE,
    QUESTION,
    check_args,
    context_length,
    passkey_prompt,
    score,
)


@pytest.fixture(scope="module")
def tok():
    """The default model's tokenizer, without loading its weights."""
    from longreach.models.gguf import GGUFFile
    from longreach.models.loader import resolve_model_path

    return GGUFFile(resolve_model_path("smollm2")).tokenizer()


@pytest.mark.parametrize("length", [200, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_has_exact_length_and_the_needle_at_its_depth(tok, length, depth):
    ids, key = passkey_prompt(tok, length, depth, seed=0)
    assert len(ids) == length and re.fullmatch(r"[1-9]\d{4}", key)
    text = tok.decode(ids)
    needle = " " + NEEDLE.format(key=key)
    assert text.count(key) == 2 and text.startswith(INTRO) and text.endswith(" " + QUESTION)
    at = text.index(needle)
    assert text[at - 1] == "."  # at a sentence boundary
    hay_chars = len(text) - len(INTRO) - len(needle) - len(" " + QUESTION)
    assert (at - len(INTRO)) / hay_chars == pytest.approx(depth, abs=0.02 + 25 / hay_chars)


def test_keys_follow_the_seed(tok):
    keys = [passkey_prompt(tok, 512, 0.5, seed)[1] for seed in range(8)]
    assert len(set(keys)) == 8
    assert passkey_prompt(tok, 512, 0.5, 3) == passkey_prompt(tok, 512, 0.5, 3)
    assert passkey_prompt(tok, 512, 0.1, 3)[1] != keys[3]  # other depths (and lengths) draw their own


def test_prompt_rejects_bad_cells(tok):
    with pytest.raises(ValueError, match=r"depth must be .* \[0, 1\], got 1.5"):
        passkey_prompt(tok, 1024, 1.5, 0)
    with pytest.raises(ValueError, match=r"cannot hold the intro, needle and question \(\d+ tokens.*use lengths >=") as e:
        passkey_prompt(tok, 40, 0.5, 0)
    shortest = int(re.search(r">= (\d+)$", str(e.value))[1])
    assert len(passkey_prompt(tok, shortest, 0.5, 0)[0]) == shortest  # no haystack, still a prompt


@pytest.mark.parametrize(("text", "right"), [
    (" 12345. Remember", True), ("12345", True), (" the key is 12345.", True), (" 54321 or 12345", False),
    (" 123456", False), (" 1234", False), (" a magical key", False), ("", False)])
def test_score_takes_the_first_number(text, right):
    assert score(text, "12345") is right


def test_lengths_accept_k_and_m_suffixes():
    assert [context_length(v) for v in ("300", "4k", "8K", "1M")] == [300, 4096, 8192, 1 << 20]
    with pytest.raises(argparse.ArgumentTypeError, match="like 4096, 4k or 1M"):
        context_length("4kb")


@pytest.mark.parametrize(("change", "message"), [
    ({"lengths": [0, 1024]}, r"--lengths must be positive"),
    ({"depths": [0.5, -0.1, 2.0]}, r"--depths must be fractions .* \[0, 1\], got \[-0.1, 2.0\]"),
    ({"seeds": 0}, r"--seeds must be >= 1"),
    ({"new_tokens": 0}, r"--new-tokens must be >= 1")])
def test_check_args_says_what_is_wrong(change, message):
    args = argparse.Namespace(**{"lengths": [1024], "depths": [0.5], "seeds": 1, "new_tokens": 8, **change})
    with pytest.raises(ValueError, match=message):
        check_args(args)


def test_cli_reports_bad_depth_without_loading_a_model(capsys):
    from longreach.cli import main

    assert main(["eval", "passkey", "--depths", "1.5", "--device", "cpu"]) == 2
    assert "--depths must be fractions" in capsys.readouterr().err


def test_cli_end_to_end_on_the_real_model(tmp_path, capsys):
    from longreach.cli import main

    out, png = tmp_path / "passkey.json", tmp_path / "passkey.png"
    rc = main(["eval", "passkey", "--attention", "dense", "streaming", "--attention-config",
               '{"n_sink": 16, "n_window": 128}', "--lengths", "512", "--depths", "0.5", "--new-tokens", "6",
               "--device", "cpu", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    captured = capsys.readouterr()
    assert json.loads(captured.out) == report
    assert report["lengths"] == [512] and report["depths"] == [0.5] and report["dtype"] == "float32"
    assert {"model", "device", "date", "args"} <= set(report)
    prov = report["provenance"]  # tools/report.py: the command, the presets that ran, prompts per cell
    assert prov["command"].startswith("longreach eval passkey --attention dense streaming") and prov["device"] == "cpu"
    assert [(a["label"], a["preset"]) for a in prov["attention"]] == [("dense", None), ("streaming", "3k")]
    assert prov["attention"][1]["config"]["n_window"] == 128 and prov["samples"]["n"] == 1
    assert set(report["methods"]) == {"dense", "streaming"}
    for m in report["methods"].values():
        (cell,) = m["cells"]
        assert set(m["accuracy"]) == {"512"} and m["overall"] == m["accuracy"]["512"] == cell["correct"]
        assert cell["length"] == 512 and cell["seconds"] > 0 and m["prefill_seconds"]["512"] > 0
    dense, streaming = report["methods"]["dense"]["cells"][0], report["methods"]["streaming"]["cells"][0]
    assert dense["correct"] and dense["key"] in dense["output"]
    assert streaming["key"] == dense["key"]  # the same prompt
    assert png.stat().st_size > 0
    assert re.search(r"passkey accuracy \(%\) \[95% CI\] +512 +all\ndense +100 \[ 21-100\] +100\nstreaming +0 "
                     r"\[  0- 79\] +0\nprompts per cell: 1", captured.err)


@pytest.mark.parametrize("haystack", ["paul-graham", "squad"])
def test_natural_haystacks_and_needle_phrasings(tok, haystack):
    from longreach.tools.eval.passkey import NEEDLES

    phrasings = ("classic", "secret", "code")
    for seed in range(3):
        ids, key = passkey_prompt(tok, 3000, 0.4, seed, haystack, phrasings)
        assert len(ids) == 3000
        text = tok.decode(ids)
        needle, question = NEEDLES[phrasings[seed]]
        assert " " + needle.format(key=key) in text and text.endswith(" " + question)
        assert "The grass is green." not in text  # natural text, not the filler
        at = text.index(needle.format(key=key))
        assert 0.3 < (at - len(INTRO)) / (len(text) - len(INTRO)) < 0.5
    with pytest.raises(ValueError, match="unknown needle phrasing"):
        passkey_prompt(tok, 3000, 0.4, 0, haystack, ("nope",))
    with pytest.raises(ValueError, match="unknown haystack 'novel'"):
        passkey_prompt(tok, 3000, 0.4, 0, "novel")


def test_summary_sums_metered_decode_reads_per_length_once_per_batch():
    """Each cell holds its batch's decode-read totals; a length's summary counts each batch once."""
    from longreach.tools.eval.passkey import summarize, table

    batch = {"keys": 600.0, "queries": 4.0, "context_keys": 2000.0}
    cells = [{"length": 1000, "correct": c, "prefill_seconds": 1.0, "decode_reads_batch": batch, "batch_size": 2}
             for c in (True, False)]
    cells.append({"length": 2000, "correct": True, "prefill_seconds": 2.0,
                  "decode_reads_batch": {"keys": 500.0, "queries": 2.0, "context_keys": 4000.0}, "batch_size": 1})
    m = summarize(cells, [1000, 2000])
    assert m["decode_reads"] == {"1000": {"keys_per_query": 150.0, "share": 0.3, "queries": 4},
                                 "2000": {"keys_per_query": 250.0, "share": 0.125, "queries": 2}}
    report = {"lengths": [1000, 2000], "methods": {"psa": m}}
    assert re.search(r"psa keys read per decode query +150 +250", table(report))
    assert "decode_reads" not in summarize([{"length": 1000, "correct": True, "prefill_seconds": 1.0}], [1000])
