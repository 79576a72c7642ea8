from dataclasses import replace

import pandas as pd
import pytest
import torch

import cpsuper as cp
from cpsuper import identification
from cpsuper.backend import is_bridge
from cpsuper.interventions import ScaleHead, intervene
from cpsuper.runtime import tokenize_prompts

PROMPTS = [
    "According to the textbook, the capital city of France is Lima. According to the textbook, the capital city of France is",
    "The book Dracula was written by",
    "Madrid is located in",
]


def _clean(model, prompts=PROMPTS):
    return cp.scoring.final_logits(model, prompts, progress=False)


def test_all_betas_zero_is_the_clean_model(tiny):
    steer = cp.JuICE(tiny, enhance=[(0, 1), (2, 3)], suppress=[(1, 0)], beta_plus=0.0, beta_minus=0.0)
    torch.testing.assert_close(steer.logits(PROMPTS), _clean(tiny), atol=1e-5, rtol=0)
    assert steer.generate(PROMPTS, 4) == cp.scoring.greedy_continuations(
        tiny, PROMPTS, max_new_tokens=4, progress=False
    )
    data = cp.conflict_dataset("world_capital", n=3, tokenizer=tiny)
    scored = steer.accuracy(data, ["coherent"], max_new_tokens=3, full_continuations=True)
    plain = cp.score_dataset(tiny, data, conflict_types=["coherent"], max_new_tokens=3, progress=False)
    plain = plain[plain.measure == "p_parametric"]
    torch.testing.assert_close(
        torch.tensor(scored.p_target.values), torch.tensor(plain.value.values), atol=1e-5, rtol=0
    )
    assert scored.continuation.tolist() == plain.continuation.tolist()


def test_june_with_beta_minus_one_is_a_knockout(tiny):
    june = cp.JuICE(tiny, dual_run=False, suppress=[(1, 2)], beta_minus=-1.0)
    with intervene(tiny, ScaleHead(1, 2, 0.0)):
        knocked = _clean(tiny)
    torch.testing.assert_close(june.logits(PROMPTS), knocked, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "heads", [{(1, 2): 3.0}, {(0, 1): 2.0, (2, 0): -1.0, (1, 3): 4.0}, {(1, 0): 2.0, (2, 3): -1.0}]
)
def test_juice_equals_a_hand_written_two_pass_run(tiny, heads, two_pass):
    enhance = [h for h, c in heads.items() if c > 0]
    suppress = [h for h, c in heads.items() if c < 0]
    coefs = {h: (2.0 if h in enhance else -1.0) for h in heads}
    steer = cp.JuICE(tiny, enhance=enhance, suppress=suppress, beta_plus=2.0, beta_minus=-1.0)
    expected = torch.stack([two_pass(tiny, p, coefs) for p in PROMPTS])
    torch.testing.assert_close(steer.logits(PROMPTS), expected, atol=1e-5, rtol=0)
    if len(heads) > 1:
        june = cp.JuICE(tiny, dual_run=False, enhance=enhance, suppress=suppress, beta_plus=2.0, beta_minus=-1.0)
        assert not torch.allclose(june.logits(PROMPTS), expected, atol=1e-4)


def test_steered_generation_equals_a_naive_two_pass_loop(tiny_gemma, two_pass):
    coefs = {(0, 1): 3.0, (2, 2): -1.0}
    steer = cp.JuICE(tiny_gemma, enhance=[(0, 1)], suppress=[(2, 2)], beta_plus=3.0, beta_minus=-1.0)
    fast = steer.generate(PROMPTS, max_new_tokens=4, batch_size=2)
    for prompt, text in zip(PROMPTS, fast):
        tokens = tiny_gemma.to_tokens(prompt)
        for _ in range(4):
            next_token = two_pass(tiny_gemma, tokens, coefs).argmax().reshape(1, 1)
            tokens = torch.cat([tokens, next_token], dim=1)
        assert text == tiny_gemma.tokenizer.decode(tokens[0, -4:].tolist(), skip_special_tokens=True)


def test_cached_dual_run_starts_its_steered_pass_at_the_first_steered_layer(tiny_gemma, two_pass):
    coefs = {(1, 1): 2.0, (2, 0): -1.0}
    steer = cp.JuICE(tiny_gemma, enhance=[(1, 1)], suppress=[(2, 0)], beta_plus=2.0, beta_minus=-1.0)
    calls = {0: 0, 2: 0}
    handles = [
        tiny_gemma.blocks[l].register_forward_hook(lambda *args, l=l: calls.__setitem__(l, calls[l] + 1)) for l in calls
    ]
    try:
        fast = steer.generate(PROMPTS, max_new_tokens=3, batch_size=1)
    finally:
        for handle in handles:
            handle.remove()
    # With TransformerLens's key-value cache, block 0 runs in the unsteered pass only and the last
    # block in both; on the bridge both passes run as one twin batch through every block.
    assert calls[2] == (calls[0] if is_bridge(tiny_gemma) else 2 * calls[0]) > 0
    for prompt, text in zip(PROMPTS, fast):
        tokens = tiny_gemma.to_tokens(prompt)
        for _ in range(3):
            tokens = torch.cat([tokens, two_pass(tiny_gemma, tokens, coefs).argmax().reshape(1, 1)], dim=1)
        assert text == tiny_gemma.tokenizer.decode(tokens[0, -3:].tolist(), skip_special_tokens=True)


def test_repeated_prompts_share_the_unsteered_pass_of_their_prefill(tiny_gemma):
    """Strength tuning puts each prompt in a batch once per strength pair; pass 1 is unsteered, so
    at the prefill it runs once per distinct prompt and every copy gets its result and cache."""
    from cpsuper.dual_run import unsteered_pass
    from cpsuper.runtime import pad_tokens

    tokens, mask, _ = pad_tokens(tiny_gemma, tokenize_prompts(tiny_gemma, PROMPTS), "left")
    order = torch.tensor([1, 0, 1, 2, 1, 0])
    names = {"blocks.1.hook_resid_pre", "blocks.1.attn.hook_z"}
    cached = not is_bridge(tiny_gemma)

    def cache(rows):
        from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

        return TransformerLensKeyValueCache.init_cache(tiny_gemma.cfg, tiny_gemma.cfg.device, rows) if cached else None

    rows_seen = []
    handle = tiny_gemma.blocks[0].register_forward_hook(
        lambda mod, args, out: rows_seen.append((out[0] if isinstance(out, tuple) else out).shape[0])
    )
    try:
        with torch.inference_mode():
            shared_kv, alone_kv = cache(len(order)), cache(len(PROMPTS))
            shared = unsteered_pass(tiny_gemma, tokens[order], mask[order], 2, names, shared_kv)
            alone = unsteered_pass(tiny_gemma, tokens, mask, 2, names, alone_kv)
            filled = [] if not cached else [(e.past_keys, e.past_values) for e in shared_kv.entries[:2]]
            filled_mask = None if not cached else shared_kv.previous_attention_mask
            # Past the prefill the copies may have decoded different text, so every row runs.
            if cached:
                step = torch.ones(len(order), 1, dtype=torch.long)
                unsteered_pass(tiny_gemma, tokens[order][:, -1:], step, 2, names, shared_kv)
    finally:
        handle.remove()
    assert rows_seen == ([3, 3, 6] if cached else [3, 3])  # six rows, three prompts: one row per prompt
    for name in names:
        torch.testing.assert_close(shared[name], alone[name][order], atol=1e-6, rtol=0)
    if cached:
        torch.testing.assert_close(filled_mask, alone_kv.previous_attention_mask[order])
        for (keys, values), theirs in zip(filled, alone_kv.entries[:2]):
            torch.testing.assert_close(keys, theirs.past_keys[order], atol=1e-6, rtol=0)
            torch.testing.assert_close(values, theirs.past_values[order], atol=1e-6, rtol=0)


def test_save_load_round_trip(tiny_gemma, tmp_path):
    steer = cp.JuICE(
        tiny_gemma,
        direction="context",
        enhance=[(0, 1)],
        suppress=[(2, 3)],
        beta_plus=2.0,
        beta_minus=-3.0,
        fitted_on={"selection": ["France"]},
    )
    steer.save(tmp_path / "juice.json")
    again = cp.JuICE.load(tmp_path / "juice.json", tiny_gemma)
    assert again.to_dict() == steer.to_dict()
    torch.testing.assert_close(again.logits(PROMPTS), steer.logits(PROMPTS))
    assert "toward context" in repr(again) and "(0, 1)" in repr(again)
    with pytest.raises(ValueError, match="fitted on 'tiny-gemma'"):
        cp.JuICE.load(tmp_path / "juice.json", cp.tiny_model("gpt2"))


def test_identification_never_returns_a_head_twice(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)
    heads = cp.identify_heads(tiny_gemma, data, k=12, progress=False)
    assert not set(heads.enhance) & set(heads.suppress)
    assert len(heads.enhance) <= 12 and len(heads.suppress) <= 12
    scores = heads.scores.pivot_table(index=["sign", "layer", "head"], columns="conflict_type", values="score")
    for head in heads.enhance:
        assert (scores.loc[("+", *head)] >= 0).all()
    for head in heads.suppress:
        assert (scores.loc[("-", *head)] >= 0).all()
    totals = scores.sum(axis=1)
    enhance_totals = [totals[("+", *h)] for h in heads.enhance]
    assert enhance_totals == sorted(enhance_totals, reverse=True)


def test_identification_bad_inputs(tiny_gemma, monkeypatch):
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)
    with pytest.raises(ValueError, match="k=13 heads asked for, but the model has 12"):
        cp.identify_heads(tiny_gemma, data, k=13, progress=False)
    with pytest.raises(ValueError, match="neg_grid negative"):
        cp.identify_heads(tiny_gemma, data, neg_grid=(1.0,), progress=False)

    real = identification.sweep_dataset

    def all_harmful(*args, **kwargs):
        result = real(*args, **kwargs)
        result.per_example["delta"] = -1.0 - result.per_example["delta"].abs()
        return result

    monkeypatch.setattr(identification, "sweep_dataset", all_harmful)
    with pytest.raises(ValueError, match="No head raises the parametric answer's probability"):
        cp.identify_heads(tiny_gemma, data, progress=False)


def test_a_head_in_both_sets_is_rejected(tiny_gemma):
    with pytest.raises(ValueError, match=r"both the enhance and the suppress set"):
        cp.JuICE(tiny_gemma, enhance=[(0, 1)], suppress=[(0, 1)])
    with pytest.raises(ValueError, match="Unknown head 7"):
        cp.JuICE(tiny_gemma, enhance=[(0, 7)])


def _known(model, n: int) -> cp.ConflictDataset:
    """Facts the tiny model "knows": each answer is set to the first word of its greedy clean
    continuation (a random model knows no real fact)."""
    from dataclasses import replace

    data = cp.conflict_dataset("world_capital", n=n, tokenizer=model)
    texts = cp.scoring.greedy_continuations(model, data.prompts("clean"), max_new_tokens=8, progress=False)
    return cp.ConflictDataset([replace(e, aliases=(t.split()[0],)) for e, t in zip(data, texts)], "known")


def test_fit_picks_betas_from_the_grid(tiny_gemma):
    data = _known(tiny_gemma, 6)
    steer = cp.JuICE(tiny_gemma, k=2, beta_pos_grid=(0.0, 2.0), beta_neg_grid=(0.0, -1.0))
    steer.fit(data[:3], data[3:], progress=False, recipe="paper")
    assert isinstance(steer.tuning, pd.DataFrame) and len(steer.tuning) == 4
    best = steer.tuning.sort_values(["accuracy", "probability"], ascending=False).iloc[0]
    assert (steer.beta_plus, steer.beta_minus) == (best.beta_plus, best.beta_minus)
    assert steer.fitted_on["selection"] == [e.subject for e in data[:3]]


def test_reusing_identified_heads_and_choosing_k(tiny_gemma):
    data = _known(tiny_gemma, 6)
    heads = cp.identify_heads(tiny_gemma, data[:3], k=12, progress=False)
    two = heads.with_k(2)
    assert two.enhance == heads.enhance[:2] and two.suppress == heads.suppress[:2]
    with pytest.raises(ValueError, match="k=40 heads asked for"):
        heads.with_k(40)
    reused = cp.JuICE(tiny_gemma, k=2, beta_pos_grid=(0.0, 2.0), beta_neg_grid=(0.0, -1.0))
    reused.fit(data[:3], data[3:], progress=False, heads=heads, clean_margin=0.0)
    fresh = cp.JuICE(tiny_gemma, k=2, beta_pos_grid=(0.0, 2.0), beta_neg_grid=(0.0, -1.0))
    fresh.fit(data[:3], data[3:], progress=False, clean_margin=0.0)
    assert (reused.enhance, reused.suppress) == (fresh.enhance, fresh.suppress)
    pd.testing.assert_frame_equal(reused.tuning, fresh.tuning)
    with pytest.raises(ValueError, match="too few"):
        cp.split(data[:4], n_select=3)  # no room for a validation and a test part


def test_subset_and_merge_equal_identifying_on_those_facts(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=4, tokenizer=tiny_gemma)
    grids = dict(pos_grid=(1.0, 5.0), neg_grid=(-1.0,), k=3, progress=False)
    whole = cp.identify_heads(tiny_gemma, data, **grids)
    first, last = cp.identify_heads(tiny_gemma, data[:2], **grids), cp.identify_heads(tiny_gemma, data[2:], **grids)
    assert whole.subjects == [e.subject for e in data]

    def same(a, b):
        pd.testing.assert_frame_equal(
            a.scores.sort_values(["layer", "head", "sign", "conflict_type"]).reset_index(drop=True),
            b.scores.sort_values(["layer", "head", "sign", "conflict_type"]).reset_index(drop=True),
            atol=1e-6,
            rtol=0,
        )
        assert (a.enhance, a.suppress) == (b.enhance, b.suppress)

    same(whole.subset([e.subject for e in data[:2]]), first)
    same(first.merge(last), whole)
    # Heads chosen on some prompts only, from the stored changes, equal stage 1 run on those prompts.
    conflicts = ["substitution", "coherent"]
    on_conflicts = cp.identify_heads(tiny_gemma, data, conflict_types=conflicts, **grids)
    same(whole.subset(whole.subjects, conflicts), on_conflicts)
    same(whole.on_conflicts(), on_conflicts)
    with pytest.raises(ValueError, match="only clean prompts"):
        whole.subset(whole.subjects, ["clean"]).on_conflicts()
    with pytest.raises(ValueError, match=r"Conflict types \['misspelt'\] were not scored"):
        whole.subset(whole.subjects, ["misspelt"])
    assert whole.subset([data[0].subject]).with_k(1).k == 1
    with pytest.raises(ValueError, match="were not scored"):
        first.subset([data[3].subject])
    with pytest.raises(ValueError, match="Both identifications scored"):
        first.merge(whole)
    other_grid = cp.identify_heads(tiny_gemma, data[2:], pos_grid=(2.0,), neg_grid=(-1.0,), k=3, progress=False)
    with pytest.raises(ValueError, match="different scale grids"):
        first.merge(other_grid)


def test_knockout_ranking_from_stage_one_equals_running_the_knockouts(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)
    grids = dict(pos_grid=(1.0,), k=3, progress=False)
    heads = cp.identify_heads(tiny_gemma, data, neg_grid=(-2.0, -1.0), **grids)
    assert heads.target == "parametric" and heads.subset(heads.subjects[:2]).with_k(2).target == "parametric"
    n_heads = tiny_gemma.cfg.n_layers * tiny_gemma.cfg.n_heads
    for conflict_type in ("substitution", "coherent"):
        ran = cp.heads.top_knockout_heads(tiny_gemma, data, conflict_type=conflict_type, k=n_heads, progress=False)
        reused = cp.heads.top_knockout_heads(
            tiny_gemma, data, conflict_type=conflict_type, k=n_heads, progress=False, identified=heads
        )
        assert len(ran) > 1
        pd.testing.assert_frame_equal(reused, ran, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="changes of the 'parametric' answer, but 'context' is ranked"):
        cp.heads.top_knockout_heads(tiny_gemma, data, target="context", identified=heads)
    with pytest.raises(ValueError, match="was scored on"):
        cp.heads.top_knockout_heads(tiny_gemma, data[:2], identified=heads)
    with pytest.raises(ValueError, match=r"no knockout \(a = -1\) of 'coherent'"):
        cp.heads.top_knockout_heads(
            tiny_gemma, data, identified=cp.identify_heads(tiny_gemma, data, neg_grid=(-2.0,), **grids)
        )


# --- baselines and evaluation -----------------------------------------------------------------


@pytest.fixture(scope="module")
def capitals(tiny_gemma):
    return cp.conflict_dataset("world_capital", n=3, tokenizer=tiny_gemma)


def test_cad_with_alpha_zero_is_plain_decoding(tiny_gemma, capitals):
    cad, plain = cp.CAD(tiny_gemma, alpha=0.0), cp.Original(tiny_gemma)
    torch.testing.assert_close(cad.logits_for(capitals, "coherent"), plain.logits_for(capitals, "coherent"))
    assert cad.generate_for(capitals, "coherent", 3) == plain.generate_for(capitals, "coherent", 3)


def test_cad_contrasts_with_the_context_free_prompt(tiny_gemma, capitals):
    with_context = cp.scoring.final_logits(tiny_gemma, capitals.prompts("substitution"), progress=False)
    without = cp.scoring.final_logits(tiny_gemma, capitals.prompts("clean"), progress=False)
    cad = cp.CAD(tiny_gemma, alpha=1.0).logits_for(capitals, "substitution")
    torch.testing.assert_close(cad, 2 * with_context - without, atol=1e-4, rtol=0)
    # Generation feeds each chosen token to both prompts: the first token is the argmax above.
    first = cp.CAD(tiny_gemma, alpha=1.0).generate_for(capitals, "substitution", 1)
    assert first == [tiny_gemma.tokenizer.decode([t]) for t in cad.argmax(-1).tolist()]


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_cached_cad_decoding_equals_rerunning_both_prompts_every_step(tiny_gemma, capitals, alpha):
    """CAD decodes each prompt and its context-free twin as paired rows with key-value caches;
    it must pick the tokens a naive loop picks by rerunning both full prompts at every step."""
    cad = cp.CAD(tiny_gemma, alpha=alpha)
    requests = [(capitals, "substitution"), (capitals, "clean"), (capitals, "coherent")]  # clean: its own twin
    for (dataset, conflict_type), texts in zip(requests, cad.generate_many(requests, 5)):
        with_context = tokenize_prompts(tiny_gemma, dataset.prompts(conflict_type))
        without = tokenize_prompts(tiny_gemma, dataset.prompts("clean"))
        expected = []
        for a, b in zip(with_context, without):
            new = []
            for _ in range(5):
                pair = [tiny_gemma(torch.tensor([t + new]))[0, -1] for t in (a, b)]
                new.append(int(((1 + alpha) * pair[0] - alpha * pair[1]).argmax()))
            expected.append(tiny_gemma.tokenizer.decode(new, skip_special_tokens=True))
        assert texts == expected, conflict_type


def test_cad_pairs_that_finish_leave_the_batch_together(tiny_gemma, capitals):
    """A stopped CAD pair drops out of decoding (both rows): later steps run on fewer, still paired
    rows, and each continuation is the full decoding's beginning."""
    cad = cp.CAD(tiny_gemma, alpha=1.0)
    requests = [(capitals, "substitution"), (capitals, "coherent")]
    full = [t for texts in cad.generate_many(requests, 6) for t in texts]
    stops = [2 + 3 * (k % 3) for k in range(len(full))]  # each prompt stops at its own text length
    rows_seen = []  # (rows, positions) of every forward through the first block
    handle = tiny_gemma.blocks[0].register_forward_hook(
        lambda mod, args, out: rows_seen.append((out[0] if isinstance(out, tuple) else out).shape[:2])
    )
    try:
        cut = cad.generate_many(requests, 6, stop_when=lambda k, text: len(text) >= stops[k])
    finally:
        handle.remove()
    cut = [t for texts in cut for t in texts]
    assert all(f.startswith(c) for c, f in zip(cut, full)) and cut != full
    # cached decoding (TransformerLens's or Hugging Face's cache): the one-position steps (a
    # prefill may run the twins apart)
    steps = [rows for rows, positions in rows_seen if positions == 1]
    assert all(n % 2 == 0 for n in steps) and min(steps) < max(steps)


def test_cad_prefills_the_short_twins_at_their_own_width(tiny_gemma, capitals):
    """A CAD batch's context-free twins (clean prompts) are prefilled apart from their partners,
    at their own width (the continuations still equal a naive loop's: the cached CAD test above)."""
    cad = cp.CAD(tiny_gemma, alpha=1.0)
    seen = []
    handle = tiny_gemma.blocks[0].register_forward_hook(
        lambda mod, args, out: seen.append((out[0] if isinstance(out, tuple) else out).shape[:2])
    )
    try:
        texts = cad.generate_many([(capitals, "coherent")], 4)[0]
    finally:
        handle.remove()
    clean = max(len(t) for t in tokenize_prompts(tiny_gemma, capitals.prompts("clean")))
    coherent = max(len(t) for t in tokenize_prompts(tiny_gemma, capitals.prompts("coherent")))
    prefills = sorted(tuple(shape) for shape in seen if shape[1] > 1)
    assert prefills == [(len(capitals), clean), (len(capitals), coherent)] and len(texts) == len(capitals)


def test_cad_decodes_a_clean_prompt_without_a_twin(tiny_gemma, capitals):
    """A clean prompt is its own context-free twin, so CAD decodes it once, as plain greedy."""
    rows_seen = []
    handle = tiny_gemma.blocks[0].register_forward_hook(
        lambda mod, args, out: rows_seen.append((out[0] if isinstance(out, tuple) else out).shape[0])
    )
    try:
        texts = cp.CAD(tiny_gemma, alpha=1.0).generate_many([(capitals, "clean")], 4)[0]
    finally:
        handle.remove()
    assert texts == cp.scoring.greedy_continuations(
        tiny_gemma, capitals.prompts("clean"), max_new_tokens=4, progress=False
    )
    assert max(rows_seen) == len(capitals)


def _every_kind_of_method(model) -> dict:
    """One method of each kind cp.evaluate decodes differently (plain, prefixed, paired, steered)."""
    return {
        "Original": cp.Original(model),
        "Prompt": cp.PromptInstruction(model),
        "CAD": cp.CAD(model, alpha=1.0),
        "JuICE": cp.JuICE(model, enhance=[(1, 1)], suppress=[(0, 2)], beta_plus=2.0, beta_minus=-1.0),
        "JuNe": cp.JuICE(model, enhance=[(1, 1)], beta_plus=2.0, dual_run=False),
    }


def test_batched_evaluation_equals_one_request_at_a_time(tiny_gemma, capitals):
    """evaluate decodes every dataset x conflict type of a method in shared batches; the rows must
    equal evaluating each (dataset, conflict type) on its own, for every kind of method."""
    methods = _every_kind_of_method(tiny_gemma)
    other = cp.conflict_dataset("official_language", n=2, tokenizer=tiny_gemma)
    types = ["clean", "substitution", "coherent"]
    batched = cp.evaluate(methods, [capitals, other], types, max_new_tokens=3)
    alone = pd.concat(
        [
            cp.evaluate({n: m}, d, [c], max_new_tokens=3)
            for n, m in methods.items()
            for d in (capitals, other)
            for c in types
        ],
        ignore_index=True,
    )
    pd.testing.assert_frame_equal(batched, alone)
    # The batches mix requests of different lengths: the continuations are not all the same.
    assert batched.continuation.nunique() > 3


def test_prompt_baseline_prefixes_the_instruction(tiny_gemma, capitals):
    method = cp.PromptInstruction(tiny_gemma, direction="parametric")
    prompts = method._prompts(capitals, "coherent")
    assert prompts[0].startswith("The following passage contains misleading information.")
    assert prompts[0].endswith(capitals[0].prompts["coherent"])
    expected = cp.scoring.final_logits(tiny_gemma, prompts, progress=False)
    torch.testing.assert_close(method.logits_for(capitals, "coherent"), expected)


def test_evaluate_and_table(tiny_gemma, capitals):
    steer = cp.JuICE(tiny_gemma, enhance=[(1, 1)], beta_plus=2.0)
    results = cp.evaluate(
        {"Original": cp.Original(tiny_gemma), "JuICE": steer},
        capitals,
        ["clean", "coherent"],
        max_new_tokens=4,
        full_continuations=True,
    )
    assert len(results) == 2 * 3 * 2
    originals = results[results.method == "Original"]
    texts = cp.scoring.greedy_continuations(tiny_gemma, capitals.prompts("coherent"), max_new_tokens=4, progress=False)
    assert originals[originals.conflict_type == "coherent"].continuation.tolist() == texts
    table = cp.evaluation_table(results)
    assert ("average", "all") in table.columns and set(table.index) == {"Original", "JuICE"}
    assert table.loc["JuICE", ("average", "all")] == pytest.approx(
        results[results.method == "JuICE"].groupby("conflict_type").correct.mean().mean()
    )


def test_ph3_prunes_its_top_heads(tiny_gemma, capitals):
    ph3 = cp.PH3(tiny_gemma, ks=(1, 3)).fit(capitals[:2], capitals[2:], progress=False)
    assert ph3.k in (1, 3) and len(ph3.tuning) == 2 and len(ph3.heads) == 12
    specs = [ScaleHead(l, h, 0.0) for l, h in ph3.heads[: ph3.k]]
    with intervene(tiny_gemma, specs):
        expected = cp.scoring.final_logits(tiny_gemma, capitals.prompts("coherent"), progress=False)
    torch.testing.assert_close(ph3.logits_for(capitals, "coherent"), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="exceeds the model's 12 heads"):
        cp.PH3(tiny_gemma, ks=(20,)).fit(capitals[:2], capitals[2:], progress=False)


def test_fit_recipes_paper_and_robust(tiny_gemma):
    data = _known(tiny_gemma, 6)
    select, validation = data[[0, 1]], data[[2, 3, 4]]
    heads = cp.identify_heads(tiny_gemma, select, pos_grid=(1.0, 10.0), neg_grid=(-1.0,), k=2, progress=False)
    grids = dict(beta_pos_grid=(0.0, 2.0, 5.0), beta_neg_grid=(0.0, -2.0))
    paper = cp.JuICE(tiny_gemma, k=2, **grids).fit(select, validation, progress=False, heads=heads, recipe="paper")
    top = paper.tuning.sort_values(["accuracy", "probability"], ascending=False).iloc[0]
    assert (paper.beta_plus, paper.beta_minus) == (top.beta_plus, top.beta_minus)
    robust = cp.JuICE(tiny_gemma, k=2, **grids).fit(
        select, validation, progress=False, heads=heads, recipe="robust", clean_margin=1 / 3
    )
    t = robust.tuning
    chosen = t[(t.beta_plus == robust.beta_plus) & (t.beta_minus == robust.beta_minus)].iloc[0]
    unsteered = t[(t.beta_plus == 0) & (t.beta_minus == 0)].iloc[0]
    assert chosen.acc_clean >= unsteered.acc_clean - 1 / 3 - 1e-9  # at most one of the 3 clean facts lost
    assert robust.fitted_on["recipe"] == "robust" and paper.fitted_on["recipe"] == "paper"
    with pytest.raises(ValueError, match="recipe must be one of"):
        cp.JuICE(tiny_gemma, k=2).fit(select, validation, progress=False, heads=heads, recipe="best")
    # Validation facts the model does not know leave the robust rule nothing to protect.
    unknown = cp.conflict_dataset("world_capital", n=6, tokenizer=tiny_gemma)[[2, 3, 4]]
    assert not any(cp.scoring.known_facts(tiny_gemma, unknown, progress=False))
    with pytest.raises(ValueError, match="answers none of the 3 validation facts' clean prompts"):
        cp.JuICE(tiny_gemma, k=2).fit(select, unknown, progress=False, heads=heads, recipe="robust", clean_margin=0)
    cp.JuICE(tiny_gemma, k=2, **grids).fit(select, unknown, progress=False, heads=heads, recipe="paper")  # allowed


def test_fit_recipe_robust_conflict_picks_heads_on_conflict_prompts(tiny_gemma):
    """robust-conflict: stage 1 on the substitution and coherent prompts only (run, or re-formed
    from given scores, alike), then the robust strength rule."""
    data = _known(tiny_gemma, 6)
    select, validation = data[[0, 1]], data[[2, 3, 4]]
    grids = dict(pos_grid=(1.0, 10.0), neg_grid=(-1.0,), beta_pos_grid=(0.0, 2.0), beta_neg_grid=(0.0, -2.0))
    conflicts = ["substitution", "coherent"]
    expected = cp.identify_heads(
        tiny_gemma, select, pos_grid=(1.0, 10.0), neg_grid=(-1.0,), k=2, progress=False, conflict_types=conflicts
    )
    fitted = cp.JuICE(tiny_gemma, k=2, **grids).fit(
        select, validation, progress=False, recipe="robust-conflict", clean_margin=0.0
    )
    assert (fitted.enhance, fitted.suppress) == (expected.enhance, expected.suppress)
    every = cp.identify_heads(tiny_gemma, select, pos_grid=(1.0, 10.0), neg_grid=(-1.0,), k=2, progress=False)
    assert (every.enhance, every.suppress) != (expected.enhance, expected.suppress)  # the prompts matter here
    reused = cp.JuICE(tiny_gemma, k=2, **grids).fit(
        select, validation, progress=False, heads=every, recipe="robust-conflict", clean_margin=0.0
    )
    assert (reused.enhance, reused.suppress, reused.beta_plus, reused.beta_minus) == (
        fitted.enhance,
        fitted.suppress,
        fitted.beta_plus,
        fitted.beta_minus,
    )
    robust = cp.tuning.choose_betas(fitted.tuning, "robust", clean_margin=0.0)
    assert (fitted.beta_plus, fitted.beta_minus) == (robust.beta_plus, robust.beta_minus)
    assert fitted.fitted_on["recipe"] == "robust-conflict"
    with pytest.raises(ValueError, match="picks heads on conflict prompts; the selection has only clean ones"):
        cp.JuICE(tiny_gemma, k=2).fit(
            select.with_prompts(["clean"]), validation, recipe="robust-conflict", clean_margin=0.0
        )
    with pytest.raises(ValueError, match="recipe must be one of .*'robust-conflict'"):
        cp.JuICE(tiny_gemma, k=2).fit(select, validation, recipe="robust_conflict")


def test_clean_prompts_expect_the_memorised_answer_in_both_directions():
    example = cp.ConflictExample(
        "world_capital", "France", "Paris", "Lima", {"clean": "x", "substitution": "y"}, ("paris",), ("lima",)
    )
    for direction in ("parametric", "context"):
        assert example.expected_answers(direction, "clean") == ("Paris", "paris")
    assert example.expected_answers("parametric", "substitution") == ("Paris", "paris")
    assert example.expected_answers("context", "substitution") == ("Lima", "lima")
    with pytest.raises(ValueError, match="Unknown direction 'memory'"):
        example.expected_answers("memory", "clean")


def test_toward_the_context_clean_rows_score_plain_recall(tiny_gemma):
    """Steering toward the context is scored on clean prompts by whether the model still gives
    the memorised answer (there is no context to follow), in JuICE.accuracy and cp.evaluate."""
    data = cp.conflict_dataset("world_capital", n=4, tokenizer=tiny_gemma)
    texts = cp.scoring.greedy_continuations(tiny_gemma, data.prompts("clean"), max_new_tokens=4, progress=False)
    # Make the first two facts "known": their memorised answer is the model's first word.
    data = cp.ConflictDataset(
        [replace(e, aliases=(t.split()[0],)) if i < 2 else e for i, (e, t) in enumerate(zip(data, texts))], "capitals"
    )
    expected = [float(cp.reading.mentions_answer(t, e.answers, 5)) for t, e in zip(texts, data)]
    assert expected[:2] == [1.0, 1.0]
    steer = cp.JuICE(tiny_gemma, direction="context", enhance=[(0, 1)], beta_plus=0.0)
    rows = steer.accuracy(data, ["clean"], max_new_tokens=4)
    assert rows.correct.tolist() == expected
    memory = [cp.runtime.answer_token(tiny_gemma, e.answer, p) for e, p in zip(data, data.prompts("clean"))]
    probs = cp.scoring.final_logits(tiny_gemma, data.prompts("clean"), progress=False).softmax(-1)
    torch.testing.assert_close(
        torch.tensor(rows.p_target.values, dtype=torch.float32),
        probs[torch.arange(len(data)), memory],
        atol=1e-5,
        rtol=0,
    )
    evaluated = cp.evaluate({"Original": cp.Original(tiny_gemma, direction="context")}, data, ["clean"], 4)
    assert evaluated.correct.tolist() == expected
    # On conflict prompts the context answer is still the target.
    sub = steer.accuracy(data, ["substitution"], max_new_tokens=4)
    subs = cp.scoring.greedy_continuations(tiny_gemma, data.prompts("substitution"), max_new_tokens=4, progress=False)
    assert sub.correct.tolist() == [
        float(cp.reading.mentions_answer(t, e.context_answers, 5)) for t, e in zip(subs, data)
    ]


def test_identification_toward_the_context_skips_clean_prompts(tiny_gemma):
    data = cp.conflict_dataset("world_capital", n=2, tokenizer=tiny_gemma)
    heads = cp.identify_heads(tiny_gemma, data, "context", pos_grid=(1.0,), neg_grid=(-1.0,), k=2, progress=False)
    assert set(heads.scores.conflict_type) == {"substitution", "coherent"}
    both = cp.identify_heads(
        tiny_gemma,
        data,
        "context",
        pos_grid=(1.0,),
        neg_grid=(-1.0,),
        k=2,
        conflict_types=["clean", "substitution"],
        progress=False,
    )
    assert set(both.scores.conflict_type) == {"clean", "substitution"}  # asked for explicitly
    with pytest.raises(ValueError, match="only clean prompts"):
        cp.identify_heads(tiny_gemma, data.with_prompts(["clean"]), "context", progress=False)


@pytest.mark.parametrize("kind", ["dual run", "per-row strengths"])
def test_steered_rows_that_finish_early_equal_the_full_decoding_cut_short(tiny_gemma, capitals, kind):
    """Finished rows leave the batch together with their share of the steering's state (the dual
    run's own key-value cache; beta tuning's per-row strengths)."""
    from cpsuper.decoding import iter_greedy
    from cpsuper.dual_run import StrengthPerRow

    steer = cp.JuICE(tiny_gemma, enhance=[(1, 1), (2, 0)], suppress=[(0, 2)], beta_plus=3.0, beta_minus=-2.0)
    token_lists = tokenize_prompts(tiny_gemma, [p for c in ("clean", "coherent") for p in capitals.prompts(c)])
    steering = steer
    if kind == "per-row strengths":
        n = len(token_lists)
        steering = StrengthPerRow(
            steer, torch.linspace(0, 4, n), torch.linspace(0, -3, n), torch.tensor([1 + k % 2 for k in range(n)])
        )
    full = {}
    for idx, _, ids in iter_greedy(
        tiny_gemma, token_lists, max_new_tokens=5, batch_size=8, progress=False, steering=steering
    ):
        full.update(zip(idx, ids))
    stops = {k: 1 + k % 3 for k in full}
    cut = {}
    for idx, _, ids in iter_greedy(
        tiny_gemma,
        token_lists,
        max_new_tokens=5,
        batch_size=8,
        progress=False,
        steering=steering,
        finished=lambda k, ids: len(ids) >= stops[k],
    ):
        cut.update(zip(idx, ids))
    assert cut == {k: full[k][: stops[k]] for k in full}
    assert len({tuple(v) for v in full.values()}) > 1  # the rows really differ


@pytest.mark.parametrize("readout_rows", [1, 5, 128])
def test_batches_decoded_in_lockstep_equal_each_batch_decoded_alone(tiny_gemma, capitals, readout_rows):
    """greedy_batches unembeds the steps of several batches together (``readout_rows`` at most per
    product, new batches joining as rows finish); each batch's ids and first logits are those of
    the batch decoded alone, steered by a dual run whose state is per batch."""
    from cpsuper.decoding import greedy_batch, greedy_batches

    steer = cp.JuICE(tiny_gemma, enhance=[(1, 1), (2, 0)], suppress=[(0, 2)], beta_plus=3.0, beta_minus=-2.0)
    prompts = [p for c in ("clean", "substitution", "coherent") for p in capitals.prompts(c)]
    token_lists = tokenize_prompts(tiny_gemma, prompts)
    batches = [[0, 5], [1, 2, 3], [4], [6, 7, 8]]  # mixed lengths: left padding within a batch
    stops = {k: 1 + k % 3 for k in range(len(token_lists))}
    finished = lambda k, ids: len(ids) >= stops[k]  # noqa: E731
    together = {}
    for batch, first, ids in greedy_batches(
        tiny_gemma, token_lists, batches, max_new_tokens=4, steering=steer, finished=finished, readout_rows=readout_rows
    ):
        together[tuple(batch)] = (first, ids)
    assert sorted(together) == sorted(map(tuple, batches))
    for batch in batches:
        first, ids = greedy_batch(
            tiny_gemma,
            [token_lists[k] for k in batch],
            4,
            steering=steer,
            finished=lambda i, ids, batch=batch: finished(batch[i], ids),
        )
        torch.testing.assert_close(together[tuple(batch)][0], first, atol=1e-5, rtol=1e-5)
        assert together[tuple(batch)][1] == ids
        assert [len(row) for row in ids] == [stops[k] for k in batch]


def test_evaluation_that_stops_once_settled_scores_like_full_continuations(tiny_gemma, capitals):
    """cp.evaluate stops each continuation once its verdict is settled: every method scores the
    same as with full continuations, and its texts are those continuations' beginnings."""
    methods = _every_kind_of_method(tiny_gemma)
    types = ["clean", "substitution", "coherent"]
    # n_words=1: a verdict settles as soon as a second word starts, so most rows stop early
    early = cp.evaluate(methods, capitals, types, max_new_tokens=6, n_words=1)
    full = cp.evaluate(methods, capitals, types, max_new_tokens=6, n_words=1, full_continuations=True)
    pd.testing.assert_series_equal(early.correct, full.correct)
    assert all(f.startswith(e) for e, f in zip(early.continuation, full.continuation))
    assert (early.continuation.str.len() < full.continuation.str.len()).any()  # rows did stop early
    steer = methods["JuICE"]
    pd.testing.assert_series_equal(
        steer.accuracy(capitals, types, max_new_tokens=6, n_words=1).correct,
        steer.accuracy(capitals, types, max_new_tokens=6, n_words=1, full_continuations=True).correct,
    )
