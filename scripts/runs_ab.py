"""A/B of infinitehip's next stage scored from the stage before's runs (method.py `runs_for_next`, the default since
2026-12-07) against every stage reading its own keys, with any `longreach` command:

    python scripts/runs_ab.py off bench decode ...   # every stage reads its keys (the code before)
    python scripts/runs_ab.py on bench decode ...    # as shipped

The selections are the same either way (tests/test_infinitehip_runs.py); only the time differs. Run both in one call
on one GPU to compare them."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from longreach.attention.infinitehip.method import InfiniteHiP  # noqa: E402
from longreach.cli import main  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("on", "off"):
        raise SystemExit("usage: python scripts/runs_ab.py on|off LONGREACH-ARGS...")
    if sys.argv[1] == "off":
        InfiniteHiP.runs_for_next = lambda self, *args: None
    raise SystemExit(main(sys.argv[2:]))
