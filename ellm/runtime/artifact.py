"""A compiled artifact on disk: manifest, a kernel library per target, page-aligned weights, tokenizer.

Loading verifies every file against its checksum, chooses the first target (they are stored best first)
whose CPU features this machine has, memory-maps the weights that target uses (zero-copy) and loads its
library. It never compiles.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import ArtifactError
from ..kv.attention import AttentionConfig
from ..fsutil import sha256_file
from ..targets import MASK_ENV, cpu_mask, host_flags, missing_features
from .envelope import DIGEST, check_envelope, read_plain
from .manifest_check import check_manifest, check_params_in_file, plain_name
from .tokenizer import Tokenizer, TokenizerInfo

FORMAT = "ellm-artifact"
FORMAT_VERSION = 5  # 2: several targets, each with its kernel library, sharing one weights file; 3: attention settings
# per layer; 4: the verify entry (speculative chains); 5: the manifest's digest envelope, a sha256 per parameter
MANIFEST = "manifest.json"
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
    sha256: str


class Artifact:
    def __init__(self, path: Path, manifest: dict[str, Any], target: dict[str, Any] | None = None):
        self.path = path
        self.manifest = manifest
        self.config = self._part("config", ModelConfig.from_dict)
        self.targets: list[dict[str, Any]] = manifest["targets"]
        self.target = target or self.targets[0]  # the target whose kernels run

    def _part(self, key: str, build):
        """`build(manifest[key])`, where a damaged part is one line naming it."""
        try:
            return build(self.manifest[key])
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise ArtifactError(f"{self.path}: manifest {key} is damaged ({type(e).__name__}: {e}); recompile it") from None

    # --- opening and verification ------------------------------------------------------------
    def attention(self) -> AttentionConfig:
        """The read budget the artifact was planned for (its manifest's; older artifacts: the default)."""
        if self.manifest.get("attention") is None:
            return AttentionConfig.from_dict({})
        return self._part("attention", AttentionConfig.from_dict)

    @classmethod
    def open(cls, path: str | Path, verify: bool = True, check_cpu: bool = True, target: str | None = None) -> Artifact:
        """`target`: run this one of the artifact's targets (default: the best this CPU can run)."""
        path = Path(path)
        if not path.is_dir():
            raise ArtifactError(f"artifact directory not found: {path} (create one with `ellm compile -o {path}`)")
        mpath = path / MANIFEST
        if mpath.is_symlink():
            raise ArtifactError(f"{path}: {MANIFEST} is a symbolic link; artifacts hold plain files only")
        try:
            raw = mpath.read_bytes()
        except FileNotFoundError:
            raise ArtifactError(f"{path} is not an eLLM artifact: {MANIFEST} is missing") from None
        except OSError as e:
            raise ArtifactError(f"{mpath} is unreadable: {e}") from None
        check_envelope(path, raw, read_plain(path, DIGEST))  # these bytes, and no others, are parsed
        try:
            manifest = json.loads(raw)
        except ValueError as e:
            raise ArtifactError(f"{mpath} is unreadable: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            what = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
            raise ArtifactError(f"{path} is not an eLLM artifact (manifest format {what!r})")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"{path} has artifact format version {manifest.get('format_version')}; this eLLM reads version "
                f"{FORMAT_VERSION}: recompile it"
            )
        check_manifest(path, manifest)
        art = cls(path, manifest)
        if target is not None:
            art.target = art._named_target(target)
        if verify:
            art.verify_files()
        if check_cpu:
            art.choose_target(named=target)
        return art

    def _named_target(self, name: str) -> dict[str, Any]:
        for t in self.targets:
            if t["preset"] == name:
                return t
        raise ArtifactError(f"{self.path} has no target {name!r} (it has {', '.join(self.target_names)})")

    @property
    def target_names(self) -> list[str]:
        return [t["preset"] for t in self.targets]

    @property
    def identity(self) -> str:
        """What the artifact computes with on this host: its files' digests and the target whose kernels
        run (16 hex digits). Files measured or saved against an artifact (verification costs, session
        caches) name it."""
        blob = json.dumps({"files": self.manifest["files"], "target": self.target["preset"]}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def verify_files(self) -> None:
        """Every file against its checksum, but the weights: their parameters are checked as mapped
        (map_params), so the bytes verified are the bytes the kernels read."""
        for name, expected in self.manifest["files"].items():
            f = self.path / plain_name(self.path, name, "file")
            if not f.is_file():
                raise ArtifactError(f"artifact file {name} is missing from {self.path}: recompile the artifact")
            if name == WEIGHTS:
                continue
            got = sha256_file(f)
            if got != expected:
                raise ArtifactError(
                    f"artifact file {name} does not match its checksum (expected {expected[:16]}..., got {got[:16]}...): "
                    "the artifact is corrupt or was modified; recompile it"
                )

    def choose_target(self, host_flags_: set[str] | None = None, named: str | None = None) -> dict[str, Any]:
        """The first target (best first) whose features the host has (`named`: that one, if the host has its
        features); refuses with one line naming what each target lacks."""
        flags = host_flags() if host_flags_ is None else host_flags_
        candidates = [self._named_target(named)] if named else self.targets
        lacking = {}
        for t in candidates:
            missing = missing_features(t["required_cpu_features"], flags)
            if not missing:
                self.target = t
                return t
            lacking[t["preset"]] = missing
        masked = f" ({MASK_ENV} hides {', '.join(cpu_mask())})" if cpu_mask() and host_flags_ is None else ""
        why = "; ".join(f"{name} needs {', '.join(m)}" for name, m in lacking.items())
        which = f"target {named} of the artifact" if named else "any target of the artifact"
        raise ArtifactError(f"this CPU{masked} cannot run {which}: {why}; compile it here with `ellm compile --target auto`")

    def check_cpu(self, host_flags: set[str] | None = None) -> None:
        self.choose_target(host_flags)

    # --- contents ---------------------------------------------------------------------------
    @property
    def params(self) -> list[ParamEntry]:
        """The chosen target's parameters, in the order its kernels take them."""
        table = self.manifest["params"]
        return [ParamEntry(table[i]["name"], table[i]["dtype"], tuple(table[i]["shape"]), int(table[i]["offset"]),
                           int(table[i]["nbytes"]), table[i]["sha256"]) for i in self.target["params"]]

    @property
    def kv_plan(self):
        """The KV cache plan (kv/plan.py) the kernels were compiled for."""
        from ..kv.plan import KVPlan

        return self._part("kv_cache", KVPlan.from_dict)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.path / TOKENIZER, self._part("tokenizer", TokenizerInfo.from_dict))

    def param_records(self) -> list[dict]:
        """The chosen target's parameter records (manifest entries), in the order its kernels take them."""
        return [self.manifest["params"][i] for i in self.target["params"]]

    def map_params(self, huge_pages: bool = False, place=None) -> list[np.ndarray]:
        """The chosen target's parameters as NumPy views of the weights file: memory-mapped (copy-on-write,
        never written, shared with other processes), or with `huge_pages` the arrays it uses read into private
        memory on 2 MiB pages (runtime/hugepages.py: fewer TLB misses as each step streams them), each at its
        offset in the file. `place(mapped bytes, records) -> bytes`: where a NUMA placement reads them in
        instead (numa/placement.py)."""
        params = self.params
        size = (self.path / WEIGHTS).stat().st_size
        check_params_in_file(self.path, params, size, PAGE)
        mm = np.memmap(self.path / WEIGHTS, dtype=np.uint8, mode="c") if size else np.zeros(0, np.uint8)
        if place is not None:
            mm = place(mm, self.param_records())
        elif huge_pages:
            from .hugepages import huge_bytes

            whole = huge_bytes(mm.size)  # offsets in the file are page aligned, so views stay 64-byte aligned
            for p in params:  # only what this target reads: another target's layouts stay on disk
                whole[p.offset : p.offset + p.nbytes] = mm[p.offset : p.offset + p.nbytes]
            mm = whole
        views = [mm[p.offset : p.offset + p.nbytes] for p in params]
        for p, v in zip(params, views):  # the bytes that run: the private copy, or the mapping (--mmap)
            if hashlib.sha256(v).hexdigest() != p.sha256:
                raise ArtifactError(f"{self.path}: parameter {p.name} in {WEIGHTS} does not match its checksum: the "
                                    "artifact is corrupt or was modified; recompile it")
        return [v.view(np.dtype(p.dtype)).reshape(p.shape) for p, v in zip(params, views)]

    def entry(self, vm, name: str):
        """The kernels file's function `name` (a manifest entry), which it must have."""
        try:
            return vm[name]
        except (AttributeError, ValueError):
            raise ArtifactError(f"{self.path}: the kernels file {self.target['kernels_file']} has no function "
                                f"{name}: the artifact is damaged; recompile it") from None

    def load_module(self):
        import tvm

        path = self.path / self.target["kernels_file"]
        try:
            return tvm.runtime.load_module(str(path))
        except Exception as e:
            raise ArtifactError(f"cannot load {path}: {e}") from None
