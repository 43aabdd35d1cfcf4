"""DFlash / DSpark drafter: checkpoint formats (DeepSpec, speculators, z-lab) on tiny synthetic
checkpoints, config validation against the target, the Markov head variants against formulas written
here, the drafting loop (greedy and probabilistic, pruned vocabulary), the replicated Markov head
under TP (no collective), and the non-causal KV-injection backbone against a direct computation."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specserve.config import ModelConfig
from specserve.distributed.parallel_state import TPGroup
from specserve.models.loader import CheckpointError
from specserve.spec_decode.dspark.config import DSparkConfig, d2t_from_t2d, expected_state_shapes
from specserve.layers import cpu_ops
from specserve.spec_decode.dspark import drafting
from specserve.spec_decode.dspark.drafting import draft_block, draft_blocks, draft_trees
from specserve.spec_decode.dspark.formats import load_dspark_checkpoint
from specserve.spec_decode.dspark.heads import ConfidenceHead, MarkovHead
from specserve.spec_decode.dspark.model import DFlashDrafter

D, H, HKV, HD, V, R, BLOCK, VD = 32, 4, 2, 8, 50, 4, 4, 40
LAYER_IDS = [0, 2]
MASK = 49
THETA = 10000.0




def target_cfg(**kw) -> ModelConfig:
    base = dict(family="qwen3", vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=H, num_key_value_heads=HKV, head_dim=HD, rope_theta=THETA, qk_norm=True)
    base.update(kw)
    return ModelConfig(**base)


def small_cfg(**kw) -> DSparkConfig:
    base = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, head_dim=HD, intermediate_size=48,
                num_layers=2, rms_norm_eps=1e-6, rope_theta=THETA, target_layer_ids=LAYER_IDS, block_size=BLOCK,
                mask_token_id=MASK, sample_from_anchor=True, markov_rank=R, markov_head_type="vanilla",
                enable_confidence_head=True, confidence_head_with_markov=True, vocab_size=V, draft_vocab_size=V)
    base.update(kw)
    return DSparkConfig(**base)


def random_t2d(seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keep = torch.randperm(V, generator=g)[:VD]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    return t2d


def random_state(cfg: DSparkConfig, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in expected_state_shapes(cfg).items():
        if name == "d2t":
            sd[name] = d2t_from_t2d(random_t2d(seed))
        elif name.endswith("norm.weight"):
            sd[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            sd[name] = 0.3 * torch.randn(shape, generator=g)
    return sd


def build(cfg: DSparkConfig, seed=0, **kw) -> DFlashDrafter:
    m = DFlashDrafter(cfg, **kw)
    m.load_state(random_state(cfg, seed))
    return m


# ---- checkpoint writers (one per published layout) ------------------------------------------------


def _decoder_json(num_layers=2, vocab=V, hidden=D):
    return {"hidden_size": hidden, "num_attention_heads": H, "num_key_value_heads": HKV, "head_dim": HD,
            "intermediate_size": 48, "num_hidden_layers": num_layers, "rms_norm_eps": 1e-6, "rope_theta": THETA,
            "vocab_size": vocab, "hidden_act": "silu", "model_type": "qwen3", "attention_bias": False}


def write_deepspec(path, markov_rank=R, head_type="vanilla", confidence=True, with_markov=True, **overrides):
    cfg = small_cfg(markov_rank=markov_rank, markov_head_type=head_type, enable_confidence_head=confidence,
                    confidence_head_with_markov=with_markov and markov_rank > 0)
    sd = random_state(cfg, seed=1)
    g = torch.Generator().manual_seed(2)
    weights = dict(sd)
    weights["embed_tokens.weight"] = torch.randn(V, D, generator=g)  # copies of the target's: ignored
    weights["lm_head.weight"] = torch.randn(V, D, generator=g)
    conf = {**_decoder_json(), "architectures": ["Qwen3DSparkModel"], "num_target_layers": 4, "block_size": BLOCK,
            "mask_token_id": MASK, "target_layer_ids": LAYER_IDS, "num_anchors": 512,
            "layer_types": ["full_attention"] * 2, "tie_word_embeddings": False, "markov_rank": markov_rank,
            "markov_head_type": head_type, "enable_confidence_head": confidence,
            "confidence_head_with_markov": with_markov}
    write_checkpoint(path, conf, weights, overrides)
    return sd


def write_checkpoint(path, conf: dict, weights: dict, overrides: dict) -> None:
    """config.json (``conf`` updated with ``overrides``; a None value removes the key) + model.safetensors."""
    conf = {k: v for k, v in {**conf, **overrides}.items() if v is not None}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(conf))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))


def write_speculators(path, kind="dspark", draft_vocab=VD, with_d2t=True, with_t2d=True, with_lm_head=True,
                      tlc_overrides=None, **overrides):
    pruned = draft_vocab < V
    cfg = small_cfg(markov_rank=R if kind == "dspark" else 0, enable_confidence_head=kind == "dspark",
                    confidence_head_with_markov=kind == "dspark", draft_vocab_size=draft_vocab,
                    sample_from_anchor=kind == "dspark")
    sd = random_state(cfg, seed=3)
    weights = {k: v for k, v in sd.items() if k != "d2t"}
    if pruned:
        t2d = random_t2d(3)
        if with_t2d:
            weights["t2d"] = t2d
        if with_d2t:
            weights["d2t"] = d2t_from_t2d(t2d)
        if not with_lm_head:
            weights.pop("lm_head.weight")
    weights["embed_tokens.weight"] = torch.randn(V, D)
    tlc = _decoder_json()
    tlc.update(tlc_overrides or {})
    conf = {"speculators_model_type": kind, "architectures": [f"{kind.upper()}Speculator"],
            "transformer_layer_config": tlc, "draft_vocab_size": draft_vocab, "block_size": BLOCK,
            "aux_hidden_state_layer_ids": LAYER_IDS, "mask_token_id": MASK,
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy"}}
    if kind == "dspark":
        conf.update(sample_from_anchor=True, markov_rank=R, markov_head_type="vanilla", enable_confidence_head=True,
                    confidence_head_with_markov=True)
    write_checkpoint(path, conf, weights, overrides)
    return sd


def write_zlab(path, dflash_config=None, **overrides):
    cfg = small_cfg(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False,
                    sample_from_anchor=False)
    sd = random_state(cfg, seed=4)
    conf = {**_decoder_json(), "architectures": ["DFlashDraftModel"], "block_size": BLOCK, "num_target_layers": 4,
            "dflash_config": dflash_config if dflash_config is not None else
            {"target_layer_ids": LAYER_IDS, "mask_token_id": MASK}}
    write_checkpoint(path, conf, sd, overrides)
    return sd


def assert_same_state(sd, written):
    assert set(sd) == set(written)
    for k in written:
        assert torch.equal(sd[k], written[k].to(sd[k].dtype)), k


# ---- formats ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_deepspec_dspark_loads(tmp_path, head_type):
    written = write_deepspec(tmp_path / "ds", head_type=head_type)
    cfg, sd = load_dspark_checkpoint(tmp_path / "ds", target_cfg())
    assert cfg.sample_from_anchor and cfg.num_drafts == BLOCK and cfg.first_draft_slot == 0
    assert (cfg.markov_rank, cfg.markov_head_type, cfg.block_size, cfg.mask_token_id) == (R, head_type, BLOCK, MASK)
    assert cfg.target_layer_ids == LAYER_IDS and cfg.num_layers == 2 and cfg.draft_vocab_size == V
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert_same_state(sd, written)  # embed_tokens / lm_head copies dropped
    m = DFlashDrafter(cfg)
    m.load_state(sd)
    assert m.lm_head is None and m.d2t is None and m.markov_head.head_type == head_type


def test_deepspec_dflash_baseline_is_anchor_first(tmp_path):
    write_deepspec(tmp_path / "ds", markov_rank=0, confidence=False, with_markov=False)
    cfg, sd = load_dspark_checkpoint(tmp_path / "ds", target_cfg())
    assert cfg.markov_rank == 0 and cfg.sample_from_anchor and cfg.num_drafts == BLOCK
    assert not any(k.startswith(("markov_head.", "confidence_head.")) for k in sd)
    m = DFlashDrafter(cfg)
    m.load_state(sd)
    assert m.markov_head is None and m.confidence_head is None


@pytest.mark.parametrize("maps", [(True, True), (True, False), (False, True)])
def test_speculators_dspark_pruned_vocab(tmp_path, maps):
    with_d2t, with_t2d = maps
    written = write_speculators(tmp_path / "sp", with_d2t=with_d2t, with_t2d=with_t2d)
    cfg, sd = load_dspark_checkpoint(tmp_path / "sp", target_cfg())
    assert cfg.sample_from_anchor and cfg.pruned_vocab and cfg.draft_vocab_size == VD
    assert torch.equal(sd["d2t"], d2t_from_t2d(random_t2d(3)))
    assert sd["markov_head.markov_w1.weight"].shape == (V, R) and sd["markov_head.markov_w2.weight"].shape == (VD, R)
    assert_same_state({k: v for k, v in sd.items() if k != "d2t"}, {k: v for k, v in written.items() if k != "d2t"})
    m = DFlashDrafter(cfg)
    m.load_state(sd)
    assert m.lm_head.weight.shape == (VD, D) and torch.equal(m.lm_head.weight, written["lm_head.weight"])


def test_speculators_dflash_missing_sample_from_anchor_is_mask_only(tmp_path):
    write_speculators(tmp_path / "sp", kind="dflash", draft_vocab=V)
    raw = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert "sample_from_anchor" not in raw
    cfg, sd = load_dspark_checkpoint(tmp_path / "sp", target_cfg())
    assert not cfg.sample_from_anchor and cfg.num_drafts == BLOCK - 1 and cfg.first_draft_slot == 1
    assert cfg.markov_rank == 0 and not cfg.pruned_vocab and "d2t" not in sd


def test_zlab_dflash_is_mask_only(tmp_path):
    written = write_zlab(tmp_path / "zl")
    cfg, sd = load_dspark_checkpoint(tmp_path / "zl", target_cfg())
    assert not cfg.sample_from_anchor and cfg.num_drafts == BLOCK - 1
    assert cfg.target_layer_ids == LAYER_IDS and cfg.mask_token_id == MASK and cfg.markov_rank == 0
    assert_same_state(sd, written)
    DFlashDrafter(cfg).load_state(sd)


@pytest.mark.parametrize("case,field", [
    ("hidden", "hidden_size"),
    ("vocab", "vocab_size"),
    ("layer_beyond", "target_layer_ids"),
    ("layer_last", "target_layer_ids"),
    ("no_mask", "mask_token_id"),
])
def test_deepspec_config_errors_name_the_field(tmp_path, case, field):
    over = {"hidden": {"hidden_size": 48}, "vocab": {"vocab_size": 60},
            "layer_beyond": {"target_layer_ids": [0, 4]}, "layer_last": {"target_layer_ids": [0, 3]},
            "no_mask": {"mask_token_id": None}}[case]
    write_deepspec(tmp_path / "ds", **over)
    with pytest.raises(CheckpointError, match=field) as e:
        load_dspark_checkpoint(tmp_path / "ds", target_cfg())
    if case == "layer_last":
        assert "last layer" in str(e.value)


def test_speculators_and_zlab_errors_name_the_field(tmp_path):
    write_speculators(tmp_path / "a", draft_vocab=V + 10)
    with pytest.raises(CheckpointError, match="draft_vocab_size"):
        load_dspark_checkpoint(tmp_path / "a", target_cfg())
    write_speculators(tmp_path / "b", tlc_overrides={"hidden_size": 48})
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_dspark_checkpoint(tmp_path / "b", target_cfg())
    write_speculators(tmp_path / "c", aux_hidden_state_layer_ids=[1, 3])
    with pytest.raises(CheckpointError, match="aux_hidden_state_layer_ids"):
        load_dspark_checkpoint(tmp_path / "c", target_cfg())
    write_speculators(tmp_path / "d", with_lm_head=False)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_dspark_checkpoint(tmp_path / "d", target_cfg())
    write_speculators(tmp_path / "e", with_d2t=False, with_t2d=False)
    with pytest.raises(CheckpointError, match="d2t"):
        load_dspark_checkpoint(tmp_path / "e", target_cfg())
    write_zlab(tmp_path / "f", dflash_config={"target_layer_ids": LAYER_IDS})
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_dspark_checkpoint(tmp_path / "f", target_cfg())
    write_zlab(tmp_path / "g")
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_dspark_checkpoint(tmp_path / "g", target_cfg(vocab_size=64))
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="Supported formats"):
        load_dspark_checkpoint(tmp_path / "h", target_cfg())


def test_bad_tensors_are_named(tmp_path):
    write_deepspec(tmp_path / "ds")
    from safetensors.torch import load_file

    f = tmp_path / "ds" / "model.safetensors"
    w = load_file(str(f))
    w["layers.1.self_attn.k_proj.weight"] = torch.zeros(HKV * HD + 1, D)
    save_file(w, str(f))
    with pytest.raises(CheckpointError, match="layers.1.self_attn.k_proj.weight"):
        load_dspark_checkpoint(tmp_path / "ds", target_cfg())
    w.pop("layers.1.self_attn.k_proj.weight")
    w["layers.2.mlp.up_proj.weight"] = torch.zeros(48, D)
    save_file(w, str(f))
    with pytest.raises(CheckpointError, match="layers.2.mlp.up_proj.weight"):
        load_dspark_checkpoint(tmp_path / "ds", target_cfg())


def test_validate_direct():
    small_cfg().validate(target_cfg())
    for kw, field in [(dict(hidden_size=48), "hidden_size"), (dict(vocab_size=60, draft_vocab_size=60), "vocab_size"),
                      (dict(target_layer_ids=[7]), "target_layer_ids"),
                      (dict(target_layer_ids=[3]), "target_layer_ids"),
                      (dict(mask_token_id=None), "mask_token_id"), (dict(draft_vocab_size=V + 1), "draft_vocab_size"),
                      (dict(markov_head_type="lstm"), "markov_head_type"),
                      (dict(markov_rank=0), "confidence_head_with_markov")]:
        with pytest.raises(CheckpointError, match=field):
            small_cfg(**kw).validate(target_cfg())


@pytest.mark.parametrize("kw", [dict(), dict(markov_head_type="gated"), dict(markov_head_type="rnn"),
                                dict(draft_vocab_size=VD), dict(attention_bias=True),
                                dict(markov_rank=0, confidence_head_with_markov=False)])
def test_expected_shapes_match_module(kw):
    cfg = small_cfg(**kw)
    m = DFlashDrafter(cfg)
    assert {k: tuple(v.shape) for k, v in m.state_for_save().items()} == expected_state_shapes(cfg)


# ---- Markov and confidence heads ----------------------------------------------------------------


def randomize(head: MarkovHead, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_markov_bias_matches_formula(head_type):
    head = MarkovHead(V, VD, R, D, head_type)
    randomize(head)
    g = torch.Generator().manual_seed(5)
    K = 5
    ids = torch.randint(0, V, (2, K), generator=g)
    hid = torch.randn(2, K, D, generator=g)
    W1, W2 = head.markov_w1.weight.detach(), head.markov_w2.weight.detach()
    e = W1[ids]  # [2, K, r]
    if head_type == "vanilla":
        want = e @ W2.T
    elif head_type == "gated":
        Wg, bg = head.gate_proj.weight.detach(), head.gate_proj.bias.detach()
        gate = torch.sigmoid(torch.cat([hid, e], -1) @ Wg.T + bg)
        want = (gate * e) @ W2.T
    else:
        Wj, bj = head.joint_proj.weight.detach(), head.joint_proj.bias.detach()
        s = torch.zeros(2, R)
        outs = []
        for k in range(K):
            z = torch.cat([s, e[:, k], hid[:, k]], -1)  # [s_{k-1}; W1[x_{k-1}]; h_k]
            a = z @ Wj.T + bj
            gate, cand, o = a[:, :R], a[:, R:2 * R], a[:, 2 * R:]
            outs.append(torch.tanh(o) @ W2.T)  # B_k from z_k: uses s_{k-1}
            s = torch.sigmoid(gate) * s + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
        want = torch.stack(outs, 1)
    with torch.no_grad():
        got = head.bias(ids, hid)
    assert got.shape == (2, K, VD)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_confidence_head_formula():
    ch = ConfidenceHead(D, R, with_markov=True)
    h, e = torch.randn(3, D), torch.randn(3, R)
    w, b = ch.proj.weight.detach(), ch.proj.bias.detach()
    with torch.no_grad():
        torch.testing.assert_close(ch(h, e), torch.sigmoid(torch.cat([h, e], -1) @ w[0] + b))
    ch2 = ConfidenceHead(D, R, with_markov=False)
    with torch.no_grad():
        torch.testing.assert_close(ch2(h), torch.sigmoid(h @ ch2.proj.weight[0] + ch2.proj.bias))


def test_replicated_markov_head_full_weights_no_collective():
    tp = TPGroup(rank=1, size=2)  # a rank of a 2-way group: any collective would need a process group
    head = MarkovHead(V, VD, R, D, "gated", tp=tp, replicate=True)
    assert not head.sharded and head.markov_w2.tp_size == 1
    assert head.markov_w1.weight.shape == (V, R) and head.markov_w2.weight.shape == (VD, R)
    w1, w2 = torch.randn(V, R), torch.randn(VD, R)
    head.markov_w1.weight.weight_loader(head.markov_w1.weight, w1)
    head.markov_w2.weight.weight_loader(head.markov_w2.weight, w2)
    ids, hid = torch.tensor([[3, 49, 0]]), torch.randn(1, 3, D)
    with torch.no_grad():
        out = head.bias(ids, hid)
        gate = torch.sigmoid(head.gate_proj(torch.cat([hid, w1[ids]], -1)))
        torch.testing.assert_close(out, (gate * w1[ids]) @ w2.T)
    assert tp.num_collectives() == 0
    sharded = MarkovHead(V, VD, R, D, "vanilla", tp=tp, replicate=False)
    assert sharded.sharded and sharded.markov_w2.tp_size == 2
    assert sharded.markov_w1.weight.shape == (V // 2, R) and sharded.markov_w2.weight.shape == (VD // 2, R)
    # the whole drafter under TP keeps its Markov head replicated and drafts without any collective
    m = build(small_cfg(draft_vocab_size=VD), tp=tp)
    assert m.markov_head.markov_w2.tp_size == 1 and m.lm_head.tp_size == 1
    cache = m.new_cache()
    cache.extend(torch.randn(5, len(LAYER_IDS) * D), torch.arange(5))
    emb = torch.randn(V, D)
    blk = m.propose(7, 5, cache, lambda ids: emb[ids], temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert blk.tokens.shape == (BLOCK,) and tp.num_collectives() == 0


# ---- drafting loop --------------------------------------------------------------------------------


def loop_reference(U, hidden, anchor, head, tokens, to_target=None):
    """Corrected logits of every position, conditioned on the given (already drafted) tokens."""
    prev, state, out = torch.tensor([anchor]), None, []
    for k in range(U.shape[0]):
        logits = U[k : k + 1]
        if head is not None:
            b, state, _ = head.step(prev, hidden[k : k + 1], state)
            logits = logits + b
        out.append(logits)
        prev = tokens[k : k + 1]
    return torch.cat(out)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_draft_block_greedy_and_probabilistic(head_type):
    torch.manual_seed(0)
    head = MarkovHead(V, V, R, D, head_type)
    randomize(head, 1)
    Wlm = torch.randn(V, D)
    hidden = torch.randn(BLOCK, D)
    anchor = 17
    U = hidden @ Wlm.T
    base = lambda h: h @ Wlm.T  # noqa: E731
    ch = ConfidenceHead(D, R, with_markov=True)

    # greedy: x_k = argmax(U_k + B_k(x_{k-1})), no probs
    tokens, probs, conf = draft_block(base, hidden, anchor, head, 0.0, confidence_head=ch)
    assert probs is None and tokens.shape == (BLOCK,)
    with torch.no_grad():
        prev, state, want = torch.tensor([anchor]), None, []
        for k in range(BLOCK):
            b, state, _ = head.step(prev, hidden[k : k + 1], state)
            prev = (U[k : k + 1] + b).argmax(-1)
            want.append(prev)
        assert torch.equal(tokens, torch.cat(want))
        # confidences read [h_k; W1[x_{k-1}]] with x_0 = the anchor
        prevs = torch.cat([torch.tensor([anchor]), tokens[:-1]])
        torch.testing.assert_close(conf, ch(hidden, head.markov_w1.weight[prevs]))

    # probabilistic: q_k = softmax(corrected / T) given the sampled predecessor
    T = 0.7
    tokens, probs, _ = draft_block(base, hidden, anchor, head, T, torch.Generator().manual_seed(3))
    with torch.no_grad():
        corrected = loop_reference(U, hidden, anchor, head, tokens)
    torch.testing.assert_close(probs, torch.softmax(corrected / T, -1))
    again, _, _ = draft_block(base, hidden, anchor, head, T, torch.Generator().manual_seed(3))
    assert torch.equal(tokens, again)  # same seed, same drafts (what keeps TP ranks in step)
    # the loop really conditions on the predecessor: some draft distribution differs from the
    # unconditioned one (anchor-conditioned bias everywhere)
    with torch.no_grad():
        flat = torch.softmax((U + head.bias(torch.full((BLOCK,), anchor), hidden)) / T, -1)
    assert not torch.allclose(flat[1:], probs[1:])


@pytest.fixture(params=["ext", "torch", "search"])
def topk_path(request, monkeypatch):
    """Draft trees with their per-depth softmax + top-k in the C++ op (where it builds), in PyTorch, or
    (``search``: a vanilla Markov head packed for it) the whole search in one C++ call."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_ops, "ENABLED", False)
    elif cpu_ops.get() is None:
        pytest.skip("the C++ extension did not build here")
    return request.param


@pytest.mark.parametrize("head_type, pruned", [("vanilla", False), ("vanilla", True), ("gated", True), ("rnn", False),
                                             ("rnn", True)])
def test_draft_trees_branches_follow_their_own_path(head_type, pruned, topk_path, monkeypatch):
    """Every candidate node's children are the top-k of ``U_d + B_d(its own path)`` (for the rnn head,
    the state unrolled along that path), scored by the calibrated confidence (greedy rows) or the
    draft probability at the row's temperature (sampled rows), times the parent's score; each depth
    expands the ``beam`` best nodes of the one before; with a wide enough beam the rank-0 path is the
    greedy chain of ``draft_blocks``."""
    torch.manual_seed(0)
    vd = VD if pruned else V
    t2d = random_t2d(3) if pruned else None
    to_target = torch.nonzero(t2d).flatten() if pruned else torch.arange(V)
    head = MarkovHead(V, vd, R, D, head_type)
    randomize(head, 4)
    ch = ConfidenceHead(D, R, with_markov=True)
    searched = []
    if topk_path == "search":
        head.pack_for_search(to_target if pruned else None)
        assert (head.search_pack is not None) == (head_type == "vanilla")  # gated / rnn: left to the loop
        real = drafting._tree_search
        monkeypatch.setattr(drafting, "_tree_search", lambda *a: searched.append(1) or real(*a))
    Wd = torch.randn(vd, D)
    base = lambda h: h @ Wd.T  # noqa: E731
    hidden = torch.randn(2, BLOCK, D)
    anchors = [int(to_target[3]), 7]
    temps, ctemps, topk, beam = [None, 0.8], [1.5, 0.7, 1.0], 3, 2
    tree = draft_trees(base, hidden, anchors, head, topk=topk, beam=beam, temperatures=temps, confidence_head=ch,
                       confidence_temperatures=ctemps, d2t=t2d)
    C = topk + (BLOCK - 1) * beam * topk
    assert tree.tokens.shape == tree.parents.shape == tree.scores.shape == (2, C)
    assert tree.depth.tolist() == [1] * topk + [d for d in range(2, BLOCK + 1) for _ in range(beam * topk)]
    with torch.no_grad():
        for b in range(2):
            par, tok, sc = tree.parents[b].tolist(), tree.tokens[b].tolist(), tree.scores[b]
            for node in [-1] + list(range(C)):
                kids = [c for c in range(C) if par[c] == node]
                path, n = [], node
                while n >= 0:
                    path.insert(0, tok[n])
                    n = par[n]
                d = len(path)
                if d == BLOCK:
                    assert not kids
                    continue
                depth_nodes = [c for c in range(C) if tree.depth[c] == d]
                if node >= 0 and node not in sorted(depth_nodes, key=lambda c: -float(sc[c]))[:beam]:
                    assert not kids  # only the best `beam` nodes of a depth are expanded
                    continue
                prevs = torch.tensor([anchors[b]] + path)
                logits = hidden[b, d] @ Wd.T + head.bias(prevs, hidden[b, : d + 1])[d]
                t = 1.0 if temps[b] is None else temps[b]
                q = torch.softmax(logits / t, -1)
                want_q, want_i = q.topk(topk)
                assert [tok[c] for c in kids] == to_target[want_i].tolist(), (b, node)
                parent = 1.0 if node < 0 else float(sc[node])
                if temps[b] is None:
                    c = ch(hidden[b, d], head.markov_w1.weight[prevs[-1]])
                    t_d = ctemps[d] if d < len(ctemps) else 1.0
                    c = torch.sigmoid(torch.logit(c) / t_d)
                    want = torch.cat([c.view(1), (1 - c) * want_q[1:] / (1 - want_q[0])])
                else:
                    want = want_q
                torch.testing.assert_close(sc[kids], parent * want, rtol=1e-4, atol=1e-6)
                assert all(float(sc[c]) <= parent + 1e-7 for c in kids)
    # a beam as wide as the tree: the rank-0 path from the root is the greedy chain
    assert len(searched) == (topk_path == "search" and head_type == "vanilla")  # the one call ran where it can
    full = draft_trees(base, hidden, anchors, head, topk=2, beam=2 ** BLOCK, d2t=t2d)
    chain = draft_blocks(base, hidden, anchors, head, d2t=t2d).tokens
    for b in range(2):
        node, path = -1, []
        par, tok = full.parents[b].tolist(), full.tokens[b].tolist()
        for _ in range(BLOCK):
            node = next(c for c in range(len(par)) if par[c] == node)  # the first child: rank 0
            path.append(tok[node])
        assert path == chain[b].tolist()


CHUNKED = (4000, 2600, 32, 5)  # target and draft vocabularies, Markov rank, depths: several of the op's chunks


def chunked_search_heads(seed: int, dtype=torch.float32):
    """A random draft vocabulary of ``CHUNKED``'s sizes (its target ids, the t2d mask), a vanilla Markov head
    and a confidence head reading W1 for the search tests."""
    vt, vd, r, _ = CHUNKED
    torch.manual_seed(seed)
    to_target = torch.randperm(vt)[:vd].sort().values
    t2d = torch.zeros(vt, dtype=torch.bool)
    t2d[to_target] = True
    head = MarkovHead(vt, vd, r, D, "vanilla", dtype=dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return to_target, t2d, head, ConfidenceHead(D, r, with_markov=True, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_tree_search_equals_the_loop_across_chunks(dtype):
    """Over a draft vocabulary of several of the op's chunks (1,024 ids each, the last one short), the
    one-call search builds the loop's tree: the same tokens and parents, the scores to float32 rounding,
    at every beam width, greedy and sampled rows, with and without a confidence head; an exact tie
    across chunks goes to the lower id in both."""
    if cpu_ops.get() is None:
        pytest.skip("the C++ extension did not build here")
    vt, vd, r, g = CHUNKED
    to_target, t2d, head, ch = chunked_search_heads(1, dtype)
    hidden = torch.randn(2, g, D).to(dtype)
    base = torch.randn(2, g, vd)
    base[0, 0, [7, 1500, 2500]] = 9.0  # a three-way tie for the first children of row 0, in three chunks
    with torch.no_grad():
        head.markov_w2.weight[[7, 1500, 2500]] = 0.0  # (no bias to break it)
    trees = []
    for topk, beam, temps, conf in [(4, 4, None, ch), (3, 2, [None, 0.8], ch), (2, 8, [1.3, None], None)]:
        kw = dict(topk=topk, beam=beam, temperatures=temps, confidence_head=conf, confidence_temperatures=[1.2, 0.9],
                  d2t=t2d)
        head.search_pack = None
        loop = draft_trees(lambda h: base, hidden, [11, 3999], head, **kw)
        head.pack_for_search(to_target)
        one = draft_trees(lambda h: base, hidden, [11, 3999], head, **kw)
        assert torch.equal(one.tokens, loop.tokens) and torch.equal(one.parents, loop.parents)
        assert torch.equal(one.depth, loop.depth)
        torch.testing.assert_close(one.scores, loop.scores, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4,
                                   atol=1e-5 if dtype == torch.bfloat16 else 1e-6)  # the loop rounds to bfloat16
        w1d, w2p = head.search_pack
        assert w2p.dim() == (4 if dtype == torch.bfloat16 else 3)  # bfloat16: W2's columns in pairs
        if dtype == torch.bfloat16:  # the op also reads W2 as 16-id blocks of whole columns: the same tree
            cols = w2p.permute(0, 1, 3, 2).reshape(w2p.shape[0], r, 16).contiguous()
            head.search_pack = (w1d, cols)
            by_cols = draft_trees(lambda h: base, hidden, [11, 3999], head, **kw)
            assert torch.equal(by_cols.tokens, one.tokens) and torch.equal(by_cols.parents, one.parents)
            torch.testing.assert_close(by_cols.scores, one.scores, rtol=1e-5, atol=1e-7)
        trees.append(one)
    assert trees[0].tokens[0, :3].tolist() == to_target[[7, 1500, 2500]].tolist()


def test_confidence_search_weights_follow_the_head():
    """``ConfidenceHead.search_weights``: the projection's hidden part, bias and W1 part (zeros without
    ``with_markov``) in float32, made again after the weights change."""
    ch = ConfidenceHead(D, R, with_markov=True, dtype=torch.bfloat16)
    w_h, b, w_e = ch.search_weights(R)
    w = ch.proj.weight.detach().float()[0]
    assert torch.equal(w_h, w[:D]) and torch.equal(w_e, w[D:]) and torch.equal(b, ch.proj.bias.detach().float())
    assert ch.search_weights(R)[0] is w_h  # kept
    with torch.no_grad():
        ch.proj.weight.mul_(2.0)
    assert torch.equal(ch.search_weights(R)[0], 2 * w[:D])
    plain = ConfidenceHead(D)
    w_h, _, w_e = plain.search_weights(R)
    assert torch.equal(w_h, plain.proj.weight.detach()[0]) and torch.equal(w_e, torch.zeros(R))


def unexpanded_below(tree, min_score: float) -> torch.Tensor:
    """[B, C] bool: the nodes of ``tree`` with an ancestor scoring below ``min_score`` (its layout's
    parents come first)."""
    par, sc = tree.parents.tolist(), tree.scores.tolist()
    out = []
    for p_row, s_row in zip(par, sc):
        gone = []
        for c, p in enumerate(p_row):
            gone.append(p >= 0 and (gone[p] or s_row[p] < min_score))
        out.append(gone)
    return torch.tensor(out)


@pytest.mark.parametrize("search", [False, True])
def test_tree_search_expands_only_nodes_above_min_score(search):
    """With ``min_score`` a depth expands only its best nodes that score at least that much: the tree is
    the one without it with every node below such a node emptied (token, parent and score -1, the layout
    kept), in the loop and in the one-call search alike (greedy and sampled rows, several chunks); a
    ``min_score`` above every score leaves only the root's children."""
    if search and cpu_ops.get() is None:
        pytest.skip("the C++ extension did not build here")
    vt, vd, r, g = CHUNKED
    to_target, t2d, head, ch = chunked_search_heads(2)
    hidden, base = torch.randn(2, g, D), torch.randn(2, g, vd) * 3
    if search:
        head.pack_for_search(to_target)
    kw = dict(topk=3, beam=3, temperatures=[None, 0.8], confidence_head=ch, confidence_temperatures=[1.2, 0.9],
              d2t=t2d)
    full = draft_trees(lambda h: base, hidden, [11, 3999], head, **kw)
    parents = full.parents[full.parents >= 0].unique()
    scores = sorted(full.scores[:, parents].flatten().tolist())  # of the expanded nodes (either row's)
    for min_score in (scores[len(scores) // 4], scores[len(scores) // 2]):
        tree = draft_trees(lambda h: base, hidden, [11, 3999], head, min_score=min_score, **kw)
        gone = unexpanded_below(full, min_score)
        assert 0 < int(gone.sum()) < gone.numel() and torch.equal(tree.depth, full.depth)
        for got, want, empty in ((tree.tokens, full.tokens, -1), (tree.parents, full.parents, -1),
                                 (tree.scores, full.scores, -1.0)):
            assert torch.equal(got, torch.where(gone, torch.full_like(want, empty), want))
    top = draft_trees(lambda h: base, hidden, [11, 3999], head, min_score=1.5, **kw)
    first = full.depth == 1
    assert torch.equal(top.tokens[:, first], full.tokens[:, first]) and bool((top.scores[:, ~first] == -1).all())
    with pytest.raises(ValueError, match="min_score"):
        draft_trees(lambda h: base, hidden, [11, 3999], head, min_score=-0.1, **kw)


def test_rank0_is_pure_dflash():
    cfg = small_cfg(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    m = build(cfg)
    assert m.markov_head is None and m.confidence_head is None
    Wlm = torch.randn(V, D)
    hidden = torch.randn(BLOCK, D)
    tokens, probs, conf = draft_block(lambda h: h @ Wlm.T, hidden, 5, None, 0.0)
    assert torch.equal(tokens, (hidden @ Wlm.T).argmax(-1)) and probs is None and conf is None
    tokens, probs, _ = draft_block(lambda h: h @ Wlm.T, hidden, 5, None, 1.3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(probs, torch.softmax(hidden @ Wlm.T / 1.3, -1))


def test_draft_block_pruned_vocab_maps_to_target_ids():
    t2d = random_t2d(7)
    d2t = d2t_from_t2d(t2d)
    to_target = torch.arange(VD) + d2t
    assert torch.equal(to_target, torch.nonzero(t2d).flatten())
    head = MarkovHead(V, VD, R, D, "vanilla")
    randomize(head, 2)
    Wd = torch.randn(VD, D)
    hidden = torch.randn(BLOCK, D)
    anchor = int(torch.nonzero(~t2d)[0])  # an anchor outside the draft vocabulary: W1 is target-vocab
    T = 1.0
    tokens, probs, _ = draft_block(lambda h: h @ Wd.T, hidden, anchor, head, T, torch.Generator().manual_seed(1),
                                   d2t, target_vocab_size=V)
    assert bool(t2d[tokens].all())  # target ids, all inside the draft vocabulary
    assert probs.shape == (BLOCK, V) and torch.all(probs[:, ~t2d] == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(BLOCK))
    with torch.no_grad():
        # the next lookup uses the TARGET id of the previous draft
        corrected = loop_reference(hidden @ Wd.T, hidden, anchor, head, tokens)
    torch.testing.assert_close(probs[:, to_target], torch.softmax(corrected / T, -1))
    # a t2d mask is accepted in place of d2t
    t_tokens, t_probs, _ = draft_block(lambda h: h @ Wd.T, hidden, anchor, head, T, torch.Generator().manual_seed(1),
                                       t2d)
    assert torch.equal(t_tokens, tokens) and torch.equal(t_probs, probs)
    g_tokens, _, _ = draft_block(lambda h: h @ Wd.T, hidden, anchor, head, 0.0, None, d2t)
    with torch.no_grad():
        corrected = loop_reference(hidden @ Wd.T, hidden, anchor, head, g_tokens)
    assert torch.equal(g_tokens, to_target[corrected.argmax(-1)])


# ---- backbone -------------------------------------------------------------------------------------


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos):
    """x [n, heads, D] rotated at positions [n] (rotate-half layout)."""
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2).float() / HD)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., HD // 2:], x[..., : HD // 2]], -1)
    return x * cos + rot * sin


def direct_block(sd, cfg, feats, ctx_pos, x, start):
    """The block forward written out: context and block K/V concatenated in one go, full attention."""
    B = x.shape[0]
    hctx = _rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    bpos = torch.arange(start, start + B)
    h = x
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        xn = _rms(h, sd[p + "input_layernorm.weight"])
        q = _rope(_rms((xn @ sd[p + "self_attn.q_proj.weight"].T).view(B, H, HD), sd[p + "self_attn.q_norm.weight"]),
                  bpos)
        src = torch.cat([hctx, xn])
        allpos = torch.cat([ctx_pos, bpos])
        k = _rope(_rms((src @ sd[p + "self_attn.k_proj.weight"].T).view(-1, HKV, HD),
                       sd[p + "self_attn.k_norm.weight"]),
                  allpos)
        v = (src @ sd[p + "self_attn.v_proj.weight"].T).view(-1, HKV, HD)
        k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(B, H * HD)
        h = h + o @ sd[p + "self_attn.o_proj.weight"].T
        y = _rms(h, sd[p + "post_attention_layernorm.weight"])
        h = h + (F.silu(y @ sd[p + "mlp.gate_proj.weight"].T) * (y @ sd[p + "mlp.up_proj.weight"].T)) @ \
            sd[p + "mlp.down_proj.weight"].T
    return _rms(h, sd["norm.weight"])


@pytest.mark.parametrize("fused", [False, True])
def test_block_forward_cache_equals_direct_and_is_non_causal(fused):
    """The block forward over the cached context equals the direct formula, also with the projections
    fused for inference (``fuse_projections``: q/k/v, gate/up and every layer's context K/V in one GEMM
    each), which the drafting worker does."""
    cfg = small_cfg()
    sd = random_state(cfg, 11)
    m = DFlashDrafter(cfg)
    m.load_state(sd)
    if fused:
        m.fuse_projections()
        assert all(layer.self_attn.q_proj is None and layer.mlp.gate_proj is None for layer in m.layers)
        with pytest.raises(RuntimeError, match="fused"):
            m.state_for_save()
    g = torch.Generator().manual_seed(12)
    n_ctx = 7
    feats = torch.randn(n_ctx, len(LAYER_IDS) * D, generator=g)
    x = torch.randn(BLOCK, D, generator=g)
    cache = m.new_cache(capacity=2)  # forces growth
    cache.extend(feats[:3], torch.arange(3))  # features arrive in pieces, as tokens get committed
    cache.extend(feats[3:], torch.arange(3, n_ctx))
    spans = m.new_cache()  # consecutive positions given as ranges (the drafting worker's): the same entries
    spans.extend(feats[:3], range(3))
    spans.extend(feats[3:], range(3, n_ctx))
    assert torch.equal(spans.kv[..., :n_ctx, :], cache.kv[..., :n_ctx, :]) and torch.equal(spans.positions,
                                                                                         cache.positions)
    out = m.forward_block_embeds(x, n_ctx, cache)
    want = direct_block(sd, cfg, feats, torch.arange(n_ctx), x, n_ctx)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)

    # non-causal inside the block: a later slot's input changes an earlier slot's output
    x2 = x.clone()
    x2[BLOCK - 1] += 1.0
    out2 = m.forward_block_embeds(x2, n_ctx, cache)
    assert not torch.allclose(out2[0], out[0], atol=1e-4)
    # the context is seen through the cache
    other = m.new_cache()
    other.extend(feats.flip(0), torch.arange(n_ctx))
    assert not torch.allclose(m.forward_block_embeds(x, n_ctx, other)[0], out[0], atol=1e-4)

    # entries at or after the anchor position are invisible; crop rolls the context back
    cache.extend(torch.randn(2, len(LAYER_IDS) * D, generator=g), torch.arange(n_ctx, n_ctx + 2))
    torch.testing.assert_close(m.forward_block_embeds(x, n_ctx, cache), out)
    cache.crop(n_ctx)
    assert len(cache) == n_ctx
    torch.testing.assert_close(m.forward_block_embeds(x, n_ctx, cache), out)
    with pytest.raises(ValueError):
        cache.crop(n_ctx + 1)


def test_block_forward_in_layer_calls_equals_op_by_op(monkeypatch):
    """A quantized bfloat16 drafter (what the drafting worker runs beside a GGUF target) computes each
    layer of a one-sequence block forward in one C++ ``decoder_layer`` call: the block's keys and values
    written past the cache's end, never kept. Its hidden states are the layers' op by op up to the
    attention's float rounding, also with context entries hidden (at or after the anchor), while the
    cache grows, and after the scratch entries were written (the kept ones unchanged)."""
    from specserve.spec_decode.dspark.proposer import quantize_drafter

    ops = cpu_ops.get()
    if ops is None or not ops.group_gemm_available():
        pytest.skip("the C++ group kernel did not build here")
    d = 64  # inputs of more than one group of 32 (one group would be quantized per channel: not the kernel's)
    cfg = small_cfg(hidden_size=d, head_dim=16, intermediate_size=128)
    m = DFlashDrafter(cfg, dtype=torch.bfloat16)
    m.load_state({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in random_state(cfg, 5).items()})
    m.fuse_projections()
    quantize_drafter(m, "int8")
    assert m._layer_calls(ops) is not None
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(12, len(LAYER_IDS) * d, generator=g).to(torch.bfloat16)
    x = torch.randn(BLOCK, d, generator=g).to(torch.bfloat16)
    cache = m.new_cache(capacity=2)
    ran = []
    real = m._forward_in_layer_calls

    def spy(*a):
        out = real(*a)
        ran.append(out is not None)
        return out

    def op_by_op():
        with monkeypatch.context() as mp:
            mp.setattr(m, "_layer_calls", lambda ops: None)
            return m.forward_block_embeds(x, 9, cache)

    monkeypatch.setattr(m, "_forward_in_layer_calls", spy)
    for n in (3, 9, 12):  # the context grows; at 12 entries the last three are at or after the anchor (hidden)
        cache.extend(feats[len(cache) : n], torch.arange(len(cache), n))
        kept = cache.kv[..., :n, :].clone()
        one = m.forward_block_embeds(x, 9, cache)
        assert torch.equal(cache.kv[..., :n, :], kept) and len(cache) == n
        assert cache.capacity >= n + BLOCK
        want = op_by_op()
        assert one.shape == want.shape == (BLOCK, d) and one.dtype == torch.bfloat16
        torch.testing.assert_close(one.float(), want.float(), rtol=0.05, atol=0.05)
        assert (one.float() - want.float()).abs().mean() < 0.01
        assert torch.equal(m.forward_block_embeds(x, 9, cache), one)
    assert ran == [True, False, True] * 3  # each one-call forward and its repeat; op by op between
    hidden_ctx = cache.kv[..., 9:12, :].clone()
    cache.kv[..., 9:12, :] = 0  # hidden entries: not read
    assert torch.equal(m.forward_block_embeds(x, 9, cache), one)
    cache.kv[..., 9:12, :] = hidden_ctx
    cache.kv[..., 0, :] = 0  # a visible entry: read
    assert not torch.equal(m.forward_block_embeds(x, 9, cache), one)


@pytest.mark.parametrize("attention_bias, packed", [(False, True), (True, False), (True, True)])
def test_fused_projections_draft_as_unfused(attention_bias, packed):
    """What the drafting worker runs (``fuse_projections``, then oneDNN packing on a CPU) drafts what the
    drafter as loaded drafts: the same block hidden states (within float rounding), tokens and
    confidences, with and without attention biases (which the fused GEMMs must carry)."""
    from specserve.layers.linear import mkldnn_packing_available
    from specserve.layers.packing import pack_linears

    if packed and not mkldnn_packing_available(torch.float32):
        pytest.skip("no oneDNN weight packing here")
    cfg = small_cfg(attention_bias=attention_bias)
    sd = random_state(cfg, 31)
    plain, fused = DFlashDrafter(cfg), DFlashDrafter(cfg)
    plain.load_state(sd)
    fused.load_state(sd)
    fused.fuse_projections()
    if packed:
        pack_linears(fused)
    g = torch.Generator().manual_seed(32)
    feats = torch.randn(9, len(LAYER_IDS) * D, generator=g)
    caches = []
    for m in (plain, fused):
        c = m.new_cache(capacity=2)
        c.extend(feats[:4], torch.arange(4))
        c.extend(feats[4:], torch.arange(4, 9))
        caches.append(c)
    torch.testing.assert_close(caches[1].k[:, :, :9], caches[0].k[:, :, :9], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].v[:, :, :9], caches[0].v[:, :, :9], rtol=1e-5, atol=1e-5)
    emb, Wt = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    x = emb[torch.tensor([5] + [MASK] * (BLOCK - 1))]
    torch.testing.assert_close(fused.forward_block_embeds(x, 9, caches[1]), plain.forward_block_embeds(x, 9, caches[0]),
                               rtol=1e-5, atol=1e-5)
    a = plain.propose(5, 9, caches[0], lambda i: emb[i], lambda h: h @ Wt.T)
    b = fused.propose(5, 9, caches[1], lambda i: emb[i], lambda h: h @ Wt.T)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(b.confidences, a.confidences, rtol=1e-5, atol=1e-5)


def test_forward_block_uses_target_embedding_and_layouts():
    for anchor_first in (True, False):
        cfg = small_cfg(sample_from_anchor=anchor_first)
        m = build(cfg, 13)
        emb = torch.randn(V, D)
        cache = m.new_cache()
        cache.extend(torch.randn(4, len(LAYER_IDS) * D), torch.arange(4))
        hb = m.forward_block(9, 4, cache, lambda ids: emb[ids])
        ids = torch.tensor([9] + [MASK] * (BLOCK - 1))
        torch.testing.assert_close(hb, m.forward_block_embeds(emb[ids], 4, cache))
        drafts = m.draft_hidden(hb)
        assert drafts.shape == (cfg.num_drafts, D)
        assert torch.equal(drafts[-1], hb[-1]) and (anchor_first or torch.equal(drafts[0], hb[1]))
        # a full-vocabulary drafter takes the target's lm_head at call time
        Wt = torch.randn(V, D)
        blk = m.propose(9, 4, cache, lambda i: emb[i], lambda h: h @ Wt.T)
        assert blk.tokens.shape == (cfg.num_drafts,) and blk.confidences.shape == (cfg.num_drafts,)
        with pytest.raises(ValueError):
            m.propose(9, 4, cache, lambda i: emb[i])


def test_loaded_checkpoint_drafts_end_to_end(tmp_path):
    write_speculators(tmp_path / "sp")
    cfg, sd = load_dspark_checkpoint(tmp_path / "sp", target_cfg())
    m = DFlashDrafter(cfg)
    m.load_state(sd)
    cache = m.new_cache()
    cache.extend(torch.randn(6, len(LAYER_IDS) * D), torch.arange(6))
    emb = torch.randn(V, D)
    blk = m.propose(3, 6, cache, lambda i: emb[i], temperature=0.8, generator=torch.Generator().manual_seed(0))
    t2d = random_t2d(3)
    assert blk.tokens.shape == (BLOCK,) and bool(t2d[blk.tokens].all())
    assert blk.probs.shape == (BLOCK, V) and torch.all(blk.probs[:, ~t2d] == 0)
    assert blk.confidences.shape == (BLOCK,) and bool(((blk.confidences > 0) & (blk.confidences < 1)).all())


@pytest.mark.parametrize("pruned", [False, True])
def test_batched_drafting_equals_one_sequence_at_a_time(pruned):
    """``propose_batch`` (padded contexts of different lengths, one forward, the Markov loop over the
    batch, one generator per row, greedy and sampled rows mixed) gives each row exactly what
    ``propose`` gives that sequence alone."""
    cfg = small_cfg(draft_vocab_size=VD if pruned else V)
    m = DFlashDrafter(cfg)
    m.load_state(random_state(cfg, 21))
    g = torch.Generator().manual_seed(22)
    emb = torch.randn(V, D, generator=g)
    Wt = torch.randn(V, D, generator=g)
    lens, anchors = [3, 9, 6], [4, 17, 30]
    caches = []
    for n in lens:
        c = m.new_cache()
        c.extend(torch.randn(n, len(LAYER_IDS) * D, generator=g), torch.arange(n))
        caches.append(c)
    caches[2].extend(torch.randn(2, len(LAYER_IDS) * D, generator=g), torch.arange(6, 8))  # beyond its anchor
    starts = [3, 9, 6]
    temps = [None, 0.8, 1.3]
    embed_fn, logits_fn = (lambda i: emb[i]), (lambda h: h @ Wt.T)
    blk = m.propose_batch(anchors, starts, caches, embed_fn, logits_fn, temps,
                          [None, torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)])
    assert blk.tokens.shape == (3, cfg.num_drafts) and blk.probs.shape == (3, cfg.num_drafts, V)
    for r in range(3):
        one = m.propose(anchors[r], starts[r], caches[r], embed_fn, logits_fn, temperature=temps[r] or 0.0,
                        generator=torch.Generator().manual_seed(4 + r))
        assert torch.equal(blk.tokens[r], one.tokens), r
        torch.testing.assert_close(blk.confidences[r], one.confidences, rtol=1e-5, atol=1e-6)
        if temps[r] is None:
            assert one.probs is None and not blk.probs[r].any()
        else:
            torch.testing.assert_close(blk.probs[r], one.probs, rtol=1e-5, atol=1e-7)
    # the batch really differs per row (contexts and anchors are not mixed up)
    assert not torch.equal(blk.tokens[0], blk.tokens[1])


def test_anchored_blocks_forward_equals_cached_block_forward():
    """The training-shaped forward (several blocks per sequence, each seeing its sequence's context before
    its own anchor, padded sequences) gives every block what ``forward_blocks`` gives it over a
    ``DraftCache`` holding that context, and it is differentiable."""
    cfg = small_cfg()
    m = build(cfg, 31).requires_grad_(True)
    g = torch.Generator().manual_seed(32)
    lens, anchors = [11, 6], torch.tensor([[2, 5, 9], [4, 1, 0]])
    feats = torch.zeros(2, max(lens), len(LAYER_IDS) * D)
    for r, n in enumerate(lens):
        feats[r, :n] = torch.randn(n, len(LAYER_IDS) * D, generator=g)
    x = torch.randn(2, 3, BLOCK, D, generator=g)
    out = m.forward_anchored_blocks(x, anchors, feats)
    assert out.shape == (2, 3, BLOCK, D)
    for r, n in enumerate(lens):
        for b, a in enumerate(anchors[r].tolist()):
            cache = m.new_cache()
            cache.extend(feats[r, :n], torch.arange(n))  # the entries at or after the anchor stay invisible
            with torch.no_grad():
                ref = m.forward_blocks(x[r, b : b + 1], [a], [cache])[0]
            torch.testing.assert_close(out[r, b].detach(), ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert m.fc.weight.grad is not None and m.layers[0].self_attn.k_proj.weight.grad is not None
