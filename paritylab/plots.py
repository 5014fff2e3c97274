"""PNG plots of a report: divergence against depth for each tower, and a layer × metric heatmap."""

from __future__ import annotations

import math
import re
from pathlib import Path

from paritylab.comparison import Report, Row

LAYER = re.compile(r"^(?P<tower>.+)\.(?P<number>\d+)$")
_FLOOR = 1e-12


def layer_rows(report: Report) -> dict[str, list[tuple[int, Row]]]:
    """Rows of numbered blocks (``...layers.3``, ``...blocks.3``), grouped by the list that holds them."""
    towers: dict[str, list[tuple[int, Row]]] = {}
    for row in report.rows:
        match = LAYER.match(row.path)
        if match and row.status in ("compared", "stats-only"):
            towers.setdefault(match["tower"], []).append((int(match["number"]), row))
    return towers


def write_plots(report: Report, directory: Path) -> list[Path]:
    """Write ``divergence_by_depth.png`` and ``layer_heatmap.png``; returns the files written."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    towers = layer_rows(report)
    written: list[Path] = []

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for tower, rows in towers.items():
        numbers = [n for n, _ in rows]
        axis.plot(numbers, [_positive(r.rel_l2) for _, r in rows], marker="o", label=f"{tower} (rel L2)")
        local = [_positive(r.local.get("local_rel_l2")) for _, r in rows]
        if any(value > _FLOOR for value in local):
            axis.plot(numbers, local, linestyle="--", marker="x", label=f"{tower} (own error, replay)")
    if not towers:  # no numbered layers: plot every compared module in execution order
        compared = [r for r in report.rows if r.rel_l2 is not None]
        axis.plot([r.index for r in compared], [_positive(r.rel_l2) for r in compared], marker=".", label="modules")
    axis.set_yscale("log")
    axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axis.set_xlabel("layer" if towers else "call index")
    axis.set_ylabel("relative L2 error")
    axis.set_title("Divergence against depth")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    written.append(_save(figure, directory / "divergence_by_depth.png"))
    plt.close(figure)

    labels, matrix = _heatmap_data(towers)
    if labels:
        columns = ["rel_l2", "max_abs", "1-cosine", "frac_outside", "own (replay)"]
        figure, axis = plt.subplots(figsize=(6.5, max(2.5, 0.28 * len(labels) + 1.5)))
        image = axis.imshow(matrix, aspect="auto", cmap="magma_r", vmin=-12, vmax=0)
        axis.set_xticks(range(len(columns)), columns, rotation=30, ha="right", fontsize=8)
        axis.set_yticks(range(len(labels)), labels, fontsize=7)
        axis.set_title("log10 divergence per layer")
        figure.colorbar(image, ax=axis, label="log10")
        figure.tight_layout()
        written.append(_save(figure, directory / "layer_heatmap.png"))
        plt.close(figure)
    return written


def _heatmap_data(towers: dict[str, list[tuple[int, Row]]]) -> tuple[list[str], list[list[float]]]:
    labels: list[str] = []
    matrix: list[list[float]] = []
    for tower, rows in towers.items():
        short = tower.rsplit(".", 2)[-2] if tower.count(".") >= 1 else tower
        for number, row in rows:
            cosine = row.metrics.get("cosine")
            values = [
                row.rel_l2,
                row.metrics.get("max_abs"),
                None if cosine is None else 1 - cosine,
                row.metrics.get("frac_outside"),
                row.local.get("local_rel_l2"),
            ]
            labels.append(f"{short}.{number}")
            matrix.append([math.log10(_positive(v)) for v in values])
    return labels, matrix


def _positive(value: float | None) -> float:
    if value is None or not math.isfinite(value):
        return _FLOOR
    return max(abs(value), _FLOOR)


def _save(figure: object, path: Path) -> Path:
    figure.savefig(path, dpi=110)  # type: ignore[attr-defined]
    return path
