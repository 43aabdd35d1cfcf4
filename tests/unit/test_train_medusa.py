"""``specserve train medusa`` end to end on a tiny random Llama (seconds), the label alignment of the
examples, and the deterministic, disjoint held-out split of the prompts."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import assert_replay_is_decoding, assert_stopped_run_resumes

from specserve import LLM, SamplingParams
from specserve.train.data import is_heldout, read_prompts_file, split_prompts
from specserve.train.medusa import IGNORE, build_examples

HAVE_CHITCHAT = importlib.util.find_spec("chitchat_dataset") is not None


def _load_heads(out: Path):
    from safetensors.torch import load_file

    from specserve.spec_decode.medusa.model import MedusaConfig, MedusaHeads

    cfg = json.loads((out / "config.json").read_text())
    mcfg = MedusaConfig(**{f.name: cfg[f.name] for f in fields(MedusaConfig)})
    heads = MedusaHeads(mcfg)
    heads.load_state(load_file(str(out / "medusa.safetensors")))
    return heads, cfg


def test_examples_align_head_k_with_token_t_plus_k_plus_2():
    ids = list(range(100, 112))  # T = 12
    P, K, d = 4, 3, 2
    h = torch.arange(len(ids), dtype=torch.float32).unsqueeze(1).repeat(1, d)  # row t holds t
    H, Y = build_examples([h], [{"ids": ids, "prompt_len": P}], K)
    ts = H[:, 0].long().tolist()
    assert ts == list(range(P - 1, len(ids) - 2))  # from the state predicting the first response token
    for row, t in enumerate(ts):
        assert Y[row, 0] == ids[t + 1]  # the base lm_head's target
        for k in range(K):
            want = ids[t + k + 2] if t + k + 2 < len(ids) else IGNORE
            assert Y[row, 1 + k] == want


def test_train_medusa_end_to_end(tiny_llama, tiny_prompts, cache_dir, tmp_path):
    from specserve.engine.model_runner import ModelRunner
    from specserve.spec_decode.medusa.model import MedusaHeads
    from specserve.train.medusa import (MedusaTrainArgs, compute_hidden_states, evaluate_heads, target_lm_head,
                                        train_medusa)

    out = tmp_path / "heads"
    args = MedusaTrainArgs(out=str(out), model=str(tiny_llama), prompts_file=str(tiny_prompts), num_prompts=40,
                           max_tokens=24, epochs=4, lr=1e-2, batch_size=64, seed=0, threads=1,
                           cache_dir=str(cache_dir), progress=False)
    logs = []
    res = train_medusa(args, log=logs.append)

    # the loss went down
    el = res["train"]["epoch_loss"]
    assert len(el) == 4 and el[-1] < el[0], el
    # the checkpoint
    assert {"config.json", "medusa.safetensors", "README.md"} <= {p.name for p in out.iterdir()}
    heads, cfg = _load_heads(out)
    assert cfg["format"] == "specserve-medusa" and cfg["num_heads"] == 4 and cfg["shared_lm_head"] is True
    assert len(cfg["heldout_topk_accuracy"]) == 4 and len(cfg["heldout_topk_accuracy"][0]) == 10
    tr = cfg["training"]
    assert tr["seed"] == 0 and tr["epochs"] == 4 and tr["train_prompts"] == 40 and tr["heldout_prompts"] >= 1
    assert tr["heldout_top1"] == [round(x, 5) for x in res["heldout"]["top1"]]
    readme = (out / "README.md").read_text()
    for s in ("Held-out accuracy", "Seed:** 0", "Time taken", str(tiny_prompts), "| 0 | t+2 |"):
        assert s in readme, s
    if importlib.util.find_spec("specserve.spec_decode.medusa.formats") is not None:  # the engine's loader
        from specserve.spec_decode.medusa.formats import load_medusa_checkpoint

        lcfg, sd = load_medusa_checkpoint(out, 64, 257)
        assert lcfg.num_heads == 4 and lcfg.shared_lm_head and set(sd) == set(heads.state_for_save())
    # held-out prompts are not training prompts
    assert not {s["prompt"] for s in res["train_samples"]} & {s["prompt"] for s in res["heldout_samples"]}
    # greedy self-distillation: the base lm_head reproduces the next token
    assert res["heldout"]["base_top1"] > 0.99
    # the chain hits behind the replay are the heads' top-1 hits; the replay is what decoding does
    ev = res["heldout"]
    assert ev["chain_hits"].shape == (tr["heldout_positions"], 4)
    assert ev["chain_hits"].sum(0).tolist() == [round(a * n) for a, n in zip(ev["top1"], ev["n"])]
    dec = ev["decode"]
    assert tr["heldout_decode_tau"] == round(dec["tau"], 4) and "Greedy decoding, replayed" in readme
    chain = {"method": "medusa", "model": str(out), "medusa_tree": None, "medusa_verify": "full"}
    assert_replay_is_decoding(tiny_llama, chain, res["heldout_samples"], 24, dec)

    # the reloaded heads beat their zero init (the base model's next token) on the training data
    runner = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    samples = res["train_samples"]
    H, Y = build_examples(compute_hidden_states(runner.model, samples), samples, 4)
    w, b = target_lm_head(runner)
    trained = evaluate_heads(heads, H, Y, w, b)
    zero = evaluate_heads(MedusaHeads(heads.cfg), H, Y, w, b)
    assert trained["top1"][0] > zero["top1"][0], (trained["top1"], zero["top1"])
    assert trained["loss"][0] < zero["loss"][0]

    # a rerun with the same data reuses the cached generations and hidden states
    logs.clear()
    # (heads over a draft vocabulary of the 100 most frequent response tokens)
    args2 = MedusaTrainArgs(**{**args.__dict__, "out": str(tmp_path / "heads2"), "epochs": 2, "draft_vocab_size": 100})
    res2 = train_medusa(args2, log=logs.append)
    assert sum("cached" in m for m in logs) == 4, logs
    heads2, cfg2 = _load_heads(tmp_path / "heads2")
    assert cfg2["draft_vocab_size"] == 100 and heads2.token_map.shape == (100,)
    assert bool((heads2.token_map[1:] > heads2.token_map[:-1]).all())
    assert res2["train"]["epoch_loss"][-1] < res2["train"]["epoch_loss"][0]
    assert 0 < res2["meta"]["heldout_draft_vocab_coverage"] <= 1
    from specserve.spec_decode.medusa.formats import load_medusa_checkpoint

    lcfg2, _ = load_medusa_checkpoint(tmp_path / "heads2", 64, 257)
    assert lcfg2.draft_vocab_size == 100
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 42], [11, 12, 13, 14, 15]]
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(prompts, params, use_tqdm=False)
    spec = LLM(model=str(tiny_llama), dtype="float32", speculative_config={
        "method": "medusa", "model": str(tmp_path / "heads2"), "medusa_tree": 4})
    out = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]


def test_train_medusa_features_of_the_quantized_target(tiny_llama, tiny_prompts, cache_dir, tmp_path):
    """A target generating in int8 (as served) gives the hidden states too, in bfloat16, in cache entries
    apart from the dense target's; the record and the README say which forward they came from."""
    from specserve.train.medusa import MedusaTrainArgs, train_medusa

    base = dict(model=str(tiny_llama), prompts_file=str(tiny_prompts), num_prompts=24, max_tokens=16, epochs=1,
                lr=1e-2, batch_size=64, threads=1, cache_dir=str(cache_dir), progress=False, feature_dtype="bfloat16")
    dense = train_medusa(MedusaTrainArgs(out=str(tmp_path / "dense"), **base), log=lambda m: None)
    logs = []
    q = train_medusa(MedusaTrainArgs(out=str(tmp_path / "q"), gen_quantization="int8", **base), log=logs.append)
    assert not any("hidden states" in m and "cached" in m for m in logs), logs
    assert q["meta"]["feature_quantization"] == "int8" and "feature_quantization" not in dense["meta"]
    readme = {k: (tmp_path / k / "README.md").read_text().replace("\n  ", " ") for k in ("q", "dense")}
    assert "hidden states of the target from a bfloat16 forward of the target's int8 weights." in readme["q"]
    assert "hidden states of the target from a bfloat16 forward." in readme["dense"]


def test_train_medusa_resumes_a_stopped_run(tiny_llama, tiny_prompts, cache_dir, tmp_path, monkeypatch):
    """A Medusa run stopped part-way continues from its saved state to the heads, losses and held-out
    figures of an uninterrupted run (``assert_stopped_run_resumes``)."""
    import specserve.train.medusa as tm

    base = dict(model=str(tiny_llama), prompts_file=str(tiny_prompts), num_prompts=40, max_tokens=24, epochs=3,
                lr=1e-2, batch_size=64, threads=1, cache_dir=str(cache_dir), progress=False)
    ref, res = assert_stopped_run_resumes(tm.train_medusa, tm.MedusaTrainArgs, tm, "medusa-train-state", base,
                                          "medusa.safetensors", tmp_path, cache_dir, monkeypatch)
    assert res["train"]["epoch_top1"] == ref["train"]["epoch_top1"]
    assert res["heldout"]["top1"] == ref["heldout"]["top1"]


def test_cli_train_medusa_own_lm_head(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    from specserve.entrypoints.cli import main

    out = tmp_path / "own"
    argv = ["train", "medusa", "--model", str(tiny_llama), "--out", str(out), "--prompts", str(tiny_prompts),
            "--num-prompts", "40", "--max-tokens", "24", "--epochs", "2", "--lr", "1e-2", "--batch-size", "64",
            "--num-heads", "2", "--own-lm-head", "--threads", "1", "--cache-dir", str(cache_dir), "--no-progress",
            "--extra-temperature", "0.7", "--extra-temperature", "1.2"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert f"to {out}" in stdout and "head 0: top-1" in stdout and "head 1: top-1" in stdout
    heads, cfg = _load_heads(out)
    assert cfg["shared_lm_head"] is False and heads.lm_heads is not None and cfg["num_heads"] == 2
    assert cfg["training"]["command"] == "specserve " + " ".join(argv)
    assert "specserve train medusa --model" in (out / "README.md").read_text()
    # two extra temperatures: two more sampled responses to each of the 40 prompts
    assert cfg["training"]["train_prompts"] == 120
    assert cfg["training"]["self_distillation"]["extra_temperatures"] == [0.7, 1.2]
    assert "sampled at temperature 0.7 and one more at 1.2" in (out / "README.md").read_text()


def test_cli_train_medusa_bad_args(tmp_path, capsys):
    from specserve.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["train", "medusa", "--num-heads", "2"])  # --out is required
    assert main(["train", "medusa", "--out", str(tmp_path / "x"), "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "prompts file does not exist" in capsys.readouterr().err
    assert main(["train", "medusa", "--out", str(tmp_path / "x"), "--extra-temperature", "-1"]) == 2
    assert "extra temperatures must be > 0" in capsys.readouterr().err


def test_prompts_file_split_is_deterministic_and_disjoint(tmp_path):
    prompts = [f"prompt number {i}" for i in range(200)]
    a_train, a_held = split_prompts(prompts)
    b_train, b_held = split_prompts(list(reversed(prompts)))
    assert set(a_train) == set(b_train) and set(a_held) == set(b_held)
    assert not set(a_train) & set(a_held) and set(a_train) | set(a_held) == set(prompts)
    assert 5 <= len(a_held) <= 40
    assert all(is_heldout(p) for p in a_held)
    # tiny lists still get one prompt on each side
    tr, he = split_prompts(["a", "b"])
    assert len(tr) == 1 and len(he) == 1
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi there"}\n\n{"prompt": "second"}\n')
    assert read_prompts_file(f) == ["hi there", "second"]


@pytest.mark.skipif(not HAVE_CHITCHAT, reason="chitchat-dataset is not installed")
def test_chitchat_split_is_deterministic_and_disjoint():
    from specserve.train.data import load_conversations, load_prompt_records, load_prompts

    train = load_prompt_records("train")
    held = load_prompt_records("heldout")
    tid, hid = {c for c, _ in train}, {c for c, _ in held}
    assert not tid & hid
    n_conv = len(load_conversations())
    assert n_conv == 7168 and len(tid) + len(hid) < n_conv
    # no held-out prompt is a training prompt, word for word: the held-out conversations whose opening
    # question is also a training conversation's are dropped (they would be training sequences)
    assert not {p for _, p in train} & {p for _, p in held}
    assert 0.06 < len(hid) / n_conv < 0.12
    # deterministic: the same split and order again; another seed reorders but keeps the split
    assert load_prompt_records("heldout") == held
    other = load_prompt_records("heldout", seed=1)
    assert {c for c, _ in other} == hid and other != held
    assert load_prompts("train", n=5) == [p for _, p in train[:5]]
    assert all(len(p.split()) >= 1 for _, p in held)
    with pytest.raises(ValueError):
        load_prompts("test")


def test_train_medusa_eval_only(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    """``--eval-only`` recomputes the held-out figures of trained heads (the same as after training,
    on the same data) without touching the weights; the head count comes from the checkpoint."""
    from specserve.entrypoints.cli import main
    from specserve.train.medusa import MedusaTrainArgs, train_medusa

    out = tmp_path / "heads"
    args = MedusaTrainArgs(out=str(out), model=str(tiny_llama), prompts_file=str(tiny_prompts), num_prompts=40,
                           max_tokens=24, epochs=2, lr=1e-2, batch_size=64, num_heads=3, draft_vocab_size=100,
                           seed=0, threads=1, cache_dir=str(cache_dir), progress=False)
    train_medusa(args, log=lambda m: None)
    weights = (out / "medusa.safetensors").read_bytes()
    before = json.loads((out / "config.json").read_text())
    argv = ["train", "medusa", "--eval-only", "--model", str(tiny_llama), "--out", str(out), "--prompts",
            str(tiny_prompts), "--num-prompts", "40", "--max-tokens", "24", "--threads", "1", "--cache-dir",
            str(cache_dir), "--no-progress"]  # --num-heads and --draft-vocab-size: from the checkpoint
    assert main(argv) == 0
    assert "evaluated Medusa heads (3 heads" in capsys.readouterr().out
    after = json.loads((out / "config.json").read_text())
    assert (out / "medusa.safetensors").read_bytes() == weights
    for k in ("heldout_top1", "heldout_top5", "heldout_decode_tau", "heldout_positions", "epoch_loss", "command"):
        assert after["training"][k] == before["training"][k], k
    assert after["heldout_topk_accuracy"] == before["heldout_topk_accuracy"]
    temps = after["head_temperatures"]
    assert temps == before["head_temperatures"] and len(temps) == 3 and all(t > 0 for t in temps)
    # the engine reads them (they shape only what medusa_verify "auto" decides to verify)
    llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config={
        "method": "medusa", "model": str(out), "medusa_verify": "auto", "medusa_tree": None})
    prop = llm.engine.proposer
    assert prop.head_temperatures.tolist() == pytest.approx(temps)
    z = torch.randn(2, 3, 100)
    seqs = [type("S", (), {"params": SamplingParams(temperature=0)})(),
            type("S", (), {"params": SamplingParams(temperature=0.5)})()]
    want = torch.softmax(z / (torch.tensor([1.0, 0.5]).view(-1, 1, 1) * torch.tensor(temps).view(1, -1, 1)), -1)
    assert torch.allclose(prop._probs(z, seqs), want)
    top_p, top_i = prop._top_probs(z, seqs)  # the dynamic trees' candidates (one pass a head on CPU)
    assert torch.equal(top_i, want.topk(prop.topk, dim=-1).indices)
    assert torch.allclose(top_p, want.topk(prop.topk, dim=-1).values)
    assert after["training"]["heldout_evaluated_by"]["command"] == "specserve " + " ".join(argv)
    readme = (out / "README.md").read_text()
    assert "recomputed after training" in readme and "Greedy decoding, replayed" in readme
    assert main(["train", "medusa", "--eval-only", "--model", str(tiny_llama), "--out", str(tmp_path / "none"),
                 "--prompts", str(tiny_prompts), "--cache-dir", str(cache_dir), "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # --init-from: those heads (shape, draft vocabulary, weights) trained further: on the same data their
    # held-out accuracy "at init" is what they scored when saved
    more = tmp_path / "more"
    argv = ["train", "medusa", "--init-from", str(out), "--model", str(tiny_llama), "--out", str(more), "--prompts",
            str(tiny_prompts), "--num-prompts", "40", "--max-tokens", "24", "--threads", "1", "--cache-dir",
            str(cache_dir), "--no-progress", "--epochs", "1", "--lr", "1e-3", "--batch-size", "64"]
    assert main(argv) == 0
    grown = json.loads((more / "config.json").read_text())
    assert grown["num_heads"] == 3 and grown["training"]["init_from"] == str(out)
    assert grown["training"]["heldout_zero_init_top1"] == pytest.approx(before["training"]["heldout_top1"])
    assert grown["training"]["heldout_top1"] != before["training"]["heldout_top1"]
    assert "**Initialised from** the heads at" in (more / "README.md").read_text()
    assert main([*argv[:2], "--eval-only", *argv[2:]]) == 2
    assert "--init-from trains the heads at DIR further" in capsys.readouterr().err
    # a --num-layers above theirs adds zero-initialised blocks after theirs: the same heads at the start
    deeper = tmp_path / "deeper"
    assert main([*[str(deeper) if a == str(more) else a for a in argv], "--num-layers", "2"]) == 0
    grown2 = json.loads((deeper / "config.json").read_text())
    assert grown2["num_layers"] == 2 and grown2["num_heads"] == 3
    assert grown2["training"]["heldout_zero_init_top1"] == pytest.approx(before["training"]["heldout_top1"])
    assert grown2["training"]["heldout_top1"] != before["training"]["heldout_top1"]
    assert _load_heads(deeper)[0].blocks[2][1].weight.abs().sum() > 0  # the added blocks trained
    assert grown2["training"]["init_num_layers"] == 1
    assert "their 1 ResBlock(s) per head first, then zero-initialised ones" in (deeper / "README.md").read_text()
    # hidden states from a bfloat16 forward of the target (its lm_head then read from the checkpoint): the
    # same figures up to bfloat16's rounding
    argv = [a for a in argv if a not in ("--init-from", str(out))]
    assert main([*argv[:2], "--eval-only", "--feature-dtype", "bfloat16", *argv[2:]]) == 0
    again = json.loads((more / "config.json").read_text())["training"]
    assert again["heldout_top1"] == pytest.approx(grown["training"]["heldout_top1"], abs=0.05)


def test_train_medusa_token_input(tiny_llama, tiny_prompts, cache_dir, tmp_path, capsys):
    """``--token-input``: heads whose first blocks also read the embedding of token t+1. Grown from trained
    heads, their held-out figures at init are those heads' (the token weights start at zero); trained, the
    weights move and the held-out top-1 rises; the replay of greedy decoding with their chains is what
    the engine does with them (the same token t+1 in training as the engine's root token)."""
    from specserve.entrypoints.cli import main
    from specserve.train.medusa import MedusaTrainArgs, train_medusa

    base = tmp_path / "base"
    common = ["--model", str(tiny_llama), "--prompts", str(tiny_prompts), "--num-prompts", "40", "--max-tokens",
              "24", "--threads", "1", "--cache-dir", str(cache_dir), "--no-progress", "--batch-size", "64"]
    assert main(["train", "medusa", "--out", str(base), *common, "--epochs", "2", "--lr", "1e-2",
                 "--num-heads", "3", "--draft-vocab-size", "100"]) == 0
    before = json.loads((base / "config.json").read_text())
    out = tmp_path / "tok"
    assert main(["train", "medusa", "--out", str(out), "--init-from", str(base), "--token-input", *common,
                 "--epochs", "3", "--lr", "1e-2"]) == 0
    assert "reads the embedding of token t+1" in capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["token_input"] is True and cfg["num_heads"] == 3 and cfg["draft_vocab_size"] == 100
    tr = cfg["training"]
    assert tr["heldout_zero_init_top1"] == pytest.approx(before["training"]["heldout_top1"])
    assert tr["heldout_top1"][0] > before["training"]["heldout_top1"][0]
    heads, _ = _load_heads(out)
    assert all(blocks[0].token_weight.abs().sum() > 0 for blocks in heads.blocks)
    assert "reading the target's embedding of token t+1" in (out / "README.md").read_text()
    res = train_medusa(MedusaTrainArgs(out=str(out), eval_only=True, model=str(tiny_llama),
                                       prompts_file=str(tiny_prompts), num_prompts=40, max_tokens=24, threads=1,
                                       cache_dir=str(cache_dir), progress=False), log=lambda m: None)
    assert res["heldout"]["top1"] == pytest.approx(tr["heldout_top1"], abs=1e-5)
    chain = {"method": "medusa", "model": str(out), "medusa_tree": None, "medusa_verify": "full"}
    assert_replay_is_decoding(tiny_llama, chain, res["heldout_samples"], 24, res["heldout"]["decode"])
    with pytest.raises(ValueError, match="--token-input needs --num-layers >= 1"):
        MedusaTrainArgs(out=str(out), token_input=True, num_layers=0).validate()


def test_grown_heads_compute_what_the_heads_computed():
    from specserve.spec_decode.medusa.model import MedusaConfig, MedusaHeads
    from specserve.train.medusa import grow_blocks

    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=16, vocab_size=40, shared_lm_head=True,
                                     bias=True, base_model="test", draft_vocab_size=24))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        heads.token_map.copy_(torch.randperm(40, generator=g)[:24])
    grown = grow_blocks(heads, 3)
    assert grown.cfg.num_layers == 3 and [len(b) for b in grown.blocks] == [3, 3]
    assert torch.equal(grown.token_map, heads.token_map)
    x = torch.randn(5, 16, generator=g)
    with torch.no_grad():
        assert torch.equal(grown.head_states(x), heads.head_states(x))
        for p in grown.blocks[0][2].parameters():  # an added block is trainable from zero: x + SiLU(W x + b)
            p.add_(0.1)
        assert not torch.equal(grown.head_states(x), heads.head_states(x))
    reading = grow_blocks(heads, 1, token_input=True)  # the first blocks read token t+1 through U = 0
    e = torch.randn(5, 16, generator=g)
    with torch.no_grad():
        assert reading.cfg.token_input and torch.equal(reading.head_states(x, e), heads.head_states(x))
        reading.blocks[1][0].token_weight.add_(0.1)
        assert not torch.equal(reading.head_states(x, e), heads.head_states(x))


@pytest.mark.parametrize("true_t", [0.5, 2.0])
def test_fit_head_temperatures_recovers_the_sampling_temperature(true_t):
    """Labels drawn from softmax(z / T) for a head whose logits are z: temperature scaling finds T."""
    from specserve.spec_decode.medusa.model import MedusaConfig, MedusaHeads
    from specserve.train.medusa import fit_head_temperatures

    g = torch.Generator().manual_seed(0)
    V, d, n = 40, 16, 4096
    heads = MedusaHeads(MedusaConfig(num_heads=2, num_layers=1, hidden_size=d, vocab_size=V, shared_lm_head=True,
                                     bias=True))  # zero-initialised blocks: each head's state is h itself
    lm_w = torch.randn(V, d, generator=g)
    H = torch.randn(n, d, generator=g)
    z = H @ lm_w.T
    y = torch.multinomial(torch.softmax(z / true_t, -1), 1, generator=g).squeeze(1)
    labels = torch.stack([y, y, y], dim=1)  # column 0: the base head's label (unused)
    labels[:100, 2] = IGNORE  # ignored labels do not count
    temps = fit_head_temperatures(heads, H, labels, lm_w, None)
    assert len(temps) == 2 and all(0.8 * true_t < t < 1.25 * true_t for t in temps), temps
