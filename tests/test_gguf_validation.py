"""The GGUF loader's validation (compiler/gguf_file.py, gguf_table.py): metadata of the wrong type is refused
with its key's name, sizes are positive before anything divides by them, and the tensor table is checked for
exact sizes, alignment, bounds and overlap. Each case once reached Python's own errors (ZeroDivisionError,
ValueError in int(), a wrapped size), shown as an internal error."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from gguf_mutate import ARR, DROP, F32, I32, STR, U32, patch_tensor, rewrite
from synthetic import write_model

from ellm.compiler.gguf_file import GGUFFile
from ellm.config import ModelConfig
from ellm.errors import GGUFError
from ellm.runtime.tokenizer import build_from_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gguf") / "good.gguf", n_layers=1, d=64, ff=128, heads=2, kv_heads=1,
                       vocab=320)


def _load(path):
    gf = GGUFFile(path)
    ModelConfig.from_gguf(gf)
    build_from_gguf(gf)


def test_the_good_file_loads(good):
    _load(good)


METADATA = [
    ({"llama.attention.head_count": ("four", STR)}, "llama.attention.head_count should be an integer, is a string"),
    ({"llama.block_count": ([1, 2], ARR, U32)}, "llama.block_count should be an integer, is an array of ints"),
    ({"llama.attention.head_count": (0, U32)}, "llama.attention.head_count is 0, must be at least 1"),
    ({"llama.embedding_length": (0, U32)}, "llama.embedding_length is 0, must be at least 1"),
    ({"llama.attention.layer_norm_rms_epsilon": ("tiny", STR)}, "layer_norm_rms_epsilon should be a number"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), F32)}, "must be a finite positive number"),
    ({"llama.rope.freq_base": (-1.0, F32)}, "llama.rope.freq_base is -1.0, must be a finite positive number"),
    ({"llama.context_length": DROP}, "required metadata key llama.context_length is missing"),
    ({"general.architecture": (7, U32)}, "general.architecture should be a string, is an integer"),
    ({"tokenizer.ggml.tokens": ([1, 2, 3], ARR, I32)}, "tokenizer.ggml.tokens should be an array of strings"),
    ({"tokenizer.ggml.eos_token_id": (10_000, U32)}, "eos_token_id 10000 is past the 320 tokens"),
    ({"tokenizer.ggml.token_type": ([1, 1], ARR, I32)}, "2 token types for 320 tokens"),
    ({"tokenizer.ggml.add_bos_token": ("yes", STR)}, "add_bos_token should be a boolean, is a string"),
    # found by the fuzzer: the tokenizers library's own refusals (a bare Exception, a TypeError)
    ({"tokenizer.ggml.merges": (["zq xv"], ARR, STR)}, "its tokenizer cannot be built from the vocabulary"),
    ({"tokenizer.ggml.merges": (["th", "e r"], ARR, STR)}, "tokenizer.ggml.merges[0] 'th' is not two tokens joined"),
]


@pytest.mark.parametrize("changes,message", METADATA, ids=[m for _, m in METADATA])
def test_bad_metadata_is_one_line_naming_the_key(good, tmp_path, changes, message):
    bad = rewrite(good, tmp_path / "bad.gguf", changes)
    with pytest.raises(GGUFError, match=re.escape(message)) as e:
        _load(bad)
    assert "\n" not in str(e.value) and str(bad) in str(e.value) or "past the" in str(e.value)


# sizes that do not match the data (huge, wrapping or zero dimensions, partial blocks), misaligned or out-of-file
# data: the loader's own checks (gguf_header.py, gguf_table.py), before any view of the data is made
TABLE = [
    (dict(dims=[64, 1 << 41]), r"has dimensions \[64, 2199023255552\] \(each must be 1 .. 2\^40\)"),
    (dict(dims=[64, 320 + (1 << 58)]), "each must be 1 .. 2"),  # 64 x that wraps to the true element count
    (dict(dims=[1 << 40, 1 << 40]), "overflow 64-bit sizes"),
    (dict(dims=[64, 1 << 30]), "is truncated or corrupt: tensor token_embd.weight needs bytes"),
    (dict(dims=[0, 64]), "has dimensions \\[0, 64\\]"),
    (dict(dims=[48, 64]), "rows of 48 values are not whole blocks of 32"),
    (dict(offset=8), "is not aligned to 32 bytes"),
    (dict(offset=1 << 40), "is truncated or corrupt"),
]


@pytest.mark.parametrize("patch,message", TABLE, ids=[str(p) for p, _ in TABLE])
def test_a_bad_tensor_table_is_refused(good, tmp_path, patch, message):
    bad = patch_tensor(good, tmp_path / "bad.gguf", "token_embd.weight", **patch)
    with pytest.raises(GGUFError, match=message):
        GGUFFile(bad)


def test_overlapping_tensors_are_refused(good, tmp_path):
    gf = GGUFFile(good)
    first, second = sorted(gf.tensors.values(), key=lambda t: t.offset)[:2]
    start = first.offset - (gf.tensors[first.name].offset - 0)  # relative offsets: the first tensor's is 0 here
    bad = patch_tensor(good, tmp_path / "bad.gguf", second.name, offset=first.offset - start + 32)
    with pytest.raises(GGUFError, match=f"tensors {first.name} and {second.name} overlap"):
        GGUFFile(bad)


def test_the_cli_says_one_line_and_exits_2(good, tmp_path):
    bad = rewrite(good, tmp_path / "bad.gguf", {"llama.attention.head_count": (0, U32)})
    p = subprocess.run([sys.executable, "-m", "ellm", "compile", str(bad), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "head_count is 0" in lines[0]
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("template,message", [
    ("{{ 1 / 0 }}", "chat template failed: ZeroDivisionError"),  # found by the fuzzer: the template's own errors
    ("{{ 'a' + 1 }}", "chat template failed: TypeError"),
    ("{% for m in messages %}", "chat template failed: Unexpected end of template"),
    ("{{ raise_exception('no system role') }}", "chat template failed: no system role"),
])
def test_a_failing_chat_template_is_one_line(good, tmp_path, template, message):
    from ellm.runtime.tokenizer import Tokenizer

    bad = rewrite(good, tmp_path / "bad.gguf", {"tokenizer.chat_template": (template, STR)})
    tok = Tokenizer.from_gguf(GGUFFile(bad))
    with pytest.raises(GGUFError, match=message):
        tok.encode_chat([{"role": "user", "content": "hi"}])
