"""Sweeps sharded over processes with ``torch.distributed``.

Launch a script with ``torchrun --nproc-per-node N script.py`` and call :func:`init_distributed`
at its top: from then on every sweep (head sweeps, knockouts, JuICE stage 1, PH3's ranking,
truncation sweeps: everything that goes through :func:`cpsuper.engine.run_conditions`) splits its
conditions over the ranks, round-robin so that early- and late-layer edits (which differ in cost)
are spread evenly, and every rank gets back the whole result, equal to a single-process run.
Write files from one rank only (:func:`is_main_process`)::

    import cpsuper as cp
    cp.distributed.init_distributed()                  # gloo on CPU, NCCL when each rank has a GPU
    model = cp.load_model(device=cp.distributed.local_device())
    sweep = cp.head_sweep(model, data)     # each rank runs 1/N of the heads
    if cp.distributed.is_main_process():
        sweep.summary.to_csv("sweep.csv")

A rank that raises mid-sweep does not leave the others waiting: every rank receives its error
and raises a :class:`ShardFailed` naming it, and no rank returns a partial result. (A rank that
dies outright is torchrun's to handle: it stops the other workers.)
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ShardFailed",
    "init_distributed",
    "is_main_process",
    "local_device",
    "on_every_rank",
    "run_sharded",
    "sharding",
    "world",
]

_local_depth = 0


class ShardFailed(RuntimeError):
    """One or more ranks raised while computing their share of a sharded sweep."""


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the current process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """True on rank 0 and in a plain (non-distributed) run: the process that writes files."""
    return world()[0] == 0


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group that ``torchrun`` describes in the environment; returns
    ``(rank, world size)``. ``backend`` defaults to NCCL when CUDA is available, gloo otherwise.
    Without torchrun's variables (a plain ``python`` run) nothing happens and ``(0, 1)`` comes back."""
    if dist.is_initialized():
        return world()
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    if not dist.is_available():
        raise RuntimeError("This torch build has no torch.distributed; install a build that has it to shard sweeps.")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs a GPU per rank; use backend='gloo' on CPU.")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    # Leave the group before the interpreter tears down: a gloo group still alive at exit can
    # abort the process ("terminate called without an active exception") after its work is done.
    atexit.register(_leave_group)
    return world()


def _leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def on_every_rank(flag: bool) -> bool:
    """True when ``flag`` holds on every rank (so that all ranks take the same branch); ``flag``
    itself without a process group."""
    if world()[1] == 1:
        return flag
    value = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def local_device() -> str:
    """This rank's GPU (``cuda:LOCAL_RANK``) when there are GPUs, else ``"cpu"``."""
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"
    return "cpu"


def sharding() -> bool:
    """Whether a sweep started now would be split over ranks (a group of two or more, and not
    already inside a rank's own share)."""
    return world()[1] > 1 and _local_depth == 0


@contextlib.contextmanager
def _local() -> Iterator[None]:
    global _local_depth
    _local_depth += 1
    try:
        yield
    finally:
        _local_depth -= 1


def run_sharded(
    compute: Callable[[list], tuple[torch.Tensor, torch.Tensor]], conditions: Sequence
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``compute(part)`` on this rank's round-robin share ``part`` of ``conditions`` and gather.

    ``compute`` returns ``(clean, swept)`` with ``swept[:, j]`` the values of ``part[j]``; the
    result is ``(clean, swept)`` over all conditions, in their order, on every rank. ``clean``
    (the same on every rank) comes from rank 0.
    """
    n_conditions = len(conditions)
    rank, size = world()
    if size > n_conditions:
        raise ValueError(
            f"{size} ranks for {n_conditions} sweep conditions: some ranks would have nothing to do. "
            f"Launch at most {n_conditions} processes (torchrun --nproc-per-node)."
        )
    mine = list(range(rank, n_conditions, size))
    try:
        with _local():
            clean, swept = compute([conditions[i] for i in mine])
        payload: Any = ("ok", mine, clean.cpu(), swept.cpu())
    except Exception as error:  # reported to every rank below, then raised everywhere
        payload = ("error", f"{type(error).__name__}: {error}")
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, payload)
    failed = [(r, p[1]) for r, p in enumerate(gathered) if p[0] == "error"]
    if failed:
        lines = "; ".join(f"rank {r}: {message}" for r, message in failed)
        raise ShardFailed(f"A sharded sweep failed on {len(failed)} of {size} ranks ({lines}); nothing was returned.")
    clean = gathered[0][2]
    swept = torch.empty((clean.shape[0], n_conditions, *gathered[0][3].shape[2:]), dtype=gathered[0][3].dtype)
    for _, indices, _, part in gathered:
        swept[:, indices] = part
    return clean, swept
