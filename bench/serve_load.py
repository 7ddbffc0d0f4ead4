"""`ellm serve` under load: streaming decode speed against `ellm run` on the same prompt (alternating, one
warm server), and a soak of mixed requests watching the server's resident memory. Emits JSON.

    python bench/serve_load.py ARTIFACT [--rounds 5] [--tokens 256] [--soak 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from ellm.bench.serve import overhead, soak
from ellm.bench.report import emit_report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--soak", type=int, default=200, help="soak requests (0: skip)")
    p.add_argument("--doc-tokens", type=int, default=4000)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    report = {}
    if not a.skip_overhead:
        report["overhead"] = overhead(a.artifact, a.rounds, a.tokens, a.threads)
        print(json.dumps(report["overhead"]), file=sys.stderr)
    if a.soak:
        report["soak"] = asdict(soak(a.artifact, a.soak, doc_tokens=a.doc_tokens, threads=a.threads))
    return emit_report(report, a.out)


if __name__ == "__main__":
    sys.exit(main())
