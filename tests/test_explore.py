"""The head explorer on the tiny model: its precomputed data equal the analyses' own numbers, the
Jupyter widget's panels follow a selected head, bad input fails clearly, and the static page,
opened in headless Chromium, updates the head's panels when a heatmap cell is clicked."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
from plotly.callbacks import Points

import cpsuper as cp
from cpsuper.attention import attention_patterns
from cpsuper.explore import (
    SPANS,
    HeadExplorer,
    explore,
    explorer_data,
    explorer_html,
    head_effects,
    write_explorer_page,
)
from cpsuper.roles import head_roles
from cpsuper.stats import sweep_intervals

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
N_BOOT = 200


@pytest.fixture(scope="module")
def facts(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=4, tokenizer=tiny_gemma)


@pytest.fixture(scope="module")
def sweep(tiny_gemma, facts):
    return cp.head_sweep(tiny_gemma, facts, (0.0, 2.0), progress=False)


@pytest.fixture(scope="module")
def attribution(tiny_gemma, facts):
    return cp.direct_logit_attribution(tiny_gemma, facts, ["parametric-context", "parametric"], progress=False)


@pytest.fixture(scope="module")
def data(tiny_gemma, facts, sweep, attribution):
    return explorer_data(tiny_gemma, facts, sweep=sweep, attribution=attribution, examples=[0, 2], n_boot=N_BOOT)


def test_precomputed_effects_and_roles_equal_the_analyses(tiny_gemma, sweep, data):
    intervals = sweep_intervals(sweep, n_boot=N_BOOT)
    summary = sweep.summary
    for row in intervals.itertuples():
        cell = data["effects"][f"{row.alpha:g}"][row.target][row.conflict_type]
        assert cell["mean"][row.layer][row.head] == pytest.approx(row.mean, rel=1e-5, abs=1e-9)
        assert cell["low"][row.layer][row.head] == pytest.approx(row.ci_low, rel=1e-5, abs=1e-9)
        assert cell["high"][row.layer][row.head] == pytest.approx(row.ci_high, rel=1e-5, abs=1e-9)
        assert cell["n"][row.layer][row.head] == row.n == 4
    for row in summary.itertuples():  # the plain means, independent of the bootstrap
        cell = data["effects"][f"{row.alpha:g}"][row.target][row.conflict_type]
        assert cell["mean"][row.layer][row.head] == pytest.approx(row.delta_mean, rel=1e-5, abs=1e-9)
    for alpha in (0.0, 2.0):
        roles = head_roles(sweep, alpha=alpha, n_boot=N_BOOT)
        for row in roles.itertuples():
            assert data["roles"][f"{alpha:g}"][row.conflict_type][row.layer][row.head] == row.role
    assert data["model"] == {"name": "tiny-gemma", "n_layers": 3, "n_heads": 4}
    assert data["n_facts"] == 4 and data["alphas"] == ["0", "2"]


def test_precomputed_dla_is_the_attributions_source_dla_by_span(data, attribution):
    s = attribution.sources[attribution.sources.direction == "parametric-context"]
    assert data["direction"] == "parametric-context"
    for (conflict_type, layer, head), rows in s.groupby(["conflict_type", "layer", "head"]):
        for k, groups in enumerate(SPANS.values()):
            per_fact = rows[rows.group.isin(groups)].groupby("example")[["dla", "attention"]].sum()
            got = data["dla"][conflict_type]
            assert got["dla"][layer][head][k] == pytest.approx(per_fact["dla"].mean(), rel=1e-5, abs=1e-7)
            assert got["attention"][layer][head][k] == pytest.approx(per_fact["attention"].mean(), rel=1e-5, abs=1e-7)
    # every token is in exactly one span, so the spans' attention sums to 1
    attention = np.array(data["dla"]["substitution"]["attention"], dtype=float)
    np.testing.assert_allclose(attention.sum(-1), 1.0, atol=1e-4)


def test_precomputed_attention_rows_are_the_heads_patterns(tiny_gemma, facts, data):
    shown = data["examples"][1]
    assert shown["index"] == 2 and shown["subject"] == facts[2].subject
    prompt = shown["prompts"]["coherent"]
    patterns, tokens = attention_patterns(tiny_gemma, facts[2].prompts["coherent"], [(1, 3)])
    assert prompt["tokens"] == tokens and prompt["queries"][-1] == len(tokens) - 1
    expected = patterns[0, prompt["queries"]].numpy()
    np.testing.assert_allclose(np.array(prompt["attention"][1][3]), expected, atol=1e-4)


def test_widget_selecting_a_head_updates_every_panel(tiny_gemma, facts, sweep, attribution):
    box = explore(tiny_gemma, facts, sweep=sweep, attribution=attribution, n_boot=N_BOOT)
    e = box.explorer
    assert isinstance(e, HeadExplorer) and box.children
    e._on_click(e.heatmap.data[0], Points(point_inds=[[2, 1]], xs=[1], ys=[2], trace_index=0), None)
    assert e.head == (2, 1) and "L2H1" in e.title.value
    assert list(e.heatmap.data[1].x) == [1] and list(e.heatmap.data[1].y) == [2]
    expected = head_effects(sweep_intervals(sweep, n_boot=N_BOOT), 2, 1, 0.0)
    bars = {t.name: list(t.y) for t in e.effects.data}
    for target in ("parametric", "context"):
        np.testing.assert_allclose(bars[f"p({target})"], expected[expected.target == target]["mean"], rtol=1e-6)
    assert e.effects.layout.title.text.startswith("L2H1") and e.dla.layout.title.text.startswith("L2H1")
    assert [t.name for t in e.dla.data] == ["clean", "substitution conflict", "coherent conflict"]
    roles = head_roles(sweep, alpha=0.0, n_boot=N_BOOT)
    role = roles[(roles.layer == 2) & (roles["head"] == 1) & (roles.conflict_type == "coherent")].role.iloc[0]
    assert "L2H1" in e.roles.value and f"<b>{role}</b>" in e.roles.value
    assert '"attentionHeadNames": ["L2H1"]' in e.view.local_src  # the circuitsvis view of this head
    e.example.value = 3  # another example: the view follows
    _, tokens = attention_patterns(tiny_gemma, facts[3].prompts["clean"], [(2, 1)])
    assert json.dumps(tokens) in e.view.local_src
    before = np.array(e.heatmap.data[0].z, dtype=float)
    e.alpha.value = 2.0  # a new scale redraws the heatmap and the head's panels
    assert not np.allclose(before, np.array(e.heatmap.data[0].z, dtype=float))
    assert "scaled by 2" in e.title.value
    e.select(0, 0)
    assert e.head == (0, 0) and "L0H0" in e.effects.layout.title.text


def test_bad_input_fails_clearly(tiny_gemma, facts, sweep, attribution):
    e = HeadExplorer(tiny_gemma, facts, sweep, n_boot=N_BOOT)
    with pytest.raises(ValueError, match="Cannot explore head.*3 layers x 4"):
        e.select(3, 0)
    with pytest.raises(ValueError, match="Cannot explore head"):
        e.select(0, 4)
    assert "pass attribution" in e.dla.layout.title.text  # no attribution: the panel says so
    other = sweep.per_example.copy()
    other.attrs["model"] = "gemma-3-270m"
    with pytest.raises(ValueError, match="run on model 'gemma-3-270m'.*tiny-gemma"):
        explorer_data(tiny_gemma, facts, sweep=other)
    bigger = pd.concat([sweep.per_example, sweep.per_example.assign(layer=17)], ignore_index=True)
    with pytest.raises(ValueError, match="another model"):
        explore(tiny_gemma, facts, sweep=bigger)
    shrunk = cp.ConflictDataset([facts[1], facts[0], facts[2], facts[3]], name="shuffled")
    with pytest.raises(ValueError, match="pass the dataset the sweep was run on"):
        explorer_data(tiny_gemma, shrunk, sweep=sweep)
    narrow = cp.Attribution(
        attribution.components,
        attribution.sources[attribution.sources.layer < 2],
        attribution.modules,
        attribution.totals,
    )
    with pytest.raises(ValueError, match="2 layers x 4 heads.*another model"):
        explorer_data(tiny_gemma, facts, sweep=sweep, attribution=narrow)


def test_page_inlines_plotly_once_and_the_data(data, tmp_path):
    from plotly.offline import get_plotlyjs

    page = explorer_html(data)
    assert page.count(get_plotlyjs()[:300]) == 1
    assert "https://" not in page.split("<script type='text/javascript'>")[0]  # nothing fetched
    path = write_explorer_page(tmp_path / "sub" / "explorer.html", data)
    assert path.read_text(encoding="utf-8") == page


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )


@needs_chromium
def test_static_page_click_updates_the_heads_panels_in_chromium(data, tmp_path):
    """A click on cell (layer 2, head 1), sent as mouse events through plotly's own hover and
    click handling, selects that head: every panel is redrawn for it, with no console error."""
    path = write_explorer_page(tmp_path / "explorer.html", data)
    plain = _chromium("--dump-dom", path.resolve().as_uri()).stdout
    first = re.search(r'data-selected="(L\d+H\d+)"', plain).group(1)  # the largest effect, shown first
    mean = np.abs(np.array(data["effects"]["0"]["parametric"]["clean"]["mean"], dtype=float))
    layer, head = np.unravel_index(np.argmax(mean), mean.shape)
    assert first == f"L{layer}H{head}" and first != "L2H1" and "<title>cpsuper head explorer</title>" in plain
    done = _chromium("--enable-logging=stderr", "--v=0", "--dump-dom", path.resolve().as_uri() + "#click=2,1")
    dom = done.stdout
    title = re.search(r"<title>(.*?)</title>", dom).group(1)
    assert title == "selected L2H1: head knocked out", title
    assert 'data-selected="L2H1"' in dom
    for panel in ("L2H1: effect per conflict type", "L2H1: DLA (parametric-context) by prompt span"):
        assert panel in dom
    assert "L2H1 attention, example 0" in dom and "L2H1: role per conflict type" in dom
    assert dom.count('class="main-svg"') >= 4  # heatmap, effects, DLA, attention drawn
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    errors = [line for line in console if "Uncaught" in line or "Error" in line or ":ERROR:CONSOLE" in line]
    assert not errors, errors


# ---------------------------------------------------------------------------------------------
# Hostile labels: datasets are shared, so every label is untrusted input.

PWN_IMG = "<img src=x onerror=\"document.documentElement.dataset.pwned='img'\">"
PWN_SCRIPT = "</script><script>document.documentElement.dataset.pwned='script'</script>"
PWN_COMMENT = "<!--<script> <b>bold</b>"  # would keep a <script> element from closing
HOSTILE = (PWN_IMG, PWN_SCRIPT, PWN_COMMENT)


@pytest.fixture(scope="module")
def hostile(tiny_gemma):
    """Two facts whose conflict types, subjects, relation, answer and dataset name are markup."""
    examples = []
    for i, fact in enumerate(cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)):
        subject = f"{HOSTILE[i + 1]} {fact.subject}"
        other = fact.context_answer
        prompts = {
            "clean": f"The capital of {subject} is",
            PWN_IMG: f"The capital of {subject} is {other}. The capital of {subject} is",
            PWN_SCRIPT: f"{other} is the capital of {subject}. The capital of {subject} is",
        }
        examples.append(
            cp.ConflictExample(
                relation=PWN_SCRIPT,
                subject=subject,
                answer=fact.answer + PWN_IMG,
                context_answer=other,
                prompts=prompts,
            )
        )
    dataset = cp.ConflictDataset(examples, name=PWN_SCRIPT)
    sweep = cp.head_sweep(tiny_gemma, dataset, (0.0,), progress=False)
    attribution = cp.direct_logit_attribution(tiny_gemma, dataset, ["parametric-context"], progress=False)
    return dataset, sweep, attribution


def _as_text(label: str) -> str:
    """How a browser serialises ``label`` set as a text node."""
    return label.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@needs_chromium
def test_static_page_shows_hostile_labels_as_text_and_runs_none(tiny_gemma, hostile, tmp_path):
    """Markup in conflict types, subjects, relation, answers and dataset name is shown as literal
    text in the dropdowns, the roles table and the plots, and no script in it runs."""
    dataset, sweep, attribution = hostile
    data = explorer_data(tiny_gemma, dataset, sweep=sweep, attribution=attribution, n_boot=N_BOOT)
    path = write_explorer_page(tmp_path / "explorer.html", data, title=PWN_IMG)
    done = _chromium("--enable-logging=stderr", "--v=0", "--dump-dom", path.resolve().as_uri() + "#click=2,1")
    dom = done.stdout
    assert "data-pwned" not in dom, "a label ran as a script"
    assert re.search(r"<title>(.*?)</title>", dom).group(1) == "selected L2H1: head knocked out"  # the page works
    for label in (PWN_IMG, PWN_SCRIPT):
        shown = _as_text(label)
        assert f"<td>{shown}</td>" in dom  # the roles table
        assert f">{shown}</option>" in dom  # the conflict type dropdown
        assert re.search(f"<text[^>]*>{re.escape(shown)}</text>", dom)  # an axis tick of the effects plot
    assert f">0: {_as_text(dataset[0].subject)}</option>" in dom
    assert _as_text(dataset[0].subject) in re.search(r'class="gtitle"[^>]*>([^<]*attention[^<]*)<', dom).group(1)
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert not [line for line in console if "Uncaught" in line or ":ERROR:CONSOLE" in line], console


def test_widget_escapes_hostile_labels(tiny_gemma, hostile):
    """The widget's HTML panels and its plotly texts (which read a subset of HTML) hold every
    label escaped, never as markup."""
    dataset, sweep, attribution = hostile
    e = HeadExplorer(tiny_gemma, dataset, sweep, attribution, n_boot=N_BOOT)
    e.conflict_type.value = PWN_IMG
    label = e.attention.outputs[0]["data"]["text/html"]  # the line above the circuitsvis view
    plotted = [e.heatmap.layout.title.text, e.effects.layout.title.text, e.dla.layout.title.text]
    for trace in (*e.effects.data, *e.dla.data):
        plotted += [trace.name, trace.hovertemplate, *map(str, trace.x)]
    markup = "\n".join([e.title.value, e.roles.value, label, *plotted])
    assert "<img" not in markup and "<script" not in markup and "</script" not in markup
    assert f"<td>{_as_text(PWN_IMG)}</td>" in e.roles.value and f"<td>{_as_text(PWN_SCRIPT)}</td>" in e.roles.value
    assert _as_text(PWN_IMG) in e.heatmap.layout.title.text and _as_text(PWN_IMG) in label
    assert _as_text(PWN_SCRIPT) in [str(x) for x in e.effects.data[0].x]


def test_widget_shows_a_heads_effect_per_prompt_position(tiny_gemma, facts, sweep):
    """The per-position panel: the selected head's output at one position of the example's conflict
    prompt comes from the agreeing prompt (the memorised answer in the context's place); each bar
    equals a hand-written hook run, positions before the context answer change nothing, and a
    clean prompt shows a note instead."""
    import torch

    from cpsuper.explore.data import head_position_effects
    from cpsuper.runtime import answer_token
    from cpsuper.tracing import agreeing_prompt

    e = HeadExplorer(tiny_gemma, facts, sweep, head=(1, 2), n_boot=N_BOOT)
    assert "pick a conflict type" in e.positions.layout.title.text and not e.positions.data
    frames = [
        head_position_effects(tiny_gemma, facts, (1, 2), example=i, conflict_type="substitution", target="parametric")
        for i in range(4)
    ]
    # where the two answers tokenize to different lengths the clean prompt is the source, from the end
    assert {f.source.iloc[0] for f in frames} == {"agreeing", "clean"}
    shorter = next(f for f in frames if f.source.iloc[0] == "clean")
    assert shorter.p.isna().any() and shorter.p.iloc[-5:].notna().all()
    i = next(i for i, f in enumerate(frames) if f.source.iloc[0] == "agreeing")
    e.conflict_type.value, e.example.value = "substitution", i
    frame = frames[i]
    shown = {x: y for trace in e.positions.data for x, y in zip(trace.x, trace.y)}
    assert len(shown) == len(frame) and "L1H2" in e.positions.layout.title.text
    labels = [f"{p} {html.escape(t)}" for p, t in zip(frame.position, frame.token)]
    np.testing.assert_allclose([shown[label] for label in labels], frame.delta)
    assert f"example {i} " in e.positions.layout.title.text
    assert (frame.source == "agreeing").all() and set(frame.span) >= {"context_answer", "subject", "end"}

    fact = facts[i]
    prompt, agreeing = fact.prompts["substitution"], agreeing_prompt(fact, "substitution")[0]
    _, source = tiny_gemma.run_with_cache(agreeing, names_filter="blocks.1.attn.hook_z")
    answer = answer_token(tiny_gemma, fact.answer, prompt)
    first_change = int(np.argmax(frame.span.to_numpy() == "context_answer"))
    for at in (first_change - 1, first_change, len(frame) - 1):

        def patch(z, hook, at=at):
            z = z.clone()
            z[0, at, 2] = source["blocks.1.attn.hook_z"][0, at, 2]
            return z

        with torch.no_grad():
            logits = tiny_gemma.run_with_hooks(prompt, fwd_hooks=[("blocks.1.attn.hook_z", patch)])[0, -1]
        by_hand = logits.float().softmax(-1)[answer].item()
        assert frame.p.iloc[at] == pytest.approx(by_hand, abs=1e-6)
    assert frame.delta.iloc[:first_change].abs().max() < 1e-6  # the prompts agree before the answer
