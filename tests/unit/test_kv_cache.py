"""The batched KV cache: truncation is O(1) and exact; different lengths and step sizes in one batch."""

import pytest
import torch

from specserve.engine.model_runner import ModelRunner

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9]


def test_truncate_then_continue_equals_never_appended(tiny_llama):
    a = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    a.forward(0, [PROMPT], [0], "none")
    a.forward(0, [[1, 2, 3, 4, 5]], [len(PROMPT)], "all")  # drafts that get rejected...
    # ...so the sequence is truncated back to len(PROMPT): nothing to do but continue from there.
    got = a.forward(0, [[60, 61, 62]], [len(PROMPT)], "all").logits[0]
    b = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    b.forward(0, [PROMPT], [0], "none")
    want = b.forward(0, [[60, 61, 62]], [len(PROMPT)], "all").logits[0]
    assert torch.equal(got, want)


def test_mixed_step_sizes_in_one_batch(tiny_llama):
    """Three sequences of different lengths append 1, 4 and 2 tokens in one forward; each row's
    logits equal running that sequence alone."""
    prompts = [PROMPT, [1, 2], [100, 101, 102, 103, 104, 105]]
    new = [[7], [8, 9, 10, 11], [12, 13]]
    batched = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=3)
    for i, p in enumerate(prompts):
        batched.forward(i, [p], [0], "none")
    out = batched.forward(0, new, [len(p) for p in prompts], "all").logits
    for i, (p, n) in enumerate(zip(prompts, new)):
        alone = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
        want = alone.forward(0, [p + n], [0], "all").logits[0, len(p):]
        assert (out[i, : len(n)] - want).abs().max().item() < 1e-5


def test_cache_grows_and_slot_moves(tiny_llama):
    """A sequence takes blocks as it grows (16 positions each) and keeps them when it moves to another
    slot (a table move: no copy); its continuation there equals one forward of the whole text."""
    r = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=2)
    long = list(range(1, 257)) + list(range(1, 200))
    r.forward(1, [long], [0], "none")
    bm = r.kv.blocks
    assert len(bm.tables[1]) == -(-len(long) // 16) == bm.num_used() and not bm.tables[0]
    r.move_slot(1, 0)
    assert len(bm.tables[0]) == 29 and not bm.tables[1]
    got = r.forward(0, [[3]], [len(long)], "last").logits
    ref = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    want = ref.forward(0, [long + [3]], [0], "last").logits
    assert (got - want).abs().max().item() < 1e-4


def test_tree_mask_matches_separate_chains(tiny_llama):
    """Two branches scored in one forward with a tree mask give each chain's own logits."""
    r = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    r.forward(0, [PROMPT], [0], "none")
    n = len(PROMPT)
    # root 50, children 60 and 70, 60 has child 80: nodes [50, 60, 70, 80], parents [-, 0, 0, 1]
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    pos = [n, n + 1, n + 1, n + 2]
    out = r.forward(0, [[50, 60, 70, 80]], [n], "all", tree_mask=[mask], positions=[pos]).logits[0]
    ref = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=1)
    chain1 = ref.forward(0, [PROMPT + [50, 60, 80]], [0], "all").logits[0, n:]
    chain2 = ref.forward(0, [PROMPT + [50, 70]], [0], "all").logits[0, n:]
    for got, want in [(out[0], chain1[0]), (out[1], chain1[1]), (out[3], chain1[2]), (out[2], chain2[1])]:
        assert (got - want).abs().max().item() < 1e-5


def test_kv_memory_follows_the_requests_in_flight(tiny_llama, monkeypatch):
    """One long request uses the same blocks whatever ``max_num_seqs`` allows; five short ones at once
    one block each; when they finish every block is given back."""
    from specserve import LLM, SamplingParams
    from specserve.engine.kv_cache import KVCache

    peaks = []
    prepare = KVCache.prepare

    def tracked(self, *args):
        prepare(self, *args)
        peaks.append(self.blocks.num_used())

    monkeypatch.setattr(KVCache, "prepare", tracked)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long = [5 + i % 200 for i in range(480)]
    used = {}
    for seqs in (1, 16):
        llm = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=seqs)
        peaks.clear()
        out = llm.generate([long], params, use_tqdm=False)
        used[seqs] = max(peaks)
        assert llm.engine.runner.kv.blocks.num_used() == 0 and out[0].outputs[0].token_ids
    assert used[1] == used[16] == -(-(480 + 8) // 16)
    llm = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=16)
    peaks.clear()
    llm.generate([[1, 2, i] for i in range(5)], params, use_tqdm=False)
    assert max(peaks) == 5 and llm.engine.runner.kv.blocks.num_used() == 0


def test_gather_into_moves_positions_in_every_layer():
    """Tree verification keeps its accepted path: positions copied across blocks in every layer at once
    (the layers are views of one pool), every other entry unchanged, copy on write where a block is
    shared (``prepare``) in every layer too."""
    from specserve.engine.kv_cache import KVCache

    kv = KVCache(num_layers=3, max_slots=2, kv_heads=2, head_dim=4, dtype=torch.float32, num_blocks=8, block_size=4)
    kv.prepare(0, [0], [10])  # positions 0..9: three blocks
    assert all(t.data_ptr() == kv.pool[i].data_ptr() for i, t in enumerate(kv.kv))
    g = torch.Generator().manual_seed(0)
    for t in kv.kv:
        t.copy_(torch.randn(t.shape, generator=g))
    before = [kv.sequence(0, layer, 10).clone() for layer in range(3)]
    kv.gather_into(0, [2, 6, 9], 2)  # the path through positions 2, 6, 9 moves to 2, 3, 4 (2 stays)
    for layer in range(3):
        want = before[layer].clone()
        want[:, :, 2:5] = before[layer][:, :, [2, 6, 9]]
        assert torch.equal(kv.sequence(0, layer, 10), want)
    with pytest.raises(ValueError, match="gather_into"):
        kv.gather_into(0, [5, 4], 2)  # not in order
    tokens = list(range(10))
    kv.blocks.register(0, tokens, 10)
    assert kv.blocks.share_prefix(1, tokens) == 8  # slot 1 reads slot 0's first two blocks
    shared = kv.blocks.tables[1][1]
    kv.prepare(1, [4], [2])  # a write to positions 4, 5: their block becomes slot 1's own copy
    assert kv.blocks.tables[1][1] != shared and kv.blocks.tables[0][1] == shared
    for layer in range(3):
        assert torch.equal(kv.sequence(1, layer, 8), kv.sequence(0, layer, 8))
