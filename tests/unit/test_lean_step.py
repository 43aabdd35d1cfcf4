"""The lean decoding step keeps the bits of the straightforward formulas it replaces."""

import torch
import torch.nn.functional as F

from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding, apply_rotary, rotate_


def test_rms_norm_of_bfloat16_input_is_the_float32_norm_rounded():
    """``RMSNorm`` hands a bfloat16 input to ``F.rms_norm`` as it is: that must be HF's float32 norm,
    cast back, then the weight."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5, torch.bfloat16)
    norm.weight.data = torch.randn(576, generator=g).to(torch.bfloat16)
    for rows in (1, 2, 16, 33):
        x = (torch.randn(1, rows, 576, generator=g) * 20).to(torch.bfloat16)
        want = norm.weight * F.rms_norm(x.float(), (576,), None, 1e-5).to(torch.bfloat16)
        assert torch.equal(norm(x), want)


def test_rotate_in_place_equals_apply_rotary_bit_for_bit():
    rope = RotaryEmbedding(64, 10000.0, 64)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 5, 12, 64, generator=g).to(dtype)
        pos = torch.tensor([[3, 4, 5, 6, 7], [0, 9, 9, 100, 2]])  # 100: past the tables, they grow
        cos, sin = rope.cos_sin(pos, dtype)
        want = apply_rotary(x, cos, sin)
        got = x.clone()
        assert rotate_(got, *rope.rotation(pos, dtype)) is got
        assert torch.equal(got, want)
        # a range of positions (one sequence) is a slice of the same tables
        one = x[:1].clone()
        rotate_(one, *rope.rotation((3, 8), dtype))
        assert torch.equal(one, want[:1])
