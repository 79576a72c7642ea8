"""Weight truncation (LASER) and MLP drops: exact restoration, exact ranks, identities against
hand computations, sweep values, and errors. Tiny models unless marked slow."""

import math

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import cpsuper as cp
from cpsuper.backend import norm_affine, query_head_weights
from cpsuper.interventions import Knockout, intervene
from cpsuper.plots import plot_truncation, plot_truncation_heatmap
from cpsuper.runtime import answer_token
from cpsuper.scoring import final_logits
from cpsuper.truncation import (
    Truncation,
    drop_mlp,
    low_rank_approx,
    truncate,
    truncation_matrices,
    truncation_rank,
    truncation_sweep,
)

PROMPTS = ["The capital city of France is", "Madrid is located in", "The book was written by"]


def _snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _unchanged(model, snapshot) -> bool:
    return all(torch.equal(snapshot[name], p) for name, p in model.named_parameters())


def _enter(model, edits):
    with truncate(model, edits):
        pass


def _best_rank_k(matrix, k):
    """Independent reference: top-k SVD in float64 by hand."""
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return u[:, :k] @ torch.diag(s[:k]) @ vh[:k], s


def _gain(norm):
    """The column a matrix after ``norm`` is truncated with: the norm's gain where the weights do
    not hold it (a model built from a config, an unprocessed bridge), else ones."""
    gain, _, _ = norm_affine(norm)
    return 1.0 if gain is None else gain.detach().double()[:, None]


# ---------------------------------------------------------------------------------------------
# Restoration and identities


def _value_attention(model) -> bool:
    """Whether ``attn_v`` / ``attn_ov`` exist (a bridged GPT-2's fused ``c_attn`` has no separate
    value projection to write into)."""
    return "attn_v" in truncation_matrices(model)


def test_weights_restored_bit_exactly_after_exit_and_exception(tiny):
    snapshot = _snapshot(tiny)
    value = ("attn_v",) if _value_attention(tiny) else ()
    edits = [Truncation(0, m, 0.3) for m in ("mlp_in", "mlp_out", *value)] + [(2, "attn_o", 0.5, 1)]
    if value:
        edits.append(Truncation(1, "attn_ov", 0.0))
    with truncate(tiny, edits):
        assert not _unchanged(tiny, snapshot)  # the edits are really in place
    assert _unchanged(tiny, snapshot)
    with pytest.raises(RuntimeError, match="inside"), truncate(tiny, edits):
        raise RuntimeError("boom inside the block")
    assert _unchanged(tiny, snapshot)
    with pytest.raises(RuntimeError), drop_mlp(tiny, [0, 2]):
        raise RuntimeError("boom")
    assert _unchanged(tiny, snapshot) and not any(h.fwd_hooks for h in tiny.hook_dict.values())


def test_rho_one_is_the_identity(tiny):
    before = tiny(PROMPTS[0])
    with truncate(
        tiny,
        [
            Truncation(layer, m, 1.0)
            for layer in range(tiny.cfg.n_layers)
            for m in ("mlp_in", "mlp_out", "attn_ov" if _value_attention(tiny) else "attn_o")
        ],
    ):
        assert torch.equal(tiny(PROMPTS[0]), before)
    # Whereas a real truncation changes the logits.
    with truncate(tiny, Truncation(1, "mlp_in", 0.5)):
        assert not torch.allclose(tiny(PROMPTS[0]), before, atol=1e-4)


@pytest.mark.parametrize("matrix", ["mlp_in", "mlp_gate", "mlp_out"])
def test_mlp_matrix_has_requested_rank_and_is_best_approximation(tiny, matrix):
    if matrix == "mlp_gate" and getattr(tiny.blocks[1].mlp, "W_gate", None) is None:
        assert matrix not in truncation_matrices(tiny)  # GPT-2's MLP has no gate
        return
    attr = {"mlp_in": "W_in", "mlp_gate": "W_gate", "mlp_out": "W_out"}[matrix]
    gain = 1.0 if matrix == "mlp_out" else _gain(tiny.blocks[1].ln2)  # the input's norm gain, folded in
    original = gain * getattr(tiny.blocks[1].mlp, attr).detach().double()
    rho = 0.3
    k = math.floor(rho * min(original.shape))
    with truncate(tiny, Truncation(1, matrix, rho)):
        new = gain * getattr(tiny.blocks[1].mlp, attr).detach().double()
    assert k == truncation_rank(rho, *original.shape) == 19
    assert torch.linalg.matrix_rank(new.float()).item() == k  # float32's rounding sets the tolerance
    best, s = _best_rank_k(original, k)
    assert torch.allclose(new.double(), best, atol=1e-5)
    # Eckart-Young: the error is exactly the discarded singular values.
    err = torch.linalg.matrix_norm(new.double() - original.double())
    assert err.item() == pytest.approx(s[k:].pow(2).sum().sqrt().item(), rel=1e-4)


def test_attention_v_and_o_have_requested_rank_per_head(tiny):
    attn = tiny.blocks[0].attn
    d_head = tiny.cfg.d_head
    k = truncation_rank(0.25, d_head)  # 4 of 16
    v_name = "_W_V" if getattr(attn, "_W_V", None) is not None else "W_V"  # the bridge stores W_V per kv head
    gain = _gain(tiny.blocks[0].ln1)
    w_v, w_o = gain * getattr(attn, v_name).detach().double(), attn.W_O.detach().clone()
    value = [Truncation(0, "attn_v", 0.25)] if _value_attention(tiny) else []
    with truncate(tiny, [*value, Truncation(0, "attn_o", 0.25, head=2)]):
        new_v, new_o = gain * getattr(attn, v_name).detach().double(), attn.W_O.detach().clone()
    for g in range(w_v.shape[0] if value else 0):  # every stored (key/value) head
        assert torch.linalg.matrix_rank(new_v[g].float()).item() == k
        assert torch.allclose(new_v[g].double(), _best_rank_k(w_v[g], k)[0], atol=1e-5)
    assert torch.linalg.matrix_rank(new_o[2]).item() == k
    assert torch.allclose(new_o[2].double(), _best_rank_k(w_o[2], k)[0], atol=1e-5)
    for h in (0, 1, 3):  # the other query heads are untouched, bit for bit
        assert torch.equal(new_o[h], w_o[h])


def test_ov_product_truncated_per_query_head(tiny):
    if not _value_attention(tiny):
        pytest.skip("a bridged GPT-2 has no separate value projection (fused c_attn)")
    attn = tiny.blocks[1].attn
    gqa = getattr(attn, "_W_V", None) is not None
    w_v, w_o = query_head_weights(tiny, "W_V", 1).detach().clone(), attn.W_O.detach().clone()
    stored_v = (attn._W_V if gqa else attn.W_V).detach().clone()
    k = truncation_rank(0.25, tiny.cfg.d_head)
    with truncate(tiny, Truncation(1, "attn_ov", 0.25, head=1)):
        new_v, new_o = query_head_weights(tiny, "W_V", 1).detach().clone(), attn.W_O.detach().clone()
        assert torch.equal((attn._W_V if gqa else attn.W_V), stored_v)  # the (shared) W_V is kept
    product = new_v[1] @ new_o[1]  # in the weights' dtype: float32 rounding sets the rank tolerance
    assert torch.linalg.matrix_rank(product).item() == k
    gain = _gain(tiny.blocks[1].ln1)  # the OV map of the normalised input, its gain included
    best = _best_rank_k(gain * w_v[1].double() @ w_o[1].double(), k)[0]
    assert torch.allclose(gain * product.double(), best, atol=1e-5)
    for h in (0, 2, 3):
        assert torch.equal(new_o[h], w_o[h])


def test_ov_rank_zero_keeps_only_the_bias_path(tiny_gpt2):
    """With every head's OV map at rank 0 the attention output is the constant bias path
    ``b_O + sum_h b_V[h] W_O[h]`` of the *original* weights, at every position."""
    if not _value_attention(tiny_gpt2):
        pytest.skip("a bridged GPT-2 has no separate value projection (fused c_attn)")
    attn = tiny_gpt2.blocks[0].attn
    expected = attn.b_O + torch.einsum("hd,hdm->m", attn.b_V, attn.W_O)
    assert (expected - attn.b_O).abs().max() > 1e-3  # the value bias's path is not negligible
    with truncate(tiny_gpt2, Truncation(0, "attn_ov", 0.0)):
        _, cache = tiny_gpt2.run_with_cache(PROMPTS[0], names_filter="blocks.0.hook_attn_out")
    out = cache["blocks.0.hook_attn_out"][0]
    assert torch.allclose(out, expected.detach().expand_as(out), atol=1e-5)


def test_gqa_value_matrix_of_one_query_head_is_an_error(tiny_gemma):
    with pytest.raises(ValueError, match="shares its W_V with query heads \\[0, 1\\].*attn_ov"):
        _enter(tiny_gemma, Truncation(0, "attn_v", 0.5, head=1))
    _enter(tiny_gemma, Truncation(0, "attn_v", 0.5, head=(0, 1, 2, 3)))  # all heads: fine


def test_drop_mlp_equals_zeroing_hook_and_differs_from_rho_zero_with_biases(tiny_gpt2, tiny_gemma):
    prompt = PROMPTS[1]
    with drop_mlp(tiny_gpt2, 1):
        dropped = tiny_gpt2(prompt)
    with intervene(tiny_gpt2, Knockout(1, "mlp")):
        knocked = tiny_gpt2(prompt)
    zero = lambda act, hook: torch.zeros_like(act)
    by_hand = tiny_gpt2.run_with_hooks(prompt, fwd_hooks=[("blocks.1.hook_mlp_out", zero)])
    assert torch.equal(dropped, knocked) and torch.equal(dropped, by_hand)
    with truncate(tiny_gpt2, Truncation(1, "mlp_in", 0.0)):
        rho_zero = tiny_gpt2(prompt)
    assert (rho_zero - dropped).abs().max() > 1e-3  # W_out act(b_in) + b_out survives rho = 0
    # On the bias-free Gemma-style MLP, rho = 0 on W_in is the drop.
    with drop_mlp(tiny_gemma, 1):
        g_drop = tiny_gemma(prompt)
    with truncate(tiny_gemma, Truncation(1, "mlp_in", 0.0)):
        g_zero = tiny_gemma(prompt)
    assert torch.allclose(g_drop, g_zero, atol=1e-5)


def test_low_rank_approx_and_rank_rounding():
    torch.manual_seed(0)
    m = torch.randn(3, 10, 7)
    assert low_rank_approx(m, 7) is m
    approx = low_rank_approx(m, 2)
    assert approx.dtype == m.dtype and all(torch.linalg.matrix_rank(a).item() == 2 for a in approx)
    assert truncation_rank(0.29, 100) == 29 and truncation_rank(0.0125, 2048, 8192) == 25
    assert truncation_rank(0.0, 64) == 0 and truncation_rank(1.0, 64, 128) == 64


# ---------------------------------------------------------------------------------------------
# The sweep


def test_sweep_cell_equals_hand_computation(tiny):
    result = truncation_sweep(
        tiny,
        PROMPTS,
        layers=[0, 2],
        rhos=[0.0, 0.2, 1.0],
        candidates={"correct": " Paris"},
        batch_size=2,
        progress=False,
    )
    per = result.per_example
    assert set(per.candidate) == {"correct", "generic"}
    assert len(per) == len(PROMPTS) * 2 * (3 + 1) * 2  # prompts x layers x (rhos + drop) x candidates
    for prompt_i, layer, rho in [(1, 2, 0.2), (0, 0, 0.0)]:
        with truncate(tiny, Truncation(layer, "mlp_in", rho)):
            probs = final_logits(tiny, [PROMPTS[prompt_i]], progress=False)[0].softmax(-1)
        for label, answer in (("correct", " Paris"), ("generic", " the")):
            row = per[(per.example == prompt_i) & (per.layer == layer) & (per.rho == rho) & (per.candidate == label)]
            assert len(row) == 1
            assert row.p.item() == pytest.approx(probs[answer_token(tiny, answer, PROMPTS[prompt_i])].item(), rel=1e-4)
    full = final_logits(tiny, PROMPTS, progress=False).softmax(-1)
    the = [answer_token(tiny, " the", p) for p in PROMPTS]
    generic = per[per.candidate == "generic"]
    rows = torch.tensor(generic.example.tolist())
    assert np.allclose(generic.p_clean, full[rows, torch.tensor(the)[rows]].numpy(), rtol=1e-4)
    # rho = 1 rows are the full model; the drop rows equal drop_mlp.
    one = per[per.rho == 1.0]
    assert np.allclose(one.p, one.p_clean, rtol=1e-5)
    with drop_mlp(tiny, 0):
        dropped = final_logits(tiny, PROMPTS[:1], progress=False)[0].softmax(-1)
    row = per[(per.edit == "drop") & (per.layer == 0) & (per.example == 0) & (per.candidate == "generic")]
    assert row.p.item() == pytest.approx(dropped[the[0]].item(), rel=1e-4)


def test_sweep_ratios_both_ways(tiny_gpt2):
    result = truncation_sweep(
        tiny_gpt2, PROMPTS, layers=[1], rhos=[0.1], candidates={"correct": " Paris"}, drop=False, progress=False
    )
    per = result.per_example
    wide = per.pivot_table(index="example", columns="candidate", values="p")
    row = result.ratios.iloc[0]
    assert row.ratio_of_means == pytest.approx(wide.correct.mean() / wide.generic.mean(), rel=1e-6)
    assert row.mean_of_ratios == pytest.approx((wide.correct / wide.generic).mean(), rel=1e-6)
    assert row.mean_log_ratio == pytest.approx(np.log(wide.correct / wide.generic).mean(), rel=1e-6)
    assert row.ratio_of_means != pytest.approx(row.mean_of_ratios, rel=1e-4)  # the two really differ here
    summary = result.summary.set_index("candidate")
    assert summary.loc["correct", "p_mean"] == pytest.approx(wide.correct.mean(), rel=1e-6)


def test_sweep_on_conflict_dataset_reads_the_roles(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=3, seed=0, tokenizer=tiny_gemma)
    result = truncation_sweep(
        tiny_gemma, data, layers=[1], rhos=[0.5], which=("mlp_in", "mlp_gate"), drop=False, progress=False
    )
    per = result.per_example
    assert set(per.conflict_type) == {"clean", "substitution", "coherent"}
    assert set(per.candidate) == {"correct", "parametric", "context", "generic"}
    assert set(per.matrix) == {"mlp_in+mlp_gate"}
    tokens = per.set_index(["example", "conflict_type", "candidate"]).token
    for i, example in enumerate(data):
        for conflict_type in data.conflict_types:
            # "correct" is the answer the prompt's context supports.
            expected = example.answer if conflict_type == "clean" else example.context_answer
            assert tokens[i, conflict_type, "correct"] == tiny_gemma.tokenizer.decode(
                [answer_token(tiny_gemma, expected, example.prompts[conflict_type])]
            )
    assert set(result.ratios.conflict_type) == {"clean", "substitution", "coherent"}
    # The in+gate setting equals both truncations applied by hand.
    ex = data[0]
    with truncate(tiny_gemma, [(1, "mlp_in", 0.5), (1, "mlp_gate", 0.5)]):
        probs = final_logits(tiny_gemma, [ex.prompts["coherent"]], progress=False)[0].softmax(-1)
    row = per[(per.example == 0) & (per.conflict_type == "coherent") & (per.candidate == "context")]
    assert row.p.item() == pytest.approx(
        probs[answer_token(tiny_gemma, ex.context_answer, ex.prompts["coherent"])].item(), rel=1e-4
    )


def test_figures(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=2, seed=0, tokenizer=tiny_gemma)
    result = truncation_sweep(tiny_gemma, data, layers=[0, 1], rhos=[0.0, 0.5, 1.0], progress=False)
    fig = plot_truncation(result)
    assert isinstance(fig, go.Figure)
    names = {(t.legendgroup or t.name) for t in fig.data}
    assert any("correct" in n for n in names) and any("MLP dropped" in n for n in names)
    assert isinstance(plot_truncation(result, conflict_type="clean", candidates=["correct", "generic"]), go.Figure)
    heat = plot_truncation_heatmap(result, relative=True)
    assert len(heat.data) == 3 and heat.data[0].z.shape == (2, 3)  # one panel per conflict type, layer x rho
    ratios = result.ratios
    cell = ratios[
        (ratios.conflict_type == "clean") & (ratios.layer == 1) & (ratios.rho == 0.5) & (ratios.edit == "truncate")
    ]
    expected = cell.log_ratio_of_means.item() - cell.log_ratio_of_means_clean.item()
    assert heat.data[0].z[1][1] == pytest.approx(expected)


def test_intervals_over_examples(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=6, seed=0, tokenizer=tiny_gemma)
    result = truncation_sweep(tiny_gemma, data, layers=[1], rhos=[0.2, 1.0], progress=False)
    per = result.per_example
    ints = result.intervals("delta", n_boot=500, seed=1)
    assert len(ints) == len(result.summary)  # one row per setting x conflict type x candidate
    cell = ints[(ints.rho == 0.2) & (ints.conflict_type == "substitution") & (ints.candidate == "context")]
    rows = per[(per.rho == 0.2) & (per.conflict_type == "substitution") & (per.candidate == "context")]
    expected = cp.stats.bootstrap_ci((rows.p - rows.p_clean).to_numpy(), n_boot=500, seed=1)
    assert cell[["mean", "ci_low", "ci_high"]].iloc[0].tolist() == pytest.approx(list(expected[:3]), abs=1e-12)
    assert cell.n.item() == 6
    # rho = 1 changes nothing: a degenerate interval at 0.
    unchanged = ints[ints.rho == 1.0]
    assert np.allclose(unchanged[["mean", "ci_low", "ci_high"]].to_numpy(), 0.0, atol=1e-6)
    p_ints = result.intervals("p", n_boot=500, seed=1)
    assert (p_ints.ci_low <= p_ints["mean"] + 1e-12).all() and (p_ints["mean"] <= p_ints.ci_high + 1e-12).all()
    with pytest.raises(ValueError, match="value must be"):
        result.intervals("ratio")
    fig = plot_truncation(result, conflict_type="clean", n_boot=200)
    bars = [t for t in fig.data if t.error_y is not None and t.error_y.array is not None]
    assert bars and any(np.nanmax(np.asarray(t.error_y.array, dtype=float)) > 0 for t in bars)


# ---------------------------------------------------------------------------------------------
# Errors


def test_bad_inputs_raise_clear_errors(tiny_gpt2, tiny_gemma):
    with pytest.raises(
        ValueError, match="'mlp_gate' does not exist on this model \\(its MLP is not gated\\); it has mlp_in"
    ):
        _enter(tiny_gpt2, Truncation(0, "mlp_gate", 0.5))
    with pytest.raises(ValueError, match="Unknown matrix 'mlp_up'; this model has mlp_in, mlp_gate, mlp_out"):
        _enter(tiny_gemma, Truncation(0, "mlp_up", 0.5))
    with pytest.raises(ValueError, match="Unknown layer 3: this model has layers 0..2"):
        _enter(tiny_gemma, Truncation(3, "mlp_in", 0.5))
    for rho in (1.5, -0.1, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match="rho must be a number in \\[0, 1\\]"):
            _enter(tiny_gemma, Truncation(0, "mlp_in", rho))
    with pytest.raises(ValueError, match="query heads 0..3"):
        _enter(tiny_gemma, Truncation(0, "attn_o", 0.5, head=7))
    with pytest.raises(ValueError, match="head= applies to attention matrices only"):
        _enter(tiny_gemma, Truncation(0, "mlp_in", 0.5, head=0))
    with pytest.raises(ValueError, match="depend on their order"):
        _enter(tiny_gemma, [Truncation(0, "attn_o", 0.5), Truncation(0, "attn_ov", 0.5)])
    with pytest.raises(ValueError, match="Plain prompts need candidates"):
        truncation_sweep(tiny_gemma, PROMPTS, layers=[0], progress=False)
    with pytest.raises(ValueError, match="has 2 answers for 3 prompts"):
        truncation_sweep(tiny_gemma, PROMPTS, layers=[0], candidates={"correct": ["a", "b"]}, progress=False)
    with pytest.raises(ValueError, match="rhos is empty"):
        truncation_sweep(tiny_gemma, PROMPTS, layers=[0], rhos=[], candidates={"c": " a"}, progress=False)
    with pytest.raises(ValueError, match="Unknown layer 9"):
        truncation_sweep(tiny_gemma, PROMPTS, layers=[9], candidates={"c": " a"}, progress=False)
    snapshot = _snapshot(tiny_gemma)
    with pytest.raises(ValueError, match="rho must be"):  # a bad edit in a list changes nothing
        _enter(tiny_gemma, [Truncation(0, "mlp_in", 0.5), Truncation(1, "mlp_in", 2.0)])
    assert _unchanged(tiny_gemma, snapshot)


# ---------------------------------------------------------------------------------------------
# The embedded Gemma-3-270M


@pytest.mark.slow
def test_madrid_example_on_gemma(gemma):
    """ "Madrid is located in": the full model prefers " the" (0.644) to " Spain" (0.041). Keeping
    6 of 640 singular directions of layer 16's MLP gate (rho = 0.01) turns that around (0.578 vs
    0.241), and dropping the layer-16 MLP nearly evens them (0.358 vs 0.390). Measured values, see
    docs/results/truncation.md; the tolerance covers float differences across machines."""
    result = truncation_sweep(
        gemma,
        "Madrid is located in",
        layers=[16],
        rhos=[0.01, 1.0],
        which="mlp_gate",
        candidates={"correct": " Spain"},
        progress=False,
    )
    p = result.summary.set_index(["edit", "rho", "candidate"]).p_mean
    full_spain, full_the = p["truncate", 1.0, "correct"], p["truncate", 1.0, "generic"]
    assert full_spain == pytest.approx(0.0413, abs=0.005) and full_the == pytest.approx(0.644, abs=0.02)
    assert p["truncate", 0.01, "correct"] == pytest.approx(0.578, abs=0.03)
    assert p["truncate", 0.01, "generic"] == pytest.approx(0.241, abs=0.03)
    drop = result.summary[result.summary.edit == "drop"].set_index("candidate").p_mean
    assert drop["correct"] == pytest.approx(0.358, abs=0.03) and drop["generic"] == pytest.approx(0.390, abs=0.03)
    ratio = result.ratios.set_index(["edit", "rho"]).ratio_of_means
    assert ratio["truncate", 0.01].item() > 2.0 and ratio["truncate", 1.0].item() < 0.1
