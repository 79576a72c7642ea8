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
