"""Device selection: ``auto`` picks a visible CUDA GPU (else the CPU), ``$SPECSERVE_DEVICE`` overrides it,
and a GPU asked for where there is none is a clear error, from the API and from the CLI. (The CUDA
path itself runs on a GPU machine: scripts/gpu_check.sh.)"""

from __future__ import annotations

import pytest
import torch

from specserve.device import resolve_device, resolve_dtype

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without a GPU")


def test_auto_device(monkeypatch):
    monkeypatch.delenv("SPECSERVE_DEVICE", raising=False)
    gpu = torch.cuda.is_available()
    assert resolve_device("auto") == ("cuda" if gpu else "cpu")
    assert resolve_device(None) == resolve_device("auto")
    assert resolve_device("auto", tensor_parallel_size=2) == "cpu"  # TP runs gloo processes on CPU
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setenv("SPECSERVE_DEVICE", "cpu")
    assert resolve_device("auto") == "cpu"


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "mps0", ""])
def test_unknown_device_is_refused(bad):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        resolve_device(bad)


@no_gpu
def test_cuda_without_a_gpu_is_a_clear_error(tiny_llama, monkeypatch, capsys):
    from specserve import LLM
    from specserve.entrypoints.cli import main

    for dev in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            resolve_device(dev)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        LLM(model=str(tiny_llama), device="cuda")
    monkeypatch.setenv("SPECSERVE_DEVICE", "cuda")  # the override is checked like an explicit choice
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        LLM(model=str(tiny_llama))
    monkeypatch.delenv("SPECSERVE_DEVICE")
    rc = main(["bench", "--model", str(tiny_llama), "--methods", "none", "--device", "cuda", "--num-prompts", "1",
               "--max-tokens", "2"])
    assert rc == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err
    rc = main(["generate", "--model", str(tiny_llama), "--prompt", "w1 w2", "--max-tokens", "2", "--device", "cuda"])
    assert rc == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err


def test_llm_reports_its_device(tiny_llama):
    from specserve import LLM

    llm = LLM(model=str(tiny_llama), device="cpu", dtype="float32")
    assert llm.engine.device == "cpu" and llm.engine.runner.device == "cpu"
    assert llm.engine.runner.kv.kv[0].device.type == "cpu"


def test_auto_dtype_is_float32_on_cpu_bfloat16_on_gpu():
    """float32 on CPU (the shipped drafters were trained on float32 target features; bfloat16, made
    batch-invariant on CPU, is asked for explicitly)."""
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16 == resolve_dtype("auto", "cuda:1")
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cuda") == torch.float16
