"""The evaluation tools on the real default model (short contexts, small method configs so that selection prunes)."""
import json

import pytest

from longreach.tools.eval.common import parse_methods
from longreach.tools.eval.data import paul_graham_text


@pytest.fixture(scope="module")
def text():
    return paul_graham_text()


def test_recall_tool_reports_per_layer_and_mean(text):
    from longreach.tools.eval.recall import run

    configs = json.dumps({"infinitehip:3k": {"n_sink": 16, "n_window": 64, "budgets": [256, 128, 64],
                                          "early_last_budget": None},
                          "streaming": {"n_sink": 16, "n_window": 64}})
    methods = parse_methods(["infinitehip:3k", "infinitehip:5k", "streaming:3k", "dense"])
    report = run("smollm2", text, 1024, methods, configs, 64, "cpu", "float32")
    json.dumps(report)
    ms = report["methods"]
    assert set(ms) == {"infinitehip:3k", "infinitehip:5k", "streaming:3k", "dense"}
    assert all(len(m["per_layer"]) == 30 for m in ms.values())
    assert ms["dense"]["mean"]["mass_recall"] == pytest.approx(1.0, abs=1e-5)
    # the 5k preset without overrides holds every key of a 1024-token context: its selection is dense
    assert ms["infinitehip:5k"]["mean"]["mass_recall"] == pytest.approx(1.0, abs=1e-5)
    ih, st = ms["infinitehip:3k"]["mean"], ms["streaming:3k"]["mean"]
    assert 16 + 64 < ih["keys_per_query"] <= 16 + 64 + 64  # selected keys inside a row's window are read once
    assert st["keys_per_query"] == pytest.approx(16 + 64, abs=1)
    assert ih["mass_recall"] > st["mass_recall"] + 0.02  # selection beats sink + window at a little more budget
    assert ih["mass_recall"] < 1.0


def test_agreement_tool(text):
    from longreach.tools.eval.agreement import run

    report = run("smollm2", text, 400, 8, parse_methods(["streaming:3k"]),
                 '{"n_sink": 8, "n_window": 32, "dense_below": 0}', "cpu", "float32")
    rows = report["methods"]
    assert set(rows) == {"dense", "streaming:3k"}
    assert 0 <= rows["streaming:3k"]["tokens_equal"] <= 8 and rows["dense"]["text"]


def test_wilson_interval_known_values():
    from longreach.tools.eval.common import wilson

    lo, hi = wilson(0, 1)
    assert lo == 0.0 and abs(hi - 0.7935) < 1e-3
    lo, hi = wilson(10, 10)
    assert abs(lo - 0.7225) < 1e-3 and hi == 1.0
    lo, hi = wilson(6, 10)
    assert abs(lo - 0.3127) < 1e-3 and abs(hi - 0.8318) < 1e-3
    assert wilson(0, 0) == (0.0, 1.0)


def test_reports_carry_their_provenance(tmp_path, monkeypatch, capsys):
    """Every eval report names the code and device it came from: the git commit here (with +dirty when the tree has
    uncommitted changes), or $LONGREACH_COMMIT on a machine without the repository (tools/report.py)."""
    import json
    import subprocess

    from longreach.tools.eval.common import emit

    out = tmp_path / "r.json"
    emit({"methods": {}}, str(out))
    got = json.loads(out.read_text())["provenance"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert got["commit"].split("+")[0] == head and got["longreach"] and got["date"] and got["command"]
    monkeypatch.setenv("LONGREACH_COMMIT", "abc1234+dirty")
    emit({"methods": {}}, str(out))
    assert json.loads(out.read_text())["provenance"]["commit"] == "abc1234+dirty"
    capsys.readouterr()


def test_provenance_record_names_command_device_presets_and_samples(monkeypatch):
    """tools/report.py: one record for every JSON the lab writes. A method given without a preset is recorded with
    the preset that ran (its default), with its overrides and resolved config; a command's own fields may not
    replace the common ones."""
    import argparse

    from longreach.tools.eval.common import attention_records
    from longreach.tools.report import command_line, default_preset, provenance, samples

    monkeypatch.setenv("LONGREACH_COMMIT", "feed123")
    args = argparse.Namespace(argv=["eval", "passkey", "--lengths", "8k", "--attention-config", '{"n_sink": 64}'])
    assert command_line(args) == "longreach eval passkey --lengths 8k --attention-config '{\"n_sink\": 64}'"
    specs = parse_methods(["dense", "infinitehip", "streaming:5k"], attention_config={"n_sink": 64})
    rec = provenance(command_line(args), "cpu", attention=attention_records(specs, {"n_sink": 64}),
                     attention_config={"n_sink": 64}, samples=samples(20, "method x length", "prompts"))
    assert rec["commit"] == "feed123" and rec["device"] == "cpu" and rec["command"].startswith("longreach eval")
    assert rec["samples"] == {"n": 20, "per": "method x length", "unit": "prompts"}
    dense, ih, st = rec["attention"]
    assert dense["preset"] is None and dense["attention_config"] is None
    assert ih["label"] == "infinitehip" and ih["preset"] == default_preset("infinitehip") == "3k-box"
    assert ih["attention_config"] == {"n_sink": 64} and ih["config"]["n_sink"] == 64
    assert st["preset"] == "5k" and st["config"]["n_sink"] == 64
    assert json.loads(json.dumps(rec)) == rec  # plain JSON
    composed = attention_records(parse_methods(["infinitehip+psa:0.9"]), None)[0]
    assert composed["decode"]["method"] == "psa" and composed["decode"]["preset"] == "0.9"
    # a config that follows the model: MInference run by an alias records the alias's shipped patterns, as its
    # engine loads them (a path model: none; given patterns: those)
    mi = parse_methods(["minference"])
    assert attention_records(mi, None, "smollm2")[0]["config"]["patterns"].endswith("patterns/smollm2.json")
    assert attention_records(mi, None, "/tmp/m.gguf")[0]["config"]["patterns"] is None
    given = attention_records(mi, {"patterns": "qwen2.5-coder-0.5b"}, "smollm2")[0]["config"]["patterns"]
    assert given.endswith("patterns/qwen2.5-coder-0.5b.json")
    with pytest.raises(ValueError, match="common fields"):
        provenance("x", "cpu", commit="mine")
