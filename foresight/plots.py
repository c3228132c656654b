"""Plots every stage writes (PNG): one figure style, matplotlib on the file-only Agg backend.

Stages run headless (DVC, Prefect workers), so pyplot is imported lazily with the Agg backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend, imported only when a stage plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(series: dict[str, tuple[Sequence[float], Sequence[float]]], title: str, xlabel: str, ylabel: str,
              path: Path, reference: tuple[float, str] | None = None,
              ylim: tuple[float, float] | None = None) -> Path:
    """One line per named (xs, ys) series; ``reference`` = (y, label) draws a dotted horizontal line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, label=name)
    if reference is not None:
        ax.axhline(reference[0], color="grey", linestyle=":", linewidth=1, label=reference[1])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def bar_plot(groups: dict[str, dict[str, float]], title: str, ylabel: str, path: Path,
             reference_line: float | None = None) -> Path:
    """Grouped bars: ``groups[group][bar] = value`` (e.g. win rate per decoder, per policy)."""
    plt = pyplot()
    names = list(dict.fromkeys(bar for bars in groups.values() for bar in bars))  # first-seen order
    width = 0.8 / max(len(groups), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4))
    for i, (group, bars) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [bars.get(n, float("nan")) for n in names], width, label=group)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(names))], names)
    if reference_line is not None:
        ax.axhline(reference_line, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
