"""Coverage-guided fuzzing (atheris) of the GGUF loader: header, metadata, tensor table, model config, tokenizer
and graph import. Any exception but a one-line EllmError is a crash.

    python fuzz/fuzz_gguf.py fuzz/corpus/gguf -max_len=65536 -runs=1000000
"""

from __future__ import annotations

import os
import tempfile

import atheris
from common import fuzz, one_line

with atheris.instrument_imports(include=["ellm"]):
    from ellm.compiler.source_model import open_model

PATH = os.path.join(tempfile.mkdtemp(prefix="ellm-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None),
                    "case.gguf")


def load() -> None:
    tok = open_model(PATH).tokenizer
    if tok.info.chat_template:
        tok.encode_chat([{"role": "user", "content": "hi <|im_end|>"}])


def one(data: bytes) -> None:
    with open(PATH, "wb") as f:
        f.write(data)
    one_line(load)


if __name__ == "__main__":
    fuzz(one)
