"""The README's quick start and CI must not drift apart."""
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    return re.findall(r"```bash\n(pip install [^\n]+)\n```", (ROOT / "README.md").read_text())


def test_readme_has_the_two_quick_start_commands():
    cmds = _readme_commands()
    assert len(cmds) >= 2
    assert "longreach demo" in cmds[0] and "pytest" in cmds[1]


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci_lines[-1] == _readme_commands()[1]


def test_rendered_tables_match_their_json():
    """Every `<!-- render: ... -->` block in docs/*.md and README.md equals what scripts/render_docs.py makes from its
    results JSON now (a hand edit inside a block, or a report changed without re-rendering, fails here)."""
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "render_docs.py"
    run = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_render_check_fails_on_a_hand_edit(tmp_path, monkeypatch):
    """The check can fail: a block whose numbers were edited by hand differs from its render."""
    import importlib.util

    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "render_docs.py"
    spec = importlib.util.spec_from_file_location("render_docs", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = (mod.ROOT / "docs" / "quality.md").read_text()
    assert "<!-- render: ladder" in text and mod.rendered(text) == text
    edited = text.replace("| dense | 100 [84-100] | 100 [84-100] |", "| dense | 100 [84-100] | 99 [84-100] |", 1)
    assert edited != text and mod.rendered(edited) != edited


def _scripts():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import render_docs

    return render_docs


def test_ppl_render_shows_skipped_lengths_and_the_tails_change(tmp_path):
    render_docs = _scripts()
    report = {"lengths": [32768, 1 << 20], "tail": 1024, "text": "t", "windows": {"ends": [1 << 20]},
              "methods": {"dense": {"32768": {"ppl_tail": 10.0, "ppl_all": 11.0}, "1048576": None},
                          "m": {"32768": {"ppl_tail": 10.0, "ppl_all": 11.0},
                                "1048576": {"ppl_tail": 12.5, "ppl_all": 13.0}}},
              "provenance": {"commit": "abc", "device": "G", "date": "2026-11-26T10:00:00"}}
    out = render_docs.render_eval.ppl_table(report)
    assert "| method | 32K | 1M |" in out
    assert "| dense, tail PPL | 10.00 | - |" in out and "dense, tail change" not in out  # one length: no change row
    assert "| m, tail change | +0.0% | +25.0% |" in out and "| m, whole-window PPL | 11.00 | 13.00 |" in out
    path = tmp_path / "ppl.json"
    path.write_text(json.dumps(report))
    assert "G, 2026-11-26, commit abc" in render_docs.render("ppl", str(path))  # the source line names the run


def test_bench_decode_render_marks_extrapolated_values_and_counted_steps(tmp_path):
    """A dense value that was not measured carries `*` and the line it was extended along; the steps a rate counts
    are in the table."""
    render_docs = _scripts()
    mem = {"weights_bytes": 1, "kv_gpu_bytes": 1 << 30, "kv_staging_bytes": 0, "kv_host_bytes": 0}
    row = {"context": 1 << 20, "attention": "infinitehip", "kv_cache_dtype": "bfloat16", "offload": False,
           "prefill_s": 10.0, "decode_tok_s": 50.0, "decode_steps": 127, "steps_counted": 123, "step_s_median": 0.02,
           "memory": mem, "dense_tok_s": 20.0, "dense_source": "extrapolated", "ratio_to_dense": 2.5}
    dense = {**row, "context": 4096, "attention": "dense", "status": "measured", "dense_source": None,
             "ratio_to_dense": None, "steps_counted": 127}
    fit = {"formula": "t(L) = ...", "L0": 131072, "t_L0_s": 0.013, "L1": 4096, "t_L1_s": 0.007,
           "slope_s_per_token": 5e-8}
    path = tmp_path / "bd.json"
    path.write_text(json.dumps({"runs": [row], "dense": [dense], "dense_extrapolation": fit, "settings": {"batch": 1},
                                "command": "longreach bench decode --lengths 1M"}))
    out = render_docs.render("bench-decode", f"{path} extrapolate=512K")
    assert "| 1M | infinitehip | bfloat16 | 10.0 | 50.0 | 123/127 | 20.00 | 2.50x* |" in out
    assert "| 512K | dense, extrapolated* |" in out and "extrapolated, not measured: t(L) = ..." in out
    assert "`longreach bench decode --lengths 1M`" in out


def test_bench_decode_render_shows_batch_and_tp_and_flags_a_preempted_rate(tmp_path):
    render_docs = _scripts()
    mem = {"weights_bytes": 1, "kv_gpu_bytes": 1 << 30, "kv_staging_bytes": 0, "kv_host_bytes": 0}
    row = {"context": 131072, "attention": "infinitehip", "kv_cache_dtype": "fp8", "offload": False,
           "prefill_s": 10.0, "decode_tok_s": 123.5, "decode_steps": 77, "steps_counted": 73, "step_s_median": 0.04,
           "memory": mem, "preemptions": 1}
    path = tmp_path / "bd.json"
    path.write_text(json.dumps({"runs": [row], "dense": [], "settings": {"batch": 16, "engine": {
        "tensor_parallel_size": 2}}, "command": "longreach bench decode --batch 16"}))
    out = render_docs.render("bench-decode", str(path))
    assert "| context | method | batch | TP | KV |" in out
    assert "| 128K | infinitehip | 16 | 2 | fp8 | 10.0 | 123.5† | 73/77 |" in out
    assert "† a sequence was preempted" in out
    row["preemptions"] = 0
    path.write_text(json.dumps({"runs": [row], "dense": [], "settings": {"batch": 1}, "command": "c"}))
    out = render_docs.render("bench-decode", str(path))
    assert "| context | method | KV |" in out and "†" not in out  # batch 1, TP 1: no columns, no mark


def test_ladder_render_flags_rows_that_ran_something_else_than_their_label():
    """A ladder row whose JSON ran another preset, overrides or RoPE scaling than its file label names is marked †,
    with what ran listed under the tables (oracle-true ran as `infinitehip:oracle` at an older commit)."""
    render_docs = _scripts()
    assert "infinitehip:3k-box" in render_docs._named_by("infinitehip-3k-box")
    assert "infinitehip" in render_docs._named_by("infinitehip")  # its default, named or not
    assert "infinitehip:oracle" not in render_docs._named_by("oracle-true")
    out = render_docs.render("ladder", "docs/results/ladder")
    assert "| oracle-true † |" in out and "oracle-true: `infinitehip:oracle`" in out
    assert "| oracle |" in out and "| hip |" in out  # rows that ran what they say are not marked


def test_every_renderer_is_listed_and_an_unknown_one_names_them():
    import pytest

    render_docs = _scripts()
    assert {"ladder", "passkey", "ruler", "ppl", "bench-decode", "bench-attention", "bench-engine", "bench-long",
            "bench-serve"} <= set(render_docs.RENDERERS)
    with pytest.raises(ValueError, match="known: .*bench-decode"):
        render_docs.render("nope", "x")
