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
