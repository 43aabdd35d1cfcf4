"""DSpark / DFlash drafting through the engine: lossless for greedy and probabilistic drafting."""

import json

import pytest
import torch
from safetensors.torch import save_file

from specserve import LLM, SamplingParams
from specserve.spec_decode.dspark_model import DSparkConfig, expected_state_shapes

from test_spec_engine import assert_same_distribution, sample_prefixes

PROMPTS = [[5, 17, 42, 99, 3], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def write_random_drafter(path, target_dir, markov_rank=8, head_type="vanilla", seed=0, scale=0.3, block=4):
    """A random DeepSpec-format drafter for a tiny target (reads the target's config)."""
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
        sd[name] = (base + scale * torch.randn(shape, generator=g)).contiguous()
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
    ("dflash", 0, "greedy", "full"), ("dspark", 8, "greedy", "full-gated"),
])
def test_greedy_identical_to_plain(tiny_llama, tmp_path, method, rank, sample, verify):
    head = "gated" if verify == "full-gated" else "vanilla"
    drafter = write_random_drafter(tmp_path / "d", tiny_llama, markov_rank=rank, head_type=head)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), dtype="float32", speculative_config={
        "method": method, "model": str(drafter), "draft_sample_method": sample,
        "dspark_verify": verify.split("-")[0], "confidence_threshold": 0.5})
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("sample", ["greedy", "probabilistic"])
def test_distribution_matches_plain_sampling(small_vocab_model, tmp_path, sample):
    drafter = write_random_drafter(tmp_path / "d", small_vocab_model, scale=0.6)
    plain = LLM(model=str(small_vocab_model), dtype="float32", max_num_seqs=64)
    spec = LLM(model=str(small_vocab_model), dtype="float32", max_num_seqs=64, speculative_config={
        "method": "dspark", "model": str(drafter), "draft_sample_method": sample})
    a = sample_prefixes(plain, 2000, 0, k=5)
    b = sample_prefixes(spec, 2000, 100_000, k=5)
    assert spec.get_metrics()["num_accepted_tokens"] > 100
    assert_same_distribution(a, b)


def test_dspark_errors(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="does not match|hidden|vocab|needs a drafter checkpoint"):
        LLM(model=str(tiny_llama), speculative_config={"method": "dspark"})  # the default model's drafter
    drafter = write_random_drafter(tmp_path / "d", tiny_llama)
    with pytest.raises(ValueError, match="exceeds the drafter's 4 drafts"):
        LLM(model=str(tiny_llama), speculative_config={"method": "dspark", "model": str(drafter),
                                                       "num_speculative_tokens": 6})
