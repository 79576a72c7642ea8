"""Bad arguments stop with a message naming the argument, the value and the fix (issue 20's rows),
and every entry point that takes prompts takes one string or a sequence of strings."""

from __future__ import annotations

import json
import math

import pytest
import torch

import cpsuper as cp


@pytest.fixture(scope="module")
def capitals(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)


PROMPT = "The name of the capital city of France is"

# --- batch sizes, scales and grids -------------------------------------------------------------


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True, "8"])
def test_head_sweep_rejects_bad_batch_sizes(tiny_gemma, capitals, batch_size):
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got .*batch_size=32"):
        cp.head_sweep(tiny_gemma, capitals, (0.0,), layers=[0], batch_size=batch_size, progress=False)


def test_knockout_sweep_rejects_a_negative_batch_size(tiny_gemma, capitals):
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got -5"):
        cp.knockout_sweep(tiny_gemma, capitals, batch_size=-5, progress=False)


@pytest.mark.parametrize("alphas", [(0.0, math.nan), (math.inf,), ()])
def test_head_sweep_rejects_non_finite_or_empty_alphas(tiny_gemma, capitals, alphas):
    with pytest.raises(ValueError, match=r"alphas"):
        cp.head_sweep(tiny_gemma, capitals, alphas, layers=[0], progress=False)


@pytest.mark.parametrize(
    "entry",
    [
        lambda m, d, b: cp.score_dataset(m, d, batch_size=b, progress=False),
        lambda m, d, b: cp.scoring.final_logits(m, PROMPT, batch_size=b, progress=False),
        lambda m, d, b: cp.scoring.greedy_continuations(m, PROMPT, max_new_tokens=2, batch_size=b, progress=False),
        lambda m, d, b: cp.identify_heads(m, d, k=1, batch_size=b, progress=False),
        lambda m, d, b: cp.truncation_sweep(m, d, layers=[0], rhos=(0.5,), batch_size=b, progress=False),
        lambda m, d, b: cp.attention_to_span(m, d, "subject", batch_size=b, progress=False),
        lambda m, d, b: cp.direct_logit_attribution(m, d, batch_size=b, progress=False),
        lambda m, d, b: cp.JuICE(m, enhance=[(1, 1)], beta_plus=1.0).generate(PROMPT, batch_size=b),
    ],
    ids=[
        "score_dataset",
        "final_logits",
        "greedy",
        "identify_heads",
        "truncation",
        "attention",
        "dla",
        "juice_generate",
    ],
)
@pytest.mark.parametrize("batch_size", [0, -1, 2.5])
def test_every_entry_point_rejects_bad_batch_sizes(tiny_gemma, capitals, entry, batch_size):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        entry(tiny_gemma, capitals, batch_size)


def test_truncation_sweep_rejects_bad_rhos(tiny_gemma, capitals):
    for rhos in [(), (math.nan,), (1.5,), (-0.1,)]:
        with pytest.raises(ValueError, match="rho"):
            cp.truncation_sweep(tiny_gemma, capitals, layers=[0], rhos=rhos, progress=False)


def test_identify_heads_rejects_wrong_sign_grids(tiny_gemma, capitals):
    with pytest.raises(ValueError, match="pos_grid"):
        cp.identify_heads(tiny_gemma, capitals, pos_grid=(-1.0,), progress=False)
    with pytest.raises(ValueError, match="neg_grid"):
        cp.identify_heads(tiny_gemma, capitals, neg_grid=(), progress=False)


def test_unknown_conflict_types_and_targets_are_named(tiny_gemma, capitals):
    with pytest.raises(ValueError, match=r"Conflict types \['contradiction'\]"):
        cp.knockout_sweep(tiny_gemma, capitals, conflict_types=["contradiction"], progress=False)
    with pytest.raises(ValueError, match=r"Unknown targets \['prior'\]"):
        cp.head_sweep(tiny_gemma, capitals, (0.0,), targets=["prior"], progress=False)
    with pytest.raises(ValueError, match="Unknown target 'prior'"):
        cp.identify_heads(tiny_gemma, capitals, target="prior", progress=False)


# --- JuICE ---------------------------------------------------------------------------------------


def test_juice_rejects_nan_and_wrong_sign_strengths(tiny_gemma):
    with pytest.raises(ValueError, match="beta_plus must be finite, got nan"):
        cp.JuICE(tiny_gemma, enhance=[(1, 1)], beta_plus=math.nan)
    with pytest.raises(ValueError, match="beta_minus must be non-positive, got 2.0"):
        cp.JuICE(tiny_gemma, suppress=[(1, 1)], beta_minus=2.0)


def test_juice_rejects_an_empty_beta_grid(tiny_gemma, capitals):
    with pytest.raises(ValueError, match="beta_pos_grid is empty"):
        cp.JuICE(tiny_gemma, beta_pos_grid=())
    steer = cp.JuICE(tiny_gemma, k=1)
    steer.beta_pos_grid = ()  # emptied after construction: fit checks again, before any work
    with pytest.raises(ValueError, match="beta_pos_grid is empty"):
        steer.fit(capitals[:1], capitals[1:], progress=False)


def _saved(tiny_gemma, tmp_path, **changes):
    steer = cp.JuICE(tiny_gemma, enhance=[(1, 1)], suppress=[(2, 0)], beta_plus=2.0, beta_minus=-1.0)
    data = steer.to_dict()
    data.update(changes)
    path = tmp_path / "juice.json"
    path.write_text(json.dumps(data))
    return path, data


def test_juice_load_names_what_is_wrong(tiny_gemma, tmp_path):
    path, data = _saved(tiny_gemma, tmp_path)
    assert cp.JuICE.load(path, tiny_gemma).enhance == [(1, 1)]
    text = path.read_text()
    cases = {
        "": "invalid JSON",
        text[: len(text) // 2]: "invalid JSON",
        json.dumps({k: v for k, v in data.items() if k != "model"}): r"missing keys \['model'\]",
        json.dumps({**data, "colour": "red"}): r"unknown keys \['colour'\]",
        json.dumps({**data, "enhance": [[1, 1, 0]]}): r"\(layer, head\) pair",
        json.dumps({**data, "beta_plus": "2.0"}): "beta_plus must be a number",
        text.replace('"beta_plus": 2.0', '"beta_plus": NaN'): "beta_plus must be finite",
    }
    for content, message in cases.items():
        path.write_text(content)
        with pytest.raises(ValueError, match=message):
            cp.JuICE.load(path, tiny_gemma)


# --- prompts: one string or a sequence of strings ---------------------------------------------


def test_one_prompt_string_gives_one_result(tiny_gemma):
    steer = cp.JuICE(tiny_gemma, enhance=[(1, 1)], beta_plus=1.0)
    many = steer.generate([PROMPT], max_new_tokens=3)
    one = steer.generate(PROMPT, max_new_tokens=3)
    assert isinstance(one, str) and [one] == many
    one = cp.scoring.greedy_continuations(tiny_gemma, PROMPT, max_new_tokens=3, progress=False)
    assert isinstance(one, str) and [one] == cp.scoring.greedy_continuations(
        tiny_gemma, [PROMPT], max_new_tokens=3, progress=False
    )
    assert cp.scoring.final_logits(tiny_gemma, PROMPT, progress=False).shape == (1, tiny_gemma.cfg.d_vocab_out)
    torch.testing.assert_close(steer.logits(PROMPT), steer.logits([PROMPT]))
    result = cp.truncation_sweep(tiny_gemma, PROMPT, layers=[1], rhos=(0.5,), candidates=[" Paris"], progress=False)
    assert set(result.per_example["example"]) == {0}


@pytest.mark.parametrize(
    "entry",
    [
        lambda m, p: cp.scoring.final_logits(m, p, progress=False),
        lambda m, p: cp.scoring.greedy_continuations(m, p, max_new_tokens=2, progress=False),
        lambda m, p: cp.JuICE(m, enhance=[(1, 1)], beta_plus=1.0).logits(p),
        lambda m, p: cp.JuICE(m, enhance=[(1, 1)], beta_plus=1.0).generate(p, max_new_tokens=2),
        lambda m, p: cp.truncation_sweep(m, p, layers=[1], rhos=(0.5,), candidates=[" Paris"], progress=False),
    ],
    ids=["final_logits", "greedy", "juice_logits", "juice_generate", "truncation"],
)
def test_non_string_prompts_are_type_errors(tiny_gemma, entry):
    for prompts in ([PROMPT, 3], [PROMPT, None], [b"bytes"]):
        with pytest.raises(TypeError, match="prompts must be"):
            entry(tiny_gemma, prompts)


def test_decoding_past_the_context_window_is_refused_before_it_runs(tiny_gemma):
    from cpsuper.scoring import decode_all

    n_ctx = tiny_gemma.cfg.n_ctx
    prompt = [tiny_gemma.tokenizer.bos_token_id] + [100] * (n_ctx - 4)  # n_ctx - 3 tokens
    texts, _ = decode_all(tiny_gemma, [prompt], max_new_tokens=4, progress=False)  # exactly fills the window
    assert len(texts) == 1
    with pytest.raises(ValueError, match=f"needs {n_ctx + 1} positions, more than the model's context window"):
        decode_all(tiny_gemma, [prompt], max_new_tokens=5, progress=False)


# --- silent wrong results that are now errors ----------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (lambda: cp.ScaleHead(0, 0, math.nan), "ScaleHead.scale must be finite, got nan"),
        (lambda: cp.ScaleHead(0, 0, -math.inf), "ScaleHead.scale must be finite, got -inf"),
        (lambda: cp.ScaleHead(0, 0, "2"), "ScaleHead.scale must be a number"),
        (
            lambda: cp.interventions.AddHeadOutput(0, 0, math.inf, torch.zeros(1, 2, 16)),
            "AddHeadOutput.coef must be finite",
        ),
        (lambda: cp.ScaleHead(0, 0, torch.ones(2, 2)), r"ScaleHead.scale must be a number or a tensor \[batch\]"),
    ],
    ids=["scale_nan", "scale_inf", "scale_str", "coef_inf", "scale_2d"],
)
def test_interventions_refuse_non_finite_scales(tiny_gemma, spec, message):
    with pytest.raises(ValueError, match=message):
        with cp.intervene(tiny_gemma, spec()):
            pass
    assert not any(h._forward_hooks for h in tiny_gemma.hook_dict.values())


def test_cad_refuses_non_finite_alpha(tiny_gemma, capitals):
    with pytest.raises(ValueError, match="alpha must be finite, got nan"):
        cp.CAD(tiny_gemma, alpha=math.nan)
    cad = cp.CAD(tiny_gemma, alpha=1.0)
    cad.alpha = math.inf  # set after construction: checked again where it is used
    with pytest.raises(ValueError, match="alpha must be finite, got inf"):
        cad.logits_for(capitals, "substitution")
    with pytest.raises(ValueError, match="alpha must be finite, got inf"):
        cad.generate_for(capitals, "substitution", 2)


def test_juice_rechecks_strengths_set_after_construction(tiny_gemma):
    steer = cp.JuICE(tiny_gemma, enhance=[(1, 1)], suppress=[(2, 0)], beta_plus=1.0, beta_minus=-1.0)
    steer.beta_plus = math.nan
    with pytest.raises(ValueError, match="beta_plus must be finite, got nan"):
        steer.coefficients()
    with pytest.raises(ValueError, match="beta_plus must be finite, got nan"):
        steer.logits(PROMPT)
    steer.beta_plus, steer.beta_minus = 1.0, 0.5
    with pytest.raises(ValueError, match="beta_minus must be non-positive, got 0.5"):
        steer.generate(PROMPT, max_new_tokens=2)
    steer.beta_plus, steer.beta_minus = -2.0, -1.0
    with pytest.raises(ValueError, match="beta_plus must be non-negative, got -2.0"):
        steer.logits(PROMPT)


@pytest.mark.parametrize(
    ("entry", "flag"),
    [
        (lambda m, d, v: cp.score_dataset(m, d, greedy=v, progress=False), "greedy"),
        (lambda m, d, v: cp.score_dataset(m, d, greedy=False, progress=v), "progress"),
        (lambda m, d, v: cp.score_dataset(m, d, greedy=False, whole_answer=v, progress=False), "whole_answer"),
        (lambda m, d, v: cp.filter_known(m, d, progress=v), "progress"),
        (lambda m, d, v: cp.evaluate({"Original": cp.Original(m)}, d, full_continuations=v), "full_continuations"),
        (lambda m, d, v: cp.knockout_sweep(m, d, progress=v), "progress"),
        (lambda m, d, v: cp.head_sweep(m, d, (0.0,), progress=v), "progress"),
        (lambda m, d, v: cp.identify_heads(m, d, k=1, progress=v), "progress"),
    ],
    ids=["greedy", "score_progress", "whole_answer", "filter_known", "evaluate", "knockout", "head_sweep", "identify"],
)
@pytest.mark.parametrize("value", ["no", 0, None])
def test_boolean_flags_must_be_booleans(tiny_gemma, capitals, entry, flag, value):
    with pytest.raises(TypeError, match=f"{flag} must be True or False, got {value!r}"):
        entry(tiny_gemma, capitals, value)


@pytest.fixture(scope="module")
def one_layer_sweep(tiny_gemma, capitals):
    return cp.head_sweep(tiny_gemma, capitals, (0.0,), layers=[0], progress=False)


def test_rank_heads_takes_a_positive_k_within_the_sweep(one_layer_sweep):
    assert len(cp.rank_heads(one_layer_sweep, k=4)) == 4
    for k in (-1, 0, 1.5, True):
        with pytest.raises(ValueError, match=f"k must be a positive integer, got {k!r}"):
            cp.rank_heads(one_layer_sweep, k=k)
    with pytest.raises(ValueError, match=r"k=5 is more than the 4 heads in the sweep; use 1\.\.4"):
        cp.rank_heads(one_layer_sweep, k=5)


def test_knockout_counts_must_be_positive_integers(tiny_gemma, capitals):
    ranking = [(0, 1), (1, 3)]
    for ks in ([-1], [0], [1, 1.5]):
        with pytest.raises(ValueError, match=r"ks\[\d\] must be a positive integer"):
            cp.cumulative_knockout(tiny_gemma, capitals, ranking, ks=ks, progress=False)
    with pytest.raises(ValueError, match="ks is empty"):
        cp.cumulative_knockout(tiny_gemma, capitals, ranking, ks=[], progress=False)
    with pytest.raises(ValueError, match="only 2"):
        cp.cumulative_knockout(tiny_gemma, capitals, ranking, ks=[3], progress=False)
    with pytest.raises(ValueError, match="k must be a positive integer, got -1"):
        cp.heads.top_knockout_heads(tiny_gemma, capitals, k=-1, progress=False)
    with pytest.raises(ValueError, match="k must be a positive integer, got 2.5"):
        cp.identify_heads(tiny_gemma, capitals, k=2.5, progress=False)


def test_an_empty_selection_of_layers_or_heads_is_refused(tiny_gemma, capitals):
    with pytest.raises(ValueError, match=r"layers is empty; give at least one layer \(this model has layers 0\.\.2\)"):
        cp.knockout_sweep(tiny_gemma, capitals, layers=[], progress=False)
    with pytest.raises(ValueError, match=r"layers is empty; give at least one layer"):
        cp.head_sweep(tiny_gemma, capitals, (0.0,), layers=[], progress=False)
    with pytest.raises(ValueError, match=r"heads is empty; give at least one head \(this model has query heads 0"):
        cp.head_sweep(tiny_gemma, capitals, (0.0,), heads=[], progress=False)


@pytest.mark.parametrize("n_layers", [-1, 0, 1.5, True])
def test_tiny_model_needs_a_positive_number_of_layers(n_layers):
    with pytest.raises(ValueError, match=f"n_layers must be a positive integer, got {n_layers!r}"):
        cp.tiny_model("gemma", n_layers=n_layers)


MAIN_ENTRIES = {
    "score_dataset": lambda m, d: cp.score_dataset(m, d, progress=False),
    "filter_known": lambda m, d: cp.filter_known(m, d, progress=False),
    "knockout_sweep": lambda m, d: cp.knockout_sweep(m, d, progress=False),
    "head_sweep": lambda m, d: cp.head_sweep(m, d, (0.0,), progress=False),
    "identify_heads": lambda m, d: cp.identify_heads(m, d, k=1, progress=False),
    "evaluate": lambda m, d: cp.evaluate({"Original": cp.Original(m)}, d),
}


@pytest.mark.parametrize("entry", MAIN_ENTRIES.values(), ids=MAIN_ENTRIES.keys())
def test_a_wrong_model_or_dataset_type_is_a_type_error(tiny_gemma, capitals, entry):
    for model in (None, 3, [tiny_gemma]):
        with pytest.raises(TypeError, match=r"model must be a TransformerLens model .*cp\.load_model"):
            entry(model, capitals)
    wrong = {"cp.conflict_dataset": (None, 3), "cp.ConflictDataset": (list(capitals),)}
    for hint, datasets in wrong.items():
        for dataset in datasets:
            with pytest.raises(TypeError, match=rf"(dataset|datasets|selection) must be a ConflictDataset.*{hint}"):
                entry(tiny_gemma, dataset)


def test_an_unknown_hook_name_suggests_close_names(tiny_gemma):
    with pytest.raises(ValueError, match=r"no hook 'blocks\.0\.attn\.hook_zz'.*'blocks\.0\.attn\.hook_z'"):
        with cp.interrupts.hooked(tiny_gemma, [("blocks.0.attn.hook_zz", lambda x, hook: x)]):
            pass
    with pytest.raises(ValueError, match=r"no hook 'blocks\.9\.hook_resid_pre'"):
        with cp.interrupts.hooked(tiny_gemma, bwd_hooks=[("blocks.9.hook_resid_pre", lambda x, hook: x)]):
            pass
    assert not any(h._forward_hooks or h._backward_hooks for h in tiny_gemma.hook_dict.values())


def test_juice_load_names_an_unreadable_or_too_deep_file(tiny_gemma, tmp_path):
    path = tmp_path / "juice.json"
    path.write_bytes(b'{"model": "tiny-gemma", "direction": "\xff\xfe"}')
    with pytest.raises(ValueError, match=r"juice\.json.*not UTF-8 text"):
        cp.JuICE.load(path, tiny_gemma)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"juice\.json.*nested too deeply"):
        cp.JuICE.load(path, tiny_gemma)
