"""Figures for papers: a print style and SVG / PDF / PNG files from any cpsuper figure.

``save_figure(fig, "fig3")`` writes ``fig3.svg``, ``fig3.pdf`` and ``fig3.png``; ``save_figures``
writes many figures in one browser session (starting the browser is most of the cost). Files are
drawn by kaleido (the optional extra ``pip install 'cpsuper[export]'``) in a headless Chrome or
Chromium found on the system (``BROWSER_PATH`` names one explicitly); nothing is downloaded.

The paper style (:func:`paper_style`) works on a copy: a plain serif-free font at print sizes,
white background, no title unless asked (a paper puts it in the caption), and every signed heatmap
on the colour-blind-safe diverging scale of :mod:`cpsuper.plots.style` centred at 0. Static files
have no mode bar; :data:`PAPER_CONFIG` hides it in HTML too (``fig.show(config=PAPER_CONFIG)``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import plotly.graph_objects as go

from .style import DIVERGING

__all__ = ["EXPORT_FORMATS", "PAPER_CONFIG", "check_export", "paper_style", "save_figure", "save_figures"]

EXPORT_FORMATS: tuple[str, ...] = ("svg", "pdf", "png")
"""File formats :func:`save_figure` writes (vector: svg, pdf; raster: png)."""

PAPER_CONFIG: dict = {"displayModeBar": False, "displaylogo": False}
"""plotly config that hides the mode bar (toolbar) of an interactive figure."""

STYLES: tuple[str | None, ...] = ("paper", None)
_FONT = "Arial, Helvetica, sans-serif"


def check_export(formats: str | Sequence[str]) -> tuple[str, ...]:
    """Validate export formats (``"svg,pdf"`` or a sequence) and that kaleido is installed.

    Returns the formats, lower case, without repeats. Raises ``ValueError`` for an unknown or
    empty format list and ``ImportError`` naming the extra when kaleido is missing or older than 1.0
    (plotly refuses those), so a long run can fail before it starts.
    """
    if isinstance(formats, str):
        formats = formats.split(",")
    wanted = tuple(dict.fromkeys(f.strip().lower().lstrip(".") for f in formats if f.strip()))
    if not wanted:
        raise ValueError(f"No export format given; choose from {', '.join(EXPORT_FORMATS)}.")
    unknown = [f for f in wanted if f not in EXPORT_FORMATS]
    if unknown:
        raise ValueError(f"Unsupported export format(s) {', '.join(unknown)}; supported: {', '.join(EXPORT_FORMATS)}.")
    if importlib.util.find_spec("kaleido") is None:
        raise ImportError(
            "Writing figures as SVG / PDF / PNG needs kaleido, which is not installed. "
            "Install the optional extra: pip install 'cpsuper[export]' (it uses the Chrome or Chromium "
            "installed on the system; set BROWSER_PATH to choose one)."
        )
    version = _kaleido_version()
    if version is not None and int(version.split(".")[0]) < 1:
        raise ImportError(
            f"kaleido {version} is installed, but plotly draws static figures only with kaleido 1 or later: "
            "pip install 'cpsuper[export]' (or pip install -U 'kaleido>=1')."
        )
    return wanted


def _kaleido_version() -> str | None:
    """The installed kaleido's version, or None where its metadata cannot be read."""
    try:
        return importlib.metadata.version("kaleido")
    except importlib.metadata.PackageNotFoundError:
        return None


def _signed(trace) -> bool:
    """Whether a heatmap-like trace shows signed values (negative and positive, or centred at 0)."""
    if getattr(trace, "zmid", None) is not None:
        return True
    z = getattr(trace, "z", None)
    if z is None:
        return False
    try:
        values = np.asarray(z, dtype=float)
    except (TypeError, ValueError):
        return False
    values = values[np.isfinite(values)]
    return values.size > 0 and values.min() < 0 < values.max()


def paper_style(
    fig: go.Figure,
    *,
    font_size: int = 12,
    width: int | None = None,
    height: int | None = None,
    title: bool = False,
) -> go.Figure:
    """A copy of ``fig`` styled for print: ``font_size`` text (titles and ticks scaled from it),
    white background, thin grid, no title unless ``title=True``, signed heatmaps on the diverging
    colour-blind-safe scale centred at 0. ``width`` / ``height`` in pixels (PDF: points)."""
    if not isinstance(fig, go.Figure):
        raise TypeError(f"paper_style takes a plotly Figure, got {type(fig).__name__}.")
    if font_size < 4:
        raise ValueError(f"font_size must be at least 4 points, got {font_size}.")
    out = go.Figure(fig)
    out.update_layout(
        template="simple_white",
        font={"family": _FONT, "size": font_size, "color": "black"},
        legend={"font": {"size": font_size - 1}},
        margin={"l": 60, "r": 20, "t": 50 if title else 30, "b": 50},
        paper_bgcolor="white",
        plot_bgcolor="white",
    )
    for shape in out.layout.shapes:  # simple_white draws shapes with no line and 0.3 opacity
        if shape.type == "line":
            shape.update(line_width=2 if shape.line.width is None else shape.line.width)
            shape.update(opacity=1 if shape.opacity is None else shape.opacity)
    if not title:
        out.update_layout(title_text=None)
    else:
        out.update_layout(title_font_size=font_size + 2)
    out.update_xaxes(showgrid=True, gridcolor="#e5e5e5", tickfont_size=font_size - 1, title_font_size=font_size)
    out.update_yaxes(showgrid=True, gridcolor="#e5e5e5", tickfont_size=font_size - 1, title_font_size=font_size)
    out.update_annotations(font_size=font_size)  # panel titles
    for trace in out.data:
        if trace.type in ("heatmap", "contour") and _signed(trace):
            trace.update(colorscale=DIVERGING, zmid=0)
    for name in [k for k in out.layout if k.startswith("coloraxis")]:
        axis = out.layout[name]
        if axis.cmid is not None or (axis.cmin is not None and axis.cmax is not None and axis.cmin < 0 < axis.cmax):
            axis.update(colorscale=DIVERGING, cmid=0)
    if width is not None:
        out.update_layout(width=width)
    if height is not None:
        out.update_layout(height=height)
    return out


def _targets(path: str | Path, formats: str | Sequence[str] | None) -> list[Path]:
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if formats is None:
        formats = (suffix,) if suffix in EXPORT_FORMATS else EXPORT_FORMATS
    formats = check_export(formats)
    stem = path.with_suffix("") if suffix in EXPORT_FORMATS else path
    return [stem.parent / f"{stem.name}.{f}" for f in formats]


def save_figures(
    figures: Mapping[str | Path, go.Figure],
    *,
    formats: str | Sequence[str] | None = None,
    style: str | None = "paper",
    scale: float = 2.0,
) -> list[Path]:
    """Write each figure of ``{path: figure}`` in every format, in one browser session.

    A path with a format's suffix (``fig.pdf``) and no ``formats`` writes that format only; a
    stem writes ``formats`` (default svg, pdf and png). ``style="paper"`` applies
    :func:`paper_style` first; ``None`` keeps the figure as drawn. ``scale`` multiplies the
    pixel size of PNG files. Returns the paths written. Folders are created as needed.
    """
    if style not in STYLES:
        raise ValueError(f"Unknown style {style!r}; use 'paper' or None.")
    jobs: list[tuple[go.Figure, Path]] = []
    for path, fig in figures.items():
        if not isinstance(fig, go.Figure):
            raise TypeError(f"{path}: expected a plotly Figure, got {type(fig).__name__}.")
        styled = paper_style(fig) if style == "paper" else fig
        jobs += [(styled, target) for target in _targets(path, formats)]
    if not jobs:
        return []
    import plotly.io as pio

    for _, target in jobs:
        target.parent.mkdir(parents=True, exist_ok=True)
    try:
        pio.write_images(  # the bulk writer ignores a figure's own size unless it is passed on
            [fig for fig, _ in jobs],
            [target for _, target in jobs],
            scale=[scale if target.suffix == ".png" else 1 for _, target in jobs],
            width=[fig.layout.width for fig, _ in jobs],
            height=[fig.layout.height for fig, _ in jobs],
        )
    except Exception as err:
        if "Chrome" in type(err).__name__ or "Chrome" in str(err):
            raise RuntimeError(
                "kaleido found no Chrome or Chromium to draw the figures: install one (e.g. apt-get install "
                f"chromium) or set BROWSER_PATH to its executable. ({err})"
            ) from err
        raise
    return [target for _, target in jobs]


def save_figure(
    fig: go.Figure,
    path: str | Path,
    *,
    formats: str | Sequence[str] | None = None,
    style: str | None = "paper",
    scale: float = 2.0,
) -> list[Path]:
    """Write ``fig`` as ``path``.svg / .pdf / .png (see :func:`save_figures`); returns the paths."""
    return save_figures({path: fig}, formats=formats, style=style, scale=scale)
