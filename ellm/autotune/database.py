"""Tuning database: the best measured knobs per (target preset, kernel), as a JSON file written atomically."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import EllmError
from ..fsutil import atomic_write_text
from ..schedules import KernelRequest

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


class TuningDatabase:
    def __init__(self, path: Path | None = None, records: list[TuningRecord] | None = None):
        self.path = path
        self._best: dict[tuple[str, str, str], TuningRecord] = {}
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
        """Keep `record` if it is the fastest for its (target, kernel, rule); True if it was kept. A failed
        candidate is kept as such and never becomes the best."""
        if record.status != "ok":
            self._failed.append(record)
            return False
        key = (record.target, record.kernel, record.rule)
        old = self._best.get(key)
        if old is None or record.seconds < old.seconds:
            self._best[key] = record
            return True
        return False

    def records(self) -> list[TuningRecord]:
        """The best record of each kernel."""
        return sorted(self._best.values(), key=lambda r: (r.target, r.kernel, r.rule))

    def failures(self) -> list[TuningRecord]:
        return list(self._failed)

    def best(self, target: str, kernel: str, rule: str) -> TuningRecord | None:
        return self._best.get((target, kernel, rule))

    def lookup_for(self, target: str):
        """A knob lookup for lowering: (request, rule name) -> best knobs or None."""

        def lookup(req: KernelRequest, rule: str) -> Mapping[str, int] | None:
            rec = self.best(target, req.key(), rule)
            return dict(rec.knobs) if rec else None

        return lookup

    def save(self, path: str | Path | None = None) -> None:
        path = Path(path or self.path)
        doc = {"format": DB_FORMAT, "version": DB_VERSION, "saved_unix": int(time.time()), "records": [asdict(r) for r in self.records() + self._failed]}
        atomic_write_text(path, json.dumps(doc, indent=1))
