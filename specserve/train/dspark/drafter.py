"""The drafter a training run starts from: its config for a target, random initial weights, a
loaded drafter grown by layers or by draft-vocabulary tokens, and its draft vocabulary."""

from __future__ import annotations

import dataclasses

import torch

from specserve.spec_decode.dspark.config import DSparkConfig
from specserve.spec_decode.dspark.drafting import draft_target_ids


def drafter_config(tcfg, *, num_layers: int, block_size: int, layer_ids: list[int], mask_token_id: int,
                   markov_rank: int, markov_head_type: str = "vanilla", draft_vocab_size: int = 0):
    """A DSpark (anchor-first) drafter for the target ``tcfg`` (a ``ModelConfig``): the target's
    hidden size, head layout, MLP width, norm eps and RoPE, ``num_layers`` draft layers, a
    confidence head (reading ``W1[x_{k-1}]`` too when there is a Markov head). ``draft_vocab_size``
    0 (or >= the target's): the target's vocabulary and lm_head; else a pruned draft vocabulary with
    the drafter's own lm_head and ``d2t`` (set by ``set_draft_vocab_``)."""
    return DSparkConfig(
        hidden_size=tcfg.hidden_size, num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads, head_dim=tcfg.head_dim,
        intermediate_size=tcfg.intermediate_size, num_layers=num_layers, rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=tcfg.rope_theta, rope_scaling=tcfg.rope_scaling, target_layer_ids=list(layer_ids),
        block_size=block_size, mask_token_id=mask_token_id, sample_from_anchor=True, markov_rank=markov_rank,
        markov_head_type=markov_head_type, enable_confidence_head=True, confidence_head_with_markov=markov_rank > 0,
        vocab_size=tcfg.vocab_size,
        draft_vocab_size=draft_vocab_size if 0 < draft_vocab_size < tcfg.vocab_size else tcfg.vocab_size,
        source_format="specserve train dspark")


def set_draft_vocab_(drafter, vocab_ids: torch.Tensor, lm_w: torch.Tensor) -> None:
    """Point a pruned drafter at the draft vocabulary ``vocab_ids`` (sorted target ids): ``d2t`` offsets
    and its lm_head initialised from those rows of the target's lm_head ``lm_w`` [V, d]."""
    with torch.no_grad():
        drafter.d2t.copy_(vocab_ids - torch.arange(vocab_ids.numel()))
        drafter.lm_head.weight.copy_(lm_w[vocab_ids].to(drafter.lm_head.weight.dtype))


def grow_draft_vocab(cfg, sd: dict[str, torch.Tensor], new_ids: torch.Tensor, lm_w: torch.Tensor):
    """(config, state dict) of a pruned drafter (``cfg``, ``sd``) whose draft vocabulary becomes
    ``new_ids`` (sorted target ids, a superset of the old ones): the rows of every draft-vocabulary
    tensor (lm_head, W2 of the Markov head) move with their tokens; a new token's lm_head row is the
    target's (``lm_w`` [V, d], as ``set_draft_vocab_`` starts one) and its W2 row zero (no Markov bias
    yet); ``d2t`` points at the new ids. Raises ``ValueError`` unless the old ids are all kept."""
    old_ids = draft_target_ids(sd["d2t"])
    where = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    where[old_ids] = torch.arange(old_ids.numel())
    src = where[new_ids]
    kept = src >= 0
    if int(kept.sum()) != old_ids.numel():
        raise ValueError("a grown draft vocabulary must keep every token of the old one")
    out = dict(sd)
    lm = lm_w[new_ids].to(sd["lm_head.weight"].dtype).clone()
    lm[kept] = sd["lm_head.weight"][src[kept]]
    out["lm_head.weight"] = lm
    name = "markov_head.markov_w2.weight"
    if name in sd:
        w2 = sd[name].new_zeros(new_ids.numel(), sd[name].shape[1])
        w2[kept] = sd[name][src[kept]]
        out[name] = w2
    out["d2t"] = (new_ids - torch.arange(new_ids.numel())).to(sd["d2t"].dtype)
    return dataclasses.replace(cfg, draft_vocab_size=int(new_ids.numel())), out


def draft_vocab_ids(drafter) -> torch.Tensor | None:
    """The target ids of a pruned drafter's draft vocabulary [V_draft] (None: the full vocabulary)."""
    return draft_target_ids(drafter.d2t)


def init_drafter_(drafter, std: float = 0.02) -> None:
    """Initialise every weight and make it trainable: linear weights N(0, std), biases 0, norms 1,
    Markov W1 N(0, 1) and W2 = 0 (the bias starts at 0: the drafter starts as its DFlash backbone),
    the confidence head's nn.Linear default with bias 0. Uses the global torch RNG."""
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name == "markov_head.markov_w1.weight":
                p.normal_(0.0, 1.0)
            elif name == "markov_head.markov_w2.weight":
                p.zero_()
            elif name.endswith("bias"):
                p.zero_()
            elif name.startswith(("markov_head.", "confidence_head.")):
                pass  # nn.Linear's own init (already done)
            else:
                p.normal_(0.0, std)
            p.requires_grad_(True)


def grow_drafter_(drafter, sd: dict[str, torch.Tensor], num_loaded: int) -> None:
    """Load ``sd``, the state of a drafter with the first ``num_loaded`` of ``drafter``'s layers, and give
    the layers after them ``init_drafter_``'s random weights with the attention and MLP output projections
    zero: each new layer adds nothing to the residual stream, so the grown drafter drafts exactly what the
    loaded one did and training starts from there. Uses the global torch RNG."""
    init_drafter_(drafter)
    full = {**drafter.state_for_save(), **sd}
    for i in range(num_loaded, len(drafter.layers)):
        for name in (f"layers.{i}.self_attn.o_proj.weight", f"layers.{i}.mlp.down_proj.weight"):
            full[name] = torch.zeros_like(full[name])
    drafter.load_state(full)


def growable_vocab(cfg, sd: dict, size: int) -> torch.Tensor:
    """The draft vocabulary (target ids) of the loaded drafter ``cfg``/``sd`` that ``--draft-vocab-size
    size`` grows; ``ValueError`` unless it is pruned and smaller than ``size``, itself below the target's."""
    if not cfg.pruned_vocab:
        raise ValueError(f"--draft-vocab-size {size} with --init-from grows a pruned draft vocabulary; the loaded "
                         f"drafter drafts over the target's whole vocabulary ({cfg.vocab_size})")
    if not cfg.draft_vocab_size < size < cfg.vocab_size:
        raise ValueError(f"--draft-vocab-size {size} with --init-from must grow the loaded drafter's draft "
                         f"vocabulary: more than its {cfg.draft_vocab_size}, fewer than the target's {cfg.vocab_size}")
    return draft_target_ids(sd["d2t"])
