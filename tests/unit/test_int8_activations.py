"""8-bit activations for quantized weights (``activations="int8"``):
the kernel (``csrc/quant_gemm_a8.cpp``: AVX-512 VNNI, or AVX2 on CPUs without it) against its definition
in PyTorch bit for bit and row-count invariant, the option's resolution and errors, the C++ decoder layer
with it, and speculative decoding on such a model token for token as plain decoding."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.model_runner import ModelRunner, resolve_activations
from specserve.layers import cpu_ops
from specserve.layers.quant import (GroupKernel, int8_activations_available, quantize, quantize_activations,
                                    reference_gemm_a8, rows_invariant)

needs_a8 = pytest.mark.skipif(not int8_activations_available(),
                              reason="the 8-bit activation kernel needs AVX-512 VNNI or AVX2")
KINDS = {"int4-g32": (4, 32), "int4-g64": (4, 64), "int8-g32 (Q8_0 layout)": (8, 32)}


def _x(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows of different scales, with an all-zero group, an outlier beside small values and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * (torch.rand(rows, 1, generator=g) * 4 + 1e-3)
    x[0, :32] = 0
    if rows > 1:
        x[1, 40] = 300.0
    if rows > 2:
        x[2] *= 1e-30
    return x.to(torch.bfloat16)


def test_activations_round_to_the_nearest_of_255_levels_per_group():
    x = _x(5, 96)
    q, dx = quantize_activations(x)
    g = x.float().view(5, 3, 32)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    assert torch.equal(q[0, 0], torch.zeros(32)) and dx[0, 0] == 0  # the all-zero group
    nonzero = g.abs().amax(-1) > 0
    assert torch.equal(q.abs().amax(-1)[nonzero], torch.full_like(q.abs().amax(-1)[nonzero], 127))
    err = (g - q * dx.unsqueeze(-1)).abs()
    assert (err <= dx.unsqueeze(-1) * 0.5001).all()  # within half a level
    assert q[1, 1, 8] == 127 and dx[1, 1] == torch.tensor(300.0) / 127  # the outlier sets its group's level


@needs_a8
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", [(40, 128), (256, 576)])
def test_kernel_is_its_definition_bit_for_bit(kind, shape):
    """The C++ kernel gives ``reference_gemm_a8``'s bits (integer dot products, then float32 FMAs in group
    order) at 1..17 rows, output rows padded (40), zero, outlier and tiny groups; each row the same bits
    alone as among others."""
    bits, group = KINDS[kind]
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.05
    qt = quantize(w, bits, group)
    k = GroupKernel(qt, cpu_ops.get(), int8_activations=True)
    assert k.code == bits | GroupKernel.INT8_ACTIVATIONS and k.key != GroupKernel(qt, cpu_ops.get()).key
    for m in (1, 2, 3, 5, 8, 9, 17):
        x = _x(m, shape[1], seed=m)
        assert torch.equal(k(x), reference_gemm_a8(x, qt)), m
    assert rows_invariant(k, shape[1])


@needs_a8
@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_stays_near_the_bfloat16_one(kind):
    bits, group = KINDS[kind]
    qt = quantize(torch.randn(128, 256, generator=torch.Generator().manual_seed(2)) * 0.05, bits, group)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    a8 = GroupKernel(qt, cpu_ops.get(), int8_activations=True)(x).float()
    bf = GroupKernel(qt, cpu_ops.get())(x).float()
    rel = ((a8 - bf).norm() / bf.norm()).item()
    assert 0 < rel < 0.02, rel


def test_activations_argument(tiny_llama):
    assert not resolve_activations("bfloat16", "gguf") and not resolve_activations("bfloat16", None)
    assert LLM(model=str(tiny_llama), quantization="int4").engine.runner.int8_activations is False  # the default
    with pytest.raises(ValueError, match="activations must be one of"):
        LLM(model=str(tiny_llama), activations="fp8")
    with pytest.raises(ValueError, match="needs weights in groups"):
        LLM(model=str(tiny_llama), activations="int8")  # dense weights
    with pytest.raises(ValueError, match="needs weights in groups"):
        resolve_activations("int8", "int8")  # per output channel: torch's kernel, bfloat16 activations
    if int8_activations_available():
        assert resolve_activations("int8", "gguf") and resolve_activations("int8", "int4")
    else:
        with pytest.raises(ValueError, match="does not have"):
            resolve_activations("int8", "gguf")


@needs_a8
def test_decoder_layer_in_one_call_keeps_the_bits_with_int8_activations(tiny_llama):
    """The C++ decoder layer (its linears' ``code`` routes them to the kernel) against the same layer op by
    op, and against bfloat16 activations (not the same logits: the option reaches the layer)."""
    runner = ModelRunner(tiny_llama, max_num_seqs=1, quantization="int4", activations="int8")
    bf = ModelRunner(tiny_llama, max_num_seqs=1, quantization="int4", activations="bfloat16")
    assert runner.int8_activations and not bf.int8_activations and runner.cost_key() != bf.cost_key()
    layers = runner.model.model.layers
    ids = list(range(3, 40))
    fused = [runner.forward(0, [ids], [0], "all").logits, runner.forward(0, [[7, 8, 9]], [37], "all").logits]
    for layer in layers:
        layer._one_call = ()  # op by op
    plain = [runner.forward(0, [ids], [0], "all").logits, runner.forward(0, [[7, 8, 9]], [37], "all").logits]
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    other = bf.forward(0, [ids], [0], "all").logits
    assert not torch.equal(other, fused[0])
    assert ((other - fused[0]).norm() / other.norm()).item() < 0.1


@needs_a8
@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
])
def test_greedy_speculative_identical_to_plain_with_int8_activations(tiny_llama, spec):
    """Verifying k tokens reproduces k one-token steps bit for bit with 8-bit activations too: the same
    greedy tokens alone and batched, drafts accepted and rejected."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11], [100, 3, 100, 3, 100]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), quantization="int4", activations="int8")
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts] == ref
    llm = LLM(model=str(tiny_llama), quantization="int4", activations="int8", speculative_config=dict(spec))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    m = llm.get_metrics()
    assert m["num_accepted_tokens"] > 0 and m["num_draft_tokens"] > m["num_accepted_tokens"]


@needs_a8
def test_bench_rows_say_their_activations(tiny_llama, tmp_path):
    """``specserve bench --activations int8``: the specserve rows run with 8-bit activations and say so in
    their weights label, identical to plain decoding with them."""
    from specserve.bench import harness

    prompts = tmp_path / "p.txt"
    prompts.write_text("w1 w2 w3 w1 w2 w3\nw4 w5 w4 w5 w4\n")
    rows = harness.run_bench(model=str(tiny_llama), methods="none,ngram", prompts_file=str(prompts), max_tokens=12,
                             dtypes="auto", quantizations="int4", threads=1, activations="int8")
    assert [r["weights"] for r in rows] == ["int4, a8", "int4, a8"] and rows[1]["identical_to_none"] is True
    assert harness.weights_label("gguf", "Q4_1") == "gguf Q4_1"
    assert harness.weights_label(None, activations="int8") == "dense"
