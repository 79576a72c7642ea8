"""Benchmark: JuICE stage 1 and a full head heatmap on randomly initialised models with the real
shapes of Gemma-2-2B and Llama-3-8B (no weights are needed to measure speed and memory).

For each workload it reports wall time, the floating-point operations the sweep engine executed
(counted by ``torch.utils.flop_counter``), the achieved rate, that rate as a fraction of the
device's measured matmul peak in the same dtype (the FLOP floor is ``flops / peak``; a fraction of
1 would be a sweep that does nothing but arithmetic), and peak memory (GPU: allocated by torch;
CPU: the process's peak resident set). Workloads, as the paper runs them on ``--facts`` facts:

- ``stage1``: the sweep of :func:`cpsuper.identify_heads` with the paper's scale grids (every
  query head x 8 scales x 3 conflict types);
- ``heatmap``: :func:`cpsuper.head_sweep`, every query head knocked out, 3 conflict types.

Run: ``python benchmarks/bench_big_models.py --config llama-3-8b`` on a GPU (it picks ``cuda``
and bf16 when there is one); ``--config tiny`` is the CPU smoke run that the tests execute. It
prints one JSON object (also written to ``--out``). ``--backend`` picks the model class as
``cp.load_model`` does (default: what the installed TransformerLens has): a HookedTransformer
built from the shape, or a TransformerBridge around the Hugging Face model class of the same shape
(``transformers``' own random initialisation).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import pandas as pd
import torch
from torch.utils.flop_counter import FlopCounterMode

import cpsuper as cp
from cpsuper.backend import HookedTransformer, HookedTransformerConfig, Model, check_backend, is_bridge
from cpsuper.edits import HeadEdit
from cpsuper.hub import quiet_deprecation
from cpsuper.identification import NEG_GRID, POS_GRID
from cpsuper.sweeps import sweep_dataset
from cpsuper.tiny import tiny_tokenizer

_RMS_ROTARY_GATED = {
    "normalization_type": "RMS",
    "positional_embedding_type": "rotary",
    "gated_mlp": True,
    "final_rms": True,
}
CONFIGS: dict[str, dict] = {
    # Published shapes (Hugging Face config.json of each model); n_ctx only bounds the prompts here.
    "gemma-2-2b": {
        **_RMS_ROTARY_GATED,
        "n_layers": 26,
        "d_model": 2304,
        "n_heads": 8,
        "n_key_value_heads": 4,
        "d_head": 256,
        "d_mlp": 9216,
        "d_vocab": 256000,
        "act_fn": "gelu_pytorch_tanh",
        "use_normalization_before_and_after": True,
        "rotary_dim": 256,
        "attn_scores_soft_cap": 50.0,
        "output_logits_soft_cap": 30.0,
        "original_architecture": "Gemma2ForCausalLM",
    },
    "llama-3-8b": {
        **_RMS_ROTARY_GATED,
        "n_layers": 32,
        "d_model": 4096,
        "n_heads": 32,
        "n_key_value_heads": 8,
        "d_head": 128,
        "d_mlp": 14336,
        "d_vocab": 128256,
        "act_fn": "silu",
        "rotary_dim": 128,
        "rotary_base": 500000,
        "original_architecture": "LlamaForCausalLM",
    },
    "gemma-3-270m": {  # the embedded model's shape, to compare a CPU run with the measured engine
        **_RMS_ROTARY_GATED,
        "n_layers": 18,
        "d_model": 640,
        "n_heads": 4,
        "n_key_value_heads": 1,
        "d_head": 256,
        "d_mlp": 2048,
        "d_vocab": 262144,
        "act_fn": "gelu_pytorch_tanh",
        "use_normalization_before_and_after": True,
        "rotary_dim": 256,
        "original_architecture": "Gemma3ForCausalLM",
    },
    "tiny": {
        **_RMS_ROTARY_GATED,
        "n_layers": 2,
        "d_model": 64,
        "n_heads": 4,
        "n_key_value_heads": 2,
        "d_head": 16,
        "d_mlp": 128,
        "d_vocab": 2048,
        "act_fn": "gelu_pytorch_tanh",
        "use_normalization_before_and_after": True,
        "rotary_dim": 16,
        "original_architecture": "Gemma2ForCausalLM",
    },
}
TIED_EMBEDDINGS = {"gemma-2-2b", "gemma-3-270m", "tiny"}  # HookedTransformer stores W_U apart; the real models share it


def hf_config(name: str):
    """The Hugging Face configuration of the same shape as ``CONFIGS[name]``."""
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig

    c = CONFIGS[name]
    sizes = {
        "vocab_size": c["d_vocab"],
        "hidden_size": c["d_model"],
        "intermediate_size": c["d_mlp"],
        "num_hidden_layers": c["n_layers"],
        "num_attention_heads": c["n_heads"],
        "num_key_value_heads": c["n_key_value_heads"],
        "head_dim": c["d_head"],
        "max_position_embeddings": 512,
    }
    architecture = c["original_architecture"]
    if architecture == "LlamaForCausalLM":
        return LlamaConfig(**sizes, hidden_act=c["act_fn"], rope_theta=c["rotary_base"], tie_word_embeddings=False)
    gemma = {**sizes, "hidden_activation": c["act_fn"], "query_pre_attn_scalar": c["d_head"], "sliding_window": 512}
    if architecture == "Gemma2ForCausalLM":
        softcaps = {"attn_logit_softcapping": c.get("attn_scores_soft_cap"),
                    "final_logit_softcapping": c.get("output_logits_soft_cap")}  # fmt: skip
        return Gemma2Config(**gemma, **softcaps)
    return Gemma3TextConfig(**gemma, layer_types=["full_attention"] * c["n_layers"])


def hf_model(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The Hugging Face model of that shape, randomly initialised (``device="meta"``: no memory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(name), torch_dtype=dtype).eval()


def build(
    name: str, device: str, dtype: torch.dtype, seed: int = 0, backend: str | None = None, process_weights: bool = True
) -> Model:
    """A randomly initialised model with the shape of ``name`` (``device="meta"``: no memory, on
    the HookedTransformer backend); ``process_weights=False``: a bridge left unprocessed."""
    if check_backend(backend) == "bridge":
        from cpsuper.bridge import boot_bridge

        hf = hf_model(name, device, dtype, seed)
        return boot_bridge(hf, tiny_tokenizer(), f"random-{name}", device, dtype, process_weights=process_weights)
    if not process_weights:
        raise SystemExit("--unprocessed is a bridge option (--backend bridge, TransformerLens >= 4.3).")
    cfg = HookedTransformerConfig(
        **CONFIGS[name],
        n_ctx=512,
        seed=seed,
        device=device,
        dtype=dtype,
        model_name=f"random-{name}",
        default_prepend_bos=True,
        tokenizer_prepends_bos=True,
    )
    with torch.device(device), quiet_deprecation():
        return HookedTransformer(cfg, tokenizer=tiny_tokenizer(), move_to_device=False).eval()


def parameter_count(model: Model, name: str) -> int:
    """Parameters of the real model: a tied unembedding counted once, and none of the zero biases
    that HookedTransformer adds to bias-free models. For a bridge: its Hugging Face model's, counted
    on a meta-device copy, because compatibility mode folds the final norm into a separate
    unembedding (no longer tied to the embedding)."""
    if is_bridge(model):
        return sum(p.numel() for p in hf_model(name, "meta", torch.float32).parameters())
    total = sum(p.numel() for n, p in model.named_parameters() if not n.split(".")[-1].lstrip("_").startswith("b_"))
    return total - (model.W_U.numel() if name in TIED_EMBEDDINGS else 0)


def stage1_sweep(model: Model, data: cp.ConflictDataset, batch_size: int) -> cp.SweepResult:
    """The sweep inside :func:`cpsuper.identify_heads` (each head's recorded output added at every
    scale of the paper's grids), without the head selection that follows it: a random model may
    have no head to select, and the selection costs nothing next to the sweep."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    grid = [(l, h, a) for l in range(n_layers) for h in range(n_heads) for a in (*POS_GRID, *NEG_GRID)]
    conditions = [[HeadEdit(l, h, add=a)] for l, h, a in grid]
    labels = pd.DataFrame(grid, columns=["layer", "head", "a"])
    return sweep_dataset(
        model, data, conditions, labels, targets=("parametric",), batch_size=batch_size, progress=False
    )


def matmul_peak(device: str, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """Measured dense matmul rate (FLOP/s) of this device in ``dtype``: the ceiling a sweep can reach."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_memory(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def measure(fn, device: str, peak: float) -> dict:
    """Time ``fn`` (after one warm-up call), then count its operations in a second call."""
    fn()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    seconds = time.perf_counter() - start
    memory = _peak_memory(device)
    with FlopCounterMode(display=False) as counter:
        fn()
    flops = counter.get_total_flops()
    rate = flops / seconds
    return {
        "seconds": seconds,
        "flops": flops,
        "gflop_per_s": rate / 1e9,
        "fraction_of_peak": rate / peak,
        "floor_seconds": flops / peak,
        "peak_memory_gib": memory / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="gemma-2-2b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--facts", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workloads", default="stage1,heatmap")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--backend", choices=("hooked", "bridge"), default=None)
    parser.add_argument("--unprocessed", action="store_true", help="bridge: skip TransformerLens's weight processing")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU is visible to torch; use --device cpu.")
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)

    model = build(args.config, args.device, dtype, backend=args.backend, process_weights=not args.unprocessed)
    load_peak = _peak_memory(args.device)  # the build's own peak (weight processing included)
    data = cp.conflict_dataset("world_capital", n=args.facts, seed=0, tokenizer=model)
    workloads = {
        "stage1": lambda: stage1_sweep(model, data, args.batch_size),
        "heatmap": lambda: cp.head_sweep(model, data, (0.0,), targets=("parametric",), batch_size=args.batch_size,
                                         progress=False),
    }  # fmt: skip
    peak = matmul_peak(args.device, dtype, 4096 if args.device.startswith("cuda") else 1024)
    report = {
        "config": args.config,
        "backend": "bridge" if is_bridge(model) else "hooked",
        "parameters": parameter_count(model, args.config),
        "weights_processed": not args.unprocessed,
        "load_peak_memory_gib": load_peak / 2**30,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": dtype_name,
        "facts": len(data),
        "batch_size": args.batch_size,
        "matmul_peak_gflop_per_s": peak / 1e9,
        "torch": torch.__version__,
    }
    for name in args.workloads.split(","):
        report[name] = measure(workloads[name], args.device, peak)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
