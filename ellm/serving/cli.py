"""`ellm serve [DIR|MODEL.gguf]`: load an artifact (or compile a GGUF once into the cache) and serve it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import EllmError
from ..numa.cli import add_numa_args, numa_option


def add_parser(sub) -> None:
    from ..cli import _positive_int, add_attention_args, add_rope_scaling_args
    from ..speculative.cli import add_speculative_args

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API, with a chat page at /")
    s.add_argument("model", nargs="?", help="artifact directory or GGUF file (default: the bundled SmolLM2, compiled once)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=os.environ.get("ELLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /metrics (default: $ELLM_API_KEY, else none)")
    s.add_argument("--model-id", default=None, help="the model's name in the API (default: the artifact's directory name)")
    s.add_argument("--slots", type=_positive_int, default=1,
                   help="KV caches kept: each holds a conversation whose next turn then computes only its new message")
    s.add_argument("--queue", type=_positive_int, default=16, help="requests that may wait (more get 503; default 16)")
    s.add_argument("--max-prompt-tokens", type=_positive_int, default=None, help="longest prompt accepted (default: the context)")
    s.add_argument("--max-tokens", type=_positive_int, default=None,
                   help="the most tokens a request may ask for (default: the context)")
    s.add_argument("--threads", type=_positive_int, default=None, help="threads (default: the physical cores this process may use)")
    s.add_argument("--ctx-size", type=_positive_int, default=None, help="context size per slot (default: the model's)")
    s.add_argument("--target", default=None, help="run this target of the artifact (default: the best this CPU can run)")
    add_rope_scaling_args(s)
    add_attention_args(s)
    add_speculative_args(s)
    add_numa_args(s)
    s.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from ..cli import attention_option, describe_target, rope_scaling_option
    from ..demo import artifact_for, cache_root, cached_artifact
    from ..runtime.engine import Engine
    from ..speculative.cli import speculative_option
    from .app import ServeConfig, create_app

    if a.prompt_cache:
        raise EllmError("--prompt-cache is for `ellm run`; the server keeps conversations in --slots")
    if not 0 < a.port < 65536:
        raise EllmError(f"--port must be between 1 and 65535, got {a.port}")
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    path = artifact_for(a.model, cache_root(), "serve") if a.model else cached_artifact("auto", log)
    spec = speculative_option(a)
    eng = Engine.load(path, threads=a.threads, ctx_size=a.ctx_size, target=a.target,
                      rope_scaling=rope_scaling_option(a), attention=attention_option(a, path), numa=numa_option(a))
    eng.add_slots(a.slots)
    if spec is not None and spec.draft_model:
        eng.draft_engine(spec.draft_model)
    model_id = a.model_id or Path(a.model or path).name
    cfg = ServeConfig(model_id=model_id, api_key=a.api_key, queue=a.queue, max_prompt_tokens=a.max_prompt_tokens,
                      max_tokens=a.max_tokens)
    app = create_app(eng, cfg, speculative=spec, cache_reuse=a.cache_reuse)
    log(f"serving {model_id} on http://{a.host}:{a.port} ({describe_target(eng.artifact)}, {eng.threads} threads, "
        f"{a.slots} slot{'s' if a.slots > 1 else ''} x {eng.ctx_size} tokens, KV "
        f"{eng.n_slots * eng.kv_bytes() / 2**20:.0f} MiB)")
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
