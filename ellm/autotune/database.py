"""Tuning database: every trial of every tuning run, one JSON record per line, appended atomically (one
`write` of a whole line to a file opened for appending, then fsync), so runs on a fleet can share a file
and a crash leaves at most a torn last line, which reading skips.

Lookups use the best record per (target preset, CPU model, threads, kernel): they prefer records measured
on the same CPU model with the same thread count and fall back to the same preset, ranking records of other
CPUs by their gain over their own default. A record slower than its kernel's default is never applied.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..errors import EllmError
from ..fsutil import atomic_write_text
from ..schedules import KernelRequest, rule_by_name
from ..targets import get_preset

DB_FORMAT = "ellm-tuning-db"
DB_VERSION = 2


def versions() -> dict[str, str]:
    import tvm

    from .. import __version__

    return {"ellm": __version__, "tvm": str(tvm.__version__)}


@dataclass(frozen=True)
class TuningRecord:
    target: str  # preset name the kernel is compiled for
    cpu: str  # model name of the CPU it was measured on
    kernel: str  # KernelRequest.key(): rule inputs, shapes, dtypes and the compile options that reach the kernel
    rule: str
    knobs: dict[str, int]
    seconds: float  # median time of one call (0 for a failed trial)
    threads: int
    workload: dict[str, Any] = field(default_factory=dict)  # the request (KernelRequest.describe()), for readers
    measured_unix: int = 0
    status: str = "ok"  # ok, build_error, run_error, wrong: failed trials are kept, never chosen
    message: str = ""  # what went wrong, for a failed trial
    default_seconds: float = 0.0  # the kernel's default knobs in the same run (0: not measured)
    cpu_features: list[str] = field(default_factory=list)  # the measuring CPU's compute features
    stats: dict[str, float] = field(default_factory=dict)  # median, min, max seconds; passes, calls per pass
    strategy: str = ""  # the search that proposed it
    trial: int = 0  # its index in the kernel's search (0: the default)
    elapsed_s: float = 0.0  # wall time into the kernel's search when it finished
    runner: str = "local"  # where it was measured: local, or rpc:<key>@<server>
    options: dict[str, Any] = field(default_factory=dict)  # compile options and workload of the run
    versions: dict[str, str] = field(default_factory=dict)  # eLLM and TVM versions
    confirmed: bool = False  # re-timed in alternation with the default after the search (confirm.py)

    def key(self) -> tuple[str, str, int, str, str]:
        return (self.target, self.cpu, self.threads, self.kernel, self.rule)

    def beats_default(self) -> bool:
        """A confirmed record must have been faster in every round of its confirmation (confirm.py)."""
        if self.confirmed and self.stats.get("wins", 0) < self.stats.get("rounds", 1):
            return False
        return self.default_seconds <= 0 or self.seconds <= self.default_seconds

    def gain(self) -> float:
        """Default time over this record's (1: no evidence of a gain)."""
        return self.default_seconds / self.seconds if self.default_seconds > 0 and self.seconds > 0 else 1.0

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TuningRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


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
    stale: set[str] = field(default_factory=set)  # records whose knobs the rule no longer takes: defaults

    def __call__(self, req: KernelRequest, rule: str) -> Mapping[str, int] | None:
        kernel = req.key()
        found_slower = found_stale = False
        for rec in self.db.ranked(self.target, kernel, rule, self.cpu, self.threads):
            exact = (rec.cpu, rec.threads) == (self.cpu, self.threads)
            if exact and not rec.beats_default():  # measured here: the default is the fastest
                self.slower.add(kernel)
                return None
            if not rec.beats_default():
                found_slower = True
                continue
            try:  # knobs of an older version of the rule, or for a shape they do not fit: try the next record
                rule_by_name(rule).resolve_knobs(req, get_preset(self.target), rec.knobs)
            except ValueError:
                found_stale = True
                continue
            self.hits[kernel] = "cpu" if exact else "target"
            return dict(rec.knobs)
        if found_slower:
            self.slower.add(kernel)
        elif found_stale:
            self.stale.add(kernel)
        elif rule_by_name(rule).knobs:
            self.misses.add(kernel)
        return None

    def summary(self) -> str:
        same = sum(1 for v in self.hits.values() if v == "cpu")
        text = (f"tuning database ({self.target}): {len(self.hits)} kernels tuned ({same} measured on this CPU model "
                f"with {self.threads} threads, {len(self.hits) - same} on others of the preset), "
                f"{len(self.misses)} not in it")
        if self.slower:
            text += f", {len(self.slower)} whose record was slower than the default"
        if self.stale:
            text += f", {len(self.stale)} with knobs this version does not take"
        kept = self.misses | self.slower | self.stale
        if kept:
            text += f"; these keep their defaults: {', '.join(sorted(kept))}"
        return text


class TuningDatabase:
    def __init__(self, path: Path | None = None, records: list[TuningRecord] | None = None):
        self.path = Path(path) if path else None
        self._trials: list[TuningRecord] = []
        self.skipped = 0  # lines that were not JSON (torn by a crash mid-append) when opened
        self._best: dict[tuple[str, str, int, str, str], TuningRecord] = {}
        for r in records or []:
            self.add(r)

    @classmethod
    def open(cls, path: str | Path) -> TuningDatabase:
        """The database at `path` (empty if there is none yet). A torn last line (a crash mid-append) is skipped."""
        path = Path(path)
        db = cls(path)
        if not path.exists():
            return db
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise EllmError(f"cannot read tuning database {path}: {e}") from None
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError:  # torn by a crash mid-append (the next append starts a new line)
                db.skipped += 1
                continue
            if isinstance(doc, dict) and doc.get("format") == DB_FORMAT:  # a header (two runs may both write one)
                if doc.get("version") != DB_VERSION:
                    raise EllmError(f"{path} is a version {doc.get('version')} tuning database; this eLLM reads "
                                    f"version {DB_VERSION}: tune again")
                continue
            if not isinstance(doc, dict) or "kernel" not in doc:
                raise EllmError(f"{path}:{i + 1}: not a tuning record: {path} is not an eLLM tuning database "
                                f"(JSON lines, version {DB_VERSION})")
            try:
                db.add(TuningRecord.from_json(doc))
            except TypeError as e:
                raise EllmError(f"{path}:{i + 1}: malformed tuning record: {e}") from None
        return db

    def add(self, record: TuningRecord) -> bool:
        """Hold `record` (in memory); True if it became the best of its (target, CPU, threads, kernel, rule).
        Confirmed records outrank the search's own (a search's fastest time is partly its quietest moment) and
        rank among themselves by whether they beat the default timed alongside them, then by the gain."""
        self._trials.append(record)
        if record.status != "ok":
            return False
        key = record.key()
        old = self._best.get(key)
        if old is None or _rank(record) > _rank(old):
            self._best[key] = record
            return True
        return False

    def append(self, record: TuningRecord) -> bool:
        """`add`, and append the record to the file at once."""
        kept = self.add(record)
        if self.path is not None:
            line = json.dumps(asdict(record), sort_keys=True) + "\n"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    line = _header() + line
                elif os.pread(fd, 1, size - 1) != b"\n":  # a torn last line: this record starts a new one
                    line = "\n" + line
                os.write(fd, line.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        return kept

    def trials(self) -> list[TuningRecord]:
        """Every record, in the order added."""
        return list(self._trials)

    def records(self) -> list[TuningRecord]:
        """The best record of each kernel, per CPU model and thread count."""
        return sorted(self._best.values(), key=TuningRecord.key)

    def failures(self) -> list[TuningRecord]:
        return [r for r in self._trials if r.status != "ok"]

    def best(self, target: str, kernel: str, rule: str, cpu: str | None = None, threads: int | None = None) -> TuningRecord | None:
        """The fastest record of a kernel on `cpu` with `threads`; without them, the one with the largest gain
        over its own default on any CPU of the target preset (CPUs differ in speed, not only in shape)."""
        if cpu is not None and threads is not None:
            return self._best.get((target, cpu, threads, kernel, rule))
        found = [r for k, r in self._best.items() if (k[0], k[3], k[4]) == (target, kernel, rule)]
        return max(found, key=TuningRecord.gain, default=None)

    def ranked(self, target: str, kernel: str, rule: str, cpu: str, threads: int) -> list[TuningRecord]:
        """A kernel's records in the order a lookup tries them: the one measured on `cpu` with `threads`, then
        the best of every other CPU and thread count of the preset, largest gain over its default first."""
        exact = self._best.get((target, cpu, threads, kernel, rule))
        others = [r for k, r in self._best.items() if (k[0], k[3], k[4]) == (target, kernel, rule) and r is not exact]
        return ([exact] if exact else []) + sorted(others, key=TuningRecord.gain, reverse=True)

    def merge(self, other: "TuningDatabase") -> None:
        """Add another database's trials (a fleet's records combine); identical records are kept once."""
        have = {json.dumps(asdict(r), sort_keys=True) for r in self._trials}
        for r in other.trials():
            text = json.dumps(asdict(r), sort_keys=True)
            if text not in have:
                have.add(text)
                self.add(r)

    def lookup_for(self, target: str, cpu: str, threads: int) -> TuningLookup:
        """A knob lookup for lowering: (request, rule name) -> best knobs or None, tallying hits and misses."""
        return TuningLookup(self, target, cpu, threads)

    def save(self, path: str | Path | None = None) -> None:
        """Write every record to `path` (default: this database's file) atomically."""
        path = Path(path or self.path)
        text = _header() + "".join(json.dumps(asdict(r), sort_keys=True) + "\n" for r in self._trials)
        atomic_write_text(path, text)


def _rank(r: TuningRecord) -> tuple[int, int, float]:
    return (1, int(r.beats_default()), r.gain()) if r.confirmed else (0, 0, -r.seconds)


def _header() -> str:
    return json.dumps({"format": DB_FORMAT, "version": DB_VERSION, "created_unix": int(time.time())}) + "\n"


__all__ = ["DB_FORMAT", "DB_VERSION", "TuningDatabase", "TuningLookup", "TuningRecord", "versions"]
