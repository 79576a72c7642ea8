"""The context gate: a steering that acts only on prompts whose unsteered next-token distribution
puts enough mass on the prompt's own tokens (cpsuper.context_gate)."""

from dataclasses import replace

import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.context_gate import DEFAULT_CONTEXT_GATE, prompt_token_mass
from cpsuper.tuning import beta_tuning

PROMPTS = [
    "According to the textbook, the capital city of France is Lima. The capital city of France is",
    "The book Dracula was written by",
    "Madrid is located in",
    "Rome Rome Rome Rome Rome Rome",
]


def _mass_by_hand(model, prompt):
    tokens = model.to_tokens(prompt)
    with torch.no_grad():
        probs = model(tokens)[0, -1].float().softmax(-1)
    own = sorted(set(tokens[0].tolist()) - set(model.tokenizer.all_special_ids))
    return probs[own].sum()


def _steer(model, gate):
    return cp.JuICE(
        model, enhance=[(1, 1), (2, 0)], suppress=[(0, 2)], beta_plus=3.0, beta_minus=-2.0, context_gate=gate
    )


def _median_gate(model, prompts):
    """A threshold that opens the gate for some prompts and not for others."""
    mass = prompt_token_mass(model, prompts).sort().values
    gate = float(mass[len(mass) // 2 - 1] + mass[len(mass) // 2]) / 2  # halfway: no prompt sits on it
    assert 0 < gate <= 1 and 0 < int((mass >= gate).sum()) < len(prompts)
    return gate


def test_prompt_token_mass_equals_a_hand_computation(tiny):
    expected = torch.stack([_mass_by_hand(tiny, p) for p in PROMPTS])
    torch.testing.assert_close(prompt_token_mass(tiny, PROMPTS, batch_size=2), expected, atol=1e-5, rtol=0)
    assert len(set(expected.tolist())) == len(PROMPTS) and bool(((expected > 0) & (expected < 1)).all())


def test_a_gated_steering_is_the_steering_where_open_and_the_plain_model_elsewhere(tiny_gemma):
    gate = _median_gate(tiny_gemma, PROMPTS)
    opened = torch.stack([_mass_by_hand(tiny_gemma, p) for p in PROMPTS]) >= gate  # not the gate's own code
    gated, always = _steer(tiny_gemma, gate), _steer(tiny_gemma, None)
    plain = cp.scoring.final_logits(tiny_gemma, PROMPTS, progress=False)
    expected = torch.where(opened[:, None], always.logits(PROMPTS), plain)
    torch.testing.assert_close(gated.logits(PROMPTS), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(always.logits(PROMPTS), plain, atol=1e-3)  # the steering does change logits
    steered, unsteered = (
        always.generate(PROMPTS, 4),
        cp.scoring.greedy_continuations(tiny_gemma, PROMPTS, max_new_tokens=4, progress=False),
    )
    assert gated.generate(PROMPTS, 4) == [s if o else u for s, u, o in zip(steered, unsteered, opened.tolist())]
    for i, prompt in enumerate(PROMPTS):  # one prompt's activations: steered only where the gate opens
        _, cache = gated.run_with_cache(prompt, names_filter="ln_final.hook_normalized")
        _, reference = (always if opened[i] else cp.JuICE(tiny_gemma)).run_with_cache(
            prompt, names_filter="ln_final.hook_normalized"
        )
        torch.testing.assert_close(cache["ln_final.hook_normalized"], reference["ln_final.hook_normalized"])


def test_gated_accuracy_and_tuning_rows_equal_one_gated_steering_at_a_time(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=4, tokenizer=tiny_gemma)
    prompts = [p for c in data.conflict_types for p in data.prompts(c)]
    gate = _median_gate(tiny_gemma, prompts)
    gated, always = _steer(tiny_gemma, gate), _steer(tiny_gemma, None)
    plain = cp.JuICE(tiny_gemma).accuracy(data, max_new_tokens=4, full_continuations=True)
    steered = always.accuracy(data, max_new_tokens=4, full_continuations=True)
    opened = (torch.stack([_mass_by_hand(tiny_gemma, p) for p in prompts]) >= gate).numpy()
    expected = steered.where(pd.Series(opened, index=steered.index), plain, axis=0)
    got = gated.accuracy(data, max_new_tokens=4, full_continuations=True)
    pd.testing.assert_frame_equal(got, expected, atol=1e-5, check_dtype=False)
    # the tuning grid's rows, decoded together, equal each pair's gated accuracy on its own
    grid = replace(gated, beta_pos_grid=(0.0, 3.0), beta_neg_grid=(0.0, -2.0))
    table = beta_tuning(grid, data, max_new_tokens=4).set_index(["beta_plus", "beta_minus"])
    for bp, bm in [(3.0, -2.0), (0.0, -2.0), (3.0, 0.0)]:
        one = replace(gated, beta_plus=bp, beta_minus=bm).accuracy(data, max_new_tokens=4)
        assert table.loc[(bp, bm), "accuracy"] == pytest.approx(one.groupby("conflict_type").correct.mean().sum())
        assert table.loc[(bp, bm), "probability"] == pytest.approx(one.p_target.sum(), abs=1e-4)


@pytest.mark.filterwarnings("ignore::cpsuper.juice.SteeringWarning")
def test_the_gated_recipe_fits_conflict_heads_with_the_default_gate_and_round_trips(tiny_gemma, tmp_path):
    from cpsuper.data.examples import ConflictDataset

    data = cp.conflict_dataset("world_capital", n=6, tokenizer=tiny_gemma)
    texts = cp.scoring.greedy_continuations(tiny_gemma, data.prompts("clean"), max_new_tokens=8, progress=False)
    known = ConflictDataset([replace(e, aliases=(t.split()[0],)) for e, t in zip(data, texts)], "known")
    grids = dict(pos_grid=(1.0, 10.0), neg_grid=(-1.0,), beta_pos_grid=(0.0, 2.0), beta_neg_grid=(0.0, -2.0))
    options = dict(progress=False, clean_margin=0.0)
    gated = cp.JuICE(tiny_gemma, k=2, **grids).fit(known[:2], known[2:5], recipe="robust-gated", **options)
    plain = cp.JuICE(tiny_gemma, k=2, **grids).fit(known[:2], known[2:5], recipe="robust-conflict", **options)
    assert gated.context_gate == DEFAULT_CONTEXT_GATE and gated.fitted_on["context_gate"] == DEFAULT_CONTEXT_GATE
    assert plain.context_gate is None and (gated.enhance, gated.suppress) == (plain.enhance, plain.suppress)
    own = cp.JuICE(tiny_gemma, k=2, context_gate=0.5, **grids).fit(known[:2], known[2:5], recipe="robust", **options)
    assert own.context_gate == 0.5  # a steering's own gate is kept, and its strengths tuned under it
    gated.save(tmp_path / "gated.json")
    loaded = cp.JuICE.load(tmp_path / "gated.json", tiny_gemma)
    assert loaded.context_gate == gated.context_gate and loaded.to_dict()["context_gate"] == DEFAULT_CONTEXT_GATE
    assert "prompt-token mass >= 0.3" in repr(_steer(tiny_gemma, 0.3))


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, "0.3", True, float("nan")])
def test_a_gate_outside_0_1_is_refused_with_what_it_means(tiny_gemma, bad):
    with pytest.raises(ValueError, match="context_gate is the prompt-token mass"):
        _steer(tiny_gemma, bad)


def test_a_fit_whose_gate_stays_shut_on_most_conflict_prompts_says_so(tiny_gemma):
    """The tuning table records the share of each prompt type the gate opens for; a fit that steers
    but whose gate opened for under half of some conflict type's validation prompts warns."""
    data = cp.conflict_dataset("world_capital", n=8, tokenizer=tiny_gemma)
    select, validation = data[:3], data[3:]
    conflict = validation.prompts("substitution")
    mass = torch.stack([_mass_by_hand(tiny_gemma, p) for p in conflict]).sort().values
    gate = float(mass[-2] + mass[-1]) / 2  # opens for one substitution prompt in five
    grids = dict(pos_grid=(1.0, 10.0), neg_grid=(-1.0,), beta_pos_grid=(0.0, 2.0), beta_neg_grid=(0.0, -2.0))
    steer = cp.JuICE(tiny_gemma, k=2, context_gate=gate, **grids)
    table = beta_tuning(replace(steer, enhance=[(1, 1)], suppress=[(0, 2)]), validation, max_new_tokens=2)
    assert table.gate_substitution.tolist() == pytest.approx([0.2] * len(table)) and {
        "gate_clean",
        "gate_coherent",
    } <= set(table.columns)
    one_pair = replace(steer, beta_pos_grid=(2.0,), beta_neg_grid=(-2.0,))  # the paper's rule then steers
    with pytest.warns(cp.juice.SteeringWarning, match=r"opened for only 20% of the substitution prompts"):
        steer = one_pair.fit(select, validation, progress=False, recipe="paper")
    assert steer.steers and steer.fitted_on["gate_open"]["substitution"] == pytest.approx(0.2)
