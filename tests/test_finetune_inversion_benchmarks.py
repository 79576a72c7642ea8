"""The benchmark stand-ins of scripts/finetune_inversion_benchmarks.py on a tiny random Gemma-shaped
model, against hand computations: true-answer contexts, greedy reading and closed-book accuracy,
per-token language-modelling loss, and the peak, paired-change and reproducibility tables."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.finetune import context_training_pairs
from cpsuper.reading import mentions_answer, normalize_answer
from cpsuper.runtime import answer_token, tokenize_prompts


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("plotly")
    path = Path(__file__).parents[1] / "scripts" / "finetune_inversion_benchmarks.py"
    spec = importlib.util.spec_from_file_location("finetune_inversion_benchmarks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _greedy(model, prompt: str, n: int = 6) -> str:
    """Greedy continuation by hand: the argmax token appended one at a time, no cache, no padding."""
    tokens = tokenize_prompts(model, [prompt])[0]
    prompt_len = len(tokens)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return model.tokenizer.decode(tokens[prompt_len:], skip_special_tokens=True)


def _first_word(text: str) -> str | None:
    words = text.split()
    return words[0] if words and normalize_answer(words[0]) else None


def test_true_context_states_the_true_answer(script, tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=6, seed=0, tokenizer=tiny_gemma)
    true = script.true_context(data)
    for before, after in zip(data, true):
        for c in script.CONTEXT_PROMPTS:
            assert before.context_answer in before.prompts[c]
            assert before.context_answer not in after.prompts[c] and after.answer in after.prompts[c]
        assert (after.answer, after.context_answer, set(after.prompts)) == (
            before.answer,
            before.context_answer,
            {*script.CONTEXT_PROMPTS},
        )
    # the same prompts as the training pairs with no counterfactual share
    pairs = context_training_pairs(data, counterfactual_share=0.0, conflict_types=script.CONTEXT_PROMPTS)
    assert sorted(p for p, _ in pairs) == sorted(e.prompts[c] for e in true for c in script.CONTEXT_PROMPTS)
    assert all(a == e.answer for (p, a) in pairs for e in true if p in e.prompts.values())


def test_sentence_joins_prompt_and_answer(script, tiny_gemma):
    example = cp.conflict_dataset("company_founder", n=1, seed=0, tokenizer=tiny_gemma)[0]
    assert script.sentence(example) == example.prompts["clean"] + " " + example.answer
    spaced = replace(example, prompts={"clean": "Answer: "})
    assert script.sentence(spaced) == "Answer: " + example.answer


def test_token_losses_match_prefix_by_prefix(script, tiny_gemma):
    texts = ["The company Microsoft was founded by Bill Gates", "Paris"]
    got = script.token_losses(tiny_gemma, texts)
    for text, losses in zip(texts, got):
        tokens = tokenize_prompts(tiny_gemma, [text])[0]
        hand = []
        with torch.no_grad():
            for i in range(1, len(tokens)):  # predict token i from tokens[:i] alone
                logits = tiny_gemma(torch.tensor([tokens[:i]]))[0, -1].double()
                hand.append(-(logits.log_softmax(-1)[tokens[i]]).item())
        assert len(losses) == len(tokens) - 1
        np.testing.assert_allclose(losses, hand, rtol=1e-4, atol=1e-4)


def _rigged(model, data, prompt_type: str):
    """Each fact's answer made the first word of the model's own greedy continuation of its
    ``prompt_type`` prompt for the even facts (the others keep their true answer, which a random
    model does not say), and the context answer the other way round, so greedy accuracy is known by hand."""
    out = []
    for i, e in enumerate(data):
        word = _first_word(_greedy(model, e.prompts[prompt_type]))
        if word is None or any(
            answer_token(model, word, p) == answer_token(model, e.answer, p) for p in e.prompts.values()
        ):
            continue  # first tokens that cannot be told apart are refused by score_dataset
        answer, other = (word, e.answer) if i % 2 == 0 else (e.answer, word)
        out.append(replace(e, answer=answer, context_answer=other, aliases=(), context_aliases=()))
    return cp.ConflictDataset(out)


def test_benchmark_rows_against_hand_greedy_and_losses(script, tiny_gemma):
    held = cp.conflict_dataset("world_capital", n=8, seed=1, tokenizer=tiny_gemma)
    reading = _rigged(tiny_gemma, script.true_context(held), "substitution")
    closed = _rigged(tiny_gemma, cp.conflict_dataset("athlete_sport", n=8, seed=0, tokenizer=tiny_gemma), "clean")
    assert len(reading) >= 4 and len(closed) >= 4
    rows = script.benchmark_rows(tiny_gemma, reading, closed, batch_size=3)
    got = rows.set_index(["quantity", "conflict_type", "fact"]).value
    for e in reading:
        fact = f"{e.relation}:{e.subject}"
        for c in script.CONTEXT_PROMPTS:
            hand = float(mentions_answer(_greedy(tiny_gemma, e.prompts[c]), e.answers))
            assert got["reading_acc", c, fact] == hand
    for e in closed:
        fact = f"{e.relation}:{e.subject}"
        assert got["closed_book_acc", "clean", fact] == float(
            mentions_answer(_greedy(tiny_gemma, e.prompts["clean"]), e.answers)
        )
        tokens = tokenize_prompts(tiny_gemma, [e.prompts["clean"] + " " + e.answer])[0]
        with torch.no_grad():
            logprobs = tiny_gemma(torch.tensor([tokens]))[0].double().log_softmax(-1)
        hand = -np.mean([logprobs[j - 1, tokens[j]].item() for j in range(1, len(tokens))])
        assert got["lm_loss", "clean", fact] == pytest.approx(hand, rel=1e-4)
    # the rigging works: the even facts are right on the prompt they were rigged on, the others wrong
    sub = [got["reading_acc", "substitution", f"{e.relation}:{e.subject}"] for e in reading]
    assert sub == [float(e.answer == _first_word(_greedy(tiny_gemma, e.prompts["substitution"]))) for e in reading]
    assert 0 < sum(sub) < len(sub)
    book = [got["closed_book_acc", "clean", f"{e.relation}:{e.subject}"] for e in closed]
    assert 0 < sum(book) < len(book)
    assert len(rows) == 2 * len(reading) + 2 * len(closed)


def test_closed_book_facts_filters_each_untrained_relation(script, tiny_gemma, monkeypatch):
    seen = []

    def keep_even(model, data, by, **options):
        seen.append((data[0].relation, len(data), by))
        return data[list(range(0, len(data), 2))]

    monkeypatch.setattr(script.cp, "filter_known", keep_even)
    got = script.closed_book_facts(tiny_gemma, 7)
    assert seen == [(r, 7, "top1") for r in script.BENCH_RELATIONS]
    assert [e.relation for e in got] == [r for r in script.BENCH_RELATIONS for _ in range(4)]
    first = cp.conflict_dataset("book_author", tokenizer=tiny_gemma)
    assert [e.subject for e in got if e.relation == "book_author"] == [first[i].subject for i in (0, 2, 4, 6)]


def _long(values: dict) -> pd.DataFrame:
    """Rows of facts x steps for one prompt x quantity per key."""
    rows = []
    for (conflict, quantity), table in values.items():
        for i, row in enumerate(table):
            for step, v in zip((0, 20, 40, 60), row):
                rows.append(dict(step=step, fact=f"f{i}", conflict_type=conflict, quantity=quantity, value=v))
    return pd.DataFrame(rows)


def test_peak_and_paired_changes_by_hand(script):
    rng = np.random.default_rng(0)
    margin_sub = np.array([[0, 5, 9, 7], [0, 6, 8, 8], [1, 4, 10, 6.0]])  # peak at 40
    margin_coh = np.array([[0, 9, 5, 4], [0, 8, 6, 3], [0, 7, 7, 5.0]])  # peak at 20
    loss = rng.normal(size=(3, 4))
    per = _long({("substitution", "context_margin"): margin_sub, ("coherent", "context_margin"): margin_coh})
    per = pd.concat([per, _long({("clean", "lm_loss"): loss})])
    peak = script.reliance_peak(per).set_index("conflict_type")
    assert peak.loc["substitution", "peak_step"] == 40 and peak.loc["coherent", "peak_step"] == 20
    assert peak.loc["coherent", "peak_mean"] == pytest.approx(8.0)
    paired = script.paired_changes(per, {"substitution": 40, "coherent": 20}, n_boot=200)
    got = paired.set_index(["vs", "from_step", "to_step", "conflict_type", "quantity"])
    assert got.loc[("start", 0, 60, "clean", "lm_loss"), "mean"] == pytest.approx((loss[:, 3] - loss[:, 0]).mean())
    assert got.loc[("previous", 20, 40, "substitution", "context_margin"), "mean"] == pytest.approx(
        (margin_sub[:, 2] - margin_sub[:, 1]).mean()
    )
    after = got.loc[("peak:coherent", 20, 60, "clean", "lm_loss")]
    assert after["mean"] == pytest.approx((loss[:, 3] - loss[:, 1]).mean()) and after["n"] == 3
    assert ("peak:substitution", 40, 20, "clean", "lm_loss") not in got.index  # only steps after the peak
    assert len(paired.query("vs == 'peak:substitution'")) == 3  # step 60 for each of 3 prompt x quantity
    boot = [
        (loss[np.repeat(np.arange(3), c), 3] - loss[np.repeat(np.arange(3), c), 1]).mean()
        for c in cp.stats.resample_counts(3, n_boot=200, seed=0)
    ]
    assert [after.ci_low, after.ci_high] == pytest.approx(np.quantile(boot, [0.025, 0.975]).tolist())


def test_reproducibility_counts_and_differences(script):
    saved = _long({("coherent", "acc"): np.array([[1, 1, 0, 0], [0, 1, 1, 1.0]])})
    fresh = saved[saved.step <= 20].copy()
    fresh.loc[(fresh.step == 20) & (fresh.fact == "f1"), "value"] = 0.0
    fresh = pd.concat([fresh, fresh.iloc[:1].assign(fact="new")])
    got = script.reproducibility(fresh, saved).set_index("step")
    assert got.loc[0, "max_abs_diff"] == 0.0 and got.loc[0, "n_missing"] == 1 and got.loc[0, "n"] == 3
    assert got.loc[20, "max_abs_diff"] == 1.0 and got.loc[20, "n_missing"] == 0


def test_measure_order_starts_with_start_peak_and_end(script):
    steps = [0, 20, 40, 60, 80, 100, 120]
    assert sorted(steps, key=lambda s: script.measure_order(s, 120)) == [0, 40, 120, 20, 60, 80, 100]
    assert sorted([0, 2, 4], key=lambda s: script.measure_order(s, 4)) == [0, 4, 2]
