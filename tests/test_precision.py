"""cp.precision.mixed_precision: bf16 / fp16 forward passes under torch.autocast with a float32 readout."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper.decoding import unembed_final


@pytest.fixture(scope="module")
def facts(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)


def test_fp32_is_the_plain_run(tiny_gemma, facts):
    plain = cp.head_sweep(tiny_gemma, facts, (0.0, 2.0), progress=False).per_example
    with cp.precision.mixed_precision(tiny_gemma, "fp32"):
        same = cp.head_sweep(tiny_gemma, facts, (0.0, 2.0), progress=False).per_example
    pd.testing.assert_frame_equal(plain, same)


def test_bf16_runs_in_bf16_and_agrees_to_bf16_accuracy(tiny_gemma, facts):
    plain = cp.head_sweep(tiny_gemma, facts, (0.0,), progress=False).per_example
    with cp.precision.mixed_precision(tiny_gemma, "bf16"):
        low = cp.head_sweep(tiny_gemma, facts, (0.0,), progress=False).per_example
    diff = (plain.p - low.p).abs()
    assert diff.max() > 0  # the block really changed the arithmetic
    assert diff.max() < 5e-3  # and the float32 readout keeps probabilities close
    assert low.p.dtype == plain.p.dtype


def test_readout_is_float32_and_leaves_autocast(tiny_gemma):
    resid = torch.randn(2, tiny_gemma.cfg.d_model)
    exact = unembed_final(tiny_gemma, resid)
    with cp.precision.mixed_precision(tiny_gemma, "bf16"):
        logits = unembed_final(tiny_gemma, resid)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, exact)  # the readout itself is not reduced


def test_steering_and_decoding_run_under_bf16(tiny_gemma, facts):
    steer = cp.JuICE(tiny_gemma, enhance=[(0, 1)], suppress=[(1, 2)], beta_plus=1.0, beta_minus=-1.0)
    with cp.precision.mixed_precision(tiny_gemma, "bf16"):
        scored = steer.accuracy(facts, max_new_tokens=2)
    assert len(scored) == 3 * len(facts) and scored.p_target.between(0, 1).all()


def test_autocast_is_off_after_the_block_even_after_an_error(tiny_gemma):
    with pytest.raises(RuntimeError, match="boom"):
        with cp.precision.mixed_precision(tiny_gemma, "bf16"):
            assert torch.is_autocast_enabled("cpu")
            raise RuntimeError("boom")
    assert not torch.is_autocast_enabled("cpu")


def test_bad_precisions_are_named(tiny_gemma):
    with pytest.raises(ValueError, match="Unknown precision 'int8'"):
        with cp.precision.mixed_precision(tiny_gemma, "int8"):
            pass
    with pytest.raises(ValueError, match="Unsupported precision"):
        with cp.precision.mixed_precision(tiny_gemma, torch.float64):
            pass


@pytest.mark.parametrize("native", [True, False])
def test_a_bf16_model_reads_out_its_top_logits_in_float32(monkeypatch, native):
    """A bf16 model unembeds in bf16 and recomputes each row's EXACT_TOP largest logits in float32,
    without a float32 copy of W_U; a CPU that would emulate bf16 reads out through that copy
    instead. Either way the logits are float32, the top ones (argmax, softmax) equal the float32
    readout's, and an in-place edit of W_U is seen."""
    from cpsuper import decoding

    monkeypatch.setattr(decoding, "native_on_cpu", lambda dtype: native)
    model = cp.load_model("tiny-gemma", dtype=torch.bfloat16)
    resid = torch.randn(5, model.cfg.d_model, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    normed = model.ln_final(resid.float()[:, None])[:, 0].float()
    expected = normed @ model.W_U.float()
    logits = unembed_final(model, resid)
    assert logits.dtype == torch.float32
    top = expected.topk(decoding.EXACT_TOP // 2, dim=-1).indices  # clear of near-ties at the 32nd place
    torch.testing.assert_close(logits.gather(1, top), expected.gather(1, top), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert (logits.gather(1, top) != logits.gather(1, top).to(torch.bfloat16).float()).any()  # not bf16-rounded
    rest = logits - expected
    assert rest.abs().max() <= 2**-7 * expected.abs().max()  # the others: bf16's accuracy
    assert bool(rest.abs().max() > 1e-5) is native  # only the bf16 product rounds them
    assert (model in decoding._FLOAT32_READOUT) is not native  # no float32 copy of W_U when native
    with torch.no_grad():
        model.W_U.mul_(2.0)
    doubled = unembed_final(model, resid)
    torch.testing.assert_close(doubled.gather(1, top), 2 * expected.gather(1, top), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("native", [False, True])
def test_emulated_reduced_precision_on_cpu_warns_once_per_request(tiny_gemma, monkeypatch, native):
    """An AVX2-only core emulates bf16 / fp16 products (about 100x slower than float32 here): loading
    or autocasting in them says so, pointing at the caller's line; a native CPU stays silent."""
    import warnings

    from cpsuper import precision

    monkeypatch.setattr(precision, "native_on_cpu", lambda dtype: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cp.load_model("tiny-gemma", dtype=torch.bfloat16)
        with cp.precision.mixed_precision(tiny_gemma, "fp16"):
            pass
        cp.load_model("tiny-gemma")  # float32: never warns
        with cp.precision.mixed_precision(tiny_gemma, "fp32"):
            pass
    slow = [w for w in caught if issubclass(w.category, RuntimeWarning) and "no native matrix" in str(w.message)]
    assert len(slow) == (0 if native else 2)
    if not native:
        assert {w.filename for w in slow} == {__file__}
        assert "torch.bfloat16" in str(slow[0].message) and "torch.float16" in str(slow[1].message)


def test_native_check_stays_silent_when_it_cannot_tell(monkeypatch):
    """float32 is always native; a torch build without the oneDNN check answers True (no warning),
    instead of raising from inside load_model."""
    from cpsuper import precision

    assert precision.native_on_cpu(torch.float32) is True
    assert isinstance(precision.native_on_cpu(torch.bfloat16), bool)
    monkeypatch.setitem(precision._ONEDNN_CHECKS, torch.bfloat16, "_no_such_onednn_check")
    assert precision.native_on_cpu(torch.bfloat16) is True
