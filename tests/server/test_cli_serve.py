"""``specserve serve`` as a user runs it: a subprocess on the default model that prints its address and
a ready line, answers the openai client, and stops cleanly on SIGTERM or Ctrl-C (SIGINT) with a stream
in flight."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from server_utils import MODEL, client

pytestmark = pytest.mark.slow

ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_answers_and_stops(sig):
    proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--port", "0", "--threads", "1",
                             "--max-model-len", "512", "--api-key", "k", "--speculative-method", "ngram"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        lines, url = [], None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 240:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            url = url or (m and m.group(1))
            if "ready" in line:
                break
        assert url and lines[-1].strip() == "[specserve] ready", (lines, proc.stderr.read() if proc.poll() else "")
        assert "speculative decoding: ngram" in "".join(lines)
        c = client(url, "k")
        r = c.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
        got = {}

        def long_stream():
            try:
                got["chunks"] = [ch for ch in c.completions.create(model=MODEL, prompt="Tell me a story.",
                                                                   max_tokens=400, stream=True,
                                                                   extra_body={"ignore_eos": True})]
            except Exception as e:  # the connection may close with the server
                got["error"] = e

        t = threading.Thread(target=long_stream)
        t.start()
        time.sleep(1.0)
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        t.join(30)
        assert not t.is_alive()
        err = proc.stderr.read()
        assert rc == 0, err
        assert "Traceback" not in err and "[specserve] stopped" in err
        if "chunks" in got:  # the stream ended early, aborted
            assert got["chunks"][-1].choices[0].finish_reason == "abort"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
