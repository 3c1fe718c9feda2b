"""The step benchmarks' output: a markdown table printed and, with ``--out``, saved with its rows."""

from __future__ import annotations

import json
import os
from typing import Optional


def save_step_table(out: Optional[str], name: str, what: str, rows: list[dict], lines: list[str],
                    rounds: Optional[int] = None) -> None:
    """Print ``lines`` (the table); under ``out``: ``<name>.json`` (``what``, the number of timing
    ``rounds`` whose medians the rows give, and the rows) and ``<name>.md`` (the table)."""
    print("\n".join(lines))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(dict(what=what, rounds=rounds, rows=rows), f, indent=1)
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
