"""LoRA finetuning (cpsuper.finetune) on the tiny models: step 0 is the base model exactly, the loss
falls, merged and unmerged adapters agree, checkpoints feed checkpoint_trajectory, bad input fails
clearly."""

import builtins
import json
import warnings

import pytest
import torch

import cpsuper as cp
from cpsuper import backend
from cpsuper.decoding import iter_final_logits
from cpsuper.finetune import LoraSettings, context_training_pairs, load_lora, lora_finetune
from cpsuper.runtime import answer_token, tokenize_prompts

pytest.importorskip("peft")


def _base(kind: str):
    """The tiny model to finetune. On the bridge GPT-2 is loaded unprocessed: its processed query, key
    and value weights live in the bridge's split copies, not in Hugging Face's fused ``c_attn``, so no
    plain Hugging Face copy (which peft needs) computes what the processed bridge computes."""
    if backend.default_backend() == "bridge" and kind == "gpt2":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This bridge's attention has value biases")
            return cp.tiny_model(kind, seed=0, process_weights=False)
    return cp.tiny_model(kind, seed=0)


@pytest.fixture(scope="module")
def run(request, tmp_path_factory):
    """A short finetune of each tiny model: (model, dataset, pairs, checkpoints)."""
    out = {}
    for kind in ("gemma", "gpt2"):
        model = _base(kind)
        data = cp.conflict_dataset("world_capital", n=12, seed=0, tokenizer=model)
        pairs = context_training_pairs(data, counterfactual_share=0.5)
        settings = LoraSettings(steps=30, save_every=10, lr=5e-3)
        checkpoints = lora_finetune(model, pairs, tmp_path_factory.mktemp(kind), settings=settings, progress=False)
        out[kind] = (model, data, pairs, checkpoints)
    return out


def _logits(model, prompts):
    """Final-position logits, one row per prompt in the order given (batches come in length order)."""
    lists = tokenize_prompts(model, prompts)
    out = [None] * len(prompts)
    for idx, logits in iter_final_logits(model, lists, progress=False):
        for row, i in enumerate(idx):
            out[i] = logits[row]
    return torch.stack(out)


def _loss(model, pairs):
    logits = _logits(model, [p for p, _ in pairs])
    targets = torch.tensor([answer_token(model, a, p) for p, a in pairs])
    return torch.nn.functional.cross_entropy(logits, targets).item()


@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_step_zero_is_the_base_model_and_the_base_is_untouched(run, kind):
    model, _, pairs, checkpoints = run[kind]
    assert [c.step for c in checkpoints] == [0, 10, 20, 30]
    prompts = [p for p, _ in pairs[:6]]
    base = _logits(model, prompts)
    assert torch.equal(_logits(checkpoints[0](), prompts), base)
    fresh = _base(kind)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_training_lowers_the_loss_and_merging_changes_nothing(run, kind):
    model, _, pairs, checkpoints = run[kind]
    trained = checkpoints[-1]()
    assert _loss(trained, pairs) < 0.9 * _loss(model, pairs)  # 30 steps on random tiny models
    unmerged = load_lora(model, checkpoints[-1].path, merge=False)
    prompts = [p for p, _ in pairs[:6]]
    torch.testing.assert_close(_logits(trained, prompts), _logits(unmerged, prompts), atol=1e-5, rtol=1e-5)
    meta = json.loads((checkpoints[-1].path / "cpsuper_lora.json").read_text())
    assert meta["step"] == 30 and meta["settings"]["rank"] == 8


def test_checkpoints_feed_checkpoint_trajectory(run):
    model, data, _, checkpoints = run["gemma"]
    trajectory = cp.checkpoint_trajectory(
        checkpoints, data, ["context_reliance"], labels=[c.step for c in checkpoints], progress=False
    )
    assert list(trajectory.checkpoint.unique()) == [0, 10, 20, 30]
    at_zero = trajectory[trajectory.checkpoint == 0].set_index("quantity").value
    base = cp.checkpoint_trajectory([model], data, ["context_reliance"], progress=False).set_index("quantity").value
    assert at_zero.to_dict() == pytest.approx(base.to_dict())


def test_training_pairs_follow_the_context():
    model = cp.tiny_model("gemma", seed=0)
    data = cp.conflict_dataset("world_capital", n=8, seed=0, tokenizer=model)
    pairs = context_training_pairs(data, counterfactual_share=0.25, conflict_types=["substitution"])
    assert len(pairs) == 8
    by_prompt = dict(pairs)
    counterfactual = [e for e in data if e.prompts["substitution"] in by_prompt]
    assert len(counterfactual) == 2
    assert all(by_prompt[e.prompts["substitution"]] == e.context_answer for e in counterfactual)
    for example in data:
        agreeing = example.prompts["substitution"].replace(example.context_answer, example.answer)
        if agreeing in by_prompt:
            assert by_prompt[agreeing] == example.answer and example.context_answer not in agreeing


def test_clear_errors(run, tmp_path, monkeypatch):
    model, data, pairs, checkpoints = run["gemma"]
    with pytest.raises(ValueError, match="learning rate"):
        lora_finetune(model, pairs, tmp_path, settings=LoraSettings(lr=0.0))
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        lora_finetune(model, pairs, tmp_path, settings=LoraSettings(steps=0))
    with pytest.raises(ValueError, match="No training pairs"):
        lora_finetune(model, [], tmp_path)
    with pytest.raises(ValueError, match="counterfactual_share"):
        context_training_pairs(data, counterfactual_share=1.5)
    with pytest.raises(ValueError, match="written for another model"):
        load_lora(run["gpt2"][0], checkpoints[-1].path)
    with pytest.raises(ValueError, match="no cpsuper LoRA checkpoint"):
        load_lora(model, tmp_path)
    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft":
            raise ImportError("no peft here")
        return real_import(name, *args, **kwargs)

    if backend.default_backend() == "bridge":  # see _base
        with pytest.raises(ValueError, match="process_weights=False"):
            lora_finetune(cp.tiny_model("gpt2", seed=0), pairs, tmp_path)
    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ImportError, match=r"cpsuper\[finetune\]"):
        lora_finetune(model, pairs, tmp_path)
