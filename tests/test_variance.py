"""Selection-set variance of JuICE (cpsuper.variance): draws, stage 1 scored once, the robust
beta objective, and the plot; on the tiny models, plus one slow check on the embedded model."""

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

import cpsuper as cp
import cpsuper.variance as variance
from cpsuper.plots.variance import plot_selection_variance
from cpsuper.runtime import answer_token
from cpsuper.tuning import choose_betas, tune_betas
from cpsuper.variance import aggregate_heads, selection_variance

FAST = {"pos_grid": (1.0,), "neg_grid": (-1.0,), "k": 2, "progress": False}


@pytest.fixture(scope="module")
def known_tiny(tiny_gemma):
    """Eight facts whose parametric answer is, by construction, the first word the tiny model
    continues the clean prompt with, so Original's clean accuracy is 1 and the other conflict
    types are not all 0 or all 1."""
    data = cp.conflict_dataset("world_capital", n=8, seed=3, tokenizer=tiny_gemma)
    texts = cp.scoring.greedy_continuations(tiny_gemma, data.prompts("clean"), max_new_tokens=8, progress=False)
    examples = [replace(e, aliases=(text.split()[0],)) for e, text in zip(data, texts)]
    return cp.ConflictDataset(examples, "tiny known")


def _heads(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in pair.split(", ")) for pair in text.strip("()").split(") (")] if text else []


def test_same_seed_same_draws_and_results(tiny_gemma, known_tiny):
    options = {**FAST, "draws": 3, "n_select": 2, "n_validation": 2, "n_pool": 5, "beta_pos_grid": (0.0, 2.0)}
    first = selection_variance(tiny_gemma, known_tiny, seed=1, **options)
    again = selection_variance(tiny_gemma, known_tiny, seed=1, **options)
    pd.testing.assert_frame_equal(first.per_draw, again.per_draw)
    pd.testing.assert_frame_equal(first.summary, again.summary)
    # The draws differ from one another, and another seed draws other facts.
    assert first.per_draw.selection.nunique() > 1
    other = selection_variance(tiny_gemma, known_tiny, seed=2, **options)
    assert list(other.per_draw.selection) != list(first.per_draw.selection)


def test_a_study_run_in_parts_equals_the_whole(tiny_gemma, known_tiny):
    """Draws are seeded by their number: draws 0-1 then 2 (first_draw=2) are the three draws of
    one run, so a long study can be resumed and its parts concatenated."""
    options = {**FAST, "n_select": 2, "n_validation": 2, "n_pool": 5, "beta_pos_grid": (0.0, 2.0), "seed": 1}
    whole = selection_variance(tiny_gemma, known_tiny, draws=3, **options)
    first = selection_variance(tiny_gemma, known_tiny, draws=2, scored=whole.scored, **options)
    rest = selection_variance(tiny_gemma, known_tiny, draws=1, first_draw=2, scored=whole.scored, **options)
    parts = pd.concat([first.per_draw, rest.per_draw], ignore_index=True)
    pd.testing.assert_frame_equal(parts, whole.per_draw)
    assert set(rest.per_draw.draw) == {2}
    with pytest.raises(ValueError, match="first_draw"):
        selection_variance(tiny_gemma, known_tiny, draws=1, first_draw=-1, scored=whole.scored, **options)


def test_stage_one_scored_once_and_test_facts_never_drawn(tiny_gemma, known_tiny, monkeypatch):
    calls = []
    real = variance.identify_heads

    def counting(model, selection, *args, **kwargs):
        calls.append([e.subject for e in selection])
        return real(model, selection, *args, **kwargs)

    monkeypatch.setattr(variance, "identify_heads", counting)
    pool, test = known_tiny[:6], known_tiny[6:]
    result = selection_variance(tiny_gemma, pool, test=test, draws=4, n_select=2, n_validation=2, **FAST)
    assert calls == [[e.subject for e in pool]]
    drawn = set("; ".join(result.per_draw.selection + "; " + result.per_draw.validation).split("; "))
    assert drawn <= {e.subject for e in pool} and not drawn & {e.subject for e in test}
    assert result.settings["test"] == [e.subject for e in test]
    # Re-using the scores runs no stage 1 at all.
    selection_variance(tiny_gemma, pool, test=test, draws=2, n_select=2, n_validation=2, scored=result.scored, **FAST)
    assert len(calls) == 1


def test_draw_heads_equal_stage_one_on_the_draw(tiny_gemma, known_tiny):
    """Each draw's heads equal stage 1 run on its selection facts: on every prompt for the paper
    recipe, on the conflict prompts alone for robust-conflict."""
    pool, test = known_tiny[:6], known_tiny[6:]
    recipes = ("paper", "robust-conflict")
    result = selection_variance(
        tiny_gemma, pool, test=test, draws=2, n_select=3, n_validation=2, recipes=recipes, **FAST
    )
    for recipe, types in zip(recipes, (None, ["substitution", "coherent"])):
        row = result.per_draw[result.per_draw.recipe == recipe].iloc[0]
        names = set(row.selection.split("; "))
        chosen = pool.filter(lambda e, names=names: e.subject in names)
        direct = cp.identify_heads(
            tiny_gemma,
            chosen,
            "parametric",
            pos_grid=(1.0,),
            neg_grid=(-1.0,),
            k=2,
            conflict_types=types,
            progress=False,
        )
        assert _heads(row.enhance) == direct.enhance and _heads(row.suppress) == direct.suppress
    paper, conflict = (result.per_draw[result.per_draw.recipe == r] for r in recipes)
    assert list(paper.enhance + paper.suppress) != list(conflict.enhance + conflict.suppress)  # the choice matters


def test_steered_rows_match_a_hand_built_juice(tiny_gemma, known_tiny):
    pool, test = known_tiny[:5], known_tiny[5:]
    result = selection_variance(
        tiny_gemma, pool, test=test, draws=1, n_select=2, n_validation=2, recipes="paper", beta_pos_grid=(3.0,),
        beta_neg_grid=(-1.0,), **FAST,
    )  # fmt: skip
    frame = result.per_draw
    for method, dual in (("JuICE", True), ("JuNe", False)):
        rows = frame[frame.method == method].set_index("conflict_type")
        steer = cp.JuICE(
            tiny_gemma, dual_run=dual, enhance=_heads(rows.enhance.iloc[0]), suppress=_heads(rows.suppress.iloc[0]),
            beta_plus=rows.beta_plus.iloc[0], beta_minus=rows.beta_minus.iloc[0],
        )  # fmt: skip
        assert (rows.beta_plus.iloc[0], rows.beta_minus.iloc[0]) == (3.0, -1.0)  # the only pair in the grid
        expected = steer.accuracy(test).groupby("conflict_type")["correct"].mean()
        assert rows.accuracy.to_dict() == pytest.approx(expected.to_dict())
        # First-token accuracy, recomputed from the steered last-position logits alone.
        for conflict_type, row in rows.iterrows():
            prompts = test.prompts(conflict_type)
            top = steer.logits(prompts).argmax(-1).tolist()
            targets = [
                answer_token(tiny_gemma, e.expected_answers("parametric", conflict_type)[0], p)
                for e, p in zip(test, prompts)
            ]
            assert row.first_token_accuracy == pytest.approx(np.mean([a == b for a, b in zip(top, targets)]))


def test_zero_betas_equal_original(tiny_gemma, known_tiny):
    result = selection_variance(
        tiny_gemma, known_tiny, draws=2, n_select=2, n_validation=2, n_pool=4, recipes=("paper", "robust"),
        beta_pos_grid=(0.0,), beta_neg_grid=(0.0,), **FAST,
    )  # fmt: skip
    table = result.per_draw.pivot_table(index=["draw", "recipe", "conflict_type"], columns="method", values="accuracy")
    assert (result.per_draw[["beta_plus", "beta_minus"]] == 0).all().all()
    assert table.Original.loc[:, :, "clean"].eq(1.0).all()  # the fixture's facts are known
    np.testing.assert_array_equal(table.JuICE, table.Original)
    np.testing.assert_array_equal(table.JuNe, table.Original)
    first = result.per_draw.pivot_table(
        index=["draw", "recipe", "conflict_type"], columns="method", values="first_token_accuracy"
    )
    np.testing.assert_array_equal(first.JuICE, first.Original)
    # The summary holds both metrics, each the mean of its own per-draw column.
    summary = result.summary.set_index(["metric", "recipe", "method", "conflict_type"])["mean"]
    for metric, column in variance.METRICS.items():
        means = result.per_draw.groupby(["recipe", "method", "conflict_type"])[column].mean()
        assert summary.loc[metric].sort_index().to_numpy() == pytest.approx(means.sort_index().to_numpy())


def _table(rows):
    return pd.DataFrame(
        rows, columns=["beta_plus", "beta_minus", "acc_clean", "acc_substitution", "acc_coherent", "probability"]
    ).assign(accuracy=lambda t: t.acc_clean + t.acc_substitution + t.acc_coherent)


def test_robust_objective_respects_the_clean_margin():
    table = _table(
        [
            (0.0, 0.0, 1.00, 0.1, 0.0, 1.0),
            (5.0, -3.0, 0.50, 1.0, 1.0, 3.0),  # most accuracy overall: the paper's pick
            (2.0, 0.0, 0.96, 0.8, 0.5, 2.0),  # allowed (drop 0.04 <= 0.05)
            (4.0, 0.0, 0.90, 0.8, 0.7, 2.5),  # drop 0.10: not allowed
        ]
    )
    assert choose_betas(table, "paper")[["beta_plus", "beta_minus"]].tolist() == [5.0, -3.0]
    assert choose_betas(table, "robust", clean_margin=0.05)[["beta_plus", "beta_minus"]].tolist() == [2.0, 0.0]
    assert choose_betas(table, "robust", clean_margin=0.1)[["beta_plus", "beta_minus"]].tolist() == [4.0, 0.0]
    # Ties in conflict accuracy go to the weaker intervention, then to the larger probability.
    tied = _table([(0.0, 0.0, 1.0, 0.0, 0.0, 1.0), (3.0, 0.0, 1.0, 1.0, 0.0, 9.0), (1.0, -1.0, 1.0, 0.5, 0.5, 2.0)])
    assert choose_betas(tied, "robust")[["beta_plus", "beta_minus"]].tolist() == [1.0, -1.0]
    tied.loc[2, ["beta_plus", "beta_minus"]] = (2.0, -1.0)
    assert choose_betas(tied, "robust")[["beta_plus", "beta_minus"]].tolist() == [3.0, 0.0]
    # When every steered pair breaks the rule, the unsteered pair is chosen.
    broken = _table([(0.0, 0.0, 1.0, 0.0, 0.0, 1.0), (1.0, 0.0, 0.5, 1.0, 1.0, 5.0)])
    assert choose_betas(broken, "robust")[["beta_plus", "beta_minus"]].tolist() == [0.0, 0.0]


def test_robust_objective_on_random_tables():
    rng = np.random.default_rng(0)
    for _ in range(200):
        pairs = [(bp, bm) for bp in (0.0, 1.0, 2.0, 3.0) for bm in (0.0, -1.0, -2.0)]
        accs = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(len(pairs), 3))
        table = _table([(*p, *a, rng.random()) for p, a in zip(pairs, accs)])
        margin = float(rng.choice([0.0, 0.05, 0.3]))
        best = choose_betas(table, "robust", clean_margin=margin)
        floor = table.acc_clean.iloc[0] - margin
        allowed = table[(table.acc_clean >= floor) | (table.index == 0)]
        assert best.acc_clean >= floor or (best.beta_plus, best.beta_minus) == (0.0, 0.0)
        conflict = allowed.acc_substitution + allowed.acc_coherent
        assert best.acc_substitution + best.acc_coherent == conflict.max()


def test_tune_betas_sets_the_chosen_pair(tiny_gemma, known_tiny):
    heads = cp.identify_heads(
        tiny_gemma, known_tiny[:2], "parametric", pos_grid=(1.0,), neg_grid=(-1.0,), k=2, progress=False
    )
    steer = cp.JuICE(
        tiny_gemma, enhance=heads.enhance, suppress=heads.suppress, beta_pos_grid=(1.0, 3.0), beta_neg_grid=(-1.0,)
    )
    tuning = tune_betas(steer, known_tiny[2:4], objective="robust")
    assert len(tuning) == 3 and ((tuning.beta_plus == 0) & (tuning.beta_minus == 0)).any()  # (0, 0) added
    assert tuning.in_grid.tolist() == [False, True, True]
    chosen = tuning[tuning.chosen].iloc[0]
    assert (steer.beta_plus, steer.beta_minus) == (chosen.beta_plus, chosen.beta_minus)
    assert chosen.acc_clean >= tuning.acc_clean.iloc[0] - 0.05 or (chosen.beta_plus, chosen.beta_minus) == (0, 0)
    assert steer.tuning is tuning


def test_median_aggregation(tiny_gemma, known_tiny):
    scored = cp.identify_heads(
        tiny_gemma, known_tiny[:3], "parametric", pos_grid=(1.0, 3.0), neg_grid=(-1.0,), k=2, progress=False
    )
    subjects = scored.subjects
    assert aggregate_heads(scored, subjects, 2, "mean").enhance == scored.with_k(2).enhance
    median = aggregate_heads(scored, subjects, 2, "median")
    per_fact = scored.per_example.groupby(["layer", "head", "sign", "conflict_type", "subject"])["delta"].mean()
    expected = per_fact.groupby(level=[0, 1, 2, 3]).median()
    got = median.scores.set_index(["layer", "head", "sign", "conflict_type"]).score
    pd.testing.assert_series_equal(got.sort_index(), expected.sort_index(), check_names=False, check_dtype=False)
    with pytest.raises(ValueError, match="how must be"):
        aggregate_heads(scored, subjects, 2, "mode")


def test_bad_input(tiny_gemma, known_tiny):
    with pytest.raises(ValueError, match="draws must be a positive integer"):
        selection_variance(tiny_gemma, known_tiny, draws=0, **FAST)
    with pytest.raises(ValueError, match="has 8 facts, too few .* 11 are needed"):
        selection_variance(tiny_gemma, known_tiny, n_select=6, n_validation=4, **FAST)
    with pytest.raises(ValueError, match="has 3 development facts, too few .* 5 are needed"):
        selection_variance(tiny_gemma, known_tiny[:3], test=known_tiny[3:], n_select=3, n_validation=2, **FAST)
    with pytest.raises(ValueError, match="also development facts"):
        selection_variance(tiny_gemma, known_tiny, test=known_tiny[:2], n_select=2, n_validation=2, **FAST)
    with pytest.raises(ValueError, match="Unknown recipes"):
        selection_variance(tiny_gemma, known_tiny, recipes=("fast",), n_select=2, n_validation=2, **FAST)
    with pytest.raises(ValueError, match="objective must be one of"):
        choose_betas(_table([(0.0, 0.0, 1.0, 0.0, 0.0, 1.0)]), "best")
    with pytest.raises(ValueError, match="no unsteered pair"):
        choose_betas(_table([(1.0, 0.0, 1.0, 0.0, 0.0, 1.0)]), "robust")
    with pytest.raises(ValueError, match="no heads to tune"):
        tune_betas(cp.JuICE(tiny_gemma), known_tiny[:2])


def test_plot(tiny_gemma, known_tiny):
    result = selection_variance(tiny_gemma, known_tiny, draws=2, n_select=2, n_validation=2, n_pool=4, **FAST)
    fig = plot_selection_variance(result)
    assert len(fig.data) == 2 * 3 * 3  # (points, interval) x methods x conflict types
    assert set(fig.data[0].x) == {"paper", "robust-conflict"}
    legend = [t for t in fig.data if t.showlegend]  # one entry per method, on a trace that draws a line
    assert [t.name for t in legend] == ["Original", "JuNe", "JuICE"] and all(t.line.width > 0 for t in legend)
    first = plot_selection_variance(result, metric="first_token")
    assert len(first.data) == len(fig.data)
    points = result.per_draw[(result.per_draw.method == "Original") & (result.per_draw.conflict_type == "clean")]
    assert list(first.data[0].y) == list(points.first_token_accuracy)
    with pytest.raises(ValueError, match="Unknown metric 'top1'"):
        plot_selection_variance(result, metric="top1")


@pytest.mark.slow
def test_embedded_draws_are_reproducible(gemma):
    """Two draws on the embedded model: same seed, same frames; the pair (0, 0) chosen with
    the all-zero grid reproduces Original."""
    facts = cp.conflict_dataset("world_capital", n=12, tokenizer=gemma).with_prompts(["clean", "substitution"])
    known = cp.filter_known(gemma, facts, progress=False)  # no coherent passages: they are the slow prompts
    options = {"draws": 2, "n_select": 1, "n_validation": 1, "recipes": "robust", "pos_grid": (3.0,)}
    options |= {"neg_grid": (-1.0,), "beta_pos_grid": (0.0,), "beta_neg_grid": (0.0,), "progress": False}
    first = selection_variance(gemma, known[:2], test=known[2:4], **options)
    again = selection_variance(gemma, known[:2], test=known[2:4], scored=first.scored, **options)
    pd.testing.assert_frame_equal(first.per_draw, again.per_draw)
    table = first.per_draw.pivot_table(index=["draw", "conflict_type"], columns="method", values="accuracy")
    np.testing.assert_array_equal(table.JuICE, table.Original)
    assert table.Original.loc[:, "clean"].eq(1.0).all()


@pytest.mark.parametrize("dual_run", [True, False])
def test_batched_beta_tuning_equals_one_accuracy_per_pair(tiny_gemma, known_tiny, dual_run):
    """Every strength pair decodes in the same batches with its own per-row strengths; the table
    must equal setting each pair in turn and scoring it alone (JuICE and JuNe)."""
    heads = cp.identify_heads(
        tiny_gemma, known_tiny[:2], "parametric", pos_grid=(1.0,), neg_grid=(-1.0,), k=2, progress=False
    )
    steer = cp.JuICE(
        tiny_gemma,
        dual_run=dual_run,
        enhance=heads.enhance,
        suppress=heads.suppress,
        beta_pos_grid=(1.0, 4.0),
        beta_neg_grid=(-1.0, -3.0),
    )
    table = variance.beta_tuning(steer, known_tiny[2:6])
    assert len(table) == 5  # (0, 0) added in front of the 2 x 2 grid
    probabilities = []
    for row in table.itertuples():
        steer.beta_plus, steer.beta_minus = row.beta_plus, row.beta_minus
        alone = steer.accuracy(known_tiny[2:6], full_continuations=True)  # the table's rows stop early
        acc = alone.groupby("conflict_type")["correct"].mean()
        for conflict_type, value in acc.items():
            assert getattr(row, f"acc_{conflict_type}") == value, (row.beta_plus, row.beta_minus, conflict_type)
        probabilities.append(alone.p_target.sum())
    np.testing.assert_allclose(table.probability, probabilities, rtol=1e-4, atol=1e-6)
    # The strengths matter on this model (a table of identical rows would not test the per-row steering).
    assert table.probability.nunique() > 1


def test_tuning_over_head_counts_equals_steering_the_top_k_heads(tiny_gemma, known_tiny):
    """beta_tuning(ks=...) steers only the first k heads of each set in its k rows: each k's
    block equals the table of a steering built from those heads alone; the robust choice breaks
    ties toward fewer heads."""
    # Fixed sets of three heads each (stage 1 on random tiny models may keep fewer).
    enhance, suppress = [(2, 1), (1, 2), (0, 3)], [(2, 0), (1, 3), (0, 1)]
    grids = {"beta_pos_grid": (0.0, 3.0), "beta_neg_grid": (0.0, -2.0)}
    steer = cp.JuICE(tiny_gemma, enhance=enhance, suppress=suppress, **grids)
    table = variance.beta_tuning(steer, known_tiny[2:6], ks=(1, 3))
    assert table.k.tolist() == [1] * 4 + [3] * 4
    for k in (1, 3):
        alone = cp.JuICE(tiny_gemma, enhance=enhance[:k], suppress=suppress[:k], **grids)
        expected = variance.beta_tuning(alone, known_tiny[2:6])
        got = table[table.k == k].drop(columns="k").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, expected, atol=1e-4, rtol=1e-4)
    assert not table[table.k == 1].probability.equals(table[table.k == 3].probability.reset_index(drop=True))
    tied = pd.DataFrame(
        {"k": [1, 3, 1, 3], "beta_plus": [0.0, 0.0, 3.0, 3.0], "beta_minus": [0.0, 0.0, 0.0, 0.0]}
        | {"accuracy": [1.0, 1.0, 2.0, 2.0], "probability": [0.1, 0.1, 0.2, 0.9]}
        | {"acc_clean": [1.0, 1.0, 1.0, 1.0], "acc_substitution": [0.0, 0.0, 1.0, 1.0]}
    )
    assert int(choose_betas(tied, "robust").k) == 1  # same accuracy and strength: fewer heads
    with pytest.raises(ValueError, match="ks must hold head counts between 1 and 3"):
        variance.beta_tuning(steer, known_tiny[2:6], ks=(4,))
