"""The helpers of scripts/lesser_known_splits.py: the FT-Random / FT-Whole / controlled training
sets, the step-0 copies of the base model, the popularity subsets, the per-step summaries and the
attention-map figure, against hand computations on small inputs and a tiny model."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cpsuper as cp


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("plotly")
    path = Path(__file__).parents[1] / "scripts" / "lesser_known_splits.py"
    spec = importlib.util.spec_from_file_location("lesser_known_splits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("lesser_known_facts", None)


def test_pool_and_random_split_leave_out_the_held_out_facts(script):
    p = pd.Series(np.linspace(1.0, 0.0, 60), index=np.random.default_rng(1).permutation(60))
    facts = script.lkf.split(p, 8, 10, 6)
    pool = script.pool(p, facts)
    assert len(pool) == 60 - 16 and set(pool).isdisjoint(facts["test"] + facts["val"])
    assert set(facts["top"]) | set(facts["bottom"]) <= set(pool)  # FT-Whole holds both halves
    drawn = {seed: script.random_split(pool, 8, seed) for seed in (0, 1)}
    for ids in drawn.values():
        assert len(set(ids)) == 8 and set(ids) <= set(pool)
    assert drawn[0] != drawn[1] and drawn[0] == script.random_split(pool, 8, 0)


def test_controlled_split_matches_relations_and_answers(script):
    rows = [  # relation a: answer x four times, y twice, z once; relation b: every answer once
        (0, "a", "x", 0.9),
        (1, "a", "x", 0.1),
        (2, "a", "x", 0.5),
        (3, "a", "x", 0.3),
        (4, "a", "y", 0.8),
        (5, "a", "y", 0.2),
        (6, "a", "z", 0.7),
        (7, "b", "u", 0.9),
        (8, "b", "v", 0.1),
    ]
    facts = pd.DataFrame(rows, columns=["fact", "relation", "answer", "p_true"])
    split = script.controlled_split(facts, n_per_relation=3)
    # x: upper two (0.9, 0.5) and lower two (0.3, 0.1); y: one each; z and relation b: none
    assert split == {"ctrl_top": [0, 2, 4], "ctrl_bottom": [1, 3, 5]}
    assert script.controlled_split(facts, n_per_relation=1) == {"ctrl_top": [0], "ctrl_bottom": [1]}
    assert script.controlled_split(facts, n_per_relation=9) == split  # all there is
    answers = facts.set_index("fact").answer
    assert sorted(answers[split["ctrl_top"]]) == sorted(answers[split["ctrl_bottom"]])

    roles = pd.concat(
        [
            facts.assign(role="ctrl_top")[facts.fact.isin(split["ctrl_top"])],
            facts.assign(role="ctrl_bottom")[facts.fact.isin(split["ctrl_bottom"])],
            pd.DataFrame({"fact": [20, 21, 22], "answer": ["x", "w", "y"], "role": "test"}),
        ]
    )
    assert script.controlled_test(roles) == [21]  # answers x and y were trained on


def test_with_base_steps_and_popular_subsets(script):
    frame = pd.DataFrame(
        {
            "fact": [1, 2, 1, 2, 1, 2],
            "condition": ["base", "base", "top", "top", "bottom", "bottom"],
            "step": [0, 0, 10, 10, 10, 10],
            "accuracy": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0],
        }
    )
    both = script.with_base_steps(frame, ("top", "bottom"))
    assert len(both) == 8 and "base" not in set(both.condition)
    at0 = both[both.step == 0].sort_values(["condition", "fact"])
    assert at0.condition.tolist() == ["bottom", "bottom", "top", "top"]
    assert at0.accuracy.tolist() == [1.0, 0.0, 1.0, 0.0]
    popularity = pd.Series({1: 0.2, 2: 0.9, 3: 0.5, 4: 0.1})
    stacked = script.popular_subsets(frame.assign(fact=frame.fact + 1), popularity, (25, 50, 100))
    assert sorted(stacked[stacked.percentile == 25].fact.unique()) == [2]
    assert sorted(stacked[stacked.percentile == 50].fact.unique()) == [2, 3]
    assert sorted(stacked[stacked.percentile == 100].fact.unique()) == [2, 3]  # fact 4 has no rows


def test_step_summaries_pair_top_and_bottom_per_step(script):
    rng = np.random.default_rng(0)
    rows = []
    for fact in range(12):
        for seed in (0, 1):
            for step in (10, 20):
                for condition in ("top", "bottom"):
                    rows.append((fact, seed, step, condition, float(rng.integers(0, 2))))
    frame = pd.DataFrame(rows, columns=["fact", "seed", "step", "condition", "accuracy"])
    base = pd.DataFrame({"fact": range(12), "seed": -1, "step": 0, "condition": "base", "accuracy": 1.0})
    summary, paired = script.step_summaries(
        script.with_base_steps(pd.concat([frame, base]), ("top", "bottom")), "accuracy", []
    )
    for step in (10, 20):
        part = frame[frame.step == step]
        means = part.groupby("condition").accuracy.mean()
        got = summary.set_index(["condition", "step"])["mean"]
        assert got["top", step] == pytest.approx(means["top"]) and got["bottom", step] == pytest.approx(means["bottom"])
        diff = paired.set_index("step").loc[step]
        assert diff["diff"] == pytest.approx(means["top"] - means["bottom"])
        assert diff.ci_low <= diff["diff"] <= diff.ci_high
    at0 = paired.set_index("step").loc[0]
    assert at0["diff"] == 0.0 and at0.ci_low == 0.0 and at0.ci_high == 0.0 and at0.n == 12


def test_map_figure_holds_each_models_attention_without_bos(script, tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)
    frames = []
    for fact, example in enumerate(data):
        frame = script.lkf.attention_map(tiny_gemma, example.prompts["clean"])
        for condition in ("base", "top", "bottom"):
            frames.append(frame.assign(fact=fact, relation="world_capital", condition=condition))
    maps = pd.concat(frames, ignore_index=True)
    fig = script.map_figure(maps, "world_capital", {0: data[0].subject})
    assert len(fig.data) == 2 * 3
    for trace, fact in zip(fig.data, [0, 0, 0, 1, 1, 1], strict=True):
        part = maps[(maps.fact == fact) & (maps.condition == "base") & (maps.position > 0)]
        expected = part.pivot_table(index="layer", columns="position", values="attention").to_numpy()
        np.testing.assert_allclose(np.asarray(trace.z, dtype=float), expected, atol=1e-12)
        assert len(trace.x) == part.position.nunique()
    assert data[0].subject in fig.layout.yaxis.title.text
