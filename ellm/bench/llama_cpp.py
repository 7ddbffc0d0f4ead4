"""The comparison peer: llama.cpp through llama-cpp-python, one build per ISA class, installed on demand into
eLLM's cache (each builds llama.cpp from source: about 5 minutes). Never required by eLLM itself.

A build is compared against eLLM code of the same ISA class: `native` (GGML_NATIVE: everything this CPU has,
AVX-512 and AMX included) or `avx512` (AVX-512 VNNI, no AMX) against eLLM's native target, `avx2`
(AVX2/FMA/F16C, AVX-512 off) against eLLM's x86-64-v3 target.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import EllmError

VERSION = "0.3.36"  # llama-cpp-python (vendors llama.cpp); the README's numbers were measured with it


@dataclass(frozen=True)
class LlamaBuild:
    name: str
    cmake_args: str
    description: str


BUILDS: dict[str, LlamaBuild] = {
    b.name: b
    for b in (
        LlamaBuild("native", "-DGGML_NATIVE=ON", "llama.cpp built for this CPU (GGML_NATIVE)"),
        # AVX-512 VNNI without AMX: where the native build's AMX path does not run (on the Emerald Rapids VM of the
        # README its ggml_backend_amx_mul_mat stops with SIGILL at the first tileloadd). Without AVX-VNNI (the
        # 256-bit VEX form): AMD's Zen 4 has AVX-512 VNNI but not AVX-VNNI, and a build with it stops with SIGILL
        LlamaBuild("avx512", "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                   "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON",
                   "llama.cpp built for AVX-512 VNNI (AMX off)"),
        LlamaBuild("avx2", "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF",
                   "llama.cpp built for AVX2 (AVX-512 off)"),
    )
}


def get_build(name: str) -> LlamaBuild:
    try:
        return BUILDS[name]
    except KeyError:
        raise EllmError(f"unknown llama.cpp build {name!r} (known: {', '.join(BUILDS)})") from None


def build_dir(build: LlamaBuild) -> Path:
    from ..demo import cache_root

    return cache_root() / "llama-cpp" / f"{build.name}-{VERSION}"


def ensure_build(build: LlamaBuild, log: Callable[[str], None] = lambda s: None) -> Path:
    """The directory holding this build's `llama_cpp` package, built first if it is not there."""
    out = build_dir(build)
    if (out / "llama_cpp" / "__init__.py").is_file():
        return out
    log(f"building {build.description}: llama-cpp-python {VERSION} from source into {out} (about 5 minutes) ...")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    env = {**os.environ, "CMAKE_ARGS": build.cmake_args}
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-cache-dir", "--target", str(tmp)]
    try:
        # its dependencies but diskcache (numpy, jinja2, typing-extensions) are eLLM's own
        for what in (f"llama-cpp-python=={VERSION}", "diskcache"):
            proc = subprocess.run([*pip, what], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                raise EllmError(f"could not install {what} ({build.name}): {last}")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def isa_of(system_info: str) -> str:
    """The ISA path a llama.cpp library uses, from llama_print_system_info(): AMX, AVX-512 VNNI, AVX-VNNI or AVX2."""
    have = {m.group(1) for m in re.finditer(r"(\w+) = 1", system_info)}
    if "AMX_INT8" in have:
        return "AMX"
    if "AVX512_VNNI" in have:
        return "AVX-512 VNNI"
    if "AVX512" in have:
        return "AVX-512"
    if "AVX_VNNI" in have:
        return "AVX-VNNI"
    if "AVX2" in have:
        return "AVX2"
    return "scalar/SSE"
