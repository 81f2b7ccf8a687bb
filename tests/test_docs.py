"""The README's quick start and CI must not drift apart."""
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


def test_ppl_render_shows_skipped_lengths_and_the_tails_change():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import render_docs

    report = {"lengths": [32768, 1 << 20], "tail": 1024, "text": "t", "windows": {"ends": [1 << 20]},
              "methods": {"dense": {"32768": {"ppl_tail": 10.0, "ppl_all": 11.0}, "1048576": None},
                          "m": {"32768": {"ppl_tail": 10.0, "ppl_all": 11.0},
                                "1048576": {"ppl_tail": 12.5, "ppl_all": 13.0}}},
              "provenance": {"commit": "abc", "gpu": "G"}}
    out = render_docs.ppl_table(report)
    assert "| method | 32K | 1M |" in out
    assert "| dense, tail PPL | 10.00 | - |" in out and "dense, tail change" not in out  # one length: no change row
    assert "| m, tail change | +0.0% | +25.0% |" in out and "| m, whole-window PPL | 11.00 | 13.00 |" in out
    assert "commit abc" in out
