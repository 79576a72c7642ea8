"""What the finetuning data holds (scripts/finetune_inversion_data.py): the no-context pairs and
subject-only pairs of ``context_training_pairs``, ``no_context_check`` against a forward pass by
hand on a tiny model, and the script's classification, shares and peak/fall changes on small
inputs computed by hand."""

import copy
import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.finetune import context_training_pairs, no_context_check
from cpsuper.runtime import answer_token


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("plotly")
    path = Path(__file__).parents[1] / "scripts" / "finetune_inversion_data.py"
    spec = importlib.util.spec_from_file_location("finetune_inversion_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data():
    return cp.conflict_dataset("world_capital", n=12, seed=0)


def test_no_context_pairs_are_the_training_pairs_without_their_context(data):
    options = {"counterfactual_share": 0.25, "conflict_types": ["substitution"], "seed": 3}
    pairs = context_training_pairs(data, **options)
    bare = context_training_pairs(data, **options, no_context=True)
    assert len(pairs) == len(bare) == 12
    cleans = {e.prompts["clean"]: e for e in data}
    for (prompt, answer), (clean, same) in zip(pairs, bare):
        example = cleans[clean]  # every no-context prompt is a clean prompt, in the same order
        assert same == answer and prompt.endswith(clean) and prompt != clean
        assert answer in (example.answer, example.context_answer)
    assert sum(a == cleans[c].context_answer for c, a in bare) == 3  # round(0.25 * 12) counterfactual


def test_subject_only_pairs_are_added_and_leave_the_context_pairs_as_they_were(data):
    options = {"counterfactual_share": 0.5, "conflict_types": ["substitution", "coherent"], "seed": 1}
    plain = context_training_pairs(data, **options)
    assert context_training_pairs(data, **options, subject_only_share=0.0) == plain  # same order too
    mixed = context_training_pairs(data, **options, subject_only_share=0.25)
    cleans = {e.prompts["clean"]: e for e in data}
    subject_only = [(p, a) for p, a in mixed if p in cleans]
    assert len(subject_only) == 3 and len(mixed) == len(plain) + 3
    assert all(a == cleans[p].answer for p, a in subject_only)  # the true answer, no context
    assert sorted(p for p in mixed if p[0] not in cleans) == sorted(plain)
    everyone = context_training_pairs(data, **options, subject_only_share=1.0)
    assert sorted(p for p, _ in everyone if p in cleans) == sorted(cleans)
    with pytest.raises(ValueError, match="subject_only_share"):
        context_training_pairs(data, subject_only_share=-0.1)
    bare = data.with_prompts(["substitution"])
    with pytest.raises(ValueError, match="clean prompt"):
        context_training_pairs(bare, conflict_types=["substitution"], no_context=True)


def test_no_context_check_matches_a_forward_pass_by_hand(tiny_gemma):
    model = tiny_gemma
    data = cp.conflict_dataset("world_capital", n=6, seed=0, tokenizer=model)
    pairs = [(e.prompts[c], a) for e in data for c in ("clean", "substitution") for a in (e.answer, e.context_answer)]
    # a copy whose unembedding bias makes one capital's first token the top token everywhere, so
    # that both outcomes of the check occur
    model = copy.deepcopy(model)
    favoured = data[0].answer
    with torch.no_grad():
        model.unembed.b_U[answer_token(model, favoured, data[0].prompts["clean"])] += 1e3
    pairs += [(e.prompts["clean"], favoured) for e in data]
    losses, top1 = no_context_check(model, pairs, batch_size=4)
    assert len(losses) == len(pairs) and top1.any() and not top1.all()
    for (prompt, answer), loss, first in zip(pairs, losses, top1):
        with torch.no_grad():
            logits = model(model.to_tokens(prompt))[0, -1].float()
        target = answer_token(model, answer, prompt)
        assert float(loss) == pytest.approx(float(-logits.log_softmax(-1)[target]), abs=1e-4)
        assert bool(first) == (int(logits.argmax()) == target)


def test_classification_and_the_loss_filter_by_hand(script, data):
    examples = {e.prompts["clean"]: e for e in data}
    chosen = list(data)[:4]
    pairs = [
        ("ctx0 " + chosen[0].prompts["clean"], chosen[0].answer),
        ("ctx1 " + chosen[1].prompts["clean"], chosen[1].context_answer),
        ("ctx2 " + chosen[2].prompts["clean"], chosen[2].answer),
        ("ctx3 " + chosen[3].prompts["clean"], chosen[3].context_answer),
    ]
    bare = [(e.prompts["clean"], a) for e, (_, a) in zip(chosen, pairs)]
    losses = torch.tensor([0.5, 9.0, 3.0, 0.1])
    top1 = torch.tensor([True, False, False, True])
    frame = script.classify(pairs, bare, examples, losses, top1, drop_share=0.25)
    assert frame.critical.tolist() == [False, True, True, False]
    assert frame.counterfactual.tolist() == [False, True, False, True]
    assert frame.kept_by_loss.tolist() == [True, True, True, False]  # the lowest quarter of losses goes
    table = script.shares(frame).set_index(["relation", "quantity"])["mean"]
    assert table["all", "critical"] == pytest.approx(0.5)
    assert table["world_capital", "kept_by_loss"] == pytest.approx(0.75)
    args = type("Args", (), {})()
    kept = script.run_pairs("context-critical", pairs, frame.critical.tolist(), data, args)
    assert kept == [pairs[1], pairs[2]]


def test_peak_fall_by_hand(script):
    rows = []
    values = {  # fact -> (step 0, step 40, step 80) per run
        "mlp": {"a": (0.0, 10.0, 4.0), "b": (1.0, 9.0, 7.0)},
        "context-critical": {"a": (0.0, 8.0, 8.0), "b": (1.0, 5.0, 6.0)},
    }
    for run, facts in values.items():
        for fact, series in facts.items():
            for step, value in zip((0, 40, 80), series):
                rows.append({"run": run, "fact": fact, "step": step, "value": value})
    per = pd.DataFrame(rows).assign(conflict_type="substitution", quantity="context_margin")
    out = script.peak_fall(per).set_index(["run", "change"])["mean"]
    assert out["mlp", "rise"] == pytest.approx((10 + 8) / 2)
    assert out["mlp", "fall"] == pytest.approx((-6 - 2) / 2)
    assert out["context-critical", "fall"] == pytest.approx((0 + 1) / 2)
    assert out["context-critical minus mlp", "fall"] == pytest.approx(((0 + 6) + (1 + 2)) / 2)


def test_nq_split_is_seeded_disjoint_and_complete(script):
    train, held = script.nq_split(69, seed=0)
    assert len(train) == 46 and len(held) == 23  # two thirds trained on
    assert not set(train) & set(held) and sorted(train + held) == list(range(69))
    assert script.nq_split(69, seed=0) == (train, held)  # the same split every time
    assert script.nq_split(69, seed=1) != (train, held)
    small_train, small_held = script.nq_split(6, seed=3, train_share=0.5)
    assert len(small_train) == len(small_held) == 3 and not set(small_train) & set(small_held)


def test_true_context_states_the_true_answer(script, data):
    reading = script.true_context(data)
    assert len(reading) == len(data)
    for example, original in zip(reading, data):
        prompt = example.prompts["substitution"]
        assert example.context_answer == example.answer == original.answer
        assert original.answer in prompt and original.context_answer not in prompt
        assert prompt.endswith(original.prompts["clean"])
        assert example.expected_answers("context", "substitution")[0] == original.answer


def _example(relation, subject, prompt, answer, context_answer):
    return cp.ConflictExample(relation, subject, answer, context_answer, {"substitution": prompt})


def test_task_scores_against_a_forward_pass_by_hand(script, tiny_gemma):
    # a copy whose unembedding bias makes " city" the top token everywhere: greedy text is
    # " city city ...", so items whose context answer is city are correct and the others are not
    model = copy.deepcopy(tiny_gemma)
    city = answer_token(model, "city", "The place is a")
    with torch.no_grad():
        model.unembed.b_U[city] += 1e3
    sayings = cp.ConflictDataset(
        [
            _example("sayings", "s0", 'End the saying with the word "city": Barking up the wrong', "tree", "city"),
            _example("sayings", "s1", 'End the saying with the word "king": Let sleeping dogs', "lie", "king"),
        ],
        "sayings",
    )
    nq = cp.ConflictDataset(
        [
            _example(
                "nq_swap", "q0", "Context: The pet is a city.\nQuestion: what is the pet?\nAnswer:", "king", "city"
            ),
            _example(
                "nq_swap", "q1", "Context: The pet is a king.\nQuestion: what is the pet?\nAnswer:", "city", "king"
            ),
        ],
        "nq",
    )
    reading = cp.ConflictDataset(
        [_example("r", "r0", "The place is a city. The place is a", "city", "city")], "reading"
    )
    frame = script.task_scores(model, {"sayings": sayings, "nq_swap_held_out": nq, "reading": reading})
    got = frame.set_index(["item", "quantity"]).value
    assert got["sayings:0", "correct"] == 1.0 and got["sayings:1", "correct"] == 0.0
    assert got["nq_swap_held_out:0", "correct"] == 1.0 and got["nq_swap_held_out:1", "correct"] == 0.0
    assert got["reading:0", "correct"] == 1.0
    assert ("reading:0", "context_wins") not in got.index  # one answer: nothing to compare
    plain = tiny_gemma  # the unbiased model: context_wins against the last position's logits by hand
    frame = script.task_scores(plain, {"sayings": sayings, "nq_swap_held_out": nq})
    got = frame.set_index(["item", "quantity"]).value
    for name, dataset in (("sayings", sayings), ("nq_swap_held_out", nq)):
        for i, example in enumerate(dataset):
            prompt = example.prompts["substitution"]
            with torch.no_grad():
                logits = plain(plain.to_tokens(prompt))[0, -1].float()
            context = answer_token(plain, example.context_answer, prompt)
            memory = answer_token(plain, example.answer, prompt)
            assert got[f"{name}:{i}", "context_wins"] == float(logits[context] > logits[memory])


def test_task_paired_by_hand(script):
    rows = []
    values = {  # item -> (reference at 0, at 40; augmented at 0, at 40)
        "a": (0.0, 1.0, 0.0, 0.0),
        "b": (1.0, 1.0, 1.0, 0.0),
        "c": (0.0, 0.0, 0.0, 1.0),
    }
    for item, (r0, r40, a0, a40) in values.items():
        for run, step, value in (
            ("reference", 0, r0),
            ("reference", 40, r40),
            ("nq-swap-split", 0, a0),
            ("nq-swap-split", 40, a40),
        ):
            rows.append({"task": "t", "quantity": "correct", "item": item, "run": run, "step": step, "value": value})
    out = script.task_paired(pd.DataFrame(rows), 40).set_index("comparison")["mean"]
    assert out["reference"] == pytest.approx(1 / 3)
    assert out["nq-swap-split"] == pytest.approx(0.0)
    assert out["nq-swap-split minus reference"] == pytest.approx((-1 - 1 + 1) / 3)
