"""Whole-answer scoring: the teacher-forced log-probability of every token of an answer.

First-token probabilities judge "Buenos Aires" by " Buenos" and a person by their first name, a
token many other answers share. :func:`answer_logprobs` feeds each prompt followed by the answer's
tokens (all but the last) and sums the log-probability of each answer token at the position
before it. The answer is tokenized as it continues the prompt
(:func:`cpsuper.runtime.answer_tokens`: a leading space after a prompt that does not end in
whitespace), the same convention the first-token measures use.

An answer may have aliases ("United States", "USA"). Per prompt the result gives

- ``logprob``: the best alias's log-probability (the most likely way to say the answer), and
- ``logprob_lse``: the log-sum-exp over the aliases, the log-probability that the continuation
  is one of them. It is exact when no alias's tokens are a prefix of another's; otherwise the
  events overlap and it is an upper bound.

Pairs run in length-grouped batches (:func:`cpsuper.runtime.length_batches`), so batched
results equal one-at-a-time results, and only the answer positions are unembedded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, final_residual
from .decoding import unembed_final
from .edits import Condition, PatchEdit
from .runtime import answer_tokens, as_prompts, check_batch_size, length_batches, pad_tokens, tokenize_prompts

__all__ = ["WHOLE_ANSWER_METRICS", "answer_logprobs", "token_logprob_sums", "whole_answer_conditions"]

WHOLE_ANSWER_METRICS = ("answer_logprob", "answer_probability")
"""Sweep metrics that score an answer whole: the teacher-forced sum of its tokens' log-probabilities
(:func:`whole_answer_conditions`), or that sum's exponential, the probability of the whole answer."""


def _alias_lists(answers, n: int) -> list[list[str]]:
    if isinstance(answers, str) or not isinstance(answers, Sequence):
        raise TypeError("answers must be a sequence with one answer (a string or a list of aliases) per prompt.")
    if len(answers) != n:
        raise ValueError(f"Got {len(answers)} answers for {n} prompts; give one answer (or alias list) per prompt.")
    out = []
    for i, item in enumerate(answers):
        aliases = [item] if isinstance(item, str) else list(item)
        if not aliases or any(not isinstance(a, str) or not a.strip() for a in aliases):
            raise ValueError(f"Answer {i} ({item!r}) is empty or not text; give a non-empty string or list of strings.")
        out.append(aliases)
    return out


@torch.inference_mode()
def token_logprob_sums(
    model: Model,
    prompt_tokens: Sequence[Sequence[int]],
    answer_ids: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
    padding_side: str = "right",
    progress: bool = False,
) -> np.ndarray:
    """Sum over each answer's tokens of their log-probability after the prompt (teacher forced).

    ``prompt_tokens[i]`` (with BOS) is continued by ``answer_ids[i]``; returns one float per pair.
    """
    batch_size = check_batch_size(batch_size)
    n_ctx = model.cfg.n_ctx
    fed = []
    for prompt, answer in zip(prompt_tokens, answer_ids):
        if not answer:
            raise ValueError("An answer tokenizes to nothing; give a non-empty answer.")
        if len(prompt) + len(answer) - 1 > n_ctx:
            raise ValueError(
                f"A prompt of {len(prompt)} tokens followed by an answer of {len(answer)} tokens needs "
                f"{len(prompt) + len(answer) - 1} positions, more than the model's context window of {n_ctx}. "
                "Shorten the prompt or the answer."
            )
        fed.append([*prompt, *answer[:-1]])
    out = np.empty(len(fed))
    for idx in tqdm(
        length_batches([len(f) for f in fed], batch_size), desc="answers", disable=not progress, leave=False
    ):
        tokens, mask, last = pad_tokens(model, [fed[i] for i in idx], padding_side)
        padded = bool((mask == 0).any())
        resid = final_residual(
            model,
            tokens,
            attention_mask=mask if padded else None,
            padding_side="right",  # already padded: stops TransformerLens inferring a mask
        )
        rows, cols, targets, owner = [], [], [], []
        for row, i in enumerate(idx):
            answer = answer_ids[i]
            first = int(last[row]) - (len(answer) - 1)  # position that predicts the first answer token
            rows += [row] * len(answer)
            cols += range(first, first + len(answer))
            targets += list(answer)
            owner += [row] * len(answer)
        picked = resid[torch.tensor(rows, device=resid.device), torch.tensor(cols, device=resid.device)]
        logprobs = unembed_final(model, picked).float().log_softmax(-1)
        token_lp = logprobs[
            torch.arange(len(targets), device=logprobs.device), torch.tensor(targets, device=logprobs.device)
        ]
        sums = torch.zeros(len(idx), dtype=torch.float64, device=token_lp.device)
        sums.index_add_(0, torch.tensor(owner, device=token_lp.device), token_lp.double())
        out[idx] = sums.cpu().numpy()
    return out


def answer_logprobs(
    model: Model,
    prompts: str | Sequence[str],
    answers: Sequence[str | Sequence[str]],
    *,
    batch_size: int = 32,
    padding_side: str = "right",
    progress: bool = True,
) -> pd.DataFrame:
    """Teacher-forced log-probability of each prompt's whole answer, best alias and over aliases.

    ``answers`` holds one item per prompt: an answer string or a list of its aliases. Returns one
    row per prompt with ``answer`` (the best alias), ``n_tokens`` (its length in tokens),
    ``logprob`` (its summed log-probability), ``logprob_lse`` (log-sum-exp over the aliases; see
    the module docstring) and ``n_aliases``. Raises if a prompt plus an answer does not fit the
    context window.
    """
    prompts, _ = as_prompts(prompts)
    aliases = _alias_lists(answers, len(prompts))
    prompt_tokens = tokenize_prompts(model, prompts)
    pairs = [(i, a) for i, items in enumerate(aliases) for a in items]
    ids = [answer_tokens(model, a, prompts[i]) for i, a in pairs]
    for (i, a), toks in zip(pairs, ids):
        if not toks:
            raise ValueError(f"Answer {a!r} of prompt {i} tokenizes to nothing; give a non-empty answer.")
    sums = token_logprob_sums(
        model,
        [prompt_tokens[i] for i, _ in pairs],
        ids,
        batch_size=batch_size,
        padding_side=padding_side,
        progress=progress,
    )
    rows, start = [], 0
    for i, items in enumerate(aliases):
        values = sums[start : start + len(items)]
        best = int(np.argmax(values))
        rows.append(
            {
                "prompt": i,
                "answer": items[best],
                "n_tokens": len(ids[start + best]),
                "logprob": float(values[best]),
                "logprob_lse": float(np.logaddexp.reduce(values)),
                "n_aliases": len(items),
            }
        )
        start += len(items)
    return pd.DataFrame(rows)


def whole_answer_conditions(
    model: Model,
    token_lists: Sequence[Sequence[int]],
    answers: Sequence[Sequence[Sequence[int]]],
    conditions: Sequence[Condition],
    *,
    metric: str = "answer_logprob",
    batch_size: int | str = 64,
    prompt_batch_size: int = 16,
    progress: bool = True,
    desc: str = "sweep",
) -> tuple[Float[Tensor, "n_prompts n_answers"], Float[Tensor, "n_prompts n_conditions n_answers"]]:
    """:func:`cpsuper.engine.run_conditions` for whole answers: ``answers[i][a]`` are the token ids
    of answer ``a`` after prompt ``i``, and each value is the sum of their log-probabilities, each
    token read after the prompt and the answer's tokens before it (teacher forcing), clean and under
    every condition (``metric="answer_probability"``: its exponential).

    Every distinct prefix (a prompt, or a prompt and the start of an answer) is one row of the
    engine, read at its last position for every token wanted there; an answer of one token costs
    what the first-token metric does. :class:`~cpsuper.edits.PatchEdit` conditions are refused:
    the answer tokens after a prompt would move the positions a patch aligns."""
    from .engine import run_conditions

    if metric not in WHOLE_ANSWER_METRICS:
        raise ValueError(f"Unknown whole-answer metric {metric!r}; use one of {WHOLE_ANSWER_METRICS}.")
    if any(isinstance(edit, PatchEdit) for condition in conditions for edit in condition):
        raise ValueError(
            f"metric={metric!r} reads positions after the prompt, which moves the positions a PatchEdit "
            "aligns; patch with metric='probability' or 'logprob' (the answers' first tokens)."
        )
    if len(answers) != len(token_lists) or len({len(a) for a in answers}) > 1:
        raise ValueError(f"answers needs the same number of answers for each of the {len(token_lists)} prompts.")
    prefixes: dict[tuple[int, ...], int] = {}
    wanted: list[list[int]] = []
    reads = []  # (prompt, answer, row, token) for every answer token
    for i, (prompt, per_prompt) in enumerate(zip(token_lists, answers)):
        for a, ids in enumerate(per_prompt):
            if not ids:
                raise ValueError(f"Answer {a} of prompt {i} has no tokens; give a non-empty answer.")
            for j, token in enumerate(ids):
                row = prefixes.setdefault((*prompt, *ids[:j]), len(prefixes))
                if row == len(wanted):
                    wanted.append([])
                if token not in wanted[row]:
                    wanted[row].append(token)
                reads.append((i, a, row, wanted[row].index(token)))
    width = max(map(len, wanted))
    ids = torch.tensor([w + [w[0]] * (width - len(w)) for w in wanted])
    clean_rows, out_rows = run_conditions(
        model,
        [list(p) for p in prefixes],
        ids,
        conditions,
        metric="logprob",
        batch_size=batch_size,
        prompt_batch_size=prompt_batch_size,
        progress=progress,
        desc=desc,
    )
    prompt, answer, row, column = (torch.tensor(v) for v in zip(*reads))
    shape = (len(token_lists), len(answers[0]))
    clean = torch.zeros(shape).index_put_((prompt, answer), clean_rows[row, column], accumulate=True)
    out = torch.zeros((*shape, len(conditions)))
    out = out.index_put_((prompt, answer), out_rows[row, :, column], accumulate=True).permute(0, 2, 1)
    return (clean.exp(), out.exp()) if metric == "answer_probability" else (clean, out)
