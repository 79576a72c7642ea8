import pytest
import torch

import cpsuper as cp
from cpsuper.decoding import iter_greedy
from cpsuper.runtime import tokenize_prompts


@pytest.fixture(scope="module")
def dataset(tiny_gemma):
    # Two relations: prompts of many different lengths, so batches need padding.
    return cp.conflict_dataset(["world_capital", "book_author"], n=6, tokenizer=tiny_gemma)


def _prompts(dataset):
    return [e.prompts[c] for e in dataset for c in dataset.conflict_types]


def test_final_logits_equal_full_forward(tiny, dataset):
    prompts = _prompts(dataset)[:5]
    batched = cp.scoring.final_logits(tiny, prompts, batch_size=5, progress=False)
    with torch.no_grad():
        reference = torch.stack([tiny(p)[0, -1] for p in prompts])
    torch.testing.assert_close(batched, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_batched_equals_one_by_one(tiny, dataset, padding_side):
    prompts = _prompts(dataset)
    lengths = {len(t) for t in tokenize_prompts(tiny, prompts)}
    assert len(lengths) > 3  # the batches really are padded
    batched = cp.scoring.final_logits(tiny, prompts, batch_size=7, padding_side=padding_side, progress=False)
    single = torch.cat([cp.scoring.final_logits(tiny, [p], progress=False) for p in prompts])
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=0)


def test_left_and_right_padding_agree(tiny, dataset):
    scores = {
        side: cp.score_dataset(tiny, dataset, padding_side=side, greedy=False, batch_size=8, progress=False)
        for side in ("left", "right")
    }
    torch.testing.assert_close(
        torch.tensor(scores["left"]["value"].values), torch.tensor(scores["right"]["value"].values), atol=1e-5, rtol=0
    )


def test_single_pass_scores_equal_a_separate_scoring_pass(tiny, dataset):
    """With greedy decoding, the probabilities come from its first (left-padded) step."""
    together = cp.score_dataset(tiny, dataset, batch_size=8, max_new_tokens=3, progress=False)
    apart = cp.score_dataset(tiny, dataset, batch_size=8, max_new_tokens=3, padding_side="right", progress=False)
    assert together.measure.nunique() == 6
    torch.testing.assert_close(torch.tensor(together.value.values), torch.tensor(apart.value.values), atol=1e-5, rtol=0)
    assert together.continuation.tolist() == apart.continuation.tolist()


def test_score_dataset_matches_an_independent_computation(tiny_gemma, dataset):
    scores = cp.score_dataset(tiny_gemma, dataset, batch_size=4, progress=False, greedy=False)
    assert set(scores.columns) >= {"example", "conflict_type", "measure", "value"}
    assert len(scores) == len(dataset) * 3 * 4
    wide = scores.pivot_table(index=["example", "conflict_type"], columns="measure", values="value")
    for (i, conflict_type), row in wide.iterrows():
        example = dataset[i]
        prompt = example.prompts[conflict_type]
        with torch.no_grad():
            logits = tiny_gemma(prompt)[0, -1]
        probs = logits.softmax(-1)
        p_tok = tiny_gemma.tokenizer.encode(" " + example.answer, add_special_tokens=False)[0]
        c_tok = tiny_gemma.tokenizer.encode(" " + example.context_answer, add_special_tokens=False)[0]
        assert row.p_parametric == pytest.approx(probs[p_tok].item(), abs=1e-6)
        assert row.p_context == pytest.approx(probs[c_tok].item(), abs=1e-6)
        assert row.logit_diff == pytest.approx((logits[p_tok] - logits[c_tok]).item(), abs=1e-4)
        assert row.context_wins == float(logits[c_tok] > logits[p_tok])


def test_greedy_continuations_match_a_naive_loop(tiny, dataset):
    prompts = _prompts(dataset)[:6]
    fast = cp.scoring.greedy_continuations(tiny, prompts, max_new_tokens=5, batch_size=3, progress=False)
    for prompt, text in zip(prompts, fast):
        tokens = tiny.to_tokens(prompt)
        with torch.no_grad():
            for _ in range(5):
                tokens = torch.cat([tokens, tiny(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        expected = tiny.tokenizer.decode(tokens[0, -5:].tolist(), skip_special_tokens=True)
        assert text == expected


def test_accuracy_reads_the_greedy_continuation(tiny_gemma, dataset):
    scores = cp.score_dataset(tiny_gemma, dataset[:3], conflict_types=["clean"], progress=False, max_new_tokens=6)
    acc = scores[scores.measure == "acc_parametric"]
    for _, row in acc.iterrows():
        assert row.value == float(cp.reading.mentions_answer(row.continuation, dataset[int(row.example)].answers))


def test_mentions_answer_normalizes():
    assert cp.reading.mentions_answer(" Bogotá, the capital.", ["Bogota"])
    assert cp.reading.mentions_answer(" BRASILIA!", ["Brasília"])
    assert cp.reading.mentions_answer(" the city of Washington, D.C.", ["Washington, D.C."])
    assert not cp.reading.mentions_answer(" Parisian food", ["Paris"])  # whole words only
    assert not cp.reading.mentions_answer(" it is a city called Paris", ["Paris"], n_words=5)
    assert cp.reading.mentions_answer(" it is a city called Paris", ["Paris"], n_words=6)


@pytest.mark.parametrize("by", ["top1", "greedy"])
def test_filter_known_keeps_what_the_model_answers(by):
    model = cp.tiny_model("gemma", seed=1)
    # Three one-token words as answers; the model is made to always say the second one.
    words = [
        w
        for w in ("capital", "official", "language", "city", "company")
        if len(model.tokenizer.encode(" " + w, add_special_tokens=False)) == 1
    ][:3]
    assert len(words) == 3
    relation = cp.load_relation("world_capital")
    custom = cp.Relation(
        "toy",
        [("France", words[0]), ("Japan", words[1]), ("Kenya", words[2])],
        relation.clean,
        relation.coherent,
        relation.question,
        relation.answer_prefix,
    )
    with torch.no_grad():
        model.unembed.b_U[cp.runtime.answer_token(model, words[1], "x")] = 1e3
    data = custom.dataset(tokenizer=model)
    known = cp.filter_known(model, data, by=by, progress=False)
    assert [e.subject for e in known] == ["Japan"]
    with pytest.raises(ValueError, match="answers none"):
        cp.filter_known(model, data.filter(lambda e: e.subject != "Japan"), by=by, progress=False)


def test_summary_orders_conflict_types(tiny_gemma, dataset):
    scores = cp.score_dataset(tiny_gemma, dataset, greedy=False, progress=False)
    summary = cp.summarize_scores(scores, by=["conflict_type"])
    assert list(dict.fromkeys(summary.conflict_type)) == list(cp.CONFLICT_TYPES)
    p = summary[(summary.conflict_type == "clean") & (summary.measure == "p_parametric")]
    clean = scores[(scores.conflict_type == "clean") & (scores.measure == "p_parametric")]
    assert p["mean"].item() == pytest.approx(clean.value.mean())
    assert p["n"].item() == len(dataset)


# --- bad input ------------------------------------------------------------------------------


def _example(**overrides):
    fields = dict(
        relation="r",
        subject="France",
        answer="Paris",
        context_answer="Rome",
        prompts={"clean": "The capital of France is"},
    )
    fields.update(overrides)
    return cp.ConflictExample(**fields)


def test_answer_collision_is_rejected(tiny_gemma):
    dataset = cp.ConflictDataset([_example(answer="Paris", context_answer="Paris Hilton")])
    with pytest.raises(ValueError, match="start with the same token"):
        cp.score_dataset(tiny_gemma, dataset, progress=False)


def test_multi_token_answer_when_one_token_is_required(tiny_gemma):
    dataset = cp.ConflictDataset([_example(answer="Ouagadougou-Bobo-Dioulasso")])
    with pytest.raises(ValueError, match="single-token answers"):
        cp.runtime.check_dataset(tiny_gemma, dataset, require_single_token=True)


def test_empty_answer_is_rejected():
    with pytest.raises(ValueError, match="empty answer"):
        _example(answer="  ")


def test_prompt_longer_than_context_window(tiny_gemma):
    long_prompt = "The capital of France is " * 200
    dataset = cp.ConflictDataset([_example(prompts={"clean": long_prompt})])
    with pytest.raises(ValueError, match="exceeds the model's context window of 256"):
        cp.score_dataset(tiny_gemma, dataset, progress=False)


def test_unknown_conflict_type(tiny_gemma):
    dataset = cp.ConflictDataset([_example()])
    with pytest.raises(ValueError, match="'coherent'.*not in dataset"):
        cp.score_dataset(tiny_gemma, dataset, conflict_types=["coherent"], progress=False)


# Early stopping: decoding ends once the metric's verdict is settled.


def test_reading_settled_cases():
    assert cp.reading.reading_settled(" Paris.", ["Paris"])  # punctuation ends the word
    assert cp.reading.reading_settled(" Paris is", ["Paris"])
    assert not cp.reading.reading_settled(" Paris", ["Paris"])  # may still become "Parisian"
    assert not cp.reading.reading_settled(" the city of", ["Paris"])
    assert cp.reading.reading_settled(" a b c d e f", ["Paris"])  # five settled words, no answer: decided
    assert not cp.reading.reading_settled(" a b c d e", ["Paris"])
    assert cp.reading.reading_settled(" a b", ["Paris"], n_words=1)
    assert not cp.reading.reading_settled("", ["Paris"])


def test_rows_that_finish_early_equal_the_full_decoding_cut_short(tiny, dataset):
    """Finished rows leave the batch (key-value cache sliced); the rest decode as before, and
    each row's ids are the full decoding's first ids, however the batch is made up."""
    token_lists = tokenize_prompts(tiny, _prompts(dataset)[:9])
    full = {}
    for idx, _, ids in iter_greedy(tiny, token_lists, max_new_tokens=6, batch_size=9, progress=False):
        full.update(zip(idx, ids))
    stops = {k: 1 + k % 4 for k in range(len(token_lists))}  # rows stop after 1 to 4 tokens
    for batch_size in (9, 4, 1):
        cut = {}
        for idx, _, ids in iter_greedy(
            tiny,
            token_lists,
            max_new_tokens=6,
            batch_size=batch_size,
            progress=False,
            finished=lambda k, ids: len(ids) >= stops[k],
        ):
            cut.update(zip(idx, ids))
        assert {k: full[k][: stops[k]] for k in full} == cut


@pytest.mark.parametrize("n_words", [1, 5])
def test_known_facts_stopping_early_equals_reading_full_continuations(tiny, dataset, n_words):
    texts = cp.scoring.greedy_continuations(tiny, dataset.prompts("clean"), max_new_tokens=8, progress=False)
    expected = [cp.reading.mentions_answer(t, e.answers, n_words) for t, e in zip(texts, dataset)]
    assert cp.scoring.known_facts(tiny, dataset, n_words=n_words, progress=False) == expected
