"""A compiled artifact on disk: manifest, kernels shared library, page-aligned weights, tokenizer.

Loading verifies every file against its checksum and the CPU against the features the kernels were
compiled for, then memory-maps the weights (zero-copy) and loads the library. It never compiles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import ArtifactError
from ..fsutil import sha256_file
from ..targets import host_cpuinfo_flags, missing_features
from .tokenizer import Tokenizer, TokenizerInfo

FORMAT = "ellm-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KERNELS = "kernels.so"
WEIGHTS = "weights.bin"
TOKENIZER = "tokenizer.json"
PAGE = 4096  # every parameter starts on a page boundary (mmap, NUMA placement, 64-byte kernel alignment)


@dataclass(frozen=True)
class ParamEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Artifact:
    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = path
        self.manifest = manifest
        self.config = ModelConfig.from_dict(manifest["config"])
        self.params = [
            ParamEntry(p["name"], p["dtype"], tuple(p["shape"]), int(p["offset"]), int(p["nbytes"]))
            for p in manifest["params"]
        ]

    # --- opening and verification ------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, verify: bool = True, check_cpu: bool = True) -> Artifact:
        path = Path(path)
        if not path.is_dir():
            raise ArtifactError(f"artifact directory not found: {path} (create one with `ellm compile -o {path}`)")
        mpath = path / MANIFEST
        try:
            manifest = json.loads(mpath.read_text())
        except FileNotFoundError:
            raise ArtifactError(f"{path} is not an eLLM artifact: {MANIFEST} is missing") from None
        except (OSError, ValueError) as e:
            raise ArtifactError(f"{mpath} is unreadable: {e}") from None
        if manifest.get("format") != FORMAT:
            raise ArtifactError(f"{path} is not an eLLM artifact (manifest format {manifest.get('format')!r})")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"{path} has artifact format version {manifest.get('format_version')}; this eLLM reads version "
                f"{FORMAT_VERSION}: recompile it"
            )
        art = cls(path, manifest)
        if verify:
            art.verify_files()
        if check_cpu:
            art.check_cpu()
        return art

    def verify_files(self) -> None:
        for name, expected in self.manifest["files"].items():
            f = self.path / name
            if not f.is_file():
                raise ArtifactError(f"artifact file {name} is missing from {self.path}: recompile the artifact")
            got = sha256_file(f)
            if got != expected:
                raise ArtifactError(
                    f"artifact file {name} does not match its checksum (expected {expected[:16]}..., got {got[:16]}...): "
                    "the artifact is corrupt or was modified; recompile it"
                )

    def check_cpu(self, host_flags: set[str] | None = None) -> None:
        target = self.manifest["target"]
        missing = missing_features(target["required_cpu_features"], host_flags or host_cpuinfo_flags())
        if missing:
            raise ArtifactError(
                f"artifact was compiled for target {target['preset']} and needs CPU features this machine lacks: "
                f"{', '.join(missing)}; compile it here with `ellm compile --target auto`"
            )

    # --- contents ---------------------------------------------------------------------------
    @property
    def kv_plan(self):
        """The KV cache plan (kv/plan.py) the kernels were compiled for."""
        from ..kv.plan import KVPlan

        return KVPlan.from_dict(self.manifest["kv_cache"])

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.path / TOKENIZER, TokenizerInfo.from_dict(self.manifest["tokenizer"]))

    def map_params(self, huge_pages: bool = False) -> list[np.ndarray]:
        """Every parameter as a NumPy view of the weights file: memory-mapped (copy-on-write, never written,
        shared with other processes), or with `huge_pages` read into private memory on 2 MiB pages
        (runtime/hugepages.py: fewer TLB misses as each step streams them)."""
        mm = np.memmap(self.path / WEIGHTS, dtype=np.uint8, mode="c")
        if huge_pages:
            from .hugepages import huge_bytes

            whole = huge_bytes(mm.size)  # offsets in the file are page aligned, so views stay 64-byte aligned
            whole[...] = mm
            mm = whole
        arrays = []
        for p in self.params:
            arr = mm[p.offset : p.offset + p.nbytes].view(np.dtype(p.dtype)).reshape(p.shape)
            arrays.append(arr)
        return arrays

    def load_module(self):
        import tvm

        try:
            return tvm.runtime.load_module(str(self.path / KERNELS))
        except Exception as e:
            raise ArtifactError(f"cannot load {self.path / KERNELS}: {e}") from None
