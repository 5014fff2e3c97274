"""SVG plots of a report: divergence against depth for each tower, and a layer × metric heatmap.

Written as plain SVG text (no plotting library to import, which would cost a second per run); MLflow's
artifact viewer and every browser display them, and the HTML report embeds them inline.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: publishing a trend plot needs no torch
    from paritylab.comparison.report import Report, Row


LAYER = re.compile(r"^(?P<tower>.+)\.(?P<number>\d+)$")
_FLOOR = 1e-12
_LOG_RANGE = (-12, 0)
"""log10 range of the heatmap colour scale."""
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
_MAGMA = (
    (0.0, (252, 253, 191)),
    (0.25, (252, 137, 97)),
    (0.5, (183, 55, 121)),
    (0.75, (81, 18, 124)),
    (1.0, (0, 0, 4)),
)
"""Anchors of the reversed magma colour map: 0 is small (pale), 1 is large (dark)."""

Series = tuple[str, list[tuple[float, float]], bool]
"""A line: label, ``(x, y)`` points, dashed."""


def layer_rows(report: Report) -> dict[str, list[tuple[int, Row]]]:
    """Rows of numbered blocks (``...layers.3``, ``...blocks.3``), grouped by the list that holds them."""
    towers: dict[str, list[tuple[int, Row]]] = {}
    for row in report.rows:
        match = LAYER.match(row.path)
        if match and row.status in ("compared", "stats-only"):
            towers.setdefault(match["tower"], []).append((int(match["number"]), row))
    return towers


def write_plots(report: Report, directory: Path) -> list[Path]:
    """Write ``divergence_by_depth.svg`` and, with numbered layers, ``layer_heatmap.svg``; returns the files."""
    directory.mkdir(parents=True, exist_ok=True)
    towers = layer_rows(report)
    series: list[Series] = []
    for tower, rows in towers.items():
        series.append((f"{tower} (rel L2)", [(float(n), _positive(r.rel_l2)) for n, r in rows], False))
        local = [(float(n), _positive(own_error(r))) for n, r in rows]
        if any(value > _FLOOR for _, value in local):
            series.append((f"{tower} (own error: the layer fed the reference's input)", local, True))
    if not towers:  # no numbered layers: every compared module in execution order
        compared = [r for r in report.rows if r.rel_l2 is not None]
        series.append(("modules", [(r.index, _positive(r.rel_l2)) for r in compared], False))
    written = [directory / "divergence_by_depth.svg"]
    written[0].write_text(line_chart(series, "Divergence against depth", "layer" if towers else "call index"))
    labels, matrix = _heatmap_data(towers)
    if labels:
        columns = ["rel_l2", "1-cosine", "outside", "own error"]
        written.append(directory / "layer_heatmap.svg")
        title = "divergence per layer, against its tolerance"
        written[1].write_text(heatmap(labels, columns, matrix, title, relative=True))
    return written


def own_error(row: Row) -> float | None:
    """A layer's own error for charts: its output fed the reference's input, everything inside it included
    (``layer_rel_l2``, from :func:`~paritylab.comparison.replay.layer_replay`), else the isolated replay's."""
    value = row.local.get("layer_rel_l2", row.local.get("local_rel_l2"))
    return None if value is None else float(value)


def trend_heatmap(
    histories: dict[str, list[tuple[int, float]]], title: str, limits: dict[str, float] | None = None
) -> str:
    """Layer × night: ``histories`` maps a layer to its ``(timestamp ms, relative error)`` points; columns
    are the nights (dates, oldest first), cells log10 of the error (a night without a point is left at the
    bottom of the scale). Given ``limits`` (a layer's relative tolerance), cells are the error against it:
    within tolerance calm, over it alarming."""
    import datetime

    stamps = sorted({stamp for points in histories.values() for stamp, _ in points})
    columns = [datetime.datetime.fromtimestamp(stamp / 1000, datetime.UTC).strftime("%m-%d %H:%M") for stamp in stamps]
    labels = sorted(histories)
    matrix = []
    limits = limits or {}
    relative = bool(limits) and all(limits.get(label, 0) > 0 for label in labels)
    for label in labels:
        by_stamp, limit = dict(histories[label]), limits.get(label, 1.0) if relative else 1.0
        matrix.append([_log_ratio(by_stamp.get(stamp), limit) for stamp in stamps])
    return heatmap(labels, columns, matrix, title, relative=relative)


def _log_ratio(value: float | None, limit: float | None) -> float:
    """log10 of ``value / limit`` (a missing or zero value sits at the bottom of the scale)."""
    if not limit or limit <= 0:
        return math.log10(_positive(value))
    return math.log10(_positive(value) / limit) if value else _RELATIVE_RANGE[0]


def line_chart(series: Sequence[Series], title: str, x_label: str) -> str:
    """A log-scale line chart with a legend; y values must be positive."""
    width, height, left, right, top, bottom = 760, 420, 70, 20, 40, 50 + 16 * len(series)
    points = [p for _, line, _ in series for p in line]
    if not points:
        points = [(0.0, 1.0)]
    x_low, x_high = min(x for x, _ in points), max(x for x, _ in points)
    y_low = math.floor(math.log10(min(y for _, y in points)))
    y_high = max(math.ceil(math.log10(max(y for _, y in points))), y_low + 1)
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x_low) / ((x_high - x_low) or 1) * plot_w

    def sy(y: float) -> float:
        return top + (y_high - math.log10(y)) / (y_high - y_low) * plot_h

    parts = [_svg_open(width, height), _text(width / 2, 24, title, size=15, anchor="middle")]
    step = max(1, (y_high - y_low) // 8)
    for power in range(y_low, y_high + 1, step):
        y = sy(10.0**power)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        parts.append(_text(left - 6, y + 4, f"1e{power}", anchor="end"))
    for x in _integer_ticks(x_low, x_high):
        parts.append(_text(sx(x), top + plot_h + 16, f"{x:g}", anchor="middle"))
    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#999"/>')
    parts.append(_text(left + plot_w / 2, top + plot_h + 34, x_label, anchor="middle"))
    parts.append(_text(16, top + plot_h / 2, "relative L2 error", anchor="middle", rotate=True))
    for number, (label, line, dashed) in enumerate(series):
        colour = _COLOURS[number % len(_COLOURS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in line)
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}/>')
        parts.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in line)
        legend_y = height - 12 - 16 * (len(series) - 1 - number)
        parts.append(
            f'<line x1="{left}" x2="{left + 24}" y1="{legend_y - 4}" y2="{legend_y - 4}" stroke="{colour}"{dash}/>'
        )
        parts.append(_text(left + 30, legend_y, label))
    return "\n".join([*parts, "</svg>\n"])


def heatmap(
    labels: Sequence[str],
    columns: Sequence[str],
    matrix: Sequence[Sequence[float]],
    title: str,
    relative: bool = False,
) -> str:
    """A labelled grid of cells coloured by value on the ``_LOG_RANGE`` scale, with a colour bar. ``relative``:
    the values are log10 of a ratio to a tolerance, drawn on a scale that is calm (greens) up to 1 and alarming
    (orange to dark red) above it, with the tolerance marked on the bar."""
    if relative:
        return _heatmap(labels, columns, matrix, title, _RELATIVE_RANGE, _relative_colour, "× tolerance")
    return _heatmap(labels, columns, matrix, title, _LOG_RANGE, _colour, "")


def _heatmap(
    labels: Sequence[str],
    columns: Sequence[str],
    matrix: Sequence[Sequence[float]],
    title: str,
    scale: tuple[int, int],
    colour: Callable[[float], str],
    unit: str,
) -> str:
    cell_w, cell_h, top = 90, 16, 60
    left = max(150, 10 + 7 * max((len(label) for label in labels), default=0))  # room for the longest label
    bar_h = max(cell_h * len(labels), 120)
    width, height = left + cell_w * len(columns) + (150 if unit else 90), top + bar_h + 20
    width = max(width, round(20 + 7.5 * len(title)))  # the title whole (14 px text)
    parts = [_svg_open(width, height), _text(width / 2, 22, title, size=14, anchor="middle")]
    for column, name in enumerate(columns):
        parts.append(_text(left + cell_w * (column + 0.5), top - 8, name, anchor="middle"))
    for row, (label, values) in enumerate(zip(labels, matrix, strict=True)):
        y = top + row * cell_h
        parts.append(_text(left - 6, y + cell_h - 4, label, anchor="end"))
        for column, value in enumerate(values):
            said = f"{10**value:.2g}{unit}" if unit else f"1e{value:.1f}"
            parts.append(
                f'<rect x="{left + column * cell_w}" y="{y}" width="{cell_w}" height="{cell_h}" '
                f'fill="{colour(value)}"><title>{escape(label)} {escape(columns[column])}: {escape(said)}</title>'
                "</rect>"
            )
    bar_x, (low, high) = left + cell_w * len(columns) + 20, scale
    for step in range(high - low):
        bar_y = top + step * bar_h / (high - low)
        parts.append(
            f'<rect x="{bar_x}" y="{bar_y:.1f}" width="14" height="{bar_h / (high - low) + 0.5:.1f}" '
            f'fill="{colour(high - step - 0.5)}"/>'
        )
    parts.append(_text(bar_x + 18, top + 8, f"1e{high}{unit}"))
    parts.append(_text(bar_x + 18, top + bar_h, f"1e{low}{unit}"))
    if unit:  # where the tolerance sits on the bar
        mark = top + high * bar_h / (high - low)
        parts.append(f'<line x1="{bar_x - 3}" x2="{bar_x + 17}" y1="{mark:.1f}" y2="{mark:.1f}" stroke="#000"/>')
        parts.append(_text(bar_x + 18, mark + 4, "tolerance"))
    return "\n".join([*parts, "</svg>\n"])


def _heatmap_data(towers: dict[str, list[tuple[int, Row]]]) -> tuple[list[str], list[list[float]]]:
    """Per layer, each measure against what its tolerance allows (log10 of the ratio): relative errors against
    the relative tolerance (``rtol``, or the noise floor's allowance where that is wider), ``1-cosine`` against
    what that error would give (``rtol**2 / 2``), the share of elements outside their tolerance against
    one element in a thousand."""
    labels: list[str] = []
    matrix: list[list[float]] = []
    for tower, rows in towers.items():
        for number, row in rows:
            limit = relative_limit(row)
            cosine = row.metrics.get("cosine")
            values = [
                _log_ratio(row.rel_l2, limit),
                _log_ratio(None if cosine is None else 1 - cosine, limit * limit / 2),
                _log_ratio(row.metrics.get("frac_outside"), 1e-3),
                _log_ratio(own_error(row), limit),
            ]
            labels.append(layer_label(f"{tower}.{number}"))
            matrix.append(values)
    return labels, matrix


def relative_limit(row: Row, noise_multiple: float = 4.0) -> float:
    """The relative L2 error a row may show and still pass: its tolerance's L2 bound (``atol * sqrt(n) + rtol *
    |reference|``, the ``norm_bound`` metric) over the reference's norm, else its ``rtol`` (float32's when it
    has none); ``noise_multiple`` times its noise floor where that is wider."""
    limit = row.tolerance.rtol if row.tolerance is not None and row.tolerance.rtol > 0 else 1.3e-6
    bound, error, relative = (row.metrics.get(key) for key in ("norm_bound", "err_l2", "rel_l2"))
    if bound and error and relative and error > 0 and relative > 0:
        limit = bound / (error / relative)  # the reference's norm is err_l2 / rel_l2
    return max(limit, noise_multiple * row.floor) if row.floor else limit


def layer_label(path: str) -> str:
    """A numbered layer's short name: ``model.language_model.layers.1`` -> ``language_model.1``."""
    match = LAYER.match(path)
    if match is None:
        return path
    tower = match["tower"]
    return f"{tower.rsplit('.', 2)[-2] if '.' in tower else tower}.{match['number']}"


def _colour(log_value: float) -> str:
    """Reversed magma colour of a log10 value on the ``_LOG_RANGE`` scale."""
    low, high = _LOG_RANGE
    return _ramp(_MAGMA, min(max((log_value - low) / (high - low), 0.0), 1.0))


_RELATIVE_RANGE = (-6, 3)
"""log10 range of a tolerance-relative colour scale: a millionth of the tolerance to a thousand times it."""
_CALM = ((0.0, (247, 252, 245)), (1.0, (161, 217, 155)))
_ALARM = ((0.0, (254, 178, 76)), (0.5, (227, 26, 28)), (1.0, (103, 0, 13)))


def _relative_colour(log_ratio: float) -> str:
    """Pale to light green up to the tolerance (log ratio 0), orange to dark red above it."""
    low, high = _RELATIVE_RANGE
    if log_ratio <= 0:
        return _ramp(_CALM, min(max((log_ratio - low) / -low, 0.0), 1.0))
    return _ramp(_ALARM, min(log_ratio / high, 1.0))


def _ramp(anchors: Sequence[tuple[float, tuple[int, int, int]]], position: float) -> str:
    for (start, first), (end, second) in itertools.pairwise(anchors):
        if position <= end:
            weight = (position - start) / ((end - start) or 1)
            red, green, blue = (round(a + (b - a) * weight) for a, b in zip(first, second, strict=True))
            return f"#{red:02x}{green:02x}{blue:02x}"
    red, green, blue = anchors[-1][1]
    return f"#{red:02x}{green:02x}{blue:02x}"


def _integer_ticks(low: float, high: float, count: int = 10) -> list[int]:
    step = max(1, math.ceil((high - low) / count))
    return list(range(math.ceil(low), math.floor(high) + 1, step))


def _svg_open(width: int, height: int) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="system-ui, sans-serif" font-size="11">'
        f'<rect width="{width}" height="{height}" fill="white"/>'
    )


def _text(x: float, y: float, text: str, *, size: int = 11, anchor: str = "start", rotate: bool = False) -> str:
    transform = f' transform="rotate(-90 {x:.1f} {y:.1f})"' if rotate else ""
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{transform}>{escape(text)}</text>'


def _positive(value: float | None) -> float:
    if value is None or not math.isfinite(value):
        return _FLOOR
    return max(abs(value), _FLOOR)
