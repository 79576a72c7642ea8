"""The TransformerBridge backend (TransformerLens >= 4.3), checked against the Hugging Face model it
wraps: logits, the final-residual path, head knockouts done on Hugging Face's own ``o_proj`` input,
greedy decoding against ``generate``, and key/value weights per query head. The backend choice and
its errors are checked on every installation."""

import copy

import pytest
import torch

import cpsuper as cp
from cpsuper import backend
from cpsuper.decoding import iter_final_logits
from cpsuper.edits import HeadEdit
from cpsuper.engine import answer_probabilities
from cpsuper.runtime import tokenize_prompts
from cpsuper.toys.build import (
    hooked_state,
    load_toy_state,
    read_weight,
    stored_weights,
    toy_parameter,
    trainable_names,
    write_weights,
)
from cpsuper.toys.common import attention_toy_model, blank_attention_model

PROMPTS = ["The capital of France is", "Paris is the capital of", "The Eiffel Tower is located in the city of"]

needs_bridge = pytest.mark.skipif(
    backend.TransformerBridge is None or backend.TL_VERSION < backend.BRIDGE_MIN_VERSION,
    reason="TransformerLens >= 4.3 is not installed (CI runs these in its second environment)",
)


def test_backend_choice_and_errors():
    assert backend.check_backend(None) == backend.default_backend()
    with pytest.raises(ValueError, match="backend must be 'hooked' or 'bridge'"):
        cp.tiny_model("gemma", backend="transformers")
    if backend.HookedTransformer is None:
        with pytest.raises(RuntimeError, match="transformer-lens>=3.9,<4"):
            cp.load_model("tiny-gemma", backend="hooked")
    if backend.TL_VERSION < backend.BRIDGE_MIN_VERSION:
        with pytest.raises(RuntimeError, match="needs TransformerLens >= 4.3"):
            cp.load_model("tiny-gemma", backend="bridge")
    if backend.HookedTransformer is not None:
        with pytest.raises(ValueError, match="process_weights is a bridge option"):
            cp.load_model("tiny-gemma", backend="hooked", process_weights=False)
    model = cp.tiny_model("gemma")
    assert backend.backend_of(model) == backend.default_backend() and backend.is_model(model)


@pytest.fixture(scope="module", params=["gemma", "gpt2"])
def bridge(request):
    return cp.tiny_model(request.param, seed=0, backend="bridge")


def _hf_last_logits(model, tokens):
    with torch.no_grad():
        return model.original_model(torch.tensor([tokens])).logits[0, -1]


@needs_bridge
def test_final_residual_path_equals_hugging_face(bridge):
    lists = tokenize_prompts(bridge, PROMPTS)
    for idx, logits in iter_final_logits(bridge, lists, batch_size=3, progress=False):  # padded batch
        for row, i in enumerate(idx):
            torch.testing.assert_close(logits[row], _hf_last_logits(bridge, lists[i]), atol=1e-4, rtol=1e-4)
    assert not any(h._forward_hooks for h in bridge.hook_dict.values())  # the early stop left no hook


def _max_difference(a, b) -> float:
    numbers = a.select_dtypes("number").columns
    assert list(a.columns) == list(b.columns) and len(a) == len(b) > 0
    return float((a[numbers].reset_index(drop=True) - b[numbers].reset_index(drop=True)).abs().max().max())


@needs_bridge
def test_unprocessed_weights_give_the_same_analyses():
    """process_weights=False (no whole-model copies at load) changes no result on a model without value
    biases: cpsuper reads each norm's gain where it sits. With value biases (GPT-2) a head's output
    carries its bias unless it is folded, so per-head results differ, and the load says so. By
    default a bridge is processed only then: Gemma stays as Hugging Face has it, GPT-2 is folded."""
    processed = cp.tiny_model("gemma", backend="bridge", process_weights=True)
    raw = cp.tiny_model("gemma", backend="bridge", process_weights=False)
    assert not torch.equal(processed.W_Q, raw.W_Q)  # the norm gains are folded in one and not the other
    assert torch.equal(cp.tiny_model("gemma", backend="bridge").W_Q, raw.W_Q)
    gpt2 = cp.tiny_model("gpt2", backend="bridge")
    assert torch.equal(gpt2.W_Q, cp.tiny_model("gpt2", backend="bridge", process_weights=True).W_Q)
    assert not torch.equal(gpt2.W_Q, cp.tiny_model("gpt2", backend="bridge", process_weights=False).W_Q)
    data = cp.conflict_dataset("world_capital", n=4, seed=0, tokenizer=processed)
    for analysis in (
        lambda m: cp.head_sweep(m, data, layers=[1], progress=False).summary,
        lambda m: cp.knockout_sweep(m, data, progress=False).summary,
        lambda m: cp.direct_logit_attribution(m, data, ["parametric-context"], progress=False).heads(),
        lambda m: cp.path_patching(m, data, progress=False),
        # a rank keeps the directions of the matrix times its input norm's gain, folded in or not
        *(
            lambda m, which=which: (
                cp.truncation_sweep(m, data, layers=[1], rhos=[0.25], which=which, drop=False).summary
            )
            for which in ("mlp_in", "mlp_gate", "attn_v", "attn_ov")
        ),
    ):
        assert _max_difference(analysis(processed), analysis(raw)) < 1e-5
    with pytest.warns(UserWarning, match="value biases"):
        cp.load_model("tiny-gpt2", backend="bridge", process_weights=False)


@needs_bridge
@pytest.mark.parametrize("kind", ["gemma", "gpt2"])
def test_raw_logits_equal_an_untouched_hugging_face_model(kind):
    """Weight processing keeps raw logits, not only their softmax: the bridge's default would
    centre the unembedding and shift every logit by the same amount (here about 0.01), which
    the comparison above cannot see, as the processed model is the reference there."""
    from cpsuper.bridge import boot_bridge, tiny_hf_model
    from cpsuper.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    hf_model = tiny_hf_model(kind, len(tokenizer), seed=0)
    untouched = copy.deepcopy(hf_model)
    bridge = boot_bridge(hf_model, tokenizer, process_weights=True)
    tokens = torch.tensor([tokenize_prompts(bridge, PROMPTS[:1])[0]])
    with torch.no_grad():
        expected = untouched(tokens).logits[0, -1]
        torch.testing.assert_close(bridge(tokens)[0, -1], expected, atol=1e-4, rtol=1e-4)
        last = next(iter_final_logits(bridge, [tokens[0].tolist()], progress=False))[1][0]
    torch.testing.assert_close(last, expected, atol=1e-4, rtol=1e-4)


def _o_proj(model, layer):
    block = model.original_model.transformer.h[layer] if hasattr(model.original_model, "transformer") else None
    if block is not None:
        return block.attn.c_proj
    return model.original_model.model.layers[layer].self_attn.o_proj


def _check_knockout_against_hugging_face(model, lists, ids, layer, head, atol, rtol):
    """The engine's knockout of (layer, head) == the head's d_head slice zeroed at Hugging Face's
    output projection, in a run that uses no TransformerLens hook at all."""
    _, out = answer_probabilities(model, lists, ids, [[HeadEdit(layer, head, scale=0.0)]], progress=False)
    d_head = model.cfg.d_head

    def zero_head(module, args):
        x = args[0].clone()
        x[..., head * d_head : (head + 1) * d_head] = 0
        return (x,)

    handle = _o_proj(model, layer).register_forward_pre_hook(zero_head)
    try:
        for i, tokens in enumerate(lists):
            expected = _hf_last_logits(model, tokens).softmax(-1)[ids[i]]
            torch.testing.assert_close(out[i, 0], expected, atol=atol, rtol=rtol)
    finally:
        handle.remove()


@needs_bridge
def test_resuming_at_a_layer_runs_only_the_blocks_from_it(bridge):
    """TransformerLens 4.3 runs (and discards) every block before ``start_at_layer``; cpsuper's
    resumed runs skip them: the same final residual from a third of the work, hooks before the
    start silent, and no block left patched (also after an error inside the run)."""
    from torch.utils.flop_counter import FlopCounterMode

    tokens = bridge.to_tokens(PROMPTS)
    saved = {}
    with torch.no_grad(), cp.interrupts.hooked(bridge, backend.saving_hooks({"blocks.2.hook_resid_pre"}, saved)):
        full = backend.final_residual(bridge, tokens)
    fired = []

    def note(x, hook):
        fired.append(hook.name)

    hooks = [(f"blocks.{layer}.hook_resid_pre", note) for layer in range(3)]
    with torch.no_grad(), FlopCounterMode(display=False) as resumed, cp.interrupts.hooked(bridge, hooks):
        again = backend.final_residual(bridge, saved["blocks.2.hook_resid_pre"], start_at_layer=2)
    with torch.no_grad(), FlopCounterMode(display=False) as whole:
        backend.final_residual(bridge, tokens)
    torch.testing.assert_close(again, full, atol=1e-5, rtol=0)
    assert len(fired) == 1 and fired[0] in ("blocks.2.hook_resid_pre", "blocks.2.hook_in")  # the bridge's alias
    assert resumed.get_total_flops() < 0.4 * whole.get_total_flops()  # 1 of 3 blocks

    def fail(x, hook):
        raise RuntimeError("inside the run")

    with (
        pytest.raises(RuntimeError, match="inside the run"),
        cp.interrupts.hooked(bridge, [("blocks.2.hook_resid_pre", fail)]),
    ):
        backend.final_residual(bridge, saved["blocks.2.hook_resid_pre"], start_at_layer=2)
    assert all("forward" not in vars(b) and "forward" not in vars(b.original_component) for b in bridge.blocks)
    with torch.no_grad():
        torch.testing.assert_close(backend.final_residual(bridge, tokens), full, atol=0, rtol=0)


@needs_bridge
def test_head_knockout_equals_zeroing_its_slice_of_o_proj_in_hugging_face(bridge):
    lists = tokenize_prompts(bridge, PROMPTS)
    _check_knockout_against_hugging_face(bridge, lists, torch.tensor([[5, 6]] * len(lists)), 1, 2, 1e-5, 1e-4)


def _layer_module(model, layer, name):
    """Hugging Face's ``o_proj`` (or GPT-2's ``c_proj``) / MLP module of ``layer``."""
    if name == "o_proj":
        return _o_proj(model, layer)
    hf = model.original_model
    return (hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers)[layer].mlp


@needs_bridge
def test_attribution_and_additivity_equal_hugging_face_computations(bridge):
    """Direct logit attribution's logit and its reconstruction, and additivity's single and joint
    final-position ablations, against Hugging Face runs with plain PyTorch hooks."""
    data = cp.conflict_dataset("world_capital", n=2, seed=0, tokenizer=bridge)
    attr = cp.direct_logit_attribution(
        bridge, data, ["parametric-context"], conflict_types=["substitution"], progress=False
    )
    classes = {"head": [(1, 2)], "mlp": [("mlp", 0)]}
    add = cp.additivity(bridge, data, classes, conflict_types=["substitution"], progress=False).per_example
    d_head = bridge.cfg.d_head

    def zero_head_last(module, args):
        x = args[0].clone()
        x[:, -1, 2 * d_head : 3 * d_head] = 0
        return (x,)

    def zero_mlp_last(module, args, out):
        out = out.clone()
        out[:, -1] = 0
        return out

    for i, example in enumerate(data):
        prompt = example.prompts["substitution"]
        tokens = tokenize_prompts(bridge, [prompt])[0]
        plus, minus = (cp.runtime.answer_token(bridge, a, prompt) for a in (example.answer, example.context_answer))

        def difference(tokens=tokens, plus=plus, minus=minus):
            logits = _hf_last_logits(bridge, tokens)
            return float(logits[plus] - logits[minus])

        clean = difference()
        total = attr.totals[attr.totals.example == i].iloc[0]
        assert total.logit == pytest.approx(clean, abs=1e-4)
        assert total.reconstructed == pytest.approx(clean, abs=1e-3)
        handles = []
        try:
            for condition, hooks in [("head", ["head"]), ("mlp", ["mlp"]), ("head + mlp", ["head", "mlp"])]:
                for kind in hooks:
                    if kind == "head":
                        handles.append(_layer_module(bridge, 1, "o_proj").register_forward_pre_hook(zero_head_last))
                    else:
                        handles.append(_layer_module(bridge, 0, "mlp").register_forward_hook(zero_mlp_last))
                expected = difference() - clean
                while handles:
                    handles.pop().remove()
                row = add[(add.example == i) & (add.condition == condition)]
                assert row.delta.item() == pytest.approx(expected, abs=1e-4)
        finally:
            for handle in handles:
                handle.remove()


@needs_bridge
def test_a_model_split_by_device_map_with_disk_offload(tmp_path):
    """A bridge loaded with a device_map that keeps two of three blocks on disk (accelerate moves each
    in for its own forward): logits equal the plain Hugging Face model's, a knockout sweep equals the
    one on a model held in memory, and an analysis that reads weights directly says why it cannot run."""
    pytest.importorskip("accelerate")
    from cpsuper.bridge import tiny_hf_model
    from cpsuper.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    ids = {f"{t}_token_id": tokenizer.convert_tokens_to_ids(f"<{t}>") for t in ("pad", "bos", "eos")}
    tiny_hf_model("gemma", len(tokenizer), 3, 0, **ids).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.rotary_emb_local": "cpu"}
    device_map |= {"model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk"}
    device_map |= {"model.norm": "cpu", "lm_head": "cpu"}
    split = cp.load_model(
        str(tmp_path / "tiny"), backend="bridge", device_map=device_map, offload_folder=str(tmp_path / "offload")
    )
    assert backend.offloaded(split)
    whole = cp.tiny_model("gemma", seed=0, backend="bridge")
    lists = tokenize_prompts(whole, PROMPTS)
    reference = tiny_hf_model("gemma", len(tokenizer), 3, 0, **ids).eval()
    for idx, logits in iter_final_logits(split, lists, batch_size=3, progress=False):
        for row, i in enumerate(idx):
            with torch.no_grad():
                expected = reference(torch.tensor([lists[i]])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
    answer_ids = torch.tensor([[5, 6]] * len(lists))
    conditions = [[HeadEdit(1, 2, scale=0.0)], [HeadEdit(2, 0, scale=3.0)]]
    _, on_disk = answer_probabilities(split, lists, answer_ids, conditions, progress=False)
    _, in_memory = answer_probabilities(whole, lists, answer_ids, conditions, progress=False)
    torch.testing.assert_close(on_disk, in_memory, atol=1e-6, rtol=1e-4)
    data = cp.conflict_dataset("world_capital", n=2, seed=0, tokenizer=whole)
    with pytest.raises(ValueError, match="offloaded some of them"):
        cp.direct_logit_attribution(split, data, progress=False)
    with pytest.raises(ValueError, match="offloaded some of them"):
        cp.truncation.truncate(split, (1, "mlp_in", 0.5))


@needs_bridge
def test_greedy_decoding_equals_an_argmax_loop_on_hugging_face(bridge):
    """Reference: Hugging Face's forward on the growing sequence, no cache. (``generate`` on a
    bridged model is not a reference: its key-value cache path runs through the bridge's attention.)"""
    lists = tokenize_prompts(bridge, PROMPTS)
    ours = cp.scoring.greedy_continuations(bridge, PROMPTS, max_new_tokens=4, progress=False)
    for tokens, text in zip(lists, ours):
        seq = list(tokens)
        for _ in range(4):
            seq.append(int(_hf_last_logits(bridge, seq).argmax()))
        assert text == bridge.tokenizer.decode(seq[len(tokens) :])


@needs_bridge
def test_bridge_decoding_keeps_a_key_value_cache_and_falls_back_without_one(bridge, monkeypatch):
    """After the prompt, each step feeds the bridge one new token per row (Hugging Face's cache
    holds the rest), with the continuations of an uncached run. Where the bridge leaves the cache
    empty, decoding says so and reruns the prompts instead, with the same continuations."""
    import cpsuper.decoding as decoding

    widths = []
    real = decoding.final_residual
    monkeypatch.setattr(decoding, "final_residual", lambda m, t, **kw: widths.append(t.shape[1]) or real(m, t, **kw))
    cached = cp.scoring.greedy_continuations(bridge, PROMPTS, max_new_tokens=4, progress=False)
    assert widths[1:] == [1, 1, 1] and widths[0] > 1
    widths.clear()
    with monkeypatch.context() as patch:
        patch.setattr(decoding.Steering, "takes_hf_cache", lambda self, state: False)
        uncached = cp.scoring.greedy_continuations(bridge, PROMPTS, max_new_tokens=4, progress=False)
    assert uncached == cached and widths == [widths[0] + i for i in range(4)]

    class NeverFilled(type(decoding.hf_cache(bridge))):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return key_states, value_states  # as a bridge that ignores the cache leaves it

    monkeypatch.setattr(decoding, "hf_cache", lambda model: NeverFilled(config=model.original_model.config))
    decoding.warn_uncached_bridge.cache_clear()  # it says so once per process
    widths.clear()
    with pytest.warns(UserWarning, match="does not fill a key-value cache"):
        fallback = cp.scoring.greedy_continuations(bridge, PROMPTS, max_new_tokens=4, progress=False)
    assert fallback == cached and widths == [widths[0] + i for i in range(4)]


MIXED = PROMPTS[:2] + [" ".join(PROMPTS) * 3, PROMPTS[1] + " " + PROMPTS[2] * 4]


def _uncached(steering_classes, patch):
    """Make greedy decoding rerun the text so far at every step for these steering classes."""
    for cls in steering_classes:
        patch.setattr(cls, "takes_hf_cache", lambda self, state: False)


@needs_bridge
def test_bridge_prefills_groups_of_widths_apart_on_hugging_face_caches(bridge, monkeypatch):
    """Short and long prompts in one batch are prefilled at their own widths, their Hugging Face
    caches stacked into the batch's; the continuations equal uncached decoding's, unsteered and
    under a dual run (whose groups are twin batches)."""
    import cpsuper.decoding as decoding
    from cpsuper.dual_run import DualRunSteering

    lists = tokenize_prompts(bridge, MIXED)
    assert decoding.prefill_groups([len(t) for t in lists]) is not None
    widths = []
    real = decoding.final_residual
    monkeypatch.setattr(decoding, "final_residual", lambda m, t, **kw: widths.append(t.shape) or real(m, t, **kw))
    steer = cp.JuICE(bridge, enhance=[(1, 0), (2, 1)], suppress=[(0, 1)], beta_plus=2.0, beta_minus=-0.5)

    def decode(steering):
        ((_, _, ids),) = decoding.greedy_batches(bridge, lists, [[0, 1, 2, 3]], max_new_tokens=4, steering=steering)
        return ids

    plain = decode(None)
    assert len([w for w in widths if w[1] > 1]) == 2 and widths[-1] == (4, 1)
    steered = decode(steer)
    assert steered != plain
    with monkeypatch.context() as patch:
        _uncached([decoding.Steering, DualRunSteering], patch)
        assert decode(None) == plain and decode(steer) == steered


@needs_bridge
def test_a_dual_run_decodes_on_one_hugging_face_cache_as_a_twin_batch(bridge, monkeypatch):
    """On the bridge, JuICE's two passes decode as one batch holding every prompt twice, on one
    Hugging Face cache fed only the new token. The continuations equal an uncached dual run's
    (both passes rerun on the text so far at each step): with fixed strengths, with a strength per
    row (strength tuning's grid), and when a row finishes early and leaves the batch with its twin."""
    import cpsuper.dual_run as dual_run
    from cpsuper.decoding import greedy_batches
    from cpsuper.dual_run import StrengthPerRow

    steer = cp.JuICE(bridge, enhance=[(1, 0), (2, 1)], suppress=[(0, 1)], beta_plus=2.0, beta_minus=-0.5)
    per_row = StrengthPerRow(steer, torch.tensor([2.0, 0.0, 2.0]), torch.tensor([-0.5, 0.0, -0.5]), torch.full((3,), 2))
    lists = tokenize_prompts(bridge, PROMPTS)

    def decode(steering, finished=None):
        ((_, _, ids),) = greedy_batches(
            bridge, lists, [[0, 1, 2]], max_new_tokens=4, steering=steering, finished=finished
        )
        return ids

    shapes = []
    real = dual_run.final_residual
    monkeypatch.setattr(
        dual_run, "final_residual", lambda m, t, **kw: shapes.append(tuple(t.shape)) or real(m, t, **kw)
    )
    cached, cached_rows = decode(steer), decode(per_row)
    assert shapes[:4] == [(6, shapes[0][1]), (6, 1), (6, 1), (6, 1)] and shapes[0][1] > 1
    plain = decode(None)
    assert cached[1] != plain[1] or cached[0] != plain[0]  # the steering changes something
    assert cached_rows[1] == plain[1] and cached_rows[0] == cached[0] and cached_rows[2] == cached[2]
    stop_row_1 = decode(steer, finished=lambda k, ids: k == 1)
    assert stop_row_1 == [cached[0], cached[1][:1], cached[2]]
    with monkeypatch.context() as patch:
        _uncached([dual_run.DualRunSteering, StrengthPerRow], patch)
        assert decode(steer) == cached and decode(per_row) == cached_rows


@needs_bridge
def test_attribution_patching_refuses_the_bridge_and_exact_patching_runs_on_it(bridge):
    """The bridge's hook points give no gradients, so attribution patching says to use the
    HookedTransformer; exact head patching, on the sweep engine, runs on the bridge."""
    from cpsuper.attribution_patching import attribution_patching, exact_head_patching

    data = cp.conflict_dataset("world_capital", n=2, seed=0, tokenizer=bridge)
    with pytest.raises(ValueError, match="backend='hooked'"):
        attribution_patching(bridge, data, progress=False)
    exact = exact_head_patching(bridge, data, progress=False)
    assert len(exact) == 2 * bridge.cfg.n_layers * bridge.cfg.n_heads and exact.delta.notna().all()


@needs_bridge
def test_value_weights_per_query_head(bridge):
    w_v = backend.query_head_weights(bridge, "W_V")
    assert w_v.shape == (bridge.cfg.n_layers, bridge.cfg.n_heads, bridge.cfg.d_model, bridge.cfg.d_head)
    group = bridge.cfg.n_heads // (bridge.cfg.n_key_value_heads or bridge.cfg.n_heads)
    torch.testing.assert_close(w_v[:, 0], w_v[:, group - 1])  # heads of one group share W_V
    torch.testing.assert_close(backend.query_head_weights(bridge, "W_V", layer=1), w_v[1])


@needs_bridge
@pytest.mark.slow
def test_embedded_model_on_the_bridge(tmp_path_factory, two_pass):
    model = cp.load_model("gemma-3-270m", device="cpu", backend="bridge")
    assert backend.is_bridge(model) and model.cfg.n_key_value_heads == 1
    assert (
        cp.scoring.greedy_continuations(
            model, "The Eiffel Tower is located in the city of", max_new_tokens=2, progress=False
        )
        .strip()
        .startswith("Paris")
    )
    lists = tokenize_prompts(model, PROMPTS[:2])
    for idx, logits in iter_final_logits(model, lists, progress=False):
        for row, i in enumerate(idx):
            torch.testing.assert_close(logits[row], _hf_last_logits(model, lists[i]), atol=1e-3, rtol=1e-4)
    ids = torch.tensor([[model.to_single_token(" Paris")]] * 2)
    _check_knockout_against_hugging_face(model, lists, ids, 9, 1, 1e-4, 1e-3)
    # JuICE's dual run (second pass resumed at the first steered layer) equals a hand-written two-pass run.
    steer = cp.JuICE(model, enhance=[(3, 1), (10, 0)], suppress=[(8, 0)], beta_plus=2.0, beta_minus=-1.0)
    expected = torch.stack([two_pass(model, p, {(3, 1): 2.0, (10, 0): 2.0, (8, 0): -1.0}) for p in PROMPTS[:2]])
    torch.testing.assert_close(steer.logits(PROMPTS[:2]), expected, atol=2e-3, rtol=1e-4)
    # Greedy decoding on Hugging Face's caches (prefilled in groups of widths; the dual run as twin
    # batches) gives the continuations of uncached decoding, sliding-window layers included.
    plain, steered = cp.scoring.greedy_continuations(model, MIXED, progress=False), steer.generate(MIXED)
    with pytest.MonkeyPatch.context() as patch:
        from cpsuper.decoding import Steering
        from cpsuper.dual_run import DualRunSteering

        _uncached([Steering, DualRunSteering], patch)
        assert cp.scoring.greedy_continuations(model, MIXED, progress=False) == plain
        assert steer.generate(MIXED) == steered
    # Truncation written into Hugging Face's gate_proj gives the HookedTransformer's Madrid numbers.
    madrid = cp.truncation_sweep(
        model, "Madrid is located in", layers=[16], rhos=[0.01], which="mlp_gate", candidates=[" Spain"], drop=False
    ).summary.set_index("candidate")
    assert madrid.loc["Spain", "p_mean"] == pytest.approx(0.578, abs=0.03)
    assert madrid.loc["generic", "p_mean"] == pytest.approx(0.241, abs=0.03)


@needs_bridge
def test_truncation_writes_hugging_face_weights(bridge):
    snapshot = {name: p.detach().clone() for name, p in bridge.named_parameters()}
    with cp.truncation.truncate(bridge, (1, "mlp_in", 0.5)):  # written into Hugging Face's own weights
        assert not all(torch.equal(snapshot[n], p) for n, p in bridge.named_parameters())
    assert all(torch.equal(snapshot[n], p) for n, p in bridge.named_parameters())
    if "attn_v" not in cp.truncation.truncation_matrices(bridge):  # GPT-2's fused c_attn
        with pytest.raises(ValueError, match="does not exist on this model"):
            cp.truncation.truncate(bridge, (1, "attn_v", 0.5))


@needs_bridge
def test_plain_hugging_face_copy_computes_what_the_bridge_computes():
    """The copy peft wraps for LoRA on a bridge: every position's logits equal the bridge's, and it
    shares no storage with it; a processed GPT-2 (fused c_attn) cannot be copied and says why."""
    from cpsuper.bridge import plain_hf_copy

    bridge = cp.tiny_model("gemma", seed=0, backend="bridge")
    plain = plain_hf_copy(bridge)
    tokens = torch.tensor([tokenize_prompts(bridge, PROMPTS[:1])[0]])
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, bridge(tokens), atol=1e-5, rtol=1e-5)
    bridge_storage = {p.untyped_storage().data_ptr() for p in bridge.parameters()}
    assert not bridge_storage & {p.untyped_storage().data_ptr() for p in plain.parameters()}
    with pytest.raises(ValueError, match="process_weights=False"):
        plain_hf_copy(cp.tiny_model("gpt2", seed=0, backend="bridge"))


@needs_bridge
def test_toy_models_on_the_bridge_are_the_models_written():
    """The toys' native bridge: attention scores unscaled when asked, weights written and read in
    TransformerLens's layout, trained through the stored tensor, and a checkpoint in
    HookedTransformer's layout (a run saved with TransformerLens 3.x) loading into it exactly."""
    gen = torch.Generator().manual_seed(0)
    d, vocab = 3, 5
    embed, unembed, w_kq, w_v = (
        torch.randn(*shape, generator=gen) for shape in [(vocab, d), (d, vocab), (d, d), (d, d)]
    )
    toy = attention_toy_model(embed, unembed, w_kq, w_v, n_ctx=4, train_kq=True, train_v=False)
    assert backend.is_bridge(toy)
    tokens = torch.tensor([[1, 2, 3, 4]])
    phi = embed[tokens[0]]
    expected = unembed.T @ w_v @ (torch.softmax(phi @ w_kq @ phi[-1], 0) @ phi)  # no 1/sqrt(d_head)
    torch.testing.assert_close(toy(tokens)[0, -1], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(read_weight(toy, "blocks.0.attn.W_K")[0, :d], w_kq)
    trainable = [p for p in toy.parameters() if p.requires_grad]
    assert len(trainable) == 1 and trainable[0] is toy_parameter(toy, "blocks.0.attn.W_K")
    assert trainable_names(toy) == {"blocks.0.attn.W_K"}
    assert trainable[0].shape == (d, 2 * d)  # nn.Linear's [out, in]: the view's transpose

    model = blank_attention_model(seed=0, name="toy", n_layers=2, n_heads=2, d_model=4, d_head=3, d_vocab=5, n_ctx=4)
    hooked_layout = {}
    for layer in range(2):
        for name, shape in [("W_Q", (2, 4, 3)), ("W_K", (2, 4, 3)), ("W_V", (2, 4, 3)), ("W_O", (2, 3, 4))]:
            hooked_layout[f"blocks.{layer}.attn.{name}"] = torch.randn(*shape, generator=gen)
        for name, shape in [("b_Q", (2, 3)), ("b_K", (2, 3)), ("b_V", (2, 3)), ("b_O", (4,))]:
            hooked_layout[f"blocks.{layer}.attn.{name}"] = torch.randn(*shape, generator=gen)
    hooked_layout |= {
        "embed.W_E": torch.randn(5, 4, generator=gen),
        "pos_embed.W_pos": torch.randn(4, 4, generator=gen),
    }
    hooked_layout |= {"unembed.W_U": torch.randn(4, 5, generator=gen), "unembed.b_U": torch.zeros(5)}
    write_weights(model, hooked_layout)
    for name, value in hooked_layout.items():
        torch.testing.assert_close(read_weight(model, name), value, msg=name)
    fresh = blank_attention_model(seed=0, name="toy", n_layers=2, n_heads=2, d_model=4, d_head=3, d_vocab=5, n_ctx=4)
    load_toy_state(fresh, hooked_layout)
    torch.testing.assert_close(fresh(tokens), model(tokens), atol=0, rtol=0)
    state = hooked_state(model)  # what a toy's checkpoints hold on either backend
    assert set(state) == set(hooked_layout) and all(torch.equal(state[k], v) for k, v in hooked_layout.items())
    with cp.interrupts.swapped_parameters(model, stored_weights(model, {"blocks.1.attn.W_O": torch.zeros(2, 3, 4)})):
        assert not read_weight(model, "blocks.1.attn.W_O").any()
    torch.testing.assert_close(read_weight(model, "blocks.1.attn.W_O"), hooked_layout["blocks.1.attn.W_O"])


@pytest.mark.skipif(backend.HookedTransformer is None, reason="needs TransformerLens 3.x")
def test_a_bridge_checkpoint_is_refused_by_a_hooked_transformer():
    model = blank_attention_model(seed=0, name="toy", n_layers=1, n_heads=1, d_model=4, d_head=4, d_vocab=5, n_ctx=4)
    bridge_state = {"embed.weight": torch.zeros(5, 4), "blocks.0.attn.k.weight": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match="holds a TransformerBridge's own state dict"):
        load_toy_state(model, bridge_state)
    # A bridge's hooked_state has the same names and layout but none of HookedTransformer's
    # attention-mask buffers; loading it keeps the model's own.
    write_weights(model, {"blocks.0.attn.W_K": torch.randn(1, 4, 4), "embed.W_E": torch.randn(5, 4)})
    weights = {k: v.clone() for k, v in hooked_state(model).items() if ".W_" in k or ".b_" in k}
    fresh = blank_attention_model(seed=0, name="toy", n_layers=1, n_heads=1, d_model=4, d_head=4, d_vocab=5, n_ctx=4)
    load_toy_state(fresh, weights)
    tokens = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(fresh(tokens), model(tokens), atol=0, rtol=0)
    assert isinstance(toy_parameter(model, "blocks.0.attn.W_K"), torch.nn.Parameter)
