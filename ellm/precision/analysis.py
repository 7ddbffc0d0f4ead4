"""The sensitivity analysis: for each layer and part, the KL divergence of next-token distributions that
lowering that part alone to each candidate precision causes, on calibration text. Cached per model and text.

Parts: every weight (Q, K, V, O, gate, up, down, the output head) at each type `candidates` allows; the
head split into row sets (the likeliest tokens' rows at the source type, the rest at each lower candidate, for
several hot-set sizes; likeliness is the reference's mean next-token probability over all calibration tokens);
each layer's K cache and V cache at q8 and q4, measured at long context (`kv_ctx` tokens, scoring the last
`kv_scored`) through the block store's numerics; each layer's sparse reads: the layer alone reading only the
top-K remote blocks by score bound (precision/sparse_read.py), for each K in `READ_TOPK`, at the same long
context from the float16 cache (against dense reads, as every part is against the unmodified model); each layer's matmul inputs rounded to int8 (what 8-bit
activations cost). Weight and activation parts are scored on `tokens` calibration tokens in sequences of
`seq`. Everything runs on the float model (precision/model.py), re-run from the layer the part is in.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

from .. import __version__
from ..compiler.gguf_file import GGUFFile
from ..config import ModelConfig
from ..errors import EllmError
from ..fsutil import atomic_write_text
from ..kv.attention import AttentionConfig
from ..kv.plan import KVType
from .calibration import Calibration
from .divergence import Reference
from .kv_read import BlockReader
from .model import FloatModel, LayerEdit, lowered_values
from .plan import WeightInfo
from .sparse_read import SparseSelect

VERSION = 4  # of the measurement method: a cached table from another version is measured again
KV_CANDIDATES = (KVType.Q8, KVType.Q4)
READ_TOPK = (12, 4)  # remote blocks a query reads, below the default's (AttentionConfig().topk)
HOT_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2)  # of the vocabulary: split heads measured


def hot_sizes(vocab: int) -> list[int]:
    """Hot-set sizes measured for a split head: whole 16-row tiles, at least one, fewer than the vocabulary."""
    return sorted({n for n in (max(16, round(f * vocab / 16) * 16) for f in HOT_FRACTIONS) if n < vocab})


def reads_type(topk: int) -> str:
    return f"top{topk}"


def split_type(cold: str, hot_rows: int) -> str:
    """A split head's measurement type: its cold rows' type and how many hot rows stay at the source type."""
    return f"{cold}/{hot_rows}"


@dataclass(frozen=True)
class AnalysisSettings:
    tokens: int = 512  # weight and activation parts: calibration tokens run
    seq: int = 512  # ... in sequences of this length
    stride: int = 2  # ... scoring every stride-th position (the head and the KL are half of a measurement's work)
    kv_ctx: int = 4096  # K and V parts: the context
    kv_scored: int = 192  # ... of which the last positions are scored (three blocks of queries)
    block: int = 64  # the KV cache's block and recent tier, pinned blocks and key rotation (kv/plan.py)
    recent: int = 2
    pinned: int = 1
    rotate_k: bool = True

    def __post_init__(self) -> None:
        if self.tokens < self.seq or self.tokens % self.seq or self.seq < 16 or not 1 <= self.stride < self.seq:
            raise EllmError("analysis: tokens must be a positive multiple of seq (>= 16), stride in [1, seq)")
        if not 0 < self.kv_scored < self.kv_ctx or self.kv_scored % self.block or self.kv_ctx % self.block:
            raise EllmError("analysis: kv_scored must be below kv_ctx, both whole blocks")


@dataclass(frozen=True)
class Measurement:
    part: str  # a weight's GGUF name, "blk.N.k_cache", "blk.N.v_cache", "blk.N.activations" or "blk.N.reads"
    kind: str  # q, k, v, o, gate, up, down, head, head_split, k_cache, v_cache, activations, reads
    layer: int | None
    type: str  # QuantType name, KVType value, "int8", split_type(cold, hot rows), or reads_type(topk)
    kl: float  # mean KL(unmodified || lowered), nats per token
    top1: float  # fraction of positions whose most likely token is unchanged


@dataclass
class SensitivityTable:
    model_sha256: str
    calibration: str
    calibration_sha256: str
    settings: AnalysisSettings
    measurements: list[Measurement] = field(default_factory=list)
    seconds: float = 0.0
    version: int = VERSION
    vocab_order: list[int] = field(default_factory=list)  # token ids by falling mean probability (the likeliest half)

    def kl(self, part: str, type_: str) -> float:
        """The measured KL of lowering `part` to `type_` (0 for its source type)."""
        for m in self.measurements:
            if m.part == part and m.type == type_:
                return m.kl
        raise KeyError((part, type_))

    def has(self, part: str, type_: str) -> bool:
        return any(m.part == part and m.type == type_ for m in self.measurements)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ellm_version"] = __version__
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SensitivityTable:
        return cls(d["model_sha256"], d["calibration"], d["calibration_sha256"], AnalysisSettings(**d["settings"]),
                   [Measurement(**m) for m in d["measurements"]], d["seconds"], d["version"], d.get("vocab_order", []))


def _map(tasks: list, what: str, t0: float, log: Callable[[str], None]) -> list[Measurement]:
    """Run measurement tasks on two threads, each with a one-thread BLAS: NumPy releases the GIL in its kernels,
    and a measurement's softmax, attention and elementwise work is single-threaded (1.3x over one thread with
    a two-thread BLAS here). Results in task order."""
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_limits

    out: list[Measurement] = []
    with threadpool_limits(1), ThreadPoolExecutor(2) as ex:
        for i, m in enumerate(ex.map(lambda f: f(), tasks)):
            out.append(m)
            if (i + 1) % 30 == 0 or i + 1 == len(tasks):
                log(f"sensitivity: {what} {i + 1}/{len(tasks)} ({time.perf_counter() - t0:.0f} s)")
    return out


def _vocab_order(model: FloatModel, finals: list[np.ndarray]) -> np.ndarray:
    """Token ids by falling mean next-token probability of the unmodified model over every calibration position
    (ties: lower id first, which for BPE vocabularies is the more frequent merge)."""
    mass = None
    for x in finals:
        for i in range(0, len(x), 128):
            z = model.logits(x[i : i + 128])  # [<=128, vocab]
            z -= z.max(axis=1, keepdims=True)
            p = np.exp(z)
            p /= p.sum(axis=1, keepdims=True)
            mass = p.sum(axis=0) if mass is None else mass + p.sum(axis=0)
    return np.argsort(-mass, kind="stable")


def cache_path(model_sha: str, calib_sha: str, settings: AnalysisSettings) -> Path:
    from ..demo import cache_root

    tag = json.dumps(asdict(settings), sort_keys=True)
    key = hashlib.sha256(f"{model_sha}:{calib_sha}:{tag}:{VERSION}".encode()).hexdigest()[:20]
    return cache_root() / "sensitivity" / f"{model_sha[:12]}-{key}.json"


def load_or_analyse(gf: GGUFFile, cfg: ModelConfig, tokenizer, infos: list[WeightInfo], calibration: Calibration,
                    settings: AnalysisSettings = AnalysisSettings(), log: Callable[[str], None] = lambda s: None,
                    cache: bool = True) -> SensitivityTable:
    """The table for this model and text: from the cache, or measured (and cached)."""
    model_sha = gf.sha256()
    path = cache_path(model_sha, calibration.sha256, settings)
    if cache and path.is_file():
        try:
            table = SensitivityTable.from_dict(json.loads(path.read_text()))
            if table.version == VERSION:
                log(f"sensitivity analysis: reusing {path} (measured in {table.seconds:.0f} s)")
                return table
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is measured again
    table = analyse(gf, cfg, tokenizer, infos, calibration, settings, log)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(table.to_dict(), indent=0))
    return table


def analyse(gf: GGUFFile, cfg: ModelConfig, tokenizer, infos: list[WeightInfo], calibration: Calibration,
            settings: AnalysisSettings = AnalysisSettings(), log: Callable[[str], None] = lambda s: None) -> SensitivityTable:
    t0 = time.perf_counter()
    s = settings
    ids = np.asarray(calibration.tokens(tokenizer, s.tokens + s.kv_ctx))
    model = FloatModel(gf, cfg, max_ctx=max(s.kv_ctx, s.seq))
    table = SensitivityTable(gf.sha256(), calibration.name, calibration.sha256, s)
    out = table.measurements

    # weights and activations: short sequences, every position scored
    seqs = ids[: s.tokens].reshape(-1, s.seq)
    runs = [model.run(q)[0] for q in seqs]  # per sequence: layer inputs [L + 1] of [seq, d]
    ref = Reference(np.concatenate([model.logits(r[-1][:: s.stride]) for r in runs]))
    # the K and V parts' long context, run now: its final states rank the vocabulary for split heads too
    kv_ids = ids[s.tokens : s.tokens + s.kv_ctx]
    P = s.kv_ctx - s.kv_scored
    xs, kvs = model.run(kv_ids, keep_kv=True, keep_from=P, final_from=0)
    order = _vocab_order(model, [xs[-1]] + [r[-1] for r in runs])
    table.vocab_order = order[: cfg.vocab_size // 2].tolist()
    xs[-1] = xs[-1][P:]

    def score(final: list[np.ndarray]) -> tuple[float, float]:
        z = np.concatenate([model.logits(x[:: s.stride]) for x in final])
        return float(ref.kl(z).mean()), ref.top1_agree(z)

    def weight_task(layer: int, info: WeightInfo, t) -> Measurement:
        w = lowered_values(gf, info.name, t)
        kl, top1 = score([model.rerun(layer, r[layer], 0, {layer: LayerEdit(weights={info.name: w})}) for r in runs])
        return Measurement(info.name, info.part, layer, t.name, kl, top1)

    def act_task(layer: int) -> Measurement:
        kl, top1 = score([model.rerun(layer, r[layer], 0, {layer: LayerEdit(act_bits=8)}) for r in runs])
        return Measurement(f"blk.{layer}.activations", "activations", layer, "int8", kl, top1)

    # The head's logits are column-separable: a split head's are the lowered head's with the hot tokens'
    # columns taken from the source head's. One matmul per type serves the whole head and every split.
    heads = [i for i in infos if i.layer is None]
    head_x = np.concatenate([model.head_input(r[-1][:: s.stride]) for r in runs])  # [scored, d]
    head_z = {(i.name, t): head_x @ lowered_values(gf, i.name, t).T for i in heads for t in i.candidates()[1:]}
    source_z = {i.name: head_x @ model.w[i.name].T for i in heads}  # [scored, vocab]

    def head_task(info: WeightInfo, t) -> Measurement:
        z = head_z[info.name, t]
        return Measurement(info.name, "head", None, t.name, float(ref.kl(z).mean()), ref.top1_agree(z))

    def split_task(info: WeightInfo, t, n: int) -> Measurement:
        z = head_z[info.name, t].copy()
        z[:, order[:n]] = source_z[info.name][:, order[:n]]
        return Measurement(info.name, "head_split", None, split_type(t.name, n), float(ref.kl(z).mean()),
                           ref.top1_agree(z))

    tasks = [partial(weight_task, i.layer, i, t) for i in infos if i.layer is not None for t in i.candidates()[1:]]
    tasks += [partial(act_task, layer) for layer in range(cfg.n_layers)]
    tasks += [partial(head_task, i, t) for i in heads for t in i.candidates()[1:]]
    tasks += [partial(split_task, i, t, n) for i in heads for t in i.candidates()[1:] for n in hot_sizes(i.rows)]
    out += _map(tasks, "weights and activations", t0, log)

    # K and V caches: one long context, the last kv_scored positions scored, the prefix's cache as written
    past = [(k[:P], v[:P]) for k, v in kvs]
    kv_ref = Reference(model.logits(xs[-1]))

    def kv_task(layer: int, side: str, t: KVType) -> Measurement:
        reader = BlockReader(side, t, s.block, s.recent, s.pinned, s.rotate_k)
        edit = LayerEdit(read_k=reader) if side == "k" else LayerEdit(read_v=reader)
        z = model.logits(model.rerun(layer, xs[layer], P, {layer: edit}, past, chunk=s.block))
        return Measurement(f"blk.{layer}.{side}_cache", f"{side}_cache", layer, t.value, float(kv_ref.kl(z).mean()),
                           kv_ref.top1_agree(z))

    def reads_task(layer: int, topk: int) -> Measurement:
        edit = LayerEdit(select=SparseSelect(AttentionConfig(topk=topk), s.block, s.recent))
        z = model.logits(model.rerun(layer, xs[layer], P, {layer: edit}, past, chunk=s.block))
        return Measurement(f"blk.{layer}.reads", "reads", layer, reads_type(topk), float(kv_ref.kl(z).mean()),
                           kv_ref.top1_agree(z))

    tasks = [partial(kv_task, layer, side, t) for layer in range(cfg.n_layers) for side in ("k", "v") for t in KV_CANDIDATES]
    tasks += [partial(reads_task, layer, k) for layer in range(cfg.n_layers) for k in READ_TOPK]
    out += _map(tasks, "KV cache and reads", t0, log)
    table.seconds = time.perf_counter() - t0
    return table
