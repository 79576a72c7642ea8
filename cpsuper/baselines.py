"""Baselines JuICE is compared with, and accuracy evaluation across methods.

Every method answers ``logits_for(dataset, conflict_type)`` (last-position logits) and
``generate_for(dataset, conflict_type, max_new_tokens)`` (greedy continuations); :class:`JuICE`
does too. :func:`evaluate` runs any of them on datasets and conflict types.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model
from .data.examples import TARGETS, ConflictDataset
from .decoding import Steering, greedy_batches, iter_final_logits, iter_greedy
from .juice import JuICE
from .path_patching import patching_roles, path_patching
from .reading import mentions_answer, stop_once_settled
from .runtime import check_conflict_datasets, check_finite, check_flag, check_model, length_batches, tokenize_prompts
from .scoring import final_logits, greedy_groups, stop_on_text
from .stats import bootstrap_summary, macro_average_ci

Request: TypeAlias = tuple[ConflictDataset, str]
"""A ``(dataset, conflict_type)`` to generate continuations for."""
StopWhen: TypeAlias = Callable[[int, str], bool]
"""``stop_when(k, text)``: True once prompt ``k``'s continuation holds all the caller reads."""

__all__ = [
    "CAD",
    "KnockoutPruning",
    "Original",
    "PH3",
    "PromptInstruction",
    "evaluate",
    "evaluation_intervals",
    "evaluation_table",
]


@dataclass
class Original:
    """The unmodified model."""

    model: Model
    direction: str = "parametric"

    batch_size: int = 32

    def __post_init__(self):
        check_model(self.model)

    def _prompts(self, dataset: ConflictDataset, conflict_type: str) -> list[str]:
        return dataset.prompts(conflict_type)

    def _steering(self) -> Steering | None:
        return None

    def plain_prompts(self, dataset: ConflictDataset, conflict_type: str) -> list[str] | None:
        """The prompts of a request this method decodes exactly as the unmodified model does (plain
        greedy decoding), or None: :func:`evaluate` decodes such prompts once for every method."""
        return self._prompts(dataset, conflict_type) if self._steering() is None else None

    def logits_for(self, dataset: ConflictDataset, conflict_type: str) -> Float[Tensor, "n d_vocab"]:
        prompts = self._prompts(dataset, conflict_type)
        return final_logits(self.model, prompts, batch_size=self.batch_size, progress=False, steering=self._steering())

    def generate_for(self, dataset: ConflictDataset, conflict_type: str, max_new_tokens: int = 8) -> list[str]:
        return self.generate_many([(dataset, conflict_type)], max_new_tokens)[0]

    def generate_many(
        self, requests: Sequence[Request], max_new_tokens: int = 8, stop_when: StopWhen | None = None
    ) -> list[list[str]]:
        """:meth:`generate_for` of every ``(dataset, conflict_type)`` request, decoded in shared
        batches; one list of continuations per request. ``stop_when(k, text)`` (``k`` counts the
        requests' prompts in order) ends a continuation once the caller has what it reads."""
        prompt_groups = [self._prompts(d, c) for d, c in requests]
        return greedy_groups(
            self.model, prompt_groups, max_new_tokens, self.batch_size, steering=self._steering(), stop_when=stop_when
        )


# Instruction prefixes of the JuICE paper's "Prompt" baseline, by direction and by whether the
# conflict is a sentence to complete (clean, substitution) or a passage with a question (coherent).
INSTRUCTIONS = {
    ("parametric", "sentence"): "Ignore the preceding statement and rely only on your pre-trained knowledge. "
    "Complete the sentence accurately based on your memory of the world:",
    ("parametric", "passage"): "The following passage contains misleading information. Ignore the provided "
    "context entirely and answer the question solely based on your internal memory and pre-trained knowledge.",
    ("context", "passage"): "Please answer the following question based on the given context, ignoring your "
    "internal memory.",
    ("context", "sentence"): "Please complete the sentence below solely relying on the provided statement, "
    "ignoring your internal memory.",
}


@dataclass
class PromptInstruction(Original):
    """The JuICE paper's "Prompt" baseline: the paper's instruction toward ``direction`` is
    prefixed only where a context conflicts (every conflict type but ``"clean"``); clean prompts
    run unchanged, so on them the method equals :class:`Original`."""

    def _prompts(self, dataset: ConflictDataset, conflict_type: str) -> list[str]:
        prompts = dataset.prompts(conflict_type)
        if conflict_type == "clean":
            return prompts
        kind = "passage" if conflict_type == "coherent" else "sentence"
        instruction = INSTRUCTIONS[(self.direction, kind)]
        return [f"{instruction} {p}" for p in prompts]


@dataclass
class CAD(Original):
    """Context-aware decoding: ``(1 + alpha) * logits(prompt) - alpha * logits(prompt without
    its context)``. The context-free prompt is the example's *clean* prompt (the context is
    really removed). ``alpha = 0`` is plain decoding; ``alpha > 0`` favours the context."""

    alpha: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        self.alpha = check_finite(self.alpha, "alpha")

    def _logits(self, token_lists: list[list[int]]) -> Tensor:
        out = torch.empty((len(token_lists), self.model.cfg.d_vocab_out))
        for idx, logits in iter_final_logits(self.model, token_lists, batch_size=self.batch_size, progress=False):
            out[idx] = logits.float().cpu()
        return out

    def _pair_logits(self, with_context: list[list[int]], without: list[list[int]]) -> Tensor:
        alpha = check_finite(self.alpha, "alpha")  # again: it may have been set after construction
        return (1 + alpha) * self._logits(with_context) - alpha * self._logits(without)

    def _token_lists(self, dataset, conflict_type):
        if "clean" not in dataset.conflict_types:
            raise ValueError("CAD needs each example's clean prompt (the prompt without its context).")
        return tokenize_prompts(self.model, dataset.prompts(conflict_type)), tokenize_prompts(
            self.model, dataset.prompts("clean")
        )

    def logits_for(self, dataset, conflict_type):
        return self._pair_logits(*self._token_lists(dataset, conflict_type))

    def plain_prompts(self, dataset, conflict_type):
        """A clean prompt is its own context-free twin: plain greedy decoding (see generate_many)."""
        return dataset.prompts(conflict_type) if conflict_type == "clean" else None

    def generate_many(self, requests, max_new_tokens=8, stop_when=None):
        """Paired greedy decoding: each prompt and its context-free twin are rows of one batch,
        each with its key-value cache, and both take the token the contrasted logits pick (so a
        pair finishes together under ``stop_when``, and leaves the batch together).

        A prompt that is its own context-free twin (a clean prompt) decodes alone: its contrasted
        logits are ``(1 + alpha) * l - alpha * l = l``, plain greedy decoding."""
        alpha = check_finite(self.alpha, "alpha")  # again: it may have been set after construction
        finished = stop_on_text(self.model, stop_when)
        with_context, without, sizes = [], [], []
        for dataset, conflict_type in requests:
            a, b = self._token_lists(dataset, conflict_type)
            with_context += a
            without += b
            sizes.append(len(a))
        generated: list[list[int]] = [[] for _ in with_context]
        twin_free = [a == b for a, b in zip(with_context, without)]  # a clean prompt is its own twin
        alone = [i for i, same in enumerate(twin_free) if same]
        for idx, _, tokens in iter_greedy(
            self.model,
            [with_context[i] for i in alone],
            max_new_tokens=max_new_tokens,
            batch_size=self.batch_size,
            progress=False,
            finished=None if finished is None else (lambda k, ids: finished(alone[k], ids)),
        ):
            for k, ids in zip(idx, tokens):
                generated[alone[k]] = ids
        paired = [i for i, same in enumerate(twin_free) if not same]
        m = len(paired)  # a batch holds pairs: its with-context rows, then their twins (indices + m)
        pair_tokens = [with_context[i] for i in paired] + [without[i] for i in paired]
        batches = [b + [j + m for j in b] for b in length_batches([len(t) for t in pair_tokens[:m]], self.batch_size)]

        def pick(logits):  # the pairs still decoding: with-context rows, then their twins
            half = logits.shape[0] // 2
            token = ((1 + alpha) * logits[:half] - alpha * logits[half:]).argmax(-1)
            return torch.cat([token, token])

        pair_finished = None if finished is None else (lambda j, ids: finished(paired[j % m], ids))
        for batch, _, tokens in greedy_batches(
            self.model, pair_tokens, batches, max_new_tokens=max_new_tokens, pick=pick, finished=pair_finished
        ):
            for j, ids in zip(batch, tokens):
                if j < m:
                    generated[paired[j]] = ids
        texts = iter(self.model.tokenizer.decode(t, skip_special_tokens=True) for t in generated)
        return [list(itertools.islice(texts, size)) for size in sizes]


@dataclass
class KnockoutPruning(Original):
    """Head pruning ranked by knockouts (cpsuper's earlier stand-in for PH3, not Jin et al.'s
    method): rank heads by how much knocking each out alone raises the ``direction`` answer's
    first-token probability on a development set (summed over its conflict types), then knock
    out the top ``k`` together, with ``k`` chosen from ``ks`` by validation accuracy.

    :class:`PH3` differs only in the ranking: path patching to the logits instead of knockouts.
    """

    ks: Sequence[int] = (1, 3, 5, 7, 9, 15)
    heads: list = field(default_factory=list)
    k: int = 0
    tuning: pd.DataFrame | None = None

    def rank(self, development: ConflictDataset, progress: bool = True) -> list[tuple[int, int]]:
        """Every head, the first to prune first: by knockout gain on ``development``."""
        from .heads import head_sweep

        sweep = head_sweep(self.model, development, (0.0,), targets=(self.direction,), progress=progress)
        gain = sweep.summary.groupby(["layer", "head"])["delta_mean"].sum().sort_values(ascending=False)
        return [(int(l), int(h)) for l, h in gain.index]

    def fit(self, development: ConflictDataset, validation: ConflictDataset, progress: bool = True) -> KnockoutPruning:
        """Rank the heads on ``development``, then tune ``k`` on ``validation``; returns self."""
        self.heads = self.rank(development, progress)
        rows = []
        for k in self.ks:
            if k > len(self.heads):
                raise ValueError(f"k={k} exceeds the model's {len(self.heads)} heads; shorten ks.")
            self.k = k
            acc = evaluate({type(self).__name__: self}, validation, validation.conflict_types)
            rows.append({"k": k, "accuracy": acc.groupby("conflict_type").correct.mean().sum()})
        self.tuning = pd.DataFrame(rows)
        self.k = int(self.tuning.sort_values("accuracy", ascending=False, kind="stable").iloc[0].k)
        return self

    def _steering(self):
        """The top ``k`` heads knocked out in one pass (JuNe with strength -1)."""
        from .juice import JuICE

        return JuICE(self.model, self.direction, dual_run=False, suppress=self.heads[: self.k], beta_minus=-1.0)


@dataclass
class PH3(KnockoutPruning):
    """PH3 (Jin et al., "Cutting Off the Head Ends the Conflict"): localise memory heads and
    context heads by path patching each head's direct path to the final logits
    (:func:`cpsuper.path_patching.path_patching`: each conflict prompt patched with the head's
    output on the example's clean prompt, parametric-minus-context logit difference, averaged
    over the development set's conflict prompts), then prune the top ``k`` heads of the kind that
    fights ``direction`` (context heads for ``"parametric"``, memory heads for ``"context"``),
    ``k`` tuned on validation from ``ks`` (the paper's grid). ``patching`` keeps every head's mean
    effect and role; heads past the last one of the pruned kind follow in order of effect.

    The original uses a development set of 200 facts; pass the same 4 selection facts as JuICE
    for the small-data variant. The development set needs clean prompts and conflict prompts.
    """

    patching: pd.DataFrame | None = None

    def rank(self, development: ConflictDataset, progress: bool = True) -> list[tuple[int, int]]:
        """Every head, the first to prune first: by path-patching effect on ``development``
        (also kept in ``patching``)."""
        roles = patching_roles(path_patching(self.model, development, progress=progress))
        if self.direction == "context":  # prune memory heads: most negative effect first
            roles = roles.iloc[::-1].reset_index(drop=True)
        self.patching = roles
        return [(int(l), int(h)) for l, h in zip(roles.layer, roles["head"])]


PROTOCOLS = {
    "cpsuper": {"max_new_tokens": 8, "juice_tokens": 8, "n_words": 5, "match": "word"},
    "paper": {"max_new_tokens": 10, "juice_tokens": 15, "n_words": 5, "match": "substring"},
}
"""How :func:`evaluate` reads accuracy. ``"cpsuper"``: an answer among the first 5 words of an
8-token greedy continuation, as whole words. ``"paper"``: the JuICE paper's evaluation, the
answer anywhere in the normalized first 5 words of a 10-token continuation (15 tokens for JuICE
and JuNe). The paper also scores every test fact, known or not: pass an unfiltered test split."""


def evaluate(
    methods: Mapping[str, object],
    datasets: Sequence[ConflictDataset] | ConflictDataset,
    conflict_types: Sequence[str] = ("clean", "substitution", "coherent"),
    max_new_tokens: int | None = None,
    n_words: int | None = None,
    *,
    protocol: str = "cpsuper",
    full_continuations: bool = False,
    progress: bool = False,
) -> pd.DataFrame:
    """Greedy accuracy of every method on every dataset and conflict type, toward each method's
    ``direction``: one row per method x example x conflict type (``correct`` is 0 or 1).

    ``protocol`` (:data:`PROTOCOLS`) sets how many tokens are decoded and how the answer is
    found; ``max_new_tokens`` and ``n_words`` override it. A continuation stops as soon as its
    verdict is settled (:func:`~cpsuper.reading.reading_settled`), so ``continuation`` may be shorter
    than ``max_new_tokens`` tokens; ``correct`` is the same as with full continuations.
    ``full_continuations=True`` decodes every token (slower). ``progress`` shows a bar over methods.

    Requests that several methods decode as the plain model does (``plain_prompts``: Original
    everywhere; Prompt and CAD on clean prompts) are decoded once and shared."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {tuple(PROTOCOLS)}, got {protocol!r}.")
    check_flag(full_continuations, "full_continuations")
    check_flag(progress, "progress")
    example = "pass e.g. {'Original': cp.Original(model)}"
    if not isinstance(methods, Mapping):
        raise TypeError(f"methods must be a mapping of names to methods, got {type(methods).__name__}; {example}.")
    if not methods:
        raise ValueError(f"No methods to evaluate; {example}.")
    datasets = check_conflict_datasets(datasets)  # non-empty, and each dataset holds examples
    reading = PROTOCOLS[protocol]
    n_words = reading["n_words"] if n_words is None else n_words
    match = reading["match"]
    rows = []
    requests = [(dataset, conflict_type) for dataset in datasets for conflict_type in conflict_types]
    plain: dict[tuple, list[str]] = {}  # (prompts, answers read, reading) -> the plain model's continuations
    for name, method in tqdm(methods.items(), desc="methods", disable=not progress):
        if method.direction not in TARGETS:
            raise ValueError(f"Method {name!r} has direction {method.direction!r}; use one of {TARGETS}.")
        tokens = max_new_tokens
        if tokens is None:
            tokens = reading["juice_tokens"] if isinstance(method, JuICE) else reading["max_new_tokens"]
        options = (tokens, n_words, match, full_continuations)
        keys = [_plain_key(method, d, c, options) for d, c in requests]
        todo = [r for r, key in zip(requests, keys) if key is None or key not in plain]
        decoded = iter(_continuations(method, todo, *options))
        continuations = [plain[key] if key in plain else next(decoded) for key in keys]
        plain.update((key, texts) for key, texts in zip(keys, continuations) if key is not None)
        for (dataset, conflict_type), texts in zip(requests, continuations):
            for i, (example, text) in enumerate(zip(dataset, texts)):
                answers = example.expected_answers(method.direction, conflict_type)
                rows.append(
                    {
                        "method": name,
                        "relation": example.relation,
                        "example": i,
                        "subject": example.subject,
                        "conflict_type": conflict_type,
                        "continuation": text,
                        "correct": float(mentions_answer(text, answers, n_words, match=match)),
                    }
                )
    return pd.DataFrame(rows)


def _stops_early(method, full: bool) -> bool:
    """Whether ``method``'s continuations end once their verdict is settled."""
    has_stop = hasattr(method, "generate_many") and "stop_when" in inspect.signature(method.generate_many).parameters
    return has_stop and not full


def _plain_key(method, dataset: ConflictDataset, conflict_type: str, options: tuple) -> tuple | None:
    """What identifies a request's continuations when ``method`` decodes it as the plain model."""
    prompts = method.plain_prompts(dataset, conflict_type) if hasattr(method, "plain_prompts") else None
    if prompts is None:
        return None
    reads = tuple(tuple(ex.expected_answers(method.direction, conflict_type)) for ex in dataset)
    return tuple(prompts), reads, options[:3], _stops_early(method, options[3])


def _continuations(method, requests, max_new_tokens: int, n_words: int, match: str, full: bool) -> list[list[str]]:
    """``method``'s greedy continuations of ``requests``, stopped once settled where it can stop."""
    if not requests:
        return []
    reads = [ex.expected_answers(method.direction, c) for dataset, c in requests for ex in dataset]
    if _stops_early(method, full):
        return method.generate_many(requests, max_new_tokens, stop_when=stop_once_settled(reads, n_words, match=match))
    if hasattr(method, "generate_many"):  # every request in shared batches
        return method.generate_many(requests, max_new_tokens)
    return [method.generate_for(d, c, max_new_tokens) for d, c in requests]  # only the documented generate_for


def evaluation_table(results: pd.DataFrame) -> pd.DataFrame:
    """The paper's layout: methods as rows, (relation, conflict type) accuracy columns, plus the
    average over relations per conflict type and the overall average."""
    table = results.pivot_table(index="method", columns=["relation", "conflict_type"], values="correct", sort=False)
    per_type = (
        results.groupby(["method", "relation", "conflict_type"])["correct"]
        .mean()
        .groupby(["method", "conflict_type"])
        .mean()
        .unstack()
    )
    for conflict_type in per_type.columns:
        table[("average", conflict_type)] = per_type[conflict_type]
    table[("average", "all")] = per_type.mean(axis=1)
    return table


def evaluation_intervals(results: pd.DataFrame, *, n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Accuracy with percentile bootstrap intervals over facts for every method x relation x
    conflict type, plus ``relation == "average"`` rows: the mean over relations (each relation
    weighted equally, facts resampled within each relation), as in :func:`evaluation_table`.

    Columns ``method, relation, conflict_type, mean, ci_low, ci_high, n``; ``cp.stats.format_ci`` /
    ``cp.stats.ci_strings`` turn them into ``"0.53 [0.37, 0.70]"`` cells.
    """
    missing = [c for c in ("method", "relation", "conflict_type", "example", "correct") if c not in results.columns]
    if missing:
        raise ValueError(f"Expected the frame cp.evaluate returns; it lacks the columns {missing}.")
    if results.empty:
        raise ValueError("No evaluation rows: run cp.evaluate on at least one method, dataset and conflict type.")
    cells = bootstrap_summary(
        results, value="correct", by=["method", "relation", "conflict_type"], n_boot=n_boot, ci=ci, seed=seed
    )
    averages = []
    for (method, conflict_type), part in results.groupby(["method", "conflict_type"], sort=False):
        mean, lo, hi, n = macro_average_ci(part, value="correct", stratum="relation", n_boot=n_boot, ci=ci, seed=seed)
        averages.append(
            {"method": method, "relation": "average", "conflict_type": conflict_type}
            | {"mean": mean, "ci_low": lo, "ci_high": hi, "n": n}
        )
    return pd.concat([cells, pd.DataFrame(averages)], ignore_index=True)
