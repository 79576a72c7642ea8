"""checkpoint_trajectory: toy checkpoints offline, built-in conflict measures on tiny models."""

import numpy as np
import pytest

import cpsuper as cp
from cpsuper.plots import plot_trajectory
from cpsuper.toys.inversion import InversionToy, inversion_measures
from cpsuper.trajectories import checkpoint_trajectory


def test_toy_checkpoints_reproduce_the_recorded_probes():
    toy = InversionToy().train()
    steps, factories = zip(*toy.model_factories())
    traj = checkpoint_trajectory(
        list(factories), toy.data, {"inversion": inversion_measures}, labels=list(steps), progress=False
    )
    m_c = traj[traj.quantity == "M_C"].sort_values("order")
    probes = toy.probes[toy.probes.measure == "M_C"].set_index("step")
    recorded = probes.loc[list(steps), "value"].to_numpy()
    assert np.allclose(m_c.value.to_numpy(), recorded, atol=1e-6)
    assert list(m_c.checkpoint) == list(steps)
    # the inversion shows through the generic tool too: a peak above the final value
    assert m_c.value.max() > m_c.value.iloc[-1] + 0.02
    fig = plot_trajectory(traj, ["M_C", "attn_context"])
    assert {t.name for t in fig.data} == {"M_C", "attn_context"}


def test_conflict_measures_on_tiny_models():
    data = cp.conflict_dataset("world_capital", n=3, tokenizer=cp.tiny_model("gemma", seed=0))
    models = {seed: cp.tiny_model("gemma", seed=seed) for seed in (0, 1)}
    traj = checkpoint_trajectory([lambda s=s: models[s] for s in (0, 1)], data, labels=["a", "b"], progress=False)
    assert set(traj.quantity) == {
        "context_accuracy",
        "M_C",
        "parametric_accuracy",
        "attention_context",
        "attention_subject",
    }
    scores = cp.score_dataset(models[1], data, progress=False)
    wide = scores[scores.conflict_type != "clean"].pivot_table(
        index=["example", "conflict_type"], columns="measure", values="value"
    )
    expected = (wide.p_context / (wide.p_context + wide.p_parametric)).mean()
    got = traj.query("checkpoint == 'b' and quantity == 'M_C'").value.item()
    assert got == pytest.approx(expected, abs=1e-6)
    att = cp.attention_to_span(models[0], data, "subject", progress=False).per_example.attention.mean()
    assert traj.query("checkpoint == 'a' and quantity == 'attention_subject'").value.item() == pytest.approx(att)
    only = checkpoint_trajectory([models[0]], data, ["parametric_accuracy"], progress=False)
    assert list(only.quantity) == ["parametric_accuracy"] and only.checkpoint.item() == 0


def test_trajectory_errors():
    data = cp.conflict_dataset("world_capital", n=2)
    with pytest.raises(ValueError, match="No checkpoints"):
        checkpoint_trajectory([], data)
    with pytest.raises(ValueError, match="base="):
        checkpoint_trajectory([1000], data, progress=False)
    with pytest.raises(ValueError, match="labels"):
        checkpoint_trajectory([lambda: None], data, labels=["a", "b"])
    with pytest.raises(ValueError, match="Unknown measures"):
        checkpoint_trajectory([lambda: None], data, ["loss"])
    with pytest.raises(TypeError, match="Cannot make a model"):
        checkpoint_trajectory([3.5], data, progress=False)


def test_a_checkpoint_index_goes_to_load_model_of_its_base(monkeypatch):
    """On both backends an index is loaded by ``cp.load_model(base, checkpoint_index=...)``."""
    import cpsuper.models

    tiny = cp.tiny_model("gemma", seed=0)
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny)
    calls = []

    def fake_load_model(name, device=None, **kwargs):
        calls.append((name, kwargs))
        return tiny

    monkeypatch.setattr(cpsuper.models, "load_model", fake_load_model)
    traj = checkpoint_trajectory([0, 7], data, ["parametric_accuracy"], base="EleutherAI/pythia-14m", progress=False)
    assert calls == [
        ("EleutherAI/pythia-14m", {"checkpoint_index": 0}),
        ("EleutherAI/pythia-14m", {"checkpoint_index": 7}),
    ]
    assert list(traj.checkpoint) == [0, 7]


def test_an_uncached_checkpoint_offline_is_a_clear_error_not_a_hang(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    data = cp.conflict_dataset("world_capital", n=2)
    with pytest.raises(cp.hub.ModelUnavailableError, match="pythia-14m"):
        checkpoint_trajectory([3], data, base="EleutherAI/pythia-14m", progress=False)


def test_a_repo_cached_only_at_a_training_revision_counts_as_cached(tmp_path, monkeypatch):
    """A checkpoint is a revision of its own: its snapshot alone (no ``main``) is in the cache."""
    import huggingface_hub.constants

    from cpsuper.hub import in_local_cache

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert not in_local_cache("EleutherAI/pythia-14m")
    snapshot = tmp_path / "models--EleutherAI--pythia-14m" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert not in_local_cache("EleutherAI/pythia-14m")  # a snapshot without a configuration
    (snapshot / "config.json").write_text("{}")
    assert in_local_cache("EleutherAI/pythia-14m") and not in_local_cache("EleutherAI/pythia-70m")
