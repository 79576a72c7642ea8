"""Where models come from: the default model's names, cpsuper's cache folder, the Hugging Face
hub switches, and the error raised when a model cannot be had on this machine.

The bottom of model loading: :mod:`cpsuper.embedded`, :mod:`cpsuper.bridge`, :mod:`cpsuper.tiny`
and :mod:`cpsuper.models` import from here and never the other way round.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings
from pathlib import Path
from types import MappingProxyType

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_TL_NAME",
    "ModelUnavailableError",
    "WEIGHT_PROCESSING",
    "cache_dir",
    "hub_offline",
    "hub_reachable",
    "in_local_cache",
    "quiet_deprecation",
]

DEFAULT_MODEL = "gemma-3-270m"
EMBEDDED_TL_NAME = "google/gemma-3-270m"

WEIGHT_PROCESSING = MappingProxyType({"fold_ln": True, "center_writing_weights": True, "center_unembed": False})
"""TransformerLens weight processing on both backends (read-only). Norms are folded into the following weights
(TransformerLens's default); the unembedding is *not* centred, so that raw logits equal the Hugging
Face model's and not just their softmax (direct logit attributions and logit columns then agree
between backends)."""


class ModelUnavailableError(RuntimeError):
    """A model cannot be had on this machine (not installed, not cached, and no network)."""


def cache_dir() -> Path:
    """Where cpsuper keeps converted models and cached results (``$CPSUPER_CACHE`` overrides)."""
    root = os.environ.get("CPSUPER_CACHE")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cpsuper"


@contextlib.contextmanager
def quiet_deprecation():
    """Silence TransformerLens 3.x's notice that HookedTransformer goes away in 4.0: the reference
    backend is 3.x on purpose (the ``hooked`` extra)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="HookedTransformer is deprecated", category=DeprecationWarning)
        yield


def in_local_cache(repo: str) -> bool:
    """Whether the local Hugging Face cache holds a configuration of ``repo`` at any revision (a
    training checkpoint such as Pythia's ``step1000`` is a revision of its own)."""
    from huggingface_hub import constants

    # the cache's layout: one snapshot folder per downloaded revision, ``main`` included
    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "snapshots"
    return any(snapshots.glob("*/config.json"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within ``timeout`` seconds."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0]
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def hub_offline():
    """Temporarily forbid Hugging Face network calls (everything needed is local)."""
    import huggingface_hub.constants as hub_constants

    old_env = os.environ.get("HF_HUB_OFFLINE")
    old_const = hub_constants.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = old_const
        if old_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_env
