"""TP=2 over two processes (gloo) gives the same greedy tokens as TP=1."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.distributed.parallel_state import TPGroup
from specserve.layers.embed_head import LogitsProcessor, ParallelLMHead

PROMPTS = [[5, 17, 42, 99, 3], [11, 12], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tp2_greedy_equals_tp1(tiny_dirs, kind):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=str(tiny_dirs[kind]), dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model=str(tiny_dirs[kind]), dtype="float32", tensor_parallel_size=2)
    try:
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        counts = llm.engine.runner.collective_counts()
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    # both ranks ran the same collectives: 2 all-reduces per layer + embedding, 1 logits gather per forward
    assert counts[0] == counts[1] and counts[0]["all_reduce"] > 0 and counts[0]["all_gather"] > 0


def test_replicated_head_never_gathers():
    """disable_tp=True: the head holds the full vocab and the logits processor runs no collective."""
    tp = TPGroup(rank=1, size=2)  # a rank of a 2-way group; a gather would need a process group
    head = ParallelLMHead(257, 16, tp, disable_tp=True)
    assert head.weight.shape == (257, 16) and head.tp_size == 1
    w = torch.randn(257, 16)
    head.weight_loader(head.weight, w)
    x = torch.randn(3, 16)
    assert torch.allclose(LogitsProcessor(257)(head, x), x @ w.T)
    assert tp.num_collectives() == 0
    sharded = ParallelLMHead(257, 16, tp)
    assert sharded.weight.shape == (129, 16) and sharded.tp_size == 2
    sharded.weight_loader(sharded.weight, w)
    assert torch.equal(sharded.weight[:128], w[129:]) and torch.equal(sharded.weight[128], torch.zeros(16))
