"""Speculative decoding on the real default model: greedy output identical to plain decoding."""

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.layers.linear import fast_bfloat16, mkldnn_packing_available
from specserve.layers.quant import int8_activations_available
from specserve.spec_decode.ngram.branches import POOLED_BRANCHES

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hi",
    "List the days of the week: Monday, Tuesday, Wednesday,",
    "Repeat this sentence twice: the cat sat on the mat.",
    "Write a Python function that adds two numbers.",
    "What is the capital of Italy? Answer in one word.",
    "Count from 1 to 15: 1, 2, 3, 4, 5,",
    "Tell me a very short story about a robot who learns to paint, and describe the colors it uses.",
    "a b c d e f g a b c d e f g a b c",
]


def test_ngram_greedy_identical_to_plain(default_llm_fp32):
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = default_llm_fp32.generate(PROMPTS, params, use_tqdm=False)
    spec = LLM(dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                                    "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                                                    "ngram_verify": "full"})  # vLLM's: all verified
    out = spec.generate(PROMPTS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, plain, out):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, p
        assert b.outputs[0].text == a.outputs[0].text
    m = spec.get_metrics()
    assert m["num_accepted_tokens"] > 0 and m["mean_acceptance_length"] > 1.0
    assert len(m["acceptance_rate_per_position"]) == 5
    spec.shutdown()


CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]


POOL = POOLED_BRANCHES  # 3 n-gram branches of 12 tokens, earlier answers too

_PLAIN: dict[tuple[int, int], tuple[LLM, list]] = {}


def plain_answers(llm, max_tokens: int) -> list[list[int]]:
    """Plain decoding's greedy answers to CHATS from ``llm`` (a fixture's engine, shared by the cases
    of a test: computed once per length, the engine kept alive beside them so that its id stays its own)."""
    key = (id(llm), max_tokens)
    if key not in _PLAIN:
        outs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        _PLAIN[key] = (llm, [list(o.outputs[0].token_ids) for o in outs])
    return _PLAIN[key][1]


@pytest.fixture(scope="module", autouse=True)
def _forget_plain_answers():
    yield
    _PLAIN.clear()  # the engines kept for their ids go with the module


@pytest.mark.parametrize("tree, extra", [(None, {}), ("auto", {}), (16, {}), (None, {"ngram_branch": 5}),
                                         ("auto", {"medusa_verify": "auto", "ngram_branch": 5}),
                                         ("auto", {"medusa_verify": "auto", **POOL})])
def test_shipped_medusa_greedy_identical_to_plain(default_llm_fp32, tree, extra):
    """Chat prompts of different lengths (the heads were trained on chat answers)."""
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = plain_answers(default_llm_fp32, params.max_tokens)
    llm = LLM(dtype="float32", speculative_config={"method": "medusa", "medusa_tree": tree, **extra})
    out = llm.chat(CHATS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, plain, out):
        assert list(b.outputs[0].token_ids) == a, p
    m = llm.get_metrics()
    assert m["mean_acceptance_length"] > 1.05  # the shipped heads predict some of the model's tokens (random: ~1.0)
    llm.shutdown()


@pytest.mark.parametrize("method, extra", [
    ("dspark", {"dspark_verify": "full"}),
    ("dspark", {"dspark_verify": "threshold", "confidence_threshold": 0.3}),
    ("dspark", {"draft_sample_method": "probabilistic"}),
    ("dspark", {"dspark_verify": "auto"}),
    ("dspark", {"dspark_tree": 12}),
    ("dspark", {"dspark_tree": "auto"}),
    ("dspark", {"dspark_verify": "auto", "ngram_branch": 5}),
    ("dspark", {"dspark_tree": "auto", "ngram_branch": 5}),
    ("dspark", {"dspark_tree": "auto", **POOL}),
    ("dspark", {"draft_dtype": "float32"}),
    ("dflash", {}),
])
def test_shipped_dspark_greedy_identical_to_plain(default_llm_fp32, method, extra):
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = plain_answers(default_llm_fp32, params.max_tokens)
    llm = LLM(dtype="float32", speculative_config={"method": method, **extra})
    # the shipped drafters are stored in bfloat16: run so beside the float32 target where that is fast
    want = torch.float32 if extra.get("draft_dtype") == "float32" or not fast_bfloat16() else torch.bfloat16
    assert llm.engine.runner.helper(method).dtype == want
    out = llm.chat(CHATS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, plain, out):
        assert list(b.outputs[0].token_ids) == a, p
    m = llm.get_metrics()
    if extra.get("dspark_verify") == "threshold":  # low-confidence drafts are cut before verification
        assert m["num_draft_tokens"] < 7 * m["num_verify_steps"]
    else:
        assert m["num_accepted_tokens"] > 0
    llm.shutdown()


@pytest.fixture(scope="module")
def default_llm_bf16():
    llm = LLM(dtype="bfloat16", quantization=None)
    yield llm
    llm.shutdown()


@pytest.mark.skipif(not mkldnn_packing_available(torch.bfloat16), reason="no bfloat16 weight packing on this CPU")
@pytest.mark.parametrize("spec", [
    {"method": "medusa", "medusa_verify": "auto"},
    {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto"},
    {"method": "dspark", "dspark_verify": "auto"},
    {"method": "dspark", "dspark_tree": "auto", "ngram_branch": 5},
    {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto", **POOL},
])
def test_bfloat16_greedy_identical_to_plain(default_llm_bf16, spec):
    """In bfloat16 on CPU the forwards are batch-invariant (``make_batch_invariant``), so verifying a
    chain or a tree gives plain bfloat16 decoding's tokens, near ties included."""
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = plain_answers(default_llm_bf16, params.max_tokens)
    llm = LLM(dtype="bfloat16", quantization=None, speculative_config=spec)
    out = llm.chat(CHATS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, plain, out):
        assert list(b.outputs[0].token_ids) == a, p
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    llm.shutdown()


@pytest.fixture(scope="module")
def default_llm_quantized():
    llm = LLM()  # the default: the GGUF's own Q4_1 / Q8_0 weights through the weight-only kernels
    assert llm.engine.runner.quantization == "gguf" and llm.engine.runner.batch_invariant
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "ngram_verify": "full"},
    {"method": "ngram"},
    {"method": "medusa"},
    {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto", **POOL},
    {"method": "dflash"},
    {"method": "dspark", "dspark_verify": "auto"},
    {"method": "dspark", "dspark_tree": "auto", **POOL},
])
def test_quantized_greedy_identical_to_plain(default_llm_quantized, spec):
    """On the quantized default model (the GGUF's own blocks), every drafter's greedy output is plain
    decoding's with the same weights, token for token, for a batch of chats of different lengths."""
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = plain_answers(default_llm_quantized, params.max_tokens)
    llm = LLM(speculative_config=spec)
    if spec.get("dspark_verify") == "auto":
        # a batch of 8 pads every row to the longest: on a 2-core CPU its cost model may find no draft worth
        # that (the choice is its own test's); verification made cheap, the chains are verified
        llm.engine.proposer.verify_costs = {1: 1.0, 4096: 1.0 + 4095 * 0.01}
    if spec["method"] == "medusa":  # the heads' first blocks in 8 bits beside it (AVX2 CPUs too: no oneDNN packing)
        heads = getattr(llm.engine.proposer, "inner", llm.engine.proposer).heads
        assert heads._first is not None and heads._first[0].kind == "int8-g32"
    out = llm.chat(CHATS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, plain, out):
        assert list(b.outputs[0].token_ids) == a, p
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    llm.shutdown()


@pytest.fixture(scope="module")
def default_llm_int8_activations():
    if not int8_activations_available():
        pytest.skip("the 8-bit activation kernel needs AVX-512 VNNI or AVX2")
    llm = LLM(activations="int8")
    assert llm.engine.runner.int8_activations
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("spec", [{"method": "medusa"}, {"method": "dspark"}])
def test_int8_activations_greedy_identical_to_plain(default_llm_int8_activations, default_llm_quantized, spec):
    """With 8-bit activations (another target: its answers differ from bfloat16 activations' in places),
    the default drafters' greedy and seeded sampled outputs are that target's plain decoding's, token for
    token."""
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = plain_answers(default_llm_int8_activations, params.max_tokens)
    assert plain != plain_answers(default_llm_quantized, params.max_tokens)
    llm = LLM(activations="int8", speculative_config=spec)
    out = llm.chat(CHATS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, plain, out):
        assert list(b.outputs[0].token_ids) == a, p
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=40)  # coupled sampling: plain's tokens too
    want = [list(o.outputs[0].token_ids) for o in default_llm_int8_activations.chat(CHATS, seeded, use_tqdm=False)]
    assert [list(o.outputs[0].token_ids) for o in llm.chat(CHATS, seeded, use_tqdm=False)] == want
    llm.shutdown()


def test_quantized_alone_equals_batched(default_llm_quantized):
    params = SamplingParams(temperature=0, max_tokens=24)
    batched = default_llm_quantized.chat(CHATS[:4], params, use_tqdm=False)
    for chat, b in zip(CHATS[:4], batched):
        alone = default_llm_quantized.chat(chat, params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == b.outputs[0].token_ids
