"""The server's request layer without a model: choices and their seeds, caps, error locations."""

import pytest

pytest.importorskip("pydantic")

from pydantic import ValidationError  # noqa: E402

from specserve.entrypoints.openai.protocol import (ChatRequest, CompletionRequest, Limits, RequestError,  # noqa: E402
                                                   sampling_params, validation_message)


def _params(body: dict, limits: Limits = Limits(), max_tokens=8, logprobs=None):
    req = CompletionRequest.model_validate({"prompt": "x", **body})
    return sampling_params(req, max_tokens, logprobs, limits, max_model_len=64)


def test_n_choices_get_seed_plus_i():
    ps = _params({"n": 3, "seed": 10, "temperature": 0.5, "stop": "a"})
    assert [p.seed for p in ps] == [10, 11, 12] and all(p.temperature == 0.5 and p.stop == ["a"] for p in ps)
    assert [p.seed for p in _params({"n": 2})] == [None, None]
    assert _params({})[0].temperature == 1.0  # OpenAI's default


@pytest.mark.parametrize("body, limits, param", [
    ({"n": 5}, Limits(max_n=4), "n"),
    ({"stop": ["a", "b", "c"]}, Limits(max_stop=2), "stop"),
    ({"stop": ["a" * 9]}, Limits(max_stop_len=8), "stop"),
    ({"stop_token_ids": [1, 2, 3]}, Limits(max_stop=2), "stop_token_ids"),
])
def test_caps_name_the_field(body, limits, param):
    with pytest.raises(RequestError) as e:
        _params(body, limits)
    assert e.value.status == 400 and e.value.param == param and "\n" not in e.value.message


def test_max_tokens_and_logprobs_bounds():
    with pytest.raises(RequestError, match="max_tokens must be in 1..64"):
        _params({}, max_tokens=65)
    with pytest.raises(RequestError, match="max_tokens must be in 1..10"):
        _params({}, Limits(max_tokens=10), max_tokens=11)
    with pytest.raises(RequestError, match="logprobs"):
        _params({}, Limits(max_logprobs=2), logprobs=3)
    assert _params({}, logprobs=2)[0].logprobs == 2


@pytest.mark.parametrize("body, field", [
    ({"prompt": 5}, "prompt"), ({"prompt": ["a", ""]}, "prompt"), ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": True}, "n"), ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"), ({"prompt": [[1], [-1]]}, "prompt"),
])
def test_validation_errors_name_the_field(body, field):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    msg, param = validation_message(e.value.errors())
    assert param == field and msg.startswith(field) and "\n" not in msg


def test_integers_as_json_writes_them_and_unknown_fields():
    req = CompletionRequest.model_validate({"prompt": [1.0, 2], "max_tokens": 3.0, "whatever": {"x": 1}})
    assert req.prompt == [1, 2] and req.max_tokens == 3 and not hasattr(req, "whatever")
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                               {"type": "text", "text": "b"}]}]})
    assert chat.messages[0].text() == "ab"
