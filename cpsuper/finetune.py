"""LoRA finetuning of a HookedTransformer on question-answering prompts with a context, with small
adapter checkpoints that :func:`cpsuper.checkpoint_trajectory` measures one by one.

The adapters come from ``peft`` (the ``finetune`` extra) and sit on the MLP weight matrices of
every block (``W_in``, ``W_gate``, ``W_out``): peft wraps a parameter of a module whose forward
takes one input, which TransformerLens's MLPs are and its attention blocks are not. ``B`` starts at
zero, so the step-0 checkpoint is the base model exactly.

On a ``TransformerBridge`` the adapters sit on the same matrices as Hugging Face holds them (the
``nn.Linear`` / ``Conv1D`` layers under each block's ``mlp``), in a plain Hugging Face copy of the
model (:func:`cpsuper.bridge.plain_hf_copy`); they are saved in peft's usual format, so the
checkpoints also load into that Hugging Face model without cpsuper. A loaded checkpoint is a new
bridge around the copy with the adapter merged in (or, ``merge=False``, with peft's layers).

Each training pair is a prompt and its answer; the loss is the cross-entropy of the answer's first
token at the prompt's last position (what cpsuper's scores read), computed from the final residual
of that position only (the 262k-word unembedding of every position would cost more than the rest).
"""

from __future__ import annotations

import copy
import json
import math
import random
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from .backend import Model, final_residual, is_bridge
from .data.examples import ConflictDataset
from .decoding import unembed_final
from .runtime import answer_token, pad_tokens, tokenize_prompts

__all__ = ["LoraCheckpoint", "LoraSettings", "context_training_pairs", "load_lora", "lora_finetune"]

TARGETS = ("mlp.W_in", "mlp.W_gate", "mlp.W_out")
_META = "cpsuper_lora.json"


def _peft():
    try:
        import peft
    except ImportError as err:
        raise ImportError("LoRA finetuning needs peft: pip install 'cpsuper[finetune]' (or pip install peft).") from err
    return peft


@dataclass(frozen=True)
class LoraSettings:
    """What a finetuning run used (also written next to every checkpoint)."""

    steps: int = 60
    batch_size: int = 8
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-3
    save_every: int = 10
    seed: int = 0

    def check(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}.")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"The learning rate must be a positive number, got lr={self.lr!r}.")
        for name in ("batch_size", "rank", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _fingerprint(model: Model) -> dict:
    cfg = model.cfg
    return {
        "model_name": cfg.model_name,
        "n_layers": cfg.n_layers,
        "d_model": cfg.d_model,
        "d_mlp": cfg.d_mlp,
        "d_vocab": cfg.d_vocab,
    }


@dataclass(frozen=True)
class LoraCheckpoint:
    """An adapter saved at ``step``; calling it gives the base model with the adapter merged in (a
    copy: ``base`` itself is not changed), which is what :func:`checkpoint_trajectory` expects."""

    path: Path
    step: int
    base: Model

    def __call__(self) -> Model:
        return load_lora(self.base, self.path, merge=True)


def load_lora(base: Model, path: str | Path, *, merge: bool = True) -> Model:
    """A copy of ``base`` carrying the adapter saved at ``path``: merged into the weights (a plain
    HookedTransformer) or, with ``merge=False``, as peft's unmerged wrapper modules. For a bridge
    ``base``: a new bridge around a plain Hugging Face copy of it with the adapter in place."""
    peft = _peft()
    path = Path(path)
    meta_file = path / _META
    if not meta_file.exists():
        raise ValueError(f"{path} holds no cpsuper LoRA checkpoint (no {_META}); pass a directory lora_finetune wrote.")
    meta = json.loads(meta_file.read_text())
    if meta["model"] != _fingerprint(base):
        raise ValueError(
            f"The checkpoint at {path} was written for another model ({meta['model']}); "
            f"this base model is {_fingerprint(base)}. Load it on the model it was trained from."
        )
    if is_bridge(base):
        from .bridge import boot_bridge, plain_hf_copy

        wrapped = peft.PeftModel.from_pretrained(plain_hf_copy(base), str(path))
        hf_model = wrapped.merge_and_unload() if merge else wrapped.get_base_model()
        device = next(hf_model.parameters()).device
        # the copy holds the base's weights as the bridge had them, processed or not: not again
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This bridge's attention has value biases")
            name, dtype = base.cfg.model_name, base.cfg.dtype
            return boot_bridge(hf_model, base.tokenizer, name, device, dtype, process_weights=False)
    model = copy.deepcopy(base)
    wrapped = peft.PeftModel.from_pretrained(model, str(path))
    return wrapped.merge_and_unload() if merge else model


def context_training_pairs(
    dataset: ConflictDataset,
    *,
    counterfactual_share: float = 0.25,
    conflict_types: Sequence[str] = ("substitution", "coherent"),
    seed: int = 0,
) -> list[tuple[str, str]]:
    """(prompt, answer) pairs in which the context gives the answer, as in instruction data: a
    ``counterfactual_share`` of the examples keep their counterfactual context (the answer is the
    context's), the others get a context that states the true answer. One pair per example and
    conflict type."""
    if not 0.0 <= counterfactual_share <= 1.0:
        raise ValueError(f"counterfactual_share must lie in [0, 1], got {counterfactual_share!r}.")
    if len(dataset) == 0:
        raise ValueError("The dataset is empty; give facts to train on.")
    rng = random.Random(seed)
    n_counter = round(counterfactual_share * len(dataset))
    counter = set(rng.sample(range(len(dataset)), n_counter))
    pairs = []
    for i, example in enumerate(dataset):
        for conflict_type in conflict_types:
            prompt = example.prompts[conflict_type]
            if i in counter:
                pairs.append((prompt, example.context_answer))
            else:  # the same text with the true answer wherever the context named the other one
                pairs.append((prompt.replace(example.context_answer, example.answer), example.answer))
    rng.shuffle(pairs)
    return pairs


def lora_finetune(
    model: Model,
    pairs: Sequence[tuple[str, str]],
    out_dir: str | Path,
    *,
    settings: LoraSettings = LoraSettings(),
    progress: bool = True,
) -> list[LoraCheckpoint]:
    """Train LoRA adapters on ``pairs`` (prompt, answer) and save one every ``save_every`` steps,
    step 0 (the base model) included, under ``out_dir/step_{n}``; ``model`` is left unchanged.

    Batches are drawn without replacement (reshuffled each epoch, seeded); AdamW on the adapters.
    Returns the checkpoints in order of step.
    """
    peft = _peft()
    settings.check()
    if not pairs:
        raise ValueError("No training pairs; give (prompt, answer) pairs, e.g. from context_training_pairs.")
    torch.manual_seed(settings.seed)
    if is_bridge(model):
        from .bridge import plain_hf_copy

        work = plain_hf_copy(model)
        names = _hf_mlp_matrices(work)
        conv1d = type(work.get_submodule(names[0])).__name__ == "Conv1D"  # GPT-2 stores [in, out]
        config = peft.LoraConfig(
            r=settings.rank, lora_alpha=settings.alpha, target_modules=names, fan_in_fan_out=conv1d
        )
    else:
        work = copy.deepcopy(model)
        config = peft.LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha,
            target_modules=[],
            target_parameters=[t for t in TARGETS if t.split(".")[1] in dir(model.blocks[0].mlp)],
        )
    wrapped = peft.get_peft_model(work, config)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr)
    prompts = [p for p, _ in pairs]
    token_lists = tokenize_prompts(model, prompts)
    targets = torch.tensor([answer_token(model, a, p) for p, a in pairs])
    out_dir = Path(out_dir)
    meta = {"model": _fingerprint(model), "settings": asdict(settings)}
    rng = random.Random(settings.seed)
    order: list[int] = []
    checkpoints = []

    def save(step: int, loss: float | None) -> None:
        path = out_dir / f"step_{step}"
        wrapped.save_pretrained(str(path))
        (path / _META).write_text(json.dumps({**meta, "step": step, "loss": loss}, indent=1) + "\n")
        checkpoints.append(LoraCheckpoint(path, step, model))

    save(0, None)
    work.train()
    for step in tqdm(range(1, settings.steps + 1), desc="finetune", disable=not progress, leave=False):
        if len(order) < settings.batch_size:
            order += rng.sample(range(len(pairs)), len(pairs))
        batch, order = order[: settings.batch_size], order[settings.batch_size :]
        tokens, mask, last = pad_tokens(model, [token_lists[i] for i in batch])
        logits = _final_logits(work, tokens, mask, last)
        loss = torch.nn.functional.cross_entropy(logits, targets[batch].to(logits.device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % settings.save_every == 0 or step == settings.steps:
            save(step, loss.item())
    return checkpoints


def _hf_mlp_matrices(hf_model: torch.nn.Module) -> list[str]:
    """Names of the weight matrices (``nn.Linear`` or GPT-2's ``Conv1D``) inside each block's MLP."""
    names = [
        name
        for name, module in hf_model.named_modules()
        if ".mlp." in f".{name}" and type(module).__name__ in ("Linear", "Conv1D")
    ]
    if not names:
        raise ValueError(f"Found no MLP weight matrices in {type(hf_model).__name__} for the LoRA adapters.")
    return names


def _final_logits(
    work: torch.nn.Module, tokens: Int[Tensor, "batch pos"], mask: Int[Tensor, "batch pos"], last: Int[Tensor, " batch"]
) -> Float[Tensor, "batch d_vocab"]:
    """Logits at each row's last real position, from that position's final residual only."""
    rows = torch.arange(len(last))
    if hasattr(work, "cfg"):  # a HookedTransformer
        resid = final_residual(work, tokens)
        return unembed_final(work, resid[rows, last])
    hf_model = work.get_base_model() if hasattr(work, "get_base_model") else work
    device = next(hf_model.parameters()).device
    body = hf_model.base_model  # the model without its output layer
    hidden = body(input_ids=tokens.to(device), attention_mask=mask.to(device)).last_hidden_state  # final norm applied
    logits = hf_model.get_output_embeddings()(hidden[rows.to(device), last.to(device)]).float()
    cap = getattr(hf_model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits
