"""``foresight/plots.py``: the figure faults issue #34's review found (clipped titles, lines hidden under others,
overlapping bar labels, mixed units on one axis, no intervals on lines), checked on the matplotlib figures."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.image import imread

from foresight.plots import DPI, bar_panels_figure, line_panels_figure, line_plot, pyplot, save


def test_line_plot_draws_interval_bands(tmp_path):
    xs, ys = [1, 2, 4, 8], [1.2, 1.4, 1.5, 1.8]
    lows, highs = [1.0, 1.1, 1.3, 1.2], [1.5, 1.6, 1.9, 2.6]
    fig = line_panels_figure({"× speed": {"speedup": (xs, ys), "other": (xs, ys[::-1])}}, "t", "block size",
                             bands={"speedup": (lows, highs)})
    (ax,) = fig.axes[:1]
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]  # one band: "other" has none
    vertices = band.get_paths()[0].vertices
    assert math.isclose(vertices[:, 1].min(), min(lows)) and math.isclose(vertices[:, 1].max(), max(highs))
    assert sorted(set(vertices[:, 0])) == xs
    line = next(li for li in ax.get_lines() if li.get_label() == "speedup")
    assert np.allclose(band.get_facecolor()[0][:3], pyplot().matplotlib.colors.to_rgb(line.get_color()))
    pyplot().close(fig)
    # the path of line_plot takes bands too
    assert line_plot({"speedup": (xs, ys)}, "t", "x", "y", tmp_path / "p.png", bands={"speedup": (lows, highs)}).is_file()


def test_long_title_is_not_clipped(tmp_path):
    """The saved PNG is as wide as the title (a figure saved without ``bbox_inches="tight"`` cuts it)."""
    title = "A title longer than the figure is wide: " + "speedup over HF greedy, batch 1, same run; " * 3
    fig = bar_panels_figure({"× greedy": {"base": {"greedy": 1.0, "sla": (1.4, 1.2, 1.6)}}}, title)
    fig.set_dpi(DPI)  # measured as saved
    fig.canvas.draw()
    title_px = fig._suptitle.get_window_extent().width
    assert title_px > 1.3 * fig.get_figwidth() * DPI  # the case: much wider than the figure
    width_px = imread(save(fig, tmp_path / "bars.png")).shape[1]
    assert width_px >= 0.99 * title_px  # (text is laid out again on saving: a pixel or two of rounding)


def test_identical_lines_stay_apart():
    """Two identical curves: the one under shows (wider, other dashes and marker, markers at other points)."""
    xs = list(range(100))
    fig = line_panels_figure({"τ": {"fixed": (xs, [1.5] * 100), "adaptive": (xs, [1.5] * 100)}}, "t", "step")
    under, over = fig.axes[0].get_lines()[:2]
    assert under.get_linewidth() > over.get_linewidth()
    assert under.get_linestyle() != over.get_linestyle() and under.get_marker() != over.get_marker()
    assert under.get_markevery() != over.get_markevery()
    pyplot().close(fig)


def test_long_bar_labels_do_not_overlap_and_units_get_panels():
    names = [f"sla_tuned_variant_number_{i}_long" for i in range(8)]
    fig = bar_panels_figure({"× greedy tokens/s": {"base": {n: 1.0 + i / 10 for i, n in enumerate(names)}},
                             "τ": {"base": {n: 2.0 for n in names}}}, "two units")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert [ax.get_ylabel() for ax in fig.axes[:2]] == ["× greedy tokens/s", "τ"]
    for ax in fig.axes[:2]:
        boxes = sorted((label.get_window_extent(renderer) for label in ax.get_xticklabels()), key=lambda b: b.x0)
        assert len(boxes) == len(names)
        assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), "tick labels overlap"
    pyplot().close(fig)
