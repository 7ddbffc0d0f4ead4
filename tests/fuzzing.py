"""What every fuzz case must hold to: the loader returns, or raises one EllmError whose message is one line; never
another exception, and never longer than a few seconds (a hang is an alarm, reported as a failure)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager

from ellm.errors import EllmError

# ELLM_FUZZ=explore: random (not derandomized) cases, ten times as many; `make test` runs the fixed set
EXPLORE = os.environ.get("ELLM_FUZZ") == "explore"
HANG_S = 10


class Hang(Exception):
    pass


@contextmanager
def no_hang(seconds: int = HANG_S):
    def alarm(signum, frame):
        raise Hang(f"a case ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def outcome(load, tally: Counter) -> str | None:
    """Run `load()`; None if it returned, else its one-line refusal. Anything else propagates (a failure)."""
    tally["cases"] += 1
    try:
        with no_hang():
            load()
    except EllmError as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"a refusal of {len(msg.splitlines())} lines: {msg!r}"
        tally["refused"] += 1
        return msg
    tally["loaded"] += 1
    return None


def assert_cli_refuses(args: list[str], expected: str) -> None:
    """The CLI on the same input: exit status 2, one line on stderr (the in-process message), no traceback."""
    p = subprocess.run([sys.executable, "-m", "ellm", *args], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (args, p.returncode, p.stderr)
    assert lines[0] == f"error: {expected}", (lines[0], expected)
