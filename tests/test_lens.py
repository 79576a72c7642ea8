"""The logit lens against hand computations on the tiny models (Gemma-style RMSNorm with GQA and
post-norms; GPT-2-style LayerNorm with biases): the last layer is the model's own output, every
layer is the final norm and unembedding of a cached residual, ranks are an argsort, batched runs
equal one-by-one runs, and bad input is named."""

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

import cpsuper as cp
from cpsuper import plots
from cpsuper.data.examples import ConflictDataset, ConflictExample
from cpsuper.lens import LogitLens, lens_summary, logit_lens
from cpsuper.runtime import answer_token, tokenize_prompts

TARGETS = ("parametric", "context")


@pytest.fixture(scope="module")
def lens_run(tiny):
    data = cp.conflict_dataset("world_capital", n=5, tokenizer=tiny)
    return tiny, data, logit_lens(tiny, data, batch_size=4, n_boot=200, progress=False)


def _rows(result, conflict_type, example, target):
    per = result.per_example
    rows = per[(per.conflict_type == conflict_type) & (per.example == example) & (per.target == target)]
    return rows.sort_values("layer").set_index("layer")


def _rank(logits, token):
    """Position of ``token`` in a descending argsort, 1 = top."""
    order = torch.argsort(logits, descending=True)
    return int((order == token).nonzero()[0, 0]) + 1


def test_the_last_layer_is_the_models_own_output(lens_run):
    model, data, result = lens_run
    n = model.cfg.n_layers
    assert sorted(result.per_example.layer.unique()) == list(range(n + 1)) and result.n_layers == n
    for conflict_type in data.conflict_types:
        for i, example in enumerate(data):
            prompt = example.prompts[conflict_type]
            with torch.inference_mode():
                logits = model(prompt)[0, -1].float()
            logprobs = logits.log_softmax(-1)
            for target in TARGETS:
                token = answer_token(model, example.target_answer(target), prompt)
                row = _rows(result, conflict_type, i, target).loc[n]
                assert row.logit == pytest.approx(float(logits[token]), abs=1e-5)
                assert row.logprob == pytest.approx(float(logprobs[token]), abs=1e-5)
                assert row.probability == pytest.approx(float(logprobs[token].exp()), abs=1e-6)
                assert row["rank"] == _rank(logits, token)


def test_every_layer_is_the_final_norm_and_unembedding_of_its_residual(lens_run):
    model, data, result = lens_run
    n = model.cfg.n_layers
    checked_ranks = set()
    for conflict_type in ("clean", "substitution"):
        for i in (0, 3):
            example = data[i]
            prompt = example.prompts[conflict_type]
            with torch.inference_mode():
                _, cache = model.run_with_cache(prompt)
            for layer in range(n):
                resid = cache[f"blocks.{layer}.hook_resid_pre"][:, -1:]
                with torch.inference_mode():
                    logits = model.unembed(model.ln_final(resid))[0, -1].float()
                logprobs = logits.log_softmax(-1)
                for target in TARGETS:
                    token = answer_token(model, example.target_answer(target), prompt)
                    row = _rows(result, conflict_type, i, target).loc[layer]
                    assert row.logit == pytest.approx(float(logits[token]), abs=1e-5)
                    assert row.logprob == pytest.approx(float(logprobs[token]), abs=1e-5)
                    assert row["rank"] == _rank(logits, token)
                    checked_ranks.add(int(row["rank"]))
    assert len(checked_ranks) > 5  # the ranks vary, so a wrong rank would show


def test_batched_equals_one_by_one_with_padding(lens_run):
    model, data, result = lens_run
    lengths = {len(t) for t in tokenize_prompts(model, [e.prompts[c] for e in data for c in data.conflict_types])}
    assert len(lengths) > 1  # prompts of different lengths share padded batches
    alone = logit_lens(model, data, batch_size=1, n_boot=200, progress=False)
    pd.testing.assert_frame_equal(
        result.per_example.drop(columns="rank"), alone.per_example.drop(columns="rank"), atol=1e-5, rtol=0
    )
    assert (result.per_example["rank"] == alone.per_example["rank"]).all()
    assert not any(h._forward_hooks for h in model.hook_dict.values())  # every caching hook removed


def test_a_subset_of_layers_targets_and_conflict_types_gives_the_same_rows(lens_run):
    model, data, result = lens_run
    n = model.cfg.n_layers
    part = logit_lens(
        model, data, layers=[n, 1], targets="context", conflict_types=["coherent"], n_boot=200, progress=False
    )
    per = part.per_example
    assert sorted(per.layer.unique()) == [1, n] and set(per.target) == {"context"}
    assert set(per.conflict_type) == {"coherent"} and len(per) == len(data) * 2
    keys = ["example", "conflict_type", "target", "layer"]
    full = result.per_example.set_index(keys).loc[per.set_index(keys).index]
    assert np.allclose(per.logprob.to_numpy(), full.logprob.to_numpy(), atol=1e-5)


def test_summary_is_the_mean_and_median_over_facts(lens_run):
    model, data, result = lens_run
    per, summary = result.per_example, result.summary
    keys = ["conflict_type", "target", "layer"]
    grouped = per.groupby(keys)
    s = summary.set_index(keys)
    assert len(s) == len(data.conflict_types) * 2 * (model.cfg.n_layers + 1)
    assert np.allclose(s.probability, grouped.probability.mean().loc[s.index], atol=1e-7)
    assert np.allclose(s.logprob, grouped.logprob.mean().loc[s.index], atol=1e-6)
    assert np.allclose(s["rank"], grouped["rank"].median().loc[s.index])
    assert np.allclose(s.top1, grouped["rank"].apply(lambda r: (r == 1).mean()).loc[s.index])
    assert (s.n == len(data)).all()
    for value in ("probability", "logprob", "rank", "top1"):
        assert (s[f"{value}_low"] <= s[value] + 1e-9).all() and (s[value] <= s[f"{value}_high"] + 1e-9).all()
    assert (s.probability_high > s.probability_low).any()
    assert list(summary.conflict_type.unique()) == list(data.conflict_types)
    again = result.intervals(n_boot=200)
    pd.testing.assert_frame_equal(again, summary)
    wider = result.intervals(n_boot=200, ci=0.99)
    assert (wider.probability_high - wider.probability_low >= summary.probability_high - summary.probability_low).all()
    assert lens_summary(per, n_boot=200).equals(summary)


def test_wide_puts_both_answers_side_by_side(lens_run):
    _, _, result = lens_run
    wide = result.wide("logprob")
    assert list(wide.columns[-2:]) == ["parametric", "context"]
    per = result.per_example.set_index(["example", "conflict_type", "layer", "target"]).logprob
    for _, row in wide.sample(10, random_state=0).iterrows():
        for target in TARGETS:
            assert row[target] == per[(row.example, row.conflict_type, row.layer, target)]
    with pytest.raises(ValueError, match="value must be"):
        result.wide("p")


@pytest.mark.parametrize("value", ["probability", "logprob", "rank"])
def test_plot_logit_lens(lens_run, value):
    _, data, result = lens_run
    fig = plots.plot_logit_lens(result, value=value)
    assert isinstance(fig, go.Figure) and fig.layout.title.text
    lines = [t for t in fig.data if t.mode and "lines" in t.mode]
    assert len(lines) == len(data.conflict_types) * 2  # one line per conflict type and target panel
    assert len(fig.data) == 2 * len(lines)  # each with its interval band
    assert (fig.layout.yaxis.type == "log") == (value == "rank")
    with pytest.raises(ValueError, match="value must be"):
        plots.plot_logit_lens(result, value="logit")
    with pytest.raises(TypeError, match="LogitLens"):
        plots.plot_logit_lens(result.per_example)


def test_bad_input_is_named(tiny_gemma, monkeypatch):
    model = tiny_gemma
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=model)
    n = model.cfg.n_layers
    for layers in ([n + 1], [-1], [True], ["0"], [1.5], "0"):
        with pytest.raises(ValueError, match=rf"layers.*residual streams 0\.\.{n}"):
            logit_lens(model, data, layers=layers, progress=False)
    with pytest.raises(ValueError, match="layers is empty"):
        logit_lens(model, data, layers=[], progress=False)
    with pytest.raises(ValueError, match="dataset is empty"):
        logit_lens(model, [], progress=False)
    with pytest.raises(TypeError, match="dataset must be a ConflictDataset"):
        logit_lens(model, "The capital of France is", progress=False)
    with pytest.raises(TypeError, match="model must be a TransformerLens model"):
        logit_lens(None, data, progress=False)
    with pytest.raises(ValueError, match="Unknown targets"):
        logit_lens(model, data, targets=["memorised"], progress=False)
    with pytest.raises(ValueError, match="Conflict types"):
        logit_lens(model, data, conflict_types=["paraphrase"], progress=False)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        logit_lens(model, data, batch_size=0, progress=False)
    clash = ConflictExample(
        relation="custom",
        subject="Italy",
        answer="Rome",
        context_answer="Rome city",
        prompts={"clean": "The capital of Italy is", "substitution": "The capital of Italy is Rome city. It is"},
    )
    with pytest.raises(ValueError, match="start with the same token"):
        logit_lens(model, ConflictDataset([clash], name="clash"), progress=False)
    hooks = {k: v for k, v in model.hook_dict.items() if k != "blocks.1.hook_resid_pre"}
    monkeypatch.setattr(type(model), "hook_dict", property(lambda self: hooks), raising=False)
    with pytest.raises(ValueError, match=r"no hook 'blocks\.1\.hook_resid_pre'"):
        logit_lens(model, data, progress=False)
    logit_lens(model, data, layers=[0, 2, n], progress=False)  # the missing hook is not needed


def test_lens_result_type(lens_run):
    assert isinstance(lens_run[2], LogitLens) and "LogitLens" in repr(lens_run[2])


@pytest.mark.slow
def test_embedded_model_last_layer_is_its_output(gemma):
    model = gemma
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=model)
    n = model.cfg.n_layers
    result = logit_lens(model, data, conflict_types=["clean"], n_boot=100, progress=False)
    for i, example in enumerate(data):
        prompt = example.prompts["clean"]
        with torch.inference_mode():
            logits = model(prompt)[0, -1].float()
        for target in TARGETS:
            token = answer_token(model, example.target_answer(target), prompt)
            row = _rows(result, "clean", i, target).loc[n]
            assert row.logit == pytest.approx(float(logits[token]), abs=1e-4)
            assert row.logprob == pytest.approx(float(logits.log_softmax(-1)[token]), abs=1e-4)
            assert row["rank"] == _rank(logits, token)
