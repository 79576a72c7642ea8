import csv
import json
import string

import pytest

import cpsuper as cp
from cpsuper.data.relations import RELATIONS_DIR

MIN_FACTS = {
    "world_capital": 190,
    "official_language": 150,
    "company_headquarter": 200,
    "company_founder": 150,
    "athlete_sport": 300,
    "book_author": 300,
}


def test_builtin_relations_are_all_there():
    assert sorted(cp.list_relations()) == sorted(MIN_FACTS)


@pytest.mark.parametrize("name", sorted(MIN_FACTS))
def test_relation_file_integrity(name):
    with (RELATIONS_DIR / f"{name}.csv").open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= MIN_FACTS[name]
    subjects = [r["subject"].strip() for r in rows]
    assert len(set(subjects)) == len(subjects), "duplicate subjects"
    for row in rows:
        assert row["subject"].strip() and row["answer"].strip(), row
        aliases = [a for a in row["aliases"].split(";") if a]
        assert row["answer"] not in aliases, row

    spec = json.loads((RELATIONS_DIR / f"{name}.json").read_text(encoding="utf-8"))
    assert len(spec["clean"]) >= 5 and len(spec["coherent"]) >= 5  # paraphrase sets
    for paragraph in spec["coherent"]:
        slots = [n for _, n, _, _ in string.Formatter().parse(paragraph) if n]
        assert 3 <= slots.count("context_answer") <= 4, paragraph
        assert "subject" in slots

    relation = cp.load_relation(name)
    assert len(relation) == len(rows)
    # Two wording families besides the base one, written in other registers.
    assert {"dialogue", "longform"} <= set(relation.family_names)
    for family, wording in spec["families"].items():
        assert len(wording["clean"]) >= 5 and len(wording["coherent"]) >= 5, family
        base = set(spec["clean"]) | set(spec["coherent"])
        assert not base & (set(wording["clean"]) | set(wording["coherent"])), f"{family} repeats base templates"
        for paragraph in wording["coherent"]:
            slots = [n for _, n, _, _ in string.Formatter().parse(paragraph) if n]
            assert 3 <= slots.count("context_answer") <= 4 and "subject" in slots, (family, paragraph)
        for template in wording["clean"]:
            assert template == template.rstrip(), (family, template)  # the answer follows the prompt
    long = [len(p.split()) for p in spec["families"]["longform"]["coherent"]]
    assert min(long) >= 70 and max(long) <= 160, long


def test_paper_template_is_available():
    assert "The name of the capital city of {subject} is" in cp.load_relation("world_capital").clean


def test_prompts_follow_the_paper_layout():
    relation = cp.load_relation("world_capital")
    prompts = relation.prompts("France", "Beijing", paraphrase=0)
    clean = relation.clean[0].format(subject="France")
    assert prompts["clean"] == clean
    assert prompts["substitution"] == f"{clean} Beijing. {clean}"
    assert prompts["coherent"].count("Beijing") in (3, 4)
    assert prompts["coherent"].endswith(
        "Question: What is the capital city of France? Answer: The capital city of France is"
    )


def test_dataset_is_deterministic_for_a_seed(tiny_gemma):
    a = cp.conflict_dataset("book_author", n=40, seed=3, tokenizer=tiny_gemma)
    b = cp.conflict_dataset("book_author", n=40, seed=3, tokenizer=tiny_gemma)
    c = cp.conflict_dataset("book_author", n=40, seed=4, tokenizer=tiny_gemma)
    assert [e.prompts for e in a] == [e.prompts for e in b]
    assert [(e.subject, e.context_answer) for e in a] != [(e.subject, e.context_answer) for e in c]


def test_distractor_depends_on_subject_not_on_sample():
    relation = cp.load_relation("world_capital")
    whole = {e.subject: e.context_answer for e in relation.dataset(seed=1)}
    part = relation.dataset(seed=1, subjects=["France", "Japan"])
    assert [e.context_answer for e in part] == [whole["France"], whole["Japan"]]


@pytest.mark.parametrize("name", sorted(MIN_FACTS))
def test_distractors_never_share_a_first_token_with_the_answer(name, tiny_gemma):
    tok = tiny_gemma.tokenizer
    for example in cp.conflict_dataset(name, tokenizer=tiny_gemma):
        first = tok.encode(" " + example.context_answer, add_special_tokens=False)[0]
        for alias in example.answers:
            assert tok.encode(" " + alias, add_special_tokens=False)[0] != first, example
        assert example.context_answer not in example.answers


def test_custom_relation_in_a_few_lines(tiny_gemma):
    relation = cp.Relation(
        name="river_country",
        facts=[("the Nile", "Egypt"), ("the Danube", "Austria", ["Hungary"]), ("the Amazon", "Brazil")],
        clean=["The river {subject} flows through"],
        coherent=[
            "Maps show that {subject} flows through {context_answer}. In {context_answer} it is "
            "famous, and {context_answer} depends on it."
        ],
        question="Which country does {subject} flow through?",
        answer_prefix="{subject} flows through",
    )
    dataset = relation.dataset(tokenizer=tiny_gemma)
    assert len(dataset) == 3 and dataset.conflict_types == cp.CONFLICT_TYPES
    assert dataset[1].aliases == ("Hungary",)
    assert dataset[1].context_answer not in ("Austria", "Hungary")


def test_template_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"no \{subject\} slot"):
        cp.Relation(
            "r",
            [("a", "b"), ("c", "d")],
            clean=["The capital is"],
            coherent=["{subject} {context_answer}"],
            question="{subject}?",
            answer_prefix="{subject} is",
        )
    with pytest.raises(ValueError, match=r"no \{context_answer\} slot"):
        cp.Relation(
            "r",
            [("a", "b"), ("c", "d")],
            clean=["{subject} is"],
            coherent=["About {subject}."],
            question="{subject}?",
            answer_prefix="{subject} is",
        )
    with pytest.raises(ValueError, match="twice"):
        cp.Relation(
            "r",
            [("a", "b"), ("a", "d")],
            clean=["{subject} is"],
            coherent=["{subject} {context_answer}"],
            question="{subject}?",
            answer_prefix="{subject} is",
        )


def test_unknown_relation_lists_the_choices():
    with pytest.raises(ValueError, match="Unknown relation 'capitals'.*world_capital"):
        cp.load_relation("capitals")


def test_empty_dataset_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        cp.ConflictDataset([], name="nothing")
    dataset = cp.conflict_dataset("world_capital", n=5)
    with pytest.raises(ValueError, match="empty"):
        dataset.filter(lambda e: False)


def _two_family_relation(**changes):
    fields = dict(
        name="tiny",
        facts=[("France", "Paris"), ("Peru", "Lima"), ("Japan", "Tokyo")],
        clean=["The capital of {subject} is", "Capital of {subject}:"],
        coherent=["{subject}'s capital is {context_answer}.", "Yes, {context_answer} rules {subject}."],
        question="What is the capital of {subject}?",
        answer_prefix="The capital of {subject} is",
        families={
            "chat": cp.data.Wording(
                clean=["Q: capital of {subject}?\nA:", "Quiz: {subject}'s capital?\nAnswer:"],
                coherent=["A: It's {context_answer}, {subject}'s seat.", "B: {context_answer}! In {subject}."],
                question="Capital of {subject}?",
                answer_prefix="It is",
                closing="\nQ: {question}\nA: {answer_prefix}",
            )
        },
    )
    return cp.Relation(**{**fields, **changes})


def test_wording_families_build_their_own_prompts():
    relation = _two_family_relation()
    assert relation.family_names == ("base", "chat")
    chat = relation.dataset(family="chat", paraphrase=1)
    france = chat[0]
    assert france.prompts["clean"] == "Quiz: France's capital?\nAnswer:"
    assert france.prompts["substitution"] == f"Quiz: France's capital?\nAnswer: {france.context_answer}. " + (
        "Quiz: France's capital?\nAnswer:"
    )
    assert france.prompts["coherent"] == f"B: {france.context_answer}! In France.\nQ: Capital of France?\nA: It is"
    assert france.meta["family"] == "chat" and france.meta["contexts"]["coherent"].startswith("B: ")
    base = relation.dataset()[0]
    assert base.prompts["coherent"].endswith(
        " Question: What is the capital of France? Answer: The capital of France is"
    )
    # Random templates: drawn per fact, reproducible by seed, and covering the family's templates.
    many = _two_family_relation(facts=[(f"Land{i}", f"City{i}") for i in range(40)])
    drawn = many.dataset(family="chat", paraphrase="random", seed=3)
    assert [e.prompts for e in drawn] == [e.prompts for e in many.dataset(family="chat", paraphrase="random", seed=3)]
    assert {e.meta["paraphrase"] for e in drawn} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert [e.context_answer for e in drawn] == [e.context_answer for e in many.dataset(family="chat", seed=3)]


def test_wording_family_errors_name_the_problem(tmp_path):
    relation = _two_family_relation()
    with pytest.raises(ValueError, match=r"no wording family 'qa'; its families are \['base', 'chat'\]"):
        relation.dataset(family="qa")
    with pytest.raises(ValueError, match="paraphrase must be a template index or 'random'"):
        relation.dataset(paraphrase="any")
    bad = cp.data.Wording(["{subject} is"], ["{subject}: {context_answer}"], "Q {subject}?", "A", closing="{question}")
    with pytest.raises(ValueError, match=r"tiny \(odd family\): closing template .* has no \{answer_prefix\} slot"):
        _two_family_relation(families={"odd": bad})
    (tmp_path / "r.csv").write_text("subject,answer,aliases\nFrance,Paris,\n")
    spec = {"clean": ["{subject} is"], "coherent": ["{subject} {context_answer}"], "question": "{subject}?"}
    spec |= {"answer_prefix": "{subject} is", "families": {"qa": {"clean": ["{subject}"]}}}
    (tmp_path / "r.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"lacks the keys \['families.qa.coherent'"):
        cp.Relation.from_files(tmp_path / "r.csv", tmp_path / "r.json")


def test_split_is_reproducible_and_disjoint():
    dataset = cp.conflict_dataset("world_capital")
    a, b = cp.split(dataset, seed=0), cp.split(dataset, seed=0)
    assert [e.subject for e in a.test] == [e.subject for e in b.test]
    parts = [{e.subject for e in part} for part in a]
    assert len(parts[0]) == 8
    assert len(parts[1]) == round(0.25 * (len(dataset) - 8))
    assert sum(map(len, parts)) == len(dataset) == len(set.union(*parts))
    assert [e.subject for e in cp.split(dataset, seed=1).select] != [e.subject for e in a.select]
    with pytest.raises(ValueError, match="too few"):
        cp.split(dataset[:4])


# --- loaders --------------------------------------------------------------------------------


def test_load_paraconflict(tmp_path):
    records = [
        {
            "Subject": "France",
            "Answer": ["Paris", "Paris, France"],
            "Answer_ns": "Paris",
            "Distracted Token": "Beijing",
            "Clean Prompt": "The capital of France is",
            "Substitution Conflict": "The capital of France is Beijing. The capital of France is",
            "Coherent Conflict": "Beijing is the capital of France. Answer: The capital of France is",
        },
        {
            "Subject": "Japan",
            "Answer": "Tokyo",
            "Distracted Token": "Lima",
            "Clean Prompt": "The capital of Japan is ",
            "Substitution Conflict": "The capital of Japan is Lima. The capital of Japan is",
            "Coherent Conflict": "Lima is the capital of Japan. Answer: The capital of Japan is",
        },
    ]
    path = tmp_path / "world_capital.json"
    path.write_text(json.dumps(records))
    dataset = cp.load_paraconflict(path)
    assert dataset.name == "world_capital" and len(dataset) == 2
    assert dataset[0].answer == "Paris" and dataset[0].aliases == ("Paris, France",)
    assert dataset[1].prompts["clean"] == "The capital of Japan is"
    assert dataset[1].context_answer == "Lima"

    del records[0]["Distracted Token"]
    path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match="Distracted Token"):
        cp.load_paraconflict(path)


def test_load_memotrap(tmp_path):
    path = tmp_path / "memotrap.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "classes", "answer_index"])
        writer.writerow(['Write a quote that ends in the word "early": Better late than', "[' early', ' never']", 0])
        writer.writerow(["Complete with an unusual word: Actions speak louder than", "[' words', ' music']", 1])
    dataset = cp.load_memotrap(path)
    first = dataset[0]
    assert (first.context_answer, first.answer) == ("early", "never")
    assert first.prompts["clean"] == "Better late than"
    assert first.prompts["substitution"].startswith("Write a quote")
    assert (dataset[1].context_answer, dataset[1].answer) == ("music", "words")


def test_shipped_sayings():
    sayings = cp.data.load_sayings()
    assert len(sayings) == 100 and sayings.name == "sayings" and sayings.relations == ("sayings",)
    assert sayings.conflict_types == ("clean", "substitution")
    for example in sayings:
        instruction, saying = example.prompts["substitution"].split(": ", 1)
        assert saying == example.prompts["clean"] == example.subject
        assert instruction == f'End the saying with the word "{example.context_answer}"'
        assert example.answer != example.context_answer and " " not in example.answer
    assert len({e.subject for e in sayings}) == 100


def test_load_nqswap(tmp_path):
    rows = [
        {
            "question": "who wrote hamlet",
            "sub_context": "Hamlet was written by Jane Austen.",
            "sub_answer": ["Jane Austen"],
            "org_answer": ["William Shakespeare", "Shakespeare"],
        },
    ]
    path = tmp_path / "nq.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    dataset = cp.load_nqswap(path)
    example = dataset[0]
    assert example.answer == "William Shakespeare" and example.aliases == ("Shakespeare",)
    assert example.context_answer == "Jane Austen"
    assert example.prompts["clean"] == "Question: who wrote hamlet?\nAnswer:"
    assert example.prompts["substitution"].startswith("Context: Hamlet was written by Jane Austen.")
    with pytest.raises(ValueError, match="sub_answer"):
        cp.load_nqswap([{"question": "q", "sub_context": "c", "org_answer": "a"}])
