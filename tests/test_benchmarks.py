"""The big-model benchmark: its model shapes are the published ones, and its tiny configuration
runs end to end on CPU (what CI can afford; the GPU figures come from the same script)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpsuper import backend
from cpsuper.precision import native_on_cpu

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "bench_big_models.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_big_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name, published",
    [("gemma-2-2b", 2_614_341_888), ("llama-3-8b", 8_030_261_248), ("gemma-3-270m", 268_098_176)],
)
def test_shapes_give_the_published_parameter_counts(bench, name, published):
    """Both builds: the Hugging Face model (wrapped by the bridge) and, on TransformerLens 3.x, the
    HookedTransformer; built on the meta device, so no memory is allocated."""
    hf = bench.hf_model(name, "meta", torch.bfloat16)
    assert sum(p.numel() for p in hf.parameters()) == published  # the tied embedding is one tensor
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads  # grouped-query attention
    if backend.HookedTransformer is not None:
        model = bench.build(name, "meta", torch.bfloat16, backend="hooked")
        assert abs(bench.parameter_count(model, name) / published - 1) < 1e-3
        assert model.cfg.n_key_value_heads == hf.config.num_key_value_heads < model.cfg.n_heads


def test_tiny_configuration_runs_and_counts_the_work(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, str(SCRIPT), "--config", "tiny", "--facts", "2", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["facts"] == 2
    assert report["backend"] == backend.default_backend()  # the installed TransformerLens's model class
    assert report["parameters"] == 205_376  # the tiny shape's count, its tied embedding counted once
    stage1, heatmap = report["stage1"], report["heatmap"]
    for part in (stage1, heatmap):
        assert part["flops"] > 0 and part["seconds"] > 0 and part["peak_memory_gib"] > 0
        assert part["floor_seconds"] == pytest.approx(part["flops"] / (report["matmul_peak_gflop_per_s"] * 1e9))
    # stage 1 sweeps 8 scales per head where the heatmap sweeps one: several times the work
    assert stage1["flops"] > 4 * heatmap["flops"]


def test_a_missing_gpu_is_named():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True)
    assert done.returncode != 0 and "no GPU is visible" in done.stderr


def test_the_suite_runs_every_workload_on_a_tiny_model(tmp_path):
    """benchmarks/suite.py end to end on tiny-gemma: every workload reports its ratio, and the
    side-by-side checks inside it hold (engine = naive loop, batched Table 3 = previous one)."""
    suite = Path(__file__).parents[1] / "benchmarks" / "suite.py"
    out = tmp_path / "suite.json"
    command = [sys.executable, str(suite), "--model", "tiny-gemma", "--facts", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["engine"]["max_abs_difference"] < 1e-5 and report["engine"]["speedup"] > 0
    assert report["stage1"]["tflop"] > 0 and 0 < report["stage1"]["fraction_of_fp32_peak"]
    assert report["bf16"]["speedup_vs_fp32"] > 0 and 0 <= report["bf16"]["top10_enhance_shared"] <= 10
    for rule in ("paper", "fitted"):
        dual = report["dual_run"][rule]
        assert dual["juice_over_plain"] > 0 and report["generation"][rule]["juice_tokens_per_cpu_s"] > 0
        assert 1 <= dual["forwards_by_layer_count"] <= 2 and len(dual["heads"]) <= 10
    assert report["dual_run"]["fitted"]["recipe"] in (
        "robust",
        "robust-conflict",
        "paper",
    )  # paper: the tiny model knows nothing
    assert 0 <= report["bf16"]["on_conflicts_top10_enhance_shared"] <= 10
    assert list(report["readout"]) == ["4", "12", "32", "64", "128"]
    assert all(r["ms_per_row"] > 0 and r["unembedding_gflop_per_s"] > 0 for r in report["readout"].values())
    low = report["bf16_readout"]
    assert low["rows"] == 6 and low["same_argmax"] and low["max_top10_logit_difference"] < 1e-4
    # bf16 products where the CPU has them; elsewhere unembed_final reads out in float32, exactly
    native = native_on_cpu(torch.bfloat16)
    assert (0 < low["max_softmax_difference"] < 1e-2) if native else low["max_softmax_difference"] == 0.0
    assert low["ms_per_row"]["bf16"] > 0
    assert report["table3"]["same_continuations"] is True
    tuned = report["tuning"]
    assert tuned["tables_identical"] is True and tuned["pairs"] == 21 and tuned["speedup"] > 0
    assert all(w["max_abs_difference"] < 1e-6 for w in report["layout"].values())  # W_U's layout: rounding
    assert report["layout"]["generation"]["identical"] is True
    assert report["table3"]["early_stop_same_correct"] is True
    for dtype, chunked in report["chunks"].items():  # bf16 rounds by a chunk's shape; float32 did not here
        sweeps = [chunked[s] for s in ("knockouts", "head_sweep")]
        assert all(s["identical"] if dtype == "float32" else s["max_abs_difference"] < 1e-2 for s in sweeps)
        assert set(chunked["resumed_forward_us_per_token"]) == {"64x12", "16x72", "32x72", "64x72"}
    for decoded in report["decoding"].values():
        assert set(decoded["step_ms"]) == {"32x16", "32x80", "128x80"} and decoded["cad"]["speedup"] > 0
        assert all(s["speedup"] > 0 for s in decoded["step_ms"].values())
        assert decoded["cad"]["same_continuations"] is True
    assert all(s["bitwise_equal"] for s in report["decoding"]["bfloat16"]["step_ms"].values())
    bad = subprocess.run([sys.executable, str(suite), "--workloads", "warp"], capture_output=True, text=True)
    assert bad.returncode != 0 and "Unknown workloads ['warp']" in bad.stderr
