"""Position-resolved patches (``PatchEdit``) and causal tracing, against hand-written hook loops."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.edits import PatchEdit
from cpsuper.engine import run_conditions
from cpsuper.runtime import tokenize_prompts
from cpsuper.tracing import causal_trace

DESTINATIONS = [
    "The capital of Peru is Tokyo. The capital of Peru is",
    "Madrid is located in",
    "The name of the capital city of Japan is Lima. The name of the capital city of Japan is",
]
SOURCES = [
    "The capital of Peru is",
    "Rome is located in",
    "The name of the capital city of Japan is",
]
ANSWERS = torch.tensor([[5, 6], [7, 8], [9, 10]])
HOOKS = {
    "resid_pre": "blocks.{}.hook_resid_pre",
    "attn_out": "blocks.{}.hook_attn_out",
    "mlp_out": "blocks.{}.hook_mlp_out",
    "z": "blocks.{}.attn.hook_z",
}


def logit(logits, ids):
    return logits.gather(-1, ids)


def hand_patch(model, dest, src, edits, align):
    """The answers' final logits of ``dest`` with ``edits`` [(site, layer, position, head)], each
    activation at a destination index replaced by the source's clean one at the index ``align``
    gives it; NaN where an edit has no (destination, source) pair. One run_with_hooks per prompt."""
    _, cache = model.run_with_cache(torch.tensor([src]))
    n_d, n_s = len(dest), len(src)
    hooks = []
    for site, layer, position, head in edits:
        indices = list(range(n_d)) if position is None else [position if position >= 0 else n_d + position]
        indices = [d for d in indices if 0 <= d < n_d]
        offset = {"end": n_s - n_d, "start": 0, "exact": 0}[align]
        pairs = [(d, d + offset) for d in indices if 0 <= d + offset < n_s]
        if not pairs:
            return None
        name = HOOKS[site].format(layer)

        def hook(act, hook, pairs=pairs, name=name, head=head):
            act = act.clone()
            for d, s in pairs:
                if head is None:
                    act[0, d] = cache[name][0, s]
                else:
                    act[0, d, head] = cache[name][0, s, head]
            return act

        hooks.append((name, hook))
    with torch.no_grad():
        return model.run_with_hooks(torch.tensor([dest]), fwd_hooks=hooks)[0, -1]


def expected(model, dests, srcs, ids, edit_lists, align):
    out = torch.full((len(dests), len(edit_lists), ids.shape[1]), math.nan)
    for p, (dest, src) in enumerate(zip(dests, srcs)):
        for c, edits in enumerate(edit_lists):
            logits = hand_patch(model, dest, src, edits, align)
            if logits is not None:
                out[p, c] = logits[ids[p]]
    return out


def as_conditions(edit_lists):
    return [[PatchEdit(layer, site, position, head) for site, layer, position, head in edits] for edits in edit_lists]


EDITS = [
    [("resid_pre", 0, -1, None)],
    [("resid_pre", 1, 2, None)],
    [("resid_pre", 2, None, None)],
    [("attn_out", 0, -3, None)],
    [("attn_out", 2, None, None)],
    [("mlp_out", 1, -2, None)],
    [("mlp_out", 2, -1, None)],  # the last block's MLP: the engine must not cut it away
    [("z", 1, -2, 0)],
    [("z", 0, None, 3)],
    [("z", 2, -1, 1), ("z", 2, -1, 2), ("mlp_out", 0, 1, None)],  # several patches in one condition
    [("resid_pre", 1, -12, None)],  # missing in some prompts: NaN there
]


@pytest.mark.parametrize("align", ["end", "start"])
def test_patches_equal_a_hand_written_hook_loop(tiny, align):
    dests, srcs = tokenize_prompts(tiny, DESTINATIONS), tokenize_prompts(tiny, SOURCES)
    want = expected(tiny, dests, srcs, ANSWERS, EDITS, align)
    somewhere = [c for c in range(len(EDITS)) if not torch.isnan(want[:, c]).all()]  # the rest are errors
    assert len(somewhere) >= 8
    edits, want = [EDITS[c] for c in somewhere], want[:, somewhere]
    clean, out = run_conditions(
        tiny,
        dests,
        ANSWERS,
        as_conditions(edits),
        metric=logit,
        source_tokens=srcs,
        align=align,
        batch_size=4,
        prompt_batch_size=2,
        progress=False,
    )
    assert torch.isnan(want).any() and not torch.isnan(want).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    with torch.no_grad():
        unpatched = torch.stack([tiny(torch.tensor([d]))[0, -1][i] for d, i in zip(dests, ANSWERS)])
    torch.testing.assert_close(clean, unpatched, atol=1e-5, rtol=1e-5)


def test_exact_alignment_on_equal_lengths(tiny):
    dests = tokenize_prompts(tiny, ["The capital of Peru is Tokyo. The capital of Peru is", "Madrid is located in"])
    srcs = tokenize_prompts(tiny, ["The capital of Peru is Lima. The capital of Peru is", "Berlin is located in"])
    assert [len(d) for d in dests] == [len(s) for s in srcs]
    ids = ANSWERS[:2]
    edits = [[("resid_pre", 1, 6, None)], [("attn_out", 0, None, None)], [("z", 1, 3, 2)], [("mlp_out", 2, -1, None)]]
    _, out = run_conditions(
        tiny, dests, ids, as_conditions(edits), metric=logit, source_tokens=srcs, align="exact", progress=False
    )
    torch.testing.assert_close(out, expected(tiny, dests, srcs, ids, edits, "exact"), atol=1e-5, rtol=1e-5)


def test_patching_every_resid_position_at_layer_0_is_the_source_run(tiny):
    """An identity the hand loop shares no code with: the whole residual stream entering layer 0
    taken from an equal-length source gives the source's own logits."""
    dests = tokenize_prompts(tiny, ["The capital of Peru is Tokyo. The capital of Peru is"])
    srcs = tokenize_prompts(tiny, ["The capital of Peru is Lima. The capital of Peru is"])
    ids = ANSWERS[:1]
    _, out = run_conditions(
        tiny, dests, ids, [[PatchEdit(0, "resid_pre")]], metric=logit, source_tokens=srcs, progress=False
    )
    with torch.no_grad():
        source_logits = tiny(torch.tensor(srcs))[0, -1][ids[0]]
    torch.testing.assert_close(out[0, 0], source_logits, atol=1e-5, rtol=1e-5)


def test_batched_equals_one_by_one(tiny):
    dests, srcs = tokenize_prompts(tiny, DESTINATIONS), tokenize_prompts(tiny, SOURCES)
    conditions = as_conditions(EDITS) + [[cp.edits.HeadEdit(1, 0, scale=0.0)], []]
    options = {"metric": logit, "source_tokens": srcs, "progress": False}
    _, batched = run_conditions(tiny, dests, ANSWERS, conditions, batch_size=64, prompt_batch_size=16, **options)
    _, single = run_conditions(tiny, dests, ANSWERS, conditions, batch_size=1, prompt_batch_size=1, **options)
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_patches_mix_with_head_edits(tiny_gemma):
    """A condition with a head scale and a patch at the same hook point: the scale first, the
    patched position then holds the source's value."""
    dests, srcs = tokenize_prompts(tiny_gemma, DESTINATIONS[:1]), tokenize_prompts(tiny_gemma, SOURCES[:1])
    condition = [cp.edits.HeadEdit(1, 2, scale=0.0), PatchEdit(1, "z", -1, head=2)]
    _, out = run_conditions(
        tiny_gemma, dests, ANSWERS[:1], [condition], metric=logit, source_tokens=srcs, progress=False
    )
    _, cache = tiny_gemma.run_with_cache(torch.tensor(srcs))

    def hook(z, hook):
        z = z.clone()
        z[:, :, 2] = 0
        z[0, -1, 2] = cache["blocks.1.attn.hook_z"][0, -1, 2]
        return z

    with torch.no_grad():
        want = tiny_gemma.run_with_hooks(torch.tensor(dests), fwd_hooks=[("blocks.1.attn.hook_z", hook)])[0, -1]
    torch.testing.assert_close(out[0, 0], want[ANSWERS[0]], atol=1e-5, rtol=1e-5)


# --- bad input ----------------------------------------------------------------------------------


def _run(model, conditions, *, align="end", sources=SOURCES, dests=DESTINATIONS):
    return run_conditions(
        model,
        tokenize_prompts(model, dests),
        ANSWERS[: len(dests)],
        conditions,
        source_tokens=None if sources is None else tokenize_prompts(model, sources),
        align=align,
        progress=False,
    )


def test_bad_patches_are_refused(tiny_gemma):
    with pytest.raises(ValueError, match="exists in none of the 3 prompts"):
        _run(tiny_gemma, [[PatchEdit(0, "resid_pre", -40)]])
    with pytest.raises(ValueError, match="exists in none"):
        _run(tiny_gemma, [[PatchEdit(0, "resid_pre", 35)]])
    with pytest.raises(ValueError, match="Unknown PatchEdit site 'resid_post'"):
        _run(tiny_gemma, [[PatchEdit(0, "resid_post", -1)]])
    with pytest.raises(ValueError, match="needs a query head: pass head=0..3"):
        _run(tiny_gemma, [[PatchEdit(0, "z", -1)]])
    with pytest.raises(ValueError, match="Unknown head 7"):
        _run(tiny_gemma, [[PatchEdit(0, "z", -1, head=7)]])
    with pytest.raises(ValueError, match="only for site='z'"):
        _run(tiny_gemma, [[PatchEdit(0, "mlp_out", -1, head=1)]])
    with pytest.raises(ValueError, match="Unknown layer 3"):
        _run(tiny_gemma, [[PatchEdit(3, "mlp_out", -1)]])
    with pytest.raises(ValueError, match="token index"):
        _run(tiny_gemma, [[PatchEdit(0, "mlp_out", 1.5)]])
    with pytest.raises(ValueError, match="need source_tokens"):
        _run(tiny_gemma, [[PatchEdit(0, "mlp_out", -1)]], sources=None)
    with pytest.raises(ValueError, match="one source per destination"):
        _run(tiny_gemma, [[PatchEdit(0, "mlp_out", -1)]], sources=SOURCES[:2])
    with pytest.raises(ValueError, match="Unknown align 'left'"):
        _run(tiny_gemma, [[PatchEdit(0, "mlp_out", -1)]], align="left")
    with pytest.raises(ValueError, match="prompt 0 has .* tokens and its source .* Use align='end'"):
        _run(tiny_gemma, [[PatchEdit(0, "mlp_out", -1)]], align="exact")
    with pytest.raises(TypeError, match="wrap"):
        _run(tiny_gemma, [PatchEdit(0, "mlp_out", -1)])


def test_hooks_are_removed_after_an_error_mid_run(tiny_gemma, monkeypatch):
    import cpsuper.engine as engine

    calls = []
    real = engine.GroupedReadout.add
    before = [len(m._forward_hooks) for m in tiny_gemma.modules()]  # the bridge keeps hooks of its own

    def failing(self, *args, **kwargs):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.GroupedReadout, "add", failing)
    with pytest.raises(RuntimeError, match="boom"):
        _run(tiny_gemma, [[PatchEdit(1, "attn_out", -1)], [PatchEdit(0, "z", -2, head=1)]])
    assert calls
    monkeypatch.setattr(engine.GroupedReadout, "add", real)
    assert all(not hp.fwd_hooks for hp in tiny_gemma.hook_dict.values())
    assert [len(m._forward_hooks) for m in tiny_gemma.modules()] == before


# --- causal_trace ---------------------------------------------------------------------------------


def _probability(model, tokens, answer, hooks=()):
    with torch.no_grad():
        logits = model.run_with_hooks(torch.tensor([tokens]), fwd_hooks=list(hooks))[0, -1]
    return float(logits.softmax(-1)[answer])


def hand_trace(model, dataset, source, destination, sites, layers, positions, make_prompt=None):
    """One run_with_hooks per (fact, site, layer, position): p of the parametric answer's first token."""
    rows = []
    for i, example in enumerate(dataset):
        src_prompt = make_prompt(example) if source == "agreeing" else example.prompts[source]
        dst_prompt = example.prompts[destination]
        src, dst = tokenize_prompts(model, [src_prompt, dst_prompt])
        answers = [cp.runtime.answer_token(model, example.answer, p) for p in (src_prompt, dst_prompt)]
        _, cache = model.run_with_cache(torch.tensor([src]))
        p_dst, p_src = _probability(model, dst, answers[1]), _probability(model, src, answers[0])
        for site in sites:
            for layer in layers:
                for position in positions:
                    d, s = len(dst) + position, len(src) + position  # aligned at the end
                    if d < 0 or s < 0 or (s == 0 and d != 0):  # BOS reads only BOS
                        continue
                    name = HOOKS[site].format(layer)

                    def hook(act, hook, d=d, s=s, name=name, cache=cache):
                        act = act.clone()
                        act[0, d] = cache[name][0, s]
                        return act

                    p = _probability(model, dst, answers[1], [(name, hook)])
                    rows.append((i, site, layer, position, p_dst, p_src, p, model.tokenizer.decode([dst[d]])))
    return pd.DataFrame(
        rows, columns=["example", "site", "layer", "position", "p_destination", "p_source", "p", "token"]
    )


def _capitals(model, n=3):
    return cp.conflict_dataset("world_capital", n=n, seed=1, tokenizer=model)


def test_causal_trace_equals_a_hand_loop(tiny):
    data = _capitals(tiny, 2)
    sites, layers, positions = ("resid_pre", "attn_out", "mlp_out"), [0, 2], [-1, -3, -12]
    result = causal_trace(tiny, data, sites=sites, layers=layers, positions=positions, batch_size=7, progress=False)
    per = result.per_example
    want = hand_trace(tiny, data, "clean", "substitution", sites, layers, positions)
    keys = ["example", "site", "layer", "position"]
    got = per.sort_values(keys).reset_index(drop=True)
    want = want.sort_values(keys).reset_index(drop=True)
    assert len(got) == len(want) == 2 * 3 * 2 * 3
    pd.testing.assert_frame_equal(got[keys], want[keys], check_dtype=False)
    for column in ("p_destination", "p_source", "p"):
        np.testing.assert_allclose(got[column], want[column], atol=1e-6, rtol=1e-5)
    assert list(got["token"]) == list(want["token"])
    np.testing.assert_allclose(got["delta"], got["p"] - got["p_destination"], rtol=0, atol=1e-12)
    gap = got["p_source"] - got["p_destination"]
    np.testing.assert_allclose(got["restored"], got["delta"] / gap, rtol=1e-9)
    assert set(per["source"]) == {"clean"} and set(per["destination"]) == {"substitution"}
    assert (per.loc[per["position"] == -1, "span"] == "end").all()
    subject_rows = per[per["span"] == "subject"]
    assert not subject_rows.empty and all(t.strip() in data[0].subject + data[1].subject for t in subject_rows["token"])


def test_causal_trace_default_positions_and_summaries(tiny_gemma):
    data = _capitals(tiny_gemma, 2)
    result = causal_trace(
        tiny_gemma, data, sites=["mlp_out"], layers=[1], target=["parametric", "context"], progress=False
    )
    per = result.per_example
    for i, example in enumerate(data):
        n_src = len(tokenize_prompts(tiny_gemma, example.prompts["clean"])[0])
        rows = per[(per["example"] == i) & (per["target"] == "parametric")]
        # every position of the clean prompt but its BOS, counted from the end
        assert sorted(rows["position"]) == list(range(-(n_src - 1), 0))
    summary = result.summary
    assert set(summary.columns) >= {
        "source",
        "destination",
        "target",
        "site",
        "layer",
        "span",
        "delta_mean",
        "restored_mean",
        "n",
    }
    relation = per[(per["span"] == "relation") & (per["target"] == "context")]
    row = summary[(summary["span"] == "relation") & (summary["target"] == "context")]
    assert float(row["delta_mean"].iloc[0]) == pytest.approx(relation["delta"].mean())
    assert set(result.by_position["position"]) == set(per["position"])
    intervals = result.intervals("delta", by="position")
    assert {"mean", "ci_low", "ci_high", "n", "span", "token"} <= set(intervals.columns)
    assert (intervals["ci_low"] <= intervals["mean"] + 1e-12).all() and (
        intervals["mean"] <= intervals["ci_high"] + 1e-12
    ).all()


def _agreeing_facts(model):
    data = cp.conflict_dataset("world_capital", n=12, seed=1, tokenizer=model)
    same = [
        len(tokenize_prompts(model, cp.tracing.agreeing_prompt(e, "substitution")[0])[0])
        == len(tokenize_prompts(model, e.prompts["substitution"])[0])
        for e in data
    ]
    assert any(same) and not all(same)
    return data, same


def test_agreeing_prompt_replaces_the_context_answer_only():
    example = _capitals_plain()[0]
    prompt, context = cp.tracing.agreeing_prompt(example, "substitution")
    substitution = example.prompts["substitution"]
    question = example.prompts["clean"]
    assert prompt.endswith(question) and substitution.endswith(question)
    assert example.context_answer not in prompt and example.answer in context
    assert prompt == substitution.replace(example.context_answer, example.answer, 1)


def _capitals_plain():
    return cp.conflict_dataset("world_capital", n=2, seed=1)


def test_agreeing_partner_equals_a_hand_loop(tiny_gpt2):
    data, same = _agreeing_facts(tiny_gpt2)
    with pytest.warns(UserWarning, match=f"{same.count(False)} of 12 facts dropped"):
        result = causal_trace(
            tiny_gpt2, data, source="agreeing", align="exact", sites=["resid_pre"], layers=[0, 1], progress=False
        )
    kept = data[[i for i, s in enumerate(same) if s]]
    make = lambda e: cp.tracing.agreeing_prompt(e, "substitution")[0]  # noqa: E731
    n_dst = max(len(tokenize_prompts(tiny_gpt2, e.prompts["substitution"])[0]) for e in kept)
    want = hand_trace(tiny_gpt2, kept, "agreeing", "substitution", ["resid_pre"], [0, 1], range(-n_dst, 0), make)
    got = result.per_example.copy()
    got["example"] = got["example"].map({j: k for k, j in enumerate(i for i, s in enumerate(same) if s)})
    keys = ["example", "layer", "position"]
    got, want = got.sort_values(keys).reset_index(drop=True), want.sort_values(keys).reset_index(drop=True)
    pd.testing.assert_frame_equal(got[keys], want[keys], check_dtype=False)
    np.testing.assert_allclose(got["p"], want["p"], atol=1e-6, rtol=1e-5)
    answer_rows = got[got["span"] == "context_answer"]
    assert not answer_rows.empty  # the memorised answer's tokens sit where the distractor's were
    assert (got.loc[got["layer"] == 0, "delta"].abs() > 1e-7).sum() == len(answer_rows[answer_rows["layer"] == 0])


def test_causal_trace_bad_input(tiny_gemma):
    data = _capitals(tiny_gemma, 2)
    with pytest.raises(ValueError, match="Unknown site 'z'.*PatchEdit"):
        causal_trace(tiny_gemma, data, sites=["z"], progress=False)
    with pytest.raises(ValueError, match="count from the end.*got 3"):
        causal_trace(tiny_gemma, data, positions=[-1, 3], progress=False)
    with pytest.raises(ValueError, match="exists in none"):
        causal_trace(tiny_gemma, data, positions=[-200], progress=False)
    with pytest.raises(ValueError, match="Unknown source 'truth'"):
        causal_trace(tiny_gemma, data, source="truth", progress=False)
    with pytest.raises(ValueError, match="both 'clean'"):
        causal_trace(tiny_gemma, data, destination="clean", progress=False)
    with pytest.raises(ValueError, match="not with 'clean'"):
        causal_trace(tiny_gemma, data, source="agreeing", destination="clean", progress=False)
    with pytest.raises(ValueError, match="Unknown layer 5"):
        causal_trace(tiny_gemma, data, layers=[5], progress=False)
    with pytest.raises(ValueError, match="Use align='end'"):
        causal_trace(tiny_gemma, data, align="exact", progress=False)
    with pytest.raises(ValueError, match="Unknown align"):
        causal_trace(tiny_gemma, data, align="middle", progress=False)
    with pytest.raises(TypeError, match="must be a ConflictDataset"):
        causal_trace(tiny_gemma, [], progress=False)
    with pytest.raises(ValueError, match="is empty"):
        causal_trace(tiny_gemma, cp.ConflictDataset([e for e in data if False] or [], name="none"), progress=False)


# --- the figure -----------------------------------------------------------------------------------


def test_plot_causal_trace(tiny_gemma):
    from cpsuper.plots.tracing import plot_causal_trace

    data = _capitals(tiny_gemma, 2)
    result = causal_trace(
        tiny_gemma, data, pairs=[("clean", "substitution"), ("clean", "coherent")], layers=[0, 2], progress=False
    )
    fig = plot_causal_trace(result, value="delta", n_boot=50)
    assert len(fig.data) == 3 * 2  # sites x pairs, every panel drawn
    for trace in fig.data:
        z = np.asarray(trace.z, dtype=float)
        assert np.isfinite(z).any()
        assert "ci low" in trace.hovertemplate
    spans = plot_causal_trace(result, by="span", value="delta", n_boot=50)
    assert list(spans.data[0].x) == [s for s in cp.spans.SPAN_GROUPS if s in set(result.per_example["span"])]
    # one destination over facts of different lengths: a token names a column only where every fact has it
    single = causal_trace(tiny_gemma, _capitals(tiny_gemma, 4), layers=[0], sites=("resid_pre",), progress=False)
    per = single.per_example.drop_duplicates(["example", "position"])
    assert per.groupby("example").size().nunique() > 1  # the prompts differ in length
    columns = list(plot_causal_trace(single, value="delta", n_boot=20).data[0].x)
    for column in columns:
        here = per[per.position == int(column.split()[0])]
        if here.token.nunique() == 1:
            assert column.endswith(": " + (here.token.iloc[0].strip() or repr(here.token.iloc[0])))
        else:
            assert ":" not in column and (here.span.nunique() == 1) == ("mostly" not in column)
    assert columns[-1].startswith("-1 end:") and any("mostly" in c for c in columns)
    with pytest.raises(TypeError, match="TraceResult"):
        plot_causal_trace(result.per_example)
    with pytest.raises(ValueError, match="target 'context' is not in this trace"):
        plot_causal_trace(result, target="context")


# --- the embedded model ---------------------------------------------------------------------------


@pytest.mark.slow
def test_causal_trace_on_the_embedded_model(gemma):
    data = cp.filter_known(gemma, cp.conflict_dataset("world_capital", n=12, tokenizer=gemma), progress=False)[:2]
    sites, layers, positions = ("resid_pre", "mlp_out"), [3, 11], [-1, -2, -4]
    result = causal_trace(gemma, data, sites=sites, layers=layers, positions=positions, progress=False)
    want = hand_trace(gemma, data, "clean", "substitution", sites, layers, positions)
    keys = ["example", "site", "layer", "position"]
    got = result.per_example.sort_values(keys).reset_index(drop=True)
    want = want.sort_values(keys).reset_index(drop=True)
    pd.testing.assert_frame_equal(got[keys], want[keys], check_dtype=False)
    # float32 on the 270M model: a padded batch and a single prompt round differently (about 1e-5 at p = 0.2)
    for column in ("p_destination", "p_source", "p"):
        np.testing.assert_allclose(got[column], want[column], atol=1e-5, rtol=1e-4)
    assert (got["delta"].abs() > 1e-3).any()  # the patches did something
