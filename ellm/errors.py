"""User-facing errors: one clear line for a person, exit status 2, never a traceback."""

from __future__ import annotations

EXIT_USER_ERROR = 2


def one_line(message) -> str:
    """A message as shown: verbatim, its whitespace runs (newlines included) made single spaces."""
    return " ".join(str(message).split())


class EllmError(Exception):
    """An error caused by the user's input or environment (bad file, wrong CPU, ...).

    The CLI prints ``error: <message>`` on one line and exits with status 2.
    """

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str):
        super().__init__(one_line(message))


def quoted(value, limit: int = 60) -> str:
    """Someone's value inside a message: its repr, cut to `limit` characters."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class GGUFError(EllmError):
    """The GGUF file is missing, truncated, malformed or uses something unsupported."""


class ArtifactError(EllmError):
    """The compiled artifact is missing, tampered with, or built for another CPU."""


class ContextOverflowError(EllmError):
    """A prompt (plus requested generation) does not fit in the context window."""
