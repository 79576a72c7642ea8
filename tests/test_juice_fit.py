"""JuICE.fit's contract: it says when it does not steer, it never leaves a half-fitted object, and
its clean-margin rule is stated in facts. Also the paper's evaluation protocol."""

import math
import warnings
from dataclasses import replace

import pandas as pd
import pytest

import cpsuper as cp
from cpsuper import juice as juice_module
from cpsuper import tuning as tuning_module
from cpsuper.juice import SteeringWarning
from cpsuper.tuning import DEFAULT_CLEAN_MARGIN, choose_betas, min_validation, unsteered_reason


def _known(model, n):
    """``n`` capitals whose "memorised" answer is the tiny model's own first word (so it knows them)."""
    data = cp.conflict_dataset("world_capital", n=n, tokenizer=model)
    texts = cp.scoring.greedy_continuations(model, data.prompts("clean"), max_new_tokens=8, progress=False)
    return cp.ConflictDataset([replace(e, aliases=(t.split()[0],)) for e, t in zip(data, texts)], "known")


def _table(rows, n):
    """A tuning table: (beta_plus, beta_minus, acc_clean, acc_substitution) per pair, n facts."""
    frame = pd.DataFrame(rows, columns=["beta_plus", "beta_minus", "acc_clean", "acc_substitution"])
    return frame.assign(accuracy=frame.acc_clean + frame.acc_substitution, probability=0.0, in_grid=True, n=n)


# -- the clean margin, in facts ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "margin", "accepts_one_loss"),
    [(10, 0.1, True), (10, 0.09, False), (9, 0.1, False), (20, 0.05, True), (19, 0.05, False), (7, 0.0, False)],
)
def test_the_margin_accepts_a_one_fact_loss_exactly_from_ceil_one_over_margin_facts(n, margin, accepts_one_loss):
    lose_one = (n - 1) / n
    table = _table([(0.0, 0.0, 1.0, 0.0), (1.0, 0.0, lose_one, 1.0), (2.0, 0.0, (n - 2) / n, 1.0)], n)
    best = choose_betas(table, "robust", clean_margin=margin)
    assert bool(best.beta_plus == 1.0) is accepts_one_loss
    assert accepts_one_loss is (n >= min_validation(margin) and margin > 0)
    assert best.beta_plus != 2.0  # a two-fact loss needs twice the facts
    if not accepts_one_loss:
        assert unsteered_reason(table, "robust", margin).startswith(
            f"every steered pair cost at least 1 of {n} clean validation facts; clean_margin={margin:g} allows 0"
        )


def test_min_validation_and_bad_margins():
    assert [min_validation(m) for m in (0.0, 0.05, 0.1, 0.25, 1 / 3, 1.0)] == [1, 20, 10, 4, 3, 1]
    for bad in (-0.1, 1.5, math.nan, "0.1", True):
        with pytest.raises(ValueError, match="clean_margin is the share of clean validation facts"):
            min_validation(bad)


def test_fit_refuses_a_validation_set_too_small_for_its_margin(tiny_gemma):
    data = _known(tiny_gemma, 8)
    with pytest.raises(ValueError, match="from 10 validation facts on, and this validation set has 5"):
        cp.JuICE(tiny_gemma, k=2).fit(data[:3], data[3:], progress=False)
    with pytest.raises(ValueError, match="clean_margin is the share"):
        cp.JuICE(tiny_gemma, k=2).fit(data[:3], data[3:], progress=False, clean_margin=1.2)


# -- no silent no-op -----------------------------------------------------------------------------


def test_a_fit_whose_every_pair_breaks_clean_recall_warns_and_does_not_steer(tiny_gemma, monkeypatch):
    data = _known(tiny_gemma, 6)
    heads = cp.identify_heads(tiny_gemma, data[:2], pos_grid=(1.0,), neg_grid=(-1.0,), k=3, progress=False)
    steer = cp.JuICE(tiny_gemma, k=3, beta_pos_grid=(0.0, 40.0), beta_neg_grid=(0.0, -40.0))
    with pytest.warns(SteeringWarning, match="ended without steering: every steered pair cost at least"):
        steer.fit(data[:2], data[2:], progress=False, clean_margin=0.0, heads=heads, recipe="robust")
    lost = steer.tuning[(steer.tuning.beta_plus != 0) | (steer.tuning.beta_minus != 0)]
    assert (lost.acc_clean < 1.0).all()  # the construction: every steered pair loses clean facts
    assert not steer.steers
    assert "NOT STEERING" in repr(steer)
    assert steer.to_dict()["steers"] is False
    assert steer.fitted_on["not_steering"].startswith("every steered pair cost at least")
    # A tuning table in which one pair wins within the margin: the fit steers, and says nothing.
    winning = _table([(0.0, 0.0, 1.0, 0.0), (40.0, 0.0, 1.0, 1.0)], 4)
    monkeypatch.setattr(tuning_module, "beta_tuning", lambda *args, **kwargs: winning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SteeringWarning)
        steer.fit(data[:2], data[2:], progress=False, clean_margin=0.0, heads=heads)
    assert steer.steers and "NOT STEERING" not in repr(steer) and "not_steering" not in steer.fitted_on


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_a_fit_that_fails_midway_leaves_the_object_as_it_was(tiny_gemma, monkeypatch, failure):
    data = _known(tiny_gemma, 5)
    steer = cp.JuICE(tiny_gemma, k=2, enhance=[(0, 1)], suppress=[(1, 0)], beta_plus=1.0, beta_minus=-0.5)
    steer.pos_grid, steer.neg_grid = (1.0,), (-1.0,)
    before = steer.to_dict(), steer.tuning, steer.identified

    def fail(*args, **kwargs):
        raise failure("stopped during strength tuning")

    monkeypatch.setattr(tuning_module, "beta_tuning", fail)
    with pytest.raises(failure):
        steer.fit(data[:2], data[2:], progress=False, clean_margin=0.0)
    assert (steer.to_dict(), steer.tuning, steer.identified) == before


def test_steers_round_trips_and_a_tampered_flag_is_refused(tiny_gemma, tmp_path):
    steer = cp.JuICE(tiny_gemma, enhance=[(0, 1)], beta_plus=2.0)
    assert steer.steers
    assert not replace(steer, beta_plus=0.0).steers and not replace(steer, enhance=[]).steers
    assert replace(steer, suppress=[(1, 1)], beta_minus=-1.0, beta_plus=0.0).steers
    steer.save(tmp_path / "s.json")
    assert cp.JuICE.load(tmp_path / "s.json", tiny_gemma).steers
    data = steer.to_dict() | {"steers": False}
    with pytest.raises(ValueError, match="says steers=False, but its heads and strengths do steer"):
        cp.JuICE.from_dict(data, tiny_gemma)
    with pytest.raises(ValueError, match="dual_run must be True"):
        cp.JuICE.from_dict(steer.to_dict() | {"dual_run": "false"}, tiny_gemma)
    with pytest.raises(ValueError, match="lists a head more than once"):
        cp.JuICE(tiny_gemma, enhance=[(0, 1), (0, 1)])


def test_split_defaults_leave_room_for_the_margin():
    data = cp.conflict_dataset("world_capital", n=40)
    parts = cp.split(data)
    assert (len(parts.select), len(parts.validation)) == (8, 10)
    assert len(parts.validation) >= min_validation(DEFAULT_CLEAN_MARGIN)
    assert len(cp.split(data, n_validation=4).validation) == 4
    with pytest.raises(ValueError, match="too few for 8 selection, 10 validation"):
        cp.split(data[:18])
    with pytest.raises(ValueError, match="n_validation must be a positive integer"):
        cp.split(data, n_validation=0)


# -- the paper's evaluation protocol ---------------------------------------------------------------


class _Scripted:
    """A method whose continuations are given, recording how many tokens it was asked for."""

    direction = "parametric"

    def __init__(self, texts):
        self.texts, self.asked = texts, []

    def generate_many(self, requests, max_new_tokens, stop_when=None):
        self.asked.append(max_new_tokens)
        return [[self.texts[c]] * len(d) for d, c in requests]


def test_paper_protocol_reads_substrings_in_ten_tokens_and_fifteen_for_juice(tiny_gemma, monkeypatch):
    fact = cp.ConflictExample(
        "world_capital", "France", "Paris", "Lima", {"clean": "c", "substitution": "s", "coherent": "k"}
    )
    data = cp.ConflictDataset([fact], "one fact")
    texts = {"clean": " Parisian food is good", "substitution": " Paris.", "coherent": " a b c d e Paris"}
    method = _Scripted(texts)
    paper = cp.evaluate({"m": method}, data, protocol="paper").set_index("conflict_type").correct
    ours = cp.evaluate({"m": method}, data).set_index("conflict_type").correct
    # By hand: "parisian" holds "paris" as a substring, not as a word; "Paris" is the sixth word.
    assert paper.to_dict() == {"clean": 1.0, "substitution": 1.0, "coherent": 0.0}
    assert ours.to_dict() == {"clean": 0.0, "substitution": 1.0, "coherent": 0.0}
    assert method.asked == [10, 8]
    steer = cp.JuICE(tiny_gemma, enhance=[(0, 1)], beta_plus=1.0)
    asked = []
    monkeypatch.setattr(
        cp.JuICE,
        "generate_many",
        lambda self, requests, max_new_tokens, stop_when=None: (
            asked.append(max_new_tokens) or [[texts[c]] * len(d) for d, c in requests]
        ),
    )
    cp.evaluate({"JuICE": steer}, data, protocol="paper")
    assert asked == [15]
    with pytest.raises(ValueError, match="protocol must be one of"):
        cp.evaluate({"m": method}, data, protocol="acl")


def test_mentions_answer_reads_one_string_as_one_answer():
    assert not cp.reading.mentions_answer("P is", "Paris")
    assert cp.reading.mentions_answer("Paris is", "Paris")
    with pytest.raises(ValueError, match="n_words must be a positive integer"):
        cp.reading.mentions_answer("Paris", ["Paris"], 0)


def test_robust_mild_scores_heads_at_the_dual_runs_own_strengths(tiny_gemma):
    data = _known(tiny_gemma, 5)
    grids = dict(beta_pos_grid=(0.0, 0.5, 2.0), beta_neg_grid=(0.0, -1.0))
    steer = cp.JuICE(tiny_gemma, k=2, **grids).fit(
        data[:2], data[2:], progress=False, recipe="robust-mild", clean_margin=0
    )
    expected = cp.identify_heads(tiny_gemma, data[:2], pos_grid=(0.5, 2.0), neg_grid=(-1.0,), k=2, progress=False)
    assert (steer.enhance, steer.suppress) == (expected.enhance, expected.suppress)
    assert steer.fitted_on["stage1_grids"] == [[0.5, 2.0], [-1.0]]
    assert steer.pos_grid == juice_module.POS_GRID  # the object's own stage-1 grids are left as they were
