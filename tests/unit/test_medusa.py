"""Medusa heads and drafting: head math, chain/tree proposals, lossless decoding, TP replication."""

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specserve import LLM, SamplingParams
from specserve.layers import cpu_ops
from specserve.spec_decode.cost_model import MAX_PROFILED_TOKENS
from specserve.spec_decode.medusa.proposer import expected_tokens, greedy_tree
from specserve.spec_decode.medusa.model import MedusaConfig, MedusaHeads

from test_spec_engine import assert_same_distribution, sample_prefixes, sampled_walk

PROMPTS = [[5, 17, 42, 99, 3], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]

# the tests below are about chains: the methods' defaults are trees with pooled n-gram branches
CHAIN = {"medusa_tree": None, "medusa_verify": "full", "ngram_branch": 0}


def make_heads(path, hidden, vocab, num_heads=3, num_layers=1, shared=True, seed=0, scale=0.5, draft_vocab=None,
               token_input=False):
    torch.manual_seed(seed)
    cfg = MedusaConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=hidden, vocab_size=vocab,
                       shared_lm_head=shared, draft_vocab_size=draft_vocab, token_input=token_input)
    heads = MedusaHeads(cfg)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn_like(p) * scale)
        if draft_vocab:  # a scattered draft vocabulary of target ids
            heads.token_map.copy_(torch.randperm(vocab)[:draft_vocab].sort().values)
    heads.save(path, dtype=torch.float32)
    return path


@pytest.fixture(scope="module")
def tiny_heads(tiny_llama, tmp_path_factory):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    root = tmp_path_factory.mktemp("heads")
    return {
        "shared": make_heads(root / "shared", cfg["hidden_size"], cfg["vocab_size"]),
        "own": make_heads(root / "own", cfg["hidden_size"], cfg["vocab_size"], num_layers=2, shared=False),
        "shared-draft-vocab": make_heads(root / "sdv", cfg["hidden_size"], cfg["vocab_size"], draft_vocab=60),
        "own-draft-vocab": make_heads(root / "odv", cfg["hidden_size"], cfg["vocab_size"], shared=False,
                                      draft_vocab=60),
        "token-input": make_heads(root / "tok", cfg["hidden_size"], cfg["vocab_size"], num_layers=2,
                                  token_input=True),
    }


def test_head_math_matches_formula():
    torch.manual_seed(0)
    cfg = MedusaConfig(num_heads=2, num_layers=2, hidden_size=8, vocab_size=11, shared_lm_head=False)
    heads = MedusaHeads(cfg)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn_like(p))
    assert heads.blocks[0][0].weight.data_ptr() != heads.blocks[0][1].weight.data_ptr()  # no tied blocks
    x = torch.randn(3, 8)
    got = heads.logits(x)
    for h in range(2):
        y = x
        for l in range(2):
            blk = heads.blocks[h][l]
            y = y + F.silu(y @ blk.weight.T + blk.bias)
        assert torch.allclose(got[:, h], y @ heads.lm_heads[h].weight.T, atol=1e-5)
    # the heads' first blocks as one packed GEMM (CPU): the same states up to float32 rounding
    heads.pack_first_blocks()
    assert heads._first is not None
    assert torch.allclose(heads.logits(x), got, atol=1e-4)


@pytest.mark.parametrize("bits", [None, 8])
def test_token_input_heads_read_the_root_embedding(bits):
    """``token_input``: each head's first block is x + SiLU(W x + U e + b), e the root token's embedding;
    zero U gives the plain heads' states; one stacked GEMM over [x; e] (oneDNN or 8 bits) computes the
    same; heads that need e refuse to run without it."""
    torch.manual_seed(0)
    cfg = MedusaConfig(num_heads=3, num_layers=2, hidden_size=64, vocab_size=11, shared_lm_head=False,
                       token_input=True)
    heads = MedusaHeads(cfg)
    plain = MedusaHeads(MedusaConfig(**{**cfg.__dict__, "token_input": False}))
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        plain.load_state({k: v for k, v in heads.state_for_save().items() if "token_weight" not in k})
    assert {k for k in heads.state_for_save() if "token_weight" in k} == {f"blocks.{h}.0.token_weight"
                                                                           for h in range(3)}  # first blocks only
    x, e = torch.randn(5, 64), torch.randn(5, 64)
    want = []
    for h in range(3):
        b0, b1 = heads.blocks[h]
        y = x + F.silu(x @ b0.weight.T + e @ b0.token_weight.T + b0.bias)
        want.append(y + F.silu(y @ b1.weight.T + b1.bias))
    want = torch.stack(want, 1)
    torch.testing.assert_close(heads.head_states(x, e), want)
    assert not torch.allclose(heads.head_states(x, e), plain.head_states(x), atol=1e-2)
    with pytest.raises(ValueError, match="token_input"):
        heads.logits(x)
    with torch.no_grad():
        for blocks in heads.blocks:
            blocks[0].token_weight.zero_()
    torch.testing.assert_close(heads.head_states(x, e), plain.head_states(x))
    with torch.no_grad():
        for blocks in heads.blocks:
            blocks[0].token_weight.copy_(torch.randn_like(blocks[0].token_weight) * 0.2)
        if bits:  # the reference: the first blocks' W and U quantized in groups of 32 columns, dequantized
            from specserve.layers.quant import quantize

            ref_heads = MedusaHeads(cfg)
            ref_heads.load_state(heads.state_for_save())
            for blocks in ref_heads.blocks:
                for w in (blocks[0].weight, blocks[0].token_weight):
                    w.copy_(quantize(w, bits, 32).dequantize())
    ref = (ref_heads if bits else heads).head_states(x, e)
    heads.pack_first_blocks(bits)
    assert heads._first is not None
    tol = 1e-4 if bits is None else 3e-2
    torch.testing.assert_close(heads.head_states(x, e), ref, atol=tol, rtol=tol)


def test_first_blocks_in_8_bits_compute_the_quantized_weights():
    """Beside a quantized target the heads' first blocks run as one 8-bit GEMM (group kernel): the
    states of the same heads with those blocks' weights quantized and dequantized, up to bfloat16."""
    from specserve.layers.quant import quantize

    torch.manual_seed(0)
    cfg = MedusaConfig(num_heads=3, num_layers=2, hidden_size=64, vocab_size=11, shared_lm_head=False)
    heads, ref = MedusaHeads(cfg), MedusaHeads(cfg)
    with torch.no_grad():
        for p, q in zip(heads.parameters(), ref.parameters()):
            q.copy_(p.copy_(torch.randn_like(p) * 0.2))
        for blocks in ref.blocks:
            blocks[0].weight.copy_(quantize(blocks[0].weight, 8, 32).dequantize())
    heads.pack_first_blocks(8)
    assert heads._first[0].kind == "int8-g32"
    x = torch.randn(5, 64)
    torch.testing.assert_close(heads.head_states(x), ref.head_states(x), atol=3e-2, rtol=3e-2)
    assert torch.allclose(heads.logits(x), ref.logits(x), atol=5e-2, rtol=5e-2)


def test_greedy_tree_and_expected_tokens():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    paths = greedy_tree(acc, 4)
    assert paths == [[0], [0, 0], [1], [0, 1]]  # 0.6, 0.24, 0.2, 0.12 (> [0, 0, 0]: 0.072)
    assert expected_tokens(paths, acc) == pytest.approx(1 + 0.6 + 0.24 + 0.2 + 0.12)


@pytest.mark.parametrize("kind", ["shared", "own", "shared-draft-vocab", "own-draft-vocab", "token-input"])
@pytest.mark.parametrize("tree", [None, 6, [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]])
def test_greedy_identical_to_plain(tiny_llama, tiny_heads, kind, tree):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    spec_cfg = {"method": "medusa", **CHAIN, "model": str(tiny_heads[kind]), "num_speculative_tokens": 3,
                "medusa_tree": tree}
    llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec_cfg)
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_chain_proposal_is_head_argmax(tiny_llama, tiny_heads):
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={"method": "medusa", **CHAIN,
                                  "model": str(tiny_heads["own"]), "num_speculative_tokens": 2})
    eng = llm.engine
    seq = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10))
    eng.step()  # prefill (+ one verify step)
    prop = eng.proposer
    from specserve.spec_decode import ProposeInputs

    drafts = prop.propose(ProposeInputs([seq], [2])).chains[0]
    h = prop._hidden[seq.seq_id]
    assert h.shape == (64,)
    want = prop.heads.logits(h[None])[0, :2].argmax(-1).tolist()
    assert drafts == want and len(drafts) == 2


@pytest.mark.parametrize("token_input", [False, True])
def test_engine_drafts_from_the_last_kept_hidden_state(small_vocab_model, tmp_path, token_input):
    """Each step's chain is the heads' argmax at the final hidden state of the last token kept so far
    (after partial acceptances and rejections), as one full forward of the final sequence gives it,
    and the steps walk the output (next start = accepted drafts + 1). ``token_input`` heads read the
    embedding of the token that state emitted: the token at ``start``."""
    heads = make_heads(tmp_path / "h", 64, 16, num_heads=3, token_input=token_input)
    llm = LLM(sampling_mode="rejection", model=str(small_vocab_model), dtype="float32",
              speculative_config={"method": "medusa", **CHAIN, "model": str(heads), "num_speculative_tokens": 3})
    prop = llm.engine.proposer
    steps = []
    engine_propose = prop.propose

    def record(inputs):
        out = engine_propose(inputs)
        steps.append((inputs.seqs[0].num_computed, out.chains[0]))
        return out

    prop.propose = record
    full = sampled_walk(llm, [5, 1, 12, 9, 3], steps)
    hidden = llm.engine.runner.forward(0, [full], [0], "all", return_hidden=True).hidden[0]
    emb = llm.engine.runner.embed_tokens(torch.tensor(full)) if token_input else None
    for start, chain in steps:
        root = None if emb is None else emb[start][None]
        want = prop.heads.logits(hidden[start - 1][None], prop.lm_head, root)[0, : len(chain)].argmax(-1).tolist()
        assert chain == want
    if token_input:  # the embedding matters: another root token drafts other chains somewhere
        other = [prop.heads.logits(hidden[start - 1][None], prop.lm_head, emb[(start + 1) % len(full)][None])
                 [0, : len(chain)].argmax(-1).tolist() for start, chain in steps]
        assert other != [chain for _, chain in steps]


def test_root_embeddings_are_kept_per_token_and_bounded(small_vocab_model, tmp_path, monkeypatch):
    """The root tokens' embedding rows that ``_root_embeddings`` keeps equal fresh lookups, for one
    request and for a batch (a token twice in it too), and never more than ``ROOT_EMBEDDINGS`` are kept."""
    import specserve.spec_decode.medusa.proposer as medusa_proposer

    monkeypatch.setattr(medusa_proposer, "ROOT_EMBEDDINGS", 3)
    heads = make_heads(tmp_path / "h", 64, 16, num_heads=3, token_input=True)
    llm = LLM(model=str(small_vocab_model), dtype="float32",
              speculative_config={"method": "medusa", **CHAIN, "model": str(heads)})
    prop, table = llm.engine.proposer, llm.engine.runner.embed_tokens
    kept = []
    for toks in ([5], [7], [5], [1], [2], [3, 5, 9, 5], [9]):
        seqs = [SimpleNamespace(output_ids=[0, t]) for t in toks]
        assert torch.equal(prop._root_embeddings(seqs), table(torch.tensor(toks)))
        kept.append(len(prop._root_rows))
    # a token seen before is not looked up again; a new one where 3 are kept starts them afresh
    assert kept[:5] == [1, 2, 2, 3, 1] and max(kept) == 3


@pytest.mark.parametrize("tree, draft_vocab, verify, quantization", [
    (None, None, "full", None), (8, None, "full", None), (None, 10, "full", None), (8, 10, "full", None),
    (None, None, "auto", None), (8, 10, "auto", None), (None, None, "auto-calibrated", None),
    (8, 10, "auto-calibrated", None), (8, 10, "full", "int4"), (8, 10, "auto-token-input", "int4"),
    (None, None, "full-token-input", None)])
def test_distribution_matches_plain_sampling(small_vocab_model, tmp_path, tree, draft_vocab, verify, quantization):
    """``auto``: the cost model's cut from the heads' probabilities alone; ``auto-calibrated``: with the
    online calibration, whose choices follow the outcomes of earlier steps (random heads promise more
    than they deliver, so it keeps changing what is verified). ``int4``: a quantized target, the heads
    sharing its LM head (the draft vocabulary's rows taken quantized). ``token-input``: heads that read
    the root token's embedding."""
    cfg = json.loads((small_vocab_model / "config.json").read_text())
    heads = make_heads(tmp_path / "h", cfg["hidden_size"], cfg["vocab_size"], shared=quantization is not None,
                       scale=1.0, draft_vocab=draft_vocab, token_input=verify.endswith("token-input"))
    fmt = {"dtype": "float32"} if quantization is None else {"quantization": quantization}
    plain = LLM(sampling_mode="rejection", model=str(small_vocab_model), max_num_seqs=64, **fmt)
    spec = LLM(sampling_mode="rejection", model=str(small_vocab_model), max_num_seqs=64, **fmt,
               speculative_config={"method": "medusa", **CHAIN, "model": str(heads), "num_speculative_tokens": 3,
                                   "medusa_tree": tree, "medusa_topk": 3, "medusa_verify": verify[:4],
                                   "online_calibration": verify == "auto-calibrated"})
    if quantization is not None:
        assert spec.engine.proposer.lm_head.qkernel is not None  # the draft head runs quantized
    if verify.startswith("auto"):  # a cost per verified token: the batch's chains cut by their confidences
        spec.engine.proposer.verify_costs = {1: 1.0, 1000: 1.0 + 999 * (0.001 if verify == "auto" else 0.0002)}
    a = sample_prefixes(plain, 2000, 0, k=5)
    b = sample_prefixes(spec, 2000, 100_000, k=5)
    m = spec.get_metrics()
    assert m["num_accepted_tokens"] > 100  # drafts were really accepted
    if verify.startswith("auto") and tree is None:
        assert 0 < m["num_draft_tokens"] < 3 * m["num_verify_steps"]
    if verify == "auto-calibrated":  # the calibration really scaled the heads' promises down
        assert spec.engine.proposer.calibration.factors((1.0, 0, 1.0, 0.0))[0] < 0.5
    assert_same_distribution(a, b)


def test_auto_verify_cuts_chains_by_cost(tiny_llama, tiny_heads):
    """``medusa_verify="auto"``: costs measured at start-up; a free verification keeps whole chains, a
    steep one drafts nothing, in between the lengths differ by request; greedy output never changes."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in
             LLM(model=str(tiny_llama), dtype="float32").generate(PROMPTS, params, use_tqdm=False)]
    cfg = {"method": "medusa", **CHAIN, "model": str(tiny_heads["own"])}
    full = LLM(model=str(tiny_llama), dtype="float32", speculative_config=cfg)
    full.generate(PROMPTS, params, use_tqdm=False)
    full_drafts = full.get_metrics()["num_draft_tokens"]
    # the cost model alone (test_calibration covers the online calibration of its predictions)
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={**cfg, "medusa_verify": "auto", "online_calibration": False})
    prop = llm.engine.proposer
    assert {1, 4} <= set(prop.verify_costs) and min(prop.verify_costs.values()) > 0
    for costs, check in (({1: 1.0, 1000: 1.0}, lambda m: m["num_draft_tokens"] == full_drafts),
                         ({1: 1.0, 1000: 1000.0}, lambda m: m["num_draft_tokens"] == 0),
                         ({1: 1.0, 1000: 1.0 + 999 * 0.4}, lambda m: 0 < m["num_draft_tokens"] < full_drafts)):
        prop.verify_costs = costs
        llm.reset_metrics()
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == plain
        assert check(llm.get_metrics()), (costs, llm.get_metrics())
    with pytest.raises(ValueError, match="medusa_verify must be one of"):
        LLM(model=str(tiny_llama), speculative_config={"method": "medusa", "medusa_verify": "sometimes"})


@pytest.mark.skipif(cpu_ops.get() is None, reason="the C++ extension did not build here (the fallback runs)")
@pytest.mark.parametrize("kind", ["shared", "shared-draft-vocab"])
def test_ranked_paths_op_equals_its_pytorch_path(tiny_llama, tiny_heads, kind, monkeypatch):
    """A dynamic tree's candidates (``MedusaProposer.ranked_paths``: the heads' top-k tokens, each path's
    probability product, their ranking) in one C++ call: the same values as the separate ops it replaces
    (the C++ top k, torch's products, the C++ ranking), and through PyTorch the same tokens and ranking
    (its softmax rounds its own way), for greedy and sampled requests in one batch, a calibration that
    scales the scores (started once a step either way), rows cut at different depths, equal logits
    (ties to the lower id)."""
    from specserve.spec_decode.cost_model import sampling_key

    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={"method": "medusa", "model": str(tiny_heads[kind]), "medusa_tree": "auto",
                                  "medusa_topk": 4, "medusa_verify": "auto", "ngram_branch": 0})
    prop = llm.engine.proposer
    assert prop._candidates is not None and prop.calibration is not None
    seqs = [SimpleNamespace(seq_id=i, output_ids=[1], params=SamplingParams(temperature=t))
            for i, t in enumerate([0.0, 0.7, 1.3])]

    def calibrated():  # both paths start from the same observed outcomes
        from specserve.spec_decode.cost_model import AcceptanceCalibration

        cal = AcceptanceCalibration(prop.calibration.max_depth)
        for s in seqs[:2]:
            for _ in range(5):
                cal.begin_step([sampling_key(s.params)])
                cal.expect(s.seq_id, sampling_key(s.params), [0.9, 0.5, 0.3, 0.2][: cal.max_depth])
                cal.observe(s.seq_id, 1)
        return cal

    g = torch.Generator().manual_seed(3)
    V = prop.heads.cfg.head_vocab_size
    logits = torch.randn(3, prop.heads.cfg.num_heads, V, generator=g) * 3
    D = prop._candidates["max_depth"]
    limits = [D, 1, 2]
    prop.calibration = calibrated()
    fast = prop.ranked_paths(logits, seqs, limits)
    fast_stats = copy.deepcopy(prop.calibration._stats)  # the step it started
    top, raw, ranked, order = fast
    assert ranked[0] != sorted(raw[0], reverse=True)  # the calibration scaled row 0
    depth = prop._candidates["depth_list"]
    assert all(r == -1.0 for r, i in zip(ranked[1], order[1]) if depth[i] > 1)
    tied = logits.clone()
    tied[1, 0, :7] = logits[1, 0].max() + 1  # equal best logits: the op takes the lowest ids first
    assert prop.ranked_paths(tied, seqs, limits)[0][1][:4] == prop.heads.to_target(torch.arange(4)).tolist()
    # the separate ops' values
    probs, ids = cpu_ops.softmax_topk(logits[:, :D].reshape(3 * D, V), None, prop._temperatures(seqs, D, "cpu"), 4)
    assert top == prop.heads.to_target(ids).reshape(3, -1).tolist()
    products = prop.path_probs(probs.view(3, D, 4))
    assert raw == products.tolist()
    prop.calibration = calibrated()
    assert [x.tolist() for x in prop.path_scores(products, limits, seqs)] == [ranked, order]
    # PyTorch's path
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    prop.calibration = calibrated()
    slow = prop.ranked_paths(logits, seqs, limits)
    assert slow[0] == top and slow[3] == order
    assert torch.allclose(torch.tensor(slow[1]), torch.tensor(raw), rtol=1e-5, atol=0)
    assert fast_stats == prop.calibration._stats


@pytest.mark.parametrize("kind, tree", [("own", 6), ("shared-draft-vocab", "auto")])
def test_dynamic_tree_by_cost(tiny_llama, tiny_heads, kind, tree):
    """``medusa_verify="auto"`` with a tree: each step, each request verifies its highest-scoring
    candidate paths (score = product of the heads' probabilities of the path's tokens), a subtree, as
    many as the cost model finds worth it: all with a free verification, none with a steep one, a
    varying number in between; greedy output never changes. (One request at a time: a batch verifies
    as many paths a row as its longest row, ``test_choose_verify_lengths_is_the_best_choice``.)"""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in
             LLM(model=str(tiny_llama), dtype="float32").generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={"method": "medusa", **CHAIN, "model": str(tiny_heads[kind]), "medusa_tree": tree,
                                  "medusa_topk": 4, "medusa_verify": "auto", "online_calibration": False})
    prop = llm.engine.proposer
    cand = prop._candidates["paths"]
    assert len(cand) == (6 if tree == 6 else 64)
    assert {1, 2, len(cand) + 1} <= set(prop.verify_costs)
    # 16 sequences x 65 tokens are extrapolated, not measured at start-up
    assert max(prop.verify_costs) == (MAX_PROFILED_TOKENS if tree == "auto" else 16 * 7)
    sizes, allowed = [], []
    engine_propose = prop.propose

    def record(inputs):
        logits = prop.heads.logits(torch.stack([prop._hidden[s.seq_id] for s in inputs.seqs]), prop.lm_head)
        out = engine_propose(inputs)
        for b, (s, t) in enumerate(zip(inputs.seqs, out.trees)):
            probs = torch.softmax(logits[b].float(), -1).topk(4, -1)
            score = {tuple(p): math.prod(float(probs.values[d, r]) for d, r in enumerate(p)) for p in map(tuple, cand)
                     if len(p) <= inputs.max_drafts[b]}
            n = 0 if t is None else t.buffers.num_nodes - 1
            sizes.append(n)
            # a free verification takes every path that adds to the expected count (not those of ~0 probability)
            allowed.append((sum(v > 1e-9 for v in score.values()), sum(v > 0 for v in score.values())))
            if t is None:
                continue
            paths = [tuple(p) for p in t.buffers.rank_paths]
            assert all(p[:-1] in paths or len(p) == 1 for p in paths)  # a subtree
            rest = [v for p, v in score.items() if p not in paths]
            assert min(score[p] for p in paths) >= max(rest, default=0) - 1e-6
            ids = prop.heads.to_target(probs.indices)
            assert t.tokens == [s.output_ids[-1]] + [int(ids[len(p) - 1, p[-1]]) for p in t.buffers.rank_paths]
        return out

    prop.propose = record
    for costs, check in (({1: 1.0, 1000: 1.0}, lambda: all(lo <= n <= hi for n, (lo, hi) in zip(sizes, allowed))
                          and max(sizes) > len(cand) // 2),
                         ({1: 1.0, 1000: 1000.0}, lambda: set(sizes) == {0}),
                         ({1: 1.0, 1000: 1.0 + 999 * 0.1}, lambda: len(set(sizes)) > 2 and 0 < max(sizes))):
        prop.verify_costs = costs
        sizes.clear()
        allowed.clear()
        out = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
        assert [o.outputs[0].token_ids for o in out] == plain
        assert check(), (costs, sizes, allowed)


def test_typical_acceptance_is_opt_in_and_runs(tiny_llama, tiny_heads, caplog):
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={"method": "medusa", **CHAIN,
                                  "model": str(tiny_heads["shared"]), "acceptance": "typical",
                                  "medusa_tree": 6})
    assert "LOSSY" in caplog.text
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.7, seed=1, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    # greedy rows stay exact under typical acceptance
    g = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(PROMPTS, g, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, g, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain]


def test_auto_tree_uses_measured_costs(tiny_llama, tiny_heads):
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={"method": "medusa", **CHAIN,
                                  "model": str(tiny_heads["shared"]), "medusa_tree": "auto"})
    prop = llm.engine.proposer
    costs = prop.tree_costs
    assert sorted(costs) == list(costs) and all(costs[a] <= costs[b] for a, b in zip(costs, list(costs)[1:]))
    assert prop.auto_choice.startswith(("chain", "tree of"))
    # the tree's table is kept apart from the engine's own step costs, which every step reports to
    from specserve.spec_decode.cost_model import StepCosts

    assert isinstance(prop.step_costs, StepCosts)


def test_bad_medusa_config(tiny_llama, tiny_heads, tmp_path):
    with pytest.raises(ValueError, match="exceeds the checkpoint's 3 Medusa heads"):
        LLM(model=str(tiny_llama), speculative_config={"method": "medusa", **CHAIN, "model": str(tiny_heads["shared"]),
                                                       "num_speculative_tokens": 5})
    wrong = make_heads(tmp_path / "wrong", 32, 257)
    with pytest.raises(ValueError, match="hidden size 32.*64"):
        LLM(model=str(tiny_llama), speculative_config={"method": "medusa", **CHAIN, "model": str(wrong)})
    with pytest.raises(ValueError, match="bogus_option"):
        LLM(model=str(tiny_llama), speculative_config={"method": "medusa", **CHAIN, "model": str(tiny_heads["shared"]),
                                                       "bogus_option": 1})


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["shared", "own", "token-input"])
def test_tp2_medusa_equals_tp1_heads_replicated(tiny_llama, tiny_heads, kind):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec_cfg = {"method": "medusa", **CHAIN,
                "model": str(tiny_heads[kind]), "num_speculative_tokens": 3, "medusa_tree": 6}
    ref = LLM(model=str(tiny_llama), dtype="float32", speculative_config=spec_cfg).generate(PROMPTS, params,
                                                                                            use_tqdm=False)
    llm = LLM(model=str(tiny_llama), dtype="float32", tensor_parallel_size=2, speculative_config=spec_cfg)
    try:
        prop = llm.engine.proposer
        heads = prop.heads.lm_heads or [prop.lm_head]
        assert all(h.weight.shape == (257, 64) and h.tp_size == 1 for h in heads)  # full vocab, replicated
        before = llm.engine.runner.collective_counts()
        hidden = torch.zeros(4, 64)
        emb = None
        if kind == "token-input":  # the root tokens' embedding: a replicated full table too
            assert prop.embed.tp_size == 1 and prop.embed.weight.shape == (257, 64)
            emb = prop.embed(torch.tensor([0, 5, 128, 256]))
            torch.testing.assert_close(emb, LLM(model=str(tiny_llama), dtype="float32").engine.runner.embed_tokens(
                torch.tensor([0, 5, 128, 256])))
        prop.heads.logits(hidden, prop.lm_head, emb)  # drafting alone runs no collective
        assert llm.engine.runner.collective_counts() == before
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        counts = llm.engine.runner.collective_counts()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert counts[0] == counts[1]  # the driver ran no extra (head) collective


@pytest.mark.parametrize("kind", ["shared-draft-vocab", "own-draft-vocab"])
def test_draft_vocabulary_proposals_are_mapped_target_ids(tiny_llama, tiny_heads, kind):
    """With a token_map the heads' logits cover its 60 tokens only; chain drafts are the target ids of
    their argmax (a shared head uses those rows of the target's lm_head), tree candidates likewise."""
    llm = LLM(model=str(tiny_llama), dtype="float32",
              speculative_config={"method": "medusa", **CHAIN,
                                  "model": str(tiny_heads[kind]), "num_speculative_tokens": 3})
    eng = llm.engine
    seq = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10))
    eng.step()
    prop = eng.proposer
    from specserve.spec_decode import ProposeInputs

    tmap = prop.heads.token_map
    assert tmap.shape == (60,)
    h = prop._hidden[seq.seq_id]
    drafts = prop.propose(ProposeInputs([seq], [3])).chains[0]
    if kind.startswith("shared"):
        full_w = eng.runner.model.lm_head.weight[:257]
        logits = prop.heads.head_states(h[None])[0] @ full_w[tmap].T  # [K, 60]
        assert prop.lm_head.weight.shape == (60, 64)
    else:
        logits = prop.heads.logits(h[None])[0]
    assert logits.shape[-1] == 60
    assert drafts == tmap[logits[:3].argmax(-1)].tolist() and set(drafts) <= set(tmap.tolist())
