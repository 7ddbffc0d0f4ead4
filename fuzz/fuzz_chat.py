"""Coverage-guided fuzzing (atheris) of the tokenizer and chat-template path: a GGUF's chat template (jinja2,
sandboxed) and a user's messages, rendered and encoded with a real vocabulary, then decoded. Any exception but a
one-line EllmError is a crash.

    python fuzz/fuzz_chat.py fuzz/corpus/chat -max_len=4096 -runs=1000000
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import atheris
from common import fuzz, one_line

with atheris.instrument_imports(include=["ellm", "jinja2"]):  # the template parser guides the search too
    import jinja2.sandbox  # noqa: F401  (imported by the tokenizer when it renders: instrumented here)
    from ellm.compiler.gguf_file import GGUFFile
    from ellm.runtime.tokenizer import Tokenizer

SEED = Path(__file__).parent / "corpus" / "gguf" / "tiny-gpt2.gguf"
BASE = Tokenizer.from_gguf(GGUFFile(SEED))


def one(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    template = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 2048))
    roles = ["system", "user", "assistant", fdp.ConsumeUnicodeNoSurrogates(8)]
    messages = [{"role": roles[fdp.ConsumeIntInRange(0, 3)], "content": fdp.ConsumeUnicodeNoSurrogates(64)}
                for _ in range(fdp.ConsumeIntInRange(0, 3))]
    tok = Tokenizer(BASE._tok, replace(BASE.info, chat_template=template))
    generation = fdp.ConsumeBool()
    one_line(lambda: tok.decode(tok.encode_chat(messages, add_generation_prompt=generation)))


if __name__ == "__main__":
    fuzz(one)
