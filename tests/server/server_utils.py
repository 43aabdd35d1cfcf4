"""Helpers of the HTTP tests: the real default model behind ``specserve serve``'s app, run by uvicorn in
a thread of the test process on a free port (port 0), driven by the real ``openai`` client."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from specserve import LLM  # noqa: E402
from specserve.entrypoints.openai.engine_loop import EngineLoop  # noqa: E402
from specserve.entrypoints.openai.protocol import Limits  # noqa: E402
from specserve.entrypoints.openai.server import ServerState, UvicornServer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
# the shipped drafters of the default model, as tests/e2e/test_spec_default_model.py runs them
SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
    "medusa": {"method": "medusa", "medusa_tree": "auto", "medusa_verify": "auto"},
    "dspark": {"method": "dspark", "dspark_verify": "full"},
}


@contextlib.contextmanager
def serving(llm: LLM, api_key: str | None = None, limits: Limits | None = None, max_num_queued_requests: int = 256):
    """Serve ``llm``'s engine until the block ends; yields (base URL, ServerState)."""
    state = ServerState(EngineLoop(llm.engine), MODEL, limits or Limits(), api_key, max_num_queued_requests)
    server = UvicornServer(state, "127.0.0.1", 0)
    url = server.start_in_thread()
    try:
        yield url, state
    finally:
        server.stop()


def client(url: str, api_key: str = "none", timeout: float = 120.0):
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


