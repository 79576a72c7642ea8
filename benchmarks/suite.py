"""Benchmark suite: cpsuper's speed as ratios measured side by side in one process.

Ratios hold up on a shared machine where absolute times do not: both sides of each ratio run in
the same process, one after the other, on the same inputs. Every time is CPU seconds of this
process (``time.process_time``; run with ``OMP_NUM_THREADS=1`` for one core) unless it says wall.

Workloads (the embedded Gemma-3-270M by default; ``--model tiny-gemma`` for a smoke run):

- ``engine``: a per-head scaling sweep, naive ``run_with_hooks`` loop vs the sweep engine;
- ``stage1``: JuICE stage 1 with the paper's grids on ``--facts`` known world-capital facts, its
  counted FLOPs, achieved GFLOP/s, and the fraction of the float32 matmul peak measured here;
- ``bf16``: the same stage 1 on the model in bf16 (top logits read out in float32): speed-up, the largest
  probability difference, and the overlap of the top-10 enhance and suppress heads, chosen on every
  prompt (the paper's rule) and on the conflict prompts alone (the default ``robust-conflict`` recipe);
- ``dual_run``: JuICE's dual-run logits and JuNe's against one plain final-position forward, for
  the top 5 + 5 heads of the paper's rule at strengths (2, -1) and for ``JuICE.fit``'s default fit
  on these facts (the cost depends on the layers the heads with a nonzero strength span);
- ``generation``: greedy tokens/s, plain vs dual-run, for the same two steerings;
- ``tuning``: JuICE's strength tuning (every pair of the default grids, as rows of shared batches)
  for the paper rule's heads, each prompt's unsteered prefill run once for all its pairs against
  once per pair, and whether the two tables are identical;
- ``readout``: the final-position read-out (final norm, unembedding, softmax) in CPU ms per row
  for 4 to 128 rows per call, which is why the engine reads out small chunks together;
- ``bf16_readout``: the read-out of the model in bf16 (bf16 product, each row's top 32 logits
  recomputed in float32) against a float32 read-out through a copy of ``W_U``, on the final
  residuals of the facts' prompts: CPU ms per row at 64 rows, and the largest softmax,
  logsumexp and top-10 logit differences;
- ``layout``: TransformerLens's own weight layout against :func:`cp.weight_layout.fast_weight_layout`'s (which
  ``load_model`` applies) on a head sweep, greedy generation and a plain forward, whether the two
  layouts give identical results and how far apart they are (the read-out's product rounds
  differently with ``W_U`` stored ``[d_vocab, d_model]``);
- ``table3``: Table 3 (Original, Prompt, CAD, PH3's pruning, JuNe, JuICE on three conflict types),
  batched evaluation vs the previous one-request-at-a-time evaluation with uncached CAD, and
  whether the two give the same continuations;
- ``chunks``: in float32 and in bf16, CPU microseconds a token of a resumed forward (half the
  layers) by rows x width, and a knockout sweep and a head sweep with the engine's row chunks (cut where prompt widths
  drop, at most ``CHUNK_TOKENS`` padded tokens on a CPU) against fixed chunks of ``batch_size``
  rows, and whether the two give identical results;
- ``decoding``: in float32 and in bf16, one cached greedy step by rows x cached positions with
  TransformerLens's grouped-query attention (keys and values repeated per query head) against
  :func:`cp.grouped_attention.grouped_attention`'s, and whether the two steps are bit-for-bit equal; then CAD's
  greedy continuations of the facts' conflict prompts with each batch prefilled as one against
  in groups of similar width (:func:`cpsuper.kv_cache.prefill_groups`), and whether they agree.

Run: ``OMP_NUM_THREADS=1 python benchmarks/suite.py --out docs/results/benchmarks/suite.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import platform
import time
from pathlib import Path
from unittest import mock

import pandas as pd
import torch
from torch.utils.flop_counter import FlopCounterMode

import cpsuper as cp
from cpsuper import decoding, dual_run, engine
from cpsuper.backend import final_residual
from cpsuper.decoding import unembed_final
from cpsuper.edits import HeadEdit
from cpsuper.engine import answer_probabilities
from cpsuper.grouped_attention import KVGroupedAttention
from cpsuper.interventions import ScaleHead, intervene
from cpsuper.runtime import answer_token, tokenize_prompts
from cpsuper.tuning import beta_tuning

WORKLOADS = (
    "engine",
    "stage1",
    "bf16",
    "dual_run",
    "generation",
    "tuning",
    "readout",
    "bf16_readout",
    "layout",
    "table3",
    "chunks",
    "decoding",
)


def cpu_seconds(fn):
    """``(CPU seconds, wall seconds, result)`` of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return time.process_time() - cpu, time.perf_counter() - wall, result


def matmul_peak(dtype: torch.dtype, d_model: int, d_mlp: int, rows: int = 4096, repeats: int = 10) -> float:
    """Measured FLOP/s of a dense product with the model's MLP shape, ``[rows, d_model] @ [d_model, d_mlp]``."""
    a, b = torch.randn(rows, d_model, dtype=dtype), torch.randn(d_model, d_mlp, dtype=dtype)
    a @ b
    cpu, _, _ = cpu_seconds(lambda: [a @ b for _ in range(repeats)])
    return 2 * rows * d_model * d_mlp * repeats / cpu


def known_facts(model, n: int, pool: int = 40) -> cp.ConflictDataset:
    data = cp.conflict_dataset("world_capital", n=pool, seed=0, tokenizer=model)
    try:
        data = cp.filter_known(model, data, progress=False)
    except ValueError:  # a random test model knows nothing: use the facts as they are
        pass
    return cp.ConflictDataset(list(data)[:n], name="world_capital")


def engine_vs_naive(model, facts: cp.ConflictDataset) -> dict:
    layers = sorted({model.cfg.n_layers // 2, model.cfg.n_layers - 1})
    grid = [(l, h, s) for l in layers for h in range(model.cfg.n_heads) for s in (0.0, 2.0)]
    prompts = facts.prompts("substitution")[:2]
    ids = torch.tensor([[answer_token(model, e.answer, p)] for e, p in zip(facts, prompts)])

    def naive():
        out = torch.empty(len(prompts), len(grid))
        with torch.inference_mode():
            for c, (layer, head, scale) in enumerate(grid):
                for i, prompt in enumerate(prompts):
                    with intervene(model, ScaleHead(layer, head, scale)):
                        out[i, c] = model(prompt)[0, -1].softmax(-1)[ids[i, 0]]
        return out

    conditions = [[HeadEdit(l, h, scale=s)] for l, h, s in grid]
    slow_s, _, slow = cpu_seconds(naive)
    fast_s, _, (_, fast) = cpu_seconds(
        lambda: answer_probabilities(model, tokenize_prompts(model, prompts), ids, conditions, progress=False)
    )
    return {
        "runs": len(grid) * len(prompts),
        "naive_cpu_s": slow_s,
        "engine_cpu_s": fast_s,
        "speedup": slow_s / fast_s,
        "max_abs_difference": (fast[:, :, 0] - slow).abs().max().item(),
    }


def stage1(model, facts: cp.ConflictDataset, peak: float) -> tuple[dict, cp.IdentifiedHeads]:
    def run():
        return cp.identify_heads(model, facts, k=10, progress=False)

    with FlopCounterMode(display=False) as counter:
        cpu, wall, heads = cpu_seconds(run)
    flops = counter.get_total_flops()
    return {
        "prompts": len(facts) * len(facts.conflict_types),
        "conditions": model.cfg.n_layers * model.cfg.n_heads * 8,
        "cpu_s": cpu,
        "wall_s": wall,
        "tflop": flops / 1e12,
        "gflop_per_s": flops / cpu / 1e9,
        "fraction_of_fp32_peak": flops / cpu / peak,
        "floor_cpu_s": flops / peak,
    }, heads


def bf16_vs_fp32(name: str, facts: cp.ConflictDataset, fp32: dict, fp32_heads: cp.IdentifiedHeads) -> dict:
    low = cp.load_model(name, device="cpu", dtype=torch.bfloat16)
    cpu, _, heads = cpu_seconds(lambda: cp.identify_heads(low, facts, k=10, progress=False))
    a, b = fp32_heads.per_example, heads.per_example
    on_conflicts = fp32_heads.on_conflicts(), heads.on_conflicts()
    return {
        "cpu_s": cpu,
        "speedup_vs_fp32": fp32["cpu_s"] / cpu,
        "max_abs_delta_difference": float((a.delta - b.delta).abs().max()),
        "top10_enhance_shared": len(set(fp32_heads.enhance) & set(heads.enhance)),
        "top10_suppress_shared": len(set(fp32_heads.suppress) & set(heads.suppress)),
        "top10_sizes_fp32": [len(fp32_heads.enhance), len(fp32_heads.suppress)],
        # the default recipe's ranking: the same changes with the clean prompts left out
        "on_conflicts_top10_enhance_shared": len(set(on_conflicts[0].enhance) & set(on_conflicts[1].enhance)),
        "on_conflicts_top10_suppress_shared": len(set(on_conflicts[0].suppress) & set(on_conflicts[1].suppress)),
        "on_conflicts_top10_sizes_fp32": [len(on_conflicts[0].enhance), len(on_conflicts[0].suppress)],
    }


def fitted_default(model, facts, validation, heads: cp.IdentifiedHeads) -> cp.JuICE:
    """``JuICE.fit`` with its defaults (the ``robust-conflict`` recipe) on ``facts``, reusing stage 1's
    ``heads``, strengths chosen on ``validation``: the heads a user's default JuICE steers (those
    with a nonzero fitted strength) decide the dual run's cost. The paper's rule where the model
    knows none of the facts (a random test model), as the robust rule then has nothing to protect."""
    try:
        return cp.JuICE(model).fit(facts, validation, progress=False, heads=heads, clean_margin=0.0)
    except ValueError as err:
        if "answers none of the" not in str(err):  # only the no-known-facts refusal falls back
            raise
        return cp.JuICE(model).fit(facts, validation, progress=False, heads=heads, recipe="paper")


def dual_run_vs_plain(model, facts: cp.ConflictDataset, steer: cp.JuICE, repeats: int = 3) -> dict:
    prompts = (facts.prompts("substitution") * 32)[:32]
    june = cp.JuICE(model, dual_run=False, enhance=steer.enhance, suppress=steer.suppress,
                    beta_plus=steer.beta_plus, beta_minus=steer.beta_minus)  # fmt: skip
    best = {}
    for name, fn in {
        "plain": lambda: cp.scoring.final_logits(model, prompts, progress=False),
        "juice": lambda: steer.logits(prompts),
        "june": lambda: june.logits(prompts),
    }.items():
        best[name] = min(cpu_seconds(fn)[0] for _ in range(repeats))
    steered = list(steer.coefficients())  # the heads with a nonzero strength
    layers = [l for l, _ in steered]
    span = max(layers) - min(layers) + 1 if layers else 0  # no steered head: JuICE is one plain pass
    return {
        "prompts": len(prompts),
        "heads": [f"{l}.{h}" for l, h in steered],
        "betas": [steer.beta_plus, steer.beta_minus],
        "recipe": steer.fitted_on.get("recipe", "fixed heads and strengths"),
        # run 1 stops after the last steered layer, run 2 resumes at the first: this many forwards
        "forwards_by_layer_count": 1 + span / model.cfg.n_layers,
        "plain_cpu_s": best["plain"],
        "juice_over_plain": best["juice"] / best["plain"],
        "june_over_plain": best["june"] / best["plain"],
    }


def generation(model, facts: cp.ConflictDataset, steer: cp.JuICE, new_tokens: int = 8) -> dict:
    prompts = (facts.prompts("substitution") * 32)[:32]
    plain_s, _, _ = cpu_seconds(
        lambda: cp.scoring.greedy_continuations(model, prompts, max_new_tokens=new_tokens, progress=False)
    )
    dual_s, _, _ = cpu_seconds(lambda: steer.generate(prompts, new_tokens, batch_size=32))
    tokens = len(prompts) * new_tokens
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "plain_tokens_per_cpu_s": tokens / plain_s,
        "juice_tokens_per_cpu_s": tokens / dual_s,
        "juice_over_plain_time": dual_s / plain_s,
    }


def tuning(steer: cp.JuICE, validation: cp.ConflictDataset) -> dict:
    """Strength tuning with pass 1 of each prompt's prefill shared by its strength pairs, against
    pass 1 run for every row (``unsteered_pass(share=False)``, as before the sharing)."""
    shared_s, _, shared = cpu_seconds(lambda: beta_tuning(steer, validation))
    every_row = functools.partial(dual_run.unsteered_pass, share=False)
    with mock.patch.object(dual_run, "unsteered_pass", every_row):
        rows_s, _, per_row = cpu_seconds(lambda: beta_tuning(steer, validation))
    return {
        "pairs": len(shared),
        "prompts": len(validation) * len(validation.conflict_types),
        "shared_cpu_s": shared_s,
        "every_row_cpu_s": rows_s,
        "speedup": rows_s / shared_s,
        "tables_identical": bool(shared.equals(per_row)),
    }


def readout(model, rows=(4, 12, 32, 64, 128), repeats: int = 3) -> dict:
    """CPU ms per row of :func:`unembed_final` plus the softmax, by rows per call: the product with
    the d_model x d_vocab unembedding reads the whole matrix whatever the number of rows."""
    resid = torch.randn(max(rows), model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    report = {}
    with torch.inference_mode():
        for n in rows:

            def read(part=resid[:n]):
                return unembed_final(model, part).softmax(-1)

            best = min(cpu_seconds(read)[0] for _ in range(repeats))
            flops = 2 * n * model.cfg.d_model * model.cfg.d_vocab
            report[str(n)] = {"ms_per_row": 1e3 * best / n, "unembedding_gflop_per_s": flops / best / 1e9}
    return report


def bf16_readout(name: str, facts: cp.ConflictDataset, rows: int = 64, repeats: int = 3) -> dict:
    """``unembed_final`` of a bf16 model against the float32 read-out it replaced (the same
    residuals through a float32 copy of ``W_U``): speed and how far the logits move."""
    low = cp.load_model(name, device="cpu", dtype=torch.bfloat16)
    tokens = tokenize_prompts(low, [p for c in ("clean", "substitution", "coherent") for p in facts.prompts(c)])
    with torch.inference_mode():
        last = [torch.tensor([len(t) - 1]) for t in tokens]
        resid = torch.cat([final_residual(low, torch.tensor([t]), positions=p) for t, p in zip(tokens, last)])

        def exact(x):  # unembed_final's path for a CPU that would emulate bf16: the float32 copy
            with mock.patch.object(decoding, "native_on_cpu", lambda dtype: False):
                return unembed_final(low, x)

        new, old = unembed_final(low, resid), exact(resid)
        batch = resid.repeat(rows // len(resid) + 1, 1)[:rows]
        times = {
            path: min(cpu_seconds(lambda f=f: f(batch))[0] for _ in range(repeats)) * 1e3 / rows
            for path, f in (("bf16", lambda x: unembed_final(low, x)), ("float32_copy", exact))
        }
    top = old.topk(min(10, old.shape[-1]), dim=-1).indices  # well inside the 32 recomputed
    return {
        "rows": len(resid),
        "ms_per_row": times,
        "speedup": times["float32_copy"] / times["bf16"],
        "max_softmax_difference": float((new.softmax(-1) - old.softmax(-1)).abs().max()),
        "max_logsumexp_difference": float((new.logsumexp(-1) - old.logsumexp(-1)).abs().max()),
        "max_top10_logit_difference": float((new.gather(1, top) - old.gather(1, top)).abs().max()),
        "same_argmax": bool(torch.equal(new.argmax(-1), old.argmax(-1))),
    }


def layout(model, facts: cp.ConflictDataset, repeats: int = 2) -> dict:
    """The same work on TransformerLens's layout (every parameter contiguous) and on cpsuper's."""
    plain = copy.deepcopy(model)
    with torch.no_grad():
        for param in plain.parameters():
            param.data = param.data.contiguous()
    prompts = (facts.prompts("substitution") * 32)[:32]
    work = {
        "head_sweep": lambda m: cp.head_sweep(m, facts[:2], (0.0,), progress=False).per_example,
        "generation": lambda m: cp.scoring.greedy_continuations(m, prompts, max_new_tokens=8, progress=False),
        "forward": lambda m: cp.scoring.final_logits(m, prompts, progress=False),
    }
    out = {}
    for name, fn in work.items():
        best, results = {}, {}
        for _ in range(repeats):  # alternated, so that load on the machine falls on both sides
            for side, m in (("transformer_lens", plain), ("cpsuper", model)):
                cpu, _, results[side] = cpu_seconds(functools.partial(fn, m))
                best[side] = min(cpu, best.get(side, float("inf")))
        a, b = results["transformer_lens"], results["cpsuper"]
        same = a.equals(b) if isinstance(a, pd.DataFrame) else torch.equal(a, b) if torch.is_tensor(a) else a == b
        if isinstance(a, pd.DataFrame):  # the read-out's product differs by rounding between W_U layouts
            numbers = a.select_dtypes("number").columns
            others_same = a.drop(columns=numbers).equals(b.drop(columns=numbers))
            difference = float((a[numbers] - b[numbers]).abs().max().max()) if others_same else float("inf")
        elif torch.is_tensor(a):
            difference = float((a - b).abs().max())
        else:
            difference = 0.0 if same else float("inf")
        out[name] = {
            "transformer_lens_cpu_s": best["transformer_lens"],
            "cpsuper_cpu_s": best["cpsuper"],
            "speedup": best["transformer_lens"] / best["cpsuper"],
            "identical": bool(same),
            "max_abs_difference": difference,
        }
    return out


def _uncached_cad(cad: cp.CAD, dataset, conflict_type: str, max_new_tokens: int) -> list[str]:
    """CAD as it decoded before: both full prompts rerun for every new token."""
    with_context = tokenize_prompts(cad.model, dataset.prompts(conflict_type))
    without = tokenize_prompts(cad.model, dataset.prompts("clean"))
    new = [[] for _ in with_context]
    for _ in range(max_new_tokens):
        step = cad._pair_logits([a + n for a, n in zip(with_context, new)], [b + n for b, n in zip(without, new)])
        for row, token in enumerate(step.argmax(-1).tolist()):
            new[row].append(token)
    return [cad.model.tokenizer.decode(n, skip_special_tokens=True) for n in new]


def table3(model, datasets: list[cp.ConflictDataset], steer: cp.JuICE, max_new_tokens: int = 8) -> dict:
    pruned = cp.PH3(model, heads=list(steer.suppress), k=len(steer.suppress))
    june = cp.JuICE(model, dual_run=False, enhance=steer.enhance, suppress=steer.suppress,
                    beta_plus=steer.beta_plus, beta_minus=steer.beta_minus)  # fmt: skip
    methods = {
        "Original": cp.Original(model),
        "Prompt": cp.PromptInstruction(model),
        "CAD": cp.CAD(model, alpha=1.0),
        "PH3": pruned,
        "JuNe": june,
        "JuICE": steer,
    }
    types = ("clean", "substitution", "coherent")

    def previous():
        rows = []
        for name, method in methods.items():
            for dataset in datasets:
                for conflict_type in types:
                    if name == "CAD":
                        texts = _uncached_cad(method, dataset, conflict_type, max_new_tokens)
                    else:
                        texts = method.generate_many([(dataset, conflict_type)], max_new_tokens)[0]
                    rows += [(name, conflict_type, e.subject, t) for e, t in zip(dataset, texts)]
        return pd.DataFrame(rows, columns=["method", "conflict_type", "subject", "continuation"])

    old_s, _, old = cpu_seconds(previous)
    new_s, _, new = cpu_seconds(lambda: cp.evaluate(methods, datasets, types, max_new_tokens, full_continuations=True))
    early_s, _, early = cpu_seconds(lambda: cp.evaluate(methods, datasets, types, max_new_tokens))
    return {
        "prompts": sum(len(d) for d in datasets) * len(types) * len(methods),
        "previous_cpu_s": old_s,
        "batched_cpu_s": new_s,
        "speedup": old_s / new_s,
        "same_continuations": old.continuation.tolist() == new.continuation.tolist(),
        # the default: each continuation stops once its verdict is settled (cp.reading.reading_settled)
        "early_stop_cpu_s": early_s,
        "early_stop_speedup": new_s / early_s,
        "early_stop_same_correct": early.correct.tolist() == new.correct.tolist(),
        "early_stop_tokens_fraction": sum(map(len, early.continuation)) / max(1, sum(map(len, new.continuation))),
    }


def chunks(model, facts: cp.ConflictDataset, shapes=((64, 12), (16, 72), (32, 72), (64, 72)), repeats: int = 2):
    """Why the engine caps a chunk's padded tokens on a CPU, and what its cuts save on real sweeps."""
    start = model.cfg.n_layers // 2
    per_token = {}
    with torch.inference_mode():
        for rows, width in shapes:
            x = torch.randn(rows, width, model.cfg.d_model, dtype=model.cfg.dtype)
            last = torch.full((rows,), width - 1)

            def forward(x=x, last=last):
                return final_residual(model, x, positions=last, start_at_layer=start)

            best = min(cpu_seconds(forward)[0] for _ in range(repeats))
            per_token[f"{rows}x{width}"] = 1e6 * best / (rows * width)

    def fixed(widths, max_rows, max_tokens=None):  # the engine's chunks before: every batch_size rows
        return [range(lo, min(lo + max_rows, len(widths))) for lo in range(0, len(widths), max_rows)]

    sweeps = {
        "knockouts": lambda: cp.knockout_sweep(model, facts, modules=("attn", "mlp", "layer"), progress=False),
        "head_sweep": lambda: cp.head_sweep(model, facts, (0.0, 2.0), progress=False),
    }
    out = {"resumed_forward_us_per_token": per_token, "first_layer": start}
    for name, sweep in sweeps.items():
        with mock.patch.object(engine, "row_chunks", fixed):
            before, _, old = cpu_seconds(sweep)
        after, _, new = cpu_seconds(sweep)
        same = old.per_example.equals(new.per_example)
        largest = float((old.per_example.p - new.per_example.p).abs().max())
        out[name] = {"fixed_cpu_s": before, "cut_cpu_s": after, "speedup": before / after}
        out[name] |= {"identical": same, "max_abs_difference": largest}
    return out


def _tl_attention(model) -> contextlib.AbstractContextManager:
    """TransformerLens's own grouped-query attention class on ``model`` for the duration."""

    @contextlib.contextmanager
    def swapped():
        ours = [m for m in model.modules() if type(m) is KVGroupedAttention]
        for m in ours:
            m.__class__ = KVGroupedAttention.__base__
        try:
            yield
        finally:
            for m in ours:
                m.__class__ = KVGroupedAttention

    return swapped()


def decoding_steps(model, facts: cp.ConflictDataset, shapes=((32, 16), (32, 80), (128, 80)), repeats: int = 3):
    """Cached decoding steps with TransformerLens's and cpsuper's grouped-query attention, and CAD
    with joint against grouped prefills."""
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    def step_ms(rows, width):  # the best of ``repeats`` single steps after a prefill of ``width``
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(5, model.cfg.d_vocab, (rows, width + 1), generator=gen)
        kv = TransformerLensKeyValueCache.init_cache(model.cfg, "cpu", rows)
        last, mask = torch.full((rows,), width - 1), torch.ones_like(tokens)
        final_residual(model, tokens[:, :width], attention_mask=mask[:, :width], positions=last, past_kv_cache=kv)
        kv.freeze()  # every repeat extends the same prefix
        new, ones, zero = tokens[:, width:], mask[:, width:], torch.zeros_like(last)
        run = lambda: final_residual(model, new, attention_mask=ones, positions=zero, past_kv_cache=kv)  # noqa: E731
        return 1e3 * min(cpu_seconds(run)[0] for _ in range(repeats)), run()

    out = {"step_ms": {}}
    with torch.inference_mode():
        for rows, width in shapes:
            with _tl_attention(model):
                before, theirs = step_ms(rows, width)
            after, ours = step_ms(rows, width)
            out["step_ms"][f"{rows}x{width}"] = {"transformer_lens": before, "grouped": after}
            out["step_ms"][f"{rows}x{width}"] |= {"speedup": before / after, "bitwise_equal": torch.equal(ours, theirs)}
    cad = cp.CAD(model, alpha=1.0)
    requests = [(facts, "substitution"), (facts, "coherent")]
    with mock.patch.object(decoding, "prefill_groups", lambda lengths: None):
        joint, _, old = cpu_seconds(lambda: cad.generate_many(requests, 8))
    grouped, _, new = cpu_seconds(lambda: cad.generate_many(requests, 8))
    out["cad"] = {"joint_prefill_cpu_s": joint, "grouped_prefill_cpu_s": grouped, "speedup": joint / grouped}
    out["cad"]["same_continuations"] = old == new
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--facts", type=int, default=4, help="known world-capital facts for stage 1")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    wanted = args.workloads.split(",")
    unknown = sorted(set(wanted) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"Unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}.")

    model = cp.load_model(args.model, device="cpu")
    pool = known_facts(model, args.facts + 4)  # 4 more facts validate the fitted JuICE's strengths
    facts, validation = pool[: args.facts], pool[args.facts :]
    peak32 = matmul_peak(torch.float32, model.cfg.d_model, model.cfg.d_mlp)
    # the bf16 peak only where bf16 is measured: an AVX2-only CPU emulates bf16 (minutes for this product)
    peak16 = matmul_peak(torch.bfloat16, model.cfg.d_model, model.cfg.d_mlp) if "bf16" in wanted else float("nan")
    report = {
        "model": args.model,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s)",
        "torch": torch.__version__,
        "facts": len(facts),
        "matmul_peak_gflop_per_s": {"float32": peak32 / 1e9, "bfloat16": peak16 / 1e9},
    }
    # Steering for the dual-run workloads, from stage 1 (run here or, if skipped, on one fact).
    if "stage1" in wanted or "bf16" in wanted:
        report["stage1"], heads = stage1(model, facts, peak32)
    elif {"dual_run", "generation", "tuning", "table3"} & set(wanted):
        heads = cp.identify_heads(model, facts[:1], pos_grid=(1.0,), neg_grid=(-1.0,), k=10, progress=False)
    if "bf16" in wanted:
        report["bf16"] = bf16_vs_fp32(args.model, facts, report["stage1"], heads)
    if {"dual_run", "generation", "tuning", "table3"} & set(wanted):
        steer = cp.JuICE(model, enhance=heads.enhance[:5], suppress=heads.suppress[:5], beta_plus=2.0, beta_minus=-1.0)
        steers = {"paper": steer, "fitted": fitted_default(model, facts, validation, heads)}
    if "engine" in wanted:
        report["engine"] = engine_vs_naive(model, facts)
    if "dual_run" in wanted:
        report["dual_run"] = {rule: dual_run_vs_plain(model, facts, s) for rule, s in steers.items()}
    if "generation" in wanted:
        report["generation"] = {rule: generation(model, facts, s) for rule, s in steers.items()}
    if "tuning" in wanted:
        report["tuning"] = tuning(steer, validation)
    if "readout" in wanted:
        report["readout"] = readout(model)
    if "bf16_readout" in wanted:
        report["bf16_readout"] = bf16_readout(args.model, facts)
    if "layout" in wanted:
        report["layout"] = layout(model, facts)
    if "table3" in wanted:
        report["table3"] = table3(model, [facts], steer)
    if "chunks" in wanted:
        low = cp.load_model(args.model, device="cpu", dtype=torch.bfloat16)
        report["chunks"] = {"float32": chunks(model, facts), "bfloat16": chunks(low, facts)}
    if "decoding" in wanted:
        low = cp.load_model(args.model, device="cpu", dtype=torch.bfloat16)
        report["decoding"] = {"float32": decoding_steps(model, facts), "bfloat16": decoding_steps(low, facts)}
    text = json.dumps(report, indent=1, default=float)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
