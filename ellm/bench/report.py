"""How the bench/ scripts hand back a report: JSON on stdout, and written atomically to --out if given."""

from __future__ import annotations

import json

from ..fsutil import atomic_write_text


def emit_report(report: dict, out: str | None) -> int:
    text = json.dumps(report, indent=1)
    if out:
        atomic_write_text(out, text + "\n")
    print(text)
    return 0
