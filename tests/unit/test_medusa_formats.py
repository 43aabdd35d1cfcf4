"""Medusa checkpoint formats: tiny synthetic checkpoints of every supported layout are loaded with
``load_medusa_checkpoint`` and the heads' logits are compared with a formula computed here from the
raw tensors (``x + silu(W x + b)`` per block, then the head's own or the target's vocab projection)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specserve.layers.embed_head import ParallelLMHead
from specserve.models.loader import CheckpointError
from specserve.spec_decode.medusa.formats import load_medusa_checkpoint
from specserve.spec_decode.medusa.model import MedusaConfig, MedusaHeads

D, V, K = 16, 37, 3


def make_raw(k=K, layers=1, bias=True, own_head=True, seed=0, d=D, v=V):
    g = torch.Generator().manual_seed(seed)
    heads = []
    for _ in range(k):
        blocks = [(torch.randn(d, d, generator=g) * 0.3, torch.randn(d, generator=g) * 0.3 if bias else None)
                  for _ in range(layers)]
        lm = torch.randn(v, d, generator=g) if own_head else None
        heads.append((blocks, lm))
    return heads


def target_weight():
    return torch.randn(V, D, generator=torch.Generator().manual_seed(123))


def reference(hidden, raw, target_w):
    outs = []
    for blocks, lm in raw:
        x = hidden
        for w, b in blocks:
            x = x + F.silu(x @ w.T + (b if b is not None else 0))
        outs.append(x @ (lm if lm is not None else target_w).T)
    return torch.stack(outs, 1)


def check(path, raw, **kw):
    cfg, sd = load_medusa_checkpoint(path, D, V)
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert cfg.num_heads == len(raw) and cfg.num_layers == len(raw[0][0])
    assert cfg.shared_lm_head == (raw[0][1] is None)
    heads = MedusaHeads(cfg)
    heads.load_state(sd)
    tw = target_weight()
    target = ParallelLMHead(V, D)
    target.weight.data.copy_(tw)
    hidden = torch.randn(5, D, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = heads.logits(hidden, target)
    torch.testing.assert_close(got, reference(hidden, raw, tw), rtol=1e-5, atol=1e-5)
    return cfg


def write_json(path, obj):
    path.write_text(json.dumps(obj))


# ---- layouts ------------------------------------------------------------------------------------


def ours_state(raw):
    sd = {}
    for h, (blocks, lm) in enumerate(raw):
        for l, (w, b) in enumerate(blocks):
            sd[f"blocks.{h}.{l}.weight"] = w
            if b is not None:
                sd[f"blocks.{h}.{l}.bias"] = b
        if lm is not None:
            sd[f"lm_heads.{h}.weight"] = lm
    return sd


def write_ours(tmp_path, raw, **over):
    cfg = {"format": "specserve-medusa", "num_heads": len(raw), "num_layers": len(raw[0][0]), "hidden_size": D,
           "vocab_size": V, "shared_lm_head": raw[0][1] is None, "bias": raw[0][0][0][1] is not None,
           "base_model": "tiny", **over}
    write_json(tmp_path / "config.json", cfg)
    save_file(ours_state(raw), str(tmp_path / "medusa.safetensors"))
    return tmp_path


def fd_state(raw, prefix=""):
    sd = {}
    for h, (blocks, lm) in enumerate(raw):
        for l, (w, b) in enumerate(blocks):
            sd[f"{prefix}{h}.{l}.linear.weight"] = w
            if b is not None:
                sd[f"{prefix}{h}.{l}.linear.bias"] = b
        if lm is not None:
            sd[f"{prefix}{h}.{len(blocks)}.weight"] = lm
    return sd


def write_fd(tmp_path, raw, kind="safetensors", config=None):
    cfg = {"medusa_num_heads": len(raw), "medusa_num_layers": len(raw[0][0]),
           "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    write_json(tmp_path / "config.json", cfg if config is None else config)
    sd = fd_state(raw)
    f = tmp_path / f"medusa_lm_head.{kind}"
    if kind == "safetensors":
        save_file(sd, str(f))
    else:
        torch.save(sd, str(f))
    return f


def vllm_state(raw, prefix="", target_copy=None):
    sd = {}
    for h, (blocks, lm) in enumerate(raw):
        for l, (w, b) in enumerate(blocks):
            sd[f"{prefix}blocks.{h}.layers.{l}.weight"] = w
            if b is not None:
                sd[f"{prefix}blocks.{h}.layers.{l}.bias"] = b
        if lm is not None:
            sd[f"{prefix}lm_heads.{h}.weight"] = lm
    if target_copy is not None:
        sd[f"{prefix}lm_heads.0.weight"] = target_copy
    return sd


def vllm_config(raw, **over):
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": D, "vocab_size": V,
            "medusa_num_heads": len(raw), "num_hidden_layers": len(raw[0][0]),
            "medusa_fc_bias": raw[0][0][0][1] is not None, **over}


# ---- ours ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("own_head", [True, False])
def test_ours(tmp_path, own_head):
    raw = make_raw(layers=2, own_head=own_head)
    cfg = check(write_ours(tmp_path, raw), raw)
    assert cfg.base_model == "tiny"


def test_ours_roundtrip_through_save(tmp_path):
    raw = make_raw(layers=1, own_head=True)
    (tmp_path / "a").mkdir()
    cfg, sd = load_medusa_checkpoint(write_ours(tmp_path / "a", raw), D, V)
    heads = MedusaHeads(cfg)
    heads.load_state(sd)
    heads.save(tmp_path / "b", dtype=torch.float32)
    check(tmp_path / "b", raw)


def test_ours_config_disagreeing_with_weights_is_an_error(tmp_path):
    raw = make_raw(layers=1)
    with pytest.raises(CheckpointError, match="config says 4 but the weights hold 3 heads"):
        load_medusa_checkpoint(write_ours(tmp_path, raw, num_heads=4), D, V)


def test_ours_token_input(tmp_path):
    """Heads whose first blocks read the root token's embedding: ``token_weight`` per head, declared by
    ``token_input``; loaded back, saved again, the same tensors. Either half without the other, a missing
    head or a wrong shape is an error naming it."""
    from safetensors.torch import load_file

    cfg = MedusaConfig(num_heads=K, num_layers=2, hidden_size=D, vocab_size=V, shared_lm_head=True,
                       token_input=True)
    heads = MedusaHeads(cfg)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn_like(p))
    heads.save(tmp_path / "a", dtype=torch.float32)
    got, sd = load_medusa_checkpoint(tmp_path / "a", D, V)
    assert got.token_input and got.num_layers == 2
    assert {k for k in sd if "token_weight" in k} == {f"blocks.{h}.0.token_weight" for h in range(K)}
    for k, v in heads.state_for_save().items():
        assert torch.equal(sd[k], v)

    def variant(name, config_over=None, drop=(), change=None):
        d = tmp_path / name
        d.mkdir()
        tensors = {k: v for k, v in load_file(str(tmp_path / "a" / "medusa.safetensors")).items() if k not in drop}
        tensors.update(change or {})
        save_file(tensors, str(d / "medusa.safetensors"))
        conf = json.loads((tmp_path / "a" / "config.json").read_text())
        write_json(d / "config.json", {**conf, **(config_over or {})})
        return d

    with pytest.raises(CheckpointError, match="does not say token_input"):
        load_medusa_checkpoint(variant("undeclared", {"token_input": False}), D, V)
    with pytest.raises(CheckpointError, match="lack blocks.1.0.token_weight"):
        load_medusa_checkpoint(variant("missing", drop=("blocks.1.0.token_weight",)), D, V)
    with pytest.raises(CheckpointError, match="blocks.0.0.token_weight.*expected"):
        load_medusa_checkpoint(variant("shape", change={"blocks.0.0.token_weight": torch.zeros(D, D + 1)}), D, V)
    with pytest.raises(CheckpointError, match="unexpected tensor 'blocks.3.0.token_weight'"):
        load_medusa_checkpoint(variant("extra", change={"blocks.3.0.token_weight": torch.zeros(D, D)}), D, V)
    plain = variant("plain", {"token_input": False}, drop=tuple(f"blocks.{h}.0.token_weight" for h in range(K)))
    assert not load_medusa_checkpoint(plain, D, V)[0].token_input


# ---- FasterDecoding -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_faster_decoding(tmp_path, kind):
    raw = make_raw(layers=1)
    write_fd(tmp_path, raw, kind)
    cfg = check(tmp_path, raw)
    assert cfg.bias and not cfg.shared_lm_head and cfg.base_model == "lmsys/vicuna-7b-v1.3"


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_faster_decoding_single_file_two_layers(tmp_path, kind):
    raw = make_raw(layers=2, seed=3)
    f = write_fd(tmp_path, raw, kind)
    check(f, raw)


def test_faster_decoding_wrong_head_count_warns(tmp_path):
    raw = make_raw(layers=1)
    # the published v0.1 configs say 2 heads for checkpoints holding more
    write_fd(tmp_path, raw, "pt", config={"medusa_num_heads": 2, "medusa_num_layers": 1,
                                          "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"})
    with pytest.warns(UserWarning, match="config says 2 but the weights hold 3 heads"):
        cfg = check(tmp_path, raw)
    assert cfg.num_heads == 3


def test_faster_decoding_v2_shared(tmp_path):
    raw = make_raw(layers=1, own_head=False)
    write_fd(tmp_path, raw, config={"medusa_num_heads": 3, "medusa_num_layers": 1, "version": "2",
                                    "base_model_name_or_path": "x"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = check(tmp_path, raw)
    assert cfg.shared_lm_head


def test_faster_decoding_partial_lm_heads_is_an_error(tmp_path):
    raw = make_raw(layers=1)
    sd = fd_state(raw)
    del sd["1.1.weight"]
    write_json(tmp_path / "config.json", {"medusa_num_heads": 3, "medusa_num_layers": 1})
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match=r"heads \[1\] have no vocab projection"):
        load_medusa_checkpoint(tmp_path, D, V)


# ---- vLLM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("prefix", ["", "medusa_heads."])
def test_vllm(tmp_path, bias, prefix):
    raw = make_raw(layers=2, bias=bias, seed=5)
    write_json(tmp_path / "config.json", vllm_config(raw))
    save_file(vllm_state(raw, prefix), str(tmp_path / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = check(tmp_path, raw)
    assert cfg.bias == bias


def test_vllm_pytorch_bin(tmp_path):
    raw = make_raw(layers=1, bias=False, seed=6)
    write_json(tmp_path / "config.json", vllm_config(raw))
    torch.save(vllm_state(raw), str(tmp_path / "pytorch_model.bin"))
    check(tmp_path, raw)


def test_vllm_original_lm_head(tmp_path):
    raw = make_raw(layers=1, bias=False, own_head=False, seed=8)
    write_json(tmp_path / "config.json", vllm_config(raw, original_lm_head=True))
    # lm_heads.0.weight is vLLM's copy of the target lm_head: ignored (a different tensor proves it)
    save_file(vllm_state(raw, target_copy=torch.randn(V, D)), str(tmp_path / "model.safetensors"))
    cfg = check(tmp_path, raw)
    assert cfg.shared_lm_head


def test_vllm_truncated_vocab_token_map(tmp_path):
    """vLLM's truncated vocabulary: own heads of truncated_vocab_size rows + token_map (their target ids)."""
    NT = 20
    raw = make_raw(layers=1, bias=False, v=NT)
    tmap = torch.randperm(V, generator=torch.Generator().manual_seed(4))[:NT]
    write_json(tmp_path / "config.json", vllm_config(raw, truncated_vocab_size=NT))
    save_file({**vllm_state(raw), "token_map": tmap}, str(tmp_path / "model.safetensors"))
    cfg, sd = load_medusa_checkpoint(tmp_path, D, V)
    assert cfg.draft_vocab_size == NT and cfg.head_vocab_size == NT and torch.equal(sd["token_map"], tmap)
    heads = MedusaHeads(cfg)
    heads.load_state(sd)
    hidden = torch.randn(5, D, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = heads.logits(hidden)
    torch.testing.assert_close(got, reference(hidden, raw, None), rtol=1e-5, atol=1e-5)
    assert torch.equal(heads.to_target(got.argmax(-1)), tmap[got.argmax(-1)])
    # our format round-trips it
    heads.save(tmp_path / "ours", dtype=torch.float32)
    cfg2, sd2 = load_medusa_checkpoint(tmp_path / "ours", D, V)
    assert cfg2 == cfg and torch.equal(sd2["token_map"], tmap)
    # errors: a truncated config without a token_map; a token_map that disagrees with the heads
    save_file(vllm_state(raw), str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="truncated_vocab_size 20 < vocab_size .* no token_map"):
        load_medusa_checkpoint(tmp_path, D, V)
    write_json(tmp_path / "config.json", vllm_config(raw))
    save_file({**vllm_state(raw), "token_map": tmap[:10]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="20 vocab rows, the token_map lists 10 tokens"):
        load_medusa_checkpoint(tmp_path, D, V)
    for bad, msg in ((torch.tensor([0] * NT), "twice"), (torch.arange(NT) + V, r"\[0, "),
                     (torch.arange(NT).float(), "integer")):
        save_file({**vllm_state(raw), "token_map": bad}, str(tmp_path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=msg):
            load_medusa_checkpoint(tmp_path, D, V)


def test_vllm_bias_in_weights_but_not_config_warns(tmp_path):
    raw = make_raw(layers=1, bias=True)
    write_json(tmp_path / "config.json", vllm_config(raw, medusa_fc_bias=False))
    save_file(vllm_state(raw), str(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning, match="bias"):
        cfg = check(tmp_path, raw)
    assert cfg.bias


# ---- Medusa-2 full model --------------------------------------------------------------------------


def test_medusa2_sharded_full_checkpoint(tmp_path):
    raw = make_raw(layers=1, seed=9)
    heads = fd_state(raw, prefix="medusa_head.")
    base = {"model.embed_tokens.weight": torch.randn(V, D), "model.norm.weight": torch.ones(D),
            "lm_head.weight": torch.randn(V, D)}
    names = sorted(heads)
    shard1 = {**{k: base[k] for k in ("model.embed_tokens.weight",)}, **{k: heads[k] for k in names[:3]}}
    shard2 = {**{k: base[k] for k in ("model.norm.weight", "lm_head.weight")}, **{k: heads[k] for k in names[3:]}}
    files = {"model-00001-of-00002.safetensors": shard1, "model-00002-of-00002.safetensors": shard2}
    for fname, sd in files.items():
        save_file(sd, str(tmp_path / fname))
    write_json(tmp_path / "model.safetensors.index.json",
               {"metadata": {}, "weight_map": {k: f for f, sd in files.items() for k in sd}})
    write_json(tmp_path / "config.json", {"architectures": ["MedusaModelLlama"], "model_type": "llama",
                                          "hidden_size": D, "vocab_size": V, "medusa_num_heads": 3,
                                          "medusa_num_layers": 1})
    cfg = check(tmp_path, raw)
    assert not cfg.shared_lm_head and cfg.base_model == str(tmp_path)


def test_medusa2_single_file_shared(tmp_path):
    raw = make_raw(layers=2, own_head=False, seed=10)
    sd = {**fd_state(raw, prefix="medusa_head."), "model.norm.weight": torch.ones(D)}
    save_file(sd, str(tmp_path / "model.safetensors"))
    write_json(tmp_path / "config.json", {"model_type": "llama", "hidden_size": D, "vocab_size": V})
    check(tmp_path, raw)


# ---- errors -------------------------------------------------------------------------------------


def test_wrong_hidden_size(tmp_path):
    raw = make_raw(layers=1)
    write_fd(tmp_path, raw)
    with pytest.raises(CheckpointError, match="Medusa heads have hidden size 16, the target model has 24"):
        load_medusa_checkpoint(tmp_path, 24, V)


def test_wrong_vocab(tmp_path):
    raw = make_raw(layers=1)
    write_fd(tmp_path, raw)
    with pytest.raises(CheckpointError, match="Medusa heads have vocab size 37, the target model has 40"):
        load_medusa_checkpoint(tmp_path, D, 40)


def test_ours_wrong_hidden_size(tmp_path):
    raw = make_raw(layers=1, own_head=False)
    with pytest.raises(CheckpointError, match="hidden size 16, the target model has 32"):
        load_medusa_checkpoint(write_ours(tmp_path, raw), 32, V)


def test_wrong_tensor_shape(tmp_path):
    raw = make_raw(layers=1)
    sd = fd_state(raw)
    sd["1.0.linear.weight"] = torch.randn(D, 12)
    write_json(tmp_path / "config.json", {"medusa_num_heads": 3, "medusa_num_layers": 1})
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match=r"'1\.0\.linear\.weight' has shape \(16, 12\), expected \(16, 16\)"):
        load_medusa_checkpoint(tmp_path, D, V)


def test_unknown_format(tmp_path):
    write_json(tmp_path / "config.json", {"model_type": "llama", "hidden_size": D})
    save_file({"model.norm.weight": torch.ones(D)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="Supported formats: specserve-medusa") as e:
        load_medusa_checkpoint(tmp_path, D, V)
    for fmt in ("vLLM", "FasterDecoding", "Medusa-2"):
        assert fmt in str(e.value)


def test_unexpected_tensor_in_fd_file(tmp_path):
    raw = make_raw(layers=1)
    sd = {**fd_state(raw), "something.else": torch.ones(3)}
    save_file(sd, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor 'something.else'"):
        load_medusa_checkpoint(tmp_path, D, V)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_medusa_checkpoint(tmp_path / "nope", D, V)
