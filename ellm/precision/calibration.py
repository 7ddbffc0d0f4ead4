"""Calibration text: what the sensitivity analysis runs the model on.

The default is Python's own language reference as `pydoc` ships it (`pydoc_data/topics.py`, about 465,000
characters of English technical prose with code): every Python install has it, and no evaluation here uses it
(`ellm eval` reads Newton's Opticks; the tests read the Apache License).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import EllmError


def default_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


@dataclass(frozen=True)
class Calibration:
    name: str  # "python-reference" or the file's name
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @classmethod
    def load(cls, path: str | Path | None = None) -> Calibration:
        if path is None:
            return cls("python-reference", default_text())
        p = Path(path)
        try:
            text = p.read_bytes().decode("utf-8")
        except OSError as e:
            raise EllmError(f"cannot read calibration text {p}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise EllmError(f"calibration text {p} is not UTF-8") from None
        return cls(p.name, text)

    def tokens(self, tokenizer, n: int) -> list[int]:
        """The first `n` tokens of the text; an error if it has fewer."""
        # tokenise a prefix a little longer than needed (about 3-4 characters per token in English)
        chars = min(len(self.text), 6 * n + 1000)
        ids = tokenizer.encode(self.text[:chars])
        if len(ids) < n and chars < len(self.text):
            ids = tokenizer.encode(self.text)
        if len(ids) < n:
            raise EllmError(f"calibration text {self.name} has {len(ids)} tokens; the analysis needs {n}")
        return ids[:n]
