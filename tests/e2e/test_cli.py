"""The ``specserve`` command driven as a user would: ``python -m specserve ...`` in a subprocess, on the
real default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def specserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specserve", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_generate_streams_text_and_stats():
    r = specserve("generate", "--prompt", "Once upon a time", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no text on stdout"
    assert r.stdout.endswith("\n")
    assert "Traceback" not in r.stderr
    assert "8 tokens" in r.stderr and "tok/s" in r.stderr and "finish_reason=length" in r.stderr


def test_generate_with_ngram_drafts():
    r = specserve("generate", "--prompt", "1, 2, 3, 4, 5, 6, 7, 8,", "--max-tokens", "12",
                  "--speculative-method", "ngram", "--num-speculative-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "mean acceptance length" in r.stderr and r.stdout.strip()


def test_generate_chat_answers_paris():
    r = specserve("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize("args, expected", [
    (["generate", "--model", "/nonexistent/model-dir", "--prompt", "hi"], "/nonexistent/model-dir"),
    (["bench", "--methods", "none,nope"], "unknown method(s) 'nope'; presets: none, ngram, ngram-chain, medusa"),
    (["bench", "--speculative-config", "x={oops"], "--speculative-config x: not valid JSON"),
    (["generate", "--prompt", "hi", "--speculative-method", "nope"], "unknown speculative method 'nope'"),
])
def test_user_errors_exit_2_without_traceback(args, expected):
    r = specserve(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and expected in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bench_none_hf_ngram_float32(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    r = specserve("bench", "--methods", "none,hf,ngram-chain", "--num-prompts", "2", "--max-tokens", "8", "--dtype",
                  "float32", "--json", str(out), "--speculation-gate", "off")  # every step drafts: counted below
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stdout and "ours/hf" in r.stdout and "interleaved prompt by prompt" in r.stdout
    assert "speculation gate off" in r.stdout
    rows = json.loads(out.read_text())
    assert all(row["interleaved"] for row in rows)
    assert [(row["method"], row["dtype"]) for row in rows] == [("none", "float32"), ("hf", "float32"),
                                                                 ("ngram-chain", "float32")]
    assert "ms/step" in r.stdout and "verified/step" in r.stdout
    ngram = rows.pop()
    assert ngram["identical_to_none"] is True and ngram["mean_acceptance_length"] >= 1.0
    assert ngram["num_draft_tokens"] > 0 and len(ngram["acceptance_rate_per_position"]) <= 5
    # where the steps' time went: plain decoding verifies one token a step and drafts nothing; vLLM's
    # n-gram drafting verifies its drafts (at least the tokens it accepts), each step drafting a little
    assert rows[0]["verified_tokens_per_step"] == 1.0 and rows[0]["draft_ms_per_step"] == 0.0
    assert 0 < rows[0]["ms_per_step"] and "ms_per_step" not in rows[1]  # hf: not our engine
    assert ngram["verified_tokens_per_step"] > 1.0
    assert ngram["verified_tokens_per_step"] >= ngram["mean_acceptance_length"]
    assert 0 < ngram["draft_ms_per_step"] < ngram["ms_per_step"]
    for row in rows:
        for key in ("tokens_per_s", "speedup_vs_none", "num_prompts", "max_tokens", "temperature", "generated_tokens",
                    "identical_to_none", "mean_acceptance_length", "acceptance_rate_per_position"):
            assert key in row, key
        assert row["num_prompts"] == 2 and row["max_tokens"] == 8 and row["temperature"] == 0.0
        assert 0 < row["generated_tokens"] <= 16 and row["tokens_per_s"] > 0
        assert row["mean_acceptance_length"] == 1.0 and row["acceptance_rate_per_position"] == []
        assert row["identical_to_none"] is True, row
    assert rows[0]["speedup_vs_none"] == 1.0
    assert rows[1]["speedup_vs_none"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], rel=1e-3)


@pytest.mark.multiproc
def test_bench_tp2_replicated_vs_sharded_markov_head(tmp_path):
    """The TP comparison row shape: both DSpark rows identical to plain decoding under TP=2, the
    replicated Markov head's drafting step runs only the backbone's two collectives, the sharded one
    two more per draft position."""
    out = tmp_path / "bench.json"
    r = specserve("bench", "--methods", "none,dspark,dspark-sharded", "--num-prompts", "1", "--max-tokens", "8",
                  "--dtype", "float32", "--threads", "2", "--tensor-parallel-size", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "over 2 TP ranks" in r.stdout and "coll/draft step" in r.stdout
    rows = {row["method"]: row for row in json.loads(out.read_text())}
    assert all(row["tensor_parallel_size"] == 2 and row["collectives_per_token"] > 0 for row in rows.values())
    assert rows["dspark"]["identical_to_none"] and rows["dspark-sharded"]["identical_to_none"]
    # replicated: the block embedding's all-reduce (+ the base logits' gather when the drafter uses the
    # target's sharded lm_head); sharded: + an all-reduce (W1) and a gather (W2) per position (block 7)
    rep, sh = rows["dspark"]["collectives_per_draft_step"], rows["dspark-sharded"]["collectives_per_draft_step"]
    assert rep["all_reduce"] == 1 and rep.get("all_gather", 0) <= 1
    assert sh["all_reduce"] - rep["all_reduce"] == 7 and sh["all_gather"] - rep.get("all_gather", 0) == 7
    assert "collectives_per_draft_step" not in rows["none"]
    r = specserve("bench", "--methods", "none,hf", "--tensor-parallel-size", "2")
    assert r.returncode != 0 and "one process" in r.stderr


def test_convert_default_gguf(tmp_path):
    from specserve.models.loader import default_gguf_path

    out = tmp_path / "hf"
    r = specserve("convert", str(default_gguf_path()), str(out))
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_demo_in_bfloat16_gives_plain_decodings_text():
    """``specserve demo --dtype bfloat16``: on a CPU that packs bfloat16 weights the forwards are
    batch-invariant, so both drafters' answers are plain bfloat16 decoding's, token for token: the
    streamed one and the timed held-out prompts of every category."""
    import torch

    from specserve.layers.linear import mkldnn_packing_available

    if not mkldnn_packing_available(torch.bfloat16):
        pytest.skip("no bfloat16 weight packing on this CPU")
    r = specserve("demo", "--dtype", "bfloat16", "--threads", "2")  # the GGUF's own quantized weights
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("(bfloat16, gguf weights, 2 CPU threads)") == 3
    assert r.stdout.count("text identical") == 2 and "DIFFERENT" not in r.stdout, r.stdout
    from specserve.bench.categories import category_prompts

    timed = len(category_prompts("categories", 1))
    assert r.stdout.count(f"{timed}/{timed} answers identical") == 2 and "a bug" not in r.stdout, r.stdout
    assert r.stdout.count("x tokens/s (request wall time") == 2


def test_bench_drafter_checkpoint_by_path(tmp_path):
    """A ``--speculative-config`` row runs the drafter at its ``model``: here the shipped DFlash drafter
    through the dspark method, which accepts what the ``dflash`` row accepts, not what the shipped
    DSpark drafter does (chains, every step drafting: the default trees and the speculation gate follow
    timings, which differ run to run)."""
    from specserve.spec_decode.dspark.proposer import SHIPPED_DIR

    ck = SHIPPED_DIR / "dflash-smollm2-135m"
    out = tmp_path / "bench.json"
    r = specserve("bench", "--methods", "dspark-chain,dflash-chain", "--prompts", "chitchat-heldout",
                  "--speculation-gate", "off",
                  "--speculative-config", "by-path=" + json.dumps({"method": "dspark", "model": str(ck),
                                                                   "dspark_tree": None}),
                  "--num-prompts", "2", "--max-tokens", "32", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = {row["method"]: row for row in json.loads(out.read_text())}
    assert all(row["identical_to_none"] is True for row in rows.values())
    by_path = rows["by-path"]
    for key in ("acceptance_rate_per_position", "mean_acceptance_length", "num_draft_tokens"):
        assert by_path[key] == rows["dflash-chain"][key], key
    assert by_path["acceptance_rate_per_position"] != rows["dspark-chain"]["acceptance_rate_per_position"]


def test_num_speculative_tokens_defaults_to_the_drafters_own():
    """Without --num-speculative-tokens each drafter keeps its own count (DSpark: every draft of its
    block of 7, not a fixed 5)."""
    from specserve import LLM
    from specserve.entrypoints.cli import build_parser, speculative_config_from_args

    p = build_parser()
    args = p.parse_args(["generate", "--prompt", "x", "--speculative-method", "dspark"])
    cfg = speculative_config_from_args(args)
    assert cfg == {"method": "dspark"}
    llm = LLM(speculative_config=cfg)
    assert llm.engine.proposer.num_speculative_tokens == 7
    llm.shutdown()
    args = p.parse_args(["generate", "--prompt", "x", "--speculative-method", "ngram", "--num-speculative-tokens", "3"])
    assert speculative_config_from_args(args) == {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def test_speculative_config_json_flag():
    """``--speculative-config JSON`` (vLLM's flag) carries any drafter option; the other flags add to it,
    and a contradiction or a bad JSON is a usage error (exit 2), not a traceback."""
    from specserve.entrypoints.cli import CLIError, build_parser, speculative_config_from_args

    p = build_parser()
    args = p.parse_args(["generate", "--prompt", "x", "--speculative-config",
                         '{"method": "dspark", "dspark_tree": "auto"}', "--num-speculative-tokens", "4"])
    assert speculative_config_from_args(args) == {"method": "dspark", "dspark_tree": "auto",
                                                  "num_speculative_tokens": 4}
    args = p.parse_args(["generate", "--prompt", "x", "--speculative-config", '{"method": "ngram"}'])
    assert speculative_config_from_args(args) == {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    for bad, match in ((["--speculative-config", '{"method": "dspark"}', "--speculative-method", "medusa"],
                        "contradicts"), (["--speculative-config", '{"dspark_tree": 4}'], "needs a")):
        with pytest.raises(CLIError, match=match):
            speculative_config_from_args(p.parse_args(["generate", "--prompt", "x", *bad]))
    r = specserve("generate", "--prompt", "Hi", "--max-tokens", "8", "--temperature", "0",
                  "--speculative-config", '{"method": "dspark", "dspark_tree": 6}')
    assert r.returncode == 0, r.stderr
    assert "dspark: mean acceptance length" in r.stderr
    for bad in ('{"method": "dspark"', '["dspark"]'):
        r = specserve("generate", "--prompt", "Hi", "--speculative-config", bad)
        assert r.returncode == 2 and "--speculative-config" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = specserve("generate", "--prompt", "Hi", "--speculative-config", '{"method": "dspark", "dspark_tree": 0}')
    assert r.returncode == 2 and "dspark_tree must be" in r.stderr and "Traceback" not in r.stderr, r.stderr
