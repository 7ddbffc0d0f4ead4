"""Coverage-guided fuzzing (atheris) of the artifact manifest loader: the input is manifest.json's bytes in a copy
of a real small artifact, sealed again (as someone without the fleet key could) so the schema, the parameter
table, the config, KV plan, attention and tokenizer parts are all reached. Any exception but a one-line EllmError
is a crash. Kernels are not loaded (the fuzzer would dlopen the same library a million times).

    python fuzz/fuzz_manifest.py fuzz/corpus/manifest -max_len=65536 -runs=1000000
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import atheris
from common import fuzz, one_line

with atheris.instrument_imports(include=["ellm"]):
    from ellm.runtime.artifact import Artifact
    from ellm.runtime.envelope import DIGEST, envelope

GOOD = Path(os.environ.get("ELLM_FUZZ_ARTIFACT", Path(__file__).parent / "artifact"))
CASE = Path(tempfile.mkdtemp(prefix="ellm-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)) / "art"


def load() -> None:
    art = Artifact.open(CASE)
    art.kv_plan, art.attention(), art.tokenizer()
    art.map_params()


def one(data: bytes) -> None:
    (CASE / "manifest.json").write_bytes(data)
    (CASE / DIGEST).write_text(envelope(data))
    one_line(load)


if __name__ == "__main__":
    if not (GOOD / "manifest.json").is_file():
        sys.exit(f"no artifact at {GOOD}: compile one (fuzz/README.md) or set ELLM_FUZZ_ARTIFACT")
    shutil.copytree(GOOD, CASE)
    fuzz(one)
