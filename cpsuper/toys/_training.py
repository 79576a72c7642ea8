"""Shared pieces of the toy-model training loops: a run record with in-memory checkpoints.

A :class:`ToyRun` keeps ``(step, state_dict)`` pairs and a tidy DataFrame of probes measured at
those steps, and saves to / loads from one ``torch.save`` file (loadable with
``weights_only=True``: only tensors, numbers, strings and plain containers are stored).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch
from torch import Tensor

__all__ = ["ToyRun", "checkpoint_steps", "snapshot"]


def checkpoint_steps(steps: int, every: int, extra: Iterable[int] = ()) -> list[int]:
    """Steps at which a run records a checkpoint: 0, every ``every`` steps, the last step, plus
    ``extra`` (early steps, where the fastest dynamics happen), sorted and deduplicated."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}.")
    if every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {every}.")
    out = set(range(0, steps + 1, every)) | {steps}
    out |= {int(s) for s in extra if 0 <= int(s) <= steps}
    return sorted(out)


def snapshot(module: torch.nn.Module) -> dict[str, Tensor]:
    """A detached CPU copy of a module's state dict (safe to keep while training continues)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


@dataclass
class ToyRun:
    """The record of one toy training run.

    ``checkpoints`` are ``(step, state_dict)`` pairs in step order; ``probes`` is a tidy
    DataFrame with at least the columns ``step, measure, value``; ``extras`` holds any other
    tensors the run needs to be rebuilt (e.g. the data distribution). Subclasses set
    ``config_cls`` so that :meth:`load` can rebuild the configuration.
    """

    config: Any
    checkpoints: list[tuple[int, dict[str, Tensor]]] = field(default_factory=list)
    probes: pd.DataFrame = field(default_factory=pd.DataFrame)
    extras: dict[str, Tensor] = field(default_factory=dict)

    config_cls: ClassVar[type | None] = None

    @property
    def steps(self) -> list[int]:
        """The checkpointed steps, in order."""
        return [step for step, _ in self.checkpoints]

    def state_at(self, step: int | None = None) -> dict[str, Tensor]:
        """The state dict saved at ``step`` (the last checkpoint when ``None``)."""
        if not self.checkpoints:
            raise ValueError("This run has no checkpoints.")
        if step is None:
            return self.checkpoints[-1][1]
        for saved, state in self.checkpoints:
            if saved == step:
                return state
        raise KeyError(f"No checkpoint at step {step}; checkpointed steps are {self.steps}.")

    def save(self, path: str | Path) -> None:
        """Write the run (config, checkpoints, probes) to ``path`` with ``torch.save``."""
        payload = {
            "kind": type(self).__name__,
            "config": dataclasses.asdict(self.config),
            "checkpoints": [(int(step), state) for step, state in self.checkpoints],
            "probes": {"columns": list(self.probes.columns), "data": self.probes.to_dict("list")},
            "extras": dict(self.extras),
        }
        torch.save(payload, Path(path))

    @classmethod
    def load(cls, path: str | Path) -> ToyRun:
        """Read a run written by :meth:`save` (of this same run class)."""
        payload = torch.load(Path(path), map_location="cpu", weights_only=True)
        if payload.get("kind") != cls.__name__:
            raise ValueError(f"{path} holds a {payload.get('kind')!r}, not a {cls.__name__!r}.")
        config = cls.config_cls(**_tuples(payload["config"])) if cls.config_cls else payload["config"]
        probes = pd.DataFrame(payload["probes"]["data"], columns=payload["probes"]["columns"])
        checkpoints = [(int(step), state) for step, state in payload["checkpoints"]]
        return cls(config=config, checkpoints=checkpoints, probes=probes, extras=payload.get("extras", {}))


def _tuples(config: dict) -> dict:
    """Lists back to tuples (``dataclasses.asdict`` keeps tuples, ``torch.load`` may not)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
