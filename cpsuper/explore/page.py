"""The head explorer as a static, offline HTML page: the data of :func:`cpsuper.explore.data.
explorer_data` inlined as JSON, plotly.js inlined once, and the page's own JavaScript linking a
click on the layer x head heatmap to the head's panels.

For tests and screenshots the page reads ``#click=LAYER,HEAD`` from its address: it then clicks
that heatmap cell with synthetic mouse events (the path a person's click takes through plotly)
and writes the selected head's panel title into ``document.title``.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from ..plots.style import CONFLICT_COLORS, DIVERGING, TARGET_COLORS, conflict_label, scale_phrase

__all__ = ["explorer_fragment", "explorer_html", "write_explorer_page"]

_STYLE = """
.cp-explorer{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;color:#222;max-width:1360px}
.cp-explorer .cp-controls label{margin-right:14px;font-size:14px}
.cp-explorer select{font-size:14px;margin-left:4px}
.cp-explorer .cp-grid{display:grid;grid-template-columns:560px 1fr;gap:8px 16px;margin-top:8px}
.cp-explorer .cp-head-title{margin:4px 0;font-size:18px}
.cp-explorer table{border-collapse:collapse;font-size:13px}
.cp-explorer td,.cp-explorer th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left}
.cp-explorer td:first-child{overflow-wrap:anywhere}
.cp-explorer .cp-note{font-size:13px;color:#555;margin:4px 0}
"""

_SCRIPT = r"""
(function () {
  const root = document.currentScript.parentElement;
  const $ = (cls) => root.querySelector("." + cls);
  const fail = (err) => { document.title = "explorer error: " + err; console.error(err); };
  try {
    const D = JSON.parse($("cp-explorer-data").textContent);
    const S = JSON.parse($("cp-explorer-style").textContent);
    const L = D.model.n_layers, H = D.model.n_heads;
    const state = {head: null};
    const config = {displayModeBar: false, responsive: true};  // drag to zoom, double-click to reset
    const fmt = (x) => (x === null || x === undefined ? "n/a" : (x >= 0 ? "+" : "") + x.toFixed(4));
    // Labels come from datasets and are untrusted. The page never parses them as HTML: it sets
    // them as text (node below, textContent), and escapes them for plotly, whose titles, ticks,
    // legends and hovers read a small subset of HTML and decode entities back to the literal text.
    const esc = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
    const node = (tag, children, cls) => {
      const e = document.createElement(tag);
      if (cls) e.className = cls;
      e.append(...[].concat(children));  // strings become text nodes
      return e;
    };
    const ctName = (c) => S.conflict_labels[c] || c;
    const ctLabel = (c) => esc(ctName(c));
    function fill(cls, options) {
      const el = $(cls);
      options.forEach(([value, text]) => { const o = document.createElement("option"); o.value = value; o.textContent = text; el.appendChild(o); });
      el.addEventListener("change", refresh);
      return el;
    }
    const sel = {
      target: fill("cp-target", D.targets.map((t) => [t, "p(" + t + ")"])),
      ct: fill("cp-ct", D.conflict_types.map((c) => [c, ctName(c)])),
      alpha: fill("cp-alpha", D.alphas.map((a) => [a, S.alpha_labels[a]])),
      example: fill("cp-example", D.examples.map((e, i) => [i, e.index + ": " + e.subject])),
    };
    const hm = $("cp-heatmap");
    const cell = () => D.effects[sel.alpha.value][sel.target.value][sel.ct.value];
    function drawHeatmap() {
      const g = cell();
      let m = 0;
      g.mean.forEach((row) => row.forEach((v) => { if (v !== null) m = Math.max(m, Math.abs(v)); }));
      m = m > 0 ? m * 1.05 : 1;
      const custom = g.mean.map((row, l) => row.map((_, h) => [g.low[l][h], g.high[l][h], g.n[l][h]]));
      const heads = [...Array(H).keys()], layers = [...Array(L).keys()];
      const traces = [
        {type: "heatmap", z: g.mean, x: heads, y: layers, customdata: custom, colorscale: S.diverging,
         zmin: -m, zmax: m, zmid: 0, colorbar: {title: {text: "Δ"}, exponentformat: "e"},
         hovertemplate: "L%{y}H%{x}<br>Δ %{z:.4f}<br>" + Math.round(D.ci * 100) +
           "% CI [%{customdata[0]:.4f}, %{customdata[1]:.4f}]<br>n = %{customdata[2]}<extra></extra>"},
        {type: "scatter", mode: "markers", x: [], y: [], hoverinfo: "skip",
         marker: {symbol: "square-open", size: 18, color: "black", line: {width: 2}}},
      ];
      const title = "Δ " + esc(D.metric) + " of p(" + esc(sel.target.value) + "), " + ctLabel(sel.ct.value) + ", head " + esc(S.alpha_labels[sel.alpha.value]);
      const layout = {title: {text: title, font: {size: 14}}, height: 460, template: "plotly_white", showlegend: false,
        margin: {t: 50, l: 60, r: 20, b: 50}, xaxis: {title: {text: "head"}, dtick: 1}, yaxis: {title: {text: "layer"}, dtick: 1}};
      return Plotly.react(hm, traces, layout, config);
    }
    function bars(el, traces, title, ytitle) {
      return Plotly.react(el, traces, {title: {text: title, font: {size: 14}}, height: 270, barmode: "group",
        template: "plotly_white", margin: {t: 45, l: 60, r: 20, b: 40}, yaxis: {title: {text: ytitle}, zeroline: true, exponentformat: "e"},
        legend: {orientation: "h", y: -0.2}}, config);
    }
    function drawEffects(l, h, name) {
      const a = sel.alpha.value, types = D.conflict_types;
      const traces = D.targets.map((t) => {
        const g = types.map((c) => D.effects[a][t][c]);
        const y = g.map((e) => e.mean[l][h]);
        return {type: "bar", name: "p(" + esc(t) + ")", x: types.map(ctLabel), y: y, marker: {color: S.target_colors[t]},
          customdata: g.map((e) => e.n[l][h]), hovertemplate: "%{x}: Δ %{y:.4f}, n = %{customdata}",
          error_y: {type: "data", symmetric: false, array: g.map((e, i) => e.high[l][h] - y[i]), arrayminus: g.map((e, i) => y[i] - e.low[l][h])}};
      });
      return bars($("cp-effects"), traces, name + ": effect per conflict type (" + Math.round(D.ci * 100) + "% bootstrap CI)", "Δ " + esc(D.metric));
    }
    function drawDla(l, h, name) {
      if (!D.dla) { $("cp-dla").textContent = "No attribution was given: no source-token DLA."; return null; }
      const traces = D.conflict_types.filter((c) => D.dla[c]).map((c) => ({type: "bar", name: ctLabel(c), x: D.spans.map(esc), y: D.dla[c].dla[l][h],
        marker: {color: S.conflict_colors[c]}, customdata: D.dla[c].attention[l][h],
        hovertemplate: "%{x}: DLA %{y:.4f}, attention %{customdata:.3f}"}));  // the trace's name shows beside it
      return bars($("cp-dla"), traces, name + ": DLA (" + esc(D.direction) + ") by prompt span", "DLA");
    }
    function drawAttention(l, h, name) {
      const ex = D.examples[sel.example.value];
      const p = ex && ex.prompts[sel.ct.value];
      if (!p) { $("cp-attention").textContent = "No stored prompt for this example and conflict type."; return null; }
      const label = (i) => i + " " + esc(p.tokens[i].replace(/\n/g, "⏎"));
      const x = p.tokens.map((_, i) => label(i)), y = p.queries.map(label);
      const trace = {type: "heatmap", z: p.attention[l][h], x: x, y: y, colorscale: S.sequential, zmin: 0,
        hovertemplate: "query %{y}<br>key %{x}<br>attention %{z:.3f}<extra></extra>", colorbar: {title: {text: "attn"}}};
      return Plotly.react($("cp-attention"), [trace], {title: {text: name + " attention, example " + ex.index + " (" + esc(ex.subject) + "), " + ctLabel(sel.ct.value), font: {size: 14}},
        height: 330, template: "plotly_white", margin: {t: 45, l: 120, r: 20, b: 110}, xaxis: {tickangle: -60, automargin: true},
        yaxis: {autorange: "reversed", automargin: true}}, config);
    }
    function drawRoles(l, h, name) {
      const r = D.roles[sel.alpha.value];
      const box = $("cp-roles");
      if (!r) { box.replaceChildren(node("p", "Roles need a scale other than 1 and both targets (" + (D.roles_note || "") + ").", "cp-note")); return; }
      const header = node("tr", ["conflict", "role", ...D.targets.map((t) => "Δp(" + t + ")")].map((text) => node("th", text)));
      const rows = D.conflict_types.filter((c) => r[c]).map((c) => node("tr", [node("td", ctName(c)), node("td", node("b", r[c][l][h] || "n/a")),
        ...D.targets.map((t) => node("td", fmt(D.effects[sel.alpha.value][t][c].mean[l][h])))]));
      box.replaceChildren(node("p", [node("b", name + ": role per conflict type"), " (head " + S.alpha_labels[sel.alpha.value] + ")"]),
        node("table", [header, ...rows]));
    }
    function select(l, h) {
      if (!(Number.isInteger(l) && Number.isInteger(h) && l >= 0 && l < L && h >= 0 && h < H)) throw new Error("no head " + l + "," + h);
      state.head = [l, h];
      const name = "L" + l + "H" + h;
      $("cp-head-title").textContent = name + ": head " + S.alpha_labels[sel.alpha.value];
      root.dataset.selected = name;
      return Promise.all([Plotly.restyle(hm, {x: [[h]], y: [[l]]}, [1]), drawEffects(l, h, name), drawDla(l, h, name),
        drawAttention(l, h, name), drawRoles(l, h, name)]);
    }
    function refresh() { return drawHeatmap().then(() => select(...state.head)).catch(fail); }
    function strongest() {
      let best = [0, 0], m = -1;
      cell().mean.forEach((row, l) => row.forEach((v, h) => { if (v !== null && Math.abs(v) > m) { m = Math.abs(v); best = [l, h]; } }));
      return best;
    }
    function clickCell(l, h) {
      // A person's click: move over the cell (plotly computes the hover point), then press and release.
      const fl = hm._fullLayout, box = hm.getBoundingClientRect();
      const opts = {bubbles: true, cancelable: true, view: window, button: 0,
        clientX: box.left + fl.xaxis._offset + fl.xaxis.l2p(h), clientY: box.top + fl.yaxis._offset + fl.yaxis.l2p(l)};
      const target = hm.querySelector(".nsewdrag");
      ["mousemove", "mousedown", "mouseup", "click"].forEach((t) => target.dispatchEvent(new MouseEvent(t, opts)));
    }
    state.head = strongest();
    const ready = drawHeatmap().then(() => {
      hm.on("plotly_click", (ev) => {
        const p = ev.points.find((q) => q.curveNumber === 0);
        if (p) select(p.y, p.x).then(() => { if (root.dataset.harness) document.title = "selected " + $("cp-head-title").textContent; }).catch(fail);
      });
      return select(...state.head);
    });
    const m = location.hash.match(/click=(\d+),(\d+)/);
    ready.then(() => {
      if (!m) return;
      root.dataset.harness = "1";
      document.title = "clicked, no update";
      setTimeout(() => { try { clickCell(+m[1], +m[2]); } catch (err) { fail(err); } }, 100);
    }).catch(fail);
  } catch (err) { fail(err); }
})();
"""  # noqa: E501 (JavaScript)


def _json(value) -> str:
    """JSON safe inside a ``<script>`` element: ``<``, ``>`` and ``&`` are written as ``\\u`` escapes,
    so no label can close the element (``</script>``) or open a comment (``<!--``) in it."""
    text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def explorer_fragment(data: dict) -> str:
    """The explorer as one ``<div>`` (data, controls, panels, script) for a page that has already
    loaded plotly.js, such as the ``cpsuper reproduce`` report."""
    style = {
        "conflict_colors": CONFLICT_COLORS,
        "target_colors": TARGET_COLORS,
        "conflict_labels": {c: conflict_label(c) for c in data["conflict_types"]},
        "alpha_labels": {a: scale_phrase(float(a)) for a in data["alphas"]},
        "diverging": DIVERGING,
        "sequential": "Viridis",
    }
    model = data["model"]
    note = (
        f"{html.escape(model['name'])} ({model['n_layers']} layers x {model['n_heads']} heads), dataset "
        f"{html.escape(data['dataset'])}, {data['n_facts']} facts. Δ = change in the answer's "
        f"{html.escape(data['metric'])} when the head is scaled; intervals are {data['ci']:.0%} bootstrap "
        "intervals over facts. Click a cell to select a head."
    )
    return (
        f"<div class='cp-explorer'><style>{_STYLE}</style>"
        f"<script type='application/json' class='cp-explorer-data'>{_json(data)}</script>"
        f"<script type='application/json' class='cp-explorer-style'>{_json(style)}</script>"
        f"<p class='cp-note'>{note}</p><div class='cp-controls'>"
        "<label>target<select class='cp-target'></select></label>"
        "<label>conflict type<select class='cp-ct'></select></label>"
        "<label>scale<select class='cp-alpha'></select></label>"
        "<label>example<select class='cp-example'></select></label></div>"
        "<div class='cp-grid'><div><div class='cp-heatmap'></div><div class='cp-roles'></div></div>"
        "<div><h3 class='cp-head-title'></h3><div class='cp-effects'></div><div class='cp-dla'></div></div></div>"
        "<div class='cp-attention'></div>"
        f"<script>{_SCRIPT}</script></div>"
    )


def explorer_html(data: dict, *, title: str = "cpsuper head explorer") -> str:
    """A complete, self-contained HTML page (plotly.js inlined; works offline)."""
    from plotly.offline import get_plotlyjs

    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<script type='text/javascript'>{get_plotlyjs()}</script></head>"
        f"<body><h2 style='font-family:system-ui,sans-serif'>{html.escape(title)}</h2>"
        f"{explorer_fragment(data)}</body></html>"
    )


def write_explorer_page(path: str | Path, data: dict, *, title: str = "cpsuper head explorer") -> Path:
    """Write :func:`explorer_html` of ``data`` (from :func:`explorer_data`) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(explorer_html(data, title=title), encoding="utf-8")
    return path
