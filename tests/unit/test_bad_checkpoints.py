"""A bad checkpoint is refused with a message naming what is wrong; nothing loads partially."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM
from specserve.config import UnsupportedModelError
from specserve.models.loader import CheckpointError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, fn):
    w = load_file(str(path / "model.safetensors"))
    fn(w)
    save_file(w, str(path / "model.safetensors"))


def test_wrong_shape_names_tensor_and_both_shapes(tiny_llama, tmp_path):
    p = _copy(tiny_llama, tmp_path / "m")
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_weights(p, lambda w: w.__setitem__(name, torch.zeros(100, 64)))
    with pytest.raises(CheckpointError) as e:
        LLM(model=str(p))
    msg = str(e.value)
    assert name in msg and "(100, 64)" in msg and "(128, 64)" in msg


def test_missing_tensor(tiny_llama, tmp_path):
    p = _copy(tiny_llama, tmp_path / "m")
    _edit_weights(p, lambda w: w.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.0\.self_attn\.qkv_proj.*k"):
        LLM(model=str(p))


def test_unexpected_tensor(tiny_llama, tmp_path):
    p = _copy(tiny_llama, tmp_path / "m")
    _edit_weights(p, lambda w: w.__setitem__("model.layers.0.mystery.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.mystery.weight'"):
        LLM(model=str(p))


def test_unknown_architecture_lists_supported(tiny_llama, tmp_path):
    p = _copy(tiny_llama, tmp_path / "m")
    cfg = json.loads((p / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(model=str(p))


def test_nonexistent_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))


def test_bad_requests(tiny_llama):
    llm = LLM(model=str(tiny_llama))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 100000]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(tiny_llama), max_model_len=8).generate([list(range(1, 20))], use_tqdm=False)
    # the engine is still usable after refusing bad requests
    assert llm.generate([[1, 2]], use_tqdm=False)[0].outputs[0].token_ids
