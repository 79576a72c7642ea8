"""Tiny random models for tests and toys: a real HookedTransformer built from a config in
milliseconds, with a small BPE tokenizer trained on built-in text (no hub, no files)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Literal

import torch

from .backend import HookedTransformer, HookedTransformerConfig, Model, check_backend
from .grouped_attention import grouped_attention
from .hub import quiet_deprecation
from .runtime import check_positive_int
from .weight_layout import fast_weight_layout

__all__ = ["tiny_model", "tiny_tokenizer"]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer(vocab_size: int = 1024):
    """A small byte-level BPE tokenizer trained on cpsuper's built-in relation files.

    Needs no network and is deterministic. Every text is encodable (byte fallback). A ``<bos>``
    token is prepended, as Gemma's tokenizer does.
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    corpus = _tiny_corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        add_bos_token=True,
        name_or_path="cpsuper-tiny",
    )
    return fast


def _tiny_corpus() -> list[str]:
    """The relation files' lines: facts and base templates only, so that adding a wording family
    to a relation leaves the tiny tokenizer (and every tiny model's numbers) as they were."""
    folder = Path(__file__).parent / "data" / "relations"
    lines = []
    for file in sorted(folder.glob("*.csv")):
        lines.extend(file.read_text(encoding="utf-8").splitlines())
    for file in sorted(folder.glob("*.json")):
        templates = {k: v for k, v in json.loads(file.read_text(encoding="utf-8")).items() if k != "families"}
        lines.extend(json.dumps(templates, indent=2, ensure_ascii=False).splitlines())
    return lines


def tiny_model(
    kind: Literal["gemma", "gpt2"] = "gemma",
    n_layers: int = 3,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str | None = None,
    process_weights: bool | None = None,
) -> Model:
    """A tiny randomly initialised model with a network-free tokenizer (for tests and examples).

    ``"gemma"``: RMSNorm before *and* after attention and MLP, grouped-query attention (4 query
    heads sharing 2 KV heads), rotary positions, gated MLP, no biases — Gemma-3's shape.
    ``"gpt2"``: LayerNorm, learned positions, one KV head per query head, biases everywhere.

    ``backend``: ``"hooked"`` (a HookedTransformer built from a config, TransformerLens 3.x) or
    ``"bridge"`` (the same shapes as a Hugging Face model in a TransformerBridge, TransformerLens
    >= 4.3); ``None`` picks what the installed TransformerLens has. ``process_weights`` says whether a
    bridge's weights are processed (:func:`cpsuper.bridge.compatible`; by default only where that
    changes cpsuper's results, the tiny GPT-2); a HookedTransformer built from a config has nothing
    to process.
    """
    if kind not in ("gemma", "gpt2"):
        raise ValueError(f"Unknown tiny model kind {kind!r}; use 'gemma' or 'gpt2'.")
    n_layers = check_positive_int(n_layers, "n_layers")
    tokenizer = tiny_tokenizer()
    if check_backend(backend) == "bridge":
        from .bridge import boot_bridge, tiny_hf_model

        ids = {f"{t}_token_id": tokenizer.convert_tokens_to_ids(f"<{t}>") for t in ("pad", "bos", "eos")}
        hf_model = tiny_hf_model(kind, len(tokenizer), n_layers, seed, **ids).to(device=device, dtype=dtype)
        return boot_bridge(
            hf_model, tokenizer, name=f"tiny-{kind}", device=device, dtype=dtype, process_weights=process_weights
        )
    common = {
        "n_layers": n_layers,
        "d_model": 64,
        "d_head": 16,
        "n_heads": 4,
        "d_mlp": 128,
        "n_ctx": 256,
        "d_vocab": len(tokenizer),
        "seed": seed,
        "device": str(device),
        "dtype": dtype,
        "default_prepend_bos": True,
        "tokenizer_prepends_bos": True,
    }
    if kind == "gemma":
        cfg = HookedTransformerConfig(
            **common,
            act_fn="gelu_pytorch_tanh",
            normalization_type="RMS",
            use_normalization_before_and_after=True,
            positional_embedding_type="rotary",
            rotary_dim=16,
            n_key_value_heads=2,
            gated_mlp=True,
            final_rms=True,
            original_architecture="Gemma3ForCausalLM",
            model_name="tiny-gemma",
        )
    elif kind == "gpt2":
        cfg = HookedTransformerConfig(
            **common,
            act_fn="gelu_new",
            normalization_type="LN",
            positional_embedding_type="standard",
            original_architecture="GPT2LMHeadModel",
            model_name="tiny-gpt2",
        )
    else:
        raise ValueError(f"Unknown tiny model kind {kind!r}; use 'gemma' or 'gpt2'.")
    with quiet_deprecation():
        model = HookedTransformer(cfg, tokenizer=tokenizer)
    if kind == "gemma":
        _randomize_norm_weights(model, seed)
    else:
        _randomize_biases(model, seed)
    return fast_weight_layout(grouped_attention(model)).eval()


def _randomize_norm_weights(model: Model, seed: int) -> None:
    """Random RMSNorm gains, so that tests notice a norm that is skipped or applied twice."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ln" in name or name.startswith("ln_final"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))


def _randomize_biases(model: Model, seed: int) -> None:
    """Non-zero biases, so that tests notice a bias that is dropped or counted twice."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.split(".")[-1].startswith("b_"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
