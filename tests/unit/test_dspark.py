"""DSpark / DFlash drafting through the engine: lossless for greedy and probabilistic drafting."""

import json

import pytest
import torch
from safetensors.torch import save_file
from test_spec_engine import assert_same_distribution, sample_prefixes, sampled_walk

from specserve import LLM, SamplingParams
from specserve.engine.block_manager import BlockManager
from specserve.spec_decode.dspark.config import DSparkConfig, expected_state_shapes
from specserve.spec_decode.dspark import model as dspark_model
from specserve.spec_decode.dspark import proposer as proposer_mod

PROMPTS = [[5, 17, 42, 99, 3], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]

# the tests below are about chains: the methods' defaults are trees with pooled n-gram branches
CHAIN = {"dspark_tree": None, "ngram_branch": 0}


def write_random_drafter(path, target_dir, markov_rank=8, head_type="vanilla", seed=0, scale=0.3, block=4,
                         dtype=torch.float32):
    """A random DeepSpec-format drafter for a tiny target (reads the target's config), stored in ``dtype``."""
    t = json.loads((target_dir / "config.json").read_text())
    hd = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    cfg = DSparkConfig(hidden_size=t["hidden_size"], num_attention_heads=t["num_attention_heads"],
                       num_key_value_heads=t["num_key_value_heads"], head_dim=hd, intermediate_size=96, num_layers=1,
                       rms_norm_eps=1e-6, rope_theta=10000.0, target_layer_ids=[0], block_size=block,
                       mask_token_id=t["vocab_size"] - 1, sample_from_anchor=True, markov_rank=markov_rank,
                       markov_head_type=head_type, enable_confidence_head=markov_rank > 0,
                       confidence_head_with_markov=markov_rank > 0, vocab_size=t["vocab_size"],
                       draft_vocab_size=t["vocab_size"])
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in expected_state_shapes(cfg).items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        sd[name] = (base + scale * torch.randn(shape, generator=g)).to(dtype).contiguous()
    conf = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": hd, "intermediate_size": 96, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "vocab_size": t["vocab_size"], "hidden_act": "silu", "attention_bias": False,
            "num_target_layers": t["num_hidden_layers"], "block_size": block, "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [0], "layer_types": ["full_attention"], "tie_word_embeddings": False,
            "markov_rank": markov_rank, "markov_head_type": head_type,
            "enable_confidence_head": markov_rank > 0, "confidence_head_with_markov": markov_rank > 0}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(conf))
    save_file(sd, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("method, rank, sample, verify", [
    ("dspark", 8, "greedy", "full"), ("dspark", 8, "probabilistic", "full"), ("dspark", 8, "greedy", "threshold"),
    ("dflash", 0, "greedy", "full"), ("dspark", 8, "greedy", "full-gated"), ("dspark", 8, "greedy", "auto"),
    ("dspark", 8, "probabilistic", "auto"), ("dspark", 8, "greedy", "tree-6"), ("dspark", 8, "greedy", "tree-6-rnn"),
    ("dflash", 0, "greedy", "tree-5"), ("dspark", 8, "greedy", "tree-auto"),
])
def test_greedy_identical_to_plain(tiny_llama, small_vocab_model, tmp_path, method, rank, sample, verify):
    head = next((h for h in ("gated", "rnn") if verify.endswith(h)), "vanilla")
    prompts = PROMPTS
    if verify.startswith("tree"):  # 16 tokens: a random drafter's trees hold the target's token often
        tiny_llama, prompts = small_vocab_model, [[t % 16 for t in p] for p in PROMPTS]
    drafter = write_random_drafter(tmp_path / "d", tiny_llama, markov_rank=rank, head_type=head)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(prompts, params, use_tqdm=False)
    spec = {"method": method, "model": str(drafter), "draft_sample_method": sample, "confidence_threshold": 0.5}
    if verify.startswith("tree"):
        size = verify.split("-")[1]
        spec["dspark_tree"] = size if size == "auto" else int(size)
    else:
        spec["dspark_verify"] = verify.split("-")[0]
    llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec)
    if spec.get("dspark_tree") == "auto":  # verifying costs a little per token: trees of several sizes
        llm.engine.proposer.verify_costs = {1: 1.0, 1000: 1.0 + 999 * 0.02}
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0
    if verify.startswith("tree"):  # trees verified, and paths accepted, through the tree verifier
        assert m["num_accepted_tokens"] > 0


@pytest.mark.parametrize("sample, verify", [("greedy", "full"), ("probabilistic", "full"), ("probabilistic", "auto"),
                                           ("greedy", "tree"), ("probabilistic", "auto-calibrated"),
                                           ("greedy", "tree-calibrated"), ("probabilistic", "full-bf16draft"),
                                           ("probabilistic", "full-int4draft")])
def test_distribution_matches_plain_sampling(small_vocab_model, tmp_path, sample, verify):
    """Many sequences draft together (batched blocks, one generator per row) at temperature 1; trees:
    each row's own tree, sized by the cost model from the draft probabilities at temperature 1;
    ``-calibrated``: with the online calibration, whose choices follow earlier steps' outcomes;
    ``-bf16draft``: the drafter in bfloat16 beside the float32 target (its q, float32 probabilities of
    bfloat16 logits, is what the rejection sampler reads); ``-int4draft``: its weights in 4 bits."""
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, scale=0.6)
    cpu = {"device": "cpu"} if verify.endswith("-int4draft") else {}  # quantized drafters run on the CPU only
    plain = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32", max_num_seqs=64, **cpu)
    mode = {"dspark_tree": "auto"} if verify.startswith("tree") else {"dspark_verify": verify.split("-")[0]}
    calibrated = verify.endswith("-calibrated")
    if verify.endswith("-bf16draft"):
        mode["draft_dtype"] = "bfloat16"
    if verify.endswith("-int4draft"):
        mode["draft_quantization"] = "int4"
    spec = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32", max_num_seqs=64, **cpu,
               speculative_config={"method": "dspark", **CHAIN, "model": str(drafter), "draft_sample_method": sample,
                                   "online_calibration": calibrated, **mode})
    if verify.endswith("-bf16draft"):
        assert spec.engine.runner.helper("dspark").drafter.fc.weight.dtype == torch.bfloat16
    if verify.endswith("-int4draft"):
        assert spec.engine.runner.helper("dspark").drafter.fc.qkernel.kind == "int4-g32"
    if verify != "full":  # a cost per verified token: lengths follow the confidences and differ by row
        spec.engine.proposer.verify_costs = {1: 1.0, 1000: 1.0 + 999 * (0.0002 if calibrated else 0.001)}
    a = sample_prefixes(plain, 2000, 0, k=5)
    b = sample_prefixes(spec, 2000, 100_000, k=5)
    m = spec.get_metrics()
    assert m["num_accepted_tokens"] > 100
    if verify.startswith("auto"):
        assert 0 < m["num_draft_tokens"] < 4 * m["num_verify_steps"]
    if calibrated:  # a random confidence head is far off: the calibration moved its predictions
        f = spec.engine.proposer.calibration.factors((1.0, 0, 1.0, 0.0))[0]
        assert not 0.67 < f < 1.5, f
    assert_same_distribution(a, b)


def test_engine_drafts_from_the_features_of_the_kept_prefix(small_vocab_model, tmp_path):
    """Each drafting step sees exactly the target features of the tokens kept so far (after partial
    acceptances and rejections): its drafts and confidences equal an offline proposal over one full
    forward of the final sequence, and the steps walk the output (next anchor = accepted drafts + 1)."""
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, scale=0.6)
    llm = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32",
              speculative_config={"method": "dspark", **CHAIN, "model": str(drafter)})
    prop = llm.engine.proposer
    w = prop.worker
    blocks, steps = [], []
    engine_propose = w.propose

    def record(seq_ids, anchors, starts, num_drafts, *args, **kwargs):
        out = engine_propose(seq_ids, anchors, starts, num_drafts, *args, **kwargs)
        blocks.append((anchors[0], out[0].tokens.clone(), out[0].confidences.clone()))
        steps.append((starts[0], out[0].tokens[0].tolist()))
        return out

    w.propose = record
    full = sampled_walk(llm, [5, 1, 12, 9, 3], steps)
    feats = torch.cat(llm.engine.runner.forward(0, [full], [0], "none", aux_layers=prop.aux_layers).aux, dim=-1)[0]
    for (anchor, tokens, conf), (start, _) in zip(blocks, steps):
        assert full[start] == anchor
        cache = w.drafter.new_cache()
        cache.extend(feats[:start], list(range(start)))
        ref = w.drafter.propose_batch([anchor], [start], [cache], w.embed, w.logits_fn, None, [None], tokens.shape[1])
        assert torch.equal(ref.tokens, tokens)
        torch.testing.assert_close(ref.confidences, conf, atol=1e-4, rtol=1e-4)


def test_worker_projects_waiting_features_when_the_sequence_drafts(small_vocab_model, tmp_path):
    """Features observed over steps without drafts wait and are projected in one call when the sequence
    drafts next: its cache then holds what step-by-step extension gives, whether each step's features came
    joined or as the engine passes them (per layer, joined when projected); a reset drops the wait, and a
    forgotten sequence leaves nothing behind."""
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, scale=0.6)
    llm = LLM(model=str(small_vocab_model), dtype="float32",
              speculative_config={"method": "dspark", **CHAIN, "model": str(drafter)})
    prop = llm.engine.proposer
    w = prop.worker
    ids = [5, 1, 12, 9, 3, 7, 7, 2, 11, 4, 6]
    layers = [a[0] for a in llm.engine.runner.forward(0, [ids], [0], "none", aux_layers=prop.aux_layers).aux]
    feats = torch.cat(layers, dim=-1)
    w.observe(-1, torch.zeros(3, feats.shape[1]), reset=True)  # another prompt's, then reset
    for a, b, reset in [(0, 5, True), (5, 6, False), (6, 9, False), (9, 11, False)]:
        w.observe(-1, feats[a:b], reset)
    assert len(w.caches[-1]) == 0 and len(w.pending[-1]) == 4  # nothing projected yet
    (cache,) = w.ready_caches([-1])
    ref = w.drafter.new_cache()
    for a, b in [(0, 5), (5, 6), (6, 9), (9, 11)]:
        ref.extend(feats[a:b], list(range(a, b)))
    assert len(cache) == 11 and torch.equal(cache.positions, ref.positions) and -1 not in w.pending
    torch.testing.assert_close(cache.k[:, :, :11], ref.k[:, :, :11], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :11], ref.v[:, :, :11], rtol=1e-5, atol=1e-5)
    for a, b, reset in [(0, 5, True), (5, 6, False), (6, 9, False), (9, 11, False)]:
        w.observe(-3, [x[a:b] for x in layers], reset)
    assert len(w.pending[-3]) == 4
    (joined,) = w.ready_caches([-3])
    assert torch.equal(joined.k[:, :, :11], cache.k[:, :, :11]) and torch.equal(joined.v[:, :, :11], cache.v[:, :, :11])
    w.observe(-3, feats[:5], reset=True)  # a joined part and per-layer ones
    w.observe(-3, [x[5:11] for x in layers], reset=False)
    (mixed,) = w.ready_caches([-3])
    assert torch.equal(mixed.k[:, :, :11], cache.k[:, :, :11])
    w.forget(-3)
    w.observe(-1, feats[:2], reset=False)
    w.forget(-1)
    assert -1 not in w.caches and -1 not in w.pending
    # a sequence that goes long without drafts has its features projected at MAX_WAITING_POSITIONS
    many = feats[:1].expand(proposer_mod.MAX_WAITING_POSITIONS, -1)
    w.observe(-2, many[:-1], reset=True)
    assert len(w.caches[-2]) == 0
    w.observe(-2, many[-1:], reset=False)
    assert len(w.caches[-2]) == proposer_mod.MAX_WAITING_POSITIONS and -2 not in w.pending
    w.forget(-2)


def test_auto_tree_search_expands_only_nodes_worth_verifying(small_vocab_model, tmp_path, monkeypatch):
    """``dspark_tree: "auto"``: each step's search expands only nodes that score at least the cost model's
    ``expand_threshold`` (steep verification here: many nodes left out), and the answers stay plain
    decoding's."""
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, scale=0.6)
    prompts = [[t % 16 for t in p] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=str(small_vocab_model), dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(small_vocab_model), dtype="float32", speculative_config={
        "method": "dspark", "model": str(drafter), "dspark_tree": "auto", "ngram_branch": 0, "draft_gate": False})
    prop = llm.engine.proposer
    prop.verify_costs = {1: 1.0, 1000: 1.0 + 999 * 0.2}
    thresholds, searched = [], []
    threshold, search = prop.expand_threshold, dspark_model.draft_trees
    monkeypatch.setattr(prop, "expand_threshold", lambda seqs: thresholds.append(threshold(seqs)) or thresholds[-1])

    def recorded(*args, **kwargs):
        tree = search(*args, **kwargs)
        searched.append((kwargs["min_score"], int((tree.scores < 0).sum())))
        return tree

    monkeypatch.setattr(dspark_model, "draft_trees", recorded)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert len(searched) > 3 and [ms for ms, _ in searched] == thresholds and min(thresholds) > 0.01
    assert sum(empty > 0 for _, empty in searched) > len(searched) // 2


def test_tree_drafting_reads_the_features_of_the_accepted_path(small_vocab_model, tmp_path):
    """After a tree step the drafter's cache holds the target features of the accepted PATH (node
    indices that need not be contiguous): every step's candidate tree equals one drafted offline from a
    full forward of the final sequence, and accepted paths left the first branch at times."""
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, scale=0.6)
    llm = LLM(model=str(small_vocab_model), dtype="float32",
              speculative_config={"method": "dspark", **CHAIN, "model": str(drafter), "dspark_tree": 6})
    prop = llm.engine.proposer
    w = prop.worker
    calls = []
    engine_propose = w.propose_tree

    def record(seq_ids, anchors, starts, *args):
        out = engine_propose(seq_ids, anchors, starts, *args)
        calls.append((anchors[0], starts[0], args, out))
        return out

    w.propose_tree = record
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, ignore_eos=True)
    prompt = [5, 1, 12, 9, 3]
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    full = prompt + list(out.outputs[0].token_ids)
    feats = torch.cat(llm.engine.runner.forward(0, [full], [0], "none", aux_layers=prop.aux_layers).aux, dim=-1)[0]
    off_branch = 0
    for i, (anchor, start, args, tree) in enumerate(calls):
        assert full[start] == anchor
        cache = w.drafter.new_cache()
        cache.extend(feats[:start], list(range(start)))
        num_drafts, temps, topk, beam, ctemps, min_score = args
        ref = w.drafter.propose_tree_batch([anchor], [start], [cache], w.embed, w.logits_fn, temps, num_drafts, topk,
                                           beam, ctemps, min_score)
        assert torch.equal(ref.tokens, tree.tokens) and torch.equal(ref.parents, tree.parents)
        torch.testing.assert_close(ref.scores, tree.scores, atol=1e-4, rtol=1e-4)
        if i + 1 < len(calls):
            n = calls[i + 1][1] - start - 1  # drafts accepted at this step
            if n >= 1 and full[start + 1] != int(tree.tokens[0, 0]):
                off_branch += 1  # the accepted path starts at a lower-ranked child
    assert len(calls) > 5 and off_branch > 0


def test_dspark_errors(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="does not match|hidden|vocab|needs a drafter checkpoint"):
        LLM(model=str(tiny_llama), speculative_config={"method": "dspark"})  # the default model's drafter
    drafter = write_random_drafter(tmp_path / "d", tiny_llama)
    with pytest.raises(ValueError, match="exceeds the drafter's 4 drafts"):
        LLM(model=str(tiny_llama), speculative_config={"method": "dspark", **CHAIN, "model": str(drafter),
                                                       "num_speculative_tokens": 6})
    for bad, match in [({"dspark_tree": 0}, "dspark_tree must be"), ({"dspark_tree": "big"}, "dspark_tree must be"),
                       ({"dspark_tree": 4, "draft_sample_method": "probabilistic"}, "draft_sample_method='greedy'"),
                       ({"dspark_tree": 4, "dspark_verify": "auto"}, "leave dspark_verify"),
                       ({"dspark_tree": 4, "dspark_tree_topk": 0}, "dspark_tree_topk must be"),
                       ({"draft_dtype": "int8"}, "draft_dtype must be one of 'auto', 'float32'"),
                       ({"draft_quantization": "q4"}, "draft_quantization must be one of 'auto', 'none'")]:
        with pytest.raises(ValueError, match=match):
            LLM(model=str(tiny_llama), speculative_config={"method": "dspark", **CHAIN, "model": str(drafter), **bad})


@pytest.mark.parametrize("stored, requested, fast_bf16, expected", [
    (torch.float32, "auto", True, torch.float32), (torch.bfloat16, "auto", True, torch.bfloat16),
    (torch.bfloat16, "auto", False, torch.float32), (torch.bfloat16, "float32", True, torch.float32),
    (torch.float32, "bfloat16", True, torch.bfloat16),
])
def test_draft_dtype_follows_the_stored_weights_unless_requested(tiny_llama, tmp_path, monkeypatch, stored,
                                                                 requested, fast_bf16, expected):
    """``draft_dtype="auto"`` runs a drafter stored in bfloat16 in bfloat16 beside a float32 target where
    bfloat16 GEMMs are fast (``fast_bf16``: ``fast_bfloat16``, faked here), anything else in the target's
    dtype; an explicit dtype wins. Every weight is in that dtype, the drafter reads the target's lm_head
    (this one has no pruned vocabulary), and greedy output is plain decoding's."""
    import specserve.layers.linear as linear

    monkeypatch.setattr(linear, "fast_bfloat16", lambda device="cpu": fast_bf16)
    drafter = write_random_drafter(tmp_path / "d", tiny_llama, dtype=stored)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={"method": "dspark", **CHAIN, "model": str(drafter), "draft_dtype": requested})
    worker = llm.engine.runner.helper("dspark")
    assert worker.dtype == expected and worker.drafter.lm_head is None
    assert {p.dtype for p in worker.drafter.parameters()} == {expected}
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("target, requested, expected", [
    (None, "auto", None), ("int8", "auto", "int8"), (None, "int4", "int4"), ("int4", "none", None),
    ("int4", "int8", "int8"),
])
def test_draft_quantization_follows_the_target_unless_requested(tiny_llama, tmp_path, target, requested, expected):
    """``draft_quantization="auto"`` quantizes the drafter's linears to 8 bits in groups of 32 beside a
    quantized target and leaves them dense beside a dense one; an explicit choice wins. Quantized, every
    linear runs a weight-only kernel with its float weight freed (the Markov head's rank-8 input stays
    dense: not a multiple of 32), and greedy output is plain decoding's on the same target."""
    drafter = write_random_drafter(tmp_path / "d", tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = {"dtype": "float32"} if target is None else {"quantization": target}
    kw["device"] = "cpu"  # quantized weights (target or drafter) run on the CPU only
    plain = LLM(model=str(tiny_llama), **kw).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), **kw,
              speculative_config={"method": "dspark", **CHAIN, "model": str(drafter), "draft_quantization": requested})
    worker = llm.engine.runner.helper("dspark")
    assert worker.quantization == expected
    fc, w2 = worker.drafter.fc, worker.drafter.markov_head.markov_w2
    if expected:
        assert fc.qkernel.kind == f"{expected}-g32" and fc.weight.numel() == 0
        assert w2.qkernel is None and w2.weight.numel() > 0
    else:
        assert fc.qkernel is None
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_choose_verify_lengths_is_the_best_choice():
    """The choice equals a brute-force search over every length vector, a batch costing its longest row
    times its rows (the forward pads the batch to it), and no row stops short of that row's count."""
    import itertools

    from specserve.spec_decode.cost_model import choose_verify_lengths, interp_cost

    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        B, K = 1 + trial % 3, 4
        conf = torch.rand(B, K, generator=g) ** 0.5
        surv = torch.cumprod(conf, 1).tolist()
        costs = {1: 1.0, 4: 1.0 + float(torch.rand(1, generator=g)), 16: 3.0 + 4 * float(torch.rand(1, generator=g))}
        cost = lambda n: interp_cost(costs, n)  # noqa: E731
        got = choose_verify_lengths(surv, cost)

        def rate(ls):
            return (B + sum(sum(row[:n]) for row, n in zip(surv, ls))) / cost(B * (1 + max(ls)))

        best = max(rate(ls) for ls in itertools.product(range(K + 1), repeat=B))
        assert rate(got) == pytest.approx(best, rel=1e-9), (trial, got)
        assert len(set(got)) == 1  # rows of equal length here: what pads the batch comes free
    # cheap verification: verify everything; verification that doubles per token: nothing
    assert choose_verify_lengths([[0.9, 0.8], [0.5, 0.1]], lambda n: 1.0) == [2, 2]
    assert choose_verify_lengths([[0.9, 0.8], [0.5, 0.1]], lambda n: 2.0 ** n) == [0, 0]
    # a long row worth verifying takes the short rows' drafts along (free: the batch is padded), and a
    # lone unlikely draft of one row is not worth padding every row for
    steep = {1: 1.0, 2: 1.1, 4: 1.3, 6: 3.0, 8: 6.0}
    assert choose_verify_lengths([[0.95, 0.9, 0.85], [0.05]], lambda n: interp_cost(steep, n)) == [1, 1]
    assert choose_verify_lengths([[0.05], [0.02]], lambda n: interp_cost(steep, n)) == [0, 0]
    assert choose_verify_lengths([[0.9, 0.8, 0.7], [0.3]], lambda n: 1.0) == [3, 1]
    with pytest.raises(ValueError, match="must not increase"):
        choose_verify_lengths([[0.1, 0.9]], lambda n: 1.0)


def test_verify_cost_table_follows_the_costs():
    """``ModelDrafter.verify_cost`` answers from a table of the first counts: the interpolation at every
    count, past the table too, and a new cost dict replaces it."""
    from specserve.spec_decode.cost_model import interp_cost
    from specserve.spec_decode.model_drafter import COST_TABLE_SIZE, ModelDrafter

    d = ModelDrafter()
    for costs in ({1: 1.0, 4: 1.7, 16: 5.2}, {1: 2.0, 300: 9.0}):
        d.verify_costs = costs
        assert [d.verify_cost(n) for n in range(COST_TABLE_SIZE + 40)] == [
            interp_cost(costs, n) for n in range(COST_TABLE_SIZE + 40)]


@pytest.mark.parametrize("tree", [None, "auto"])
def test_drafting_is_timed_at_the_depth_a_step_drafts(tiny_llama, tmp_path, monkeypatch, tree):
    """The start-up drafting cost is measured drafting ``num_speculative_tokens`` deep (a tree of 2
    depths costs less than one of the block's 3), not the whole block, once per process: a second
    engine of the same target, drafter and threads reads the first one's table; another drafter depth
    measures again."""
    drafter = write_random_drafter(tmp_path / "d", tiny_llama)  # blocks of 4: 3 drafts
    seen = []
    for fn in ("propose", "propose_tree"):
        def spy(self, seq_ids, anchors, starts, num_drafts, *args, _orig=getattr(proposer_mod.DSparkDraftWorker, fn),
                **kw):
            seen.append(num_drafts)
            return _orig(self, seq_ids, anchors, starts, num_drafts, *args, **kw)
        monkeypatch.setattr(proposer_mod.DSparkDraftWorker, fn, spy)

    def engine(k):
        return LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=2, speculative_config={
            "method": "dspark", "model": str(drafter), "dspark_tree": tree, "ngram_branch": 0,
            "num_speculative_tokens": k,
            **({"dspark_verify": "auto"} if tree is None else {})})  # a chain's cost model, or the tree's

    llm = engine(2)
    costs = llm.engine.proposer.draft_costs
    assert costs and seen and set(seen) == {2}
    llm.shutdown()
    calls = len(seen)
    again = engine(2)
    assert len(seen) == calls and again.engine.proposer.draft_costs == costs
    again.shutdown()
    engine(3).shutdown()
    assert len(seen) > calls and set(seen[calls:]) == {3}


def test_auto_profiles_costs_and_cuts_drafts(tiny_llama, tmp_path):
    drafter = write_random_drafter(tmp_path / "d", tiny_llama)
    llm = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=4, speculative_config={  # the cost model alone
        "method": "dspark", **CHAIN, "model": str(drafter), "dspark_verify": "auto", "online_calibration": False})
    prop = llm.engine.proposer
    assert set(prop.draft_costs) == {1, 2, 4} and all(v > 0 for v in prop.draft_costs.values())
    assert min(prop.verify_costs) == 1 and max(prop.verify_costs) >= 4 * 5
    # a verification that costs nothing extra per token: every draft is verified; one that grows
    # steeply with the token count: none
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=4, speculative_config={
        "method": "dspark", **CHAIN, "model": str(drafter), "dspark_verify": "full"})
    full.generate(PROMPTS, params, use_tqdm=False)
    prop.verify_costs = {1: 1.0, 1000: 1.0}
    llm.generate(PROMPTS, params, use_tqdm=False)
    m = llm.get_metrics()
    assert m["num_draft_tokens"] == full.get_metrics()["num_draft_tokens"] > 0
    llm.reset_metrics()
    prop.verify_costs = {1: 1.0, 2: 100.0, 1000: 1e5}
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert llm.get_metrics()["num_draft_tokens"] == 0


@pytest.mark.parametrize("mode", [{**CHAIN, "dspark_verify": "auto"}, {"dspark_tree": "auto", "ngram_branch": 0}])
def test_auto_verify_choice_leaves_the_drafting_time_out(tiny_llama, tmp_path, mode):
    """What a step verifies does not depend on what its drafting cost, which is spent whatever is
    verified: a drafter a million times dearer verifies the same drafts (the draft gate, off here, is
    what weighs that cost), fewer than where verification is free. Counted in, a dear drafting step
    made every draft look worth verifying."""
    drafter = write_random_drafter(tmp_path / "d", tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    verified = []
    for draft_s, verify in ((1e-4, {1: 1.0, 2: 1.5, 8: 6.0, 1000: 1e4}), (1e2, {1: 1.0, 2: 1.5, 8: 6.0, 1000: 1e4}),
                            (1e-4, {1: 1.0, 1000: 1.0})):
        llm = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=4, speculative_config={
            "method": "dspark", "model": str(drafter), "online_calibration": False, "draft_gate": False, **mode})
        prop = llm.engine.proposer
        prop.verify_costs = verify
        prop.draft_costs = {b: draft_s for b in prop.draft_costs}
        llm.generate(PROMPTS, params, use_tqdm=False)
        verified.append(llm.engine.stats.verified_tokens)
        llm.shutdown()
    assert verified[0] == verified[1] < verified[2]


@pytest.mark.multiproc
@pytest.mark.parametrize("replicate", [True, False])
def test_tp2_dspark_equals_tp1_and_counts_collectives(tiny_llama, tmp_path, replicate):
    """Under TP=2 the drafter runs on both ranks. A replicated Markov head holds its full weights on each
    rank and adds no collective to a draft step (the step runs the embedding's all-reduce and the base
    logits' gather, as without a Markov head); a sharded one adds an all-reduce (W1) and a gather (W2)
    per draft position."""
    drafter = write_random_drafter(tmp_path / "d", tiny_llama, markov_rank=8)
    dflash = write_random_drafter(tmp_path / "f", tiny_llama, markov_rank=0)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    spec = {"method": "dspark", **CHAIN, "model": str(drafter), "markov_replicate": replicate,
            "draft_sample_method": "probabilistic"}
    # greedy, and seeded sampling with drafts sampled on both ranks from the same generator states
    sampled = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=20, ignore_eos=True) for i in range(3)]
    one = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec)
    ref = one.generate(PROMPTS, params, use_tqdm=False)
    ref_s = one.generate(PROMPTS, sampled, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), dtype="float32", tensor_parallel_size=2, speculative_config=spec)
    try:
        runner = llm.engine.runner
        shapes = runner.helper_report("dspark", "markov_weight_shapes")
        step = runner.helper_report("dspark", "draft_step_collectives", 2)
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        out_s = llm.generate(PROMPTS, sampled, use_tqdm=False)
        counts = runner.collective_counts()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in out_s] == [o.outputs[0].token_ids for o in ref_s]
    base = LLM(model=str(tiny_llama), dtype="float32", tensor_parallel_size=2,
               speculative_config={"method": "dspark", **CHAIN, "model": str(dflash)})
    try:
        base_step = base.engine.runner.helper_report("dspark", "draft_step_collectives", 2)
    finally:
        base.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert counts[0] == counts[1]  # the ranks stayed in step
    V, g = 257, 4
    assert base_step[0] == base_step[1] == {"all_reduce": 1, "all_gather": 1}
    if replicate:
        assert shapes == [{"markov_w1": (V, 8), "markov_w2": (V, 8)}] * 2
        assert step == base_step
    else:
        assert shapes == [{"markov_w1": (129, 8), "markov_w2": (129, 8)}] * 2
        assert step == [{"all_reduce": 1 + g, "all_gather": 1 + g}] * 2


@pytest.mark.multiproc
def test_tp2_dspark_tree_equals_tp1(small_vocab_model, tmp_path):
    """Tree drafting under TP=2 (candidates drafted on both ranks, the tree verified by the sharded
    target): the same tokens as TP=1, greedy and seeded sampling."""
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, markov_rank=8)
    spec = {"method": "dspark", **CHAIN, "model": str(drafter), "dspark_tree": 6}
    prompts = [[t % 16 for t in p] for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)]
    one = LLM(model=str(small_vocab_model), dtype="float32", speculative_config=spec)
    ref = one.generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(small_vocab_model), dtype="float32", tensor_parallel_size=2, speculative_config=spec)
    try:
        out = llm.generate(prompts, params, use_tqdm=False)
        m = llm.get_metrics()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert m["num_accepted_tokens"] > 0


def _three_requests(llm, params):
    """A prompt of two full blocks and 5 positions, a follow-up over it and its whole answer, and one
    sharing the prompt's first two blocks. Returns the three outputs and the follow-up prompt."""
    first = [(7 * i) % 13 + 1 for i in range(37)]
    outs = [list(llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids)]
    follow_up = first + outs[0] + [3, 2]  # 63 positions: the first request kept 60
    for prompt in (follow_up, first[:35] + [9, 9, 4]):
        outs.append(list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids))
    return outs, follow_up


def test_prefix_caching_hands_the_drafter_the_shared_positions_features(small_vocab_model, tmp_path):
    """With prefix caching a DSpark request skips the cached blocks of its prompt (a shared prompt, a
    follow-up turn over a whole earlier answer) and its drafter still sees every position's features:
    the same drafts and the same output as without prefix caching, the stored features those a fresh
    forward gives; a store that lost a block shares only the blocks before it."""
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, scale=0.6)
    spec = {"method": "dspark", **CHAIN, "dspark_verify": "full", "model": str(drafter)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        llm = LLM(model=str(small_vocab_model), dtype="float32", speculative_config=spec,
                  enable_prefix_caching=caching)
        w = llm.engine.proposer.worker
        drafts, propose = [], w.propose

        def record(*args, drafts=drafts, propose=propose, **kwargs):
            out = propose(*args, **kwargs)
            drafts.append(out[0].tokens.tolist())
            return out

        w.propose = record
        outs, follow_up = _three_requests(llm, params)
        runs[caching] = (outs, drafts, llm.engine.stats.prefix_cached_tokens, llm)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]  # every drafting step alike
    assert runs[False][2] == 0 and runs[True][2] == 48 + 32  # 3 blocks of the follow-up, 2 of the third
    llm = runs[True][3]
    store, prop = llm.engine.prefix_features, llm.engine.proposer
    n, feats = store.lookup(follow_up)
    assert n == 48
    ref = llm.engine.runner.forward(0, [follow_up], [0], "none", aux_layers=prop.aux_layers).aux
    for f, r in zip(feats, ref):
        torch.testing.assert_close(f, r[0, :48], rtol=1e-5, atol=1e-5)
    llm.engine.runner.release_slot(0)  # the blocks of that forward
    store.blocks.pop(BlockManager.chain_hashes(follow_up, 16, 3)[1])  # the store loses the second block
    before = llm.engine.stats.prefix_cached_tokens
    again = llm.generate([follow_up], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(again) == runs[True][0][1] and llm.engine.stats.prefix_cached_tokens == before + 16


@pytest.mark.multiproc
def test_tp2_prefix_caching_hands_both_ranks_the_shared_features(small_vocab_model, tmp_path):
    """Under TP=2 the stored features of shared blocks reach the drafter on both ranks: the same
    outputs and acceptance as TP=1 without prefix caching, and the ranks stay in step."""
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, scale=0.6)
    spec = {"method": "dspark", **CHAIN, "dspark_verify": "full", "model": str(drafter)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = LLM(model=str(small_vocab_model), dtype="float32", speculative_config=spec, enable_prefix_caching=False)
    ref = _three_requests(one, params)[0], one.get_metrics()
    llm = LLM(model=str(small_vocab_model), dtype="float32", tensor_parallel_size=2, speculative_config=spec)
    try:
        out = _three_requests(llm, params)[0], llm.get_metrics()
        cached, counts = llm.engine.stats.prefix_cached_tokens, llm.engine.runner.collective_counts()
    finally:
        llm.shutdown()
    assert out == ref and cached == 48 + 32 and counts[0] == counts[1]
