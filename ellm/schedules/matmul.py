"""The matmul computation shared by the GEMV and GEMM rules: optional RMSNorm prologue, dequant, bias/residual epilogue."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te

from ..quant import FORMATS, WeightFormat
from .dequant import dequant, flat_k, split_k, weight_placeholders
from .rule import KernelRequest


@dataclass
class MatmulStages:
    """TE tensors of one matmul kernel. `params` is the PrimFunc signature order."""

    fmt: WeightFormat
    params: list[te.Tensor]
    x: te.Tensor  # the activations the product reads (normalised if there is a norm)
    y: te.Tensor  # the reduction  [M, N]
    out: te.Tensor  # y plus epilogue (is y when there is none)
    wt: te.Tensor | None  # dequantised weight tile stage [K, N] (GEMM only)
    norm_stages: tuple[str, ...]  # names of prologue blocks


def token_dim(req: KernelRequest):
    return req.m if req.m is not None else te.var("T", "int64")


def matmul_stages(req: KernelRequest, weight_tile: bool) -> MatmulStages:
    """Build the compute. With `weight_tile`, dequantisation is its own stage WT[k, n] (for GEMM tiling);
    otherwise it is inlined into the reduction over (block, sub-axes) (for GEMV vectorisation)."""
    fmt = FORMATS[req.qtype]
    N, K = req.weight_shape
    M = token_dim(req)
    if req.attr("last_row"):
        # Only the last token's row is projected (logits of a prefill chunk): x is [T, K], out is [1, N].
        rows = te.var("T", "int64")
        x = te.placeholder((rows, K), "float32", name="x")
        x_row = lambda t: rows - 1  # noqa: E731
    else:
        x = te.placeholder((M, K), "float32", name="x")
        x_row = lambda t: t  # noqa: E731
    params = [x]
    residual = None
    if req.attr("residual"):
        residual = te.placeholder((M, N), "float32", name="residual")
        params.append(residual)
    w = weight_placeholders(fmt, N, K)
    params.extend(w.values())

    xs, xs_row, norm_stages = x, x_row, ()
    if "norm" in req.vectors:
        g = te.placeholder((K,), "float32", name="norm")
        params.append(g)
        eps = float(req.attr("norm_eps"))
        k = te.reduce_axis((0, K), "k")
        ss = te.compute((M,), lambda t: te.sum(x[x_row(t), k] * x[x_row(t), k], axis=k), name="sumsq")
        rstd = te.compute((M,), lambda t: 1.0 / te.sqrt(ss[t] / float(K) + eps), name="rstd")
        xs = te.compute((M, K), lambda t, c: x[x_row(t), c] * rstd[t] * g[c], name="xnorm")
        xs_row = lambda t: t  # noqa: E731  (xnorm holds only the selected rows)
        norm_stages = ("sumsq", "rstd", "xnorm")
    bias = None
    if "bias" in req.vectors:
        bias = te.placeholder((N,), "float32", name="bias")
        params.append(bias)

    wt = None
    if weight_tile:
        wt = te.compute((K, N), lambda c, n: dequant(fmt, w, n, *split_k(fmt, c)), name="wt")
        k = te.reduce_axis((0, K), "k")
        y = te.compute((M, N), lambda t, n: te.sum(xs[xs_row(t), k] * wt[k, n], axis=k), name="y")
    else:
        kb = te.reduce_axis((0, K // fmt.block), "kb")
        subs = [te.reduce_axis((0, e), f"ks{i}") for i, e in enumerate(fmt.sub_axes)]
        y = te.compute(
            (M, N),
            lambda t, n: te.sum(xs[xs_row(t), flat_k(fmt, kb, subs)] * dequant(fmt, w, n, kb, subs), axis=[kb, *subs]),
            name="y",
        )

    out = y
    if bias is not None or residual is not None:

        def epilogue(t, n):
            v = y[t, n]
            if bias is not None:
                v = v + bias[n]
            if residual is not None:
                v = v + residual[t, n]
            return v

        out = te.compute((M, N), epilogue, name="out")
    params.append(out)
    return MatmulStages(fmt, params, xs, y, out, wt, norm_stages)


def lanes_for(fmt: WeightFormat) -> int:
    """Extent of the innermost in-block axis (the contiguous one that vector lanes run along)."""
    return fmt.sub_axes[-1]


