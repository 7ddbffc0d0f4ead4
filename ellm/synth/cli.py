"""`ellm synth --shape llama-1b|llama-3b|llama-8b --type-mix q4_k_m -o FILE`."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    from .shapes import SHAPES
    from .type_mix import TYPE_MIXES

    s = sub.add_parser("synth", help="write a llama GGUF of a real shape with random weights (for speed measurements)")
    s.add_argument("--shape", required=True, choices=list(SHAPES), help="model shape (Llama 3 family)")
    s.add_argument("--type-mix", default="q4_k_m", choices=list(TYPE_MIXES),
                   help="tensor types as llama.cpp's quantizer assigns them (default q4_k_m: Q4_K, Q6_K for the head "
                        "and for attn_v/ffn_down in some layers)")
    s.add_argument("-o", "--output", required=True, help="GGUF file to write")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--ctx", type=int, default=None, help="context_length to record (default 8192)")
    s.add_argument("--force", action="store_true", help="replace an existing file")
    s.set_defaults(func=cmd_synth)


def cmd_synth(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from ..errors import EllmError
    from .shapes import get_shape
    from .type_mix import get_type_mix
    from .writer import tensor_plan, write_synthetic

    shape, mix = get_shape(a.shape), get_type_mix(a.type_mix)
    if a.ctx is not None:
        if a.ctx < 1:
            raise EllmError(f"--ctx must be at least 1, got {a.ctx}")
        shape = replace(shape, ctx=a.ctx)
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    counts: dict[str, int] = {}
    for t in tensor_plan(shape, mix):
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    log(f"{shape.name} ({shape.n_params / 1e9:.2f} B parameters), {mix.name}: "
        + ", ".join(f"{n} x {k}" for k, n in sorted(counts.items())))
    path = write_synthetic(a.output, shape, mix, seed=a.seed, force=a.force, log=log)
    log(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)")
    return 0
