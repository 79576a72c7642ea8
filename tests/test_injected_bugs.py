"""The property tests can fail: each one is run on a fixed example with the bug it targets
injected, and must then raise. Without the bug the same example passes."""

from __future__ import annotations

import pytest
import test_properties as props

from cpsuper import engine, interventions
from cpsuper.juice import JuICE

PROMPT = props.PROMPTS[2]


def _flip_suppression(monkeypatch):
    original = JuICE.coefficients
    monkeypatch.setattr(
        JuICE, "coefficients", lambda self, *a, **k: {h: abs(c) for h, c in original(self, *a, **k).items()}
    )


def _ignore_recorded_outputs(monkeypatch):
    original = engine._RowEdits.hooks
    monkeypatch.setattr(
        engine._RowEdits, "hooks", lambda self, clean_z: original(self, {l: 0 * z for l, z in (clean_z or {}).items()})
    )


def _ignore_head_scale(monkeypatch):
    monkeypatch.setattr(interventions, "_per_row", lambda value, z: 1.0)


def _layer_knockout_skips_the_mlp(monkeypatch):
    original = interventions.module_hook_names
    monkeypatch.setattr(
        interventions,
        "module_hook_names",
        lambda layer, module: original(layer, "attn" if module == "layer" else module),
    )


CASES = {
    "dual run with random strengths": (
        props.test_dual_run_with_random_strengths_equals_a_two_pass_hook_run,
        {
            "name": "gemma",
            "enhance": [(1, 0)],
            "suppress": [(2, 1)],
            "beta_plus": 1.5,
            "beta_minus": -1.0,
            "prompt": PROMPT,
        },
        _flip_suppression,
    ),
    "engine head edits with add": (
        props.test_engine_head_edits_with_add_equal_a_two_pass_hook_run,
        {"name": "gemma", "edits": [((1, 2), 0.5, 1.0), ((2, 0), 1.0, -0.5)], "batch_size": 2},
        _ignore_recorded_outputs,
    ),
    "ScaleHead against W_O": (
        props.test_scale_head_equals_scaling_its_rows_of_W_O,
        {"name": "gpt2", "head": (1, 1), "scale": 2.5, "prompt": PROMPT},
        _ignore_head_scale,
    ),
    "layer knockout": (
        props.test_layer_knockout_equals_carrying_the_residual_stream_past_the_block,
        {"name": "gemma", "layer": 1, "mean": True, "prompt": PROMPT},
        _layer_knockout_skips_the_mlp,
    ),
}


@pytest.fixture
def models(tiny_gemma, tiny_gpt2):
    return {"gemma": tiny_gemma, "gpt2": tiny_gpt2}


def _run(test, example, models, two_pass):
    inner = test.hypothesis.inner_test
    fixtures = {"models": models}
    if "two_pass" in inner.__code__.co_varnames[: inner.__code__.co_argcount]:
        fixtures["two_pass"] = two_pass
    inner(**fixtures, **example)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_property_test_fails_with_its_bug_injected(case, models, two_pass, monkeypatch):
    test, example, inject = CASES[case]
    _run(test, example, models, two_pass)  # the example passes on the real code
    inject(monkeypatch)
    with pytest.raises(AssertionError):
        _run(test, example, models, two_pass)
