"""Whole-answer scoring against one-at-a-time, token-by-token runs."""

import math

import numpy as np
import pytest
import torch

import cpsuper as cp
from cpsuper.answers import answer_logprobs

PROMPTS = [
    "The capital city of Argentina is",
    "According to the textbook, the capital city of France is Lima. The capital city of France is",
    "Madrid is located in",
]
ANSWERS = [["Buenos Aires", "Buenos Aires City"], ["Paris"], ["Spain", "the Kingdom of Spain"]]


def _by_hand(model, prompt, answer):
    """Sum of per-token log-probabilities, one full forward per answer token."""
    ids = model.to_tokens(prompt)[0].tolist()
    total = 0.0
    for token in cp.runtime.answer_tokens(model, answer, prompt):
        with torch.no_grad():
            logits = model(torch.tensor([ids]))[0, -1]
        total += logits.float().log_softmax(-1)[token].item()
        ids.append(token)
    return total


def test_whole_answer_equals_the_sum_of_one_at_a_time_token_logprobs(tiny):
    frame = answer_logprobs(tiny, PROMPTS, ANSWERS, progress=False)
    for i, (prompt, aliases) in enumerate(zip(PROMPTS, ANSWERS)):
        each = [_by_hand(tiny, prompt, a) for a in aliases]
        row = frame.iloc[i]
        assert row.logprob == pytest.approx(max(each), abs=1e-4)
        assert row.answer == aliases[int(np.argmax(each))]
        assert row.logprob_lse == pytest.approx(math.log(sum(math.exp(v) for v in each)), abs=1e-4)
    assert (frame.n_tokens > 1).any()  # multi-token answers really are scored whole
    first = cp.scoring.final_logits(tiny, PROMPTS[1], progress=False).log_softmax(-1)[0]
    single = cp.runtime.answer_tokens(tiny, "Paris", PROMPTS[1])
    if len(single) == 1:  # a one-token answer is its first-token log-probability
        assert frame.logprob[1] == pytest.approx(first[single[0]].item(), abs=1e-4)


def test_batched_equals_one_by_one_and_left_equals_right(tiny_gemma):
    together = answer_logprobs(tiny_gemma, PROMPTS, ANSWERS, batch_size=8, progress=False)
    alone = answer_logprobs(tiny_gemma, PROMPTS, ANSWERS, batch_size=1, progress=False)
    left = answer_logprobs(tiny_gemma, PROMPTS, ANSWERS, batch_size=8, padding_side="left", progress=False)
    for other in (alone, left):
        np.testing.assert_allclose(together.logprob, other.logprob, atol=1e-4)
        np.testing.assert_allclose(together.logprob_lse, other.logprob_lse, atol=1e-4)


def test_bad_input(tiny_gemma):
    too_long = "word"  # the longest prompt that still fits the context window on its own
    while len(tiny_gemma.to_tokens(too_long + " word", truncate=False)[0]) <= tiny_gemma.cfg.n_ctx:
        too_long += " word"
    with pytest.raises(ValueError, match="followed by an answer"):
        answer_logprobs(tiny_gemma, [too_long], ["Buenos Aires City of Argentina"], progress=False)
    with pytest.raises(ValueError, match="one answer"):
        answer_logprobs(tiny_gemma, PROMPTS, ANSWERS[:2], progress=False)
    with pytest.raises(ValueError, match="empty"):
        answer_logprobs(tiny_gemma, PROMPTS[:1], [[]], progress=False)
    with pytest.raises(ValueError, match="empty"):
        answer_logprobs(tiny_gemma, PROMPTS[:1], ["  "], progress=False)


def test_score_dataset_whole_answer_measures(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)
    plain = cp.score_dataset(tiny_gemma, data, conflict_types=["coherent"], greedy=False, progress=False)
    assert not plain.measure.str.startswith("logprob_").any()
    scores = cp.score_dataset(
        tiny_gemma, data, conflict_types=["coherent"], greedy=False, whole_answer=True, progress=False
    )
    wide = scores.pivot_table(index="example", columns="measure", values="value")
    prompts = data.prompts("coherent")
    for measure, aliases in (
        ("logprob_parametric", [e.answers for e in data]),
        ("logprob_context", [e.context_answers for e in data]),
    ):
        expected = answer_logprobs(tiny_gemma, prompts, aliases, progress=False).logprob
        np.testing.assert_allclose(wide[measure].to_numpy(), expected.to_numpy(), atol=1e-6)


def _teacher_forced(model, prompt, answer, hooks=()):
    """One forward of the prompt and the answer, hooks on; the sum of the answer tokens' log-probabilities."""
    prompt_ids = model.to_tokens(prompt)[0].tolist()
    answer_ids = cp.runtime.answer_tokens(model, answer, prompt)
    with torch.no_grad():
        logits = model.run_with_hooks(torch.tensor([prompt_ids + answer_ids]), fwd_hooks=list(hooks))[0]
    reads = logits[len(prompt_ids) - 1 : -1].float().log_softmax(-1)
    return float(reads[torch.arange(len(answer_ids)), torch.tensor(answer_ids)].sum())


def test_whole_answer_sweeps_equal_teacher_forced_sums_by_hand(tiny_gemma):
    """head_sweep / knockout_sweep / identify_heads with a whole-answer metric: each value is the
    sum of the answer tokens' log-probabilities from one hooked forward of prompt + answer (by
    hand), clean and with the head knocked out; ``answer_probability`` is its exponential."""
    data = cp.conflict_dataset("world_capital", n=3, seed=0, tokenizer=tiny_gemma)
    sweep = cp.head_sweep(
        tiny_gemma, data, alphas=(0.0,), layers=[1], heads=[2], metric="answer_logprob", progress=False
    )
    rows = sweep.per_example
    assert rows.attrs["metric"] == "answer_logprob" and len(rows) == 3 * len(data.conflict_types) * 2

    def knockout(z, hook):
        z = z.clone()
        z[:, :, 2] = 0.0
        return z

    multi = 0
    for row in rows.itertuples():
        example = data[row.example]
        prompt = example.prompts[row.conflict_type]
        answer = example.target_answer(row.target)
        multi += len(cp.runtime.answer_tokens(tiny_gemma, answer, prompt)) > 1
        assert row.p_clean == pytest.approx(_teacher_forced(tiny_gemma, prompt, answer), abs=1e-4)
        by_hand = _teacher_forced(tiny_gemma, prompt, answer, [("blocks.1.attn.hook_z", knockout)])
        assert row.p == pytest.approx(by_hand, abs=1e-4)
    assert multi == len(rows)  # every answer here has several tokens
    probability = cp.head_sweep(
        tiny_gemma, data, alphas=(0.0,), layers=[1], heads=[2], metric="answer_probability", progress=False
    ).per_example
    np.testing.assert_allclose(probability.p, np.exp(rows.p), rtol=1e-5)
    knocked = cp.knockout_sweep(tiny_gemma, data, layers=[0], metric="answer_logprob", progress=False).per_example
    assert np.isfinite(knocked.p).all() and (knocked.p <= 0).all()
    heads = cp.identify_heads(tiny_gemma, data, k=2, metric="answer_logprob", progress=False)
    assert heads.per_example.delta.abs().max() > 1e-3
    with pytest.raises(ValueError, match="scored with metric='answer_logprob', not 'probability'"):
        cp.heads.top_knockout_heads(tiny_gemma, data, identified=heads, progress=False)
    joint = cp.cumulative_knockout(tiny_gemma, data, [(1, 2)], metric="answer_logprob", progress=False).per_example
    knocked_out = rows[(rows.conflict_type == "coherent") & (rows.target == "parametric")]
    np.testing.assert_allclose(joint[joint.k == 1].p, knocked_out.p, atol=1e-5)


def test_whole_answer_metric_refuses_patches_and_bad_answers(tiny_gemma):
    from cpsuper.answers import whole_answer_conditions
    from cpsuper.edits import HeadEdit, PatchEdit

    data = cp.conflict_dataset("world_capital", n=3, seed=0, tokenizer=tiny_gemma)
    with pytest.raises(ValueError, match="patch with metric='probability'"):
        cp.knockout_sweep(tiny_gemma, data, layers=[0], metric="answer_logprob", ablation="resample", progress=False)
    tokens = [tiny_gemma.to_tokens(p)[0].tolist() for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="has no tokens"):
        whole_answer_conditions(tiny_gemma, tokens, [[[5]], [[]]], [[HeadEdit(0, 0, scale=0.0)]], progress=False)
    with pytest.raises(ValueError, match="same number of answers"):
        whole_answer_conditions(tiny_gemma, tokens, [[[5]], [[5], [6]]], [[]], progress=False)
    with pytest.raises(ValueError, match="moves the positions a PatchEdit"):
        whole_answer_conditions(tiny_gemma, tokens, [[[5]], [[6]]], [[PatchEdit(0, "resid_pre", -1)]], progress=False)
    with pytest.raises(ValueError, match="Unknown whole-answer metric"):
        whole_answer_conditions(tiny_gemma, tokens, [[[5]], [[6]]], [[]], metric="probability", progress=False)
