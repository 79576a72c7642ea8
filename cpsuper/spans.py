"""Where the parts of a conflict prompt sit among its tokens: BOS, prefix, context, context
answer, subject, relation, end.

Attribution and attention analyses sum over these groups. Spans are found on characters and
mapped to tokens through each token's character offsets, so a subject split over several tokens,
a token that carries a leading space, and a subject that also appears inside the context are all
handled. Every token gets exactly one group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .backend import Model
from .data.examples import ConflictExample
from .runtime import tokenize_prompts

__all__ = ["SPAN_GROUPS", "example_spans", "find_spans", "occurrences", "token_offsets"]

SPAN_GROUPS: tuple[str, ...] = ("bos", "prefix", "context", "context_answer", "subject", "relation", "end")
"""Token groups, in prompt order. ``context`` is the conflicting statement or paragraph minus the
context answer's own tokens; ``relation`` is every other question token before the final one;
``prefix`` is text before the context (e.g. an instruction); ``end`` is the final token."""

_PRIORITY = {"end": 0, "subject": 1, "context_answer": 2, "context": 3, "prefix": 4, "relation": 5}


def token_offsets(model: Model, prompt: str, tokens: Sequence[int]) -> list[tuple[int, int]]:
    """Character range ``[start, end)`` of each token of ``prompt`` (BOS gets ``(0, 0)``).

    Uses the tokenizer's offset mapping when it reproduces ``tokens``; otherwise decodes
    growing prefixes of the tokens.
    """
    tokenizer = model.tokenizer
    n_special = len(tokens) - len(tokenizer.encode(prompt, add_special_tokens=False))
    body = list(tokens[n_special:])
    try:
        enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) == body:
            return [(0, 0)] * n_special + [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError):
        pass
    offsets, previous = [], 0
    for i in range(len(body)):
        text = tokenizer.decode(body[: i + 1])
        end = len(text) if prompt.startswith(text) else previous
        offsets.append((previous, end))
        previous = end
    if previous != len(prompt):
        raise ValueError(
            f"Could not map the tokens of {prompt[:60]!r}... back to characters with this tokenizer; "
            "pass the groups of each token yourself."
        )
    return [(0, 0)] * n_special + offsets


def occurrences(text: str, needle: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """Every occurrence of ``needle`` in ``text[start:end]`` (case-sensitive, else case-insensitive)."""
    end = len(text) if end is None else end
    if not needle.strip():
        return []
    needle = needle.strip()
    for flags in (0, re.IGNORECASE):
        hits = [(m.start(), m.end()) for m in re.finditer(re.escape(needle), text[start:end], flags)]
        if hits:
            return [(a + start, b + start) for a, b in hits]
    return []


def _context_range(prompt: str, context: str | None, context_answers: Sequence[str]) -> tuple[int, int] | None:
    """Characters of the conflicting text: given explicitly, else up to the end of the sentence
    with the last mention of a context answer."""
    if context:
        at = prompt.rfind(context.strip())
        if at < 0:
            raise ValueError(f"The context {context[:60]!r}... does not occur in the prompt {prompt[:60]!r}...")
        return at, at + len(context.strip())
    hits = [hit for answer in context_answers for hit in occurrences(prompt, answer)]
    if not hits:
        return None
    last = max(end for _, end in hits)
    stop = re.search(r"[.!?\n]", prompt[last:])
    return 0, last + (stop.end() if stop else 0)


def find_spans(
    model: Model,
    prompt: str,
    subject: str,
    *,
    context_answers: Sequence[str] = (),
    context: str | None = None,
    tokens: Sequence[int] | None = None,
) -> list[str]:
    """The group (one of :data:`SPAN_GROUPS`) of every token of ``prompt``, BOS included.

    ``context`` is the conflicting text as it appears in the prompt; without it, the context runs
    from the start to the end of the sentence holding the last mention of a context answer (no
    mention: no context). The subject is looked for in the question after the context, every
    occurrence; subject mentions inside the context count as context.
    """
    tokens = list(tokens) if tokens is not None else tokenize_prompts(model, [prompt])[0]
    offsets = token_offsets(model, prompt, tokens)
    ctx = _context_range(prompt, context, context_answers)
    question_start = ctx[1] if ctx else 0
    regions: list[tuple[str, int, int]] = []
    if ctx:
        regions.append(("prefix", 0, ctx[0]))
        regions.append(("context", *ctx))
        regions += [("context_answer", a, b) for ans in context_answers for a, b in occurrences(prompt, ans, *ctx)]
    subject_hits = occurrences(prompt, subject, question_start)
    if not subject_hits:
        raise ValueError(
            f"The subject {subject!r} does not occur in the question part of the prompt {prompt[-80:]!r}; "
            "check the example's subject or pass the context text explicitly."
        )
    regions += [("subject", a, b) for a, b in subject_hits]
    groups = []
    bos = model.tokenizer.bos_token_id
    for i, (start, end) in enumerate(offsets):
        if start == end == 0 and i == 0 and tokens[0] == bos:
            groups.append("bos")
            continue
        if i == len(tokens) - 1:
            groups.append("end")
            continue
        found = [name for name, a, b in regions if start < b and end > a and a < b]
        groups.append(min(found, key=_PRIORITY.get) if found else ("relation" if start >= question_start else "prefix"))
    return groups


def example_spans(
    model: Model, example: ConflictExample, conflict_type: str, *, tokens: Sequence[int] | None = None
) -> list[str]:
    """:func:`find_spans` for one prompt of a dataset example; the context text comes from
    ``example.meta["contexts"]`` when the dataset recorded it (the built-in relations do)."""
    context = (example.meta.get("contexts") or {}).get(conflict_type)
    answers = example.context_answers if conflict_type != "clean" else ()
    return find_spans(
        model, example.prompts[conflict_type], example.subject, context_answers=answers, context=context, tokens=tokens
    )
