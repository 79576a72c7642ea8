"""cpsuper.attention_push: the loss gradient on the last query's attention scores and the relevance
terms, against finite differences on tiny HookedTransformers (one with grouped-query attention,
n_key_value_heads < n_heads), and the helpers of scripts/attention_push.py."""

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.attention_push import GROUPS, attention_score_gradients, sign_agreement
from cpsuper.runtime import answer_token
from cpsuper.spans import example_spans


@pytest.fixture(scope="module", params=["gemma", "gpt2"])
def model64(request):
    """A float64 tiny model, so that central differences are exact to ~1e-9. The gemma one has
    grouped-query attention: 4 query heads over 2 key/value heads."""
    return cp.tiny_model(request.param, n_layers=2, seed=1, dtype=torch.float64)


@pytest.fixture(scope="module")
def example(model64):
    fact = cp.conflict_dataset("world_capital", n=2, tokenizer=model64)[1]
    prompt = fact.prompts["clean"]
    return prompt, fact.answer, example_spans(model64, fact, "clean")


def _loss(model, prompt, answer, hooks=()) -> float:
    with torch.no_grad(), cp.interrupts.hooked(model, list(hooks)):
        logits = model(prompt)[0, -1]
    target = torch.tensor(answer_token(model, answer, prompt))
    return torch.nn.functional.cross_entropy(logits, target).item()


def _central(model, prompt, answer, name, edit, eps=1e-5) -> float:
    """d loss / d t of ``edit(act, t)`` at ``name``, by central differences."""

    def hook_at(t):
        def hook(act, hook):
            act = act.clone()
            edit(act, t)
            return act

        return [(name, hook)]

    return (_loss(model, prompt, answer, hook_at(eps)) - _loss(model, prompt, answer, hook_at(-eps))) / (2 * eps)


def test_model_has_grouped_query_attention_where_asked(model64):
    n_kv = model64.cfg.n_key_value_heads or model64.cfg.n_heads
    assert (n_kv < model64.cfg.n_heads) == (model64.cfg.model_name == "tiny-gemma")


def test_push_is_minus_the_score_gradient_by_finite_differences(model64, example):
    prompt, answer, labels = example
    frame = attention_score_gradients(model64, [prompt], [answer], spans=[labels])
    assert len(frame) == model64.cfg.n_layers * model64.cfg.n_heads
    assert frame.loss.iloc[0] == pytest.approx(_loss(model64, prompt, answer), rel=1e-10)
    groups = np.array(["relation" if g not in ("subject", "bos") else g for g in labels])
    assert set(groups) == set(GROUPS)
    for layer in range(model64.cfg.n_layers):
        for head in range(model64.cfg.n_heads):
            row = frame[(frame.layer == layer) & (frame["head"] == head)].iloc[0]
            for group in GROUPS:
                keys = torch.tensor(groups == group)

                def shift(act, t, head=head, keys=keys):
                    act[0, head, -1, keys] += t  # raise the group's scores at the last query

                slope = _central(model64, prompt, answer, f"blocks.{layer}.attn.hook_attn_scores", shift)
                assert row[f"push_{group}"] == pytest.approx(-slope, abs=1e-8)


def test_relevance_is_minus_the_pattern_gradient_by_finite_differences(model64, example):
    """rel_j = -dL/da_j with the pattern entry moved alone (z = sum_j a_j v_j is linear in it), so
    a wrong key/value head for a grouped query head shows up here."""
    prompt, answer, labels = example
    frame = attention_score_gradients(model64, [prompt], [answer], spans=[labels])
    groups = np.array(["relation" if g not in ("subject", "bos") else g for g in labels])
    _, cache = model64.run_with_cache(prompt)
    for layer in range(model64.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][0, :, -1]
        for head in range(model64.cfg.n_heads):
            rel = []
            for key in range(len(labels)):

                def move(act, t, head=head, key=key):
                    act[0, head, -1, key] += t

                rel.append(-_central(model64, prompt, answer, f"blocks.{layer}.attn.hook_pattern", move))
            rel, a = np.array(rel), pattern[head].numpy()
            row = frame[(frame.layer == layer) & (frame["head"] == head)].iloc[0]
            assert row.rel_mean == pytest.approx((a * rel).sum(), abs=1e-8)
            for group in GROUPS:
                keep = groups == group
                assert row[f"attn_{group}"] == pytest.approx(a[keep].sum(), abs=1e-12)
                assert row[f"rel_{group}"] == pytest.approx((a[keep] * rel[keep]).sum() / a[keep].sum(), abs=1e-7)
                # The softmax identity per group: push = attention mass x (relevance - mean relevance).
                assert row[f"push_{group}"] == pytest.approx(
                    a[keep].sum() * (row[f"rel_{group}"] - row.rel_mean), abs=1e-8
                )


def test_identity_holds_pushes_cancel_and_nothing_is_left_behind(model64, example):
    prompt, answer, labels = example
    grads_before = [p.grad for p in model64.parameters()]
    frame = attention_score_gradients(model64, [prompt, prompt], [answer, answer], spans=[labels, labels], layers=[1])
    assert frame.identity_err.max() < 1e-12
    pushes = frame[[f"push_{g}" for g in GROUPS]].sum(axis=1)
    np.testing.assert_allclose(pushes, 0.0, atol=1e-12)  # softmax is shift-invariant
    np.testing.assert_allclose(frame[[f"attn_{g}" for g in GROUPS]].sum(axis=1), 1.0, atol=1e-12)
    # the first-order change of the attention masses also sums to zero
    np.testing.assert_allclose(frame[[f"attn_step_{g}" for g in GROUPS]].sum(axis=1), 0.0, atol=1e-12)
    assert set(frame.layer) == {1} and list(frame.example.unique()) == [0, 1]
    pd.testing.assert_frame_equal(
        frame[frame.example == 0].drop(columns="example").reset_index(drop=True),
        frame[frame.example == 1].drop(columns="example").reset_index(drop=True),
    )
    assert [p.grad for p in model64.parameters()] == grads_before  # no .grad written
    assert not any(hp._forward_hooks for hp in model64.hook_dict.values())


def test_frozen_weights_give_the_same_terms(example):
    model = cp.tiny_model("gemma", n_layers=2, seed=1, dtype=torch.float64)
    prompt, answer, labels = example
    free = attention_score_gradients(model, [prompt], [answer], spans=[labels])
    for p in model.parameters():
        p.requires_grad_(False)
    frozen = attention_score_gradients(model, [prompt], [answer], spans=[labels])
    pd.testing.assert_frame_equal(free, frozen)


def test_hooks_are_removed_when_the_forward_pass_raises(example):
    model = cp.tiny_model("gemma", n_layers=2, seed=1)
    prompt, answer, labels = example

    def boom(act, hook):
        raise RuntimeError("stop here")

    model.blocks[1].hook_resid_post.add_hook(boom)
    with pytest.raises(RuntimeError, match="stop here"):
        attention_score_gradients(model, [prompt], [answer], spans=[labels])
    left = {name: len(hp._forward_hooks) for name, hp in model.hook_dict.items() if hp._forward_hooks}
    assert left == {"blocks.1.hook_resid_post": 1}  # only the test's own hook
    model.reset_hooks(including_permanent=True)


def test_span_labels_must_cover_every_token(tiny_gemma, example):
    prompt, answer, labels = example
    with pytest.raises(ValueError, match="span labels"):
        attention_score_gradients(tiny_gemma, [prompt], [answer], spans=[labels[:-1]])
    with pytest.raises(ValueError, match="prompts"):
        attention_score_gradients(tiny_gemma, [prompt], [answer, answer], spans=[labels])


def test_sign_agreement_by_hand():
    frame = pd.DataFrame(
        {
            "rel_subject": [1.0, 1.0, -1.0, 0.5, 0.0],
            "rel_relation": [0.0, 0.0, 0.0, 0.5, 1.0],
            "rel_mean": [2.0, 0.0, -2.0, 0.0, 1.0],
            "push_subject": [0.3, -0.1, -0.2, 0.1, 0.0],
        }
    )
    paper = sign_agreement(frame)
    np.testing.assert_array_equal(paper.to_numpy(), [1.0, 0.0, 1.0, np.nan, np.nan])
    exact = sign_agreement(frame, predictor="exact")
    np.testing.assert_array_equal(exact.to_numpy(), [0.0, 0.0, 0.0, 1.0, np.nan])
    with pytest.raises(ValueError, match="predictor"):
        sign_agreement(frame, predictor="other")


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("plotly")
    path = Path(__file__).parents[1] / "scripts" / "attention_push.py"
    spec = importlib.util.spec_from_file_location("attention_push_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_per_fact_sums_heads_and_reads_directions(script):
    heads = pd.DataFrame(
        {
            "fact": [5, 5, 5, 5],
            "role": "top",
            "relation": "r",
            "layer": [0, 0, 1, 1],
            "head": [0, 1, 0, 1],
            "push_subject": [0.3, -0.1, 0.2, -0.4],
            "push_relation": [-0.2, 0.1, -0.1, 0.3],
            "push_bos": [-0.1, 0.0, -0.1, 0.1],
            "attn_step_subject": [0.01, 0.0, 0.02, -0.01],
            "rel_subject": [1.0, 1.0, 0.0, 0.0],
            "rel_relation": [0.0, 0.0, 1.0, 1.0],
            "rel_mean": 0.0,
            "loss": 2.0,
        }
    )
    layers, total = script.per_fact(heads)
    np.testing.assert_allclose(layers.push_subject, [0.2, -0.2])
    row = total.iloc[0]
    assert row.push_subject == pytest.approx(0.0) and row.push_relation == pytest.approx(0.1)
    assert row.net_direction == pytest.approx(0.0)
    assert row.share_positive == 0.5 and row.share_s_above_p == 0.5
    # signs agree on heads (0,0) (+,+) and (1,1) (-,-): half the heads, 0.7 of the |push| of 1.0
    assert row.agreement == 0.5 and row.agreement_weighted == pytest.approx(0.7)
    assert row.subject_minus_relation == pytest.approx(-0.1)


def test_script_interval_rows_take_the_unpaired_difference(script):
    frame = pd.DataFrame({"fact": range(6), "role": ["top"] * 3 + ["bottom"] * 3, "v": [1.0, 2.0, 3.0, 0.0, 0.0, 3.0]})
    row = script.interval_rows(frame, "v", []).iloc[0]
    assert row.top_mean == pytest.approx(2.0) and row.bottom_mean == pytest.approx(1.0)
    assert row["diff"] == pytest.approx(1.0)
    assert row.diff_ci_low < 1.0 < row.diff_ci_high


def test_script_rank_correlation_is_spearman_with_an_interval(script):
    from cpsuper.toys.finetuning_salience import spearman

    rng = np.random.default_rng(0)
    x = rng.normal(size=40)
    y = x + rng.normal(size=40)
    got = script.rank_correlation(x, y, n_boot=300)
    assert got.mean == pytest.approx(spearman(x, y)) and got.ci_low < got.mean < got.ci_high and got.n == 40
    same = script.rank_correlation(x, np.exp(x), n_boot=50)  # monotone: exactly 1 in every resample
    assert tuple(same)[:3] == pytest.approx((1.0, 1.0, 1.0))
    total = pd.DataFrame({"relation": ["a"] * 5 + ["b"] * 5, "p_true": np.arange(10.0)})
    total = total.assign(push_subject=-total.p_true, net_direction=total.p_true**2)
    table = script.rank_correlations(total).set_index(["relation", "value"])
    assert table.loc[("all", "push_subject"), "rho"] == pytest.approx(-1.0)
    assert (
        table.loc[("b", "net_direction"), "rho"] == pytest.approx(1.0) and table.loc[("b", "net_direction"), "n"] == 5
    )


def test_a_bridge_is_refused_with_the_backend_to_use(tiny_gemma, example, monkeypatch):
    import cpsuper.attention_push as push

    prompt, answer, labels = example
    monkeypatch.setattr(push, "is_bridge", lambda model: True)
    with pytest.raises(ValueError, match="backend='hooked'"):
        attention_score_gradients(tiny_gemma, [prompt], [answer], spans=[labels])
