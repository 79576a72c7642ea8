"""Batched last-position scoring of conflict prompts.

Only the final position of each prompt is unembedded: on a 262k-token vocabulary, unembedding
every position costs more than the rest of the forward pass on short prompts. Prompts of
different lengths are grouped by length and padded on the right (or left, with an attention
mask), so that batched results equal one-at-a-time results.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens import HookedTransformer
from transformer_lens.utilities.activation_functions import apply_softcap

from .data.examples import CONFLICT_TYPES, ConflictDataset

__all__ = [
    "answer_token",
    "check_dataset",
    "final_logits",
    "greedy_continuations",
    "iter_greedy",
    "mentions_answer",
    "normalize_answer",
    "score_dataset",
    "summarize_scores",
    "tokenize_prompts",
    "unembed_final",
]


# ---------------------------------------------------------------------------------------------
# Tokens


def tokenize_prompts(model: HookedTransformer, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt (BOS prepended as the model expects), checked against ``n_ctx``."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if len(prompts) == 0:
        raise ValueError("No prompts to run; pass at least one.")
    out = []
    for prompt in prompts:
        ids = model.to_tokens(prompt, truncate=False)[0].tolist()
        if len(ids) > model.cfg.n_ctx:
            raise ValueError(
                f"Prompt of {len(ids)} tokens exceeds the model's context window of {model.cfg.n_ctx} "
                f"tokens: {prompt[:80]!r}... Shorten it or use a model with a longer context."
            )
        out.append(ids)
    return out


def answer_token(model: HookedTransformer, answer: str, prompt: str = "") -> int:
    """The first token of ``answer`` as it would continue ``prompt``.

    A prompt that does not end in whitespace is continued by ``" " + answer``.
    """
    text = answer.strip()
    if prompt and not prompt[-1].isspace():
        text = " " + text
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    if not text.strip() or not ids:
        raise ValueError(f"Answer {answer!r} tokenizes to nothing; give a non-empty answer.")
    return ids[0]


def _answer_tokens(model: HookedTransformer, answer: str, prompt: str) -> list[int]:
    text = answer.strip()
    if prompt and not prompt[-1].isspace():
        text = " " + text
    return model.tokenizer.encode(text, add_special_tokens=False)


def check_dataset(
    model: HookedTransformer,
    dataset: ConflictDataset,
    conflict_types: Sequence[str] | None = None,
    require_single_token: bool = False,
) -> None:
    """Raise a clear error if ``dataset`` cannot be scored on ``model``.

    Checks: prompt length against the context window; answers that tokenize to nothing; a
    context answer whose first token equals the parametric answer's (the two probabilities
    would be the same number); with ``require_single_token``, multi-token answers.
    """
    conflict_types = _conflict_types(dataset, conflict_types)
    for example in dataset:
        for conflict_type in conflict_types:
            prompt = example.prompts[conflict_type]
            ids = {}
            for role, answer in (("answer", example.answer), ("context answer", example.context_answer)):
                toks = _answer_tokens(model, answer, prompt)
                if not toks:
                    raise ValueError(f"The {role} {answer!r} of {example.subject!r} tokenizes to nothing.")
                if require_single_token and len(toks) > 1:
                    pieces = [model.tokenizer.decode([t]) for t in toks]
                    raise ValueError(
                        f"The {role} {answer!r} of {example.subject!r} is {len(toks)} tokens {pieces}, "
                        "but this analysis needs single-token answers. Filter the dataset, e.g. "
                        "dataset.filter(lambda e: ...), or use an analysis that reads the first token."
                    )
                ids[role] = toks[0]
            if ids["answer"] == ids["context answer"]:
                raise ValueError(
                    f"For {example.subject!r}, the answer {example.answer!r} and the context answer "
                    f"{example.context_answer!r} start with the same token "
                    f"{model.tokenizer.decode([ids['answer']])!r}, so their first-token probabilities "
                    "cannot be told apart. Build the dataset with the model's tokenizer "
                    "(conflict_dataset(..., tokenizer=model)) or choose another distractor."
                )
    tokenize_prompts(model, [e.prompts[c] for e in dataset for c in conflict_types])


def _conflict_types(dataset: ConflictDataset, conflict_types: Sequence[str] | None) -> tuple[str, ...]:
    if len(dataset) == 0:
        raise ValueError("The dataset is empty.")
    if conflict_types is None:
        return dataset.conflict_types
    if isinstance(conflict_types, str):
        conflict_types = (conflict_types,)
    missing = [c for c in conflict_types if c not in dataset.conflict_types]
    if missing:
        raise ValueError(
            f"Conflict types {missing} are not in dataset {dataset.name!r}; it has {dataset.conflict_types}."
        )
    return tuple(conflict_types)


# ---------------------------------------------------------------------------------------------
# Batches


def _batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), to keep padding small."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def pad_tokens(
    model: HookedTransformer, token_lists: Sequence[Sequence[int]], padding_side: str = "right"
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Int[Tensor, " batch"]]:
    """Pad token lists into a tensor; returns tokens, attention mask and each row's last real index."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}.")
    pad_id = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0
    width = max(len(t) for t in token_lists)
    tokens = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    last = torch.empty(len(token_lists), dtype=torch.long)
    for row, ids in enumerate(token_lists):
        start = 0 if padding_side == "right" else width - len(ids)
        tokens[row, start : start + len(ids)] = torch.tensor(ids)
        mask[row, start : start + len(ids)] = 1
        last[row] = start + len(ids) - 1
    return tokens.to(model.cfg.device), mask.to(model.cfg.device), last.to(model.cfg.device)


def unembed_final(
    model: HookedTransformer, resid: Float[Tensor, "batch d_model"]
) -> Float[Tensor, "batch d_vocab"]:
    """Final norm, unembedding and soft-capping of one residual vector per row.

    Multiplies by ``W_U`` directly: TransformerLens's ``Unembed`` copies the transposed
    262k x d_model matrix on every call, which costs more than the product itself.
    """
    if model.cfg.normalization_type is not None:
        resid = model.ln_final(resid[:, None, :])[:, 0, :]
    logits = resid @ model.W_U + model.b_U
    return apply_softcap(logits, model.cfg.output_logits_soft_cap)


def iter_final_logits(
    model: HookedTransformer,
    token_lists: Sequence[Sequence[int]],
    batch_size: int = 32,
    padding_side: str = "right",
    progress: bool = True,
    desc: str = "forward",
) -> Iterator[tuple[list[int], Float[Tensor, "batch d_vocab"]]]:
    """Yield ``(indices, final-position logits)`` batch by batch, in length order."""
    batches = _batches([len(t) for t in token_lists], batch_size)
    for idx in tqdm(batches, desc=desc, disable=not progress, leave=False):
        tokens, mask, last = pad_tokens(model, [token_lists[i] for i in idx], padding_side)
        padded = bool((mask == 0).any())
        with torch.inference_mode():
            resid = model(
                tokens,
                stop_at_layer=model.cfg.n_layers,
                attention_mask=mask if padded else None,
                padding_side="right",  # tokens are already padded; stops TransformerLens inferring a mask
            )
            rows = torch.arange(len(idx), device=resid.device)
            yield idx, unembed_final(model, resid[rows, last])


def final_logits(
    model: HookedTransformer,
    prompts: Sequence[str],
    batch_size: int = 32,
    padding_side: str = "right",
    progress: bool = True,
) -> Float[Tensor, "n_prompts d_vocab"]:
    """Logits at the last token of each prompt, in prompt order (full vocabulary; for large
    datasets prefer :func:`score_dataset`, which keeps only the answers' probabilities)."""
    token_lists = tokenize_prompts(model, prompts)
    out = torch.empty((len(token_lists), model.cfg.d_vocab_out), dtype=model.cfg.dtype)
    for idx, logits in iter_final_logits(model, token_lists, batch_size, padding_side, progress):
        out[idx] = logits.float().cpu().to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Greedy continuation


def iter_greedy(
    model: HookedTransformer,
    token_lists: Sequence[Sequence[int]],
    max_new_tokens: int = 8,
    batch_size: int = 32,
    progress: bool = True,
) -> Iterator[tuple[list[int], Float[Tensor, "batch d_vocab"], Int[Tensor, "batch new"]]]:
    """Yield ``(indices, last-position logits of the prompts, greedy token ids)`` batch by batch.

    Left-padded batches with a key-value cache; only the last position is unembedded. The first
    step's logits are the prompts' own last-position logits, so scoring can reuse them.
    """
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    n_layers = model.cfg.n_layers
    for idx in tqdm(_batches([len(t) for t in token_lists], batch_size), desc="greedy", disable=not progress, leave=False):
        tokens, mask, _ = pad_tokens(model, [token_lists[i] for i in idx], "left")
        cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, len(idx))
        generated, first_logits = [], None
        step_tokens, step_mask = tokens, mask
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                resid = model(step_tokens, stop_at_layer=n_layers, attention_mask=step_mask, past_kv_cache=cache)
                logits = unembed_final(model, resid[:, -1])
                first_logits = logits if first_logits is None else first_logits
                next_tok = logits.argmax(-1)
                generated.append(next_tok)
                step_tokens = next_tok[:, None]
                step_mask = torch.ones_like(step_tokens)
        yield idx, first_logits, torch.stack(generated, dim=1).cpu()


def greedy_continuations(
    model: HookedTransformer,
    prompts: Sequence[str],
    max_new_tokens: int = 8,
    batch_size: int = 32,
    progress: bool = True,
) -> list[str]:
    """Greedy (argmax) continuations of each prompt, decoded, in prompt order."""
    out: list[str] = [""] * len(prompts)
    for idx, _, generated in iter_greedy(model, tokenize_prompts(model, prompts), max_new_tokens, batch_size, progress):
        for row, i in enumerate(idx):
            out[i] = model.tokenizer.decode(generated[row].tolist(), skip_special_tokens=True)
    return out


def normalize_answer(text: str) -> str:
    """Lowercase, strip accents and punctuation, collapse whitespace (for alias matching)."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).casefold()
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(text.split())


def mentions_answer(continuation: str, answers: Sequence[str], n_words: int = 5) -> bool:
    """Whether any of ``answers`` appears, as whole words, in the first ``n_words`` words of
    ``continuation`` (after :func:`normalize_answer`)."""
    head = " " + normalize_answer(" ".join(continuation.split()[:n_words])) + " "
    return any(f" {normalize_answer(a)} " in head for a in answers if normalize_answer(a))


# ---------------------------------------------------------------------------------------------
# Scores


MEASURES = ("p_parametric", "p_context", "logit_diff", "context_wins", "acc_parametric", "acc_context")


def score_dataset(
    model: HookedTransformer,
    dataset: ConflictDataset,
    conflict_types: Sequence[str] | None = None,
    batch_size: int = 32,
    progress: bool = True,
    greedy: bool = True,
    max_new_tokens: int = 8,
    n_words: int = 5,
    padding_side: str = "left",
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
      (``max_new_tokens`` tokens).

    ``pivot_table(index=["example", "conflict_type"], columns="measure", values="value")`` gives
    the wide view; :func:`summarize_scores` the means. With ``greedy=True`` and the default left
    padding, the probabilities are read from the first step of the greedy decoding (one forward
    pass per prompt); left and right padding give the same values to 1e-5.
    """
    conflict_types = _conflict_types(dataset, conflict_types)
    check_dataset(model, dataset, conflict_types)
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
        for idx, logits in iter_final_logits(model, token_lists, batch_size, padding_side, progress, desc="score"):
            record(idx, logits)
    if greedy:
        for idx, first_logits, generated in iter_greedy(model, token_lists, max_new_tokens, batch_size, progress):
            if single_pass:
                record(idx, first_logits)
            for row, k in enumerate(idx):
                continuations[k] = model.tokenizer.decode(generated[row].tolist(), skip_special_tokens=True)
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
    frames = [base.assign(measure=m, value=values[m]) for m in measures]
    return pd.concat(frames, ignore_index=True)


def summarize_scores(scores: pd.DataFrame, by: Sequence[str] = ("relation", "conflict_type")) -> pd.DataFrame:
    """Mean, standard deviation and count of every measure, per group (default: relation x
    conflict type), in canonical conflict-type order."""
    table = (
        scores.groupby([*by, "measure"], sort=False)["value"]
        .agg(mean="mean", std="std", n="count")
        .reset_index()
    )
    if "conflict_type" in table:
        order = {c: k for k, c in enumerate(CONFLICT_TYPES)}
        table = table.sort_values(
            [*by, "measure"], key=lambda s: s.map(order).fillna(len(order)) if s.name == "conflict_type" else s
        ).reset_index(drop=True)
    return table

