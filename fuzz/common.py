"""What every harness checks of one input: the loader returns, or refuses it with one EllmError line."""

from __future__ import annotations

import sys
from typing import Callable

import atheris

from ellm.errors import EllmError


def one_line(load: Callable[[], object]) -> None:
    try:
        load()
    except EllmError as e:
        if "\n" in str(e) or not str(e):
            raise AssertionError(f"a refusal that is not one line: {e!r}") from None


def fuzz(one: Callable[[bytes], None]) -> None:
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
