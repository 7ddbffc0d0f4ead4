"""GGUF (llama family) -> graph IR: one node per op of the reference forward pass, nothing fused yet."""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import GGUFError
from .gguf_file import GGUFFile
from .graph import T, Graph, Op, OpKind, TensorType, Use, VectorRef, WeightRef, attrs

def _weight(gf: GGUFFile, name: str, rows: int, cols: int) -> WeightRef:
    info = gf.info(name)
    if (info.rows, info.cols) != (rows, cols) or info.ndim != 2:
        raise GGUFError(f"{gf.path}: tensor {name} has shape [{info.rows}, {info.cols}], expected [{rows}, {cols}]")
    fmt = gf.weight_format(name)
    return WeightRef(name, fmt.qtype, rows, cols, (name,))


def _vector(gf: GGUFFile, name: str, size: int) -> VectorRef:
    info = gf.info(name)
    if info.rows * info.cols != size:
        raise GGUFError(f"{gf.path}: tensor {name} has {info.rows * info.cols} elements, expected {size}")
    return VectorRef(name, size, (name,))


def import_llama(gf: GGUFFile, cfg: ModelConfig) -> Graph:
    g = Graph()
    D, H, Hkv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    act = lambda width: TensorType((T, width))  # noqa: E731  [T, width] float32 activations
    # the cache's logical type [n_layers, n_kv_heads, ctx, head_dim]; its storage (blocks, tiers,
    # precision per layer) is decided by the plan_kv_cache pass
    cache_t = TensorType((cfg.n_layers, Hkv, "C", hd), "float16")

    g.add("tokens", Op(OpKind.INPUT, (TensorType((T,), "int32"),)))
    cache = g.add("kv_cache", Op(OpKind.INPUT, (cache_t,)))
    embd = _weight(gf, "token_embd.weight", cfg.vocab_size, D)
    x = g.add("embed", Op(OpKind.EMBEDDING, (act(D),), (Use("tokens"),), weights=(embd,)))

    def matmul(name: str, src: str, rows: int, layer: int, bias: str | None = None) -> str:
        vectors = ()
        if bias is not None and gf.has(bias):
            vectors = (("bias", _vector(gf, bias, rows)),)
        w = _weight(gf, f"{name}.weight", rows, D if not name.endswith("ffn_down") else cfg.d_ff)
        return g.add(name, Op(OpKind.MATMUL, (act(rows),), (Use(src),), weights=(w,), vectors=vectors, layer=layer))

    def rmsnorm(name: str, src: str, layer: int | None) -> str:
        v = _vector(gf, f"{name}.weight", D)
        return g.add(
            name,
            Op(OpKind.RMSNORM, (act(D),), (Use(src),), vectors=(("norm", v),), attrs=attrs(eps=cfg.rms_eps), layer=layer),
        )

    rope = dict(neox=cfg.rope_neox, rope_dim=cfg.rope_dim)
    for i in range(cfg.n_layers):
        p = f"blk.{i}"
        h = rmsnorm(f"{p}.attn_norm", x, i)
        bias = (lambda n: f"{p}.{n}.bias") if cfg.attn_bias else (lambda n: None)
        q = matmul(f"{p}.attn_q", h, H * hd, i, bias("attn_q"))
        k = matmul(f"{p}.attn_k", h, Hkv * hd, i, bias("attn_k"))
        v = matmul(f"{p}.attn_v", h, Hkv * hd, i, bias("attn_v"))
        qr = g.add(
            f"{p}.rope_q", Op(OpKind.ROPE, (act(H * hd),), (Use(q),), attrs=attrs(n_heads=H, **rope), layer=i)
        )
        kr = g.add(
            f"{p}.rope_k", Op(OpKind.ROPE, (act(Hkv * hd),), (Use(k),), attrs=attrs(n_heads=Hkv, **rope), layer=i)
        )
        cache = g.add(f"{p}.kv_append", Op(OpKind.KV_APPEND, (cache_t,), (Use(cache), Use(kr), Use(v)), layer=i))
        att = g.add(
            f"{p}.attention",
            Op(OpKind.ATTENTION, (act(H * hd),), (Use(qr), Use(cache)), attrs=attrs(n_heads=H), layer=i),
        )
        o = matmul(f"{p}.attn_output", att, D, i)
        x = g.add(f"{p}.attn_residual", Op(OpKind.ADD, (act(D),), (Use(x), Use(o)), layer=i))
        h = rmsnorm(f"{p}.ffn_norm", x, i)
        gate = matmul(f"{p}.ffn_gate", h, cfg.d_ff, i)
        up = matmul(f"{p}.ffn_up", h, cfg.d_ff, i)
        s = g.add(f"{p}.ffn_silu_mul", Op(OpKind.SILU_MUL, (act(cfg.d_ff),), (Use(gate), Use(up)), layer=i))
        dn = matmul(f"{p}.ffn_down", s, D, i)
        x = g.add(f"{p}.ffn_residual", Op(OpKind.ADD, (act(D),), (Use(x), Use(dn)), layer=i))

    h = rmsnorm("output_norm", x, None)
    head = embd if cfg.tied_embeddings else _weight(gf, "output.weight", cfg.vocab_size, D)
    g.add("lm_head", Op(OpKind.LM_HEAD, (act(cfg.vocab_size),), (Use(h),), weights=(head,)))
    g.outputs = ["lm_head"]
    g.check()
    return g
