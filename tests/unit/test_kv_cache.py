"""The batched KV cache: truncation is O(1) and exact; different lengths and step sizes in one batch."""

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
    r = ModelRunner(tiny_llama, dtype="float32", max_num_seqs=2)
    cap0 = r.kv.capacity
    long = list(range(1, 257)) + list(range(1, 200))
    r.forward(1, [long], [0], "none")
    assert r.kv.capacity > len(long) and r.kv.capacity > cap0
    r.move_slot(1, 0, len(long))
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
