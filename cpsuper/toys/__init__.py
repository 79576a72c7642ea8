"""Toy models that train on a CPU in minutes and reproduce the papers' mechanisms.

- :mod:`cpsuper.toys.noisy_recall`: noisy in-context recall in a two-layer transformer; the
  noise is stored in the second MLP (truncation paper, section 4).
- :mod:`cpsuper.toys.associative_memory`: a linear associative memory with a shared noise token;
  low-rank truncation recovers the clean labels (truncation paper, section 5).
- :mod:`cpsuper.toys.inversion`: one-layer context-parametric inversion; context reliance rises,
  then falls (context-parametric inversion paper).
- :mod:`cpsuper.toys.finetuning`: finetuning on well-known vs less-known facts (factual
  knowledge extraction paper).
- :mod:`cpsuper.toys.juice_theory`: the JuICE paper's two-layer theory model, where running once
  and running twice differ in closed form.
- :mod:`cpsuper.toys.juice_learning`: the theory model's second layer trained from zero by gradient
  descent on recall and induction (Proposition 5.3).
- :mod:`cpsuper.toys.noisy_recall_variants`, :mod:`cpsuper.toys.margins`: the truncation paper's
  variants (extra triggers, feed-forward kinds, value truncation) and its one-step margin bounds.
- :mod:`cpsuper.toys.finetuning_sweeps`, :mod:`cpsuper.toys.finetuning_salience`: the finetuning
  toy swept over the Zipf exponent and the pretraining length, and its salience, relevance and
  attention-imbalance probes (sections 3 and 4 of the factual knowledge extraction paper).
- :mod:`cpsuper.toys.inversion_subject`: the inversion toy with memorized subject-only points
  (Proposition 2 of the context-parametric inversion paper).

Each module is used through its own namespace (``from cpsuper.toys import inversion``).
:mod:`cpsuper.toys.common` holds what they share (checkpoint schedules and snapshots, run records,
the one-head attention model and its training loop) and :mod:`cpsuper.toys.build` builds their models
on either TransformerLens backend; their figures are in :mod:`cpsuper.plots.toys`.
"""

from . import (
    associative_memory,
    finetuning,
    finetuning_salience,
    finetuning_sweeps,
    inversion,
    inversion_subject,
    juice_learning,
    juice_theory,
    margins,
    noisy_recall,
    noisy_recall_variants,
)

__all__ = [
    "associative_memory",
    "finetuning",
    "finetuning_salience",
    "finetuning_sweeps",
    "inversion",
    "inversion_subject",
    "juice_learning",
    "juice_theory",
    "margins",
    "noisy_recall",
    "noisy_recall_variants",
]
