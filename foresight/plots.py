"""Plots every stage writes (PNG): one figure style, matplotlib on the file-only Agg backend.

Stages run headless (DVC, Prefect workers), so pyplot is imported lazily with the Agg backend. What the review of
issue #34 found wrong, and what prevents it here:

* **clipped titles and legends**: every figure is saved with ``bbox_inches="tight"`` (the saved canvas grows to
  every artist: a long title, a legend placed beside the axes);
* **mixed units on one axis** (a speedup beside τ): :func:`line_panels` and :func:`bar_panels` draw one panel per
  unit (``ylabel``), the panels sharing the x axis;
* **a line hidden under another** (identical curves): each series has its own line style and markers, so a curve
  drawn over an identical one still shows its dashes and markers;
* **overlapping tick labels**: bar labels are wrapped at ``_`` / spaces, and the figure widened until they fit;
* **intervals on lines**: ``bands`` draws a series' 95 % interval as a shaded band (``fill_between``).

Each plot has a ``*_figure`` function returning the matplotlib figure (what the tests inspect) and a ``*_plot`` /
``*_panels`` function that saves it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from itertools import cycle
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Series = Mapping[str, tuple[Sequence[float], Sequence[float]]]
"""Named ``(xs, ys)`` lines."""
Bands = Mapping[str, tuple[Sequence[float], Sequence[float]]]
"""A series' name -> its ``(lows, highs)`` at the same xs (NaN where a point has no interval)."""
Bar = float | tuple[float, float, float]
"""A bar's value, or ``(value, low, high)`` with its 95 % interval (:func:`interval_bar`)."""
Groups = Mapping[str, Mapping[str, Bar]]
"""``groups[group][bar]``: bars of the same name side by side, one colour per group."""

DPI = 120
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
_MARKS_PER_LINE = 12
"""Markers per series: enough to tell lines apart, few enough to keep a noisy curve readable."""
_LEGEND_BESIDE = 2
"""Line legends with more entries go beside the axes rather than over the lines (bar legends always do: bars fill
the axes from the bottom, leaving no empty corner)."""
_LABEL_WIDTH = 14
"""Bar labels wrap at this many characters."""


def pyplot():
    """matplotlib.pyplot on the Agg backend, imported only when a stage plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG (folders made), the canvas grown to every artist (title, legend), and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    pyplot().close(fig)
    return path


def _panels(count: int, title: str, sharex: bool = True) -> tuple[Figure, list[Axes]]:
    plt = pyplot()
    fig, axes = plt.subplots(count, 1, figsize=(6.5, 2.2 + 1.8 * count), sharex=sharex, squeeze=False)
    fig.suptitle(title)
    return fig, list(axes[:, 0])


def _legend(ax: Axes, beside: bool = False) -> None:
    handles, _ = ax.get_legend_handles_labels()
    if beside or len(handles) > _LEGEND_BESIDE:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    elif handles:
        ax.legend(fontsize="small")


def _draw_lines(ax: Axes, series: Series, bands: Bands | None, styles: dict[str, dict]) -> None:
    """Each series in its style from ``styles`` (:func:`_line_styles`), its band under it where it has one."""
    for name, (xs, ys) in series.items():
        xs, ys = list(xs), list(ys)
        style = styles[name]
        every = max(1, math.ceil(len(xs) / _MARKS_PER_LINE))
        if bands and name in bands:
            lows, highs = bands[name]
            ax.fill_between(xs, lows, highs, color=style["color"], alpha=0.2, linewidth=0)
        ax.plot(xs, ys, color=style["color"], linestyle=style["linestyle"], linewidth=style["linewidth"],
                marker=style["marker"], markersize=4, markevery=(int(every * style["shift"]), every), label=name)


def _line_styles(names: Sequence[str]) -> dict[str, dict]:
    """matplotlib ``plot`` styles, one per name, so that identical curves stay apart: colour, dashes and marker
    change from one name to the next, a line drawn later is thinner than the ones under it (their edges show), and
    each line's markers sit at other points than the others' (``shift``: the fraction of the marker spacing)."""
    colors = cycle(pyplot().rcParams["axes.prop_cycle"].by_key()["color"])
    styles, markers = cycle(_STYLES), cycle(_MARKERS)
    return {name: {"color": next(colors), "linestyle": next(styles), "marker": next(markers),
                   "linewidth": max(0.8, 2.2 - 0.5 * i), "shift": i / len(names)} for i, name in enumerate(names)}


def line_panels_figure(panels: Mapping[str, Series], title: str, xlabel: str, bands: Bands | None = None,
                       references: Mapping[str, tuple[float, str]] | None = None,
                       ylims: Mapping[str, tuple[float, float]] | None = None) -> Figure:
    """One panel per unit: ``panels[ylabel]`` = its series; a series keeps its style in every panel it is in.
    ``bands[series]`` = (lows, highs) shades its interval; ``references[ylabel]`` = (y, label) draws a dotted
    horizontal line in that panel; ``ylims[ylabel]`` fixes its range."""
    fig, axes = _panels(len(panels), f"{title}\n(shaded: 95 % confidence intervals)" if bands else title)
    styles = _line_styles(list(dict.fromkeys(name for series in panels.values() for name in series)))
    for ax, (ylabel, series) in zip(axes, panels.items()):
        _draw_lines(ax, series, bands, styles)
        if references and ylabel in references:
            y, label = references[ylabel]
            ax.axhline(y, color="grey", linestyle=":", linewidth=1, label=label)
        if ylims and ylabel in ylims:
            ax.set_ylim(*ylims[ylabel])
        ax.set_ylabel(ylabel)
        _legend(ax)
    axes[-1].set_xlabel(xlabel)
    fig.tight_layout()
    return fig


def line_panels(panels: Mapping[str, Series], title: str, xlabel: str, path: Path, bands: Bands | None = None,
                references: Mapping[str, tuple[float, str]] | None = None) -> Path:
    """:func:`line_panels_figure` saved to ``path``."""
    return save(line_panels_figure(panels, title, xlabel, bands, references), path)


def line_plot(series: Series, title: str, xlabel: str, ylabel: str, path: Path,
              reference: tuple[float, str] | None = None, ylim: tuple[float, float] | None = None,
              bands: Bands | None = None) -> Path:
    """One line per named (xs, ys) series, in one unit; ``reference`` = (y, label) draws a dotted horizontal line,
    ``bands[name]`` = (lows, highs) that series' interval."""
    return save(line_panels_figure({ylabel: series}, title, xlabel, bands, {ylabel: reference} if reference else None,
                                   {ylabel: ylim} if ylim else None), path)


def interval_bar(row: dict, column: str) -> tuple[float, float, float]:
    """``(value, low, high)`` of a table row's ``column`` (``column_low`` / ``_high``; NaN when it has none), for
    :func:`bar_plot`'s error bars."""
    return row[column], row.get(f"{column}_low", float("nan")), row.get(f"{column}_high", float("nan"))


def interval_bands(rows: Sequence[dict], column: str) -> tuple[list[float], list[float]]:
    """``(lows, highs)`` of ``column`` over table rows (``column_low`` / ``_high``), for a line's ``bands``."""
    return ([r.get(f"{column}_low", float("nan")) for r in rows], [r.get(f"{column}_high", float("nan")) for r in rows])


def _wrap(label: str) -> str:
    """``label`` on lines of at most :data:`_LABEL_WIDTH` characters, broken after an underscore or at a space."""
    lines = [""]
    for token in re.findall(r"[^_ ]+_?|_| ", label):
        if token == " ":
            lines[-1] += " "
        elif lines[-1] and len(lines[-1].rstrip()) + len(token) > _LABEL_WIDTH:
            lines[-1] = lines[-1].rstrip()
            lines.append(token)
        else:
            lines[-1] += token
    return "\n".join(lines)


def _draw_bars(ax: Axes, groups: Groups, reference_line: float | None) -> None:
    """Grouped bars with their error bars."""
    names = list(dict.fromkeys(bar for bars in groups.values() for bar in bars))  # first-seen order
    width = 0.8 / max(len(groups), 1)
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
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(names))], [_wrap(n) for n in names])
    if reference_line is not None:
        ax.axhline(reference_line, color="grey", linestyle="--", linewidth=1)


def _widen_for_labels(fig: Figure, axes: Sequence[Axes]) -> None:
    """Widen the figure until every axis' (wrapped) tick labels fit side by side with a gap (turned labels would
    still cover each other's corners)."""
    for _ in range(3):  # the layout moves a little with the width: converges in one or two rounds
        fig.canvas.draw()  # places the ticks
        renderer = fig.canvas.get_renderer()
        short = 0.0
        for ax in axes:
            boxes = [label.get_window_extent(renderer) for label in ax.get_xticklabels() if label.get_text()]
            needed = 1.15 * sum(b.width for b in boxes)
            short = max(short, needed - ax.get_window_extent(renderer).width)
        if short <= 0:
            return
        fig.set_figwidth(fig.get_figwidth() + short / fig.dpi)
        fig.tight_layout()


def bar_panels_figure(panels: Mapping[str, Groups], title: str,
                      reference_lines: Mapping[str, float] | None = None) -> Figure:
    """One panel per unit: ``panels[ylabel]`` = its groups (``groups[group][bar]`` = value or (value, low, high),
    the interval drawn as an error bar); ``reference_lines[ylabel]`` draws a dashed line in that panel."""
    intervals = any(isinstance(bar, tuple) for groups in panels.values() for bars in groups.values()
                    for bar in bars.values())
    fig, axes = _panels(len(panels), f"{title}\n(error bars: 95 % confidence intervals)" if intervals else title,
                        sharex=False)
    # about an inch per bar label, and room for the legend beside the axes
    fig.set_figwidth(2 + max(6.5, 1.1 * max(len({b for g in groups.values() for b in g}) for groups in panels.values())))
    for ax, (ylabel, groups) in zip(axes, panels.items()):
        _draw_bars(ax, groups, (reference_lines or {}).get(ylabel))
        ax.set_ylabel(ylabel)
        _legend(ax, beside=True)
    fig.tight_layout()
    _widen_for_labels(fig, axes)
    return fig


def bar_panels(panels: Mapping[str, Groups], title: str, path: Path,
               reference_lines: Mapping[str, float] | None = None) -> Path:
    """:func:`bar_panels_figure` saved to ``path``."""
    return save(bar_panels_figure(panels, title, reference_lines), path)


def bar_plot(groups: Groups, title: str, ylabel: str, path: Path, reference_line: float | None = None) -> Path:
    """Grouped bars in one unit: ``groups[group][bar] = value``, or ``(value, low, high)`` for a bar with its 95 %
    interval drawn as an error bar (e.g. win rate per decoder, per policy)."""
    return save(bar_panels_figure({ylabel: groups}, title,
                                  {ylabel: reference_line} if reference_line is not None else None), path)
