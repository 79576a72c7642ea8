"""Query/key adapters (``LoraSettings(targets="qk")``) on the tiny models: step 0 is the base model
exactly, training lowers the loss and moves only the query and key weights (values, outputs and MLPs
stay bit for bit), the deltas are low-rank and respect grouped-query attention, checkpoints round
trip; plus the summaries of scripts/finetune_inversion_variants.py on made-up numbers."""

import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper import backend
from cpsuper.decoding import iter_final_logits
from cpsuper.finetune import LoraSettings, context_training_pairs, load_lora, lora_finetune
from cpsuper.runtime import answer_token, tokenize_prompts

pytest.importorskip("peft")
BRIDGE = backend.default_backend() == "bridge"
KINDS = ["gemma"] if BRIDGE else ["gemma", "gpt2"]  # GPT-2's fused c_attn: refused on the bridge


def _logits(model, prompts):
    out = [None] * len(prompts)
    for idx, logits in iter_final_logits(model, tokenize_prompts(model, prompts), progress=False):
        for row, i in enumerate(idx):
            out[i] = logits[row]
    return torch.stack(out)


def _loss(model, pairs):
    targets = torch.tensor([answer_token(model, a, p) for p, a in pairs])
    return torch.nn.functional.cross_entropy(_logits(model, [p for p, _ in pairs]), targets).item()


def _weights(model) -> dict[str, torch.Tensor]:
    """Every weight under the name it has in the model the checkpoint gives (a Hugging Face copy's
    on the bridge)."""
    if BRIDGE:
        from cpsuper.bridge import plain_hf_copy

        return dict(plain_hf_copy(model).state_dict())
    return {n: p.detach() for n, p in model.named_parameters()}


def _is_query_or_key(name: str) -> bool:
    last = name.rsplit(".", 2)[-2] if BRIDGE else name.rsplit(".", 1)[-1]
    return last in (("q_proj", "k_proj") if BRIDGE else ("W_Q", "_W_K", "W_K"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for kind in KINDS:
        model = cp.tiny_model(kind, seed=0)
        data = cp.conflict_dataset("world_capital", n=12, seed=0, tokenizer=model)
        pairs = context_training_pairs(data, counterfactual_share=0.5)
        settings = LoraSettings(steps=30, save_every=15, lr=5e-3, rank=2, alpha=4.0, targets="qk")
        checkpoints = lora_finetune(model, pairs, tmp_path_factory.mktemp(kind), settings=settings, progress=False)
        out[kind] = (model, pairs, checkpoints)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_step_zero_is_the_base_and_the_loss_falls(runs, kind):
    model, pairs, checkpoints = runs[kind]
    assert [c.step for c in checkpoints] == [0, 15, 30]
    prompts = [p for p, _ in pairs[:6]]
    assert torch.equal(_logits(checkpoints[0](), prompts), _logits(model, prompts))
    assert _loss(checkpoints[-1](), pairs) < 0.9 * _loss(model, pairs)
    meta = json.loads((checkpoints[-1].path / "cpsuper_lora.json").read_text())
    assert meta["settings"]["targets"] == "qk" and meta["step"] == 30


@pytest.mark.parametrize("kind", KINDS)
def test_only_the_query_and_key_weights_move(runs, kind):
    model, pairs, checkpoints = runs[kind]
    before, after = _weights(model), _weights(checkpoints[-1]())
    assert sorted(before) == sorted(after)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    expected = {n for n in before if _is_query_or_key(n)}
    assert moved == expected and expected  # every query and key matrix, nothing else
    if not BRIDGE:  # the value vectors of a prompt are unchanged where the residual is (layer 0)
        tokens = model.to_tokens(pairs[0][0])
        _, base = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.attn"))
        _, tuned = checkpoints[-1]().run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.attn"))
        assert torch.equal(base["blocks.0.attn.hook_v"], tuned["blocks.0.attn.hook_v"])
        assert not torch.equal(base["blocks.0.attn.hook_k"], tuned["blocks.0.attn.hook_k"])
        assert not torch.allclose(base["blocks.0.attn.hook_pattern"], tuned["blocks.0.attn.hook_pattern"])


@pytest.mark.skipif(BRIDGE, reason="the HookedTransformer's own low-rank deltas")
def test_the_deltas_are_low_rank_and_grouped_like_the_keys(runs):
    model, _, checkpoints = runs["gemma"]
    attn = model.blocks[1].attn
    assert attn._W_K.shape[0] < attn.W_Q.shape[0]  # the tiny Gemma groups its keys, as Gemma-3 does
    tuned = checkpoints[-1]().blocks[1].attn
    for name in ("W_Q", "_W_K"):
        delta = getattr(tuned, name).detach() - getattr(attn, name).detach()  # [heads, d_model, d_head]
        as_map = delta.transpose(0, 1).reshape(delta.shape[1], -1)  # d_model -> heads * d_head
        assert torch.linalg.matrix_rank(as_map, atol=1e-6).item() == 2  # the rank asked for
    state = torch.load(checkpoints[-1].path / "qk_adapters.pt", weights_only=True)
    assert state["blocks.1.attn._W_K.B"].shape == (2, attn._W_K.shape[0] * attn.cfg.d_head)


@pytest.mark.parametrize("kind", KINDS)
def test_merged_and_unmerged_checkpoints_agree(runs, kind):
    model, pairs, checkpoints = runs[kind]
    prompts = [p for p, _ in pairs[:6]]
    merged = _logits(load_lora(model, checkpoints[-1].path), prompts)
    unmerged = _logits(load_lora(model, checkpoints[-1].path, merge=False), prompts)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(BRIDGE, reason="checked on the HookedTransformer")
def test_mlp_and_qk_together_leave_values_and_outputs_alone(tmp_path):
    model = cp.tiny_model("gemma", seed=0)
    data = cp.conflict_dataset("world_capital", n=8, seed=0, tokenizer=model)
    pairs = context_training_pairs(data, counterfactual_share=0.5)
    settings = LoraSettings(steps=4, save_every=4, lr=5e-3, targets="mlp+qk")
    checkpoints = lora_finetune(model, pairs, tmp_path, settings=settings, progress=False)
    before, after = _weights(model), _weights(checkpoints[-1]())
    moved = {n.rsplit(".", 1)[-1] for n in before if not torch.equal(before[n], after[n])}
    assert moved == {"W_Q", "_W_K", "W_in", "W_gate", "W_out"}


def test_clear_errors(tmp_path):
    model = cp.tiny_model("gemma", seed=0)
    pairs = [("The capital of France is", " Paris")]
    with pytest.raises(ValueError, match="targets must be one of"):
        lora_finetune(model, pairs, tmp_path, settings=LoraSettings(targets="v"))
    if BRIDGE:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This bridge's attention has value biases")
            gpt2 = cp.tiny_model("gpt2", seed=0, process_weights=False)
        with pytest.raises(NotImplementedError, match="backend='hooked'"):
            lora_finetune(gpt2, pairs, tmp_path, settings=LoraSettings(steps=1, targets="qk"))


def _script():
    pytest.importorskip("plotly")
    path = Path(__file__).parents[1] / "scripts" / "finetune_inversion_variants.py"
    spec = importlib.util.spec_from_file_location("finetune_inversion_variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variant_summaries_pair_runs_over_facts_and_find_the_peak():
    script = _script()
    rows = []
    for f in range(6):
        relation = "world_capital" if f < 3 else "official_language"
        for step, ref in ((0, 0.0), (10, 2.0), (20, 1.0)):
            rows.append(("mlp", step, relation, f"{relation}:{f}", "substitution", "context_margin", ref + f))
            if step != 10:  # a run measured more sparsely: paired only where both were measured
                rows.append(("qk", step, relation, f"{relation}:{f}", "substitution", "context_margin", ref + f + 0.5))
    per = pd.DataFrame(rows, columns=["run", "step", "relation", "fact", "conflict_type", "quantity", "value"])
    summary, paired = script.summarise(per)
    capitals = summary[(summary.run == "mlp") & (summary.facts == "world_capital") & (summary.step == 10)]
    assert capitals["mean"].item() == pytest.approx(3.0) and capitals.n.item() == 3
    assert sorted(paired.step.unique()) == [0, 20]
    assert np.allclose(paired["mean"], 0.5) and np.allclose(paired.ci_low, 0.5)
    peaks = script.peak_then_last(per).set_index("change")
    assert (peaks.from_step.to_dict(), peaks.to_step.to_dict()) == ({"rise": 0, "fall": 10}, {"rise": 10, "fall": 20})
    assert peaks["mean"].to_dict() == pytest.approx({"rise": 2.0, "fall": -1.0})
