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


def interval_bar(row: dict, column: str) -> tuple[float, float, float]:
    """``(value, low, high)`` of a table row's ``column`` (``column_low`` / ``_high``; NaN when it has none), for
    :func:`bar_plot`'s error bars."""
    return row[column], row.get(f"{column}_low", float("nan")), row.get(f"{column}_high", float("nan"))


def bar_plot(groups: dict[str, dict[str, float | tuple[float, float, float]]], title: str, ylabel: str, path: Path,
             reference_line: float | None = None) -> Path:
    """Grouped bars: ``groups[group][bar] = value``, or ``(value, low, high)`` for a bar with its 95 % interval
    drawn as an error bar (e.g. win rate per decoder, per policy)."""
    plt = pyplot()
    names = list(dict.fromkeys(bar for bars in groups.values() for bar in bars))  # first-seen order
    width = 0.8 / max(len(groups), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4))
    nan = float("nan")
    for i, (group, bars) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(names))]
        points = [bars.get(n, nan) for n in names]
        points = [p if isinstance(p, tuple) else (p, nan, nan) for p in points]
        values = [v for v, _, _ in points]
        # error bars as distances below / above the value; bars without an interval get none (0)
        below = [v - lo if lo == lo else 0.0 for v, lo, _ in points]
        above = [hi - v if hi == hi else 0.0 for v, _, hi in points]
        has_interval = any(lo == lo for _, lo, _ in points)
        ax.bar(xs, values, width, label=group, yerr=[below, above] if has_interval else None, capsize=3)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(names))], names)
    if reference_line is not None:
        ax.axhline(reference_line, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel(ylabel)
    ax.set_title(title + ("\n(error bars: 95 % confidence intervals)" if any(
        isinstance(p, tuple) for bars in groups.values() for p in bars.values()) else ""))
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
