"""Ablation kinds (zero / mean / resample) of knockout_sweep and head_sweep, each checked
against a hand-written ``run_with_hooks`` loop on the tiny models."""

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.ablation import derangement, mean_outputs
from cpsuper.edits import HeadEdit, ModuleEdit, OffsetEdit
from cpsuper.knockouts import consistent_gains
from cpsuper.sweeps import sweep_dataset


@pytest.fixture(scope="module")
def data(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=4, tokenizer=tiny_gemma)


def _prob(model, prompt, token, hooks=()):
    with torch.no_grad():
        logits = model.run_with_hooks(prompt, fwd_hooks=list(hooks))
    return logits[0, -1].softmax(-1)[token].item()


def _hand_deltas(model, data, conflict_type, target, hooks_for):
    """delta per example, with ``hooks_for(i)`` the hooks of example ``i``."""
    out = []
    for i, example in enumerate(data):
        prompt = example.prompts[conflict_type]
        token = cp.runtime.answer_token(model, example.target_answer(target), prompt)
        out.append(_prob(model, prompt, token, hooks_for(i)) - _prob(model, prompt, token))
    return np.array(out)


def _rows(per, conflict_type, target, **labels):
    mask = (per.conflict_type == conflict_type) & (per.target == target)
    for key, value in labels.items():
        mask &= per[key] == value
    return per[mask].sort_values("example").delta.to_numpy()


def _hand_mean(model, prompts, name):
    """Mean of ``name`` over every token of ``prompts``, one prompt at a time."""
    acts = []
    for prompt in prompts:
        _, cache = model.run_with_cache(prompt, names_filter=name)
        acts.append(cache[name][0])
    return torch.cat(acts).mean(0)


def _all_prompts(data):
    return [p for c in data.conflict_types for p in data.prompts(c)]


def _replace(value, head=None):
    def hook(act, hook):
        act = act.clone()
        if head is None:
            act[:] = value
        else:
            act[:, :, head] = value
        return act

    return hook


# --- zero is today's sweep ---------------------------------------------------------------------


def test_zero_ablation_is_todays_sweep_bit_for_bit(tiny, data):
    result = cp.knockout_sweep(tiny, data, targets=("parametric", "context"), progress=False)
    grid = [(l, m) for l in range(tiny.cfg.n_layers) for m in ("attn", "mlp", "layer")]
    labels = pd.DataFrame(grid, columns=["layer", "module"])
    today = sweep_dataset(tiny, data, [[ModuleEdit(l, m, 0.0)] for l, m in grid], labels, progress=False)
    assert (result.per_example.ablation == "zero").all()
    pd.testing.assert_frame_equal(result.per_example.drop(columns="ablation"), today.per_example, check_exact=True)
    pd.testing.assert_frame_equal(result.summary.drop(columns="ablation"), today.summary, check_exact=True)

    heads = cp.head_sweep(tiny, data, alphas=(0.0, 2.0), layers=[1], progress=False)
    grid = [(1, h, a) for h in range(tiny.cfg.n_heads) for a in (0.0, 2.0)]
    today = sweep_dataset(
        tiny, data, [[HeadEdit(l, h, scale=a)] for l, h, a in grid], pd.DataFrame(grid, columns=["layer", "head", "alpha"]),
        progress=False,
    )  # fmt: skip
    pd.testing.assert_frame_equal(heads.per_example.drop(columns="ablation"), today.per_example, check_exact=True)


# --- mean ----------------------------------------------------------------------------------------


def test_mean_with_one_row_reference_is_that_prompts_position_mean(tiny, data):
    reference = data[2:3].with_prompts(["clean"])
    result = cp.knockout_sweep(
        tiny, data, modules=("mlp",), layers=[1], conflict_types=["substitution"], ablation="mean",
        reference=reference, progress=False,
    )  # fmt: skip
    name = "blocks.1.hook_mlp_out"
    _, cache = tiny.run_with_cache(reference[0].prompts["clean"], names_filter=name)
    mean = cache[name][0].mean(0)  # the one reference prompt, averaged over its positions
    expected = _hand_deltas(tiny, data, "substitution", "parametric", lambda i: [(name, _replace(mean))])
    np.testing.assert_allclose(_rows(result.per_example, "substitution", "parametric"), expected, atol=1e-5)
    assert (result.per_example.ablation == "mean").all()


def test_mean_knockouts_equal_a_hand_mean_replacement_loop(tiny, data):
    result = cp.knockout_sweep(
        tiny, data, targets=("parametric", "context"), ablation="mean", progress=False
    )  # reference: the swept dataset, every conflict type
    per = result.per_example
    prompts = _all_prompts(data)
    for layer, module, conflict_type, target in [
        (0, "attn", "clean", "parametric"),
        (1, "mlp", "coherent", "context"),
        (2, "layer", "substitution", "parametric"),
    ]:
        kinds = ("attn", "mlp") if module == "layer" else (module,)
        names = [f"blocks.{layer}.hook_{k}_out" for k in kinds]
        hooks = [(n, _replace(_hand_mean(tiny, prompts, n))) for n in names]
        expected = _hand_deltas(tiny, data, conflict_type, target, lambda i, hooks=hooks: hooks)
        np.testing.assert_allclose(_rows(per, conflict_type, target, layer=layer, module=module), expected, atol=1e-5)


def test_mean_head_sweep_equals_the_hand_formula(tiny, data):
    result = cp.head_sweep(
        tiny, data, alphas=(0.0, 0.5, 0.25), layers=[0, 2], heads=[1], ablation="mean", progress=False
    )
    per = result.per_example
    prompts = _all_prompts(data)
    for layer, alpha, conflict_type in [(0, 0.0, "coherent"), (2, 0.5, "substitution"), (0, 0.25, "clean")]:
        name = f"blocks.{layer}.attn.hook_z"
        mean = _hand_mean(tiny, prompts, name)[1]

        def mix(z, hook, alpha=alpha, mean=mean):
            z = z.clone()
            z[:, :, 1] = alpha * z[:, :, 1] + (1 - alpha) * mean
            return z

        expected = _hand_deltas(tiny, data, conflict_type, "context", lambda i, name=name, mix=mix: [(name, mix)])
        got = _rows(per, conflict_type, "context", layer=layer, head=1, alpha=alpha)
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_mean_outputs_are_position_means_over_all_real_tokens(tiny_gemma, data):
    names = ["blocks.1.attn.hook_z", "blocks.2.hook_attn_out"]
    means = mean_outputs(tiny_gemma, data, names, batch_size=3)  # padded batches of mixed lengths
    for name in names:
        torch.testing.assert_close(means[name], _hand_mean(tiny_gemma, _all_prompts(data), name), atol=1e-6, rtol=0)


# --- resample ------------------------------------------------------------------------------------


def _patch_from(model, source_prompt, name, head=None, alpha=0.0):
    """Hook putting the source prompt's activation in at positions aligned from the end; positions
    of the destination without a counterpart keep their own value."""
    _, cache = model.run_with_cache(source_prompt, names_filter=name)
    source = cache[name][0]

    def hook(act, hook):
        act = act.clone()
        n_dest, n_src = act.shape[1], source.shape[0]
        for d in range(n_dest):
            s = d + n_src - n_dest
            if 0 <= s < n_src:
                if head is None:
                    act[0, d] = alpha * act[0, d] + (1 - alpha) * source[s]
                else:
                    act[0, d, head] = alpha * act[0, d, head] + (1 - alpha) * source[s, head]
        return act

    return hook


def test_resample_knockouts_equal_patching_from_the_other_prompt(tiny, data):
    lengths = {len(tiny.to_tokens(p)[0]) for p in data.prompts("substitution")}
    assert len(lengths) > 1  # the end alignment is exercised
    result = cp.knockout_sweep(
        tiny, data, targets=("parametric", "context"), ablation="resample", seed=3, progress=False
    )
    per = result.per_example
    sources = per.attrs["sources"]
    assert sources == derangement(len(data), 3) and all(s != i for i, s in enumerate(sources))
    for layer, module, conflict_type, target in [
        (0, "layer", "substitution", "context"),
        (2, "attn", "clean", "parametric"),
    ]:
        kinds = ("attn", "mlp") if module == "layer" else (module,)

        def hooks_for(i, layer=layer, kinds=kinds, conflict_type=conflict_type):
            prompt = data[sources[i]].prompts[conflict_type]
            return [(n, _patch_from(tiny, prompt, n)) for n in (f"blocks.{layer}.hook_{k}_out" for k in kinds)]

        expected = _hand_deltas(tiny, data, conflict_type, target, hooks_for)
        np.testing.assert_allclose(_rows(per, conflict_type, target, layer=layer, module=module), expected, atol=1e-5)


def test_resample_head_sweep_mixes_the_other_prompts_head_output(tiny, data):
    result = cp.head_sweep(
        tiny, data, alphas=(0.0, 0.25, 1.0), layers=[1], heads=[2], ablation="resample", seed=0, progress=False
    )
    per = result.per_example
    sources = per.attrs["sources"]
    assert np.abs(per[per.alpha == 1.0].delta).max() < 1e-6  # keeping all of the head changes nothing
    name = "blocks.1.attn.hook_z"
    for alpha, conflict_type in [(0.0, "coherent"), (0.25, "substitution")]:

        def hooks_for(i, alpha=alpha, conflict_type=conflict_type):
            return [(name, _patch_from(tiny, data[sources[i]].prompts[conflict_type], name, head=2, alpha=alpha))]

        expected = _hand_deltas(tiny, data, conflict_type, "parametric", hooks_for)
        got = _rows(per, conflict_type, "parametric", layer=1, head=2, alpha=alpha)
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_derangement_moves_every_example_and_follows_the_seed():
    for n in (2, 3, 10):
        order = derangement(n, seed=1)
        assert sorted(order) == list(range(n)) and all(o != i for i, o in enumerate(order))
    assert derangement(10, 1) == derangement(10, 1) and derangement(10, 1) != derangement(10, 2)


# --- results of several kinds, bad input ---------------------------------------------------------


def test_kinds_concatenate_and_tables_refuse_mixed_kinds(tiny_gemma, data):
    runs = [
        cp.head_sweep(tiny_gemma, data, (0.0,), layers=[2], ablation=k, progress=False) for k in cp.ablation.ABLATIONS
    ]
    summary = pd.concat([r.summary for r in runs], ignore_index=True)
    assert set(summary.ablation) == {"zero", "mean", "resample"}
    with pytest.raises(ValueError, match="mixes ablations"):
        cp.rank_heads(summary, k=2)
    cp.rank_heads(summary[summary.ablation == "mean"], k=2)
    knock = pd.concat(
        [cp.knockout_sweep(tiny_gemma, data, layers=[0], ablation=k, progress=False).summary for k in ("zero", "mean")]
    )
    with pytest.raises(ValueError, match="mixes ablations"):
        consistent_gains(knock)


def test_bad_input(tiny_gemma, data):
    empty = data[:1]
    empty.examples = []  # a dataset emptied after construction
    with pytest.raises(ValueError, match="reference has no examples"):
        cp.knockout_sweep(tiny_gemma, data, layers=[0], ablation="mean", reference=empty, progress=False)
    with pytest.raises(TypeError, match="reference must be a ConflictDataset"):
        cp.head_sweep(tiny_gemma, data, layers=[0], ablation="mean", reference=list(data), progress=False)
    with pytest.raises(ValueError, match="Unknown ablation 'means'"):
        cp.knockout_sweep(tiny_gemma, data, ablation="means", progress=False)
    with pytest.raises(ValueError, match="Unknown ablation"):
        cp.head_sweep(tiny_gemma, data, ablation=None, progress=False)
    with pytest.raises(ValueError, match="at least 2 examples"):
        cp.knockout_sweep(tiny_gemma, data[:1], layers=[0], ablation="resample", progress=False)
    with pytest.raises(ValueError, match="shape"):
        cp.engine.run_conditions(
            tiny_gemma, [[1, 2, 3]], torch.tensor([[5]]), [[OffsetEdit(0, "attn_out", torch.zeros(3))]], progress=False
        )
    with pytest.raises(ValueError, match="needs a query head"):
        cp.engine.run_conditions(
            tiny_gemma, [[1, 2, 3]], torch.tensor([[5]]), [[OffsetEdit(0, "z", torch.zeros(4))]], progress=False
        )
