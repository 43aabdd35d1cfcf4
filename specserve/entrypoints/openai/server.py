"""The FastAPI app of ``specserve serve``: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, plus ``/health``, ``/version``, ``/metrics``, ``/tokenize`` and ``/detokenize``, and
``run_server`` (uvicorn; Ctrl-C / SIGTERM abort what is in flight, then the engine shuts down).

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with one line that
names the field and no server path. Requests are checked whole (types, ranges, token ids, lengths)
before anything reaches the engine; a bounded number of sequences may be in flight (``429`` with
``Retry-After`` beyond it); a client that leaves aborts its request (its KV blocks are given back)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve import LLM, __version__
from specserve.entrypoints.openai.engine_loop import Delta, EngineLoop, Request
from specserve.entrypoints.openai.metrics import ServerMetrics
from specserve.entrypoints.openai.protocol import (ChatRequest, CompletionRequest, DetokenizeRequest,
                                                   ErrorResponse, Limits, RequestError, TokenizeRequest,
                                                   sampling_params, validation_message)

log = logging.getLogger("specserve.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 431: "invalid_request_error",
               429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


def error_body(message: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


GENERATION_ERRORS = (400, 404, 413, 429, 500, 503)
STREAMED = {200: {"description": "the response, or with stream: server-sent events",
                  "content": {"application/json": {}, "text/event-stream": {}}}}


def errors(*statuses: int) -> dict:
    """OpenAPI ``responses`` of a route: these statuses and those of every route (401, 431)."""
    return {s: {"model": ErrorResponse, "description": ERROR_TYPES.get(s, "error")}
            for s in sorted({*statuses, 401, 431})}


def error_response(message: str, status: int, param: str | None = None, headers: dict | None = None):
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


@dataclass
class ServerState:
    """What the app serves: the engine loop, the model's name, the caps, and the API key (None: open)."""

    loop: EngineLoop
    model_name: str
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    max_num_queued_requests: int = 256
    metrics: ServerMetrics | None = None
    inflight: int = 0  # sequences accepted and not yet finished

    @property
    def engine(self):
        return self.loop.engine

    @property
    def capacity(self) -> int:
        return self.engine.cfg.max_num_seqs + self.max_num_queued_requests


class Guard:
    """ASGI middleware run before any route: header size (h11's own cap only catches headers that
    arrive in pieces), the API key (constant-time comparison) and the declared body size."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, max_header_bytes: int):
        self.app, self.max_body, self.max_header = app, max_body_bytes, max_header_bytes
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            raw = scope.get("headers") or []
            if sum(len(k) + len(v) + 4 for k, v in raw) + len(scope.get("raw_path") or b"") > self.max_header:
                r = error_response(f"request headers larger than {self.max_header} bytes", 431)
                return await r(scope, receive, send)
            headers = dict(raw)
            if self.key is not None:
                auth = headers.get(b"authorization", b"")
                given = auth[7:] if auth[:7].lower() == b"bearer " else b""
                if not hmac.compare_digest(given, self.key):
                    r = error_response("invalid or missing API key (Authorization: Bearer KEY)", 401)
                    return await r(scope, receive, send)
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                r = error_response(f"request body larger than {self.max_body} bytes", 413)
                return await r(scope, receive, send)
        await self.app(scope, receive, send)


async def read_json(request: HTTPRequest, model, max_bytes: int):
    """The body as ``model``: at most ``max_bytes`` read, malformed JSON and wrong types are 400s."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestError(f"request body larger than {max_bytes} bytes", 413)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON body: {str(e).split(':')[0]}") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e.errors())
        raise RequestError(msg, param=param) from None


def create_app(state: ServerState) -> FastAPI:
    metrics = state.metrics or ServerMetrics(state.model_name)
    state.metrics = metrics
    state.loop.metrics = metrics
    metrics.attach(state.loop)

    async def lifespan(app):
        if state.loop.thread is None:
            state.loop.start(asyncio.get_running_loop())
        yield
        state.loop.stop()

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan)
    body = openapi_bodies(app, [CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest])
    app.state.specserve = state
    app.add_middleware(Guard, api_key=state.api_key, max_body_bytes=state.limits.max_body_bytes,
                       max_header_bytes=state.limits.max_header_bytes)
    tok = state.engine.tokenizer

    @app.exception_handler(RequestError)
    async def _request_error(request, e: RequestError):
        return error_response(e.message, e.status, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        msg, param = validation_message(list(e.errors()))
        return error_response(msg, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error_response(str(e.detail), e.status_code, headers=e.headers)  # 405: its Allow header

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        log.exception("error while serving a request")
        return error_response("internal server error", 500)

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise RequestError(f"model {name!r} does not exist; this server serves {state.model_name!r}", 404,
                               "model")

    def check_alive() -> None:
        if not state.loop.alive:
            raise RequestError("the engine is not running", 503)

    # ---- plain routes ----------------------------------------------------------------------------
    @app.get("/health", responses=errors(503))
    async def health():
        if not state.loop.alive:
            return error_response(state.loop.dead or "the engine is not running", 503)
        return {"status": "ok"}

    @app.get("/version", responses=errors())
    async def version():
        return {"version": __version__}

    @app.get("/v1/models", responses=errors())
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": STARTED,
                                            "owned_by": "specserve", "max_model_len": state.engine.max_model_len}]}

    @app.get("/metrics", response_class=PlainTextResponse, responses=errors())
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize", openapi_extra=body[TokenizeRequest], responses=errors(400, 404, 413))
    async def tokenize(request: HTTPRequest):
        req = await read_json(request, TokenizeRequest, state.limits.max_body_bytes)
        check_model(req.model)
        if req.prompt is not None and req.messages is not None:
            raise RequestError("give one of prompt and messages, not both", param="prompt")
        ids = (chat_ids(tok, req.messages, req.add_generation_prompt) if req.messages is not None
               else tok.encode(req.prompt or "", req.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len}

    @app.post("/detokenize", openapi_extra=body[DetokenizeRequest], responses=errors(400, 404, 413))
    async def detokenize(request: HTTPRequest):
        req = await read_json(request, DetokenizeRequest, state.limits.max_body_bytes)
        check_model(req.model)
        check_ids(req.tokens, state.engine.model_config.vocab_size, "tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    # ---- generation ----------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=body[CompletionRequest], responses=STREAMED | errors(*GENERATION_ERRORS))
    async def completions(request: HTTPRequest):
        req = await read_json(request, CompletionRequest, state.limits.max_body_bytes)
        check_model(req.model)
        check_alive()
        prompts = completion_prompts(req.prompt, state.limits.max_prompts)
        items = [(p, tok.encode(p)) if isinstance(p, str) else (None, p) for p in prompts]
        return await generate(request, req, items, req.max_tokens, req.logprobs, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=body[ChatRequest], responses=STREAMED | errors(*GENERATION_ERRORS))
    async def chat_completions(request: HTTPRequest):
        req = await read_json(request, ChatRequest, state.limits.max_body_bytes)
        check_model(req.model)
        check_alive()
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens differ; give one", param="max_tokens")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        items = [(None, chat_ids(tok, req.messages, req.add_generation_prompt))]
        return await generate(request, req, items, max_tokens, logprobs, chat=True)

    async def generate(request, req, items, max_tokens, logprobs, chat: bool):
        engine = state.engine
        reqs, q = [], asyncio.Queue()
        for i, (text, ids) in enumerate(items):
            where = f"prompt {i}: " if len(items) > 1 else ""
            check_ids(ids, engine.model_config.vocab_size, "prompt", where)
            mt = max_tokens
            if len(ids) >= engine.max_model_len:
                raise RequestError(f"{where}prompt has {len(ids)} tokens; max_model_len is {engine.max_model_len}",
                                   param="prompt" if not chat else "messages")
            if mt is not None and len(ids) + mt > engine.max_model_len:
                raise RequestError(f"{where}prompt ({len(ids)} tokens) + max_tokens ({mt}) exceeds max_model_len "
                                   f"({engine.max_model_len})", param="max_tokens")
            if mt is None:  # what is left of max_model_len, within the server's cap
                mt = min(engine.max_model_len - len(ids), state.limits.max_tokens or engine.max_model_len)
            plist = sampling_params(req, mt, logprobs, state.limits, engine.max_model_len)
            for j, p in enumerate(plist):
                try:
                    engine.check_request(ids, p)
                except (ValueError, TypeError) as e:
                    raise RequestError(f"{where}{e}", param="prompt" if not chat else "messages") from None
                reqs.append(Request(i * req.n + j, ids, p, q, text))
        if state.inflight + len(reqs) > state.capacity:
            raise RequestError(f"too many requests in flight ({state.inflight}); retry later", 429,
                               headers={"Retry-After": "1"})
        state.inflight += len(reqs)
        state.loop.add(reqs)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        prompt_tokens = sum(len(ids) for _, ids in items)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(reqs, q, rid, chat, prompt_tokens, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(release, reqs))
        try:
            return await collect(request, reqs, q, rid, chat, prompt_tokens)
        finally:
            release(reqs)

    def release(reqs) -> None:
        """The request ended (finished, failed or its client left): the engine drops what is left.
        Called once or more (the stream's end and the response's background task)."""
        if reqs[0].released:
            return
        for r in reqs:
            r.released = True
        state.loop.abort(reqs)
        state.inflight -= len(reqs)

    async def collect(request, reqs, q, rid, chat, prompt_tokens):
        choices = {r.index: {"text": "", "ids": [], "lps": [], "finish": None, "stop": None} for r in reqs}
        left = len(reqs)
        while left:
            try:
                d: Delta = await asyncio.wait_for(q.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            if d.error is not None:
                raise RequestError(d.error, d.status)
            c = choices[d.index]
            c["text"] += d.text
            c["ids"] += d.token_ids
            c["lps"] += d.logprobs or []
            if d.finish_reason is not None:
                c["finish"], c["stop"] = d.finish_reason, d.stop_reason
                left -= 1
        logp = reqs[0].params.logprobs is not None
        out = []
        for i in sorted(choices):
            c = choices[i]
            lp = logprobs_json(tok, c["ids"], c["lps"], chat) if logp else None
            if chat:
                out.append({"index": i, "message": {"role": "assistant", "content": c["text"]}, "logprobs": lp,
                            "finish_reason": c["finish"], "stop_reason": c["stop"]})
            else:
                out.append({"index": i, "text": c["text"], "logprobs": lp, "finish_reason": c["finish"],
                            "stop_reason": c["stop"]})
        completion_tokens = sum(len(c["ids"]) for c in choices.values())
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": state.model_name, "choices": out, "usage": usage(prompt_tokens, completion_tokens)}

    async def stream(reqs, q, rid, chat, prompt_tokens, include_usage):
        created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"
        logp = reqs[0].params.logprobs is not None
        completion_tokens, left = 0, len(reqs)

        def event(choices, **extra) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choices}
            body.update(extra)
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if chat:  # the first delta of each choice carries the role
                yield event([{"index": r.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for r in reqs])
            while left:
                d: Delta = await q.get()
                if d.error is not None:
                    yield f"data: {json.dumps(error_body(d.error, d.status))}\n\n"
                    break
                if not d.text and not d.token_ids and d.finish_reason is None:
                    continue
                completion_tokens += len(d.token_ids)
                lp = logprobs_json(tok, d.token_ids, d.logprobs or [], chat) if logp else None
                choice = {"index": d.index, "logprobs": lp, "finish_reason": d.finish_reason}
                if chat:
                    choice["delta"] = {"content": d.text} if d.text or d.finish_reason is None else {}
                else:
                    choice["text"] = d.text
                    choice["stop_reason"] = d.stop_reason
                if d.finish_reason is not None:
                    left -= 1
                yield event([choice])
            else:
                if include_usage:
                    yield event([], usage=usage(prompt_tokens, completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            release(reqs)

    return app


STARTED = int(time.time())


def openapi_bodies(app: FastAPI, models: list) -> dict:
    """The request-body schemas of routes that read their body themselves (``read_json``), for
    ``/openapi.json``: per model its ``openapi_extra``; the schemas join the app's components."""
    from fastapi.openapi.utils import get_openapi

    defs, extras = {}, {}
    for m in models:
        schema = m.model_json_schema(ref_template="#/components/schemas/{model}")
        defs.update(schema.pop("$defs", {}))
        defs[m.__name__] = schema
        extras[m] = {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{m.__name__}"}}}}}

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return extras


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_prompts(prompt, max_prompts: int) -> list:
    """``prompt`` as a list of prompts: each a string or a list of token ids."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise RequestError("prompt is empty", param="prompt")
    if len(prompts) > max_prompts:
        raise RequestError(f"prompt: at most {max_prompts} prompts per request, got {len(prompts)}", param="prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise RequestError("prompt is empty" + (f" (prompt {i})" if len(prompts) > 1 else ""), param="prompt")
    return prompts


def check_ids(ids: list[int], vocab_size: int, param: str, where: str = "") -> None:
    if not ids:
        raise RequestError(f"{where}{param} is empty", param=param)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{where}{param}: token ids out of range [0, {vocab_size}): {bad[:5]}", param=param)


def chat_ids(tok, messages, add_generation_prompt: bool) -> list[int]:
    msgs = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return tok.apply_chat_template(msgs, add_generation_prompt)
    except ValueError as e:
        raise RequestError(str(e), param="messages") from None
    except Exception as e:  # a template error (e.g. roles it refuses)
        raise RequestError(f"messages: the chat template failed: {type(e).__name__}: {str(e)[:200]}",
                           param="messages") from None


def logprobs_json(tok, ids: list[int], lps: list, chat: bool):
    """OpenAI's logprobs object for these tokens: chat's ``{"content": [...]}`` or completions'
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
    def piece(t: int) -> str:
        return tok.decode([t], skip_special_tokens=False)

    if chat:
        return {"content": [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode()),
                             "top_logprobs": [{"token": piece(a), "logprob": v, "bytes": list(piece(a).encode())}
                                              for a, v in top]}
                            for t, (lp, top) in zip(ids, lps)]}
    tokens = [piece(t) for t in ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{piece(a): v for a, v in top} for _, top in lps], "text_offset": offsets}


# ---- running it ----------------------------------------------------------------------------------
H11_BUFFER_FACTOR = 16  # h11's buffer cap, in header caps


class UvicornServer:
    """uvicorn with the server's limits (h11: its header-size cap applies), a ready line once the socket
    listens, and in-flight requests aborted as soon as a stop is asked for (Ctrl-C, SIGTERM)."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 8000,
                 log_level: str = "warning", on_ready=None):
        import uvicorn

        self.state = state
        config = uvicorn.Config(create_app(state), host=host, port=port, http="h11", lifespan="on",
                                # h11's buffer cap, past which it answers a bare 400 itself: well above the
                                # header cap, so that oversized headers get the app's 431 however they arrive
                                h11_max_incomplete_event_size=H11_BUFFER_FACTOR * state.limits.max_header_bytes,
                                log_level=log_level,
                                timeout_graceful_shutdown=10, access_log=False)
        outer = self

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started and on_ready is not None:
                    on_ready(outer.address)

            def handle_exit(self, sig, frame):
                outer.state.loop.abort_all()  # open streams end now, so the graceful stop is quick
                super().handle_exit(sig, frame)
                # uvicorn raises the signal again once it stopped, which would kill the process before the
                # engine (and its tensor-parallel workers) shut down: the stop is ours to finish
                getattr(self, "_captured_signals", []).clear()

        self.server = _Server(config)

    @property
    def address(self) -> str:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def run(self) -> None:
        self.server.run()

    def start_in_thread(self, timeout: float = 60.0) -> str:
        """Serve from a background thread (tests); returns the address once it listens."""
        import threading

        self.thread = threading.Thread(target=self.run, name="specserve-http", daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.address

    def stop(self, timeout: float = 30.0) -> None:
        self.state.loop.abort_all()
        self.server.should_exit = True
        if getattr(self, "thread", None) is not None:
            self.thread.join(timeout)


def served_model_name(model) -> str:
    """The API's name for ``model``: its file or directory name (the default model's own name)."""
    from pathlib import Path

    if model is None:
        return "SmolLM2-135M-Instruct"
    p = Path(str(model).rstrip("/"))
    return p.stem if p.suffix == ".gguf" else p.name


def serve_from_args(args, llm_kwargs: dict) -> int:
    """``specserve serve``: load the engine, serve until Ctrl-C / SIGTERM, then shut everything down."""
    api_key = args.api_key or os.environ.get("SPECSERVE_API_KEY") or None
    name = args.served_model_name or served_model_name(args.model)
    print(f"[specserve] loading {name} ...", file=sys.stderr, flush=True)
    llm = LLM(**llm_kwargs)
    try:
        limits = Limits(max_n=args.max_n, max_tokens=args.max_tokens_cap, max_stop=args.max_stop,
                        max_body_bytes=args.max_body_bytes, max_header_bytes=args.max_header_bytes)
        state = ServerState(EngineLoop(llm.engine), name, limits, api_key, args.max_num_queued_requests)
        spec = llm.engine.proposer.name

        def ready(address: str) -> None:
            print(f"[specserve] serving {name} at {address}/v1 (speculative decoding: {spec}; "
                  f"max_num_seqs {llm.engine.cfg.max_num_seqs}, max_model_len {llm.engine.max_model_len}"
                  f"{', API key required' if api_key else ''})", flush=True)
            print("[specserve] ready", flush=True)

        server = UvicornServer(state, args.host, args.port, args.log_level, ready)
        server.run()
        if not server.server.started:
            print(f"error: could not listen on {args.host}:{args.port}", file=sys.stderr, flush=True)
            return 2
        print("[specserve] stopped", file=sys.stderr, flush=True)
    finally:
        llm.shutdown()
    return 0
