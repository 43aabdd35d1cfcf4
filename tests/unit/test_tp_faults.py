"""Tensor-parallel faults: an interrupted generate leaves the group in step, a dead worker is reported
within seconds, a failed ``LLM()`` or a dead owner leaves no worker behind, a script without a main
guard gets an error that says what to add instead of a hang."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from specserve import LLM, SamplingParams
from specserve.engine.model_runner import TPWorkerError

pytestmark = pytest.mark.multiproc
PARAMS = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], [11, 12]]


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie child of this process counts as gone once reaped by its parent
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def _plain_tokens_and_tp_llm(tiny_llama):
    """(a fresh one-process LLM's tokens for PROMPTS, a TP=2 LLM with n-gram speculation)"""
    want = [o.outputs[0].token_ids for o in LLM(model=str(tiny_llama), dtype="float32").generate(
        PROMPTS, PARAMS, use_tqdm=False)]
    return want, LLM(model=str(tiny_llama), dtype="float32", tensor_parallel_size=2,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 3})


@pytest.fixture
def sigint_handler():
    """Sets this process's SIGINT handler for a test, then puts the one before back: the suite may run
    with SIGINT ignored (started in the background by a shell without job control)."""
    before = signal.getsignal(signal.SIGINT)
    yield lambda handler: signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGINT, before)


def test_keyboard_interrupt_mid_generate_leaves_the_group_usable(tiny_llama, sigint_handler):
    """Ctrl-C (SIGINT to this process) at several points of a generate: KeyboardInterrupt is raised,
    the requests are dropped, and the next generate on the same LLM gives a fresh LLM's tokens."""
    sigint_handler(signal.default_int_handler)
    want, llm = _plain_tokens_and_tp_llm(tiny_llama)
    try:
        for delay in (0.05, 0.13, 0.31):
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            interrupted = False
            try:
                for _ in range(50):  # long enough for the timer to fire inside a generate
                    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            except KeyboardInterrupt:
                interrupted = True
            timer.join()
            # what a lost Ctrl-C needs to be traced: whether it was sent, and the handler it met
            assert interrupted, (f"no KeyboardInterrupt (delay {delay} s; SIGINT sent: {timer.finished.is_set()}, "
                                 f"handler now: {signal.getsignal(signal.SIGINT)!r})")
            assert not llm.engine.waiting and not llm.engine.running
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
            assert got == want
    finally:
        llm.shutdown()


def test_ctrl_c_stays_ignored_where_the_process_ignores_it(tiny_llama, sigint_handler):
    """With SIGINT ignored, a Ctrl-C mid-generate is ignored as everywhere else in the process: the
    generate finishes with a fresh LLM's tokens and no KeyboardInterrupt comes later."""
    sigint_handler(signal.SIG_IGN)
    want, llm = _plain_tokens_and_tp_llm(tiny_llama)
    try:
        timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        got = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] for _ in range(5)]
        timer.join()
        assert timer.finished.is_set() and got == [want] * 5
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        llm.shutdown()


def test_a_dead_worker_is_reported_and_the_llm_refuses_further_work(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", tensor_parallel_size=2)
    try:
        (worker,) = llm.engine.runner.procs
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TPWorkerError, match=r"tensor-parallel worker 1 failed \(exit code -9\)"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert time.monotonic() - t0 < 10
        with pytest.raises(TPWorkerError, match="failed earlier .* create a new LLM"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_failed_llm_leaves_no_worker(tiny_llama, tmp_path):
    """A speculative configuration that cannot work fails before any worker starts; one that fails
    while loading (a drafter checkpoint that is not one) stops the workers it started."""
    import multiprocessing as mp

    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        LLM(model=str(tiny_llama), tensor_parallel_size=2,
            speculative_config={"method": "dspark", "model": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="unknown speculative method"):
        LLM(model=str(tiny_llama), tensor_parallel_size=2, speculative_config={"method": "eagle9"})
    assert time.monotonic() - t0 < 3 and not mp.active_children()  # no worker was started
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    with pytest.raises(Exception):
        LLM(model=str(tiny_llama), tensor_parallel_size=2, dtype="float32",
            speculative_config={"method": "dspark", "model": str(bad)})
    assert not mp.active_children()


def _run_script(tmp_path, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def test_workers_die_with_their_owner(tiny_llama, tmp_path):
    """The process that owns an LLM is killed (SIGKILL: no clean-up runs): its workers exit."""
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from specserve import LLM
        if __name__ == "__main__":
            llm = LLM(model={str(tiny_llama)!r}, dtype="float32", tensor_parallel_size=2)
            print(*[p.pid for p in llm.engine.runner.procs], flush=True)
            time.sleep(600)
    """))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pids = [int(x) for x in owner.stdout.readline().split()]
        assert pids
        owner.kill()
        owner.wait()
        assert all(_gone(pid) for pid in pids)
    finally:
        owner.kill()


def test_a_script_without_a_main_guard_gets_an_error_not_a_hang(tiny_llama, tmp_path):
    out = _run_script(tmp_path, f"""
        from specserve import LLM
        llm = LLM(model={str(tiny_llama)!r}, dtype="float32", tensor_parallel_size=2)
        print("built")
    """)
    assert out.returncode != 0 and "built" not in out.stdout
    assert 'if __name__ == "__main__":' in out.stderr.splitlines()[-1]
