"""How a greedy continuation is read: does it name an answer?

An answer counts when it appears in the first ``n_words`` words of the continuation, after
:func:`normalize_answer` (case, accents and punctuation removed), as whole words (cpsuper's
reading) or anywhere in that text (``match="substring"``, the JuICE paper's). Decoding can stop
as soon as the verdict cannot change (:func:`reading_settled`, :func:`stop_once_settled`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence

__all__ = ["MATCHES", "mentions_answer", "normalize_answer", "reading_settled", "stop_once_settled"]


def normalize_answer(text: str) -> str:
    """Lowercase, strip accents and punctuation, collapse whitespace (for alias matching)."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).casefold()
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(text.split())


MATCHES = ("word", "substring")
"""How an answer is found in a continuation: as whole words (cpsuper's default) or as a substring
of the normalized text (the JuICE paper's evaluation)."""


def _answer_list(answers: str | Sequence[str]) -> list[str]:
    """``answers`` as a list (one string is one answer, not a sequence of letters)."""
    return [answers] if isinstance(answers, str) else list(answers)


def _check_reading(n_words: int, match: str) -> None:
    if isinstance(n_words, bool) or not isinstance(n_words, int) or n_words < 1:
        raise ValueError(f"n_words must be a positive integer (words of the continuation read), got {n_words!r}.")
    if match not in MATCHES:
        raise ValueError(f"match must be one of {MATCHES}, got {match!r}.")


def mentions_answer(continuation: str, answers: str | Sequence[str], n_words: int = 5, *, match: str = "word") -> bool:
    """Whether any of ``answers`` appears in the first ``n_words`` words of ``continuation``
    (after :func:`normalize_answer`): as whole words (``match="word"``), or anywhere in that
    text (``match="substring"``, the JuICE paper's reading, where "Paris" is found in "Parisian")."""
    _check_reading(n_words, match)
    head = " " + normalize_answer(" ".join(continuation.split()[:n_words])) + " "
    found = [normalize_answer(a) for a in _answer_list(answers)]
    if match == "substring":
        return any(a in head for a in found if a)
    return any(f" {a} " in head for a in found if a)


def reading_settled(continuation: str, answers: str | Sequence[str], n_words: int = 5, *, match: str = "word") -> bool:
    """Whether :func:`mentions_answer` is already decided by ``continuation``: it gives the same
    verdict on every longer continuation that starts with this text, so greedy decoding can stop.

    Only text that more tokens cannot change counts: every word but the last, and the last word
    up to its final punctuation mark (``"Paris."`` is settled, ``"Par"`` may become ``"Paris"``).
    Decided once an answer appears there, or once ``n_words`` words are settled."""
    _check_reading(n_words, match)
    words = continuation.split()
    if not words:
        return False
    settled = words[:-1]
    if len(settled) >= n_words:
        return True
    last = words[-1]
    cut = max((i for i, ch in enumerate(last) if unicodedata.category(ch).startswith("P")), default=-1)
    if cut >= 0:
        settled.append(last[: cut + 1])
    return mentions_answer(" ".join(settled), answers, n_words, match=match)


def stop_once_settled(
    answer_lists: Sequence[Sequence[str]], n_words: int = 5, *, match: str = "word"
) -> Callable[[int, str], bool]:
    """The ``stop_when(k, text)`` of :func:`decode_all` (and of ``generate_many``) that ends prompt
    ``k``'s continuation once :func:`reading_settled` on its answers ``answer_lists[k]``."""
    _check_reading(n_words, match)
    return lambda k, text: reading_settled(text, answer_lists[k], n_words, match=match)
