"""`ellm demo`: compile the bundled model once (cached), then answer a question about a long real document."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from . import __version__
from .errors import ArtifactError, EllmError
from .models import default_model_path
from .fsutil import sha256_file

QUESTION = "Is the software provided with a warranty?"


def cache_root() -> Path:
    return Path(os.environ.get("ELLM_CACHE", Path.home() / ".cache" / "ellm")).expanduser()


def demo_document() -> Path:
    """The Apache License 2.0 text shipped inside the installed apache-tvm package (every install has it)."""
    import tvm

    path = Path(tvm.__file__).parent / "LICENSE"
    if not path.is_file():
        raise EllmError(f"demo document not found: {path}")
    return path


def demo_artifact_dir(model_sha256: str, target: str) -> Path:
    """Where the demo keeps the default model compiled for `target` (a preset name)."""
    return cache_root() / f"smollm2-135m-q4_1-{model_sha256[:12]}-{target}-ellm{__version__}"


def cached_artifact(target: str = "auto", log=print) -> Path:
    """Compile the default model into the cache unless a verified artifact for it is already there."""
    from .compiler.build import CompileOptions, compile_model
    from .runtime.artifact import Artifact
    from .targets import resolve_target

    model = default_model_path()
    digest = sha256_file(model)
    preset = resolve_target(target)
    out = demo_artifact_dir(digest, preset.name)
    try:
        art = Artifact.open(out)
        if art.manifest["source"]["sha256"] == digest:
            log(f"using cached artifact {out}")
            return out
    except ArtifactError:
        pass
    log(f"compiling {model.name} for {preset.name} into {out} (once) ...")
    report = compile_model(model, out, CompileOptions(target=preset.name), force=True, log=log)
    log(f"compiled in {report.seconds:.1f} s: {report.artifact_bytes / 1e6:.1f} MB, {report.kernels} kernels")
    return out


def artifact_for(path: str | Path, cache: Path, option: str, kind: str = "models") -> Path:
    """The artifact directory for `path`: itself, or for a GGUF file the artifact compiled from it (with the
    default options, for this host) under `cache`/`kind`, compiled on first use. `option` names the command-line
    option in messages."""
    p = Path(path)
    if p.is_dir():
        return p
    if not p.is_file():
        raise EllmError(f"{option} {path}: no such artifact directory or GGUF file")
    from .compiler.build import CompileOptions, compile_model
    from .compiler.gguf_file import GGUFFile
    from .targets import resolve_target

    digest = GGUFFile(p).sha256()[:16]
    out = cache / kind / f"{digest}-{__version__}-{resolve_target('auto').name}"
    if not (out / "manifest.json").is_file():
        print(f"compiling {p.name} into {out} (once)", file=sys.stderr)
        compile_model(p, out, CompileOptions(target="auto"), force=out.exists(), log=lambda s: print(s, file=sys.stderr))
    return out


def run_demo(threads: int | None = None, n_predict: int = 96, target: str = "auto") -> int:
    from .runtime.engine import Engine

    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    art = cached_artifact(target, log)
    eng = Engine.load(art, threads=threads)
    doc_path = demo_document()
    doc = doc_path.read_text()
    # The question before and after the document: small models attend most to the end of the prompt.
    content = (
        f"Read the document below, then answer this question: {QUESTION}\n\n---\n{doc}\n---\n\n"
        f"Question: {QUESTION}\nAnswer in one sentence."
    )
    prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    ids = eng.tokenizer.encode(prompt)
    print(f"document: {doc_path} ({len(doc):,d} characters)")
    print(f"question: {QUESTION}")
    print(f"prompt:   {len(ids):,d} tokens, {eng.threads} threads, context {eng.ctx_size}\n")
    printed = ""
    out: list[int] = []

    def on_token(t: int) -> None:
        nonlocal printed
        if not out:
            print("answer:   ", end="", flush=True)
        out.append(t)
        text = eng.tokenizer.decode([x for x in out if not eng.tokenizer.is_eog(x)])
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text

    from .cli import prefill_progress

    eng.generate(ids, n_predict, on_token=on_token, progress=prefill_progress())
    st = eng.stats
    print("\n")
    print(f"prefill:  {st.prompt_tokens:,d} tokens in {st.prefill_s:.2f} s = {st.prefill_tok_s:.1f} tokens/s")
    print(f"first token after {st.ttft_s:.2f} s")
    print(f"decode:   {st.decode_tokens} tokens at {st.decode_tok_s:.1f} tokens/s (stop: {st.stop_reason})")
    return 0
