"""Additivity of mechanisms: exact on separate linear paths, broken by a shared nonlinearity,
single ablations checked against direct logit attribution, and clear errors."""

import numpy as np
import pytest
import torch

import cpsuper as cp
from cpsuper.additivity import additivity
from cpsuper.attribution import direct_logit_attribution
from cpsuper.mechanisms import head_categories, mechanism_classes
from cpsuper.tiny import tiny_tokenizer
from cpsuper.toys.build import toy_transformer


def _no_norm_model(attn_only: bool):
    """Two layers, no norms: with attention only, the last layer's heads write to the logits
    along separate linear paths; with MLPs, they meet in the last MLP. (On TransformerLens 4.3,
    the native bridge: the sweeps resume it mid-model on padded batches.)"""
    tokenizer = tiny_tokenizer()
    model = toy_transformer(
        tokenizer=tokenizer,
        n_layers=2,
        d_model=64,
        d_head=16,
        n_heads=4,
        d_mlp=None if attn_only else 128,
        act_fn=None if attn_only else "gelu",
        attn_only=attn_only,
        normalization_type=None,
        n_ctx=256,
        d_vocab=len(tokenizer),
        seed=0,
        initializer_range=0.2,
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
    )
    return model.eval()


@pytest.fixture(scope="module")
def linear():
    model = _no_norm_model(attn_only=True)
    return model, cp.conflict_dataset("world_capital", n=4, tokenizer=model)


@pytest.fixture(scope="module")
def shared():
    model = _no_norm_model(attn_only=False)
    return model, cp.conflict_dataset("world_capital", n=4, tokenizer=model)


def _pair(result, name="a + b"):
    return result.per_example[result.per_example.condition == name]


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_heads_on_separate_linear_paths_add_up_exactly(linear, ablation):
    model, data = linear
    result = additivity(model, data, {"a": [(1, 0)], "b": [(1, 2), (1, 3)]}, ablation=ablation, progress=False)
    pair = _pair(result)
    assert np.abs(pair.delta).max() > 1e-2  # the ablations do something ...
    assert np.allclose(pair.residual, 0.0, atol=1e-5)  # ... and exactly add up
    summary = result.summary.set_index(["conflict_type", "condition"])
    assert list(summary.index.get_level_values(0).unique()) == ["clean", "substitution", "coherent"]
    assert summary.loc[("clean", "a + b"), "residual_mean"] == pytest.approx(0.0, abs=1e-5)
    assert np.isnan(summary.loc[("clean", "a"), "residual_mean"])


def test_a_shared_nonlinearity_breaks_additivity(linear, shared):
    model, data = shared  # two last-layer heads feed the last MLP at the final position
    pair = _pair(additivity(model, data, {"a": [(1, 0)], "b": [(1, 2)]}, progress=False))
    assert np.abs(pair.residual).max() > 1e-2
    model, data = linear  # a layer-0 head changes the softmax of a layer-1 head at the final token
    pair = _pair(additivity(model, data, {"early": [(0, 1)], "late": [(1, 1)]}, progress=False), "early + late")
    assert np.abs(pair.residual).max() > 1e-3


def test_a_single_last_layer_head_costs_exactly_its_direct_logit_attribution(linear):
    model, data = linear
    result = additivity(model, data, {"a": [(1, 0)], "b": [(1, 1)], "c": [(1, 3)]}, progress=False)
    dla = direct_logit_attribution(model, data, ["parametric-context"], progress=False).components
    heads = dla[(dla.kind == "head") & (dla.layer == 1)].set_index(["conflict_type", "example", "head"]).dla
    per = result.per_example.set_index(["conflict_type", "example", "condition"]).delta
    for name, head in {"a": 0, "b": 1, "c": 3}.items():
        got = per.xs(name, level="condition").sort_index()
        want = -heads.xs(head, level="head").astype(float).sort_index()
        assert np.allclose(got.to_numpy(), want.to_numpy(), atol=1e-4)
    everything = result.per_example[result.per_example.kind == "all"]
    assert set(everything.condition) == {"a + b + c"} and np.allclose(everything.residual, 0.0, atol=1e-5)


def test_mlp_classes_and_the_plain_logit(shared):
    model, data = shared
    result = additivity(
        model, data, {"mlp0": [("mlp", 0)], "attn1": [("attn", 1)]}, direction="parametric", progress=False
    )
    prompt = data[0].prompts["clean"]
    answer = cp.runtime.answer_token(model, data[0].answer, prompt)
    with torch.inference_mode():
        logits = model(prompt)[0, -1]
    row = result.per_example.query("conflict_type == 'clean' and example == 0 and condition == 'mlp0'").iloc[0]
    assert row.p_clean == pytest.approx(float(logits[answer]), abs=1e-4)

    def hook(act, hook):
        act = act.clone()
        act[:, -1] = 0.0
        return act

    with torch.inference_mode(), model.hooks(fwd_hooks=[("blocks.0.hook_mlp_out", hook)]):
        ablated = model(prompt)[0, -1]
    assert row.p == pytest.approx(float(ablated[answer]), abs=1e-4)


def test_mechanism_classes_from_head_categories(tiny_gpt2):
    data = cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gpt2)
    attribution = direct_logit_attribution(tiny_gpt2, data, ["parametric"], progress=False)
    categories = head_categories(attribution, "clean", threshold=0.5, mixed_min=0.2, min_dla=-1e9)
    classes = mechanism_classes(categories, model=tiny_gpt2)
    assert classes["MLPs"] == [("mlp", 0), ("mlp", 1), ("mlp", 2)]
    heads = [h for name, members in classes.items() if name != "MLPs" for h in members]
    assert len(heads) == len(set(heads))
    for name, members in classes.items():
        if name != "MLPs":
            cat = categories.set_index(["layer", "head"]).category
            assert {cat[h] for h in members} == {name.removesuffix(" heads")}
    with pytest.raises(ValueError, match="two categories"):
        both = head_categories(attribution, threshold=0.5, mixed_min=0.2, min_dla=-1e9)
        mechanism_classes(both.assign(category=np.where(both.conflict_type == "clean", "subject", "relation")))


def test_clear_errors(linear):
    model, data = linear
    with pytest.raises(ValueError, match="'b' is empty"):
        additivity(model, data, {"a": [(1, 0)], "b": []}, progress=False)
    with pytest.raises(ValueError, match="overlap"):
        additivity(model, data, {"a": [(1, 0)], "b": [(1, 0), (1, 1)]}, progress=False)
    with pytest.raises(ValueError, match="overlap"):
        additivity(model, data, {"a": [(1, 0)], "b": [("attn", 1)]}, progress=False)
    with pytest.raises(ValueError, match="at least two"):
        additivity(model, data, {"a": [(1, 0)]}, progress=False)
    with pytest.raises(ValueError, match="attention-only"):
        additivity(model, data, {"a": [(1, 0)], "m": [("mlp", 0)]}, progress=False)
    with pytest.raises(ValueError, match="ablation"):
        additivity(model, data, {"a": [(1, 0)], "b": [(1, 1)]}, ablation="resample", progress=False)
    with pytest.raises(ValueError, match="not a component"):
        additivity(model, data, {"a": [(1, 0)], "b": [1]}, progress=False)
    with pytest.raises(ValueError):
        additivity(model, data, {"a": [(1, 0)], "b": [(5, 0)]}, progress=False)


def test_additivity_figure(linear):
    from cpsuper.plots.additivity import plot_additivity

    model, data = linear
    result = additivity(model, data, {"a": [(1, 0)], "b": [(1, 1)], "c": [(0, 2)]}, progress=False)
    fig = plot_additivity(result)
    names = {trace.name for trace in fig.data}
    assert {"ablated together", "sum of singles"} <= names
    residual = [t for t in fig.data if t.name == "residual"]
    assert residual and len(residual[0].x) == 4  # three pairs and all together
    assert residual[0].error_y.array is not None
