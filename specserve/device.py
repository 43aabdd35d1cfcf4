"""Devices and dtypes: which device a model runs on, what a dtype name means, and waiting for a device's
queued work before a timing."""

from __future__ import annotations

import os
import re

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | None = "auto", tensor_parallel_size: int = 1) -> str:
    """``auto`` (or None): ``$SPECSERVE_DEVICE`` if set, else ``cuda`` when a GPU is visible and the model
    runs in one process (tensor parallelism runs gloo worker processes on CPU), else ``cpu``. An
    explicit ``cuda`` / ``cuda:N`` without a usable GPU is an error, not a silent fall-back."""
    if device in (None, "auto"):
        device = os.environ.get("SPECSERVE_DEVICE") or (
            "cuda" if tensor_parallel_size == 1 and torch.cuda.is_available() else "cpu")
    device = str(device)
    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}; use device='cpu' or 'auto')")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def synchronize(device) -> None:
    """Wait for the device's queued work (timings of GPU work need it; a no-op on CPU)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """``auto``: bfloat16 on GPUs, float32 on CPUs. In float32 a forward over k tokens differs from k
    one-token forwards by ~5e-5 in the logits (default model), too little to move greedy tokens in
    practice. "bfloat16" on CPU halves the weight bytes; there the forwards are made batch-invariant
    (``make_batch_invariant``) so that verifying a chain or a tree reproduces one-token decoding."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        return DTYPES[dtype]
    return torch.bfloat16 if device.startswith("cuda") else torch.float32
