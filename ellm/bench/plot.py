"""Decode tokens/s against context length for each system, with the measured bandwidth bound."""

from __future__ import annotations

from pathlib import Path

from ..errors import EllmError


def plot_report(report: dict, path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EllmError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    systems = sorted({r["system"] for r in report["rows"]}, key=lambda s: s != "ellm")
    for s in systems:
        rows = sorted((r for r in report["rows"] if r["system"] == s), key=lambda r: r["ctx"])
        xs = [r["ctx"] for r in rows]
        ax.plot(xs, [r["decode_tok_s"] for r in rows], marker="o", label=f"{'eLLM' if s == 'ellm' else s} decode")
        ax.fill_between(xs, [r["decode_tok_s_min"] for r in rows], [r["decode_tok_s_max"] for r in rows], alpha=0.2)
    bound = sorted((r for r in report["rows"] if r["system"] == "ellm"), key=lambda r: r["ctx"])
    ax.plot([r["ctx"] for r in bound], [r["bound_tok_s"] for r in bound], "k--", label="memory-bandwidth bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{report['model']}, {report['threads']} threads\neLLM: {report.get('attention', '')}, {report['kv_cache']}",
                 fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
