"""How independent are a passkey cell's prompts? Over every passkey report in docs/results (or the paths given), in
cells between 20% and 80% right, the share of prompt pairs at one length and depth that agree (both right or both
wrong), against what independent prompts at the cell's accuracy would give (p^2 + (1 - p)^2). docs/quality.md quotes
its output.

    python scripts/passkey_depth_agreement.py [REPORT.json ...]
"""
from __future__ import annotations

import collections
import glob
import json
import sys


def agreement(paths: list[str]) -> tuple[int, float, float]:
    """(pairs, observed agreement, agreement expected of independent prompts)."""
    n = observed = expected = 0
    for path in sorted(set(paths)):
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue
        for method in (report.get("methods") or {}).values():
            cells = method.get("cells") if isinstance(method, dict) else None
            by_length = collections.defaultdict(list)
            for c in cells or []:
                by_length[c["length"]].append(c)
            for cs in by_length.values():
                p = sum(c["correct"] for c in cs) / len(cs)
                if not 0.2 <= p <= 0.8:
                    continue
                pairs = collections.defaultdict(list)  # the two seeds of a phrasing at one depth (seeds 2k, 2k + 1)
                for c in cs:
                    pairs[(c["depth"], c["seed"] // 2)].append(c["correct"])
                for v in pairs.values():
                    if len(v) == 2:
                        n += 1
                        observed += v[0] == v[1]
                        expected += p * p + (1 - p) ** 2
    return n, observed / max(n, 1), expected / max(n, 1)


def main() -> None:
    paths = sys.argv[1:] or glob.glob("docs/results/**/passkey*.json", recursive=True)
    n, obs, exp = agreement(paths)
    print(f"{n} pairs: agree {obs:.3f}, independent prompts would {exp:.3f}")


if __name__ == "__main__":
    main()
