"""Tuning database: the best measured knobs per (target preset, CPU model, threads, kernel), as a JSON file
written atomically. Lookups prefer records measured on the same CPU model with the same thread count and
fall back to the same target preset; a record slower than its kernel's default is never applied."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import EllmError
from ..fsutil import atomic_write_text
from ..schedules import KernelRequest, rule_by_name

DB_FORMAT = "ellm-tuning-db"
DB_VERSION = 1


@dataclass(frozen=True)
class TuningRecord:
    target: str  # preset name the kernel is compiled for
    cpu: str  # model name of the CPU it was measured on
    kernel: str  # KernelRequest.key()
    rule: str
    knobs: dict[str, int]
    seconds: float  # median time of one call
    threads: int
    workload: dict[str, Any] = field(default_factory=dict)  # the request, for people reading the file
    measured_unix: int = 0
    status: str = "ok"  # ok, build_error, run_error: failed candidates are kept, never chosen
    message: str = ""  # what went wrong, for a failed candidate
    default_seconds: float = 0.0  # the kernel's default knobs in the same run (0: not measured)

    def key(self) -> tuple[str, str, int, str, str]:
        return (self.target, self.cpu, self.threads, self.kernel, self.rule)

    def beats_default(self) -> bool:
        return self.default_seconds <= 0 or self.seconds <= self.default_seconds


@dataclass
class TuningLookup:
    """The knob lookup lowering calls for every kernel: the best record for this CPU model and thread count,
    else for the target preset, and a tally of what was found, for the compile report."""

    db: "TuningDatabase"
    target: str
    cpu: str
    threads: int
    hits: dict[str, str] = field(default_factory=dict)  # kernel -> "cpu" (same CPU and threads) or "target"
    misses: set[str] = field(default_factory=set)  # kernels with knobs and no usable record: defaults
    slower: set[str] = field(default_factory=set)  # kernels whose record lost to the default: defaults

    def __call__(self, req: KernelRequest, rule: str) -> Mapping[str, int] | None:
        kernel = req.key()
        exact = self.db.best(self.target, kernel, rule, self.cpu, self.threads)
        rec, level = (exact, "cpu") if exact else (self.db.best(self.target, kernel, rule), "target")
        if rec is not None and not rec.beats_default():
            self.slower.add(kernel)
            return None
        if rec is None:
            if rule_by_name(rule).knobs:
                self.misses.add(kernel)
            return None
        self.hits[kernel] = level
        return dict(rec.knobs)

    def summary(self) -> str:
        same = sum(1 for v in self.hits.values() if v == "cpu")
        text = (f"tuning database ({self.target}): {len(self.hits)} kernels tuned ({same} measured on this CPU model "
                f"with {self.threads} threads, {len(self.hits) - same} on others of the preset), "
                f"{len(self.misses)} not in it")
        if self.slower:
            text += f", {len(self.slower)} whose record was slower than the default"
        if self.misses or self.slower:
            text += f"; these keep their defaults: {', '.join(sorted(self.misses | self.slower))}"
        return text


class TuningDatabase:
    def __init__(self, path: Path | None = None, records: list[TuningRecord] | None = None):
        self.path = path
        self._best: dict[tuple[str, str, int, str, str], TuningRecord] = {}
        self._failed: list[TuningRecord] = []
        for r in records or []:
            self.add(r)

    @classmethod
    def open(cls, path: str | Path) -> TuningDatabase:
        path = Path(path)
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise EllmError(f"cannot read tuning database {path}: {e}") from None
        if data.get("format") != DB_FORMAT or data.get("version") != DB_VERSION:
            raise EllmError(f"{path} is not an eLLM tuning database (version {DB_VERSION})")
        try:
            return cls(path, [TuningRecord(**r) for r in data["records"]])
        except TypeError as e:
            raise EllmError(f"malformed record in tuning database {path}: {e}") from None

    def add(self, record: TuningRecord) -> bool:
        """Keep `record` if it is the fastest for its (target, CPU, threads, kernel, rule); True if it was kept.
        A failed candidate is kept as such and never becomes the best."""
        if record.status != "ok":
            self._failed.append(record)
            return False
        key = record.key()
        old = self._best.get(key)
        if old is None or record.seconds < old.seconds:
            self._best[key] = record
            return True
        return False

    def records(self) -> list[TuningRecord]:
        """The best record of each kernel, per CPU model and thread count."""
        return sorted(self._best.values(), key=TuningRecord.key)

    def failures(self) -> list[TuningRecord]:
        return list(self._failed)

    def best(self, target: str, kernel: str, rule: str, cpu: str | None = None, threads: int | None = None) -> TuningRecord | None:
        """The fastest record of a kernel on `cpu` with `threads`; without them, the fastest on any CPU of the
        target preset (relative to its own default where that was measured, since CPUs differ in speed)."""
        if cpu is not None and threads is not None:
            return self._best.get((target, cpu, threads, kernel, rule))
        found = [r for k, r in self._best.items() if (k[0], k[3], k[4]) == (target, kernel, rule)]
        return min(found, key=lambda r: r.seconds / r.default_seconds if r.default_seconds > 0 else r.seconds, default=None)

    def merge(self, other: "TuningDatabase") -> None:
        for r in other.records():
            self.add(r)
        self._failed.extend(other.failures())

    def lookup_for(self, target: str, cpu: str, threads: int) -> TuningLookup:
        """A knob lookup for lowering: (request, rule name) -> best knobs or None, tallying hits and misses."""
        return TuningLookup(self, target, cpu, threads)

    def save(self, path: str | Path | None = None) -> None:
        path = Path(path or self.path)
        doc = {"format": DB_FORMAT, "version": DB_VERSION, "saved_unix": int(time.time()), "records": [asdict(r) for r in self.records() + self._failed]}
        atomic_write_text(path, json.dumps(doc, indent=1))
