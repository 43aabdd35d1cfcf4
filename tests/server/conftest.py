"""Fixtures of the HTTP tests (``server_utils`` has the helpers)."""

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from specserve import LLM  # noqa: E402

from server_utils import serving  # noqa: E402


@pytest.fixture(scope="session")
def ref_llm():
    """Offline plain decoding, the reference (never the engine a server runs: that one is its thread's)."""
    llm = LLM(num_threads=2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def plain_server():
    llm = LLM(num_threads=2)
    with serving(llm) as (url, state):
        yield url, state
    llm.shutdown()
