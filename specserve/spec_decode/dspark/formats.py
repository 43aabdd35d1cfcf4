"""Read DFlash / DSpark drafter checkpoints into our names.

``load_dspark_checkpoint(path, target_cfg)`` returns ``(DSparkConfig, state dict)`` with the state
dict in our names (``expected_state_shapes(cfg)``: float tensors in their stored dtype, ``d2t`` as int64), ready
for ``DFlashDrafter(cfg).load_state(sd)``. ``path`` is the checkpoint directory (``config.json`` +
``*.safetensors``, optionally sharded with ``model.safetensors.index.json``); ``target_cfg`` is the
target's ``ModelConfig``, checked against the drafter (``DSparkConfig.validate``).

Formats, detected from ``config.json``:

1. **speculators** (``speculators_model_type: "dspark" | "dflash"``): the draft decoder in
   ``transformer_layer_config`` (its ``vocab_size`` is the target's), ``draft_vocab_size``,
   ``block_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``sample_from_anchor`` (missing
   = false: the mask-only 1+N layout), the Markov / confidence fields. Weights add ``t2d`` (bool
   [V]) and/or ``d2t`` (offsets [V_draft]) and, for a pruned vocabulary, ``lm_head.weight``
   [V_draft, d]. A full-vocabulary ``lm_head`` / ``embed_tokens`` copy is ignored (we use the target's).
2. **z-lab DFlash** (``dflash_config: {target_layer_ids, mask_token_id}`` + ``block_size``): a Qwen3
   config whose ``num_hidden_layers`` is the draft depth; always mask-only, no Markov head.
3. **DeepSpec** (``architectures: ["Qwen3DSparkModel"]``): the target config plus ``block_size``,
   ``mask_token_id``, ``target_layer_ids``, ``markov_rank``, ``markov_head_type``,
   ``enable_confidence_head``, ``confidence_head_with_markov`` (``num_hidden_layers`` = draft depth).
   Always anchor-first, DFlash baselines included (they are ``markov_rank: 0``). The
   ``embed_tokens`` / ``lm_head`` copies of the target's are ignored.

The layout (anchor-first vs mask-only) always comes from the format and its config, never from a
guess. Every error is a ``CheckpointError`` naming the field or tensor at fault.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.config import UnsupportedModelError, _rope_scaling
from specserve.models.loader import CheckpointError, read_json_object, read_tensors, weight_files
from specserve.spec_decode.dspark.config import DSparkConfig, d2t_from_t2d, expected_state_shapes

__all__ = ["load_dspark_checkpoint", "detect_format", "SUPPORTED_FORMATS"]

SUPPORTED_FORMATS = (
    'speculators (config.json with speculators_model_type "dspark" or "dflash"); '
    "z-lab DFlash (config.json with dflash_config.{target_layer_ids, mask_token_id}); "
    'DeepSpec (config.json with architectures ["Qwen3DSparkModel"])'
)

DEEPSPEC_ARCHITECTURES = ("Qwen3DSparkModel",)

# checkpoint copies of target weights (or training-only tensors) that the drafter never reads
_ALWAYS_IGNORED = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


# ---- entry point --------------------------------------------------------------------------------


def detect_format(raw: dict) -> str:
    """``"speculators"``, ``"zlab"`` or ``"deepspec"`` for a parsed ``config.json``."""
    if "speculators_model_type" in raw:
        return "speculators"
    if "dflash_config" in raw:
        return "zlab"
    archs = raw.get("architectures") or []
    if any(a in DEEPSPEC_ARCHITECTURES for a in archs):
        return "deepspec"
    if any(str(a).endswith("DSparkModel") for a in archs):
        raise CheckpointError(f"architectures {archs}: only {', '.join(DEEPSPEC_ARCHITECTURES)} DeepSpec drafters "
                              "are supported")
    raise CheckpointError(f"config.json is not a recognised DFlash/DSpark drafter. Supported formats: "
                          f"{SUPPORTED_FORMATS}")


def load_dspark_checkpoint(path, target_cfg) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """Detect the format at ``path`` and return ``(config, state dict in our names)``.

    Raises ``FileNotFoundError`` for a missing path and ``CheckpointError`` for an unknown format, a
    config that does not fit the target, or a missing, unexpected or mis-shaped tensor."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"drafter checkpoint path does not exist: {path}")
    d = p if p.is_dir() else p.parent
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d}: no config.json (a DFlash/DSpark checkpoint is a directory with config.json "
                              "and *.safetensors)")
    raw = _read_json(d / "config.json")
    fmt = detect_format(raw)
    tensors = _read_weights(d)
    parse = {"speculators": _speculators_config, "zlab": _zlab_config, "deepspec": _deepspec_config}[fmt]
    cfg = parse(raw, tensors)
    try:
        cfg.validate(target_cfg)
    except CheckpointError as e:
        raise CheckpointError(f"{d}: {e}") from None
    ntl = raw.get("num_target_layers")
    if ntl is not None and int(ntl) != target_cfg.num_hidden_layers:
        raise CheckpointError(f"{d}: num_target_layers is {ntl}, the target model has "
                              f"{target_cfg.num_hidden_layers} layers (a drafter trained for another target)")
    sd = _map_weights(d, cfg, tensors)
    return cfg, sd


# ---- configs --------------------------------------------------------------------------------------


def _req(c: dict, key: str, where: str = ""):
    if c.get(key) is None:
        raise CheckpointError(f"config.json is missing {where}{key}")
    return c[key]


def _decoder_fields(c: dict, where: str = "") -> dict:
    """The draft decoder's architecture from an HF-style (Qwen3) config dict."""
    try:
        hidden = int(_req(c, "hidden_size", where))
        heads = int(_req(c, "num_attention_heads", where))
        rope_theta = c.get("rope_theta")
        if rope_theta is None:
            rope_theta = (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        out = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or hidden // heads),
            intermediate_size=int(_req(c, "intermediate_size", where)),
            num_layers=int(_req(c, "num_hidden_layers", where)),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=_rope_scaling(c),
            attention_bias=bool(c.get("attention_bias", False)),
            vocab_size=int(_req(c, "vocab_size", where)),
        )
    except UnsupportedModelError as e:
        raise CheckpointError(f"config.json {where}rope_scaling: {e}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json {where}: bad value ({e})") from None
    types = c.get("layer_types")
    if types and any(t != "full_attention" for t in types):
        raise CheckpointError(f"config.json {where}layer_types {types}: only full-attention draft layers are "
                              "supported (no sliding window)")
    act = c.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"config.json {where}hidden_act {act!r}: the drafter MLP is SwiGLU (silu)")
    return out


def _ids(v, key: str) -> list[int]:
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise CheckpointError(f"config.json {key} must be a list of layer ids, got {v!r}")
    return list(v)


def _opt_int(v, key: str):
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise CheckpointError(f"config.json {key} must be an integer, got {v!r}") from None


def _confidence_fields(raw: dict, tensors: dict, d: int, r: int) -> tuple[bool, bool]:
    """(enable_confidence_head, confidence_head_with_markov): from the config, or, when a field is
    absent, from the ``confidence_head.proj.weight`` tensor (its presence / its width d or d + r)."""
    w = tensors.get("confidence_head.proj.weight")
    enable = raw.get("enable_confidence_head")
    enable = (w is not None) if enable is None else bool(enable)
    with_markov = raw.get("confidence_head_with_markov")
    if with_markov is None:
        with_markov = bool(enable and w is not None and w.dim() == 2 and r > 0 and w.shape[1] == d + r)
    return enable, bool(with_markov)


def _deepspec_config(raw: dict, tensors: dict) -> DSparkConfig:
    dec = _decoder_fields(raw)
    r = int(raw.get("markov_rank") or 0)
    enable, with_markov = _confidence_fields(raw, tensors, dec["hidden_size"], r)
    return DSparkConfig(
        **dec,
        target_layer_ids=_ids(_req(raw, "target_layer_ids"), "target_layer_ids"),
        block_size=int(_req(raw, "block_size")),
        mask_token_id=_opt_int(raw.get("mask_token_id"), "mask_token_id"),
        sample_from_anchor=bool(raw.get("sample_from_anchor", True)),  # DeepSpec drafters are anchor-first
        markov_rank=r,
        markov_head_type=str(raw.get("markov_head_type") or "vanilla").lower(),
        enable_confidence_head=enable,
        confidence_head_with_markov=with_markov,
        draft_vocab_size=dec["vocab_size"],
        source_format="DeepSpec",
    )


def _speculators_config(raw: dict, tensors: dict) -> DSparkConfig:
    kind = raw.get("speculators_model_type")
    if kind not in ("dspark", "dflash"):
        raise CheckpointError(f"config.json speculators_model_type {kind!r}: expected \"dspark\" or \"dflash\"")
    tlc = raw.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise CheckpointError("config.json is missing transformer_layer_config (the draft decoder's config)")
    dec = _decoder_fields(tlc, "transformer_layer_config.")
    th = raw.get("target_hidden_size")
    if th is not None and int(th) != dec["hidden_size"]:
        raise CheckpointError(f"config.json target_hidden_size {th} differs from the draft hidden_size "
                              f"{dec['hidden_size']}: the drafter must share the target's hidden size")
    r = int(raw.get("markov_rank") or 0) if kind == "dspark" else 0
    enable, with_markov = (_confidence_fields(raw, tensors, dec["hidden_size"], r) if kind == "dspark"
                           else (False, False))
    dv = raw.get("draft_vocab_size")
    return DSparkConfig(
        **dec,
        target_layer_ids=_ids(_req(raw, "aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
        block_size=int(_req(raw, "block_size")),
        mask_token_id=_opt_int(raw.get("mask_token_id"), "mask_token_id"),
        sample_from_anchor=bool(raw.get("sample_from_anchor", False)),  # missing = the 1+N mask-only layout
        markov_rank=r,
        markov_head_type=str(raw.get("markov_head_type") or "vanilla").lower(),
        enable_confidence_head=enable,
        confidence_head_with_markov=with_markov,
        draft_vocab_size=int(dv) if dv is not None else dec["vocab_size"],
        source_format=f"speculators {kind}",
        source_fields={"target_layer_ids": "aux_hidden_state_layer_ids",
                       "vocab_size": "transformer_layer_config.vocab_size",
                       "hidden_size": "transformer_layer_config.hidden_size",
                       "num_layers": "transformer_layer_config.num_hidden_layers"},
    )


def _zlab_config(raw: dict, tensors: dict) -> DSparkConfig:
    dc = raw.get("dflash_config")
    if not isinstance(dc, dict):
        raise CheckpointError("config.json dflash_config must be an object with target_layer_ids and mask_token_id")
    dec = _decoder_fields(raw)
    block = raw.get("block_size", dc.get("block_size"))
    if block is None:
        raise CheckpointError("config.json is missing block_size")
    return DSparkConfig(
        **dec,
        target_layer_ids=_ids(_req(dc, "target_layer_ids", "dflash_config."), "dflash_config.target_layer_ids"),
        block_size=int(block),
        mask_token_id=_opt_int(dc.get("mask_token_id"), "dflash_config.mask_token_id"),
        sample_from_anchor=False,  # z-lab DFlash: [anchor, masks], drafts from slots 1..B-1
        draft_vocab_size=dec["vocab_size"],
        source_format="z-lab DFlash",
        source_fields={"target_layer_ids": "dflash_config.target_layer_ids",
                       "mask_token_id": "dflash_config.mask_token_id"},
    )


# ---- weights --------------------------------------------------------------------------------------


def _map_weights(d: Path, cfg: DSparkConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    want = expected_state_shapes(cfg)
    tensors = dict(tensors)
    t2d, d2t = tensors.pop("t2d", None), tensors.pop("d2t", None)
    sd: dict[str, torch.Tensor] = {}
    for src, t in tensors.items():
        name = src
        if name not in want and name.startswith("model.") and name[len("model."):] in want:
            name = name[len("model."):]
        if name in want:
            sd[name] = (src, t)
            continue
        base = name[len("model."):] if name.startswith("model.") else name
        if base in _ALWAYS_IGNORED or base.endswith("rotary_emb.inv_freq"):
            continue
        if base == "lm_head.weight" and not cfg.pruned_vocab:
            continue  # a copy of the target's head: we use the target's own
        if base.startswith(("markov_head.", "confidence_head.")):
            what = "markov_rank is 0" if base.startswith("markov_head.") and not cfg.has_markov else (
                "enable_confidence_head is false" if base.startswith("confidence_head.") and
                not cfg.enable_confidence_head else f"markov_head_type is {cfg.markov_head_type!r}")
            raise CheckpointError(f"{d}: tensor {src!r} is present but the config says {what}")
        raise CheckpointError(f"{d}: unexpected tensor {src!r} (shape {tuple(t.shape)}) in a {cfg.source_format} "
                              "checkpoint")

    if cfg.pruned_vocab:
        sd["d2t"] = ("d2t", _draft_to_target(d, cfg, t2d, d2t))
    else:
        if d2t is not None and bool((d2t != 0).any()):
            raise CheckpointError(f"{d}: d2t maps a full-size draft vocabulary (draft_vocab_size == vocab_size "
                                  f"{cfg.vocab_size}) onto other ids; only pruned vocabularies are supported")
        if t2d is not None and not bool(t2d.to(torch.bool).all()):
            raise CheckpointError(f"{d}: t2d leaves target tokens out but draft_vocab_size equals vocab_size "
                                  f"({cfg.vocab_size})")

    missing = [n for n in want if n not in sd]
    if missing:
        hint = ""
        if "lm_head.weight" in missing:
            hint = (f" (draft_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.vocab_size}: the pruned draft "
                    "lm_head must be in the checkpoint)")
        raise CheckpointError(f"{d}: {cfg.source_format} checkpoint is missing {', '.join(missing[:6])}"
                              + (" ..." if len(missing) > 6 else "") + hint)
    out: dict[str, torch.Tensor] = {}
    for name, shape in want.items():
        src, t = sd[name]
        if tuple(t.shape) != tuple(shape):
            hint = ""
            if name == "fc.weight":
                hint = f" ([hidden_size, {cfg.num_aux_layers} target layers x hidden_size])"
            elif name == "markov_head.markov_w1.weight" and cfg.pruned_vocab and t.shape[0] == cfg.draft_vocab_size:
                hint = " (W1 must be indexed by TARGET-vocabulary ids; this one has draft-vocabulary rows)"
            raise CheckpointError(f"{d}: tensor {src!r} has shape {tuple(t.shape)}, expected {tuple(shape)}{hint}")
        if name == "d2t":
            out[name] = t.to(torch.long).contiguous()
            continue
        if not t.is_floating_point():
            raise CheckpointError(f"{d}: tensor {src!r} has dtype {t.dtype}, expected a float type")
        out[name] = t.detach().contiguous()  # stored dtype: the engine's draft_dtype='auto' reads it
    return out


def _draft_to_target(d: Path, cfg: DSparkConfig, t2d, d2t) -> torch.Tensor:
    """Validated ``d2t`` offsets [V_draft] from the checkpoint's ``d2t`` and/or ``t2d``."""
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    if t2d is not None:
        if tuple(t2d.shape) != (V,):
            raise CheckpointError(f"{d}: t2d has shape {tuple(t2d.shape)}, expected ({V},)")
        if t2d.dtype != torch.bool and not bool(((t2d == 0) | (t2d == 1)).all()):
            raise CheckpointError(f"{d}: t2d must be a boolean mask over the target vocabulary")
        t2d = t2d.to(torch.bool)
        if int(t2d.sum()) != Vd:
            raise CheckpointError(f"{d}: t2d selects {int(t2d.sum())} tokens but draft_vocab_size is {Vd}")
        derived = d2t_from_t2d(t2d)
        if d2t is not None:
            if tuple(d2t.shape) != (Vd,) or not torch.equal(d2t.to(torch.long), derived):
                raise CheckpointError(f"{d}: d2t disagrees with t2d (draft_id + d2t[draft_id] must list t2d's "
                                      "target ids in order)")
        return derived
    if d2t is None:
        raise CheckpointError(f"{d}: draft_vocab_size {Vd} < vocab_size {V} but the checkpoint has neither d2t "
                              "nor t2d (the draft -> target vocabulary map)")
    if tuple(d2t.shape) != (Vd,):
        raise CheckpointError(f"{d}: d2t has shape {tuple(d2t.shape)}, expected ({Vd},)")
    if d2t.is_floating_point():
        raise CheckpointError(f"{d}: d2t has dtype {d2t.dtype}, expected integer offsets")
    target = torch.arange(Vd) + d2t.to(torch.long)
    if bool((target < 0).any()) or bool((target >= V).any()) or target.unique().numel() != Vd:
        raise CheckpointError(f"{d}: d2t maps draft ids outside the target vocabulary [0, {V}) or onto the "
                              "same target id twice")
    return d2t.to(torch.long)


# ---- file reading ---------------------------------------------------------------------------------


def _read_json(f: Path) -> dict:
    return read_json_object(f, missing_ok=False)


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    files = weight_files(d)
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors weights")
    return read_tensors(files)
