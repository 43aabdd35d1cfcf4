"""Schemathesis against ``/openapi.json``: generated requests (valid and invalid, unknown methods) get
documented statuses, content types and error bodies, and none is a server error. Its positive-data check
(every schema-valid request accepted) is left out: the limits that depend on the served model (its
vocabulary, max_model_len) and the server's caps are not in the static schema, so such requests get
their documented 400s."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specserve import LLM
from specserve.entrypoints.openai.protocol import Limits

from server_utils import serving

pytestmark = pytest.mark.slow


def _schemathesis() -> str | None:
    exe = Path(sys.executable).parent / "schemathesis"
    return str(exe) if exe.exists() else shutil.which("schemathesis")


def test_schemathesis_conformance(tmp_path, real_threads):
    exe = _schemathesis()
    if exe is None:
        pytest.skip("schemathesis is not installed (pip install schemathesis==4.32.5)")
    llm = LLM(num_threads=real_threads, max_model_len=256)
    try:
        # small caps keep the generated requests cheap (n x prompts x max_tokens)
        with serving(llm, api_key="k", limits=Limits(max_tokens=4, max_n=2, max_prompts=4)) as (url, state):
            r = subprocess.run([exe, "run", url + "/openapi.json", "-H", "Authorization: Bearer k", "--checks", "all",
                                "--exclude-checks", "positive_data_acceptance", "--max-examples", "10", "--seed", "1",
                                "--no-color"], capture_output=True, text=True, timeout=600,
                               cwd=tmp_path)  # its cache directory goes there
            assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
            assert "API Operations" in r.stdout
            assert state.loop.alive  # no generated request hurt the engine
    finally:
        llm.shutdown()
