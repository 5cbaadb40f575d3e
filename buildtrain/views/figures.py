"""Figures drawn with matplotlib's Agg backend: inline SVG for the HTML report, PNG for papers.

One library for both outputs: the same function draws a figure, which is saved as SVG (text kept
as text, so the page stays small and searchable, and needs no JavaScript or network) or as PNG at
print resolution. matplotlib is imported here only, when a report is asked for, so tables and
the null build never pay for it.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from buildtrain.views.curves import Curve

FIGURES = ("loss", "lr", "heldout")
# Height of one legend entry at 7 pt: 60 plans in a 3.2 in figure ran their legend past its edge.
LEGEND_ENTRY_INCHES = 0.15
PNG_DPI = 200


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3})
    return plt


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """matplotlib's layout warnings are for a person at a plot window, not for `bt report`'s
    stderr; a figure whose layout gave way shows as clipped text, which
    scripts/report_in_browser.py fails on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _loss(ax: Any, curves: Sequence[Curve]) -> None:
    for curve in curves:
        (line,) = ax.plot(curve.steps, curve.loss, linewidth=1.2, label=curve.label)
        if curve.evals:
            at, values = zip(*curve.evals, strict=True)
            ax.plot(at, values, "o", markersize=3.5, color=line.get_color())
        for boundary in curve.boundaries:
            ax.axvline(boundary, color="0.6", linewidth=0.8, linestyle=":")
    during = " (dots: held-out during training)" if any(c.evals for c in curves) else ""
    stages = "; dotted lines: stage boundaries" if any(c.boundaries for c in curves) else ""
    ax.set(xlabel="update", ylabel="loss (nats/token)", title=f"Training loss{during}{stages}")


def _lr(ax: Any, curves: Sequence[Curve]) -> None:
    for curve in curves:
        ax.plot(curve.steps, curve.lr, linewidth=1.2, label=curve.label)
    ax.set(xlabel="update", ylabel="learning rate", title="Learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))


def _heldout(ax: Any, curves: Sequence[Curve], heldout: Sequence[float | None]) -> None:
    labels = [c.label for c in curves]
    values = [v if v is not None else 0.0 for v in heldout]
    colors = [f"C{i % 10}" for i in range(len(curves))]
    bars = ax.barh(range(len(curves)), values, color=colors)
    for bar, value in zip(bars, heldout, strict=True):
        text = f"{value:.4f}" if value is not None else "not evaluated"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {text}", va="center", fontsize=8)
    ax.set_yticks(range(len(curves)), labels)
    ax.invert_yaxis()
    ax.set(xlabel="held-out loss (nats/token)", title="Held-out evaluation (final weights)")
    ax.margins(x=0.25)


def draw(name: str, curves: Sequence[Curve], heldout: Sequence[float | None]) -> Any:
    """A matplotlib Figure for one of FIGURES."""
    plt = _pyplot()
    columns = 1 if len(curves) < 12 else 2
    if name == "heldout":
        height = max(1.6, 0.35 * len(curves) + 0.9)
    else:  # tall enough for the legend beside it: a 7 pt entry takes about 0.15 in
        height = max(3.2, LEGEND_ENTRY_INCHES * math.ceil(len(curves) / columns) + 0.6)
    fig, ax = plt.subplots(figsize=(10, height), layout="constrained")
    if name == "loss":
        _loss(ax, curves)
    elif name == "lr":
        _lr(ax, curves)
    else:
        _heldout(ax, curves, heldout)
    if name != "heldout" and curves:
        # Beside the axes, never over a curve.
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncols=columns)
    return fig


def svg(name: str, curves: Sequence[Curve], heldout: Sequence[float | None]) -> str:
    """The figure as an inline `<svg>` element (no XML prologue, ids unique to this figure)."""
    plt = _pyplot()
    fig = draw(name, curves, heldout)
    buffer = io.StringIO()
    with plt.rc_context({"svg.hashsalt": f"bt-{name}", "svg.id": f"figure-{name}"}), _quiet():
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def write_pngs(folder: Path, curves: Sequence[Curve], heldout: Sequence[float | None]) -> list[Path]:
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in FIGURES:
        fig = draw(name, curves, heldout)
        path = folder / f"{name}.png"
        with _quiet():
            fig.savefig(path, dpi=PNG_DPI, metadata={"Software": None})
        plt.close(fig)
        paths.append(path)
    return paths


def suites_svg(series: Sequence[tuple[str, Sequence[tuple[int, float]]]]) -> str:
    """Each suite's accuracy over the kept checkpoints (`eval.checkpoints_every`), one line per plan and
    suite, as an inline `<svg>`."""
    plt = _pyplot()
    height = max(3.2, LEGEND_ENTRY_INCHES * len(series) + 0.6)
    fig, ax = plt.subplots(figsize=(10, height), layout="constrained")
    for label, points in series:
        at, values = zip(*points, strict=True) if points else ((), ())
        ax.plot(at, values, "o-", linewidth=1.2, markersize=3.5, label=label)
    ax.set(
        xlabel="update",
        ylabel="accuracy",
        title="Benchmark suites at the kept checkpoints (checkpoints_every)",
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    buffer = io.StringIO()
    with plt.rc_context({"svg.hashsalt": "bt-suites", "svg.id": "figure-suites"}), _quiet():
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]
