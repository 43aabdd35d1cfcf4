"""Bad requests get OpenAI's error shape with the right status and leave the server working; the API
key guards every route; the bounded queue answers 429, never hangs; clients that give up free their
sequences and KV blocks; an engine fault is a 500 (a streamed error event, then [DONE])."""

import asyncio
import json
import random
import re
import threading
import time

import httpx
import pytest

from specserve import LLM
from specserve.entrypoints.openai.protocol import Limits

from server_utils import MODEL, client, serving

pytestmark = pytest.mark.slow

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def llm(real_threads):
    llm = LLM(num_threads=real_threads, max_model_len=512)
    yield llm
    llm.shutdown()


def _check_error(r: httpx.Response, status: int, param: str | None = "any"):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["code"] == status and isinstance(err["message"], str) and 0 < len(err["message"]) < 300
    assert "\n" not in err["message"] and not re.search(r"/(home|root|usr|tmp|work)/", err["message"])
    if param != "any":
        assert err["param"] == param, err


BAD = [  # (route, body, status, param)
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 3.5}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "n": True}, 400, "n"),
    ("/v1/completions", {**GOOD, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "stop": 5}, 400, "stop"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {**GOOD, "logprobs": "x"}, 400, "logprobs"),
    ("/v1/completions", {k: v for k, v in GOOD.items() if k != "prompt"}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {**GOOD, "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("/v1/completions", {**GOOD, "n": 100}, 400, "n"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {**GOOD, "stop": ["x"] * 17}, 400, "stop"),
    ("/v1/completions", {**GOOD, "stop": ["x" * 300]}, 400, "stop"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[]]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["ok", ""]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [49152]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1] * 512}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1] * 100, "max_tokens": 413}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "prompt"),
]


def test_bad_inputs_then_a_good_request(llm):
    with serving(llm) as (url, state):
        with httpx.Client(base_url=url, timeout=30) as h:
            for route, body, status, param in BAD:
                _check_error(h.post(route, json=body), status, param)
                _check_error(h.post(route, json={**body, "stream": True}) if "stream" not in body
                             else h.post(route, json=body), status, param)
            _check_error(h.post("/v1/completions", content=b"{not json"), 400)
            _check_error(h.post("/v1/completions", content=b"\xff\xfe"), 400)
            _check_error(h.post("/v1/completions", json=[1, 2]), 400)
            _check_error(h.get("/v1/nothing"), 404)
            _check_error(h.get("/v1/completions"), 405)
            big = json.dumps({**GOOD, "prompt": "x" * (2 << 20)}).encode()
            _check_error(h.post("/v1/completions", content=big), 413)  # by Content-Length

            def chunks():  # no Content-Length: the stream-read limit
                for _ in range(40):
                    yield b" " * 65536

            _check_error(h.post("/v1/completions", content=chunks()), 413)
            r = h.get("/health", headers={"X-Big": "y" * 100_000})  # header size cap (h11)
            _check_error(r, 431)
            r = h.post("/v1/completions", json={**GOOD, "unknown_field": {"a": 1}, "user": "u1", "max_tokens": 3.0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert h.get("/health").status_code == 200
        assert state.inflight == 0


def test_caps(llm):
    """A request without max_tokens gets what is left of max_model_len within the server's cap; caps
    beyond it are 400s naming the field."""
    with serving(llm, limits=Limits(max_tokens=5, max_n=2, max_stop=1, max_prompts=2)) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as h:
            r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Tell me a story."}],
                                                     "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            assert r.json()["choices"][0]["finish_reason"] == "length"
            for body, param in (({**GOOD, "max_tokens": 6}, "max_tokens"), ({**GOOD, "n": 3}, "n"),
                                ({**GOOD, "stop": ["a", "b"]}, "stop"),
                                ({**GOOD, "prompt": ["a", "b", "c"]}, "prompt")):
                _check_error(h.post("/v1/completions", json=body), 400, param)


def test_api_key_on_every_route(llm):
    routes = [("GET", "/health", None), ("GET", "/version", None), ("GET", "/v1/models", None),
              ("GET", "/metrics", None), ("POST", "/v1/completions", GOOD), ("POST", "/v1/chat/completions", CHAT),
              ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
              ("GET", "/docs", None), ("GET", "/openapi.json", None)]
    with serving(llm, api_key="s3cret") as (url, _):
        with httpx.Client(base_url=url, timeout=30) as h:
            for method, route, body in routes:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                                {"Authorization": "Bearer s3cret2"}):
                    _check_error(h.request(method, route, json=body, headers=headers), 401)
                r = h.request(method, route, json=body, headers={"Authorization": "Bearer s3cret"})
                assert r.status_code == 200, (route, r.text)
        assert client(url, "s3cret").completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage
        with pytest.raises(Exception, match="401|API key"):
            client(url, "bad").completions.create(model=MODEL, prompt="Hi", max_tokens=2)


def _gauges(h) -> dict:
    text = h.get("/metrics").text
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        m = re.search(rf"^vllm:{name}{{[^}}]*}} (\S+)$", text, re.M)
        out[name] = float(m.group(1))
    return out


def test_cancelled_requests_free_everything(llm):
    """200 requests whose clients give up (timeouts, streamed and not), then a fresh request works and
    running / waiting / KV usage are back to 0 within 10 s."""
    async def one(h, i):
        body = {**GOOD, "prompt": f"Tell me a long story number {i}.", "max_tokens": 64, "stream": i % 2 == 0}
        try:
            async with asyncio.timeout(random.Random(i).uniform(0.02, 0.6)):
                async with h.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass
        except (TimeoutError, httpx.HTTPError):
            pass

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=300)) as h:
            await asyncio.gather(*(one(h, i) for i in range(200)))

    with serving(llm) as (url, state):
        asyncio.run(run(url))
        r = client(url).completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        with httpx.Client(base_url=url, timeout=10) as h:
            t0 = time.monotonic()
            while True:
                g = _gauges(h)
                if g == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0} \
                        and state.inflight == 0:
                    break
                assert time.monotonic() - t0 < 10, (g, state.inflight)
                time.sleep(0.2)
        assert not llm.engine.has_unfinished()


@pytest.fixture(scope="module")
def one_seq_llm(real_threads):
    llm = LLM(num_threads=real_threads, max_num_seqs=1, max_model_len=512)
    yield llm
    llm.shutdown()


def test_queue_limit_gives_429(one_seq_llm):
    """One running sequence and one queued: the rest get 429 with Retry-After at once."""
    async def one(h):
        t0 = time.monotonic()
        r = await h.post("/v1/completions", json={**GOOD, "max_tokens": 40, "ignore_eos": True,
                                                       "prompt": "Tell me a story."})
        return r, time.monotonic() - t0

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as h:
            return await asyncio.gather(*(one(h) for _ in range(5)))

    with serving(one_seq_llm, max_num_queued_requests=1) as (url, state):
        results = asyncio.run(run(url))
        refused = [(r, dt) for r, dt in results if r.status_code == 429]
        served = [r for r, _ in results if r.status_code == 200]
        assert len(refused) >= 3 and len(served) >= 1 and len(refused) + len(served) == 5
        for r, dt in refused:
            _check_error(r, 429)
            assert r.headers["retry-after"] == "1" and dt < 5
        assert all(r.json()["usage"]["completion_tokens"] == 40 for r in served)
        # n counts: 2 choices do not fit in 1 running + 1 queued while another request holds one
        r = httpx.post(url + "/v1/completions", json={**GOOD, "n": 2}, timeout=60)
        assert r.status_code == 200 and state.inflight == 0


def test_engine_fault_is_a_500_and_health_turns_503(one_seq_llm):
    engine = one_seq_llm.engine
    real_step = engine.step

    def failing_step():
        if engine.running and len(engine.running[0].output_ids) >= 3:
            raise RuntimeError("injected fault at /some/server/path")
        return real_step()

    engine.step = failing_step
    try:
        with serving(one_seq_llm) as (url, _):
            with httpx.Client(base_url=url, timeout=60) as h:
                box = {}
                t = threading.Thread(target=lambda: box.update(r=h.post("/v1/completions",
                                                                        json={**GOOD, "max_tokens": 50})))
                t.start()
                r = h.post("/v1/completions", json={**GOOD, "max_tokens": 50, "stream": True})
                t.join(60)
                events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
                assert events[-1] == "[DONE]"
                err = json.loads(events[-2])
                assert set(err) == {"error"} and err["error"]["code"] == 500
                assert "/some/server/path" not in r.text
                # the request that waited behind it: a 500 too (or it had finished)
                assert box["r"].status_code in (200, 500)
                if box["r"].status_code == 500:
                    _check_error(box["r"], 500)
                _check_error(h.get("/health"), 503)
                _check_error(h.post("/v1/completions", json=GOOD), 503)
    finally:
        engine.step = real_step
