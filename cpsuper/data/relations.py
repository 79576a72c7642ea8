"""Fact relations and the conflict prompts built from them.

A :class:`Relation` is a list of facts (subject, answer, aliases) plus templates. From it,
:meth:`Relation.dataset` builds clean / substitution / coherent prompts with a distractor drawn
from the relation's own answer pool. Built-in relations live as ``relations/NAME.csv`` (facts)
and ``relations/NAME.json`` (templates); see ``relations/FORMAT.md``.
"""

from __future__ import annotations

import functools
import json
import random
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .examples import ConflictDataset, ConflictExample
from .files import DataFileError, read_csv_rows, read_text, text_field

__all__ = [
    "Fact",
    "Relation",
    "RELATIONS_DIR",
    "conflict_dataset",
    "list_relations",
    "load_relation",
]

RELATIONS_DIR = Path(__file__).parent / "relations"

SUBSTITUTION_TEMPLATE = "{clean} {context_answer}. {clean}"
"""A sentence-level conflict: the clean prompt completed with the distractor, then asked again."""

COHERENT_SUFFIX = " Question: {question} Answer: {answer_prefix}"


@dataclass(frozen=True)
class Fact:
    subject: str
    answer: str
    aliases: tuple[str, ...] = ()


def _slots(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def _check_template(template: str, required: set[str], allowed: set[str], where: str) -> None:
    try:
        slots = _slots(template)
    except ValueError as err:
        raise ValueError(f"{where} template {template!r} is not a valid format string: {err}") from err
    missing = required - slots
    if missing:
        raise ValueError(
            f"{where} template {template!r} has no {', '.join('{' + m + '}' for m in sorted(missing))} slot; "
            f"add it where the {' and '.join(sorted(missing))} should go."
        )
    unknown = slots - allowed
    if unknown:
        raise ValueError(
            f"{where} template {template!r} has unknown slots {sorted(unknown)}; "
            f"only {sorted(allowed)} are filled in (write literal braces as '{{{{' and '}}}}')."
        )


@dataclass(frozen=True)
class Relation:
    """Facts plus templates for one relation (e.g. country -> capital).

    Args:
        name: identifier used in results.
        facts: the facts; subjects must be unique.
        clean: clean prompt templates with a ``{subject}`` slot whose next word is the answer; the
            first is the default, the others are paraphrases.
        coherent: persuasive paragraphs with ``{subject}`` and ``{context_answer}`` slots; the
            question block ``Question: {question} Answer: {answer_prefix}`` is appended.
        question: the question closing a coherent prompt.
        answer_prefix: the start of the answer to ``question``; the answer follows it.
    """

    name: str
    facts: tuple[Fact, ...]
    clean: tuple[str, ...]
    coherent: tuple[str, ...]
    question: str
    answer_prefix: str
    description: str = ""
    substitution: str = SUBSTITUTION_TEMPLATE
    _by_subject: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "facts", tuple(_as_fact(f) for f in self.facts))
        object.__setattr__(self, "clean", tuple(self.clean))
        object.__setattr__(self, "coherent", tuple(self.coherent))
        if not self.facts:
            raise ValueError(f"Relation {self.name!r} has no facts.")
        if not self.clean or not self.coherent:
            raise ValueError(f"Relation {self.name!r} needs at least one clean and one coherent template.")
        seen: dict[str, Fact] = {}
        for fact in self.facts:
            if fact.subject in seen:
                raise ValueError(f"Relation {self.name!r} lists subject {fact.subject!r} twice; keep one.")
            seen[fact.subject] = fact
        object.__setattr__(self, "_by_subject", seen)
        for t in self.clean:
            _check_template(t, {"subject"}, {"subject"}, f"{self.name}: clean")
        for t in self.coherent:
            _check_template(t, {"subject", "context_answer"}, {"subject", "context_answer"}, f"{self.name}: coherent")
        _check_template(self.question, {"subject"}, {"subject"}, f"{self.name}: question")
        _check_template(self.answer_prefix, {"subject"}, {"subject"}, f"{self.name}: answer_prefix")
        _check_template(
            self.substitution,
            {"clean", "context_answer"},
            {"clean", "context_answer", "subject"},
            f"{self.name}: substitution",
        )

    def __repr__(self) -> str:
        return (
            f"Relation({self.name!r}, {len(self.facts)} facts, {len(self.clean)} clean and "
            f"{len(self.coherent)} coherent templates)"
        )

    def __len__(self) -> int:
        return len(self.facts)

    @property
    def subjects(self) -> list[str]:
        return [f.subject for f in self.facts]

    def fact(self, subject: str) -> Fact:
        try:
            return self._by_subject[subject]
        except KeyError:
            raise KeyError(f"Relation {self.name!r} has no subject {subject!r}.") from None

    # -- prompts -------------------------------------------------------------------------------

    def prompts(self, subject: str, context_answer: str, paraphrase: int = 0) -> dict[str, str]:
        """Clean, substitution and coherent prompts for one subject and distractor.

        ``paraphrase`` picks the clean and coherent template (modulo their number).
        """
        clean = self.clean[paraphrase % len(self.clean)].format(subject=subject)
        substitution = self.substitution.format(clean=clean, context_answer=context_answer, subject=subject)
        paragraph = self.coherent[paraphrase % len(self.coherent)].format(
            subject=subject, context_answer=context_answer
        )
        question = self.question.format(subject=subject)
        prefix = self.answer_prefix.format(subject=subject)
        coherent = paragraph + COHERENT_SUFFIX.format(question=question, answer_prefix=prefix)
        return {"clean": clean, "substitution": substitution, "coherent": coherent}

    def contexts(self, subject: str, context_answer: str, paraphrase: int = 0) -> dict[str, str]:
        """The conflicting text inside each conflict prompt (where the context answer is asserted),
        so analyses can tell context tokens from question tokens."""
        prompts = self.prompts(subject, context_answer, paraphrase)
        clean, substitution = prompts["clean"], prompts["substitution"]
        statement = substitution[: -len(clean)].rstrip() if substitution.endswith(clean) else substitution
        paragraph = self.coherent[paraphrase % len(self.coherent)].format(
            subject=subject, context_answer=context_answer
        )
        return {"substitution": statement, "coherent": paragraph}

    @property
    def n_paraphrases(self) -> int:
        return max(len(self.clean), len(self.coherent))

    def distractor(self, fact: Fact, seed: int = 0, tokenizer=None) -> str:
        """A context answer for ``fact``: another answer of this relation, chosen
        deterministically from ``seed`` and the subject, whose first token differs from the first
        token of every accepted answer (under ``tokenizer``; without one, the first word,
        case-insensitively, stands in for the first token)."""
        first = _first_unit_fn(tokenizer)
        taken = {first(a) for a in (fact.answer, *fact.aliases)}
        banned = {_normalize(a) for a in (fact.answer, *fact.aliases)}
        pool = sorted({f.answer for f in self.facts})
        random.Random(f"{seed}|{self.name}|{fact.subject}").shuffle(pool)
        for candidate in pool:
            if _normalize(candidate) not in banned and first(candidate) not in taken:
                return candidate
        raise ValueError(
            f"No distractor for {fact.subject!r} in relation {self.name!r}: every other answer "
            "shares its first token with the true answer. Add more facts with varied answers."
        )

    def dataset(
        self,
        n: int | None = None,
        seed: int = 0,
        tokenizer=None,
        paraphrase: int = 0,
        subjects: Sequence[str] | None = None,
    ) -> ConflictDataset:
        """Conflict examples for this relation.

        Args:
            n: keep a random sample of ``n`` facts (by ``seed``); default all, in file order.
            seed: seeds the distractor choice and the sample.
            tokenizer: a tokenizer or ``HookedTransformer``; with it, distractors never share a
                first token with the answer under that tokenizer. Pass the model you will study.
            paraphrase: which clean / coherent template to use (0 = default).
            subjects: build only these subjects (in this order).
        """
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        facts = [self.fact(s) for s in subjects] if subjects is not None else list(self.facts)
        if n is not None:
            if n <= 0:
                raise ValueError(f"n must be positive, got {n}.")
            rng = random.Random(f"{seed}|sample|{self.name}")
            facts = sorted(rng.sample(facts, min(n, len(facts))), key=self.facts.index)
        examples = []
        for fact in facts:
            context_answer = self.distractor(fact, seed=seed, tokenizer=tokenizer)
            examples.append(
                ConflictExample(
                    relation=self.name,
                    subject=fact.subject,
                    answer=fact.answer,
                    aliases=fact.aliases,
                    context_answer=context_answer,
                    prompts=self.prompts(fact.subject, context_answer, paraphrase),
                    meta={
                        "paraphrase": paraphrase,
                        "seed": seed,
                        "contexts": self.contexts(fact.subject, context_answer, paraphrase),
                    },
                )
            )
        return ConflictDataset(examples, name=self.name)

    # -- files ---------------------------------------------------------------------------------

    @classmethod
    def from_files(cls, facts_csv: str | Path, templates_json: str | Path, name: str | None = None) -> Relation:
        """Read a relation from a facts CSV (``subject,answer,aliases``) and a templates JSON
        (``clean``, ``coherent``, ``question``, ``answer_prefix``; see ``relations/FORMAT.md``).
        A missing file or key, an empty cell or a template that is not text is an error naming
        the file, the row or key, and the fix."""
        facts_csv, templates_json = Path(facts_csv), Path(templates_json)
        facts = []
        for number, line, row in read_csv_rows(facts_csv, what="facts", required=("subject", "answer")):
            where = {"source": facts_csv, "number": number, "line": line}
            aliases = row.get("aliases") or ""
            facts.append(
                Fact(
                    text_field(row, "subject", **where),
                    text_field(row, "answer", **where),
                    tuple(a.strip() for a in aliases.split(";") if a.strip()),
                )
            )
        spec = _read_templates(templates_json)
        return cls(
            name=name or spec.get("name") or facts_csv.stem,
            facts=tuple(facts),
            clean=spec["clean"],
            coherent=spec["coherent"],
            question=spec["question"],
            answer_prefix=spec["answer_prefix"],
            description=spec.get("description", ""),
            substitution=spec.get("substitution", SUBSTITUTION_TEMPLATE),
        )


_TEMPLATE_KEYS = {"clean": list, "coherent": list, "question": str, "answer_prefix": str}
_OPTIONAL_TEMPLATE_KEYS = ("name", "description", "substitution")


def _read_templates(path: Path) -> dict:
    """The templates JSON as a dict with every required key checked (lists of strings for
    ``clean`` / ``coherent``, strings for the rest)."""
    text = read_text(path, what="templates", expected="a JSON object with " + ", ".join(_TEMPLATE_KEYS))
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataFileError(path, f"not valid JSON ({err}).") from None
    if not isinstance(spec, dict):
        raise DataFileError(path, f"holds a {type(spec).__name__}; expected a JSON object.")
    missing = [key for key in _TEMPLATE_KEYS if key not in spec]
    if missing:
        raise DataFileError(
            path, f"lacks the keys {missing}; a templates file needs {list(_TEMPLATE_KEYS)} (see relations/FORMAT.md)."
        )
    for key, kind in _TEMPLATE_KEYS.items():
        value = spec[key]
        items = value if kind is list and isinstance(value, list) else [value]
        if (kind is list and not isinstance(value, list)) or not items or not all(isinstance(v, str) for v in items):
            expected = "a non-empty list of strings" if kind is list else "a string"
            raise DataFileError(path, f"expected {expected}, got {value!r}.", field=key)
    for key in _OPTIONAL_TEMPLATE_KEYS:
        if key in spec and not isinstance(spec[key], str):
            raise DataFileError(path, f"expected a string, got {spec[key]!r}.", field=key)
    return spec


def _as_fact(item) -> Fact:
    if isinstance(item, Fact):
        return item
    if isinstance(item, dict):
        aliases = item.get("aliases") or ()
        aliases = tuple(a for a in (aliases.split(";") if isinstance(aliases, str) else aliases) if a)
        return Fact(item["subject"], item["answer"], aliases)
    subject, answer, *rest = item
    aliases = rest[0] if rest else ()
    return Fact(subject, answer, tuple([aliases] if isinstance(aliases, str) else aliases))


def _normalize(text: str) -> str:
    return " ".join(text.casefold().split())


def _first_unit_fn(tokenizer):
    """Map an answer to the unit that must differ between answer and distractor."""
    if tokenizer is None:
        return lambda answer: _normalize(answer).split(" ")[0]

    def first_token(answer: str) -> int:
        ids = tokenizer.encode(" " + answer, add_special_tokens=False)
        if not ids:
            raise ValueError(f"Answer {answer!r} tokenizes to nothing; fix or drop that fact.")
        return ids[0]

    return first_token


def list_relations() -> list[str]:
    """Names of the built-in relations."""
    return sorted(p.stem for p in RELATIONS_DIR.glob("*.json"))


@functools.cache
def load_relation(name: str) -> Relation:
    """A built-in relation by name (see :func:`list_relations`)."""
    available = list_relations()
    if name not in available:
        raise ValueError(f"Unknown relation {name!r}; built-in relations are {available}.")
    return Relation.from_files(RELATIONS_DIR / f"{name}.csv", RELATIONS_DIR / f"{name}.json", name=name)


def conflict_dataset(
    relations: str | Relation | Iterable[str | Relation] = "world_capital",
    n: int | None = None,
    seed: int = 0,
    tokenizer=None,
    paraphrase: int = 0,
) -> ConflictDataset:
    """Clean / substitution / coherent prompts for one or several relations.

    ``relations`` are built-in names or :class:`Relation` objects; ``n`` samples that many facts
    per relation. Pass ``tokenizer=model`` so that distractors never share the answer's first
    token under the model's tokenizer.
    """
    if isinstance(relations, (str, Relation)):
        relations = [relations]
    parts = [
        (load_relation(r) if isinstance(r, str) else r).dataset(
            n=n, seed=seed, tokenizer=tokenizer, paraphrase=paraphrase
        )
        for r in relations
    ]
    if not parts:
        raise ValueError("No relations given; name at least one, e.g. 'world_capital'.")
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    if len(parts) == 1:
        out.name = parts[0].name
    return out
