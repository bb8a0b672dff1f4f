"""PNG plots of benchmark results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(result: dict, path: Path, title: str) -> Path:
    plt = _plt()
    systems = result["systems"]
    names = [s["system"] for s in systems]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(names, [s["output_tok_s"] for s in systems], color=["#2b7bba", "#d95f02", "#7570b3"][: len(names)])
    for bar, s in zip(bars, systems):
        ax.annotate(f"{s['output_tok_s']:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("useful output tokens / s")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(rows: list[dict], path: Path, title: str) -> Path:
    """Stacked bars: the time-averaged state of the allocated (and externally fragmented) KV slots."""
    plt = _plt()
    states = [("useful", "#1b9e77"), ("reservation", "#7570b3"), ("internal", "#d95f02"), ("external", "#e7298a")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0.0] * len(rows)
    names = [r["policy"] for r in rows]
    for state, color in states:
        values = [100 * r["fractions"][state] for r in rows]
        ax.bar(names, values, bottom=bottom, label=state, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("% of occupied KV slots")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_lines(series: dict[str, tuple[list, list]], path: Path, xlabel: str, ylabel: str, title: str,
               logy: bool = False) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
