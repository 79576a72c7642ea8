"""Scoring conflict prompts: answer probabilities, greedy accuracy, and which facts a model knows.

Everything runs through :mod:`cpsuper.runtime` and :mod:`cpsuper.decoding` (length-grouped batches, final-position
unembedding), so batched results equal one-at-a-time results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from .backend import Model
from .data.examples import CONFLICT_TYPES, ConflictDataset
from .decoding import Steering, iter_final_logits, iter_greedy
from .reading import mentions_answer, stop_once_settled
from .runtime import (
    answer_token,
    as_prompts,
    check_batch_size,
    check_conflict_dataset,
    check_dataset,
    check_flag,
    check_model,
    resolve_conflict_types,
    tokenize_prompts,
)
from .stats import bootstrap_summary

__all__ = [
    "decode_all",
    "filter_known",
    "final_logits",
    "greedy_continuations",
    "known_facts",
    "score_dataset",
    "stop_on_text",
    "summarize_scores",
]


def final_logits(
    model: Model,
    prompts: str | Sequence[str],
    *,
    batch_size: int = 32,
    padding_side: str = "right",
    progress: bool = True,
    steering: Steering | None = None,
) -> Float[Tensor, "n_prompts d_vocab"]:
    """Logits at the last token of each prompt, in prompt order (full vocabulary; for large
    datasets prefer :func:`score_dataset`, which keeps only the answers' probabilities).

    One string gives one row. ``steering`` (e.g. a :class:`~cpsuper.JuICE`) steers every pass."""
    token_lists = tokenize_prompts(model, prompts)
    out = torch.empty((len(token_lists), model.cfg.d_vocab_out), dtype=torch.float32)
    for idx, logits in iter_final_logits(
        model,
        token_lists,
        batch_size=check_batch_size(batch_size),
        padding_side=padding_side,
        progress=progress,
        steering=steering,
    ):
        out[idx] = logits.float().cpu()
    return out


def stop_on_text(model: Model, stop_when: Callable[[int, str], bool] | None) -> Callable[[int, list[int]], bool] | None:
    """``stop_when(k, text)``, a test on decoded text, as the ``finished(k, ids)`` of
    :func:`~cpsuper.decoding.greedy_batches`. None (decode in full) for a tokenizer that cleans
    up spaces, since its decoding can rewrite text already decoded (``" n't"`` -> ``"n't"``)."""
    if stop_when is None or getattr(model.tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return lambda k, ids: stop_when(k, model.tokenizer.decode(ids, skip_special_tokens=True))


def decode_all(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 8,
    steering: Steering | None = None,
    batch_size: int = 32,
    progress: bool = True,
    stop_when: Callable[[int, str], bool] | None = None,
    keep_logits: bool = True,
) -> tuple[list[str], Float[Tensor, "n d_vocab"] | None]:
    """Greedy continuations (decoded, in input order) and the prompts' own last-position logits
    (None with ``keep_logits=False``: a megabyte per prompt on a 262k vocabulary).

    ``stop_when(k, text)``: True once prompt ``k``'s continuation so far holds all the caller
    will read (e.g. :func:`reading_settled`); that prompt's decoding stops there."""
    longest = max((len(t) for t in token_lists), default=0)
    if longest + max_new_tokens - 1 > model.cfg.n_ctx:  # the last new token needs no position of its own
        raise ValueError(
            f"A prompt of {longest} tokens plus {max_new_tokens} new tokens needs {longest + max_new_tokens - 1} "
            f"positions, more than the model's context window of {model.cfg.n_ctx}. Shorten the prompt or "
            "decode fewer tokens (max_new_tokens)."
        )
    texts: list[str] = [""] * len(token_lists)
    first = torch.empty((len(token_lists), model.cfg.d_vocab_out), dtype=torch.float32) if keep_logits else None

    finished = stop_on_text(model, stop_when)
    for idx, logits, generated in iter_greedy(
        model,
        token_lists,
        max_new_tokens=max_new_tokens,
        batch_size=check_batch_size(batch_size),
        progress=progress,
        steering=steering,
        finished=finished,
    ):
        if first is not None:
            first[idx] = logits.float().cpu()
        for row, i in enumerate(idx):
            texts[i] = model.tokenizer.decode(generated[row], skip_special_tokens=True)
    return texts, first


def greedy_continuations(
    model: Model,
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = 8,
    batch_size: int = 32,
    progress: bool = True,
    steering: Steering | None = None,
    stop_when: Callable[[int, str], bool] | None = None,
) -> list[str] | str:
    """Greedy (argmax) continuations of each prompt, decoded, in prompt order (one string for one
    prompt string). ``steering`` (e.g. a :class:`~cpsuper.JuICE`) steers every step;
    ``stop_when(k, text)`` ends prompt ``k``'s continuation early (:func:`decode_all`)."""
    prompts, single = as_prompts(prompts)
    texts, _ = decode_all(
        model,
        tokenize_prompts(model, prompts),
        max_new_tokens=max_new_tokens,
        steering=steering,
        batch_size=batch_size,
        progress=progress,
        stop_when=stop_when,
        keep_logits=False,
    )
    return texts[0] if single else texts


def greedy_groups(
    model: Model,
    prompt_groups: Sequence[Sequence[str]],
    max_new_tokens: int = 8,
    batch_size: int = 32,
    progress: bool = False,
    *,
    steering: Steering | None = None,
    stop_when: Callable[[int, str], bool] | None = None,
) -> list[list[str]]:
    """:func:`greedy_continuations` of several prompt lists decoded in shared batches (fuller
    batches: one pass over the weights serves all of them); one list of texts per group.
    ``stop_when(k, text)`` counts ``k`` over the groups' prompts in order."""
    flat = [p for group in prompt_groups for p in group]
    if not flat:
        return [[] for _ in prompt_groups]
    texts = greedy_continuations(
        model,
        flat,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        progress=progress,
        steering=steering,
        stop_when=stop_when,
    )
    out, start = [], 0
    for group in prompt_groups:
        out.append(texts[start : start + len(group)])
        start += len(group)
    return out


# ---------------------------------------------------------------------------------------------
# Scores


MEASURES = ("p_parametric", "p_context", "logit_diff", "context_wins", "acc_parametric", "acc_context")


def score_dataset(
    model: Model,
    dataset: ConflictDataset,
    *,
    conflict_types: Sequence[str] | None = None,
    batch_size: int = 32,
    progress: bool = True,
    greedy: bool = True,
    max_new_tokens: int = 8,
    n_words: int = 5,
    padding_side: str = "left",
    whole_answer: bool = False,
) -> pd.DataFrame:
    """Score every example under every conflict type.

    Returns a tidy DataFrame, one row per example x conflict type x measure, with columns
    ``example, relation, subject, answer, context_answer, conflict_type, measure, value``.
    Measures:

    - ``p_parametric`` / ``p_context``: probability of the first token of the parametric /
      context answer at the last prompt position;
    - ``logit_diff``: parametric minus context first-token logit;
    - ``context_wins``: 1.0 if the context answer's first token outranks the parametric one's;
    - ``acc_parametric`` / ``acc_context`` (with ``greedy=True``): 1.0 if an alias of that
      answer is among the first ``n_words`` words of the greedy continuation
      (``max_new_tokens`` tokens);
    - ``logprob_parametric`` / ``logprob_context`` (with ``whole_answer=True``): teacher-forced
      log-probability of the whole answer, every token summed, for its best alias
      (:func:`cpsuper.answers.answer_logprobs`; one extra pass per alias).

    ``pivot_table(index=["example", "conflict_type"], columns="measure", values="value")`` gives
    the wide view; :func:`summarize_scores` the means. With ``greedy=True`` and the default left
    padding, the probabilities are read from the first step of the greedy decoding (one forward
    pass per prompt); left and right padding give the same values to 1e-5.
    """
    check_model(model)
    check_conflict_dataset(dataset)
    greedy, progress = check_flag(greedy, "greedy"), check_flag(progress, "progress")
    whole_answer = check_flag(whole_answer, "whole_answer")
    conflict_types = resolve_conflict_types(dataset, conflict_types)
    batch_size = check_batch_size(batch_size)
    check_dataset(model, dataset, conflict_types=conflict_types)
    items = [(i, c) for i, _ in enumerate(dataset) for c in conflict_types]
    prompts = [dataset[i].prompts[c] for i, c in items]
    token_lists = tokenize_prompts(model, prompts)
    p_ids = torch.tensor([answer_token(model, dataset[i].answer, p) for (i, _), p in zip(items, prompts)])
    c_ids = torch.tensor([answer_token(model, dataset[i].context_answer, p) for (i, _), p in zip(items, prompts)])

    values = {m: np.full(len(items), np.nan) for m in MEASURES}
    continuations = [""] * len(items)

    def record(idx: list[int], logits: Tensor) -> None:
        logits = logits.float()
        logprobs = logits.log_softmax(-1)
        rows = torch.arange(len(idx))
        pi, ci = p_ids[idx].to(logits.device), c_ids[idx].to(logits.device)
        values["p_parametric"][idx] = logprobs[rows, pi].exp().cpu().numpy()
        values["p_context"][idx] = logprobs[rows, ci].exp().cpu().numpy()
        diff = (logits[rows, pi] - logits[rows, ci]).cpu().numpy()
        values["logit_diff"][idx] = diff
        values["context_wins"][idx] = (diff < 0).astype(float)

    # Greedy decoding pads on the left; its first step is the scoring pass, so with the default
    # padding the prompts run once. Right padding scores in a separate pass.
    single_pass = greedy and padding_side == "left"
    if not single_pass:
        for idx, logits in iter_final_logits(
            model, token_lists, batch_size=batch_size, padding_side=padding_side, progress=progress, desc="score"
        ):
            record(idx, logits)
    if greedy:
        for idx, first_logits, generated in iter_greedy(
            model, token_lists, max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress
        ):
            if single_pass:
                record(idx, first_logits)
            for row, k in enumerate(idx):
                continuations[k] = model.tokenizer.decode(generated[row], skip_special_tokens=True)
        for k, ((i, _), text) in enumerate(zip(items, continuations)):
            values["acc_parametric"][k] = float(mentions_answer(text, dataset[i].answers, n_words))
            values["acc_context"][k] = float(mentions_answer(text, dataset[i].context_answers, n_words))

    base = pd.DataFrame(
        {
            "example": [i for i, _ in items],
            "relation": [dataset[i].relation for i, _ in items],
            "subject": [dataset[i].subject for i, _ in items],
            "answer": [dataset[i].answer for i, _ in items],
            "context_answer": [dataset[i].context_answer for i, _ in items],
            "conflict_type": [c for _, c in items],
        }
    )
    if greedy:
        base["continuation"] = continuations
    measures = [m for m in MEASURES if greedy or not m.startswith("acc_")]
    if whole_answer:
        from .answers import answer_logprobs

        for measure, role in (("logprob_parametric", "answers"), ("logprob_context", "context_answers")):
            aliases = [getattr(dataset[i], role) for i, _ in items]
            scored = answer_logprobs(model, prompts, aliases, batch_size=batch_size, progress=progress)
            values[measure] = scored["logprob"].to_numpy()
            measures.append(measure)
    frames = [base.assign(measure=m, value=values[m]) for m in measures]
    return pd.concat(frames, ignore_index=True)


def summarize_scores(
    scores: pd.DataFrame,
    by: Sequence[str] = ("relation", "conflict_type"),
    *,
    ci: float | None = None,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Mean, standard deviation and count of every measure, per group (default: relation x
    conflict type), in canonical conflict-type order.

    With ``ci`` (e.g. 0.95), also ``ci_low`` / ``ci_high``: a percentile bootstrap interval of
    the mean over facts (``n_boot`` resamples, seeded; :func:`cpsuper.stats.bootstrap_summary`).
    """
    table = scores.groupby([*by, "measure"], sort=False)["value"].agg(mean="mean", std="std", n="count").reset_index()
    if ci is not None:
        facts = scores.assign(fact=scores["relation"].astype(str) + "/" + scores["example"].astype(str))
        bounds = bootstrap_summary(
            facts.dropna(subset=["value"]),
            value="value",
            by=[*by, "measure"],
            unit="fact",
            n_boot=n_boot,
            ci=ci,
            seed=seed,
        )
        table = table.merge(bounds[[*by, "measure", "ci_low", "ci_high"]], on=[*by, "measure"], how="left")
    if "conflict_type" in table:
        order = {c: k for k, c in enumerate(CONFLICT_TYPES)}
        table = table.sort_values(
            [*by, "measure"], key=lambda s: s.map(order).fillna(len(order)) if s.name == "conflict_type" else s
        ).reset_index(drop=True)
    return table


# ---------------------------------------------------------------------------------------------
# Which facts the model knows


def known_facts(
    model: Model,
    dataset: ConflictDataset,
    by: str = "greedy",
    *,
    batch_size: int = 32,
    progress: bool = True,
    n_words: int = 5,
) -> list[bool]:
    """Whether the model answers each fact's *clean* prompt correctly.

    ``by="greedy"``: an alias of the answer is among the first ``n_words`` words of the greedy
    continuation (the paper's accuracy; decoding stops once that is settled). ``by="top1"``: the
    answer's first token is the most likely next token.
    """
    check_model(model)
    check_conflict_dataset(dataset)
    progress = check_flag(progress, "progress")
    if by not in ("greedy", "top1"):
        raise ValueError(f"by must be 'greedy' or 'top1', got {by!r}.")
    resolve_conflict_types(dataset, ["clean"])
    prompts = [e.prompts["clean"] for e in dataset]
    token_lists = tokenize_prompts(model, prompts)
    if by == "greedy":
        texts, _ = decode_all(
            model,
            token_lists,
            batch_size=batch_size,
            progress=progress,
            stop_when=stop_once_settled([e.answers for e in dataset], n_words),
            keep_logits=False,
        )
        return [mentions_answer(t, e.answers, n_words) for t, e in zip(texts, dataset)]
    known = [False] * len(dataset)
    for idx, logits in iter_final_logits(
        model, token_lists, batch_size=check_batch_size(batch_size), progress=progress, desc="top1"
    ):
        top = logits.argmax(-1).tolist()
        for row, i in enumerate(idx):
            known[i] = top[row] == answer_token(model, dataset[i].answer, prompts[i])
    return known


def filter_known(model: Model, dataset: ConflictDataset, by: str = "greedy", **options) -> ConflictDataset:
    """Keep the facts the model answers correctly on the clean prompt: :func:`known_facts`, whose
    keyword options (``batch_size``, ``progress``, ``n_words``) it takes.

    Raises if the model knows none of them.
    """
    known = known_facts(model, dataset, by, **options)
    keep = [i for i, ok in enumerate(known) if ok]
    if not keep:
        raise ValueError(
            f"The model answers none of the {len(dataset)} clean prompts of {dataset.name!r} correctly "
            f"(by={by!r}); try another relation, clean template (paraphrase=...), or by='top1'."
        )
    return dataset[keep]
