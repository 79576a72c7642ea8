"""The shipped context-direction tasks: every file loads, meets its size, and every item is well formed."""

import ast
import csv
import re

import pytest

import cpsuper as cp
from cpsuper.data.context_tasks_loader import (
    CONTEXT_TASK_KINDS,
    CONTEXT_TASKS_DIR,
    MEMOTRAP_KINDS,
    load_context_tasks,
)
from cpsuper.reading import normalize_answer
from cpsuper.runtime import answer_token

MINIMUM = {
    "proverb_ending": 100,
    "proverb_translation": 60,
    "hate_speech_ending": 60,
    "history_of_science_qa": 60,
    "nq_swap": 60,
}


def _rows(kind: str) -> list[dict]:
    with (CONTEXT_TASKS_DIR / f"{kind}.csv").open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tasks():
    return {kind: load_context_tasks(kind) for kind in CONTEXT_TASK_KINDS}


def test_kinds_and_files_match():
    assert set(MINIMUM) == set(CONTEXT_TASK_KINDS)
    assert {p.stem for p in CONTEXT_TASKS_DIR.glob("*.csv")} == set(CONTEXT_TASK_KINDS)


@pytest.mark.parametrize("kind", CONTEXT_TASK_KINDS)
def test_each_file_loads_through_the_existing_loaders(kind):
    path = CONTEXT_TASKS_DIR / f"{kind}.csv"
    direct = cp.load_nqswap(path) if kind == "nq_swap" else cp.load_memotrap(path, relation=kind)
    shipped = load_context_tasks(kind)
    assert len(direct) == len(shipped) == len(_rows(kind)) >= MINIMUM[kind]
    assert [e.prompts for e in direct] == [e.prompts for e in shipped]
    assert shipped.conflict_types == ("clean", "substitution")  # every prompt splits into instruction and text
    assert shipped.relations == (kind,)


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown context task 'memotrap'.*proverb_ending"):
        load_context_tasks("memotrap")


@pytest.mark.parametrize("kind", MEMOTRAP_KINDS)
def test_memotrap_rows_are_well_formed(kind):
    rows = _rows(kind)
    indices = []
    for row in rows:
        classes = ast.literal_eval(row["classes"])
        index = int(row["answer_index"])
        indices.append(index)
        assert len(classes) == 2 and index in (0, 1), row
        instructed, memorised = classes[index], classes[1 - index]
        assert normalize_answer(instructed) != normalize_answer(memorised), row
        assert instructed.startswith(" ") and memorised.startswith(" "), row  # endings continue the text
        instruction = re.split(r"[:\n]", row["prompt"])[0]
        if kind == "history_of_science_qa":  # the story names the substituted person, never the real one
            assert instructed.strip() in instruction and memorised.strip() not in instruction, row
        else:  # the instruction quotes the instructed ending
            assert re.findall(r'"([^"]+)"', instruction) == [instructed.strip()], row
    assert set(indices) == {0, 1}  # the instructed ending is not always in the same slot


def test_memotrap_examples_point_at_the_instructed_ending(tasks):
    for kind in MEMOTRAP_KINDS:
        for row, example in zip(_rows(kind), tasks[kind]):
            classes = ast.literal_eval(row["classes"])
            index = int(row["answer_index"])
            assert example.context_answer == classes[index].strip()
            assert example.answer == classes[1 - index].strip()
            assert example.prompts["substitution"].endswith(example.prompts["clean"])
            assert not example.prompts["clean"].endswith(" ")


def test_history_story_names_the_substituted_person(tasks):
    for example in tasks["history_of_science_qa"]:
        story, question = example.prompts["substitution"].split("\n")
        assert story.startswith(f"In this story, it was {example.context_answer} who ")
        assert example.answer not in story
        assert question == example.prompts["clean"] and question.startswith("Who ")


def test_nqswap_rows_are_well_formed(tasks):
    for example in tasks["nq_swap"]:
        original = {normalize_answer(a) for a in example.answers}
        substituted = {normalize_answer(a) for a in example.context_answers}
        assert not original & substituted, example.subject
        passage = " " + normalize_answer(example.prompts["substitution"].split("\nQuestion:")[0]) + " "
        assert f" {normalize_answer(example.context_answer)} " in passage, example.subject
        assert not any(f" {a} " in passage for a in original), example.subject
        # first words differ, so the first generated word tells the two answers apart
        assert example.context_answer.split()[0].lower() != example.answer.split()[0].lower()


def test_no_duplicates_within_or_between_files_or_with_sayings(tasks):
    seen: dict[str, str] = {normalize_answer(e.prompts["clean"]): "sayings" for e in cp.data.load_sayings()}
    for kind, dataset in tasks.items():
        full = [e.prompts["substitution"] for e in dataset]
        assert len(set(full)) == len(full), kind
        for example in dataset:
            key = normalize_answer(example.prompts["clean"])
            assert key not in seen, f"{example.prompts['clean']!r} in {kind} repeats an item of {seen.get(key)}"
            seen[key] = kind


@pytest.mark.slow
def test_first_tokens_differ_on_the_embedded_model(gemma, tasks):
    for dataset in tasks.values():
        for example in dataset:
            for prompt in example.prompts.values():
                context = answer_token(gemma, example.context_answer, prompt)
                assert all(answer_token(gemma, a, prompt) != context for a in example.answers), example.subject
