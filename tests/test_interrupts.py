"""Ctrl-C at any moment leaves the model exactly as it was: no hook attached, no hook context
open, weights bit-identical, the same logits as before.

Two kinds of interrupt: a real SIGINT from a timer thread at many delays into every long-running
entry point, and a SIGINT raised at every single Python call or return while hooks are added and
removed, or while weights are swapped and put back (the narrow windows a timer rarely hits).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

import cpsuper as cp
from cpsuper.interventions import Knockout, ScaleHead

PROMPTS = ["The name of the capital city of France is", "Madrid is located in"]


def _module_hooks(model) -> dict[str, tuple[int, int, int]]:
    """PyTorch hooks per module. A HookedTransformer has none of its own; a TransformerBridge keeps
    its own on the wrapped Hugging Face modules, which must be exactly the ones it had before."""
    return {
        name: (len(module._forward_hooks), len(module._forward_pre_hooks), len(module._backward_hooks))
        for name, module in model.named_modules()
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
    }


def _snapshot(model):
    tokens = model.to_tokens(PROMPTS[0])
    with torch.inference_mode():
        logits = model(tokens)
    return {k: v.clone() for k, v in model.state_dict().items()}, tokens, logits, _module_hooks(model)


def assert_untouched(model, snapshot) -> None:
    """No hook added to any module, no hook context open, weights and logits as before."""
    state, tokens, logits, own_hooks = snapshot
    hooks = _module_hooks(model)
    assert hooks == own_hooks, f"hooks left on {sorted(set(hooks.items()) - set(own_hooks.items()))}"
    lens = [name for name, hp in model.hook_dict.items() if hp.fwd_hooks or hp.bwd_hooks or hp.ctx]
    assert not lens, f"TransformerLens hook handles left on {lens}"
    assert model.context_level == 0, f"hook context level {model.context_level}"
    assert not getattr(model, "is_caching", False)  # HookedTransformer only; a bridge has no such flag
    now = model.state_dict()
    assert now.keys() == state.keys()
    changed = [k for k in state if not torch.equal(now[k], state[k])]
    assert not changed, f"weights changed: {changed}"
    with torch.inference_mode():
        assert torch.equal(model(tokens), logits)


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler for each test, whatever the launch left: a process started in the
    background of a non-interactive shell (``cmd &``, nohup) inherits SIGINT ignored, and Python then
    raises no KeyboardInterrupt at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def capitals(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)


def _entry_points(model, data):
    steer = cp.JuICE(model, enhance=[(1, 1)], suppress=[(2, 0)], beta_plus=2.0, beta_minus=-1.0)
    return {
        "knockout_sweep": lambda: cp.knockout_sweep(model, data, conflict_types=["substitution"], progress=False),
        "head_sweep": lambda: cp.head_sweep(model, data, (0.0,), conflict_types=["coherent"], progress=False),
        "identify_heads": lambda: cp.identify_heads(
            model, data, pos_grid=(1.0,), neg_grid=(-1.0,), k=2, conflict_types=["clean"], progress=False
        ),
        "JuICE.generate": lambda: steer.generate(PROMPTS, max_new_tokens=3, batch_size=1),
        "truncation_sweep": lambda: cp.truncation_sweep(
            model, data, layers=[1, 2], rhos=(0.5,), conflict_types=["clean"], progress=False
        ),
        "score_dataset": lambda: cp.score_dataset(model, data, batch_size=1, progress=False, max_new_tokens=2),
        "greedy_continuations": lambda: cp.scoring.greedy_continuations(
            model, PROMPTS, max_new_tokens=3, batch_size=1, progress=False
        ),
    }


def _interrupt_after(fn, delay: float) -> bool:
    """Run ``fn`` with a SIGINT sent after ``delay`` seconds; whether it landed inside ``fn``.
    A signal that comes after ``fn`` returned is taken here, never later in the test."""
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    finished = False
    try:
        timer.start()
        try:
            fn()
            finished = True
        finally:
            timer.join()
            time.sleep(0.001)  # let a signal that arrived during join be handled here
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the SIGINT was never delivered")
    return not finished


ENTRY_POINTS = [
    "knockout_sweep",
    "head_sweep",
    "identify_heads",
    "JuICE.generate",
    "truncation_sweep",
    "score_dataset",
    "greedy_continuations",
]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_ctrl_c_at_many_moments_leaves_the_model_as_it_was(tiny_gemma, capitals, entry):
    fn = _entry_points(tiny_gemma, capitals)[entry]
    snapshot = _snapshot(tiny_gemma)
    start = time.perf_counter()
    fn()  # warm, and time it
    duration = time.perf_counter() - start
    landed = 0
    for fraction in np.linspace(0.05, 0.95, 6):
        landed += _interrupt_after(fn, duration * fraction)
        assert_untouched(tiny_gemma, snapshot)
    assert landed >= 1, f"none of the 6 interrupts landed inside {entry}"


# ---------------------------------------------------------------------------------------------
# An interrupt at every call and return of the steps that change the model


def _count_events(fn) -> int:
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _interrupt_at_event(fn, k: int) -> bool:
    """Run ``fn``, raising SIGINT at its ``k``-th call/return event; whether it was interrupted."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += 1
        if count == k:
            sys.setprofile(None)
            signal.raise_signal(signal.SIGINT)

    sys.setprofile(profile)
    try:
        try:
            fn()
        finally:
            sys.setprofile(None)
            time.sleep(0.001)
    except KeyboardInterrupt:
        return True
    return False


def _every_event(model, fn, stride: int = 1, samples: int | None = None) -> int:
    """Interrupt ``fn`` at every ``stride``-th event (or at ``samples`` events spread evenly),
    checking the model after each; how many runs were interrupted."""
    snapshot = _snapshot(model)
    fn()  # warm: a first call makes more calls (imports, caches) than the ones that follow
    n = _count_events(fn)
    moments = range(1, n + 1, stride) if samples is None else np.linspace(1, 0.98 * n, samples).astype(int)
    interrupted = 0
    for k in moments:
        interrupted += _interrupt_at_event(fn, int(k))
        assert_untouched(model, snapshot)
    return interrupted


def test_ctrl_c_while_hooks_are_added_or_removed(tiny):
    specs = [ScaleHead(0, 1, 0.0), ScaleHead(2, 3, 2.0), Knockout(1, "mlp"), Knockout(2, "attn")]

    def enter_and_leave():
        with cp.intervene(tiny, specs):
            pass

    assert _every_event(tiny, enter_and_leave, stride=11) > 20


def test_ctrl_c_while_weights_are_swapped_or_restored(tiny):
    cache: dict = {}
    edits = [cp.truncation.Truncation(1, "mlp_in", 0.3), cp.truncation.Truncation(2, "W_O", 0.5, head=1)]
    with cp.truncation.truncate(tiny, edits, svd_cache=cache):  # factorize once, outside the interrupted part
        pass

    def enter_and_leave():
        with cp.truncation.truncate(tiny, edits, svd_cache=cache):
            pass

    assert _every_event(tiny, enter_and_leave, stride=5) > 20


def test_ctrl_c_inside_a_caching_run(tiny):
    """Activation caching (attention to spans' patterns, mean activations) restores hooks too."""

    def cache_patterns():
        cp.attention_patterns(tiny, PROMPTS[0], [(0, 1), (2, 3)])

    assert _every_event(tiny, cache_patterns, stride=37) > 5


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_ctrl_c_at_sampled_calls_of_an_entry_point(tiny_gemma, capitals, entry):
    """Deterministic moments spread over a whole run (a timer cannot aim at a given one). The
    model is checked after every one; a moment may fall where pandas drops the interrupt (seen:
    ``StringDtype.__repr__`` called from its compiled code while a result frame is built), so up to
    two of the 30 may finish normally."""
    fn = _entry_points(tiny_gemma, capitals)[entry]
    assert _every_event(tiny_gemma, fn, samples=30) >= 28


def test_a_suspended_or_abandoned_decoding_loop_leaves_autograd_on(tiny_gemma, capitals):
    """The runtime's generators run the model in inference mode but must not hand that mode to the
    caller between batches, nor leave it on when the caller stops early (it is thread-wide)."""
    from cpsuper.decoding import iter_final_logits, iter_greedy
    from cpsuper.runtime import tokenize_prompts

    tokens = tokenize_prompts(tiny_gemma, capitals.prompts("clean") + capitals.prompts("substitution"))
    for loop in (
        iter_final_logits(tiny_gemma, tokens, batch_size=1, progress=False),
        iter_greedy(tiny_gemma, tokens, max_new_tokens=2, batch_size=1, progress=False),
    ):
        next(loop)
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        del loop  # abandoned mid-way
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
