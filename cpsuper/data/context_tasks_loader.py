"""The shipped context-direction tasks: the JuICE paper's Table 4 layout, written for cpsuper.

Five files under ``cpsuper/data/context_tasks/``, read by the existing loaders:

- four in the MemoTrap format (``prompt``, ``classes``, ``answer_index``), read by
  :func:`~cpsuper.load_memotrap`: ``proverb_ending`` (150 items), ``proverb_translation`` (81),
  ``hate_speech_ending`` (67; civil wording, see ``docs/context_tasks.md``) and
  ``history_of_science_qa`` (68);
- one in the NQ-Swap format (``question``, ``sub_context``, ``sub_answer``, ``org_answer``), read
  by :func:`~cpsuper.load_nqswap`: ``nq_swap`` (69 items).

In every task the instructed or substituted answer is the *context* answer and the memorised one
the *parametric* answer, so the datasets serve steering toward the context.
"""

from __future__ import annotations

from pathlib import Path

from .examples import ConflictDataset
from .loaders import load_memotrap, load_nqswap

__all__ = ["CONTEXT_TASK_KINDS", "load_context_tasks"]

CONTEXT_TASKS_DIR = Path(__file__).parent / "context_tasks"

MEMOTRAP_KINDS = ("proverb_ending", "proverb_translation", "hate_speech_ending", "history_of_science_qa")
CONTEXT_TASK_KINDS = (*MEMOTRAP_KINDS, "nq_swap")


def load_context_tasks(kind: str) -> ConflictDataset:
    """One shipped context-direction task as a :class:`~cpsuper.ConflictDataset`.

    ``kind`` is one of ``CONTEXT_TASK_KINDS``: the four MemoTrap-style tasks
    (``"proverb_ending"``, ``"proverb_translation"``, ``"hate_speech_ending"``,
    ``"history_of_science_qa"``; relation and dataset name are the kind) or ``"nq_swap"``
    (relation ``"nq_swap"``). Proverb ending is the paper's head-identification task for the
    context direction; the others are for evaluation.
    """
    if kind not in CONTEXT_TASK_KINDS:
        raise ValueError(f"Unknown context task {kind!r}; choose one of {list(CONTEXT_TASK_KINDS)}.")
    path = CONTEXT_TASKS_DIR / f"{kind}.csv"
    if kind == "nq_swap":
        return load_nqswap(path)
    return load_memotrap(path, relation=kind)
