"""A bandwidth model of decode across NUMA nodes and across machines: what the layout should gain on
hardware this project cannot measure on (a 2-socket server, machines on a network). Every input is stated,
in the arguments or in the result; nothing here is a measurement.

A decode step reads every matmul weight once and the KV cache up to the context; it is bound by memory
traffic. Placements on one machine of N nodes (bandwidth per node `local`, from a remote node `remote`):
- first touch by one loading thread: every byte on node 0, whose controller serves all the machine's threads
  and whose links carry the other nodes' shares;
- interleaved pages: each controller serves 1/N of the bytes, each link 1/N of a node's share;
- the layout plan (numa/plan.py): each node reads its own 1/N locally; every kernel then ends at a barrier
  across all nodes.
Across M machines (tensor parallel, one Disco worker each): each machine reads 1/M of the bytes from its own
memory. Each layer then has two all-reduces of the d_model activations (after attention's output projection
and after the FFN's down projection), and the logits of the head rows are gathered once per token. Ring
collectives: 2 (M - 1) steps of link latency, and 2 (M - 1) / M of the vector per machine over the link.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..synth.shapes import ModelShape
from ..synth.type_mix import TypeMix
from ..synth.writer import tensor_plan

ACT_BYTES = 4  # float32 activations in a collective


def weight_bytes_per_token(shape: ModelShape, mix: TypeMix) -> float:
    """Bytes of the matmul weights a decode step reads (GGUF accounting): every 2-D tensor but the token
    embedding, which is gathered one row a token unless it is also the (tied) head."""
    import gguf

    total = 0.0
    for t in tensor_plan(shape, mix):
        if t.rows == 1 or (t.name == "token_embd.weight" and not shape.tied):
            continue
        block, size = gguf.GGML_QUANT_SIZES[t.qtype]
        total += t.rows * t.cols / block * size
    return total


@dataclass(frozen=True)
class Workload:
    """Bytes a decode step reads, and the shape its collectives move."""

    name: str
    weight_bytes: float  # matmul weights read per token
    kv_bytes_per_token: float  # KV cache bytes per context token (both K and V, every layer)
    n_layers: int
    d_model: int
    vocab: int
    kernels_per_token: int  # parallel kernels of a step (each ends at a barrier of all threads)

    def step_bytes(self, ctx: int) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * ctx

    @classmethod
    def of(cls, shape: ModelShape, mix: TypeMix, kv_bytes_per_value: float = 2.0, name: str | None = None) -> Workload:
        kv = 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim * kv_bytes_per_value
        # per layer: attention input (norm + QKV + RoPE + append), attention, output, gate+up, SiLU*mul, down
        return cls(name or f"{shape.name} {mix.name}", weight_bytes_per_token(shape, mix), kv, shape.n_layers,
                   shape.d_model, shape.vocab, 6 * shape.n_layers + 2)


@dataclass(frozen=True)
class Machine:
    """A machine of `nodes` NUMA nodes: bandwidth a node's cores draw from local and from remote memory,
    GB/s, and the cost of a barrier across all its threads (µs)."""

    nodes: int
    local_gbs: float
    remote_gbs: float
    barrier_us: float = 1.0

    @classmethod
    def from_distances(cls, nodes: int, local_gbs: float, distance: int, barrier_us: float = 1.0) -> Machine:
        """Remote bandwidth stated as local x 10 / distance (the SLIT's relative cost, local = 10): a proxy
        where no cross-node measurement exists."""
        return cls(nodes, local_gbs, local_gbs * 10 / distance, barrier_us)


def tokens_per_s_one_machine(w: Workload, m: Machine, ctx: int) -> dict[str, float]:
    """Decode tokens/s for each placement on one machine, all nodes' threads working at once: a step takes as
    long as its busiest memory controller (`local_gbs` each) or its busiest link between two nodes
    (`remote_gbs` each way)."""
    b, n, local, remote = w.step_bytes(ctx), m.nodes, m.local_gbs * 1e9, m.remote_gbs * 1e9
    barrier = w.kernels_per_token * m.barrier_us * 1e-6
    if n == 1:
        t = b / local + barrier
        return {"first_touch": 1 / t, "interleave": 1 / t, "plan": 1 / t}
    # node 0 serves every byte; each other node's threads pull their 1/n share over their link to node 0
    t_first_touch = max(b / local, (b / n) / remote) + barrier
    # each controller serves 1/n; each link carries 1/n of a node's 1/n share
    t_interleave = max((b / n) / local, (b / n**2) / remote) + barrier
    t_plan = (b / n) / local + barrier
    return {"first_touch": 1 / t_first_touch, "interleave": 1 / t_interleave, "plan": 1 / t_plan}


@dataclass(frozen=True)
class Link:
    """A link between machines (or Disco workers): bandwidth in GB/s and one-way latency per message, µs."""

    name: str
    gbs: float
    latency_us: float


def collective_bytes_per_token(w: Workload, machines: int) -> float:
    """Bytes each worker sends per token: two all-reduces per layer and the logits gather (ring)."""
    if machines == 1:
        return 0.0
    frac = (machines - 1) / machines
    return w.n_layers * 2 * 2 * frac * w.d_model * ACT_BYTES + frac * w.vocab * ACT_BYTES


def tokens_per_s_across(w: Workload, per_machine_gbs: float, machines: int, link: Link, ctx: int) -> dict:
    """Decode tokens/s with the model split over `machines` (each reading its share at `per_machine_gbs`),
    and where the time goes."""
    memory_s = w.step_bytes(ctx) / machines / (per_machine_gbs * 1e9)
    if machines == 1:
        return {"tokens_per_s": 1 / memory_s, "memory_s": memory_s, "latency_s": 0.0, "transfer_s": 0.0,
                "bytes_per_token": 0.0}
    steps = w.n_layers * 2 * 2 * (machines - 1) + (machines - 1)  # ring all-reduces, then the gather
    latency_s = steps * link.latency_us * 1e-6
    sent = collective_bytes_per_token(w, machines)
    transfer_s = sent / (link.gbs * 1e9)
    t = memory_s + latency_s + transfer_s
    return {"tokens_per_s": 1 / t, "memory_s": memory_s, "latency_s": latency_s, "transfer_s": transfer_s,
            "bytes_per_token": sent}


def as_dict(x) -> dict:
    return asdict(x)
