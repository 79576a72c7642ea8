"""Direct logit attribution, source-token DLA, span finding and attention to spans: exact
identities on tiny GPT-2-style (LayerNorm, biases) and Gemma-style (RMSNorm before and after
each block, grouped-query attention) models."""

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.attention import attention_to_span
from cpsuper.attribution import (
    Attribution,
    Direction,
    direct_logit_attribution,
    prompt_example,
)
from cpsuper.backend import norm_affine
from cpsuper.mechanisms import head_categories
from cpsuper.plots import attention_view, save_attention_view
from cpsuper.runtime import tokenize_prompts
from cpsuper.spans import find_spans


@pytest.fixture(scope="module")
def capitals(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=4, tokenizer=tiny_gemma)


@pytest.fixture(scope="module")
def attribution(tiny, capitals):
    return direct_logit_attribution(tiny, capitals, ["parametric-context", "parametric"], progress=False)


def test_components_sum_to_the_models_logit(tiny, capitals, attribution):
    """Every component + constants == the logit (difference) from an ordinary forward pass."""
    for _, row in attribution.totals.iterrows():
        example = capitals[row.example]
        prompt = example.prompts[row.conflict_type]
        with torch.inference_mode():
            logits = tiny(prompt)[0, -1]
        ans = cp.runtime.answer_token(tiny, example.answer, prompt)
        ctx = cp.runtime.answer_token(tiny, example.context_answer, prompt)
        actual = logits[ans] - logits[ctx] if row.direction == "parametric-context" else logits[ans]
        assert row.reconstructed == pytest.approx(float(actual), abs=1e-4)
        assert row.logit == pytest.approx(float(actual), abs=1e-4)


def test_source_dla_sums_to_head_dla_and_heads_to_attention_output(attribution):
    keys = ["example", "conflict_type", "direction", "layer", "head"]
    by_source = attribution.sources.groupby(keys)["dla"].sum()
    heads = attribution.components[attribution.components.kind == "head"].set_index(keys)["dla"]
    assert np.allclose(by_source.sort_index(), heads.astype(float).sort_index(), atol=1e-5)
    # heads + attention bias (and the frozen post-norm's bias) == hook_attn_out read directly
    c = attribution.components[attribution.components.kind.isin(["head", "attn_bias"])]
    summed = c.groupby(["example", "conflict_type", "direction", "layer"])["dla"].sum()
    attn = attribution.modules[attribution.modules.module == "attn"].set_index(
        ["example", "conflict_type", "direction", "layer"]
    )["dla"]
    assert np.allclose(summed.sort_index().to_numpy(), attn.sort_index().to_numpy(), atol=1e-5)
    # the source groups' attention adds up to 1 for every head
    att = attribution.sources.groupby(keys)["attention"].sum()
    assert np.allclose(att, 1.0, atol=1e-5)


def test_per_token_and_custom_sources_add_up_to_the_span_groups(tiny, capitals, attribution):
    """Source DLA per token, summed over the tokens of each span, equals the span groups' DLA; a
    custom labelling (subject vs everything else) adds up the same way; each prompt lists only
    its own positions, the final token at position -1."""
    from cpsuper.spans import example_spans

    kw = {"conflict_types": ["substitution"], "progress": False}
    spans = direct_logit_attribution(tiny, capitals, ["parametric-context"], **kw).sources
    tokens = direct_logit_attribution(tiny, capitals, ["parametric-context"], sources="tokens", batch_size=3, **kw)
    per = tokens.sources
    keys = ["example", "layer", "head"]
    for i, example in enumerate(capitals):
        ids = cp.runtime.tokenize_prompts(tiny, [example.prompts["substitution"]])[0]
        labels = example_spans(tiny, example, "substitution", tokens=ids)
        rows = per[per.example == i]
        assert sorted(rows.position.unique()) == list(range(-len(ids), 0))
        assert (rows[rows.position == -1].token == tiny.tokenizer.decode([ids[-1]])).all()
        span_of = dict(zip(range(-len(ids), 0), labels))
        summed = rows.assign(span=rows.position.map(span_of)).groupby([*keys, "span"])["dla"].sum()
        expected = spans[spans.example == i].set_index([*keys, "group"])["dla"]
        expected = expected[expected.index.get_level_values("group").isin(set(labels))]
        assert np.allclose(summed.sort_index().to_numpy(), expected.sort_index().to_numpy(), atol=1e-5)

    def subject_or_not(example, conflict_type, ids):
        labels = example_spans(tiny, example, conflict_type, tokens=ids)
        return ["subject" if g == "subject" else "rest" for g in labels]

    custom = direct_logit_attribution(tiny, capitals, ["parametric-context"], sources=subject_or_not, **kw).sources
    assert set(custom.group) == {"subject", "rest"}
    subject = custom[custom.group == "subject"].set_index(keys)["dla"].sort_index()
    assert np.allclose(subject.to_numpy(), spans[spans.group == "subject"].set_index(keys)["dla"].sort_index())
    with pytest.raises(ValueError, match="one label per token"):
        direct_logit_attribution(tiny, capitals, sources=lambda e, c, ids: ["x"], **kw)
    with pytest.raises(ValueError, match="sources must be"):
        direct_logit_attribution(tiny, capitals, sources="words", **kw)


def test_attribution_is_independent_of_batching(tiny, capitals, attribution):
    one = direct_logit_attribution(tiny, capitals, ["parametric-context", "parametric"], batch_size=1, progress=False)
    pd.testing.assert_frame_equal(one.components.drop(columns="dla"), attribution.components.drop(columns="dla"))
    assert np.allclose(one.components.dla, attribution.components.dla, atol=1e-5)
    assert np.allclose(one.sources.dla, attribution.sources.dla, atol=1e-5)


def _frozen_norm(model, norm, x, scale):
    """``norm`` applied to ``x`` through its own forward, with its scale swapped for ``scale`` (the
    clean run's) and its bias left out: the linear map a frozen norm applies to one component."""
    own = {}
    with model.hooks(fwd_hooks=[(norm.hook_scale.name, lambda s, hook: own.setdefault("s", s))]):
        y = norm(x[None, None])[0, 0]
    bias = norm_affine(norm)[1]
    return (y - bias if bias is not None else y) * own["s"][0, 0] / scale


def test_zeroing_a_head_removes_exactly_its_direct_effect_in_the_last_layer(tiny, capitals):
    """Knocking out a last-layer head changes the logit by its DLA when the final norm is frozen;
    here we check the DLA against (z @ W_O) read from an independent cache, through the norms."""
    example, prompt = capitals[0], capitals[0].prompts["clean"]
    result = direct_logit_attribution(tiny, capitals[:1], ["parametric"], conflict_types=["clean"], progress=False)
    layer = tiny.cfg.n_layers - 1
    with torch.inference_mode():
        _, cache = tiny.run_with_cache(prompt)
        direction = tiny.W_U[:, cp.runtime.answer_token(tiny, example.answer, prompt)]
        for head in range(tiny.cfg.n_heads):
            out = cache[f"blocks.{layer}.attn.hook_z"][0, -1, head] @ tiny.blocks[layer].attn.W_O[head]
            if hasattr(tiny.blocks[layer], "ln1_post"):
                scale = cache[f"blocks.{layer}.ln1_post.hook_scale"][0, -1]
                out = _frozen_norm(tiny, tiny.blocks[layer].ln1_post, out, scale)
            out = _frozen_norm(tiny, tiny.ln_final, out, cache["ln_final.hook_scale"][0, -1])
            expected = float(out @ direction)
            got = result.components.query(f"kind == 'head' and layer == {layer} and head == {head}").dla.item()
            assert got == pytest.approx(expected, abs=1e-5)


def test_spans_on_a_subject_split_over_tokens_and_repeated_in_the_context(tiny_gemma, capitals):
    example = capitals[0]
    prompt = example.prompts["coherent"]
    tokens = tokenize_prompts(tiny_gemma, [prompt])[0]
    groups = find_spans(
        tiny_gemma,
        prompt,
        example.subject,
        context_answers=example.context_answers,
        context=example.meta["contexts"]["coherent"],
    )
    pieces = [tiny_gemma.tokenizer.decode([t]) for t in tokens]
    subject_text = "".join(p for p, g in zip(pieces, groups) if g == "subject")
    question = prompt[len(example.meta["contexts"]["coherent"]) :]
    # every subject token lies in the question, and together they spell each mention there
    assert subject_text.replace(" ", "") == example.subject.replace(" ", "") * question.count(example.subject)
    assert sum(g == "subject" for g in groups) > question.count(example.subject)  # several tokens per mention
    # the subject's mentions inside the paragraph count as context; the distractor as context_answer
    assert (
        "".join(p for p, g in zip(pieces, groups) if g == "context_answer").count(example.context_answer.split()[0][:3])
        >= 2
    )
    assert groups[0] == "bos" and groups[-1] == "end"
    # without the explicit context, the heuristic (up to the sentence with the last distractor) agrees
    # on the subject and context-answer tokens
    guessed = find_spans(tiny_gemma, prompt, example.subject, context_answers=example.context_answers)
    assert [g == "subject" for g in guessed] == [g == "subject" for g in groups]
    assert [g == "context_answer" for g in guessed] == [g == "context_answer" for g in groups]


def test_a_subject_boundary_inside_a_token_marks_the_whole_token(tiny_gemma):
    prompt = "Fact: The Colosseum is in the country of"
    tokens = tokenize_prompts(tiny_gemma, [prompt])[0]
    full = find_spans(tiny_gemma, prompt, "Colosseum")
    part = find_spans(tiny_gemma, prompt, "Coloss")  # ends mid-word
    assert sum(g == "subject" for g in full) >= 2
    first = full.index("subject")
    assert part[first] == "subject"
    assert part.count("subject") <= full.count("subject")
    assert full[-1] == "end" and len(full) == len(tokens)
    assert set(full[1:-1]) == {"relation", "subject"}
    with pytest.raises(ValueError, match="does not occur"):
        find_spans(tiny_gemma, prompt, "Eiffel Tower")


def test_head_categories_follow_the_thresholds():
    rows = []
    shares = {
        (0, 0): {"subject": 0.9, "relation": 0.1},
        (0, 1): {"subject": 0.1, "relation": 0.8},
        (1, 0): {"subject": 0.5, "relation": 0.5},
        (1, 1): {"bos": 1.0},
        (2, 0): {"subject": 0.001},
        (2, 1): {"end": 0.7, "relation": 0.2},
    }
    for (layer, head), parts in shares.items():
        for group in ("bos", "subject", "relation", "context", "end"):
            rows.append(
                {
                    "example": 0,
                    "subject": "x",
                    "conflict_type": "clean",
                    "direction": "parametric",
                    "layer": layer,
                    "head": head,
                    "group": group,
                    "dla": parts.get(group, 0.0),
                    "attention": 0.25,
                }
            )
    fake = Attribution(pd.DataFrame(), pd.DataFrame(rows), pd.DataFrame(), pd.DataFrame())
    table = head_categories(fake, "clean", "parametric").set_index(["layer", "head"])["category"]
    assert table[(0, 0)] == "subject" and table[(0, 1)] == "relation" and table[(1, 0)] == "mixed"
    assert table[(1, 1)] == "other" and table[(2, 0)] == "minor"
    assert table[(2, 1)] == "relation"  # the final token closes the relation phrase
    strict = head_categories(fake, "clean", relation_groups=("relation",)).set_index(["layer", "head"])
    assert strict.category[(2, 1)] == "other" and strict.relation_dla[(2, 1)] == pytest.approx(0.2)
    assert (
        head_categories(fake, "clean", threshold=0.95, mixed_min=0.05).set_index(["layer", "head"]).category[(0, 0)]
        == "mixed"
    )


def test_direction_errors(tiny, capitals):
    with pytest.raises(ValueError, match="Unknown direction"):
        direct_logit_attribution(tiny, capitals, ["memory"], progress=False)
    empty = Direction("empty", lambda e: e.answer, lambda e: [])
    with pytest.raises(ValueError, match="empty set"):
        direct_logit_attribution(tiny, capitals, [empty], progress=False)


def test_answer_minus_candidate_mean_is_linear(tiny, capitals, attribution):
    """DLA is linear in the direction: (a - mean(a, c)) == (a - c) / 2."""
    half = Direction("half", lambda e: e.answer, lambda e: [e.answer, e.context_answer])
    result = direct_logit_attribution(tiny, capitals, [half], progress=False)
    diff = attribution.components[attribution.components.direction == "parametric-context"].dla.to_numpy()
    assert np.allclose(result.components.dla.to_numpy(), diff / 2, atol=1e-5)


def test_prompt_example_and_cumulative_dla(tiny):
    data = prompt_example("Fact: The Colosseum is in the country of", "Colosseum", "Italy", "France")
    result = direct_logit_attribution(tiny, data, ["parametric", "context"], progress=False)
    lens = result.by_layer()
    last = lens.groupby("direction").cumulative.last()
    totals = result.totals.set_index("direction")
    constant = result.components[result.components.kind == "constant"].set_index("direction").dla
    for direction in ("parametric", "context"):
        assert last[direction] + constant[direction] == pytest.approx(totals.logit[direction], abs=1e-4)


def test_attention_to_span_matches_the_cached_pattern(tiny, capitals):
    result = attention_to_span(tiny, capitals, "subject", progress=False)
    example = capitals[1]
    prompt = example.prompts["substitution"]
    groups = find_spans(
        tiny,
        prompt,
        example.subject,
        context_answers=example.context_answers,
        context=example.meta["contexts"]["substitution"],
    )
    mask = np.array([g == "subject" for g in groups])
    with torch.inference_mode():
        _, cache = tiny.run_with_cache(prompt)
    row = result.per_example.query("example == 1 and conflict_type == 'substitution' and layer == 1 and head == 2")
    pattern = cache["blocks.1.attn.hook_pattern"][0, 2, -1].numpy()
    assert row.attention.item() == pytest.approx(pattern[mask].sum(), abs=1e-6)
    assert row.attention_no_bos.item() == pytest.approx(pattern[mask].sum() / (1 - pattern[0]), abs=1e-6)


def test_attention_patterns_equal_the_full_runs_patterns(tiny, capitals):
    """attention_patterns stops after the last layer shown; the patterns are the full run's."""
    from cpsuper.attention import attention_patterns

    prompt = capitals[2].prompts["coherent"]
    patterns, tokens = attention_patterns(tiny, prompt, [(0, 1), (1, 2), (0, 3)])
    with torch.inference_mode():
        _, cache = tiny.run_with_cache(prompt)
    expected = torch.stack(
        [cache[f"blocks.{layer}.attn.hook_pattern"][0, head] for layer, head in [(0, 1), (1, 2), (0, 3)]]
    )
    assert patterns.shape == expected.shape == (3, len(tokens), len(tokens))
    torch.testing.assert_close(patterns, expected.float(), atol=1e-6, rtol=0)


def test_attention_reductions_padding_and_known_split(tiny, capitals):
    right = attention_to_span(tiny, capitals, "context", progress=False, batch_size=4)
    left = attention_to_span(tiny, capitals, "context", progress=False, batch_size=4, padding_side="left")
    assert np.allclose(right.per_example.attention, left.per_example.attention, atol=1e-5)
    assert set(right.per_example.conflict_type) == {"substitution", "coherent"}  # clean has no context
    parts = [
        attention_to_span(tiny, capitals, g, progress=False).per_example.attention.to_numpy()
        for g in ("context", "context_answer")
    ]
    only_context = attention_to_span(tiny, capitals, ("context",), progress=False).per_example.attention.to_numpy()
    assert np.allclose(parts[0], only_context + parts[1], atol=1e-6)  # "context" includes the answer
    mean = attention_to_span(tiny, capitals, "subject", reduce="mean", progress=False).per_example
    total = attention_to_span(tiny, capitals, "subject", reduce="sum", progress=False).per_example
    assert np.allclose(mean.attention * mean.n_span_tokens, total.attention, atol=1e-6)
    mx = attention_to_span(tiny, capitals, "subject", reduce="max", progress=False).per_example
    assert (mx.attention <= total.attention + 1e-7).all() and (mx.attention >= mean.attention - 1e-7).all()
    split = attention_to_span(tiny, capitals, "subject", known=[True, False, True, False], progress=False)
    assert set(split.by_layer().known) == {True, False}
    # by_layer's interval is a bootstrap over facts of the per-fact means: it holds the mean and
    # lies within the range of those means; the figure's error bars reach exactly its ends.
    layers = attention_to_span(tiny, capitals, "subject", progress=False)
    by_layer = layers.by_layer()
    facts = layers.per_example.groupby(["conflict_type", "layer", "example"]).attention.mean()
    spread = facts.groupby(["conflict_type", "layer"]).agg(["min", "max"])
    joined = by_layer.join(spread, on=["conflict_type", "layer"])
    assert (joined.ci_low <= joined.attention + 1e-9).all() and (joined.attention <= joined.ci_high + 1e-9).all()
    assert (joined.ci_low >= joined["min"] - 1e-9).all() and (joined.ci_high <= joined["max"] + 1e-9).all()
    fig = cp.plots.plot_attention_by_layer(layers)
    for trace in fig.data:
        part = by_layer[by_layer.conflict_type == trace.name].sort_values("layer")
        y = np.asarray(trace.y, float)
        np.testing.assert_allclose(y + np.asarray(trace.error_y.array, float), part.ci_high)
        np.testing.assert_allclose(y - np.asarray(trace.error_y.arrayminus, float), part.ci_low)
    custom = attention_to_span(tiny, capitals, lambda e, c: e.subject, progress=False).per_example
    clean = total[total.conflict_type == "clean"].attention.to_numpy()
    assert np.allclose(custom[custom.conflict_type == "clean"].attention.to_numpy(), clean, atol=1e-6)


def test_attention_errors(tiny, capitals):
    with pytest.raises(ValueError, match="reduce"):
        attention_to_span(tiny, capitals, "subject", reduce="median", progress=False)
    with pytest.raises(ValueError, match="Unknown span"):
        attention_to_span(tiny, capitals, "object", progress=False)
    with pytest.raises(ValueError, match="known has"):
        attention_to_span(tiny, capitals, "subject", known=[True], progress=False)
    with pytest.raises(ValueError, match="contains the span"):
        attention_to_span(tiny, capitals, "context", conflict_types=["clean"], progress=False)


def test_circuitsvis_view_is_standalone(tiny, capitals, tmp_path):
    view = attention_view(tiny, capitals[0].prompts["clean"], [(0, 1), (2, 3)])
    path = tmp_path / "view.html"
    save_attention_view(view, path)
    html = path.read_text()
    assert "unpkg.com" not in html and "<script" in html and "L2H3" in html
    with pytest.raises(ValueError, match="head"):
        attention_view(tiny, "hello", [(0, 99)])


def test_attribution_and_attention_figures(tiny, capitals, attribution):
    from cpsuper import plots

    cats = head_categories(attribution, "clean", "parametric", min_dla=0.0)
    mech = cp.mechanism_contributions(
        tiny,
        capitals,
        {"correct": lambda e: e.answer, "context": lambda e: e.context_answer},
        categories=cats,
        progress=False,
    )
    sums = mech[mech.mechanism == "sum"].set_index(["conflict_type", "candidate"]).dla
    parts = mech[mech.mechanism != "sum"].groupby(["conflict_type", "candidate"]).dla.sum()
    assert np.allclose(sums.sort_index(), parts.sort_index(), atol=1e-6)
    figures = [
        plots.plot_head_dla(attribution, "substitution", "parametric-context"),
        plots.plot_head_sources(attribution, top_k=3),
        plots.plot_head_categories(cats),
        plots.plot_mechanisms(mech),
        plots.plot_cumulative_dla(attribution),
        plots.plot_attention_heatmap(attention_to_span(tiny, capitals, progress=False)),
        plots.plot_attention_by_layer(attention_to_span(tiny, capitals, progress=False)),
    ]
    heat = figures[0]
    panels = [a.text for a in heat.layout.annotations]
    assert "subject" in panels and "context_answer" in panels
    assert len(figures[1].data[-1].x) == 3
    with pytest.raises(ValueError, match="No conflict type"):
        plots.plot_head_dla(attribution, "paraphrase")


def test_a_mixed_heads_subject_relation_and_other_parts_sum_to_its_dla(tiny, capitals, attribution):
    # thresholds no head can pass make every head mixed (shares >= 0), so every head is split
    cats = head_categories(attribution, "clean", "parametric", threshold=1.01, mixed_min=0.0, min_dla=-1e9)
    assert set(cats.category) == {"mixed"}
    heads = attribution.components[
        (attribution.components.kind == "head")
        & (attribution.components.direction == "parametric")
        & (attribution.components.conflict_type == "clean")
    ]
    mean_dla = heads.groupby(["layer", "head"]).dla.mean().astype(float)
    table = cats.set_index(["layer", "head"]).sort_index()
    parts = table.subject_dla + table.relation_dla + table.other_dla
    assert np.allclose(parts.to_numpy(), mean_dla.sort_index().to_numpy(), atol=1e-5)
    assert (table.other_dla.abs() > 1e-4).any()  # BOS and context carry DLA too
    mech = cp.mechanism_contributions(
        tiny, capitals, {"parametric": lambda e: e.answer}, categories=cats, progress=False
    )
    mech = mech.set_index(["conflict_type", "mechanism"]).dla
    assert "mixed heads" not in mech.index.get_level_values("mechanism")
    split = [mech[("clean", f"mixed heads: {p}")] for p in ("subject", "relation", "other")]
    assert sum(split) == pytest.approx(float(heads.groupby("example").dla.sum().mean()), abs=1e-5)
    sources = attribution.sources.query("direction == 'parametric' and conflict_type == 'clean'")
    subject = sources[sources.group == "subject"].groupby("example").dla.sum().mean()
    relation = sources[sources.group.isin(["relation", "end"])].groupby("example").dla.sum().mean()
    assert split[0] == pytest.approx(subject, abs=1e-5) and split[1] == pytest.approx(relation, abs=1e-5)
    # a head in another class keeps one undivided row
    one = cats.assign(category=np.where(cats.index == 0, "subject", "mixed"))
    mech = cp.mechanism_contributions(
        tiny, capitals, {"parametric": lambda e: e.answer}, categories=one, progress=False
    )
    assert "subject heads" in set(mech.mechanism) and "mixed heads: other" in set(mech.mechanism)


def test_a_bf16_model_is_decomposed_in_float32(tiny_gemma, capitals):
    """A bf16 model (as `cpsuper reproduce --dtype bfloat16` loads it): the decomposition runs in
    float32, its identities hold, and it agrees with the float32 model's to bf16's accuracy."""
    low = cp.tiny_model("gemma", dtype=torch.bfloat16)
    assert low.cfg.dtype == torch.bfloat16
    got = direct_logit_attribution(low, capitals, ["parametric-context"], progress=False)
    want = direct_logit_attribution(tiny_gemma, capitals, ["parametric-context"], progress=False)
    scale = want.totals.logit.abs().max()
    # the bf16 residual stream rounds each addition, so the parts sum to the logit within that rounding
    assert np.abs(got.totals.reconstructed - got.totals.logit).max() < 0.02 * scale
    keys = ["example", "conflict_type", "direction", "layer", "head"]
    heads = got.components[got.components.kind == "head"].set_index(keys)["dla"].astype(float).sort_index()
    by_source = got.sources.groupby(keys)["dla"].sum().sort_index()  # z = pattern @ v was rounded to bf16
    assert np.abs(by_source.to_numpy() - heads.to_numpy()).max() < 0.01 * heads.abs().max()
    assert np.abs(got.totals.logit.to_numpy() - want.totals.logit.to_numpy()).max() < 0.05 * scale
