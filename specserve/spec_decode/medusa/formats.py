"""Read Medusa head checkpoints of the common published layouts into our names.

``load_medusa_checkpoint(path, hidden_size, vocab_size)`` returns ``(MedusaConfig, state_dict)``
with the state dict in our names (``blocks.{h}.{l}.weight|bias``, ``blocks.{h}.0.token_weight``,
``lm_heads.{h}.weight``, float32),
ready for ``MedusaHeads(cfg).load_state(sd)``. ``path`` is a directory, or a single weights file
(``.safetensors`` / ``.pt`` / ``.bin``) whose ``config.json``, if any, sits next to it.

Supported layouts, detected in this order:

1. **specserve-medusa** (ours): ``config.json`` with ``"format": "specserve-medusa"`` and
   ``medusa.safetensors``. The config is authoritative: any disagreement with the weights is an error.
2. **vLLM** ``MedusaModel``: ``config.json`` with ``model_type: "medusa"`` or
   ``architectures: ["MedusaModel"]``; weights ``blocks.{i}.layers.{j}.weight`` (+ ``.bias`` when
   ``medusa_fc_bias``), ``lm_heads.{i}.weight``, optionally under a ``medusa_heads.`` prefix. Config
   keys are renamed like vLLM does (any key with "num" and "heads" -> ``num_heads``, "num" and "layers"
   -> ``num_hidden_layers``). ``original_lm_head: true`` -> the heads share the target's ``lm_head``
   and any ``lm_heads.*`` tensor (a copy of the target's) is ignored. A truncated draft vocabulary
   (``truncated_vocab_size`` < ``vocab_size``) comes with a ``token_map`` tensor (its target ids); the
   own heads are then [truncated_vocab_size, d].
3. **FasterDecoding** (Medusa v0.1 / legacy training output): ``medusa_lm_head.safetensors`` or
   ``medusa_lm_head.pt`` with ``{h}.{l}.linear.weight|bias`` and ``{h}.{L}.weight`` (the head's own
   vocab projection; absent in "v2" checkpoints, which share the target's ``lm_head``).
4. **Medusa-2 full model**: a full model directory whose safetensors (single, several, or sharded
   with ``model.safetensors.index.json``) hold ``medusa_head.{h}.{l}.linear.weight|bias`` and
   ``medusa_head.{h}.{L}.weight`` next to the base weights; only the ``medusa_head.*`` tensors are read.

For the foreign layouts the weights are trusted over the config: head count, layer count, bias and
shared/own vocab projection are inferred from the tensors present, and a config that disagrees (the
published FasterDecoding configs say ``medusa_num_heads: 2`` for 5-head checkpoints) only warns.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from specserve.models.loader import (SAFETENSORS_INDEX, TORCH_INDEX, CheckpointError, iter_tensors, read_json_object,
                                     read_tensors, weight_files)
from specserve.spec_decode.medusa.model import FORMAT, MedusaConfig

__all__ = ["load_medusa_checkpoint", "SUPPORTED_FORMATS"]

SUPPORTED_FORMATS = (
    'specserve-medusa (config.json with "format": "specserve-medusa" + medusa.safetensors); '
    'vLLM MedusaModel (config.json with model_type "medusa", tensors blocks.{i}.layers.{j}.weight, '
    "lm_heads.{i}.weight); FasterDecoding Medusa v0.1/legacy (medusa_lm_head.safetensors or "
    "medusa_lm_head.pt, tensors {h}.{l}.linear.weight, {h}.{L}.weight); Medusa-2 full model "
    "(model safetensors holding medusa_head.{h}.* tensors)"
)

_WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")  # a directory's weights, when it has no index
_FD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")

_OURS_BLOCK = re.compile(r"^blocks\.(\d+)\.(\d+)\.(weight|bias)$")
_OURS_TOKEN = re.compile(r"^blocks\.(\d+)\.0\.token_weight$")  # ours only: ``token_input`` heads
_OURS_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")
_FD_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_FD_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")

Entries = dict[str, tuple[str, torch.Tensor]]  # our name -> (name in the checkpoint, tensor)


# ---- entry point --------------------------------------------------------------------------------


def load_medusa_checkpoint(path, hidden_size: int, vocab_size: int) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Detect the layout at ``path`` and return ``(config, state dict in our names, float32)``.

    Raises ``FileNotFoundError`` for a missing path and ``CheckpointError`` for an unknown layout, a
    head whose hidden size / vocabulary does not match the target, or a mis-shaped tensor."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"Medusa checkpoint path does not exist: {path}")
    if p.is_dir():
        d, weights_file = p, None
    else:
        if p.suffix not in _WEIGHT_SUFFIXES:
            raise CheckpointError(f"{p}: expected a Medusa checkpoint directory or a weights file "
                                  f"({', '.join(_WEIGHT_SUFFIXES)}); supported formats: {SUPPORTED_FORMATS}")
        d, weights_file = p.parent, p
    cfg = _read_json(d / "config.json")

    if cfg.get("format") == FORMAT:
        return _load_ours(p, d, weights_file, cfg, hidden_size, vocab_size)
    if cfg.get("model_type") == "medusa" or "MedusaModel" in (cfg.get("architectures") or []):
        return _load_vllm(p, d, weights_file, cfg, hidden_size, vocab_size)
    if weights_file is not None:
        return _load_faster_decoding(p, weights_file, cfg, hidden_size, vocab_size)
    for name in _FD_FILES:
        if (d / name).is_file():
            return _load_faster_decoding(p, d / name, cfg, hidden_size, vocab_size)
    found = _load_medusa2(p, d, cfg, hidden_size, vocab_size)
    if found is not None:
        return found
    hint = ""
    if "medusa_num_heads" in cfg:
        hint = (" (config.json has medusa_num_heads, but there is no medusa_lm_head.safetensors / "
                "medusa_lm_head.pt and no model safetensors with medusa_head.* tensors)")
    raise CheckpointError(f"{p}: not a recognised Medusa checkpoint{hint}. Supported formats: {SUPPORTED_FORMATS}")


# ---- the four layouts -----------------------------------------------------------------------------


def _load_ours(p: Path, d: Path, weights_file: Path | None, cfg: dict, hidden_size: int, vocab_size: int):
    f = weights_file or d / "medusa.safetensors"
    if not f.is_file():
        raise CheckpointError(f"{p}: specserve-medusa checkpoint without medusa.safetensors")
    for key, target in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if key in cfg and int(cfg[key]) != int(target):
            what = key.replace("_", " ")
            raise CheckpointError(f"{p}: Medusa heads have {what} {cfg[key]}, the target model has {target}")
    entries: Entries = {}
    token_map = None
    token_weights: dict[str, torch.Tensor] = {}
    for name, t in iter_tensors(f):
        if name == "token_map":
            token_map = t
            continue
        if _OURS_TOKEN.match(name):
            token_weights[name] = t
            continue
        if not (_OURS_BLOCK.match(name) or _OURS_HEAD.match(name)):
            raise CheckpointError(f"{f}: unexpected tensor {name!r} in a specserve-medusa checkpoint")
        entries[name] = (name, t)
    declared = {k: cfg.get(k) for k in ("num_heads", "num_layers", "bias")}
    declared["shared_lm_head"] = cfg.get("shared_lm_head")
    mcfg, sd = _assemble(p, entries, hidden_size, vocab_size, declared, strict=True,
                         base_model=cfg.get("base_model"), token_map=token_map,
                         draft_vocab_size=cfg.get("draft_vocab_size"))
    return _token_input(p, mcfg, sd, token_weights, bool(cfg.get("token_input", False)))


def _token_input(p: Path, cfg: MedusaConfig, sd: dict, weights: dict[str, torch.Tensor], declared: bool):
    """Our heads' ``token_weight`` tensors (``token_input``): one [d, d] for every head's first block, or
    none; the config must say which."""
    want = {f"blocks.{h}.0.token_weight" for h in range(cfg.num_heads)} if cfg.num_layers else set()
    if not weights and not declared:
        return cfg, sd
    if not declared:
        raise CheckpointError(f"{p}: the weights hold token_weight tensors but the config does not say "
                              "token_input: true")
    missing = sorted(want - set(weights))
    if missing or not want:
        raise CheckpointError(f"{p}: the config says token_input: true but the weights lack "
                              f"{', '.join(missing[:6]) or 'the residual blocks that read the token'}")
    extra = sorted(set(weights) - want)
    if extra:
        raise CheckpointError(f"{p}: unexpected tensor {extra[0]!r} (only heads 0..{cfg.num_heads - 1} exist)")
    d = cfg.hidden_size
    for name in sorted(want):
        t = weights[name]
        if tuple(t.shape) != (d, d) or not t.is_floating_point():
            raise CheckpointError(f"{p}: Medusa tensor {name!r} has {t.dtype} {tuple(t.shape)}, expected a float "
                                  f"type of shape {(d, d)}")
        sd[name] = t.detach().to(torch.float32).contiguous()
    cfg = replace(cfg, token_input=True)
    cfg.validate()
    return cfg, sd


def _load_vllm(p: Path, d: Path, weights_file: Path | None, cfg: dict, hidden_size: int, vocab_size: int):
    cfg = _vllm_rename(cfg)
    tvs, cv = cfg.get("truncated_vocab_size"), cfg.get("vocab_size")
    truncated = int(tvs) if tvs is not None and cv is not None and int(tvs) < int(cv) else None
    token_map = None
    files = [weights_file] if weights_file else weight_files(d, WEIGHT_PATTERNS, (SAFETENSORS_INDEX, TORCH_INDEX))
    if not files:
        raise CheckpointError(f"{p}: vLLM Medusa config.json but no weights (*.safetensors, *.bin, *.pt)")
    shared = bool(cfg.get("original_lm_head", False))
    entries: Entries = {}
    for f in files:
        for src, t in iter_tensors(f):
            name = src[len("medusa_heads."):] if src.startswith("medusa_heads.") else src
            if name == "token_map":
                token_map = t
                continue
            m = _VLLM_BLOCK.match(name)
            if m:
                entries[f"blocks.{m[1]}.{m[2]}.{m[3]}"] = (src, t)
                continue
            m = _VLLM_HEAD.match(name)
            if m or name == "lm_head.weight":
                if not shared:
                    if m is None:
                        raise CheckpointError(f"{f}: unexpected tensor {src!r} (original_lm_head is false)")
                    entries[f"lm_heads.{m[1]}.weight"] = (src, t)
                continue  # original_lm_head: a copy of the target's lm_head, ignored
            raise CheckpointError(f"{f}: unexpected tensor {src!r} in a vLLM Medusa checkpoint")
    declared = {"num_heads": cfg.get("num_heads"), "num_layers": cfg.get("num_hidden_layers"),
                "bias": bool(cfg.get("medusa_fc_bias", False))}
    if not shared:
        declared["shared_lm_head"] = False
    if truncated is not None and token_map is None:
        raise CheckpointError(f"{p}: truncated_vocab_size {truncated} < vocab_size {cv} but the weights have no "
                              "token_map (the draft vocabulary's target ids)")
    return _assemble(p, entries, hidden_size, vocab_size, declared, strict=False,
                     base_model=cfg.get("base_model_name_or_path"), shared=True if shared else None,
                     token_map=token_map, draft_vocab_size=truncated)


def _vllm_rename(cfg: dict) -> dict:
    """vLLM's MedusaConfig.from_pretrained renaming of head / layer count keys."""
    out = {}
    for k, v in cfg.items():
        if "num" in k and "heads" in k:
            out["num_heads"] = v
        elif "num" in k and "layers" in k:
            out["num_hidden_layers"] = v
        else:
            out[k] = v
    return out


def _load_faster_decoding(p: Path, f: Path, cfg: dict, hidden_size: int, vocab_size: int):
    raw = read_tensors([f])
    if any(k.startswith("medusa_head.") for k in raw):  # a Medusa-2 style file given directly
        raw = {k: v for k, v in raw.items() if k.startswith("medusa_head.")}
    entries = _fd_entries(f, raw)
    if not entries:
        raise CheckpointError(f"{p}: no Medusa head tensors found. Supported formats: {SUPPORTED_FORMATS}")
    declared = {"num_heads": cfg.get("medusa_num_heads"), "num_layers": cfg.get("medusa_num_layers")}
    if str(cfg.get("version", "")) == "2":
        declared["shared_lm_head"] = True
    return _assemble(p, entries, hidden_size, vocab_size, declared, strict=False,
                     base_model=cfg.get("base_model_name_or_path"))


def _load_medusa2(p: Path, d: Path, cfg: dict, hidden_size: int, vocab_size: int):
    """Medusa-2 full model directory, or None when no medusa_head.* tensors are in it."""
    raw = read_tensors(weight_files(d), keep=lambda name: name.startswith("medusa_head."))
    if not raw:
        return None
    entries = _fd_entries(d, raw)
    declared = {"num_heads": cfg.get("medusa_num_heads"), "num_layers": cfg.get("medusa_num_layers")}
    # the heads were trained jointly with this very backbone: it is their base model
    return _assemble(p, entries, hidden_size, vocab_size, declared, strict=False, base_model=str(d))


def _fd_entries(where: Path, raw: dict[str, torch.Tensor]) -> Entries:
    """FasterDecoding names (optionally under ``medusa_head.``) -> our names. The vocab projection
    ``{h}.{L}.weight`` is told from the blocks by its index, which must equal the head's block count."""
    blocks: Entries = {}
    heads: dict[int, tuple[int, str, torch.Tensor]] = {}
    for src, t in raw.items():
        name = src[len("medusa_head."):] if src.startswith("medusa_head.") else src
        m = _FD_BLOCK.match(name)
        if m:
            blocks[f"blocks.{m[1]}.{m[2]}.{m[3]}"] = (src, t)
            continue
        m = _FD_HEAD.match(name)
        if m:
            h = int(m[1])
            if h in heads:
                raise CheckpointError(f"{where}: head {h} has two vocab projections "
                                      f"({heads[h][1]!r} and {src!r})")
            heads[h] = (int(m[2]), src, t)
            continue
        raise CheckpointError(f"{where}: unexpected tensor {src!r}. Supported formats: {SUPPORTED_FORMATS}")
    entries = dict(blocks)
    for h, (idx, src, t) in heads.items():
        n_blocks = len({int(k.split(".")[2]) for k in blocks if k.startswith(f"blocks.{h}.")})
        if idx != n_blocks:
            raise CheckpointError(f"{where}: {src!r} is not after head {h}'s {n_blocks} residual block(s) "
                                  f"(expected index {n_blocks} for its vocab projection)")
        entries[f"lm_heads.{h}.weight"] = (src, t)
    return entries


# ---- common inference and validation --------------------------------------------------------------


def _assemble(p: Path, entries: Entries, hidden_size: int, vocab_size: int, declared: dict, *, strict: bool,
              base_model, shared: bool | None = None, token_map: torch.Tensor | None = None,
              draft_vocab_size=None):
    """Infer K, L, bias and shared-ness from ``entries`` (our names), check them against the declared
    config values (error if ``strict`` else warn) and every tensor's shape against the target.
    ``token_map`` (a draft vocabulary's target ids) must list ``draft_vocab_size`` distinct ids of the
    target vocabulary; own heads then have that many rows."""
    head_rows = vocab_size
    if token_map is not None:
        token_map = _check_token_map(p, token_map, vocab_size, draft_vocab_size)
        head_rows = vocab_size if token_map is None else token_map.numel()
    elif draft_vocab_size is not None and int(draft_vocab_size) < vocab_size:
        raise CheckpointError(f"{p}: draft_vocab_size {draft_vocab_size} but the weights have no token_map")
    if not entries:
        raise CheckpointError(f"{p}: no Medusa head tensors found. Supported formats: {SUPPORTED_FORMATS}")
    block_w: dict[int, set[int]] = {}
    block_b: set[tuple[int, int]] = set()
    own: set[int] = set()
    for name in entries:
        m = _OURS_BLOCK.match(name)
        if m:
            h, l = int(m[1]), int(m[2])
            if m[3] == "weight":
                block_w.setdefault(h, set()).add(l)
            else:
                block_b.add((h, l))
        else:
            own.add(int(_OURS_HEAD.match(name)[1]))

    head_ids = set(block_w) | own | {h for h, _ in block_b}
    k = max(head_ids) + 1
    if head_ids != set(range(k)):
        missing = sorted(set(range(k)) - head_ids)
        raise CheckpointError(f"{p}: Medusa heads {missing} are missing (the weights hold heads {sorted(head_ids)})")
    layer_sets = {h: block_w.get(h, set()) for h in range(k)}
    n_layers = len(layer_sets[0])
    for h, ls in layer_sets.items():
        if ls != set(range(n_layers)):
            raise CheckpointError(f"{p}: Medusa head {h} has residual blocks {sorted(ls)}, head 0 has "
                                  f"{sorted(layer_sets[0])}: all heads need blocks 0..{n_layers - 1}")
    for h, l in sorted(block_b):
        if l not in layer_sets[h]:
            raise CheckpointError(f"{p}: bias of Medusa head {h} block {l} without its weight")
    n_blocks = k * n_layers
    if block_b and len(block_b) != n_blocks:
        lacking = [(h, l) for h in range(k) for l in range(n_layers) if (h, l) not in block_b]
        raise CheckpointError(f"{p}: some Medusa residual blocks have a bias and others do not "
                              f"(missing for head/block {lacking[:6]})")
    bias = bool(block_b) if n_blocks else (declared.get("bias") if declared.get("bias") is not None else True)

    if shared is None:
        if own and own != set(range(k)):
            missing = sorted(set(range(k)) - own)
            raise CheckpointError(f"{p}: Medusa heads {missing} have no vocab projection, the others have one "
                                  "(expected all or none: none means they share the target's lm_head)")
        shared = not own
    elif shared:
        entries = {n: v for n, v in entries.items() if not n.startswith("lm_heads.")}

    inferred = {"num_heads": k, "num_layers": n_layers, "bias": bias, "shared_lm_head": shared}
    labels = {"num_heads": "heads", "num_layers": "layers per head", "bias": "block bias",
              "shared_lm_head": "shared lm_head"}
    for key, got in inferred.items():
        want = declared.get(key)
        if want is None or (key == "bias" and n_blocks == 0):
            continue
        want = bool(want) if isinstance(got, bool) else int(want)
        if want != got:
            msg = f"{p}: the config says {key}={want} but the weights hold {labels[key]}={got}"
            if key == "num_heads":
                msg = f"{p}: the config says {want} but the weights hold {got} heads"
            elif key == "num_layers":
                msg = f"{p}: the config says {want} layers per head but the weights hold {got}"
            if strict:
                raise CheckpointError(msg)
            warnings.warn(msg + "; using the weights", stacklevel=4)

    # target dimensions: the most common value the tensors imply, so one bad tensor is named as such
    dims = Counter()
    vocabs = Counter()
    for name, (_, t) in entries.items():
        if name.endswith(".bias"):
            dims[t.shape[0] if t.dim() == 1 else -1] += 1
        elif name.startswith("blocks."):
            dims.update(t.shape if t.dim() == 2 else (-1,))
        elif t.dim() == 2:
            dims[t.shape[1]] += 1
            vocabs[t.shape[0]] += 1
    d = dims.most_common(1)[0][0] if dims else hidden_size
    if d != hidden_size:
        raise CheckpointError(f"{p}: Medusa heads have hidden size {d}, the target model has {hidden_size}")
    if vocabs:
        v = vocabs.most_common(1)[0][0]
        if v != head_rows:
            if token_map is not None:
                raise CheckpointError(f"{p}: Medusa heads have {v} vocab rows, the token_map lists {head_rows} tokens")
            raise CheckpointError(f"{p}: Medusa heads have vocab size {v}, the target model has {vocab_size}")

    sd: dict[str, torch.Tensor] = {}
    for name, (src, t) in sorted(entries.items()):
        if name.endswith(".bias"):
            expected = (hidden_size,)
        elif name.startswith("blocks."):
            expected = (hidden_size, hidden_size)
        else:
            expected = (head_rows, hidden_size)
        if tuple(t.shape) != expected:
            raise CheckpointError(f"{p}: Medusa tensor {src!r} has shape {tuple(t.shape)}, expected {expected}")
        if not t.is_floating_point():
            raise CheckpointError(f"{p}: Medusa tensor {src!r} has dtype {t.dtype}, expected a float type")
        sd[name] = t.detach().to(torch.float32).contiguous()

    if token_map is not None:
        sd["token_map"] = token_map
    cfg = MedusaConfig(num_heads=k, num_layers=n_layers, hidden_size=hidden_size, vocab_size=vocab_size,
                       shared_lm_head=shared, bias=bias, base_model=base_model,
                       draft_vocab_size=None if token_map is None else token_map.numel())
    try:
        cfg.validate()
    except ValueError as e:
        raise CheckpointError(f"{p}: {e}") from e
    return cfg, sd


def _check_token_map(p: Path, t: torch.Tensor, vocab_size: int, declared) -> torch.Tensor:
    if t.dim() != 1 or t.is_floating_point() or t.dtype == torch.bool:
        raise CheckpointError(f"{p}: token_map must be a 1-D integer tensor of target ids, got "
                              f"{t.dtype} {tuple(t.shape)}")
    t = t.to(torch.long)
    if declared is not None and int(declared) != t.numel():
        raise CheckpointError(f"{p}: the config's draft vocabulary has {declared} tokens, token_map lists {t.numel()}")
    if t.numel() == 0 or bool((t < 0).any()) or bool((t >= vocab_size).any()):
        raise CheckpointError(f"{p}: token_map ids must lie in the target vocabulary [0, {vocab_size})")
    if t.unique().numel() != t.numel():
        raise CheckpointError(f"{p}: token_map lists a target id twice")
    if t.numel() == vocab_size:
        if not torch.equal(t, torch.arange(vocab_size)):
            raise CheckpointError(f"{p}: a token_map over the whole vocabulary must be the identity")
        return None  # no draft vocabulary
    return t.contiguous()


# ---- file reading ---------------------------------------------------------------------------------


def _read_json(f: Path) -> dict:
    return read_json_object(f, missing_ok=True)
