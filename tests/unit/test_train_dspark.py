"""``specserve train dspark`` on a tiny random Llama (seconds): the training forward equals the
proposer's block forward, labels and teacher forcing line up, STS calibrates, and the command writes a
DeepSpec checkpoint that ``load_dspark_checkpoint`` and the engine load, lossless under greedy decoding
(``dspark``; ``dflash`` for ``--markov-rank 0``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_replay_is_decoding, assert_stopped_run_resumes

from specserve.train.dspark import (IGNORE, block_outputs, collate, default_target_layer_ids, drafter_config,
                                    fit_sts, init_drafter_, resolve_layer_ids, slot_states, slot_weights, target_lse)

PROMPTS = ["w5 w17 w99 w3", "w200 w1 w2", "w42 w42 w7 w8 w9"]


def _target_cfg(model_dir: Path):
    from specserve.config import ModelConfig

    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def _tcfg(num_layers=3, heads=4, kv=2):
    from specserve.config import ModelConfig

    return ModelConfig(family="llama", vocab_size=50, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=8)


def _random_drafter(markov_rank=8, head_type="vanilla", num_layers=2, block=4, layer_ids=(0, 1), seed=0):
    from specserve.spec_decode.dspark.model import DFlashDrafter

    cfg = drafter_config(_tcfg(), num_layers=num_layers, block_size=block, layer_ids=list(layer_ids),
                         mask_token_id=49, markov_rank=markov_rank, markov_head_type=head_type)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    init_drafter_(d, std=0.2)
    with torch.no_grad():  # non-trivial norms and Markov W2 so that every part is exercised
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif n == "markov_head.markov_w2.weight":
                p.normal_(0, 0.3)
    return d


def test_default_target_layer_ids():
    assert default_target_layer_ids(2) == [0]  # the tiny 2-layer models
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B (z-lab / DeepSpec)
    assert default_target_layer_ids(40) == [1, 10, 19, 28, 37]  # Qwen3-14B
    for L in range(2, 64):
        ids = default_target_layer_ids(L)
        assert ids and max(ids) < L - 1 and min(ids) >= 0 and ids == sorted(set(ids))
    assert resolve_layer_ids("3, 1", 8) == [1, 3]  # layer order: what the target emits
    with pytest.raises(ValueError, match="forbidden"):
        resolve_layer_ids("1", 2)  # the last layer
    with pytest.raises(ValueError, match="comma-separated"):
        resolve_layer_ids("one", 8)


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_training_forward_equals_proposer_block_forward(head_type):
    """Every block of the training loss's batch (many anchors and sequences, padding; collated, embedded
    and run through the drafter's training-shaped forward) gives the slot states and Markov-corrected
    logits of the proposer's per-block forward over a DraftCache."""
    from specserve.spec_decode.dspark.drafting import draft_block

    d = _random_drafter(head_type=head_type).eval()
    G, V = d.cfg.block_size, d.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    embed_w = torch.randn(V, 32, generator=g)
    lm_w = torch.randn(V, 32, generator=g)
    lens = [20, 13]
    samples = [{"ids": torch.randint(0, 49, (n,), generator=g).tolist(), "prompt_len": 4} for n in lens]
    feats = [(torch.randn(n, 64, generator=g).to(torch.bfloat16), torch.randn(n, 32, generator=g)) for n in lens]
    items = [(0, torch.tensor([4, 9, 16, 18])), (1, torch.tensor([5, 11]))]  # 18, 11: labels past the end
    batch = collate(items, samples, feats, G, 49)
    with torch.no_grad():
        hid = slot_states(d, batch, embed_w)
    for r, (i, anchors) in enumerate(items):
        ids = samples[i]["ids"]
        for n, a in enumerate(anchors.tolist()):
            assert batch["block_ids"][r, n].tolist() == [ids[a]] + [49] * (G - 1)
            for k in range(G):
                want = ids[a + k + 1] if a + k + 1 < len(ids) else IGNORE
                assert batch["labels"][r, n, k] == want
                if want != IGNORE:
                    assert torch.equal(batch["target_hidden"][r, n, k], feats[i][1][a + k])
            cache = d.new_cache()
            cache.extend(feats[i][0][:a].float(), list(range(a)))
            ref = d.forward_block(ids[a], a, cache, lambda x: torch.nn.functional.embedding(x, embed_w))
            torch.testing.assert_close(hid[r, n], ref, rtol=1e-4, atol=1e-4)
            # the proposer's drafting loop, fed the labels, gives the training logits' argmax
            if a + G < len(ids):
                blk = draft_block(lambda h: h @ lm_w.T, ref, ids[a], d.markov_head, 0.0,
                                  confidence_head=d.confidence_head)
                logits = hid[r, n] @ lm_w.T + d.markov_head.bias(
                    torch.tensor([ids[a]] + ids[a + 1 : a + G]), hid[r, n])
                assert int(logits[0].argmax()) == int(blk.tokens[0])
                torch.testing.assert_close(
                    d.confidence_head(hid[r, n, :1], d.markov_head.prev_embeddings(torch.tensor([ids[a]]))),
                    blk.confidences[:1], rtol=1e-4, atol=1e-4)
    # the losses are finite and differentiable; padding blocks carry no label
    d.train()
    out = block_outputs(d, batch, lm_w, None, embed_w, slot_weights(G))
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and d.fc.weight.grad is not None
    assert d.markov_head.markov_w1.weight.grad is not None
    assert not batch["labels"][1, 2:].ne(IGNORE).any()
    assert ((out["cstar"] >= 0) & (out["cstar"] <= 1)).all()


def test_sts_fixes_an_overconfident_head():
    g = torch.Generator().manual_seed(0)
    nb, G = 4000, 3
    true_logit = torch.randn(nb, G, generator=g) * 1.5
    cstar = torch.sigmoid(true_logit)
    valid = torch.ones(nb, G, dtype=torch.bool)
    valid[:500, 2] = False
    res = fit_sts(true_logit * 3.0, cstar, valid)  # 3x overconfident
    assert abs(res["temperatures"][0] - 3.0) < 0.5, res
    assert all(a < b for a, b in zip(res["ece_after"], res["ece_before"])), res
    assert res["ece_after"][0] < 0.01
    calibrated = fit_sts(true_logit, cstar, valid)
    assert abs(calibrated["temperatures"][0] - 1.0) < 0.2


def _greedy_identical(model_dir: Path, drafter: Path, method: str) -> dict:
    from specserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=str(model_dir), dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model=str(model_dir), dtype="float32", speculative_config={"method": method, "model": str(drafter)})
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    m = llm.get_metrics()
    assert m["num_draft_tokens"] > 0
    return m


def test_train_dspark_end_to_end(tiny_llama, tiny_prompts, cache_dir, tmp_path):
    from safetensors import safe_open

    from specserve.spec_decode.dspark.formats import load_dspark_checkpoint
    from specserve.spec_decode.dspark.model import DFlashDrafter
    from specserve.train.dspark import DSparkTrainArgs, train_dspark

    out = tmp_path / "dspark"
    args = DSparkTrainArgs(out=str(out), model=str(tiny_llama), prompts_file=str(tiny_prompts), num_prompts=40,
                           max_tokens=24, block_size=4, markov_rank=16, epochs=4, lr=3e-3, batch_size=8, seed=0,
                           threads=1, cache_dir=str(cache_dir), progress=False)
    logs = []
    res = train_dspark(args, log=logs.append)

    # the loss went down, on the training blocks and on the held-out ones
    el = res["train"]["epoch_loss"]
    assert len(el) == 4 and el[-1] < el[0], el
    assert res["heldout"]["loss"] < res["heldout_init"]["loss"]
    assert res["heldout"]["tau"] > res["heldout_init"]["tau"]
    assert res["timings"]["total_s"] < 60
    # the checkpoint: DeepSpec format, bfloat16, loads and fits the target
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["architectures"] == ["Qwen3DSparkModel"] and cfg_json["target_layer_ids"] == [0]
    assert cfg_json["mask_token_id"] == 256 and cfg_json["block_size"] == 4 and cfg_json["num_target_layers"] == 2
    assert len(cfg_json["confidence_temperatures"]) == 4 and all(t > 0 for t in cfg_json["confidence_temperatures"])
    tr = cfg_json["training"]
    assert tr["seed"] == 0 and tr["epochs"] == 4 and tr["train_prompts"] == 40 and tr["heldout_prompts"] >= 1
    assert len(tr["heldout_acceptance"]) == 4 and tr["heldout_tau"] == round(res["heldout"]["tau"], 4)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    lcfg, sd = load_dspark_checkpoint(out, _target_cfg(tiny_llama))
    assert lcfg.sample_from_anchor and lcfg.markov_rank == 16 and lcfg.confidence_head_with_markov
    assert lcfg.num_drafts == 4 and lcfg.mask_token_id == 256
    DFlashDrafter(lcfg).load_state(sd)
    readme = (out / "README.md").read_text()
    for s in ("Held-out acceptance estimates", "Seed:** 0", "Time taken", str(tiny_prompts), "tau estimate",
              "| 1 | a+1 |", "| 4 | a+4 |", "self-distillation"):
        assert s in readme, s
    # held-out prompts are not training prompts
    assert not {s["prompt"] for s in res["train_samples"]} & {s["prompt"] for s in res["heldout_samples"]}

    # the engine runs it, lossless
    _greedy_identical(tiny_llama, out, "dspark")

    # a rerun with the same data reuses the cached generations and target features
    logs.clear()
    # (an rnn Markov head over a pruned draft vocabulary of 100 tokens: speculators format)
    args2 = DSparkTrainArgs(**{**args.__dict__, "out": str(tmp_path / "d2"), "epochs": 2, "markov_head_type": "rnn",
                               "draft_vocab_size": 100})
    res2 = train_dspark(args2, log=logs.append)
    assert sum("cached" in m for m in logs) == 4, logs
    assert res2["heldout"]["loss"] < res2["heldout_init"]["loss"]
    cfg2 = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert cfg2["speculators_model_type"] == "dspark" and cfg2["draft_vocab_size"] == 100
    lcfg2, sd2 = load_dspark_checkpoint(tmp_path / "d2", _target_cfg(tiny_llama))
    assert lcfg2.markov_head_type == "rnn" and lcfg2.pruned_vocab and lcfg2.sample_from_anchor
    # the draft vocabulary: the 100 most frequent response tokens, in increasing target-id order
    vocab = torch.arange(100) + sd2["d2t"]
    counts = torch.zeros(257)
    for smp in res2["train_samples"]:
        resp = smp["ids"][smp["prompt_len"]:]
        counts.index_add_(0, torch.as_tensor(resp), torch.ones(len(resp)))
    assert bool((vocab[1:] > vocab[:-1]).all())
    assert counts[vocab].min() >= counts[[i for i in range(257) if i not in set(vocab.tolist())]].max()
    _greedy_identical(tiny_llama, tmp_path / "d2", "dspark")

    # bfloat16 features and mixed-precision training: the generations come from the cache, the
    # features do not (their own cache entries); the same first step's loss up to bf16 rounding
    logs.clear()
    args3 = DSparkTrainArgs(**{**args.__dict__, "out": str(tmp_path / "d3"), "feature_dtype": "bfloat16",
                               "train_dtype": "bfloat16"})
    res3 = train_dspark(args3, log=logs.append)
    assert sum("self-distillation (items" in m and "cached" in m for m in logs) == 2, logs
    assert not any("target features" in m and "cached" in m for m in logs), logs
    l32, l16 = res["train"]["step_loss"][0], res3["train"]["step_loss"][0]
    assert l16 != l32 and abs(l16 - l32) < 0.05 * l32, (l16, l32)
    assert res3["heldout"]["loss"] < res3["heldout_init"]["loss"]
    tr3 = json.loads((tmp_path / "d3" / "config.json").read_text())["training"]
    assert tr3["feature_dtype"] == "bfloat16" and tr3["train_dtype"] == "bfloat16"
    readme3 = (tmp_path / "d3" / "README.md").read_text()
    assert "bfloat16 mixed precision" in readme3 and "target features from a bfloat16 forward" in readme3
    _greedy_identical(tiny_llama, tmp_path / "d3", "dspark")

    # the target generating in int8 (as it would be served): the features come from that same int8
    # target (the drafter reads its hidden states when serving), in cache entries of their own, its
    # embedding dequantized; the record and README say so
    logs.clear()
    args4 = DSparkTrainArgs(**{**args3.__dict__, "out": str(tmp_path / "d4"), "gen_quantization": "int8"})
    res4 = train_dspark(args4, log=logs.append)
    assert not any("target features" in m and "cached" in m for m in logs), logs
    assert res4["train"]["step_loss"][0] != l16 and res4["heldout"]["loss"] < res4["heldout_init"]["loss"]
    tr4 = json.loads((tmp_path / "d4" / "config.json").read_text())["training"]
    assert tr4["feature_quantization"] == "int8" and "feature_quantization" not in tr3
    readme4 = (tmp_path / "d4" / "README.md").read_text()
    assert "target features from a bfloat16 forward of the target's int8 weights" in readme4
    with pytest.raises(ValueError, match="train_dtype"):
        DSparkTrainArgs(**{**args.__dict__, "train_dtype": "float16"}).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path is the test above)")
def test_train_dspark_on_a_gpu_learns_as_on_the_cpu(tiny_llama, tiny_prompts, cache_dir, tmp_path):
    """``device="cuda"``: the features from the dense target on the GPU, training and evaluation there; the
    same start (same weights, features equal to a GPU's last bits) and about the same result as the CPU."""
    from specserve.train.dspark import DSparkTrainArgs, train_dspark

    res = {}
    for dev in ("cpu", "cuda"):
        args = DSparkTrainArgs(out=str(tmp_path / dev), model=str(tiny_llama), prompts_file=str(tiny_prompts),
                               num_prompts=40, max_tokens=24, block_size=4, markov_rank=16, epochs=4, lr=3e-3,
                               batch_size=8, seed=0, threads=1, cache_dir=str(cache_dir), progress=False, device=dev)
        res[dev] = train_dspark(args, log=lambda m: None)
    c, g = res["cpu"], res["cuda"]
    assert g["heldout"]["loss"] < g["heldout_init"]["loss"]
    assert g["heldout_init"]["loss"] == pytest.approx(c["heldout_init"]["loss"], rel=1e-3)
    assert g["heldout"]["loss"] == pytest.approx(c["heldout"]["loss"], rel=0.05)
    tr = json.loads((tmp_path / "cuda" / "config.json").read_text())["training"]
    assert tr["feature_device"] == "cuda" and tr["device"] == torch.cuda.get_device_name("cuda")
    assert "feature_device" not in json.loads((tmp_path / "cpu" / "config.json").read_text())["training"]
    assert "on a GPU" in (tmp_path / "cuda" / "README.md").read_text()


def test_cli_train_dflash_baseline(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    from specserve.entrypoints.cli import main
    from specserve.spec_decode.dspark.formats import load_dspark_checkpoint

    out = tmp_path / "dflash"
    argv = ["train", "dspark", "--model", str(tiny_llama), "--out", str(out), "--prompts", str(tiny_prompts),
            "--num-prompts", "40", "--max-tokens", "24", "--epochs", "2", "--lr", "3e-3", "--block-size", "3",
            "--markov-rank", "0", "--anchors-per-seq", "8", "--threads", "1", "--cache-dir", str(cache_dir),
            "--no-progress", "--extra-temperature", "1.0"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert f"to {out}" in stdout and "slot 1: acceptance estimate" in stdout and "slot 3:" in stdout
    cfg = json.loads((out / "config.json").read_text())
    # --extra-temperature: a second, sampled response to each of the 40 prompts is trained on too
    assert cfg["training"]["train_prompts"] == 80
    assert cfg["training"]["self_distillation"]["extra_temperatures"] == [1.0]
    assert "one more response to each training prompt sampled at temperature 1.0" in (out / "README.md").read_text()
    assert "80 training sequences" in (out / "README.md").read_text()
    assert cfg["markov_rank"] == 0 and cfg["confidence_head_with_markov"] is False
    assert cfg["training"]["command"] == "specserve " + " ".join(argv) and cfg["training"]["method"] == "dflash"
    assert "specserve train dspark --model" in (out / "README.md").read_text()
    lcfg, sd = load_dspark_checkpoint(out, _target_cfg(tiny_llama))
    assert lcfg.markov_rank == 0 and not any(k.startswith("markov_head.") for k in sd)
    _greedy_identical(tiny_llama, out, "dflash")


def test_cli_train_seed_draws_new_anchors_over_the_same_data(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    """--train-seed seeds the training loop alone: equal to --seed it is the default run bit for bit; another
    value trains on the same sequences and held-out prompts (--seed keeps the split and the responses) with
    its own initial weights, order and anchors, and the config and README say so."""
    from safetensors.torch import load_file

    from specserve.entrypoints.cli import main

    common = ["train", "dspark", "--model", str(tiny_llama), "--prompts", str(tiny_prompts), "--num-prompts", "40",
              "--max-tokens", "24", "--epochs", "1", "--lr", "3e-3", "--block-size", "3", "--markov-rank", "4",
              "--anchors-per-seq", "4", "--threads", "1", "--cache-dir", str(cache_dir), "--no-progress"]
    runs = {"a": [], "b": ["--train-seed", "0"], "c": ["--train-seed", "1"]}
    for name, extra in runs.items():
        assert main([*common, "--out", str(tmp_path / name), *extra]) == 0
    capsys.readouterr()
    w = {n: load_file(str(tmp_path / n / "model.safetensors")) for n in runs}
    assert all(torch.equal(w["a"][k], w["b"][k]) for k in w["a"])
    assert not torch.equal(w["a"]["fc.weight"], w["c"]["fc.weight"])
    c = {n: json.loads((tmp_path / n / "config.json").read_text())["training"] for n in runs}
    for k in ("train_prompts", "train_response_tokens", "train_blocks_per_epoch", "heldout_prompts", "heldout_blocks"):
        assert c["c"][k] == c["a"][k], k
    assert c["c"]["epoch_loss"] != c["a"]["epoch_loss"]
    assert c["c"]["seed"] == 0 and c["c"]["train_seed"] == 1
    assert "train_seed" not in c["a"] and "train_seed" not in c["b"]
    assert "- **Seed:** 0 (the training loop's: 1, `--train-seed`" in (tmp_path / "c" / "README.md").read_text()
    assert "- **Seed:** 0.\n" in (tmp_path / "a" / "README.md").read_text()


def test_cli_train_dspark_init_from(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    """--init-from: the second run starts from the first drafter's weights (its held-out loss at init is the
    first run's final one), keeps its shape and draft vocabulary, trains it further and records where it
    started; shape options next to --init-from are refused."""
    from safetensors.torch import load_file

    from specserve.entrypoints.cli import main
    from specserve.train.dspark import DSparkTrainArgs

    common = ["--model", str(tiny_llama), "--prompts", str(tiny_prompts), "--num-prompts", "40", "--max-tokens",
              "24", "--anchors-per-seq", "8", "--threads", "1", "--cache-dir", str(cache_dir), "--no-progress"]
    first = tmp_path / "first"
    argv1 = ["train", "dspark", "--out", str(first), "--block-size", "3", "--markov-rank", "8",
             "--draft-vocab-size", "100", "--epochs", "2", "--lr", "3e-3", *common]
    assert main(argv1) == 0
    second = tmp_path / "second"
    argv2 = ["train", "dspark", "--out", str(second), "--init-from", str(first), "--epochs", "2", "--lr", "1e-3",
             "--seed", "1", *common]
    assert main(argv2) == 0
    capsys.readouterr()
    c1, c2 = (json.loads((d / "config.json").read_text()) for d in (first, second))
    t1, t2 = c1["training"], c2["training"]
    assert t2["heldout_loss_init"] == pytest.approx(t1["heldout_loss"], abs=1e-4)
    assert t2["heldout_loss"] < t2["heldout_loss_init"]
    for k in ("block_size", "markov_rank", "draft_vocab_size", "aux_hidden_state_layer_ids", "speculators_model_type"):
        assert c2[k] == c1[k], k
    w1, w2 = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert set(w1) == set(w2) and torch.equal(w1["d2t"], w2["d2t"])
    assert not torch.equal(w1["fc.weight"], w2["fc.weight"])  # trained further
    assert t2["init_from"] == {"path": str(first), "command": "specserve " + " ".join(argv1),
                               "total_s": t1["timings_s"]["total_s"]}
    assert t2["command"] == "specserve " + " ".join(argv2)
    readme = (second / "README.md").read_text()
    assert f"Initialised from** the drafter at `{first}` (made by `specserve train dspark --out" in readme
    assert "Draft vocabulary: the 100 most frequent tokens of the starting drafter's training responses" in readme
    # trained further in place: the README says it started from what the directory held
    argv3 = ["train", "dspark", "--out", str(second), "--init-from", str(second), "--epochs", "1", *common]
    assert main(argv3) == 0
    # the first run's training and held-out sequences again: their target log-sum-exps come from the cache
    assert capsys.readouterr().err.count("target log-sum-exp: cached") == 2
    assert ("Initialised from** the drafter this directory held before this run (made by `specserve train dspark "
            f"--out {second} --init-from") in (second / "README.md").read_text()
    _greedy_identical(tiny_llama, second, "dspark")

    # the shape comes from the checkpoint: shape options beside --init-from are errors, naming them
    assert main(["train", "dspark", "--out", str(tmp_path / "x"), "--init-from", str(first), "--num-layers", "2",
                 "--block-size", "4", "--draft-vocab-size", "150", *common]) == 2
    err = capsys.readouterr().err
    assert "drop --num-layers, --block-size" in err and "--draft-vocab-size" not in err
    assert not (tmp_path / "x").exists()
    # --draft-vocab-size beside --init-from grows the draft vocabulary, never shrinks it (checked before any data)
    assert main(["train", "dspark", "--out", str(tmp_path / "x"), "--init-from", str(first),
                 "--draft-vocab-size", "80", *common]) == 2
    assert "must grow the loaded drafter's draft vocabulary: more than its 100" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # a checkpoint that does not fit the target: the field is named
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((first / "model.safetensors").read_bytes())
    (bad / "config.json").write_text(json.dumps({**c1, "target_hidden_size": c1["target_hidden_size"] * 2}))
    assert main(["train", "dspark", "--out", str(tmp_path / "y"), "--init-from", str(bad), *common]) == 2
    assert "hidden_size" in capsys.readouterr().err and not (tmp_path / "y").exists()
    with pytest.raises(ValueError, match="init_from"):
        DSparkTrainArgs(out="z", init_from=str(first), eval_only=True).validate()


def test_grow_draft_vocab_moves_rows_with_their_tokens(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    """``grow_draft_vocab``: every old token keeps its lm_head and W2 rows at its new draft index, a new
    token starts from the target's lm_head row and a zero W2 row, so on the old tokens the grown drafter's
    logits are the old drafter's. ``--init-from D --draft-vocab-size N`` trains the grown drafter (its
    vocabulary a superset of D's: D's tokens and the most frequent other ones), records and describes the
    growth, and stays lossless; a drafter over the whole vocabulary cannot be grown."""
    from safetensors.torch import load_file

    from specserve.entrypoints.cli import main
    from specserve.spec_decode.dspark.formats import load_dspark_checkpoint
    from specserve.spec_decode.dspark.model import DFlashDrafter
    from specserve.train.common import select_draft_vocab
    from specserve.train.dspark import draft_vocab_ids, grow_draft_vocab

    common = ["--model", str(tiny_llama), "--prompts", str(tiny_prompts), "--num-prompts", "40", "--max-tokens",
              "24", "--anchors-per-seq", "8", "--threads", "1", "--cache-dir", str(cache_dir), "--no-progress"]
    first = tmp_path / "first"
    assert main(["train", "dspark", "--out", str(first), "--block-size", "3", "--markov-rank", "8",
                 "--draft-vocab-size", "60", "--epochs", "1", "--lr", "3e-3", *common]) == 0
    tcfg = _target_cfg(tiny_llama)
    cfg, sd = load_dspark_checkpoint(first, tcfg)
    old_ids = torch.arange(60) + sd["d2t"].long()
    extra = torch.tensor([i for i in range(tcfg.vocab_size) if i not in set(old_ids.tolist())][:25])
    new_ids = torch.cat([old_ids, extra]).sort().values
    lm_w = torch.randn(tcfg.vocab_size, tcfg.hidden_size)
    gcfg, gsd = grow_draft_vocab(cfg, sd, new_ids, lm_w)
    assert gcfg.draft_vocab_size == 85 and cfg.draft_vocab_size == 60
    old_d, new_d = DFlashDrafter(cfg, dtype=torch.float32), DFlashDrafter(gcfg, dtype=torch.float32)
    old_d.load_state(sd)
    new_d.load_state(gsd)
    assert torch.equal(draft_vocab_ids(new_d), new_ids)
    pos = {int(t): j for j, t in enumerate(new_ids)}
    at = torch.tensor([pos[int(t)] for t in old_ids])
    new_rows = torch.tensor([pos[int(t)] for t in extra])
    h, r = torch.randn(5, tcfg.hidden_size), torch.randn(5, cfg.markov_rank)
    w2_old, w2_new = old_d.markov_head.markov_w2.weight, new_d.markov_head.markov_w2.weight
    torch.testing.assert_close((h @ new_d.lm_head.weight.T + r @ w2_new.T)[:, at],
                               h @ old_d.lm_head.weight.T + r @ w2_old.T,
                               rtol=0, atol=0)
    stored = sd["lm_head.weight"].dtype  # a new row is the target's, in the checkpoint's dtype
    assert torch.equal(new_d.lm_head.weight[new_rows], lm_w[extra].to(stored).to(new_d.lm_head.weight.dtype))
    assert not w2_new[new_rows].any()
    with pytest.raises(ValueError, match="keep every token"):
        grow_draft_vocab(cfg, sd, extra.sort().values, lm_w)
    keep = torch.tensor([3, 9])
    chosen = select_draft_vocab([{"ids": [1, 1, 2], "prompt_len": 0}], 20, 3, keep=keep)
    assert set(keep.tolist()) <= set(chosen.tolist())

    grown = tmp_path / "grown"
    argv = ["train", "dspark", "--out", str(grown), "--init-from", str(first), "--draft-vocab-size", "90",
            "--epochs", "1", "--lr", "1e-3", *common]
    assert main(argv) == 0
    capsys.readouterr()
    c = json.loads((grown / "config.json").read_text())
    assert c["draft_vocab_size"] == 90 and c["training"]["init_from"]["draft_vocab_grown_from"] == 60
    ids = torch.arange(90) + load_file(str(grown / "model.safetensors"))["d2t"].long()
    assert set(old_ids.tolist()) < set(ids.tolist())
    readme = (grown / "README.md").read_text()
    assert "Draft vocabulary: 90 tokens: the starting drafter's 60 and the 30 most frequent other tokens" in readme
    assert "draft vocabulary of 60 tokens (grown, `--draft-vocab-size`)" in readme
    _greedy_identical(tiny_llama, grown, "dspark")
    # a drafter over the target's whole vocabulary has no draft vocabulary to grow
    full = tmp_path / "full"
    assert main(["train", "dspark", "--out", str(full), "--block-size", "3", "--markov-rank", "0", "--epochs", "1",
                 *common]) == 0
    capsys.readouterr()
    assert main(["train", "dspark", "--out", str(tmp_path / "z"), "--init-from", str(full), "--draft-vocab-size", "90",
                 *common]) == 2
    assert "grows a pruned draft vocabulary" in capsys.readouterr().err


def test_cli_train_dspark_add_layers_grows_the_loaded_drafter(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    """--add-layers N with --init-from: the drafter gets N more decoder layers after its own whose output
    projections start at zero, so it starts as the loaded drafter (its held-out loss at init is the loaded
    drafter's final one), then all are trained; the grown checkpoint loads and decodes losslessly."""
    from safetensors.torch import load_file

    from specserve.entrypoints.cli import main
    from specserve.train.dspark import DSparkTrainArgs

    common = ["--model", str(tiny_llama), "--prompts", str(tiny_prompts), "--num-prompts", "40", "--max-tokens",
              "24", "--anchors-per-seq", "6", "--threads", "1", "--cache-dir", str(cache_dir), "--no-progress"]
    first, grown = tmp_path / "first", tmp_path / "grown"
    assert main(["train", "dspark", "--out", str(first), "--block-size", "3", "--markov-rank", "8",
                 "--draft-vocab-size", "100", "--epochs", "1", "--lr", "3e-3", *common]) == 0
    assert main(["train", "dspark", "--out", str(grown), "--init-from", str(first), "--add-layers", "1",
                 "--epochs", "1", "--lr", "3e-3", *common]) == 0
    capsys.readouterr()
    c1, c2 = (json.loads((d / "config.json").read_text()) for d in (first, grown))
    n1, n2 = (c["transformer_layer_config"]["num_hidden_layers"] for c in (c1, c2))  # speculators format
    assert (n1, n2) == (1, 2)
    t1, t2 = c1["training"], c2["training"]
    assert t2["heldout_loss_init"] == pytest.approx(t1["heldout_loss"], abs=1e-4)
    assert t2["heldout_loss"] < t2["heldout_loss_init"]
    assert t2["init_from"]["added_layers"] == 1 and t2["init_from"]["loaded_layers"] == 1
    w1, w2 = load_file(str(first / "model.safetensors")), load_file(str(grown / "model.safetensors"))
    assert set(w1) < set(w2) and all(k.startswith("layers.1.") for k in set(w2) - set(w1))
    assert w2["layers.1.self_attn.o_proj.weight"].abs().max() > 0  # trained away from its zero start
    assert "grown by 1 decoder layer(s) after its 1 (`--add-layers`" in (grown / "README.md").read_text()
    _greedy_identical(tiny_llama, grown, "dspark")
    with pytest.raises(ValueError, match="add_layers"):
        DSparkTrainArgs(out="z", add_layers=1).validate()


def test_train_dspark_resumes_a_stopped_run(tiny_llama, tiny_prompts, cache_dir, tmp_path, monkeypatch):
    """A run stopped part-way continues from its saved state to the weights, losses and held-out figures
    of an uninterrupted run (``assert_stopped_run_resumes``)."""
    import specserve.train.dspark as ds
    import specserve.train.dspark.run as ds_run

    base = dict(model=str(tiny_llama), prompts_file=str(tiny_prompts), num_prompts=40, max_tokens=24, block_size=4,
                markov_rank=8, epochs=3, lr=3e-3, batch_size=8, anchors_per_seq=6, threads=1,
                cache_dir=str(cache_dir), progress=False)
    ref, res = assert_stopped_run_resumes(ds.train_dspark, ds.DSparkTrainArgs, ds_run, "dspark-train-state", base,
                                          "model.safetensors", tmp_path, cache_dir, monkeypatch)
    assert res["heldout"]["loss"] == ref["heldout"]["loss"] and res["sts"] == ref["sts"]


def test_cli_train_dspark_ctrl_c_saves_and_the_same_command_continues(tiny_llama, tiny_prompts, cache_dir, tmp_path,
                                                                       monkeypatch, capsys):
    """SIGINT in the middle of training (no periodic save due: --save-every 10 minutes): the command saves
    its state at the end of that step, exits 130 saying where it stopped, restores the signal handlers,
    and run again continues to the weights of an uninterrupted run."""
    import os
    import signal

    from safetensors.torch import load_file

    import specserve.train.dspark.run as ds_run
    from specserve.entrypoints.cli import main

    common = ["--model", str(tiny_llama), "--prompts", str(tiny_prompts), "--num-prompts", "40", "--max-tokens", "24",
              "--block-size", "3", "--markov-rank", "8", "--epochs", "2", "--anchors-per-seq", "6", "--threads", "1",
              "--cache-dir", str(cache_dir), "--no-progress"]
    assert main(["train", "dspark", "--out", str(tmp_path / "ref"), "--save-every", "0", *common]) == 0
    real, calls = ds_run.TrainState, []

    class SignalledAtStep7(real):
        def due(self):
            calls.append(1)
            if len(calls) == 7:
                os.kill(os.getpid(), signal.SIGINT)
            return super().due()

    monkeypatch.setattr(ds_run, "TrainState", SignalledAtStep7)
    before = signal.getsignal(signal.SIGINT)
    argv = ["train", "dspark", "--out", str(tmp_path / "run"), *common]
    capsys.readouterr()
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "SIGINT: saving the training state at the end of this step" in err
    assert "interrupted: training stopped at epoch " in err and "the same command continues from it" in err
    assert signal.getsignal(signal.SIGINT) is before and not (tmp_path / "run").exists()
    (state,) = cache_dir.glob("dspark-train-state-*.pt")
    monkeypatch.setattr(ds_run, "TrainState", real)
    assert main(argv) == 0
    assert "resuming training at epoch " in capsys.readouterr().err and not state.exists()
    w_ref, w_run = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("ref", "run"))
    assert all(torch.equal(w_ref[k], w_run[k]) for k in w_ref)
    t_ref, t_run = (json.loads((tmp_path / d / "config.json").read_text())["training"] for d in ("ref", "run"))
    assert t_run["resumed_at_steps"] == [7] and t_run["epoch_loss"] == t_ref["epoch_loss"]


def test_cli_train_dspark_bad_args(tiny_llama, tiny_prompts, tmp_path, capsys):
    from specserve.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["train", "dspark", "--block-size", "4"])  # --out is required
    with pytest.raises(SystemExit):
        main(["train", "dspark", "--out", str(tmp_path / "x"), "--markov-rank", "-1"])
    assert main(["train", "dspark", "--out", str(tmp_path / "x"), "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "prompts file does not exist" in capsys.readouterr().err
    assert main(["train", "dspark", "--out", str(tmp_path / "x"), "--extra-temperature", "0"]) == 2
    assert "extra temperatures must be > 0" in capsys.readouterr().err
    assert main(["train", "dspark", "--out", str(tmp_path / "x"), "--device", "tpu"]) == 2
    assert "device must be cpu, cuda or cuda:N, got 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():  # asked for, never a silent fall-back to the CPU
        assert main(["train", "dspark", "--out", str(tmp_path / "x"), "--device", "cuda"]) == 2
        assert "torch sees no CUDA GPU" in capsys.readouterr().err
    assert main(["train", "dspark", "--out", str(tmp_path / "x"), "--model", str(tiny_llama), "--prompts",
                 str(tiny_prompts), "--target-layer-ids", "1", "--threads", "1", "--cache-dir",
                 str(tmp_path / "c"), "--max-tokens", "4", "--num-prompts", "2", "--no-progress"]) == 2
    assert "forbidden" in capsys.readouterr().err


def test_train_dspark_two_sources_then_eval_only(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    """Two prompt sources: each is self-distilled and cached on its own, the held-out replay reports
    both; ``--eval-only`` recomputes the same held-out figures from the saved weights without touching
    them, and on one source alone reuses that source's cache."""
    import random

    from specserve.entrypoints.cli import main
    from specserve.train.common import select_prompts
    from specserve.train.dspark import DSparkTrainArgs, train_dspark

    r = random.Random(5)
    more = tmp_path / "more.txt"
    more.write_text("".join(" ".join(f"w{r.randint(1, 256)}" for _ in range(r.randint(2, 6))) + " ?\n"
                            for _ in range(40)))
    out = tmp_path / "two"
    args = DSparkTrainArgs(out=str(out), model=str(tiny_llama), prompts_file=[str(tiny_prompts), str(more)],
                           num_prompts=20, num_eval_prompts=4, max_tokens=16, block_size=3, markov_rank=8,
                           epochs=2, lr=3e-3, seed=0, threads=1, cache_dir=str(cache_dir), progress=False)
    res = train_dspark(args, log=lambda m: None)
    meta = res["meta"]
    n_held1 = len(select_prompts(str(tiny_prompts), 20, 4, 0)[1])
    n_held2 = len(select_prompts(str(more), 20, 4, 0)[1])
    assert meta["train_prompts"] == 40 and meta["heldout_prompts"] == n_held1 + n_held2 == len(res["heldout_samples"])
    assert str(tiny_prompts) in meta["data"] and str(more) in meta["data"]
    dec = res["heldout"]["decode"]
    assert set(dec["by_source"]) == {str(tiny_prompts), str(more)} and 1.0 <= dec["tau"] <= 4.0
    assert meta["heldout_decode_tau"] == round(dec["tau"], 4)
    readme = (out / "README.md").read_text()
    assert "Greedy decoding, replayed" in readme and "By source" in readme
    # the replay is what decoding does: the engine, greedy with full verification, on the held-out prompts
    assert_replay_is_decoding(tiny_llama, {"method": "dspark", "model": str(out), "dspark_tree": None},
                              res["heldout_samples"], 16, dec)

    weights = (out / "model.safetensors").read_bytes()
    before = json.loads((out / "config.json").read_text())
    argv = ["train", "dspark", "--eval-only", "--model", str(tiny_llama), "--out", str(out), "--prompts",
            str(tiny_prompts), "--prompts", str(more), "--num-prompts", "20", "--num-eval-prompts", "4",
            "--max-tokens", "16", "--threads", "1", "--cache-dir", str(cache_dir), "--no-progress"]
    assert main(argv) == 0
    assert "greedy decoding replayed: tau" in capsys.readouterr().out
    after = json.loads((out / "config.json").read_text())
    assert (out / "model.safetensors").read_bytes() == weights
    for k in ("heldout_decode_tau", "heldout_tau", "heldout_greedy_tau", "heldout_decode_tau_by_source",
              "epoch_loss", "command"):
        assert after["training"][k] == before["training"][k], k
    assert after["confidence_temperatures"] == before["confidence_temperatures"]
    assert after["training"]["heldout_evaluated_by"]["command"] == "specserve " + " ".join(argv)
    assert "recomputed after training" in (out / "README.md").read_text()

    # one source alone: its generations and features come from the cache; the figures are its own
    logs = []
    one = DSparkTrainArgs(**{**args.__dict__, "prompts_file": str(tiny_prompts), "eval_only": True})
    res1 = train_dspark(one, log=logs.append)
    assert sum("cached" in m for m in logs) == 3, logs  # training + held-out responses, held-out features
    assert res1["meta"]["heldout_prompts"] == n_held1
    assert res1["heldout"]["decode"]["tau"] == pytest.approx(dec["by_source"][str(tiny_prompts)])
    assert main(["train", "dspark", "--eval-only", "--model", str(tiny_llama), "--out", str(tmp_path / "none"),
                 "--prompts", str(tiny_prompts), "--cache-dir", str(cache_dir), "--no-progress"]) == 2
    assert "error:" in capsys.readouterr().err


def test_target_lse_matches_each_sequences_own_logsumexp(tmp_path):
    """The log-sum-exp over the full vocabulary at every response position, computed in fixed-size blocks
    across sequences, equals each sequence's own; prompt positions stay 0. Through the cache: computed
    once per key, sequences and dtype."""
    torch.manual_seed(0)
    V, d = 50, 8
    lm_w, lm_b = torch.randn(V, d), torch.randn(V)
    samples = [{"ids": list(range(n)), "prompt_len": p} for n, p in ((5, 2), (9, 4), (3, 3), (7, 1))]
    feats = [(None, torch.randn(len(s["ids"]), d)) for s in samples]
    got = target_lse(lm_w, lm_b, feats, samples, chunk=4)  # blocks straddle sequences; the last is padded
    for (_, fin), s, lse in zip(feats, samples, got):
        p = s["prompt_len"]
        assert lse.shape == (len(s["ids"]),) and torch.all(lse[:p] == 0)
        torch.testing.assert_close(lse[p:], torch.logsumexp(fin[p:] @ lm_w.T + lm_b, dim=-1))
    # in bfloat16 (mixed-precision training): the same up to bf16 rounding of the products
    got16 = target_lse(lm_w, lm_b, feats, samples, chunk=4, dtype=torch.bfloat16)
    for g32, g16, s in zip(got, got16, samples):
        assert torch.equal(g32, g16) == (s["prompt_len"] == len(s["ids"]))  # bf16 products differ
        torch.testing.assert_close(g16, g32, atol=0.1, rtol=0.02)
    logs = []
    for _ in range(2):
        cached = target_lse(lm_w, lm_b, feats, samples, chunk=4, cache=(tmp_path, {"model": "m"}), log=logs.append)
        assert all(torch.equal(a, b) for a, b in zip(cached, got))
    assert len(logs) == 1 and "target log-sum-exp: cached" in logs[0]  # the second call read the first's
    cached16 = target_lse(lm_w, lm_b, feats, samples, chunk=4, dtype=torch.bfloat16, cache=(tmp_path, {"model": "m"}),
                          log=logs.append)
    other = target_lse(lm_w, lm_b, feats, samples[:3], chunk=4, cache=(tmp_path, {"model": "m"}), log=logs.append)
    assert len(logs) == 1 and all(torch.equal(a, b) for a, b in zip(cached16, got16))
    assert len(other) == 3 and all(torch.equal(a, b) for a, b in zip(other, got))
