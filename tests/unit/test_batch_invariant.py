"""Batch-invariant bfloat16 forwards on CPU: a token's logits get the same bits whether it is decoded
alone or verified with others (in a chain, in a tree, beside another sequence, or in a prefill)."""

import pytest
import torch

from specserve.layers.packing import ROW_BLOCK

from specserve.engine.model_runner import ModelRunner
from specserve.layers.linear import PackedGEMM, in_row_blocks, lone_row_differs, mkldnn_packing_available
from specserve.sample.tree import TreeBuffers

needs_bf16 = pytest.mark.skipif(not mkldnn_packing_available(torch.bfloat16),
                                reason="this CPU cannot pack bfloat16 weights (no AVX512)")


def test_in_row_blocks_applies_fn_to_blocks_of_rows():
    x = torch.arange(2 * 37 * 3, dtype=torch.float32).view(2, 37, 3)
    sizes = []

    def fn(rows):
        sizes.append(rows.shape[0])
        return rows.sum(-1, keepdim=True) * 2

    out = in_row_blocks(fn, x, 32)
    assert sizes == [32, 32, 10]
    assert torch.equal(out, x.sum(-1, keepdim=True) * 2)
    sizes.clear()
    assert torch.equal(in_row_blocks(fn, x, 0), x.sum(-1, keepdim=True) * 2) and len(sizes) == 1  # whole
    # never one row alone: a lone row (a decoding step, or a last block of one) travels with a zero row
    sizes.clear()
    one = x[:1, :1]
    assert torch.equal(in_row_blocks(fn, one, 32), one.sum(-1, keepdim=True) * 2) and sizes == [2]
    sizes.clear()
    y = x.reshape(-1, 3)[:65]
    assert torch.equal(in_row_blocks(fn, y, 32), y.sum(-1, keepdim=True) * 2) and sizes == [32, 32, 2]
    # a shape whose lone row takes the same kernel is not padded
    sizes.clear()
    assert torch.equal(in_row_blocks(fn, y, 32, pad_lone_row=False), y.sum(-1, keepdim=True) * 2)
    assert sizes == [32, 32, 1]
    sizes.clear()
    assert torch.equal(in_row_blocks(fn, one, 32, pad_lone_row=False), one.sum(-1, keepdim=True) * 2) and sizes == [1]


def test_lone_row_probe_tells_a_kernel_that_sums_one_row_differently():
    assert not lone_row_differs(lambda x: x * 3 - 1, 16, torch.float32)  # row-wise whatever the row count
    # one row alone computed another way (here: off by a few ulp) is found
    assert lone_row_differs(lambda x: x * 3 - (1 + 1e-6 if x.shape[0] == 1 else 1), 16, torch.float32)


@needs_bf16
def test_only_the_shapes_whose_lone_row_differs_are_padded(tiny_llama):
    runner = ModelRunner(tiny_llama, dtype="bfloat16", max_num_seqs=1)
    gemms = [m for m in runner.model.modules() if isinstance(m, PackedGEMM) and m.packed is not None]
    assert {type(m).__name__ for m in gemms} >= {"QKVParallelLinear", "RowParallelLinear", "ParallelLMHead"}
    for m in gemms:
        w = m.packed
        assert m.row_block == ROW_BLOCK
        assert m.pad_lone_row == lone_row_differs(m.dense_matmul, w.shape[1], w.dtype), type(m).__name__


def _singles(runner, slot, prompt, cont):
    runner.forward(slot, [prompt], [0], "none")
    return torch.stack([runner.forward(slot, [[t]], [len(prompt) + i]).logits[0] for i, t in enumerate(cont)])


def _differing_rows(a, b):
    return [i for i in range(a.shape[0]) if not torch.equal(a[i], b[i])]


@needs_bf16
@pytest.mark.parametrize("model", ["tiny", "default"])
def test_verification_reproduces_one_token_steps_bit_for_bit(model, tiny_llama, default_model_dir):
    torch.set_num_threads(2)  # the threaded kernels too
    path = tiny_llama if model == "tiny" else default_model_dir
    runner = ModelRunner(path, dtype="bfloat16", max_num_seqs=3)
    assert runner.batch_invariant
    vocab = runner.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (37,), generator=g).tolist()
    cont = torch.randint(3, vocab, (2 * ROW_BLOCK + 6,), generator=g).tolist()  # several row blocks
    P = len(prompt)
    singles = _singles(runner, 0, prompt, cont)
    for k in (1, 7, ROW_BLOCK, ROW_BLOCK + 1, len(cont)):  # chains, within and across row blocks
        runner.forward(1, [prompt], [0], "none")
        out = runner.forward(1, [cont[:k]], [P], "all").logits[0]
        assert _differing_rows(out, singles[:k]) == [], k
    # a random tree of 40 nodes (over a row block): each node sees its ancestors only, which sit at other
    # cache offsets than in one-token decoding; every root-to-leaf path must give that path's own steps
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 40)]
    tree = torch.randint(3, vocab, (40,), generator=g).tolist()
    buffers = TreeBuffers.from_parents(parents)
    paths = [buffers.path_to(i) for i in range(40)]
    runner.forward(1, [prompt], [0], "none")
    out = runner.forward(1, [tree], [P], "all", tree_mask=[buffers.attn_mask],
                         positions=[buffers.position_ids(P).tolist()]).logits[0]
    leaves = [i for i in range(40) if not buffers.children[i]]
    assert max(len(paths[i]) for i in leaves) >= 4
    for leaf in leaves[-3:]:
        steps = _singles(runner, 2, prompt, [tree[j] for j in paths[leaf]])
        assert _differing_rows(out[paths[leaf]], steps) == [], paths[leaf]
    # batched with another sequence of another length, and inside a prefill
    runner.forward(1, [prompt[:20]], [0], "none")
    runner.forward(2, [prompt], [0], "none")
    out = runner.forward(1, [cont[:9], cont[:12]], [20, P], "all").logits[1]
    assert _differing_rows(out, singles[:12]) == []
    out = runner.forward(2, [prompt + cont[:10]], [0], "all").logits[0][P:]
    assert _differing_rows(out, singles[:10]) == []


def test_float32_runner_is_left_as_it_is(tiny_llama):
    runner = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    assert not runner.batch_invariant
    layer = runner.model.model.layers[0]
    assert not layer.self_attn.attn.batch_invariant and layer.mlp.down_proj.row_block == 0
