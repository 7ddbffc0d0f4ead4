"""The speculation benchmark's task set, built from texts every install has: the Apache License (in
apache-tvm), Newton's Opticks (in apache-tvm-ffi) and Python's own standard library source.

Input-grounded tasks ask for output the prompt already contains (quotes, a summary, an edit of given
code or text); open-ended tasks do not. Each is built at a requested prompt length: filler text (the
document's own kind) before the material and the request, so the prompt holds that many tokens."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..eval.texts import opticks


def license_text() -> str:
    import tvm

    return (Path(tvm.__file__).parent / "LICENSE").read_text()


def stdlib_code() -> str:
    return Path(textwrap.__file__).read_text()


def _section(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i : text.index(end, i)].strip()


def _quote_material() -> str:
    return _section(license_text(), "4. Redistribution.", "5. Submission of Contributions.")


def _code_material() -> str:
    return _section(stdlib_code(), "def wrap(", "# -- Loosely related functionality")


def _opticks_passage() -> str:
    text = opticks().read_text()
    i = text.index("The Light whose Rays are all alike Refrangible")
    return text[i : i + 1500].rsplit(".", 1)[0] + "."


@dataclass(frozen=True)
class SpecTask:
    name: str
    grounded: bool
    filler: Callable[[], str]  # text repeated before the material to reach the prompt length
    material: Callable[[], str]  # what the request is about, right before it ("" for none)
    request: str

    def prompt(self, tokenizer, n_tokens: int) -> list[int]:
        """Chat-templated ids of about `n_tokens` (the filler is cut to fit; at least the material and request)."""
        tail = (self.material() + "\n\n" if self.material else "") + self.request
        fixed = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": tail}])))
        fill = tokenizer.encode(self.filler())
        while len(fill) < n_tokens:
            fill = fill + fill
        room = max(0, n_tokens - fixed - 2)
        head = tokenizer.decode(fill[:room]) + "\n\n" if room else ""
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": head + tail}]))


TASKS: tuple[SpecTask, ...] = (
    SpecTask("quote", True, lambda: opticks().read_text()[200_000:260_000], _quote_material,
             "Quote section 4 of the license above, Redistribution, word for word, items (a) to (d) included."),
    SpecTask("summarise", True, license_text, lambda: "",
             "Summarise the document above, section by section, using its own wording where you can."),
    SpecTask("edit_code", True, stdlib_code, _code_material,
             "Rewrite the Python functions above with their docstrings removed. Output the complete code of every "
             "function, unchanged otherwise."),
    SpecTask("edit_text", True, lambda: opticks().read_text()[100_000:160_000], _opticks_passage,
             "Rewrite the passage above in modern spelling, sentence by sentence, changing nothing else."),
    SpecTask("story", False, lambda: opticks().read_text()[300_000:360_000], lambda: "",
             "Leave the text above aside. Write a short story about a lighthouse keeper who finds a message in a bottle."),
    SpecTask("advice", False, license_text, lambda: "",
             "Unrelated to the text above: what are five good habits for a healthy life? Explain each in two sentences."),
)


def task(name: str) -> SpecTask:
    for t in TASKS:
        if t.name == name:
            return t
    raise KeyError(name)
