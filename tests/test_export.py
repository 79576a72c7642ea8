"""Figures for papers: the paper style, format checks, the missing-extra error, and real SVG / PDF /
PNG files drawn by kaleido in the system Chromium (skipped, with the reason, where either is missing)."""

from __future__ import annotations

import importlib.util
import shutil
import xml.etree.ElementTree as ET

import plotly.graph_objects as go
import pytest

from cpsuper.plots import export
from cpsuper.plots.export import EXPORT_FORMATS, PAPER_CONFIG, check_export, paper_style, save_figure, save_figures
from cpsuper.plots.style import DIVERGING

HAVE_KALEIDO = importlib.util.find_spec("kaleido") is not None
HAVE_BROWSER = any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome"))
needs_kaleido = pytest.mark.skipif(
    not (HAVE_KALEIDO and HAVE_BROWSER),
    reason="kaleido (pip install 'cpsuper[export]') or a Chromium/Chrome browser is not installed",
)


def _figure() -> go.Figure:
    fig = go.Figure(go.Heatmap(z=[[-0.2, 0.5], [0.1, -0.05]], colorscale="Viridis"))
    fig.add_trace(go.Heatmap(z=[[0.1, 0.9], [0.3, 0.4]], colorscale="Viridis", visible=False))
    fig.update_layout(title="a title", font_size=20)
    return fig


def test_paper_style_centres_signed_heatmaps_and_keeps_the_original():
    fig = _figure()
    styled = paper_style(fig, font_size=9, width=340)
    signed, positive = styled.data
    assert signed.zmid == 0 and [c for _, c in signed.colorscale] == [
        c for _, c in go.Heatmap(colorscale=DIVERGING).colorscale
    ]
    assert positive.zmid is None and positive.colorscale == fig.data[1].colorscale  # sequential data untouched
    assert styled.layout.font.size == 9 and styled.layout.width == 340
    assert not styled.layout.title.text  # the caption carries the title
    assert paper_style(fig, title=True).layout.title.text == "a title"
    assert fig.layout.font.size == 20 and fig.data[0].zmid is None  # the input is not modified
    assert PAPER_CONFIG["displayModeBar"] is False


def test_paper_style_keeps_reference_lines_visible():
    """simple_white's shape defaults have no line width and 0.3 opacity: a reference line drawn
    without a width would vanish from every exported figure."""
    fig = go.Figure(go.Scatter(x=[0, 1], y=[0, 1]))
    fig.add_hline(y=0.5, line_dash="dot")  # no width, no opacity: plotly's own defaults apply
    fig.add_vline(x=0.5, line_width=1, opacity=0.6)  # explicit values are kept
    fig.add_vrect(x0=0.1, x1=0.2)  # a filled shape keeps the template's look
    styled = paper_style(fig)
    defaults = styled.layout.template.layout.shapedefaults
    hline, vline, rect = styled.layout.shapes
    assert defaults.line.width == 0  # the template's default that the styling must override
    assert hline.line.width == 2 and hline.opacity == 1 and hline.line.dash == "dot"
    assert vline.line.width == 1 and vline.opacity == 0.6
    assert rect.line.width is None and rect.opacity is None
    assert fig.layout.shapes[0].line.width is None  # the input is not modified


def test_paper_style_checks_its_input():
    with pytest.raises(TypeError, match="plotly Figure"):
        paper_style({"data": []})
    with pytest.raises(ValueError, match="font_size"):
        paper_style(go.Figure(), font_size=1)


@pytest.mark.parametrize("formats, expected", [("svg,PDF", ("svg", "pdf")), ([".png", "png"], ("png",))])
def test_formats_are_normalised(formats, expected):
    if not HAVE_KALEIDO:
        pytest.skip("kaleido is not installed")
    assert check_export(formats) == expected


@pytest.mark.parametrize("formats", ["jpg", "svg,eps", ["html"]])
def test_an_unsupported_format_lists_the_supported_ones(formats, tmp_path):
    with pytest.raises(ValueError, match="supported: svg, pdf, png"):
        save_figure(go.Figure(), tmp_path / "fig", formats=formats)
    assert not list(tmp_path.iterdir())


def test_no_format_is_an_error():
    with pytest.raises(ValueError, match="No export format"):
        check_export(" , ")


def test_missing_kaleido_names_the_extra(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(export.importlib.util, "find_spec", lambda name, *a: None if name == "kaleido" else real(name))
    with pytest.raises(ImportError, match=r"pip install 'cpsuper\[export\]'"):
        save_figure(go.Figure(), tmp_path / "fig", formats="svg")


def test_kaleido_older_than_one_is_refused_before_any_work(monkeypatch, tmp_path):
    real_spec, real_version = importlib.util.find_spec, export.importlib.metadata.version
    monkeypatch.setattr(
        export.importlib.util, "find_spec", lambda name, *a: object() if name == "kaleido" else real_spec(name)
    )
    monkeypatch.setattr(
        export.importlib.metadata, "version", lambda name: "0.2.1" if name == "kaleido" else real_version(name)
    )
    with pytest.raises(ImportError, match=r"kaleido 0\.2\.1 is installed.*kaleido>=1"):
        save_figure(go.Figure(), tmp_path / "fig", formats="svg")
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(export.importlib.metadata, "version", lambda name: "1.0.0")
    assert check_export("svg") == ("svg",)


def test_unknown_style_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Unknown style"):
        save_figures({tmp_path / "a": go.Figure()}, formats="svg", style="poster")


@needs_kaleido
def test_writes_svg_pdf_and_png(tmp_path):
    paths = save_figure(_figure(), tmp_path / "sub" / "heat")
    assert [p.name for p in paths] == [f"heat.{f}" for f in EXPORT_FORMATS]
    root = ET.parse(paths[0]).getroot()
    assert root.tag.endswith("svg") and len(root) > 0
    assert paths[1].read_bytes()[:5] == b"%PDF-"
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a suffix picks that one format; several figures share one browser session
    more = save_figures({tmp_path / "one.pdf": go.Figure(go.Bar(y=[1, 2])), tmp_path / "two": _figure()}, formats=None)
    assert sorted(p.name for p in more) == sorted(["one.pdf", "two.svg", "two.pdf", "two.png"])


@needs_kaleido
def test_png_keeps_each_figure_size_when_written_together(tmp_path):
    import struct

    sized = go.Figure(go.Bar(y=[1, 2])).update_layout(width=900, height=300)
    paths = save_figures(
        {tmp_path / "sized": sized, tmp_path / "plain": go.Figure(go.Bar(y=[1]))}, formats="png", scale=1
    )

    def size(path):  # width and height from the PNG's IHDR chunk
        return struct.unpack(">II", path.read_bytes()[16:24])

    assert size(paths[0]) == (900, 300)
    assert size(paths[1]) == (700, 500)  # plotly's default where the figure sets no size
