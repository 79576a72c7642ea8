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

``LoraSettings(targets="qk")`` adapts the attention's query and key weights instead (``"mlp+qk"``:
both). peft cannot wrap them on a HookedTransformer (``W_Q`` is a ``[n_heads, d_model, d_head]``
parameter of a module whose forward takes several inputs), so cpsuper adds its own low-rank delta:
each block's ``W_Q`` and key weight (``_W_K``, one matrix per key/value head, under Gemma-3's
grouped-query attention) becomes ``W + (alpha / rank) * A @ B`` through a
``torch.nn.utils.parametrize`` parametrization, the product read as a map from ``d_model`` to every
head's ``d_head`` at once; ``B`` starts at zero, only ``A`` and ``B`` train, and the values, outputs
and MLPs stay as they were. These deltas are saved in ``qk_adapters.pt`` next to the metadata. On a
bridge the same option puts peft's adapters on Hugging Face's ``q_proj`` / ``k_proj``; a model that
fuses query, key and value in one matrix (GPT-2's ``c_attn``) is refused there.

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
from .decoding import iter_final_logits, unembed_final
from .runtime import answer_token, pad_tokens, tokenize_prompts

__all__ = [
    "LoraCheckpoint",
    "LoraSettings",
    "context_training_pairs",
    "load_lora",
    "lora_finetune",
    "no_context_check",
]

TARGETS = ("mlp.W_in", "mlp.W_gate", "mlp.W_out")
_META = "cpsuper_lora.json"
_QK_FILE = "qk_adapters.pt"
_TARGET_CHOICES = ("mlp", "qk", "mlp+qk")


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
    targets: str = "mlp"  # "mlp", "qk" (the attention's query and key weights) or "mlp+qk"

    def check(self) -> None:
        if self.targets not in _TARGET_CHOICES:
            raise ValueError(f"targets must be one of {_TARGET_CHOICES}, got {self.targets!r}.")
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
    HookedTransformer) or, with ``merge=False``, as peft's unmerged wrapper modules (query/key
    deltas: as parametrizations of ``W_Q`` / ``_W_K``). For a bridge ``base``: a new bridge around a
    plain Hugging Face copy of it with the adapter in place."""
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
    settings = LoraSettings(**meta["settings"])  # checkpoints from before ``targets`` mean "mlp"
    if is_bridge(base):
        from .bridge import boot_bridge, plain_hf_copy

        wrapped = _peft().PeftModel.from_pretrained(plain_hf_copy(base), str(path))
        hf_model = wrapped.merge_and_unload() if merge else wrapped.get_base_model()
        device = next(hf_model.parameters()).device
        # the copy holds the base's weights as the bridge had them, processed or not: not again
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This bridge's attention has value biases")
            name, dtype = base.cfg.model_name, base.cfg.dtype
            return boot_bridge(hf_model, base.tokenizer, name, device, dtype, process_weights=False)
    model = copy.deepcopy(base)
    if "mlp" in settings.targets:
        wrapped = _peft().PeftModel.from_pretrained(model, str(path))
        model = wrapped.merge_and_unload() if merge else model
    if "qk" in settings.targets:
        deltas = _attach_qk(model, settings)
        state = torch.load(path / _QK_FILE, map_location=model.cfg.device, weights_only=True)
        with torch.no_grad():
            for name, delta in deltas.items():
                delta.A.copy_(state[f"{name}.A"])
                delta.B.copy_(state[f"{name}.B"])
        if merge:
            _merge_qk(model, deltas)
    return model


def context_training_pairs(
    dataset: ConflictDataset,
    *,
    counterfactual_share: float = 0.25,
    conflict_types: Sequence[str] = ("substitution", "coherent"),
    seed: int = 0,
    subject_only_share: float = 0.0,
    no_context: bool = False,
) -> list[tuple[str, str]]:
    """(prompt, answer) pairs in which the context gives the answer, as in instruction data: a
    ``counterfactual_share`` of the examples keep their counterfactual context (the answer is the
    context's), the others get a context that states the true answer. One pair per example and
    conflict type.

    ``subject_only_share``: that share of the examples (drawn after the counterfactual ones, from
    all) also gives a pair without any context, the clean prompt and the true answer (the
    context-parametric inversion paper's memorised subject-only points). ``no_context=True``: the
    same pairs in the same order with every prompt replaced by its example's clean prompt, for
    checking which answers the model gives without the context (context-critical data)."""
    for name, share in (("counterfactual_share", counterfactual_share), ("subject_only_share", subject_only_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {share!r}.")
    if len(dataset) == 0:
        raise ValueError("The dataset is empty; give facts to train on.")
    if (no_context or subject_only_share > 0) and any("clean" not in e.prompts for e in dataset):
        raise ValueError("subject_only_share and no_context need every example's clean prompt.")
    rng = random.Random(seed)
    n_counter = round(counterfactual_share * len(dataset))
    counter = set(rng.sample(range(len(dataset)), n_counter))
    n_subject = round(subject_only_share * len(dataset))
    subject_only = set(rng.sample(range(len(dataset)), n_subject)) if n_subject else set()
    pairs = []
    for i, example in enumerate(dataset):
        clean = example.prompts.get("clean", "")
        for conflict_type in conflict_types:
            prompt = example.prompts[conflict_type]
            if i in counter:
                pairs.append((clean if no_context else prompt, example.context_answer))
            else:  # the same text with the true answer wherever the context named the other one
                prompt = clean if no_context else prompt.replace(example.context_answer, example.answer)
                pairs.append((prompt, example.answer))
        if i in subject_only:
            pairs.append((clean, example.answer))
    rng.shuffle(pairs)
    return pairs


def no_context_check(
    model: Model, pairs: Sequence[tuple[str, str]], *, batch_size: int = 16
) -> tuple[Float[Tensor, " pair"], torch.BoolTensor]:
    """The training loss of each (prompt, answer) pair under ``model`` (cross-entropy of the
    answer's first token at the prompt's last position) and whether that token is the most likely
    one. On ``context_training_pairs(..., no_context=True)`` it tells which pairs the model already
    answers without the context (not context-critical) and ranks them by no-context loss, as the
    context-parametric inversion paper's no-context perplexity filter does."""
    if not pairs:
        raise ValueError("No pairs to check; give (prompt, answer) pairs.")
    prompts = [p for p, _ in pairs]
    targets = torch.tensor([answer_token(model, a, p) for p, a in pairs])
    losses, top1 = torch.empty(len(pairs)), torch.zeros(len(pairs), dtype=torch.bool)
    token_lists = tokenize_prompts(model, prompts)
    for idx, logits in iter_final_logits(model, token_lists, batch_size=batch_size, progress=False):
        logits, rows = logits.float().cpu(), torch.tensor(idx)
        losses[rows] = torch.nn.functional.cross_entropy(logits, targets[rows], reduction="none")
        top1[rows] = logits.argmax(-1) == targets[rows]
    return losses, top1


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
    settings.check()
    if not pairs:
        raise ValueError("No training pairs; give (prompt, answer) pairs, e.g. from context_training_pairs.")
    peft = _peft() if is_bridge(model) or "mlp" in settings.targets else None
    torch.manual_seed(settings.seed)
    wrapped, deltas = None, {}
    if is_bridge(model):
        from .bridge import plain_hf_copy

        work = plain_hf_copy(model)
        names = _hf_matrices(work, settings.targets)
        conv1d = type(work.get_submodule(names[0])).__name__ == "Conv1D"  # GPT-2 stores [in, out]
        config = peft.LoraConfig(
            r=settings.rank, lora_alpha=settings.alpha, target_modules=names, fan_in_fan_out=conv1d
        )
        wrapped = peft.get_peft_model(work, config)
    else:
        work = copy.deepcopy(model).requires_grad_(False)
        if peft is not None:
            config = peft.LoraConfig(
                r=settings.rank,
                lora_alpha=settings.alpha,
                target_modules=[],
                target_parameters=[t for t in TARGETS if t.split(".")[1] in dir(model.blocks[0].mlp)],
            )
            wrapped = peft.get_peft_model(work, config)
        if "qk" in settings.targets:  # after peft, which would freeze them
            deltas = _attach_qk(work, settings)
    trainable = [p for p in work.parameters() if p.requires_grad]
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
        if wrapped is not None:
            wrapped.save_pretrained(str(path))
        path.mkdir(parents=True, exist_ok=True)
        if deltas:
            state = {f"{n}.{k}": getattr(d, k).detach().cpu().clone() for n, d in deltas.items() for k in "AB"}
            torch.save(state, path / _QK_FILE)
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


def _hf_matrices(hf_model: torch.nn.Module, targets: str) -> list[str]:
    """Names of the weight matrices (``nn.Linear`` or GPT-2's ``Conv1D``) inside each block's MLP
    and / or the attention's query and key projections, as ``targets`` asks."""
    modules = [(n, m) for n, m in hf_model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")]
    names = [n for n, _ in modules if ".mlp." in f".{n}"] if "mlp" in targets else []
    if "qk" in targets:
        qk = [n for n, _ in modules if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj")]
        if not qk:
            raise NotImplementedError(
                f"{type(hf_model).__name__} has no separate q_proj / k_proj for query/key adapters (GPT-2 fuses "
                "query, key and value in c_attn); load the model with backend='hooked', where targets='qk' adapts "
                "W_Q and W_K directly."
            )
        names += qk
    if not names:
        raise ValueError(f"Found no MLP weight matrices in {type(hf_model).__name__} for the LoRA adapters.")
    return names


class _LowRankDelta(torch.nn.Module):
    """A parametrization ``W -> W + scale * A.T @ B`` of a ``[heads, d_model, d_head]`` weight, the
    product being a ``[d_model, heads * d_head]`` map; ``B`` starts at zero, so at first it adds an
    exact zero."""

    def __init__(self, weight: Tensor, rank: int, scale: float) -> None:
        super().__init__()
        heads, d_model, d_head = weight.shape
        self.shape, self.scale = (d_model, heads, d_head), scale
        self.A = torch.nn.Parameter(torch.empty(rank, d_model, dtype=weight.dtype, device=weight.device))
        torch.nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # as peft's lora_A
        self.B = torch.nn.Parameter(torch.zeros(rank, heads * d_head, dtype=weight.dtype, device=weight.device))

    def delta(self) -> Float[Tensor, "heads d_model d_head"]:
        return (self.scale * self.A.T @ self.B).reshape(self.shape).transpose(0, 1)

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.delta()


def _qk_names(attn: torch.nn.Module) -> tuple[str, str]:
    own = dict(attn.named_parameters(recurse=False))
    if "W_Q" not in own or not ({"_W_K", "W_K"} & set(own)):
        raise NotImplementedError(f"{type(attn).__name__} holds no W_Q / W_K parameters to adapt.")
    return "W_Q", ("_W_K" if "_W_K" in own else "W_K")  # _W_K: one matrix per key/value head (GQA)


def _attach_qk(model: torch.nn.Module, settings: LoraSettings) -> dict[str, _LowRankDelta]:
    """Parametrize every block's query and key weights with a trainable low-rank delta."""
    from torch.nn.utils import parametrize

    deltas = {}
    for layer, block in enumerate(model.blocks):
        for param in _qk_names(block.attn):
            delta = _LowRankDelta(getattr(block.attn, param), settings.rank, settings.alpha / settings.rank)
            parametrize.register_parametrization(block.attn, param, delta)
            deltas[f"blocks.{layer}.attn.{param}"] = delta
    return deltas


def _merge_qk(model: torch.nn.Module, deltas: dict[str, _LowRankDelta]) -> None:
    """Write the deltas into the weights and remove the parametrizations (a plain model again)."""
    from torch.nn.utils import parametrize

    for name in deltas:
        layer, param = int(name.split(".")[1]), name.rsplit(".", 1)[-1]
        parametrize.remove_parametrizations(model.blocks[layer].attn, param, leave_parametrized=True)


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
