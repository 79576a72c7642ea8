"""Fact relations and the conflict prompts built from them.

A :class:`Relation` is a list of facts (subject, answer, aliases) plus templates. From it,
:meth:`Relation.dataset` builds clean / substitution / coherent prompts with a distractor drawn
from the relation's own answer pool. Built-in relations live as ``relations/NAME.csv`` (facts)
and ``relations/NAME.json`` (templates); see ``relations/FORMAT.md``.

Templates come in *wording families* (:class:`Wording`): ``"base"`` is the relation's main set,
and a relation may add others written in another register (e.g. ``"dialogue"``: question-and-
answer framing; ``"longform"``: long encyclopedic paragraphs). A method tuned on one family and
scored on another is tested under a shift of wording, not only of facts.
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
    "BASE_FAMILY",
    "Fact",
    "Relation",
    "RELATIONS_DIR",
    "Wording",
    "conflict_dataset",
    "list_relations",
    "load_relation",
]

RELATIONS_DIR = Path(__file__).parent / "relations"

SUBSTITUTION_TEMPLATE = "{clean} {context_answer}. {clean}"
"""A sentence-level conflict: the clean prompt completed with the distractor, then asked again."""

COHERENT_SUFFIX = " Question: {question} Answer: {answer_prefix}"
"""What follows a coherent paragraph unless a wording family sets its own ``closing``."""

BASE_FAMILY = "base"
"""The name of a relation's main templates (the top-level keys of its templates file)."""


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
class Wording:
    """One wording family's templates (see :class:`Relation` for what each holds).

    ``closing`` is appended to a coherent paragraph (slots ``{question}`` and ``{answer_prefix}``).
    """

    clean: tuple[str, ...]
    coherent: tuple[str, ...]
    question: str
    answer_prefix: str
    closing: str = COHERENT_SUFFIX
    substitution: str = SUBSTITUTION_TEMPLATE
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "clean", tuple(self.clean))
        object.__setattr__(self, "coherent", tuple(self.coherent))

    def check(self, where: str) -> None:
        """Raise a ValueError naming ``where`` if a template lacks a slot or has an unknown one."""
        if not self.clean or not self.coherent:
            raise ValueError(f"{where} needs at least one clean and one coherent template.")
        for t in self.clean:
            _check_template(t, {"subject"}, {"subject"}, f"{where}: clean")
        for t in self.coherent:
            _check_template(t, {"subject", "context_answer"}, {"subject", "context_answer"}, f"{where}: coherent")
        _check_template(self.question, {"subject"}, {"subject"}, f"{where}: question")
        _check_template(self.answer_prefix, set(), {"subject"}, f"{where}: answer_prefix")  # "A: It is" is fine
        _check_template(self.closing, {"answer_prefix"}, {"question", "answer_prefix"}, f"{where}: closing")
        _check_template(
            self.substitution,
            {"clean", "context_answer"},
            {"clean", "context_answer", "subject"},
            f"{where}: substitution",
        )

    def prompts(self, subject: str, context_answer: str, clean: int = 0, coherent: int = 0) -> dict[str, str]:
        """Clean, substitution and coherent prompts from clean template ``clean`` and coherent
        paragraph ``coherent`` (indices modulo their number)."""
        clean_prompt = self.clean[clean % len(self.clean)].format(subject=subject)
        substitution = self.substitution.format(clean=clean_prompt, context_answer=context_answer, subject=subject)
        paragraph = self.paragraph(subject, context_answer, coherent)
        closing = self.closing.format(
            question=self.question.format(subject=subject), answer_prefix=self.answer_prefix.format(subject=subject)
        )
        return {"clean": clean_prompt, "substitution": substitution, "coherent": paragraph + closing}

    def paragraph(self, subject: str, context_answer: str, coherent: int = 0) -> str:
        """Coherent paragraph ``coherent`` (modulo their number), without the closing question."""
        return self.coherent[coherent % len(self.coherent)].format(subject=subject, context_answer=context_answer)


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
        families: further wording families by name (:class:`Wording`); the fields above are the
            ``"base"`` family.
    """

    name: str
    facts: tuple[Fact, ...]
    clean: tuple[str, ...]
    coherent: tuple[str, ...]
    question: str
    answer_prefix: str
    description: str = ""
    substitution: str = SUBSTITUTION_TEMPLATE
    families: dict[str, Wording] = field(default_factory=dict)
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
        if BASE_FAMILY in self.families:
            raise ValueError(f"Relation {self.name!r}: {BASE_FAMILY!r} names the main templates; rename that family.")
        self.wording(BASE_FAMILY).check(self.name)
        for name, wording in self.families.items():
            if not isinstance(wording, Wording):
                raise ValueError(f"Relation {self.name!r}: family {name!r} must be a Wording, got {wording!r}.")
            wording.check(f"{self.name} ({name} family)")

    def __repr__(self) -> str:
        return (
            f"Relation({self.name!r}, {len(self.facts)} facts, {len(self.clean)} clean and "
            f"{len(self.coherent)} coherent templates, families {list(self.family_names)})"
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

    # -- wording families ----------------------------------------------------------------------

    @property
    def family_names(self) -> tuple[str, ...]:
        """``"base"`` and the names of the other wording families."""
        return (BASE_FAMILY, *self.families)

    def wording(self, family: str = BASE_FAMILY) -> Wording:
        """The templates of one wording family (``"base"``: the relation's main templates)."""
        if family == BASE_FAMILY:
            return Wording(self.clean, self.coherent, self.question, self.answer_prefix, substitution=self.substitution)
        if family not in self.families:
            raise ValueError(
                f"Relation {self.name!r} has no wording family {family!r}; its families are {list(self.family_names)}."
            )
        return self.families[family]

    # -- prompts -------------------------------------------------------------------------------

    def prompts(
        self, subject: str, context_answer: str, paraphrase: int | tuple[int, int] = 0, family: str = BASE_FAMILY
    ) -> dict[str, str]:
        """Clean, substitution and coherent prompts for one subject and distractor.

        ``paraphrase`` picks the clean and coherent template (modulo their number); a pair
        ``(clean, coherent)`` picks each on its own. ``family`` picks the wording family.
        """
        clean, coherent = _template_indices(paraphrase)
        return self.wording(family).prompts(subject, context_answer, clean, coherent)

    def contexts(
        self, subject: str, context_answer: str, paraphrase: int | tuple[int, int] = 0, family: str = BASE_FAMILY
    ) -> dict[str, str]:
        """The conflicting text inside each conflict prompt (where the context answer is asserted),
        so analyses can tell context tokens from question tokens."""
        prompts = self.prompts(subject, context_answer, paraphrase, family)
        clean, substitution = prompts["clean"], prompts["substitution"]
        statement = substitution[: -len(clean)].rstrip() if substitution.endswith(clean) else substitution
        paragraph = self.wording(family).paragraph(subject, context_answer, _template_indices(paraphrase)[1])
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
        paraphrase: int | str = 0,
        subjects: Sequence[str] | None = None,
        family: str = BASE_FAMILY,
    ) -> ConflictDataset:
        """Conflict examples for this relation.

        Args:
            n: keep a random sample of ``n`` facts (by ``seed``); default all, in file order.
            seed: seeds the distractor choice, the sample and random templates.
            tokenizer: a tokenizer or ``HookedTransformer``; with it, distractors never share a
                first token with the answer under that tokenizer. Pass the model you will study.
            paraphrase: which clean / coherent template to use (0 = the family's first), or
                ``"random"``: a clean template and a coherent paragraph drawn for each fact
                (seeded by ``seed`` and the subject), so no single wording dominates.
            subjects: build only these subjects (in this order).
            family: the wording family (:attr:`family_names`); recorded in each example's
                ``meta["family"]``.
        """
        wording = self.wording(family)
        if isinstance(paraphrase, str) and paraphrase != "random":
            raise ValueError(f"paraphrase must be a template index or 'random', got {paraphrase!r}.")
        if isinstance(paraphrase, bool) or not isinstance(paraphrase, (int, str)):
            raise ValueError(f"paraphrase must be a template index or 'random', got {paraphrase!r}.")
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
            if paraphrase == "random":
                rng = random.Random(f"{seed}|templates|{self.name}|{family}|{fact.subject}")
                chosen = (rng.randrange(len(wording.clean)), rng.randrange(len(wording.coherent)))
            else:
                chosen = paraphrase
            examples.append(
                ConflictExample(
                    relation=self.name,
                    subject=fact.subject,
                    answer=fact.answer,
                    aliases=fact.aliases,
                    context_answer=context_answer,
                    prompts=self.prompts(fact.subject, context_answer, chosen, family),
                    meta={
                        "paraphrase": chosen,
                        "family": family,
                        "seed": seed,
                        "contexts": self.contexts(fact.subject, context_answer, chosen, family),
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
        families = spec.get("families", {})
        if not isinstance(families, dict):
            raise DataFileError(
                templates_json, f"expected an object of wording families, got {families!r}.", field="families"
            )
        return cls(
            name=name or spec.get("name") or facts_csv.stem,
            facts=tuple(facts),
            clean=spec["clean"],
            coherent=spec["coherent"],
            question=spec["question"],
            answer_prefix=spec["answer_prefix"],
            description=spec.get("description", ""),
            substitution=spec.get("substitution", SUBSTITUTION_TEMPLATE),
            families={
                family: _wording(_check_template_keys(templates_json, value, f"families.{family}"))
                for family, value in families.items()
            },
        )


_TEMPLATE_KEYS = {"clean": list, "coherent": list, "question": str, "answer_prefix": str}
_OPTIONAL_TEMPLATE_KEYS = ("name", "description", "substitution", "closing")


def _read_templates(path: Path) -> dict:
    """The templates JSON as a dict with every required key checked (lists of strings for
    ``clean`` / ``coherent``, strings for the rest)."""
    text = read_text(path, what="templates", expected="a JSON object with " + ", ".join(_TEMPLATE_KEYS))
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataFileError(path, f"not valid JSON ({err}).") from None
    return _check_template_keys(path, spec)


def _check_template_keys(path: Path, spec, prefix: str = "") -> dict:
    """``spec`` (the file or one of its wording families) with its keys and their types checked."""
    where = f"{prefix}." if prefix else ""
    if not isinstance(spec, dict):
        raise DataFileError(path, f"holds a {type(spec).__name__} at {prefix or 'the top'}; expected a JSON object.")
    missing = [key for key in _TEMPLATE_KEYS if key not in spec]
    if missing:
        raise DataFileError(
            path,
            f"lacks the keys {[where + k for k in missing]}; templates need {list(_TEMPLATE_KEYS)} "
            "(see relations/FORMAT.md).",
        )
    for key, kind in _TEMPLATE_KEYS.items():
        value = spec[key]
        items = value if kind is list and isinstance(value, list) else [value]
        if (kind is list and not isinstance(value, list)) or not items or not all(isinstance(v, str) for v in items):
            expected = "a non-empty list of strings" if kind is list else "a string"
            raise DataFileError(path, f"expected {expected}, got {value!r}.", field=where + key)
    for key in _OPTIONAL_TEMPLATE_KEYS:
        if key in spec and not isinstance(spec[key], str):
            raise DataFileError(path, f"expected a string, got {spec[key]!r}.", field=where + key)
    return spec


def _wording(spec: dict) -> Wording:
    return Wording(
        clean=spec["clean"],
        coherent=spec["coherent"],
        question=spec["question"],
        answer_prefix=spec["answer_prefix"],
        closing=spec.get("closing", COHERENT_SUFFIX),
        substitution=spec.get("substitution", SUBSTITUTION_TEMPLATE),
        description=spec.get("description", ""),
    )


def _template_indices(paraphrase: int | tuple[int, int]) -> tuple[int, int]:
    """(clean template, coherent paragraph) indices from one index or a pair."""
    if isinstance(paraphrase, tuple):
        return paraphrase
    return paraphrase, paraphrase


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
    paraphrase: int | str = 0,
    family: str = BASE_FAMILY,
) -> ConflictDataset:
    """Clean / substitution / coherent prompts for one or several relations.

    ``relations`` are built-in names or :class:`Relation` objects; ``n`` samples that many facts
    per relation. Pass ``tokenizer=model`` so that distractors never share the answer's first
    token under the model's tokenizer. ``family`` picks the wording family (``"base"``,
    ``"dialogue"``, ``"longform"`` for the built-in relations) and ``paraphrase`` a template in
    it, or ``"random"`` for one drawn per fact (see :meth:`Relation.dataset`).
    """
    if isinstance(relations, (str, Relation)):
        relations = [relations]
    parts = [
        (load_relation(r) if isinstance(r, str) else r).dataset(
            n=n, seed=seed, tokenizer=tokenizer, paraphrase=paraphrase, family=family
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
