"""The trained drafter on disk: its ``config.json`` (DeepSpec format, or speculators format for a
pruned draft vocabulary) and ``model.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def checkpoint_config(cfg, tcfg, *, num_anchors: int, temperatures: list[float] | None = None,
                      training: dict | None = None) -> dict:
    """The ``config.json`` of drafter ``cfg`` for target ``tcfg``: DeepSpec format, or speculators format
    (``speculators_model_type: "dspark"``; ``markov_rank: 0`` for a DFlash baseline) for a pruned draft
    vocabulary, which DeepSpec configs cannot express."""
    decoder = {
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
    }
    if cfg.rope_scaling:
        decoder["rope_scaling"] = dict(cfg.rope_scaling)
    heads = {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "num_target_layers": tcfg.num_hidden_layers,
        "num_anchors": num_anchors,
        "sample_from_anchor": True,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
    }
    if cfg.pruned_vocab:
        c = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
             "transformer_layer_config": {**decoder, "model_type": "qwen3"}, "target_hidden_size": cfg.hidden_size,
             "draft_vocab_size": cfg.draft_vocab_size, "aux_hidden_state_layer_ids": list(cfg.target_layer_ids),
             **heads, "torch_dtype": "bfloat16",
             "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                    "speculative_tokens": cfg.num_drafts}}
    else:
        c = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", **decoder, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "target_layer_ids": list(cfg.target_layer_ids), **heads}
    if temperatures is not None:
        c["confidence_temperatures"] = [round(float(t), 6) for t in temperatures]
    if training is not None:
        c["training"] = training
    return c


def save_checkpoint(out, drafter, config: dict) -> None:
    """``config.json`` + ``model.safetensors`` (floating tensors in bfloat16)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
          for k, v in drafter.state_for_save().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
