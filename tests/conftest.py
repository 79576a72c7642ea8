"""Shared fixtures. Tests never reach a model hub: HF_HUB_OFFLINE is set before anything loads."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`-n 2`), share the cores between the workers instead of oversubscribing
# them: each worker, and the notebook kernels and CLI runs it starts, gets its slice of threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))

import pytest  # noqa: E402
import torch  # noqa: E402

import cpsuper as cp  # noqa: E402

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_gemma():
    """Random 3-layer model with Gemma-3's shape: GQA, RMSNorm before and after each sublayer."""
    return cp.tiny_model("gemma", seed=0)


@pytest.fixture(scope="session")
def tiny_gpt2():
    """Random 3-layer GPT-2-style model: LayerNorm, learned positions, biases."""
    return cp.tiny_model("gpt2", seed=0)


@pytest.fixture(scope="session", params=["gemma", "gpt2"])
def tiny(request, tiny_gemma, tiny_gpt2):
    return {"gemma": tiny_gemma, "gpt2": tiny_gpt2}[request.param]


@pytest.fixture(scope="session")
def gemma():
    """The real embedded Gemma-3-270M (converted on first use, then loaded from the cache)."""
    torch.manual_seed(0)
    return cp.load_model("gemma-3-270m", device="cpu")


def _two_pass(model, prompt, coefs):
    """Hand-written dual run: record z of the heads in a clean pass, add coef * z in a second;
    the last position's logits."""
    _, cache = model.run_with_cache(prompt)
    hooks = []
    for (layer, head), coef in coefs.items():
        recorded = cache[f"blocks.{layer}.attn.hook_z"][:, :, head]

        def hook(z, hook, head=head, coef=coef, recorded=recorded):
            z = z.clone()
            z[:, :, head] += coef * recorded
            return z

        hooks.append((f"blocks.{layer}.attn.hook_z", hook))
    with torch.no_grad():
        return model.run_with_hooks(prompt, fwd_hooks=hooks)[0, -1]


@pytest.fixture(scope="session")
def two_pass():
    """The independent reference for JuICE's dual run: ``two_pass(model, prompt, {(layer, head): coef})``."""
    return _two_pass


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a test module (toy training is faster so under pytest-xdist)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _autograd_is_left_on():
    """Grad mode is thread-wide: a test (or the code it runs) that leaves it off breaks every later
    test that trains a toy. Fail the test that did it, not the victims."""
    yield
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled(), "this test left autograd off"
