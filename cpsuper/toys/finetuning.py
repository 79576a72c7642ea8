"""One-layer toy of QA finetuning on well-known vs less-known facts.

The setting follows the synthetic experiments and the one-layer analysis of "Understanding Finetuning
for Factual Knowledge Extraction".  Facts are triples ``(s, r, a)`` of single tokens.  Pretraining
shows them as ``(s, r) -> a`` with subjects drawn from a Zipf law (popular subjects are seen often,
the tail rarely) and relations uniformly.  Question answering uses a new prompt token ``p_r`` per
relation that pretraining never shows: ``(s, p_r) -> a``.  Finetuning on QA pairs about some
subjects has to teach the model to answer ``(s, p_r)`` like ``(s, r)``; it is evaluated on the QA
pairs of *held-out* subjects, whose facts were all seen in pretraining.

``FT-Top`` finetunes on the most popular half of the finetuning pool, ``FT-Bottom`` on the least
popular half.  The paper predicts that FT-Top extracts held-out facts better: facts stored weakly in
the subject's value vector (low *salience*) push attention from the subject to ``p_r`` (whose value
vector learns the relation's most common answer, a shortcut), and that shift in ``W_KQ[p_r, p_r]``
applies to every subject.

The model is the paper's: one layer, one head, one-hot token embeddings, identity unembedding, full
trainable ``W_V`` and ``W_KQ`` initialised with variance 1e-3, written as an attention-only
TransformerLens model (see :mod:`cpsuper.toys.common`).  The paper reports no sizes or
optimiser settings for the synthetic experiments; the ones here are ours (see
``docs/toys_training_dynamics.md`` for what they give).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from ..backend import Model
from .common import Trajectory, attention_toy_model, checkpoint_steps, last_position, load_config, train_attention_toy

__all__ = [
    "FinetuningConfig",
    "FinetuningData",
    "FinetuningToy",
    "finetuning_measures",
    "make_finetuning_data",
    "pretraining_measures",
]


SPLITS = ("top", "bottom", "random", "whole")
RUN_NAMES = {"top": "FT-Top", "bottom": "FT-Bottom", "random": "FT-Random", "whole": "FT-Whole"}


@dataclass(frozen=True)
class FinetuningConfig:
    """Sizes, frequencies and optimiser settings of the finetuning toy (all ours: the paper gives none).

    Subjects are ranked by popularity: subject ``i`` is drawn in pretraining with probability
    proportional to ``(i + 1) ** -zipf_alpha``.  Each relation has ``answers_per_relation`` answers
    whose frequencies among subjects fall as ``1 / k ** answer_skew`` (so a relation has a most common
    answer that a shortcut can output).  Half the subjects (a seeded draw) form the finetuning pool,
    the rest are held out for evaluation.  Pretraining is minibatch SGD on freshly sampled triples;
    finetuning is full-batch gradient descent on the chosen split's QA pairs.
    """

    n_subjects: int = 200
    n_relations: int = 4
    answers_per_relation: int = 8
    answer_skew: float = 1.0
    zipf_alpha: float = 1.0
    ft_pool_fraction: float = 0.5
    init_variance: float = 1e-3
    pretrain_steps: int = 2000
    pretrain_batch: int = 32
    pretrain_lr: float = 16.0
    finetune_steps: int = 200
    finetune_lr: float = 8.0
    checkpoint_every: int = 10
    pretrain_checkpoint_every: int = 250
    splits: tuple[str, ...] = ("top", "bottom")
    seed: int = 0

    def __post_init__(self):
        if self.n_subjects < 8 or self.n_relations < 1 or self.answers_per_relation < 2:
            raise ValueError("Need at least 8 subjects, 1 relation and 2 answers per relation.")
        if not 0 < self.ft_pool_fraction < 1:
            raise ValueError(f"ft_pool_fraction must be in (0, 1), got {self.ft_pool_fraction}.")
        bad = [s for s in self.splits if s not in SPLITS]
        if bad:
            raise ValueError(f"Unknown finetuning split(s) {bad}; use any of {SPLITS}.")
        checkpoint_steps(self.finetune_steps, self.checkpoint_every)
        checkpoint_steps(self.pretrain_steps, self.pretrain_checkpoint_every)

    @classmethod
    def larger(cls, **overrides) -> FinetuningConfig:
        """A larger run: 400 subjects, 10 answers per relation, longer pretraining and finetuning,
        and the FT-Random and FT-Whole baselines (a few minutes on one core)."""
        base = cls(
            n_subjects=400,
            answers_per_relation=10,
            pretrain_steps=5000,
            pretrain_checkpoint_every=500,
            finetune_steps=400,
            checkpoint_every=20,
            splits=SPLITS,
        )
        return replace(base, **overrides)


@dataclass(frozen=True, eq=False)
class FinetuningData:
    """Facts, token ids and splits of the finetuning toy.

    Token ids: subjects ``0..S-1`` (in popularity order), relations, answers, then QA prompts
    ``p_r``.  ``answer[s, r]`` is the fact's answer token; ``popularity[s]`` the subject's pretraining
    probability.  ``ft_pool`` / ``eval_subjects`` partition the subjects; ``splits[name]`` are the
    finetuning subjects of each split (``top`` and ``bottom`` are the popular and unpopular halves of
    the pool).
    """

    answer: Int[Tensor, "subject relation"]
    popularity: Float[Tensor, " subject"]
    answer_marginal: Float[Tensor, " answer_rank"]
    relation_tokens: Int[Tensor, " relation"]
    prompt_tokens: Int[Tensor, " relation"]
    answer_tokens: Int[Tensor, "relation answer_rank"]
    ft_pool: Int[Tensor, " n_pool"]
    eval_subjects: Int[Tensor, " n_eval"]
    splits: dict[str, Tensor]
    vocab_size: int

    @property
    def n_subjects(self) -> int:
        return self.answer.shape[0]

    @property
    def n_relations(self) -> int:
        return self.answer.shape[1]

    def examples(
        self, subjects: Tensor, fmt: str = "qa"
    ) -> tuple[Int[Tensor, "n 2"], Int[Tensor, " n"], Int[Tensor, " n"]]:
        """``(tokens, labels, subject)`` for every (subject, relation) of ``subjects``, as
        ``(s, p_r)`` (``fmt="qa"``) or ``(s, r)`` (``fmt="pretrain"``)."""
        if fmt not in ("qa", "pretrain"):
            raise ValueError(f"fmt must be 'qa' or 'pretrain', got {fmt!r}.")
        second = self.prompt_tokens if fmt == "qa" else self.relation_tokens
        s = subjects.repeat_interleave(self.n_relations)
        r = torch.arange(self.n_relations).repeat(len(subjects))
        return torch.stack([s, second[r]], dim=1), self.answer[s, r], s

    def shortcut_answers(self) -> Int[Tensor, " relation"]:
        """Each relation's most common answer (the answer a subject-blind model gives)."""
        counts = torch.stack(
            [torch.bincount(self.answer[:, r], minlength=self.vocab_size) for r in range(self.n_relations)]
        )
        return counts.argmax(1)


def make_finetuning_data(config: FinetuningConfig = FinetuningConfig()) -> FinetuningData:
    """Draw the facts and the finetuning / evaluation split (seeded)."""
    cfg = config
    rng = np.random.default_rng(cfg.seed)
    n_s, n_r, n_a = cfg.n_subjects, cfg.n_relations, cfg.answers_per_relation
    relation_tokens = torch.arange(n_s, n_s + n_r)
    answer_tokens = torch.arange(n_s + n_r, n_s + n_r + n_r * n_a).reshape(n_r, n_a)
    prompt_tokens = torch.arange(n_s + n_r + n_r * n_a, n_s + 2 * n_r + n_r * n_a)
    marginal = 1.0 / np.arange(1, n_a + 1) ** cfg.answer_skew
    marginal /= marginal.sum()
    ranks = rng.choice(n_a, size=(n_s, n_r), p=marginal)
    answer = answer_tokens[torch.arange(n_r), torch.from_numpy(ranks)]
    popularity = 1.0 / np.arange(1, n_s + 1) ** cfg.zipf_alpha
    popularity /= popularity.sum()
    # Split the subjects into a finetuning pool and held-out subjects, both spanning all popularities.
    perm = rng.permutation(n_s)
    n_pool = round(cfg.ft_pool_fraction * n_s)
    pool = torch.from_numpy(np.sort(perm[:n_pool]))
    held_out = torch.from_numpy(np.sort(perm[n_pool:]))
    half = len(pool) // 2
    random_half = torch.from_numpy(np.sort(rng.permutation(pool.numpy())[:half]))
    splits = {"top": pool[:half], "bottom": pool[-half:], "random": random_half, "whole": pool}
    return FinetuningData(
        answer=answer,
        popularity=torch.from_numpy(popularity),
        answer_marginal=torch.from_numpy(marginal),
        relation_tokens=relation_tokens,
        prompt_tokens=prompt_tokens,
        answer_tokens=answer_tokens,
        ft_pool=pool,
        eval_subjects=held_out,
        splits=splits,
        vocab_size=n_s + 2 * n_r + n_r * n_a,
    )


def pretraining_batch(
    data: FinetuningData, batch: int, generator: torch.Generator
) -> tuple[Int[Tensor, "batch 2"], Int[Tensor, " batch"]]:
    """One pretraining minibatch: subjects from the popularity (Zipf) law, relations uniform."""
    s = torch.multinomial(data.popularity, batch, replacement=True, generator=generator)
    r = torch.randint(data.n_relations, (batch,), generator=generator)
    return torch.stack([s, data.relation_tokens[r]], dim=1), data.answer[s, r]


def _initial_model(data: FinetuningData, config: FinetuningConfig) -> Model:
    n = data.vocab_size
    gen = torch.Generator().manual_seed(config.seed)
    std = math.sqrt(config.init_variance)
    w_kq = std * torch.randn(n, n, generator=gen)
    w_v = std * torch.randn(n, n, generator=gen)
    eye = torch.eye(n)
    return attention_toy_model(eye, eye, w_kq, w_v, n_ctx=2, train_kq=True, train_v=True, name="finetuning-toy")


def _scores(model: Model, tokens: Tensor, labels: Tensor):
    logits, pattern = last_position(model, tokens)
    return logits, pattern[:, 0], logits.argmax(-1) == labels


def finetuning_measures(model: Model, data: FinetuningData, split: str | None = None) -> dict[str, float]:
    """QA-format probes on held-out subjects (and on the finetuning split if ``split`` is given).

    * ``acc_eval``: argmax accuracy on ``(s, p_r)`` for held-out subjects; ``acc_eval_top{x}``: the
      same on the ``x`` % most popular held-out subjects;
    * ``attn_subject_eval``: attention from ``p_r`` to the subject on those prompts (mean);
    * ``stored_eval``: accuracy of the same facts in pretraining format ``(s, r)`` (what is stored);
    * ``shortcut_eval``: how often the answer is the relation's most common answer;
    * ``acc_ft`` / ``loss_ft`` / ``attn_subject_ft``: on the finetuning split's QA pairs.
    """
    out = {}
    with torch.no_grad():
        subjects = data.eval_subjects
        tokens, labels, subj = data.examples(subjects, "qa")
        logits, attn, correct = _scores(model, tokens, labels)
        out["acc_eval"] = correct.float().mean().item()
        rank = torch.empty(data.n_subjects, dtype=torch.long)
        rank[subjects] = torch.arange(len(subjects))  # subjects are sorted by popularity
        for pct in (10, 25, 50):
            keep = rank[subj] < max(1, round(len(subjects) * pct / 100))
            out[f"acc_eval_top{pct}"] = correct[keep].float().mean().item()
        out["attn_subject_eval"] = attn.mean().item()
        shortcut = data.shortcut_answers()[tokens[:, 1] - data.prompt_tokens[0]]
        out["shortcut_eval"] = (logits.argmax(-1) == shortcut).float().mean().item()
        p_tokens, p_labels, _ = data.examples(subjects, "pretrain")
        out["stored_eval"] = _scores(model, p_tokens, p_labels)[2].float().mean().item()
        if split is not None:
            f_tokens, f_labels, _ = data.examples(data.splits[split], "qa")
            f_logits, f_attn, f_correct = _scores(model, f_tokens, f_labels)
            out["acc_ft"] = f_correct.float().mean().item()
            out["loss_ft"] = F.cross_entropy(f_logits, f_labels).item()
            out["attn_subject_ft"] = f_attn.mean().item()
    return out


def pretraining_measures(model: Model, data: FinetuningData) -> dict[str, float]:
    """Memorization in pretraining format ``(s, r)``: over all subjects, the finetuning splits and the
    held-out subjects."""
    out = {}
    with torch.no_grad():
        groups = {"all": torch.arange(data.n_subjects), "eval": data.eval_subjects}
        groups.update({f"ft_{k}": data.splits[k] for k in ("top", "bottom")})
        for name, subjects in groups.items():
            tokens, labels, _ = data.examples(subjects, "pretrain")
            out[f"stored_{name}"] = _scores(model, tokens, labels)[2].float().mean().item()
    return out


class FinetuningToy:
    """Pretraining, then QA finetuning on each split, with checkpoints and probes.

    >>> toy = FinetuningToy().train()                 # CI size, well under a minute
    >>> toy.probes                                    # tidy: run, step, measure, value
    >>> toy.model_at("FT-Bottom", 100)                # the model at a checkpoint (either backend)
    >>> cpsuper.plots.toys.plot_finetuning(toy.probes)
    """

    def __init__(self, config: FinetuningConfig = FinetuningConfig()):
        self.config = config
        self.data = make_finetuning_data(config)
        self.runs: dict[str, Trajectory] = {}

    def initial_model(self) -> Model:
        """The randomly initialised model (fresh copy)."""
        return _initial_model(self.data, self.config)

    def train(self, progress: bool = False) -> FinetuningToy:
        """Pretrain, then finetune a copy of the pretrained model on every split in ``config.splits``."""
        self.pretrain(progress=progress)
        for split in self.config.splits:
            self.finetune(split, progress=progress)
        return self

    def pretrain(self, progress: bool = False) -> Trajectory:
        """Minibatch SGD on freshly sampled ``(s, r) -> a`` triples from the initial model."""
        cfg = self.config
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        self.runs["pretrain"] = train_attention_toy(
            self.initial_model().train(),
            lambda: pretraining_batch(self.data, cfg.pretrain_batch, gen),
            lambda model: pretraining_measures(model, self.data),
            run="pretrain",
            steps=cfg.pretrain_steps,
            every=cfg.pretrain_checkpoint_every,
            lr=cfg.pretrain_lr,
            build=self.initial_model,
            progress=progress,
        )
        return self.runs["pretrain"]

    def finetune(self, split: str, progress: bool = False) -> Trajectory:
        """Full-batch gradient descent on the QA pairs of ``split`` from the pretrained model."""
        if split not in SPLITS:
            raise ValueError(f"Unknown split {split!r}; use one of {SPLITS}.")
        if "pretrain" not in self.runs:
            raise RuntimeError("Pretrain first: toy.pretrain() (or toy.train()).")
        cfg = self.config
        name = RUN_NAMES[split]
        tokens, labels, _ = self.data.examples(self.data.splits[split], "qa")
        self.runs[name] = train_attention_toy(
            self.runs["pretrain"].model_at(cfg.pretrain_steps).train(),
            lambda: (tokens, labels),
            lambda model: finetuning_measures(model, self.data, split),
            run=name,
            steps=cfg.finetune_steps,
            every=cfg.checkpoint_every,
            lr=cfg.finetune_lr,
            build=self.initial_model,
            progress=progress,
        )
        return self.runs[name]

    def measure(self, model: Model) -> dict[str, float]:
        """:func:`finetuning_measures` on this toy's held-out subjects."""
        return finetuning_measures(model, self.data)

    @property
    def probes(self) -> pd.DataFrame:
        """All runs' probes in one tidy table (pretraining and every finetuning split)."""
        if not self.runs:
            raise RuntimeError("Train the toy first: FinetuningToy(config).train().")
        return pd.concat([t.probes for t in self.runs.values()], ignore_index=True)

    def model_at(self, run: str, step: int) -> Model:
        """The model of ``run`` (``"pretrain"``, ``"FT-Top"``, ...) at checkpoint ``step``."""
        if run not in self.runs:
            raise KeyError(f"No run {run!r}; trained runs: {list(self.runs)}.")
        return self.runs[run].model_at(step)

    def model_factories(self, run: str):
        """``[(step, make_model), ...]`` for every checkpoint of ``run``."""
        return self.runs[run].model_factories()

    def save(self, path) -> None:
        """Config and every run's checkpoints and probes in one ``torch.save`` file."""
        cfg = asdict(self.config)
        torch.save({"config": cfg, "runs": {k: t.to_dict() for k, t in self.runs.items()}}, path)

    @classmethod
    def load(cls, path) -> FinetuningToy:
        """Read a toy written by :meth:`save`."""
        blob = torch.load(path, weights_only=True)
        toy = cls(load_config(FinetuningConfig, blob["config"]))
        for name, run in blob["runs"].items():
            toy.runs[name] = Trajectory.from_dict(run, toy.initial_model)
        return toy
