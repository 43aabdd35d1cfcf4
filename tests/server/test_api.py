"""The OpenAI API of ``specserve serve`` against offline plain decoding: usage, finish reasons, token-id
and batched prompts, n > 1, logprobs, chat, and the plain routes."""

import re

import httpx
import pytest

from specserve import SamplingParams

from server_utils import MODEL, client

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "List the days of the week: Monday,", "1, 2, 3, 4,"]


def test_completion_matches_offline_with_exact_usage(plain_server, ref_llm):
    url, _ = plain_server
    c = client(url)
    for p in PROMPTS:
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        ref = ref_llm.generate(p, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        assert r.choices[0].text == ref.outputs[0].text
        assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
        assert r.usage.prompt_tokens == len(ref_llm.tokenizer.encode(p))
        assert r.usage.completion_tokens == 12 == len(ref.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12
        assert r.model == MODEL and r.object == "text_completion"


def test_finish_reason_stop_and_eos(plain_server, ref_llm):
    url, _ = plain_server
    c = client(url)
    full = ref_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = full.text[4:8]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    want = ref_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want.text == full.text[: full.text.find(stop)]
    assert r.usage.completion_tokens == len(want.token_ids) < 12
    # the chat answer to "Hi" ends with EOS well before 64 tokens
    msgs = [{"role": "user", "content": "Hi"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0)
    ids = ref_llm.tokenizer.apply_chat_template(msgs)
    want = ref_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=64),
                            use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == len(ids)


def test_token_id_and_batched_prompts(plain_server, ref_llm):
    url, _ = plain_server
    c = client(url)
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in PROMPTS]
    ids = [ref_llm.tokenizer.encode(p) for p in PROMPTS]
    r = c.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, temperature=0)
    assert r.choices[0].text == alone[0] and r.usage.prompt_tokens == len(ids[0])
    r = c.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and [ch.text for ch in r.choices] == alone
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 24
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [ch.text for ch in r.choices] == alone


def test_n_choices_with_derived_seeds(plain_server):
    url, _ = plain_server
    c = client(url)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    for i, ch in enumerate(r.choices):  # choice i is the request alone with seed 7 + i
        alone = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=7 + i)
        assert alone.choices[0].text == ch.text
    assert len({ch.text for ch in r.choices}) > 1
    # two prompts x n=2: index = prompt * n + choice
    r = c.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text != r.choices[2].text == r.choices[3].text
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
                                  temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1] and r.usage.completion_tokens == 8


def test_logprobs_are_the_targets(plain_server, ref_llm):
    url, _ = plain_server
    c = client(url)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    eng = ref_llm.engine
    seq = eng.add_request(ref_llm.tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=6,
                                                                               logprobs=2))
    while not seq.finished:
        eng.step()
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([v for v, _ in seq.logprobs], abs=1e-4)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(x.top_logprobs) == 3 and x.logprob <= 0 for x in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy: the top one


def test_plain_routes(plain_server, ref_llm):
    url, _ = plain_server
    c = client(url)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200
    assert "version" in httpx.get(url + "/version").json()
    t = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert t["tokens"] == ref_llm.tokenizer.encode("Hello world") and t["count"] == len(t["tokens"])
    msgs = [{"role": "user", "content": "Hi"}]
    t = httpx.post(url + "/tokenize", json={"messages": msgs}).json()
    assert t["tokens"] == ref_llm.tokenizer.apply_chat_template(msgs)
    d = httpx.post(url + "/detokenize", json={"tokens": ref_llm.tokenizer.encode("Hello world")}).json()
    assert d["prompt"] == "Hello world"
    spec = httpx.get(url + "/openapi.json").json()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    assert {"ChatRequest", "ChatMessage", "StreamOptions"} <= set(spec["components"]["schemas"])
    def counter(text, name):
        m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    before = httpx.get(url + "/metrics").text
    r = c.completions.create(model=MODEL, prompt=["Hi", "Hello there"], max_tokens=3, n=2)
    text = httpx.get(url + "/metrics").text
    for name, grew in (("vllm:generation_tokens_total", 12), ("vllm:time_to_first_token_seconds_count", 4),
                       ("vllm:inter_token_latency_seconds_count", 8),  # per token after the first
                       ("vllm:prompt_tokens_total", 2 * r.usage.prompt_tokens)):  # each choice prefills its prompt
        assert counter(text, name) - counter(before, name) == grew, name
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
        assert name in text, name
