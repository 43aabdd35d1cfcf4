"""Streaming (SSE) with every speculative method: joined deltas equal the non-streamed text at
temperature 0 (and offline plain decoding's), the usage chunk, finish_reason once per choice, and a stop
string or a stop token at every position of the output (so inside accepted blocks) cutting the text
exactly where plain decoding cuts it, with usage counting what was delivered."""

import json

import httpx
import pytest

from specserve import LLM, SamplingParams

from server_utils import MODEL, SPECS, client, serving

pytestmark = pytest.mark.slow

PROMPTS = ["Count from 1 to 15: 1, 2, 3, 4, 5,", "List the days of the week: Monday, Tuesday,",
           "Repeat this sentence twice: the cat sat on the mat."]
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module", params=list(SPECS))
def spec_server(request, real_threads):
    llm = LLM(num_threads=real_threads, speculative_config=SPECS[request.param])
    with serving(llm) as (url, state):
        yield request.param, url, state
    llm.shutdown()


def _stream_completion(c, **kw):
    chunks = list(c.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None  # the usage chunk comes last
    assert all(ch.usage is None for ch in body)
    finishes = [(ch.choices[0].index, ch.choices[0].finish_reason) for ch in body if ch.choices[0].finish_reason]
    return body, last.usage, finishes


def test_stream_equals_non_stream(spec_server, ref_llm):
    method, url, state = spec_server
    c = client(url)
    per_chunk = []
    for p in PROMPTS:
        whole = c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
        body, use, finishes = _stream_completion(c, prompt=p, max_tokens=24, temperature=0, logprobs=0)
        assert "".join(ch.choices[0].text for ch in body) == whole.choices[0].text
        assert finishes == [(0, whole.choices[0].finish_reason)]  # exactly once
        assert use.completion_tokens == whole.usage.completion_tokens and use.prompt_tokens == whole.usage.prompt_tokens
        per_chunk += [len(ch.choices[0].logprobs.tokens) for ch in body if ch.choices[0].logprobs]
        ref = ref_llm.generate(p, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
        assert whole.choices[0].text == ref.text  # lossless: plain decoding's text
    if method != "plain":
        assert max(per_chunk) > 1  # several tokens arrived in one chunk (an accepted block)
        m = state.engine.get_metrics()
        assert m["num_accepted_tokens"] > 0
    # chat: the role first, content deltas, finish_reason once per choice (n=2)
    whole = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    texts, roles, finishes = {0: "", 1: ""}, {}, {0: [], 1: []}
    for ch in chunks[:-1]:
        for choice in ch.choices:
            if choice.delta.role:
                roles.setdefault(choice.index, []).append(choice.delta.role)
                assert texts[choice.index] == ""  # the role comes first
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert roles == {0: ["assistant"], 1: ["assistant"]}
    assert texts[0] == texts[1] == whole.choices[0].message.content
    assert finishes == {0: [whole.choices[0].finish_reason]} | {1: [whole.choices[0].finish_reason]}
    assert chunks[-1].usage.completion_tokens == 2 * whole.usage.completion_tokens


def test_stop_at_every_position(spec_server, ref_llm):
    """Stop strings starting at successive characters, and each output token as a stop token: the
    streamed text, finish reason and usage are plain decoding's with the same stop."""
    method, url, _ = spec_server
    if method == "plain":
        pytest.skip("speculative methods only (blocks of accepted tokens)")
    c = client(url)
    p = PROMPTS[0]
    base = SamplingParams(temperature=0, max_tokens=16)
    full = ref_llm.generate(p, base, use_tqdm=False)[0].outputs[0]
    cases = [{"stop": [full.text[k:k + 2]]} for k in range(1, len(full.text) - 1, 2)]
    cases += [{"stop_token_ids": [t]} for t in dict.fromkeys(full.token_ids)]
    for case in cases:
        want = ref_llm.generate(p, base.clone(**case), use_tqdm=False)[0].outputs[0]
        body, use, finishes = _stream_completion(c, prompt=p, max_tokens=16, temperature=0, extra_body=case)
        text = "".join(ch.choices[0].text for ch in body)
        assert (text, finishes, use.completion_tokens) == (want.text, [(0, want.finish_reason)],
                                                           len(want.token_ids)), case
        if "stop" in case:
            assert want.finish_reason == "stop" and full.text.startswith(text + case["stop"][0])


def test_eos_in_a_block(spec_server, ref_llm):
    """The chat answer ends with EOS: stream and non-stream stop there with plain decoding's count."""
    method, url, _ = spec_server
    c = client(url)
    msgs = [{"role": "user", "content": "Hi"}]
    ids = ref_llm.tokenizer.apply_chat_template(msgs)
    want = ref_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=64),
                            use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop"
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=64, temperature=0)
    assert whole.choices[0].message.content == want.text and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == len(want.token_ids)
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": msgs, "max_tokens": 64, "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True}})
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == want.text
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"] and
            ch["choices"][0]["finish_reason"]] == ["stop"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(want.token_ids)
