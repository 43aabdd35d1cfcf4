"""The engine in its own thread, fed by asyncio request handlers (continuous batching).

Handlers put ``add`` / ``abort`` commands on a thread-safe queue; the engine thread takes them between
steps (a request joins or leaves the running batch at a step boundary), steps while anything is
unfinished, and after each step hands every request its new tokens and text (``Delta``) through the
request's asyncio queue (``loop.call_soon_threadsafe``). Only the engine thread touches the engine's
state; other threads read counters for ``/metrics``.

An exception inside a step is an engine fault: every request in flight gets the error, the loop stops
and ``dead`` says why (``/health`` answers 503 from then on)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from specserve.config import SamplingParams

log = logging.getLogger("specserve.serve")


@dataclass
class Delta:
    """What one choice gained in a step: text (held back while it could still be part of a stop
    string), token ids, their logprobs (when asked for), and at the end its finish reason; or an error."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    status: int = 500  # the HTTP status of ``error``


class Request:
    """One sequence of an HTTP request (a choice): what the engine needs, where its deltas go, and how
    much of it was delivered."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, out: asyncio.Queue,
                 prompt: str | None = None):
        self.index, self.prompt_ids, self.params, self.out, self.prompt = index, prompt_ids, params, out, prompt
        self.seq = None
        self.sent_ids = 0
        self.sent_text = 0
        self.arrival = time.perf_counter()
        self.last_token_time: float | None = None
        self.done = False
        self.released = False  # the HTTP side let go of it (``server.release``)


class EngineLoop:
    """Runs ``engine`` (an ``LLMEngine``) in a thread. ``metrics``: a ``ServerMetrics`` (or None) told
    about tokens as they are delivered."""

    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.active: list[Request] = []
        self.pending = 0  # requests put on the inbox, not yet taken by the engine thread
        self.dead: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False  # the engine thread has ended and takes no more commands

    # ---- called from the event loop (or any thread) --------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.dead is None and self.thread is not None and self.thread.is_alive()

    def add(self, reqs: list[Request]) -> None:
        with self._lock:
            if not self._closed:
                self.pending += len(reqs)
                self.inbox.put(("add", reqs))
                return
        for r in reqs:  # the engine thread has ended: nothing would ever answer
            r.done = True
            r.out.put_nowait(Delta(r.index, error="the engine is not running", status=503))

    def abort(self, reqs: list[Request]) -> None:
        """Stop these requests (the client left): their KV blocks are given back at the next step boundary."""
        if any(not r.done for r in reqs):
            self.inbox.put(("abort", reqs))

    def abort_all(self) -> None:
        self.inbox.put(("abort_all", None))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight and end the thread (the engine itself is shut down by its owner)."""
        self.inbox.put(("stop", None))
        if self.thread is not None:
            self.thread.join(timeout)

    def counts(self) -> tuple[int, int, float]:
        """(requests running, requests waiting, KV cache usage in [0, 1]) as of now."""
        sched = self.engine.scheduler
        blocks = sched.blocks
        usage = blocks.num_used() / max(1, blocks.num_blocks - 1)
        return len(sched.running) + len(sched.prefilling), len(sched.waiting) + self.pending, usage

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not self._take_commands(block=not busy):
                    break
                if self.engine.has_unfinished():
                    self.engine.step()
                    self._deliver()
        except Exception as e:  # an engine fault: every request in flight hears of it
            log.exception("engine fault")
            self.dead = f"engine fault: {type(e).__name__}"
            for r in self.active:
                r.done = True
                self._push(r, Delta(r.index, error="the engine failed while running this request"))
            for r in self.active:
                try:
                    self.engine.abort(r.seq)
                except Exception:
                    pass
            self.active = []
        else:
            self.dead = "the engine loop stopped"
        finally:
            self._close()

    def _close(self) -> None:
        """No more commands: requests still on the inbox are answered with an error."""
        with self._lock:
            self._closed = True
        while True:
            try:
                cmd, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                for r in arg:
                    r.done = True
                    self._push(r, Delta(r.index, error="the engine is not running", status=503))

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when there is nothing to run. False: stop."""
        while True:
            try:
                cmd, arg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if cmd == "add":
                with self._lock:
                    self.pending -= len(arg)
                for r in arg:
                    self._add(r)
            elif cmd == "abort":
                self._abort(arg)
            elif cmd == "abort_all":
                self._abort(self.active)
            elif cmd == "stop":
                self._abort(self.active)
                return False

    def _add(self, r: Request) -> None:
        if r.done:  # aborted before it reached the engine
            return
        try:
            r.seq = self.engine.add_request(r.prompt_ids, r.params, r.prompt)
        except (ValueError, TypeError) as e:  # checked by the handler already; never fatal here
            r.done = True
            self._push(r, Delta(r.index, error=str(e)))
            return
        self.active.append(r)

    def _abort(self, reqs: list[Request]) -> None:
        for r in list(reqs):
            if r.done:
                continue
            r.done = True
            if r.seq is not None and not r.seq.finished:
                self.engine.abort(r.seq)
            self._push(r, Delta(r.index, finish_reason="abort"))
        gone = {id(r) for r in reqs}
        self.active = [r for r in self.active if id(r) not in gone]

    def _deliver(self) -> None:
        now = time.perf_counter()
        still = []
        for r in self.active:
            s = r.seq
            ids = s.output_ids
            text = s.text if s.finished else s.stream_text()
            new_ids = ids[r.sent_ids:]
            if new_ids or len(text) > r.sent_text or s.finished:
                lps = s.logprobs[r.sent_ids:len(ids)] if s.logprobs is not None else None
                d = Delta(r.index, text[r.sent_text:], list(new_ids), lps,
                          s.finish_reason if s.finished else None, s.stop_reason if s.finished else None)
                if self.metrics is not None and new_ids:
                    self.metrics.tokens_delivered(r, len(new_ids), now)
                if new_ids:
                    r.last_token_time = now
                r.sent_ids, r.sent_text = len(ids), len(text)
                if s.finished:
                    r.done = True
                    if self.metrics is not None:
                        self.metrics.request_finished(r, s.finish_reason, now)
                self._push(r, d)
            if not s.finished:
                still.append(r)
        self.active = still

    def _push(self, r: Request, d: Delta) -> None:
        if self.loop is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(r.out.put_nowait, d)
            except RuntimeError:  # the event loop closed meanwhile (shutdown)
                pass
