"""The helpers of scripts/lesser_known_facts.py: the fact split, the popularity-percentile subsets
and the per-example attention maps (against a hand computation on a tiny model)."""

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("plotly")
    path = Path(__file__).parents[1] / "scripts" / "lesser_known_facts.py"
    spec = importlib.util.spec_from_file_location("lesser_known_facts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_keeps_the_extremes_for_training_and_draws_disjoint_test_and_validation(script):
    p = pd.Series(np.linspace(1.0, 0.0, 50), index=np.random.default_rng(0).permutation(50))
    best = p.sort_values(ascending=False).index
    for n_test, n_val in ((24, 16), (12, 8), (5, 30), (17, 3), (30, 2)):
        facts = script.split(p, n_train=5, n_test=n_test, n_val=n_val)
        assert facts["top"] == list(best[:5]) and facts["bottom"] == list(best[-5:])
        assert len(facts["test"]) == n_test and len(facts["val"]) == n_val
        used = [i for ids in facts.values() for i in ids]
        assert len(set(used)) == len(used)  # no fact in two roles
        assert set(facts["test"]) | set(facts["val"]) <= set(best[5:-5])  # drawn from the middle only
        assert facts == script.split(p, n_train=5, n_test=n_test, n_val=n_val)  # seeded


def test_percentile_subsets_keep_the_most_popular_test_facts(script):
    popularity = {10 + i: (30 - i) / 30 for i in range(30)}  # fact 10 most popular
    base = pd.DataFrame({"fact": list(popularity), "p_true": list(popularity.values())}).assign(condition="base")
    tuned = base.assign(condition="top", p_true=0.5)  # a finetuned model's p is not the popularity
    stacked = script.percentile_subsets(pd.concat([base, tuned]))
    for pct in script.PERCENTILES:
        part = stacked[(stacked.percentile == pct) & (stacked.condition == "top")]
        k = int(np.ceil(pct / 100 * 30))  # 25 % of 30 facts: 8
        assert sorted(part.fact) == list(range(10, 10 + k))


def test_attention_map_is_the_head_mean_of_the_last_row(script, tiny_gemma):
    prompt = cp.conflict_dataset("world_capital", n=1, tokenizer=tiny_gemma)[0].prompts["clean"]
    frame = script.attention_map(tiny_gemma, prompt)
    with torch.inference_mode():
        _, cache = tiny_gemma.run_with_cache(prompt)
    n = cache["blocks.0.attn.hook_pattern"].shape[-1]
    assert len(frame) == tiny_gemma.cfg.n_layers * n
    for layer in range(tiny_gemma.cfg.n_layers):
        expected = cache[f"blocks.{layer}.attn.hook_pattern"][0, :, -1].mean(0).numpy()
        got = frame[frame.layer == layer].sort_values("position").attention.to_numpy()
        np.testing.assert_allclose(got, expected, atol=1e-6)
        assert got.sum() == pytest.approx(1.0, abs=1e-5)
