"""Property-based checks (hypothesis) of the core identities, on random heads, layers, batch sizes
and prompt subsets of the tiny models."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cpsuper as cp
from cpsuper.interventions import Knockout, ScaleHead, intervene
from cpsuper.runtime import tokenize_prompts

PROMPTS = [
    "The name of the capital city of France is",
    "Madrid is located in",
    "The name of the capital city of Japan is Lima. The name of the capital city of Japan is",
    "Paris",
    "The capital of Peru is Tokyo. The capital of Peru is",
]
HEADS = st.tuples(st.integers(0, 2), st.integers(0, 3))
MODELS = st.sampled_from(["gemma", "gpt2"])
SETTINGS = settings(max_examples=10, deadline=None)


@pytest.fixture(scope="module")
def models(tiny_gemma, tiny_gpt2):
    return {"gemma": tiny_gemma, "gpt2": tiny_gpt2}


def _logits(model, prompt):
    with torch.inference_mode():
        return model(prompt)[0, -1]


@SETTINGS
@given(name=MODELS, heads=st.sets(HEADS, min_size=1, max_size=6), prompt=st.sampled_from(PROMPTS))
def test_scale_one_changes_nothing(models, name, heads, prompt):
    model = models[name]
    reference = _logits(model, prompt)
    with intervene(model, [ScaleHead(layer, head, 1.0) for layer, head in heads]):
        assert torch.equal(_logits(model, prompt), reference)


@SETTINGS
@given(name=MODELS, layer=st.integers(0, 2), module=st.sampled_from(["attn", "mlp"]), prompt=st.sampled_from(PROMPTS))
def test_knockout_equals_zeroing_the_hook(models, name, layer, module, prompt):
    model = models[name]
    with intervene(model, Knockout(layer, module)):
        knocked = _logits(model, prompt)
    with torch.inference_mode():
        zeroed = model.run_with_hooks(
            prompt, fwd_hooks=[(f"blocks.{layer}.hook_{module}_out", lambda act, hook: torch.zeros_like(act))]
        )[0, -1]
    assert torch.equal(knocked, zeroed)


@SETTINGS
@given(
    name=MODELS,
    subset=st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=5),
    batch_size=st.integers(1, 6),
    padding_side=st.sampled_from(["left", "right"]),
)
def test_batched_equals_one_by_one(models, name, subset, batch_size, padding_side):
    model = models[name]
    batched = cp.scoring.final_logits(model, subset, batch_size=batch_size, padding_side=padding_side, progress=False)
    single = torch.stack([_logits(model, prompt) for prompt in subset])
    torch.testing.assert_close(batched, single, atol=1e-4, rtol=0)


@SETTINGS
@given(
    name=MODELS,
    heads=st.lists(HEADS, min_size=1, max_size=4, unique=True),
    layers=st.lists(st.integers(0, 2), min_size=1, max_size=2, unique=True),
    batch_size=st.integers(1, 40),
)
def test_engine_batched_equals_one_condition_at_a_time(models, name, heads, layers, batch_size):
    """The sweep engine with random row batches equals one hooked forward per condition."""
    from cpsuper.edits import HeadEdit, ModuleEdit
    from cpsuper.engine import run_conditions

    model = models[name]
    conditions = [[HeadEdit(l, h, scale=0.5)] for l, h in heads] + [[ModuleEdit(l, "mlp", 0.0)] for l in layers]
    tokens = tokenize_prompts(model, PROMPTS[:3])
    ids = torch.tensor([[cp.runtime.answer_token(model, " Paris", p)] for p in PROMPTS[:3]])
    logit = lambda logits, answer_ids: logits.gather(-1, answer_ids)  # noqa: E731
    _, out = run_conditions(model, tokens, ids, conditions, metric=logit, batch_size=batch_size, progress=False)
    for c, condition in enumerate(conditions):
        edit = condition[0]
        spec = ScaleHead(edit.layer, edit.head, 0.5) if isinstance(edit, HeadEdit) else Knockout(edit.layer, "mlp")
        with intervene(model, spec):
            expected = torch.stack([_logits(model, p)[ids[i, 0]] for i, p in enumerate(PROMPTS[:3])])
        torch.testing.assert_close(out[:, c, 0], expected, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def capitals(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)


@SETTINGS
@given(name=MODELS, start=st.integers(0, 2), stop=st.integers(1, 3))
def test_dla_components_sum_to_the_logit(models, capitals, name, start, stop):
    model = models[name]
    data = capitals[min(start, stop - 1) : stop]
    attribution = cp.direct_logit_attribution(model, data, ["parametric"], progress=False)
    for _, row in attribution.totals.iterrows():
        example = data[row.example]
        prompt = example.prompts[row.conflict_type]
        actual = _logits(model, prompt)[cp.runtime.answer_token(model, example.answer, prompt)]
        assert row.reconstructed == pytest.approx(float(actual), abs=1e-4)


@SETTINGS
@given(
    name=MODELS,
    enhance=st.lists(HEADS, max_size=3, unique=True),
    suppress=st.lists(HEADS, max_size=3, unique=True),
    subset=st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=3),
)
def test_dual_run_with_zero_strengths_equals_clean(models, name, enhance, suppress, subset):
    model = models[name]
    suppress = [h for h in suppress if h not in enhance]
    steer = cp.JuICE(model, enhance=enhance, suppress=suppress, beta_plus=0.0, beta_minus=0.0)
    clean = cp.scoring.final_logits(model, subset, progress=False)
    assert torch.equal(steer.logits(subset), clean)
    assert steer.generate(subset, max_new_tokens=2) == cp.scoring.greedy_continuations(
        model, subset, max_new_tokens=2, progress=False
    )


SETTLE_ALPHABET = "abPrisNewYokp -.,'!\u00e9\u0301\u00a0"
SETTLE_ANSWERS = (["Paris"], ["New York"], ["par"], ["Paris", "p"])


@given(
    text=st.text(SETTLE_ALPHABET, max_size=24),
    more=st.text(SETTLE_ALPHABET, max_size=12),
    answers=st.sampled_from(SETTLE_ANSWERS),
    n_words=st.integers(1, 5),
)
@settings(max_examples=400, deadline=None)
def test_a_settled_reading_never_changes(text, more, answers, n_words):
    """reading_settled(text) means mentions_answer gives the same verdict on any extension."""
    if cp.reading.reading_settled(text, answers, n_words):
        assert cp.reading.mentions_answer(text, answers, n_words) == cp.reading.mentions_answer(
            text + more, answers, n_words
        )


@SETTINGS
@given(rows=st.integers(0, 6), vocab=st.integers(1, 300), scale=st.floats(0.1, 50.0), masked=st.booleans())
def test_logsumexp_by_row_is_torchs_logsumexp(rows, vocab, scale, masked):
    """The metrics' row-by-row logsumexp gives exactly the values of one call over the matrix,
    including -inf entries (masked tokens) and an empty batch."""
    from cpsuper.metrics import logsumexp_by_row

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab)) * scale
    if masked:
        logits[:, ::2] = float("-inf")
    assert torch.equal(logsumexp_by_row(logits), logits.logsumexp(-1, keepdim=True))


STRENGTHS = st.floats(0.25, 3.0)


@SETTINGS
@given(
    name=MODELS,
    enhance=st.lists(HEADS, min_size=1, max_size=3, unique=True),
    suppress=st.lists(HEADS, min_size=1, max_size=3, unique=True),
    beta_plus=STRENGTHS,
    beta_minus=STRENGTHS.map(lambda b: -b),
    prompt=st.sampled_from(PROMPTS),
)
def test_dual_run_with_random_strengths_equals_a_two_pass_hook_run(
    models, two_pass, name, enhance, suppress, beta_plus, beta_minus, prompt
):
    """JuICE's batched, resumed dual run against a hand-written record-then-add run."""
    model = models[name]
    suppress = [h for h in suppress if h not in enhance] or [h for h in [(2, 3), (0, 0)] if h not in enhance][:1]
    steer = cp.JuICE(model, enhance=enhance, suppress=suppress, beta_plus=beta_plus, beta_minus=beta_minus)
    coefs = {h: beta_plus for h in enhance} | {h: beta_minus for h in suppress}
    torch.testing.assert_close(steer.logits([prompt])[0], two_pass(model, prompt, coefs), atol=1e-4, rtol=1e-4)


@SETTINGS
@given(
    name=MODELS,
    edits=st.lists(
        st.tuples(HEADS, st.floats(0.0, 2.0), st.floats(-1.5, 1.5)), min_size=1, max_size=3, unique_by=lambda e: e[0]
    ),
    batch_size=st.integers(1, 7),
)
def test_engine_head_edits_with_add_equal_a_two_pass_hook_run(models, name, edits, batch_size):
    """Several ``HeadEdit(scale, add)`` in one condition: ``z <- scale * z + add * z_clean``."""
    from cpsuper.edits import HeadEdit
    from cpsuper.engine import run_conditions

    model = models[name]
    condition = [HeadEdit(l, h, scale=s, add=a) for (l, h), s, a in edits]
    prompts = PROMPTS[:3]
    tokens = tokenize_prompts(model, prompts)
    ids = torch.tensor([[cp.runtime.answer_token(model, " Paris", p)] for p in prompts])
    logit = lambda logits, answer_ids: logits.gather(-1, answer_ids)  # noqa: E731
    _, out = run_conditions(model, tokens, ids, [condition], metric=logit, batch_size=batch_size, progress=False)
    for i, prompt in enumerate(prompts):
        _, clean = model.run_with_cache(prompt)
        hooks = []
        for (l, h), s, a in edits:
            recorded = clean[f"blocks.{l}.attn.hook_z"][:, :, h]

            def edit(z, hook, h=h, s=s, a=a, recorded=recorded):
                z = z.clone()
                z[:, :, h] = s * z[:, :, h] + a * recorded
                return z

            hooks.append((f"blocks.{l}.attn.hook_z", edit))
        with torch.inference_mode():
            expected = model.run_with_hooks(prompt, fwd_hooks=hooks)[0, -1, ids[i, 0]]
        torch.testing.assert_close(out[i, 0, 0], expected, atol=1e-4, rtol=1e-4)


@SETTINGS
@given(
    name=MODELS,
    head=HEADS,
    scale=st.floats(-2.0, 3.0).filter(lambda s: abs(s - 1) > 0.05),
    prompt=st.sampled_from(PROMPTS),
)
def test_scale_head_equals_scaling_its_rows_of_W_O(models, name, head, scale, prompt):
    """Scaling a query head's ``z`` is scaling its block of ``W_O`` (the output is linear in both)."""
    from cpsuper.backend import is_bridge
    from cpsuper.interrupts import swapped_parameters
    from cpsuper.truncation.hf_weights import hf_replacements

    model = models[name]
    layer, h = head
    with intervene(model, ScaleHead(layer, h, scale)):
        hooked_logits = _logits(model, prompt)
    edited = model.blocks[layer].attn.W_O.detach().clone()  # [head d_head d_model]
    edited[h] *= scale
    if is_bridge(model):  # the bridge computes with the Hugging Face output projection
        replacements = hf_replacements(model, layer, "attn_o", edited)
    else:
        replacements = {f"blocks.{layer}.attn.W_O": edited}
    with swapped_parameters(model, replacements):
        weight_logits = _logits(model, prompt)
    torch.testing.assert_close(hooked_logits, weight_logits, atol=1e-4, rtol=1e-4)


@SETTINGS
@given(name=MODELS, layer=st.integers(0, 2), mean=st.booleans(), prompt=st.sampled_from(PROMPTS))
def test_layer_knockout_equals_carrying_the_residual_stream_past_the_block(models, name, layer, mean, prompt):
    """``Knockout(layer, "layer")`` (zero or mean) against an independent hook: the block's output
    residual is its input plus the replacement outputs (zero, or the two means)."""
    model = models[name]
    means = {"attn": torch.randn(model.cfg.d_model) * 0.1, "mlp": torch.randn(model.cfg.d_model) * 0.1}
    with intervene(model, Knockout(layer, "layer", mean=means if mean else None)):
        knocked = _logits(model, prompt)
    added = means["attn"] + means["mlp"] if mean else 0.0
    kept = {}

    def keep(resid, hook):
        kept["pre"] = resid

    def carry(resid, hook):
        return kept["pre"] + added

    hooks = [(f"blocks.{layer}.hook_resid_pre", keep), (f"blocks.{layer}.hook_resid_post", carry)]
    with torch.inference_mode():
        expected = model.run_with_hooks(prompt, fwd_hooks=hooks)[0, -1]
    torch.testing.assert_close(knocked, expected, atol=1e-4, rtol=1e-4)
