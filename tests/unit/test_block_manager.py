"""The paged KV cache's block manager, prefix caching and preemption through the engine."""

import random
from types import SimpleNamespace

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.block_manager import BlockManager, OutOfBlocks
from specserve.engine.prefix_features import PrefixFeatures


def test_blocks_are_taken_as_a_sequence_grows_and_given_back():
    bm = BlockManager(num_blocks=9, block_size=4, max_slots=3)  # 8 usable blocks (block 0: scratch)
    bm.ensure(0, 10)  # 3 blocks
    bm.ensure(1, 4)  # 1 block
    assert [len(t) for t in bm.tables[:2]] == [3, 1] and bm.num_free() == 4
    assert 0 not in bm.tables[0] + bm.tables[1]
    bm.ensure(0, 5)  # shrank (rejected drafts): one block back
    assert len(bm.tables[0]) == 2 and bm.num_free() == 5
    with pytest.raises(OutOfBlocks):
        bm.ensure(2, 4 * 6)  # 6 blocks, 5 free: nothing taken
    assert bm.tables[2] == [] and bm.num_free() == 5
    bm.move(1, 0)  # slot 1's sequence now in slot 0 (slot 0's blocks given back)
    assert len(bm.tables[0]) == 1 and bm.tables[1] == [] and bm.num_free() == 7
    bm.release_all()
    assert bm.num_free() == 8
    bm.check()


def test_prefix_blocks_are_shared_counted_and_evicted_last():
    bm = BlockManager(num_blocks=7, block_size=4, max_slots=3)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks before the last token
    bm.ensure(0, len(prompt))
    bm.register(0, prompt, len(prompt))
    first = list(bm.tables[0])
    # a second request with the same first 9 tokens and another ending: the 2 full blocks are shared
    other = prompt[:9] + [7, 7]
    assert bm.share_prefix(1, other) == 8
    assert bm.tables[1] == first[:2] and bm.ref[first[0]] == 2
    bm.ensure(1, len(other))
    assert bm.tables[1][2] != first[2]  # its third block is its own
    # the last token's block is never shared: a prompt of exactly 8 tokens shares 1 block, not 2
    assert bm.share_prefix(2, prompt[:8]) == 4
    bm.release(2)
    # both users leave: the cached blocks stay (content kept) until their blocks are needed
    bm.release(0)
    bm.release(1)
    assert bm.num_free() == 6 and len(bm.cached_free) == 2
    assert bm.share_prefix(0, prompt) == 8  # still cached
    bm.release(0)
    bm.ensure(1, 4 * 6)  # every block: the cached ones are taken last, their hashes dropped
    assert not bm.by_hash and not bm.cached_free
    bm.release(1)
    assert bm.share_prefix(0, prompt) == 0
    bm.check()


def test_copy_on_write_before_a_shared_block_is_written():
    bm = BlockManager(num_blocks=6, block_size=4, max_slots=2)
    toks = list(range(9))
    bm.ensure(0, 9)
    bm.register(0, toks, 8)
    assert bm.share_prefix(1, toks) == 8
    shared = bm.tables[1][1]
    copies = bm.writable(1, 6, 8)  # a write into the second (shared) block of slot 1
    assert copies == [(shared, bm.tables[1][1])] and bm.tables[1][1] != shared and bm.ref[shared] == 1
    bm.check()


def test_no_block_leaks_after_random_add_abort_finish():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=41, block_size=4, max_slots=6)
    lengths = [0] * 6
    vocab = [1, 2, 3]
    tokens = [[] for _ in range(6)]
    for _ in range(1000):
        slot = rng.randrange(6)
        op = rng.random()
        try:
            if lengths[slot] == 0 and op < 0.5:  # add: maybe with a cached prefix
                tokens[slot] = [rng.choice(vocab) for _ in range(rng.randint(1, 20))]
                lengths[slot] = bm.share_prefix(slot, tokens[slot])
                bm.ensure(slot, len(tokens[slot]))
                lengths[slot] = len(tokens[slot])
            elif lengths[slot] and op < 0.7:  # decode a few tokens (drafts), keep some
                grow = rng.randint(1, 6)
                bm.ensure(slot, lengths[slot] + grow)
                for c in bm.writable(slot, lengths[slot], lengths[slot] + grow):
                    pass
                keep = rng.randint(1, grow)
                tokens[slot] += [rng.choice(vocab) for _ in range(keep)]
                lengths[slot] += keep
                bm.ensure(slot, lengths[slot])
            elif lengths[slot] and op < 0.85:  # finish: register, give back
                bm.register(slot, tokens[slot], lengths[slot])
                bm.release(slot)
                lengths[slot] = 0
            elif lengths[slot]:  # abort
                bm.release(slot)
                lengths[slot] = 0
            elif op > 0.95 and any(lengths):  # a sequence moves to a free slot
                src = next(i for i, n in enumerate(lengths) if n)
                bm.move(src, slot)
                lengths[slot], lengths[src] = lengths[src], 0
                tokens[slot] = tokens[src]
        except OutOfBlocks:
            bm.release(slot)
            lengths[slot] = 0
        bm.check()
    bm.release_all()
    bm.check()
    assert bm.num_free() == 40 and bm.num_used() == 0


def test_engine_prefix_caching_skips_the_shared_prompt_and_changes_nothing(tiny_llama):
    """Requests with a common 40-token prefix: the later ones prefill only what is theirs, with the same
    tokens as without prefix caching."""
    system = [(7 * i) % 250 + 1 for i in range(40)]
    prompts = [system + [11, 12, 13], system + [21, 22], system + [31]]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=str(tiny_llama), dtype="float32",
                                              enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=1)  # one after the other
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    st = llm.engine.stats
    assert st.prefix_cached_tokens == 2 * 32  # two full blocks of 16, for each later request
    assert st.prefill_tokens == sum(len(p) for p in prompts) - 2 * 32


def test_preemption_when_blocks_run_out_recomputes_and_changes_nothing(tiny_llama):
    """A cache too small for every request at once: sequences wait or are preempted and recomputed,
    none fails, and the tokens (greedy and seeded) are those of an engine with room to spare."""
    prompts = [[(3 * i + j) % 250 + 1 for j in range(30 + 7 * i)] for i in range(6)]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, ignore_eos=True)
              for i, t in enumerate([0, 0.9, 0, 0.7, 1.0, 0])]
    roomy = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    block_bytes = roomy.engine.runner.kv.block_bytes
    small = LLM(model=str(tiny_llama), dtype="float32", max_num_seqs=8, max_model_len=128,
                kv_cache_memory=18 * block_bytes / (1 << 30), speculative_config={"method": "ngram"})
    assert small.engine.runner.kv.blocks.num_blocks == 18
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert small.engine.scheduler.num_preempted > 0
    assert small.engine.runner.kv.blocks.num_used() == 0


def test_kv_cache_memory_too_small_for_one_sequence_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"kv_cache_memory=1e-05 GiB holds \d+ positions, fewer than max_model_len "
                                         r"\(512\) needs"):
        LLM(model=str(tiny_llama), kv_cache_memory=1e-5)


def test_a_long_prompt_is_prefilled_a_chunk_a_step_while_others_decode(tiny_llama):
    """A 400-token prompt arriving while a request decodes is computed 64 tokens a step (the budget,
    ``prefill_chunk``), and the decoding request gains a token in every one of those steps; both
    outputs are those of each request alone."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short, long = [5, 6, 7], [(11 * i) % 250 + 1 for i in range(400)]
    alone = [LLM(model=str(tiny_llama), dtype="float32").generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
             for p in (short, long)]
    llm = LLM(model=str(tiny_llama), dtype="float32", prefill_chunk=64)
    eng = llm.engine
    a = eng.add_request(short, params)
    eng.step()
    assert len(a.output_ids) == 2  # prefilled (first token) and decoded once
    b = eng.add_request(long, params)
    computed = []
    while not b.output_ids:
        before = len(a.output_ids)
        eng.step()
        assert len(a.output_ids) == before + 1  # never stalled by the long prefill
        computed.append(b.num_computed)
    assert computed == [64, 128, 192, 256, 320, 384, 401]  # the last chunk, then its first decoding step
    while eng.has_unfinished():
        eng.step()
    assert [a.output_ids, b.output_ids] == alone


def test_a_recomputed_sequence_takes_cached_blocks_and_goes_on_the_same(tiny_llama):
    """A preempted sequence (prompt + output so far) whose every full block is cached by an earlier
    request still computes its last prompt position and continues with the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [(5 * i) % 250 + 1 for i in range(20)]
    llm = LLM(model=str(tiny_llama), dtype="float32")
    eng = llm.engine
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    k = 13  # prompt + 13 outputs = 33 positions: the recompute prefills 32, two full cached blocks
    seq = eng.add_request(prompt, params)
    seq.append_tokens(first[:k])  # as a preempted sequence comes back
    while eng.has_unfinished():
        eng.step()
    assert eng.stats.prefix_cached_tokens == 16  # the block of its last prefill position is computed
    assert seq.output_ids == first


def test_prefix_features_store_blocks_under_the_block_managers_hashes():
    """``PrefixFeatures`` keeps a sequence's features a full block at a time, however they arrive, under
    the chained hash the block manager registers that block's KV under; ``lookup`` returns the leading
    blocks it holds (never the last token's), least recently used blocks go first past the capacity,
    and a reset starts the sequence's chain again."""
    seq = SimpleNamespace(seq_id=1, all_ids=list(range(100, 150)))
    feats = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    store = PrefixFeatures(block_size=16, capacity=48)
    for a, b in [(0, 5), (5, 6), (6, 30), (30, 40)]:  # observed in uneven pieces: 2 blocks complete
        store.observe(seq, [feats[a:b], -feats[a:b]], reset=a == 0)
    assert list(store.blocks) == BlockManager.chain_hashes(seq.all_ids, 16, 2)
    n, (f, g) = store.lookup(seq.all_ids)
    assert n == 32 and torch.equal(f, feats[:32]) and torch.equal(g, -feats[:32])
    assert store.lookup(seq.all_ids[:32])[0] == 16  # never the block of the last token
    assert store.lookup([7] + seq.all_ids[1:])[0] == 0  # another first block: nothing
    seq.all_ids = seq.all_ids[:45]  # a position observed whose token is not known yet waits
    store.observe(seq, [feats[40:50], -feats[40:50]], reset=False)
    assert len(store.blocks) == 2
    other = SimpleNamespace(seq_id=2, all_ids=list(range(200, 240)))
    store.observe(other, [feats[:40], feats[:40]], reset=True)  # 2 more blocks, room for 3
    assert len(store.blocks) == 3 and store.lookup(other.all_ids)[0] == 32
    assert store.lookup(seq.all_ids)[0] == 16  # its second block was used least recently: dropped
    store.observe(seq, [feats[:40], feats[:40]], reset=True)  # from position 0 again: stored again
    assert store.lookup(seq.all_ids)[0] == 32 and store.lookup(other.all_ids)[0] == 0
    store.forget(seq)
    assert 1 not in store.chains
