"""Bad data files fail with a message naming the file, the row and the field (issue 20).

Each test writes a tiny fixture reproducing one reported failure; before the fix these raised
raw library errors (pandas EmptyDataError, KeyError, "'int' object is not iterable") or loaded
the string 'nan' as a prompt."""

import csv
import json

import pandas as pd
import pytest

import cpsuper as cp
from cpsuper.data.files import DataFileError


def _write_csv(path, header, rows):
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


MEMOTRAP_HEADER = ["prompt", "classes", "answer_index"]
NQ_HEADER = ["question", "sub_context", "sub_answer", "org_answer"]
GOOD_MEMOTRAP_ROW = ['End the saying with the word "early": Better late than', "[' early', ' never']", 0]


# --- empty files ------------------------------------------------------------------------------


def test_empty_memotrap_csv_is_named(tmp_path):
    path = tmp_path / "memotrap.csv"
    path.write_text("")
    with pytest.raises(
        DataFileError, match=r"memotrap\.csv: the file is empty; expected a header row \(prompt,classes,answer_index\)"
    ):
        cp.load_memotrap(path)


def test_empty_nqswap_csv_is_named(tmp_path):
    path = tmp_path / "nq.csv"
    path.write_text("\n")
    with pytest.raises(DataFileError, match=r"nq\.csv: the file is empty"):
        cp.load_nqswap(path)


def test_header_only_csv_has_no_rows(tmp_path):
    path = _write_csv(tmp_path / "memotrap.csv", MEMOTRAP_HEADER, [])
    with pytest.raises(DataFileError, match="header but no rows"):
        cp.load_memotrap(path)


def test_empty_paraconflict_file_is_named(tmp_path):
    path = tmp_path / "world_capital.json"
    path.write_text("  ")
    with pytest.raises(DataFileError, match=r"world_capital\.json: the file is empty"):
        cp.load_paraconflict(path)
    path.write_text("[]")
    with pytest.raises(DataFileError, match="no records"):
        cp.load_paraconflict(path)


def test_truncated_json_is_named_with_its_line(tmp_path):
    path = tmp_path / "nq.jsonl"
    path.write_text(
        '{"question": "q", "sub_context": "c", "sub_answer": "a", "org_answer": "b"}\n{"question": "q2", "sub'
    )
    with pytest.raises(DataFileError, match=r"nq\.jsonl: neither JSON .* line 2"):
        cp.load_nqswap(path)


# --- missing and unreadable paths ------------------------------------------------------------


def test_missing_and_folder_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"MemoTrap file .*nothing\.csv does not exist"):
        cp.load_memotrap(tmp_path / "nothing.csv")
    with pytest.raises(FileNotFoundError, match="NQ-Swap file"):
        cp.load_nqswap(tmp_path / "nothing.jsonl")
    folder = tmp_path / "data.csv"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        cp.load_memotrap(folder)
    with pytest.raises(ValueError, match=r"suffix '\.txt'"):
        cp.load_nqswap(tmp_path / "rows.txt")


def test_non_utf8_file_is_named(tmp_path):
    path = tmp_path / "memotrap.csv"
    path.write_bytes(b"prompt,classes,answer_index\n\xff\xfe,x,0\n")
    with pytest.raises(DataFileError, match="not UTF-8"):
        cp.load_memotrap(path)


# --- empty cells, never the string 'nan' ----------------------------------------------------


def test_memotrap_empty_prompt_is_rejected_not_nan(tmp_path):
    path = _write_csv(tmp_path / "memotrap.csv", MEMOTRAP_HEADER, [GOOD_MEMOTRAP_ROW, ["", "[' a', ' b']", 0]])
    with pytest.raises(DataFileError, match=r"memotrap\.csv, row 2 \(line 3\), field 'prompt': empty"):
        cp.load_memotrap(path)


def test_nqswap_empty_sub_context_is_rejected_not_nan(tmp_path):
    path = _write_csv(tmp_path / "nq.csv", NQ_HEADER, [["who wrote hamlet", "", "Jane Austen", "Shakespeare"]])
    with pytest.raises(DataFileError, match=r"nq\.csv, row 1 \(line 2\), field 'sub_context': empty"):
        cp.load_nqswap(path)


def test_nqswap_dataframe_nan_is_rejected():
    frame = pd.DataFrame([{"question": "q", "sub_context": float("nan"), "sub_answer": "a", "org_answer": "b"}])
    with pytest.raises(DataFileError, match=r"NQ-Swap rows, row 1, field 'sub_context': missing"):
        cp.load_nqswap(frame)


def test_short_csv_row_is_named(tmp_path):
    path = _write_csv(tmp_path / "memotrap.csv", MEMOTRAP_HEADER, [GOOD_MEMOTRAP_ROW, ["Better late than"]])
    with pytest.raises(DataFileError, match=r"row 2 \(line 3\): 1 cells for 3 columns"):
        cp.load_memotrap(path)


# --- wrong types ----------------------------------------------------------------------------


def test_nqswap_integer_org_answer_is_named(tmp_path):
    rows = [
        {
            "question": "who wrote hamlet",
            "sub_context": "By Jane Austen.",
            "sub_answer": ["Jane Austen"],
            "org_answer": ["Shakespeare"],
        },
        {"question": "when did it end", "sub_context": "It ended in 1920.", "sub_answer": "1920", "org_answer": 1918},
    ]
    path = tmp_path / "nq.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(
        DataFileError,
        match=r"nq\.json, row 2, field 'org_answer': expected a string or a list of "
        r"strings, got int 1918",
    ):
        cp.load_nqswap(path)
    rows[1]["org_answer"] = ["1918", 1918]
    with pytest.raises(DataFileError, match=r"row 2, field 'org_answer': expected strings, got int"):
        cp.load_nqswap(rows)


def test_nqswap_non_text_question_and_non_dict_row():
    with pytest.raises(DataFileError, match=r"row 1, field 'question': expected text, got int"):
        cp.load_nqswap([{"question": 7, "sub_context": "c", "sub_answer": "a", "org_answer": "b"}])
    with pytest.raises(DataFileError, match=r"row 1: a str where a dict"):
        cp.load_nqswap(["question,sub_context"])
    with pytest.raises(TypeError, match="iterable of dicts"):
        cp.load_nqswap({"question": "q"})


def test_paraconflict_non_text_field_and_bad_answer(tmp_path):
    record = {
        "Subject": "France",
        "Answer": "Paris",
        "Distracted Token": "Beijing",
        "Clean Prompt": "C",
        "Substitution Conflict": "S",
        "Coherent Conflict": "K",
    }
    path = tmp_path / "rel.json"
    path.write_text(json.dumps([record, {**record, "Clean Prompt": None}]))
    with pytest.raises(DataFileError, match=r"rel\.json, row 2, field 'Clean Prompt': missing"):
        cp.load_paraconflict(path)
    path.write_text(json.dumps([{**record, "Answer": []}]))
    with pytest.raises(DataFileError, match=r"row 1, field 'Answer': empty"):
        cp.load_paraconflict(path)
    path.write_text(json.dumps([record, [1, 2]]))
    with pytest.raises(DataFileError, match=r"row 2: a list where a JSON object"):
        cp.load_paraconflict(path)


def test_nqswap_csv_with_list_cells_loads(tmp_path):
    path = _write_csv(
        tmp_path / "nq.csv",
        NQ_HEADER,
        [["who wrote hamlet", "By Jane Austen.", "['Jane Austen']", "['William Shakespeare', 'Shakespeare']"]],
    )
    example = cp.load_nqswap(path)[0]
    assert example.answer == "William Shakespeare" and example.aliases == ("Shakespeare",)
    assert example.context_answer == "Jane Austen"
    assert example.prompts["substitution"] == "Context: By Jane Austen.\nQuestion: who wrote hamlet?\nAnswer:"


# --- MemoTrap classes and answer_index ----------------------------------------------------------


def test_memotrap_answer_index_out_of_range(tmp_path):
    path = _write_csv(
        tmp_path / "memotrap.csv", MEMOTRAP_HEADER, [GOOD_MEMOTRAP_ROW, [GOOD_MEMOTRAP_ROW[0], GOOD_MEMOTRAP_ROW[1], 2]]
    )
    with pytest.raises(DataFileError, match=r"row 2 \(line 3\), field 'answer_index': 2 is out of range"):
        cp.load_memotrap(path)
    path = _write_csv(
        tmp_path / "memotrap.csv", MEMOTRAP_HEADER, [[GOOD_MEMOTRAP_ROW[0], GOOD_MEMOTRAP_ROW[1], "first"]]
    )
    with pytest.raises(DataFileError, match=r"field 'answer_index': 'first' is not an integer"):
        cp.load_memotrap(path)


def test_memotrap_bad_classes(tmp_path):
    path = _write_csv(tmp_path / "memotrap.csv", MEMOTRAP_HEADER, [[GOOD_MEMOTRAP_ROW[0], "[' early'", 0]])
    with pytest.raises(DataFileError, match=r"field 'classes': .* is not a valid list"):
        cp.load_memotrap(path)
    path = _write_csv(tmp_path / "memotrap.csv", MEMOTRAP_HEADER, [[GOOD_MEMOTRAP_ROW[0], "[' early']", 0]])
    with pytest.raises(DataFileError, match=r"field 'classes': .* has 1 endings; expected two"):
        cp.load_memotrap(path)


# --- Relation.from_files --------------------------------------------------------------------


TEMPLATES = {
    "clean": ["The capital of {subject} is"],
    "coherent": ["{subject}'s capital is {context_answer}."],
    "question": "What is the capital of {subject}?",
    "answer_prefix": "The capital of {subject} is",
}


def _relation_files(tmp_path, templates=TEMPLATES, facts=(("France", "Paris", ""), ("Japan", "Tokyo", ""))):
    facts_csv = _write_csv(tmp_path / "capitals.csv", ["subject", "answer", "aliases"], facts)
    templates_json = tmp_path / "capitals.json"
    templates_json.write_text(json.dumps(templates))
    return facts_csv, templates_json


def test_relation_without_question_template_names_the_key(tmp_path):
    templates = {k: v for k, v in TEMPLATES.items() if k != "question"}
    with pytest.raises(DataFileError, match=r"capitals\.json: lacks the keys \['question'\]"):
        cp.Relation.from_files(*_relation_files(tmp_path, templates))


def test_relation_files_are_validated(tmp_path):
    relation = cp.Relation.from_files(*_relation_files(tmp_path))
    assert relation.subjects == ["France", "Japan"] and relation.question == TEMPLATES["question"]
    with pytest.raises(DataFileError, match=r"field 'clean': expected a non-empty list of strings, got 'The"):
        cp.Relation.from_files(*_relation_files(tmp_path, {**TEMPLATES, "clean": "The capital of {subject} is"}))
    with pytest.raises(DataFileError, match=r"field 'question': expected a string, got \['"):
        cp.Relation.from_files(*_relation_files(tmp_path, {**TEMPLATES, "question": ["What?"]}))
    with pytest.raises(DataFileError, match=r"capitals\.csv, row 2 \(line 3\), field 'answer': empty"):
        cp.Relation.from_files(*_relation_files(tmp_path, facts=[("France", "Paris", ""), ("Japan", " ", "")]))
    facts_csv, templates_json = _relation_files(tmp_path)
    templates_json.write_text('{"clean": [')
    with pytest.raises(DataFileError, match=r"capitals\.json: not valid JSON"):
        cp.Relation.from_files(facts_csv, templates_json)
    with pytest.raises(FileNotFoundError, match="templates file"):
        cp.Relation.from_files(facts_csv, tmp_path / "missing.json")


def test_row_of_empty_cells_is_rejected_and_bom_header_is_read(tmp_path):
    path = tmp_path / "memotrap.csv"
    path.write_text("\ufeffprompt,classes,answer_index\n,,\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=r"row 1 \(line 2\), field 'prompt': empty"):
        cp.load_memotrap(path)


def test_paraconflict_category_gives_one_relation_each(tmp_path):
    def record(subject, category):
        return {
            "Subject": subject,
            "Answer": "A",
            "Distracted Token": "B",
            "Clean Prompt": f"{subject} is",
            "Substitution Conflict": "S",
            "Coherent Conflict": "K",
            "Category": category,
        }

    path = tmp_path / "paraconflict.json"
    rows = [record("France", "country capital"), record("Dune", "book author"), record("Japan", "country capital")]
    path.write_text(json.dumps(rows))
    dataset = cp.load_paraconflict(path)
    assert dataset.relations == ("country capital", "book author") and dataset.name == "paraconflict"
    assert [e.relation for e in dataset] == ["country capital", "book author", "country capital"]
    by_relation = {r: [e.subject for e in dataset if e.relation == r] for r in dataset.relations}
    assert by_relation == {"country capital": ["France", "Japan"], "book author": ["Dune"]}
    forced = cp.load_paraconflict(path, relation="mixed")  # an explicit relation still wins
    assert forced.relations == ("mixed",) and forced.name == "mixed"
    path.write_text(json.dumps([rows[0], {**rows[1], "Category": "  "}]))
    with pytest.raises(DataFileError, match=r"row 2, field 'Category': empty"):
        cp.load_paraconflict(path)
    path.write_text(json.dumps([rows[0], {k: v for k, v in rows[1].items() if k != "Category"}]))
    with pytest.raises(DataFileError, match=r"row 2, field 'Category': missing"):
        cp.load_paraconflict(path)
