"""The baselines as the JuICE paper defines them: Prompt, PH3 (path patching) and knockout pruning."""

import pytest
import torch

import cpsuper as cp
from cpsuper.baselines import KnockoutPruning, PromptInstruction
from cpsuper.heads import head_sweep
from cpsuper.interventions import ScaleHead, intervene
from cpsuper.path_patching import patching_roles, path_patching


@pytest.fixture(scope="module")
def capitals(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=4, tokenizer=tiny_gemma)


@pytest.mark.parametrize("direction", ["parametric", "context"])
def test_prompt_baseline_leaves_clean_prompts_alone(tiny_gemma, capitals, direction):
    method = PromptInstruction(tiny_gemma, direction=direction)
    original = cp.Original(tiny_gemma, direction=direction)
    assert method._prompts(capitals, "clean") == capitals.prompts("clean")
    torch.testing.assert_close(method.logits_for(capitals, "clean"), original.logits_for(capitals, "clean"))
    assert method.generate_for(capitals, "clean", 3) == original.generate_for(capitals, "clean", 3)
    # Where a context conflicts, the paper's instruction comes first.
    for conflict_type, kind in (("substitution", "sentence"), ("coherent", "passage")):
        prompts = method._prompts(capitals, conflict_type)
        instruction = cp.baselines.INSTRUCTIONS[(direction, kind)]
        assert prompts == [f"{instruction} {p}" for p in capitals.prompts(conflict_type)]
    differs = method.logits_for(capitals, "substitution") - original.logits_for(capitals, "substitution")
    assert differs.abs().max() > 1e-3


def _pruned_logits(model, heads, dataset, conflict_type):
    with intervene(model, [ScaleHead(l, h, 0.0) for l, h in heads]):
        return cp.scoring.final_logits(model, dataset.prompts(conflict_type), progress=False)


def test_ph3_prunes_the_context_heads_found_by_path_patching(tiny_gemma, capitals):
    ph3 = cp.PH3(tiny_gemma, ks=(1, 3)).fit(capitals[:2], capitals[2:], progress=False)
    roles = patching_roles(path_patching(tiny_gemma, capitals[:2], progress=False))
    assert ph3.heads == [(int(l), int(h)) for l, h in zip(roles.layer, roles["head"])]
    assert ph3.patching.delta_mean.is_monotonic_decreasing  # strongest context head first
    assert ph3.k in (1, 3) and len(ph3.tuning) == 2
    expected = _pruned_logits(tiny_gemma, ph3.heads[: ph3.k], capitals, "coherent")
    torch.testing.assert_close(ph3.logits_for(capitals, "coherent"), expected, atol=1e-5, rtol=0)


def test_ph3_toward_the_context_prunes_memory_heads(tiny_gemma, capitals):
    ph3 = cp.PH3(tiny_gemma, direction="context", ks=(1,)).fit(capitals[:2], capitals[2:], progress=False)
    assert ph3.patching.delta_mean.is_monotonic_increasing  # strongest memory head first
    assert ph3.heads[0] == (int(ph3.patching.layer[0]), int(ph3.patching["head"][0]))
    assert ph3.patching.delta_mean[0] < 0


def test_knockout_pruning_keeps_the_old_ranking(tiny_gemma, capitals):
    pruning = KnockoutPruning(tiny_gemma, ks=(1,)).fit(capitals[:2], capitals[2:], progress=False)
    sweep = head_sweep(tiny_gemma, capitals[:2], (0.0,), targets=("parametric",), progress=False)
    gain = sweep.summary.groupby(["layer", "head"])["delta_mean"].sum().sort_values(ascending=False)
    assert pruning.heads == [(int(l), int(h)) for l, h in gain.index]
    ph3 = cp.PH3(tiny_gemma, ks=(1,)).fit(capitals[:2], capitals[2:], progress=False)
    assert ph3.heads != pruning.heads  # the two rankings are different methods


def test_ph3_needs_conflict_and_clean_prompts(tiny_gemma, capitals):
    with pytest.raises(ValueError, match="only clean prompts"):
        cp.PH3(tiny_gemma, ks=(1,)).fit(capitals.with_prompts(["clean"]), capitals, progress=False)
    with pytest.raises(ValueError, match="clean"):
        cp.PH3(tiny_gemma, ks=(1,)).fit(capitals.with_prompts(["coherent"]), capitals, progress=False)


def test_evaluation_intervals_cells_and_macro_average():
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(1)
    rows = [
        {"method": m, "relation": r, "example": i, "conflict_type": c, "correct": float(rng.random() < p)}
        for m, p in (("Original", 0.3), ("JuICE", 0.8))
        for r, n in (("capital", 12), ("author", 4))  # unequal sizes: the average weights relations equally
        for i in range(n)
        for c in ("clean", "coherent")
    ]
    results = pd.DataFrame(rows)
    table = cp.baselines.evaluation_intervals(results, n_boot=500)
    assert set(table.relation) == {"capital", "author", "average"}
    means = results.groupby(["method", "relation", "conflict_type"]).correct.mean()
    for row in table.itertuples():
        assert row.ci_low <= row.mean <= row.ci_high
        if row.relation == "average":
            expected = means.loc[row.method].xs(row.conflict_type, level="conflict_type").mean()
            assert row.n == 16
        else:
            expected = means.loc[(row.method, row.relation, row.conflict_type)]
        assert row.mean == pytest.approx(expected)
    flat = cp.evaluation_table(results)  # the same averages as the interval-free table
    avg = table[table.relation == "average"].set_index(["method", "conflict_type"])["mean"]
    for (method, conflict_type), value in avg.items():
        assert flat.loc[method, ("average", conflict_type)] == pytest.approx(value)
    with pytest.raises(ValueError, match="lacks the columns"):
        cp.baselines.evaluation_intervals(results.drop(columns="relation"))


def test_evaluate_decodes_what_methods_share_with_the_plain_model_once(tiny_gemma, capitals, monkeypatch):
    """Prompt and CAD decode clean prompts as the plain model does: after Original, evaluate hands
    them only their other requests, and their clean rows are Original's."""
    methods = {"Original": cp.Original(tiny_gemma), "Prompt": PromptInstruction(tiny_gemma), "CAD": cp.CAD(tiny_gemma)}
    asked = {}
    for name, method in methods.items():
        decode = method.generate_many

        def spy(requests, *args, name=name, decode=decode, **kwargs):
            asked[name] = [c for _, c in requests]
            return decode(requests, *args, **kwargs)

        monkeypatch.setattr(method, "generate_many", spy)
    types = ["clean", "substitution", "coherent"]
    results = cp.evaluate(methods, capitals, types, max_new_tokens=3)
    assert asked == {"Original": types, "Prompt": types[1:], "CAD": types[1:]}
    clean = results[results.conflict_type == "clean"].set_index(["method", "example"]).continuation
    assert (clean["Prompt"] == clean["Original"]).all() and (clean["CAD"] == clean["Original"]).all()
    # A steered method decodes its own; so does one that reads other answers where it does (toward
    # the context on substitution prompts; on a clean prompt both directions read the true answer).
    steered = cp.JuICE(tiny_gemma, enhance=[(1, 1)], beta_plus=2.0, dual_run=False)
    others = {"JuNe": steered, "toward context": cp.Original(tiny_gemma, direction="context")}
    for name, method in others.items():
        decode = method.generate_many
        monkeypatch.setattr(
            method, "generate_many", lambda r, *a, n=name, d=decode, **k: asked.update({n: r}) or d(r, *a, **k)
        )
    cp.evaluate({"Original": methods["Original"], **others}, capitals, types[:2], max_new_tokens=3)
    assert [c for _, c in asked["JuNe"]] == types[:2] and [c for _, c in asked["toward context"]] == ["substitution"]
