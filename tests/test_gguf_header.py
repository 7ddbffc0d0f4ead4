"""eLLM's own GGUF header parser (compiler/gguf_header.py): the same metadata and tensor table as the gguf
package's reader on the real model, and one GGUFError line for each way a header can be wrong, including a file
cut at every byte of its header."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGUFReader
from gguf_mutate import encode, spec_of
from synthetic import write_model

from ellm.compiler.gguf_file import GGUFFile
from ellm.compiler.gguf_header import ValueType, parse_header
from ellm.errors import GGUFError


def test_the_real_model_reads_as_the_gguf_package_reads_it(model_path):
    ref = GGUFReader(model_path)
    ours = parse_header(memoryview(np.memmap(model_path, dtype=np.uint8, mode="r")), model_path)
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for key, f in fields.items():
        mine = ours.fields[key]
        assert [int(t) for t in f.types] == [mine.type] + ([mine.elem_type] if mine.elem_type is not None else []), key
        want, got = f.contents(), mine.contents()
        if isinstance(want, float):
            assert np.float32(want) == np.float32(got), key
        else:
            assert want == got, key
    assert [t.name for t in ref.tensors] == [t.name for t in ours.tensors]
    for r, t in zip(ref.tensors, ours.tensors):
        assert list(t.dims) == [int(x) for x in r.shape] and t.type_id == int(r.tensor_type)
        assert ours.data_offset + t.offset == int(r.data_offset)
    assert ours.alignment == int(ref.alignment) and ours.version == ref.fields["GGUF.version"].contents()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("h") / "small.gguf", n_layers=1, d=64, ff=128, heads=2, kv_heads=1)


def test_a_file_cut_anywhere_in_its_header_is_one_line(small, tmp_path):
    raw = small.read_bytes()
    header_end = GGUFFile(small).tensors["token_embd.weight"].offset  # the first tensor's data
    bad = tmp_path / "cut.gguf"
    for n in list(range(0, 64)) + list(range(64, header_end, 37)) + [header_end - 1]:
        bad.write_bytes(raw[:n])
        with pytest.raises(GGUFError) as e:
            GGUFFile(bad)
        assert "\n" not in str(e.value)


def _with(small, tmp_path, **changes) -> GGUFFile:
    spec = dataclasses.replace(spec_of(small), **changes)
    (tmp_path / "bad.gguf").write_bytes(encode(spec))
    return GGUFFile(tmp_path / "bad.gguf")


def _field(small, key, t, elem, value):
    spec = spec_of(small)
    return [f for f in spec.fields if f[0] != key] + [(key, t, elem, value)]


CASES = [
    (dict(version=1), "has GGUF version 1; eLLM reads versions 2 and 3"),
    (dict(version=3 << 24), "a big-endian file"),
    (dict(n_kv=1 << 40), "claims .* 1099511627776 metadata entries, more than"),
    (dict(n_tensors=1 << 40), "claims 1099511627776 tensors"),
    (dict(n_kv=3), "is truncated or corrupt|unknown value type|not UTF-8|appears twice|tensor"),
]


@pytest.mark.parametrize("changes,message", CASES, ids=[m for _, m in CASES])
def test_a_bad_header_is_one_line(small, tmp_path, changes, message):
    with pytest.raises(GGUFError, match=message):
        _with(small, tmp_path, **changes)


FIELDS = [
    (("general.alignment", 4, None, 48), "general.alignment is 48; it must be a power of two"),
    (("general.alignment", 4, None, 0), "general.alignment is 0"),
    (("general.alignment", 8, None, "32"), "general.alignment is '32'"),
    (("x.nested", 9, 9, [1]), "metadata key x.nested is an array of arrays"),
    (("x.type", 13, None, 0), "metadata key x.type has unknown value type 13"),
    (("x.list", 9, 4, list(range(10))), None),  # a good array: loads
    (("x.bytes", 8, None, b"\xff\xfe"), r"metadata key x.bytes is not UTF-8 \(byte 0 of it is 0xff\)"),
]


@pytest.mark.parametrize("field,message", FIELDS, ids=[f[0] + str(f[1]) for f, _ in FIELDS])
def test_bad_metadata_entries_are_one_line(small, tmp_path, field, message):
    fields = _field(small, *field)
    if message is None:
        assert _with(small, tmp_path, fields=fields).get_array("x.list", "int") == list(range(10))
        return
    with pytest.raises(GGUFError, match=message):
        _with(small, tmp_path, fields=fields)


def test_a_key_twice_and_a_tensor_twice_are_refused(small, tmp_path):
    spec = spec_of(small)
    with pytest.raises(GGUFError, match="metadata key general.architecture appears twice"):
        _with(small, tmp_path, fields=spec.fields + spec.fields[:1])
    t = spec.tensors
    with pytest.raises(GGUFError, match=f"tensor {t[0][0]} appears twice in the tensor table"):
        _with(small, tmp_path, tensors=t + [(t[0][0], t[0][1], t[0][2], t[-1][3])])


@pytest.mark.parametrize("n_dims", [0, 5])
def test_a_tensor_has_one_to_four_dimensions(small, tmp_path, n_dims):
    t = spec_of(small).tensors
    with pytest.raises(GGUFError, match=f"has {n_dims} dimensions \\(GGUF allows 1 .. 4\\)"):
        _with(small, tmp_path, tensors=[(t[0][0], [64] * n_dims, t[0][2], t[0][3])] + t[1:])


def test_value_types_follow_the_format():
    assert [t.value for t in ValueType] == list(range(13))
