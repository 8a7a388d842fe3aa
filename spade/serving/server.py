"""``spade serve``: an OpenAI-compatible HTTP server over ``AsyncEngine``.

    spade serve --config configs/cpu_tiny.yaml --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m", "prompt": "The sky is", "max_tokens": 16}'

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text). FastAPI routes on uvicorn, on the
same asyncio loop (uvloop when installed) as the engine: the server only talks to
``AsyncEngine`` and knows nothing of ranks, transports or kernels.

Behaviour: a bad request gets 400 with the OpenAI error object naming the field; more
requests than batch slots + ``serve.max_waiting`` get 429 with ``Retry-After``; a
client that disconnects has its request aborted (its slot freed); SIGTERM / SIGINT
stop accepting, let requests in flight finish for ``serve.shutdown_grace_s``, abort
the rest, close the engine (and its cache rank) and exit 0.

FastAPI and uvicorn are the ``serve`` extra (``pip install -e '.[serve]'``): this
module imports them, ``import spade`` does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import signal
import sys
import threading
import time
from typing import Any, AsyncIterator

from spade.errors import ArgumentError, ArgumentTypeError, ConfigError, MissingDependencyError

try:
    import anyio
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as _e:  # pragma: no cover - exercised without the extra
    raise MissingDependencyError(getattr(_e, "name", None) or "fastapi", "spade serve",
                                 "pip install -e '.[serve]' (fastapi, uvicorn)") from None

from spade.serving import openai_protocol as oai
from spade.serving.metrics import ServerMetrics, engine_value
from spade.serving.params import RequestOutput, RequestOutputKind, SamplingParams

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def _error_response(e: oai.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class ServerState:
    """What the routes share: the engine, the config, the metrics and the requests in flight."""

    def __init__(self, engine, cfg):
        self.engine = engine
        self.cfg = cfg
        self.scfg = cfg.serve
        self.model_name = cfg.serve.served_model_name or cfg.model.name
        self.live: set[str] = set()  # request ids handed to the engine and not finished
        self.draining = False
        pol = cfg.policy
        self.metadata = {"model": cfg.model.name, "policy": pol.name, "budget": getattr(pol, "budget", None),
                         "topology": cfg.runtime.topology, "transport": cfg.runtime.transport.name,
                         "max_seq_len": cfg.model.max_seq_len, "max_batch": cfg.serving.max_batch,
                         "prefill_chunk": cfg.serving.prefill_chunk}
        self.metrics = ServerMetrics({"model": self.model_name, "policy": pol.name,
                                      "topology": cfg.runtime.topology, "transport": cfg.runtime.transport.name})
        key = cfg.serve.api_key
        self.api_key = key.get_secret_value() if key is not None else None

    # -- admission ----------------------------------------------------------
    def stats(self) -> dict:
        try:
            return dict(self.engine.stats())
        except Exception:  # a scrape must not fail because the engine is closing
            return {}

    def admit(self) -> None:
        """429 when the engine's batch is full and ``serve.max_waiting`` requests wait."""
        if self.draining:
            raise oai.APIError("the server is shutting down; retry on another replica", status=503,
                               type="service_unavailable", code="shutting_down", headers={"Retry-After": "1"})
        slots = engine_value(self.stats(), "slots") or 0  # serving.max_batch
        if self.metrics.in_flight >= slots + self.scfg.max_waiting:
            self.metrics.reject("overload")
            raise oai.APIError(f"the server is at capacity ({self.metrics.in_flight} requests in flight, "
                               f"serve.max_waiting={self.scfg.max_waiting}); retry later", status=429,
                               type="rate_limit_error", code="overloaded", headers={"Retry-After": "1"})

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            self.metrics.reject("unauthorized")
            raise oai.APIError("a valid API key is needed: send the header 'Authorization: Bearer <key>' "
                               "(serve.api_key)", status=401, type="authentication_error", param=None,
                               code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.cfg.model.name):
            raise oai.APIError(f"model: {name!r} is not served here; this server serves {self.model_name!r} "
                               "(GET /v1/models)", param="model", code="model_not_found")

    # -- prompts ------------------------------------------------------------
    @property
    def tokenizer(self):
        return getattr(self.engine, "tokenizer", None)

    def completion_prompt(self, req: oai.CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise oai.APIError(f"prompt: spade serves one prompt per request, got a batch of {len(p)}; send "
                                   "one request per prompt", param="prompt")
            p = p[0]
        if isinstance(p, list):
            if not p:
                raise oai.APIError("prompt: the token-id list is empty", param="prompt")
            return list(p)
        if not p:
            raise oai.APIError("prompt: the prompt is empty; give it some text", param="prompt")
        tok = self.tokenizer
        if tok is None:
            return self.byte_ids(p, "prompt")
        return list(tok(p)["input_ids"])  # with the model's special tokens (a BOS), as vLLM does

    def byte_ids(self, text: str, param: str) -> list[int]:
        """A model without a tokenizer (a random-weight preset) reads text as its UTF-8
        bytes, one token id each: deterministic, so its requests can be compared."""
        vocab = getattr(self.engine, "vocab", None) or getattr(getattr(self.engine, "backend", None),
                                                              "vocab_size", None)
        if vocab is not None and vocab < 256:
            raise oai.APIError(f"{param}: model '{self.cfg.model.name}' has no tokenizer and a vocabulary of "
                               f"{vocab} < 256, too small to read text as bytes; send token ids", param=param)
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise oai.APIError(f"{param}: the text is not valid Unicode ({e.reason} at character {e.start})",
                               param=param) from None

    def chat_prompt(self, req: oai.ChatCompletionRequest) -> list[int]:
        messages = oai.chat_messages(req)
        tok = self.tokenizer
        if tok is None:
            return self.byte_ids(oai.plain_chat_prompt(messages), "messages")
        if getattr(tok, "chat_template", None):
            try:
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # a template that refuses the roles or their order
                raise oai.APIError(f"messages: the model's chat template refused them: {e}",
                                   param="messages") from None
        else:
            text = oai.plain_chat_prompt(messages)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def sampling(self, req, prompt: list[int], param: str, default_max: int | None) -> SamplingParams:
        """SamplingParams, with the prompt and ``max_tokens`` checked against
        ``model.max_seq_len`` (``default_max`` None: the rest of the context). Outputs
        come as deltas (``output_kind="delta"``: no copy of the whole output per token);
        ``_Call`` adds them up."""
        cap, n = self.cfg.model.max_seq_len, len(prompt)
        if n >= cap:
            raise oai.APIError(f"{param}: the prompt has {n} tokens; this model's context (model.max_seq_len) "
                               f"is {cap}, which leaves room for at most {cap - 1} prompt tokens and one to "
                               "generate", param=param, code="context_length_exceeded")
        room = cap - n
        default_max = room if default_max is None else min(default_max, room)
        params = oai.to_sampling_params(req, default_max_tokens=default_max)
        if params.max_tokens > room:
            field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None \
                else "max_tokens"
            raise oai.APIError(f"{field}: {params.max_tokens} tokens to generate after a prompt of {n} tokens "
                               f"exceed this model's context of {cap} (model.max_seq_len); ask for at most {room}",
                               param=field, code="context_length_exceeded")
        return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)


async def _read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise oai.APIError(f"the request body is not valid JSON: {e}", param=None, code="invalid_json") from None


async def _until_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body must have been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _abort(state: ServerState, rid: str) -> None:
    """Abort ``rid`` in the engine, even from a cancelled task (a client that left)."""
    if rid not in state.live:
        return
    state.live.discard(rid)
    with anyio.CancelScope(shield=True):
        try:
            await state.engine.abort(rid)
        except Exception:  # the request may have finished in between; nothing to free then
            pass


class _Call:
    """One request in the engine: its generator, its deadline, its bookkeeping. With
    ``output_kind="delta"`` (what ``ServerState.sampling`` asks for) it adds up the
    outputs' ids and text: ``cumulative()`` is the request's whole output so far."""

    def __init__(self, state: ServerState, request: Request, prompt, params: SamplingParams):
        self.state = state
        self.request = request
        self.rid = oai.new_id("req")
        self.t0 = time.monotonic()
        self.deadline = asyncio.get_running_loop().time() + state.scfg.request_timeout_s
        self.gen = state.engine.generate(prompt, params, self.rid)
        self.last: RequestOutput | None = None
        self.delta = params.output_kind == RequestOutputKind.DELTA
        self.ids: list[int] = []  # the output ids so far (delta outputs, added up)
        self.pieces: list[str] = []  # the output text so far, in pieces
        self._closed = False
        state.live.add(self.rid)
        state.metrics.in_flight += 1

    async def next(self) -> RequestOutput | None:
        """The next output (None after the final one). Errors the engine raises before
        any work become 400s; the deadline (``serve.request_timeout_s``) a 504."""
        if self.last is not None and self.last.finished:
            return None
        try:
            async with asyncio.timeout_at(self.deadline):
                out = await self.gen.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"the engine ended request {self.rid} without a final output") from None
        except TimeoutError:
            raise oai.APIError(f"the request ran past serve.request_timeout_s ({self.state.scfg.request_timeout_s}"
                               " s) and was aborted", status=504, type="timeout", code="timeout") from None
        except (ArgumentError, ArgumentTypeError, ConfigError) as e:
            if self.last is not None:
                raise
            raise oai.engine_error(e) from None
        self.last = out
        if self.delta:
            self.ids += out.token_ids
            if out.text:
                self.pieces.append(out.text)
        return out

    def cumulative(self) -> RequestOutput | None:
        """The last output with everything generated so far (its ``token_ids`` and ``text``)."""
        out = self.last
        if out is None or not self.delta:
            return out
        return dataclasses.replace(out, token_ids=list(self.ids), text="".join(self.pieces))

    @property
    def num_output_tokens(self) -> int:
        if self.delta:
            return len(self.ids)
        return len(self.last.token_ids) if self.last is not None else 0

    async def until(self, what) -> tuple[bool, Any]:
        """Await ``what`` (a coroutine) unless the client disconnects first: (True, its
        result), or (False, None) when the client left (the coroutine is cancelled)."""
        task = asyncio.ensure_future(what)
        gone = asyncio.ensure_future(_until_disconnect(self.request))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            gone.cancel()
        if task in done:
            return True, task.result()
        task.cancel()
        await asyncio.wait({task})  # let it unwind (its error, a cancellation, stays in the task)
        return False, None

    async def close(self) -> None:
        """Release the request: abort it in the engine unless it finished; record it.
        Safe from a cancelled task (a client that left) and idempotent."""
        if self._closed:
            return
        self._closed = True
        st = self.state
        st.metrics.in_flight -= 1
        out = self.last
        with anyio.CancelScope(shield=True):
            if out is not None and out.finished:
                st.live.discard(self.rid)
            else:
                await _abort(st, self.rid)
            with contextlib.suppress(BaseException):
                await self.gen.aclose()
        if out is not None:
            reason = out.finish_reason if out.finished else "abort"
            n = self.num_output_tokens
            st.metrics.finish(reason, ttft=out.ttft_s, tpot=out.tpot_s if n > 1 else None,
                              e2e=time.monotonic() - self.t0, queue=out.queue_s,
                              prompt_tokens=len(out.prompt_token_ids), completion_tokens=n)


async def _complete(state: ServerState, request: Request, prompt, params: SamplingParams, *, stream: bool,
                    include_usage: bool, chat: bool) -> Response:
    state.admit()
    call = _Call(state, request, prompt, params)
    model, created = state.model_name, oai.now()
    rid = oai.new_id("chatcmpl" if chat else "cmpl")

    if not stream:
        async def collect():
            while await call.next() is not None:
                pass
        try:
            here, _ = await call.until(collect())
        finally:
            await call.close()
        if not here:  # the client left: its slot is free again
            return Response(status_code=499)
        build = oai.chat_response if chat else oai.completion_response
        return JSONResponse(build(rid, model, created, call.cumulative()))

    # the first output before the headers: an error the engine raises is still a 400
    try:
        here, first = await call.until(call.next())
    except BaseException:
        await call.close()
        raise
    if not here:
        await call.close()
        return Response(status_code=499)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(out: RequestOutput) -> bytes:
        text, finish = out.delta_text, out.finish_reason
        if chat:
            delta = {"content": text} if text or finish is None else {}
            return _sse(oai.chat_chunk(rid, model, created, delta, finish, out.stop_reason))
        return _sse(oai.completion_chunk(rid, model, created, text, finish, out.stop_reason))

    async def events() -> AsyncIterator[bytes]:
        try:
            if chat:
                yield _sse(oai.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, None))
            out = first
            while out is not None:
                if out.delta_text or out.finished:
                    yield chunk(out)
                if out.finished and include_usage:
                    yield _sse(oai.usage_chunk(rid, model, created, obj, call.cumulative()))
                try:
                    out = await call.next()
                except oai.APIError as e:  # the deadline
                    yield _sse(e.body())
                    break
                except Exception as e:  # the engine failed mid-stream: say so on the stream
                    yield _sse(oai.APIError(f"the generation failed: {type(e).__name__}: {e}", status=500,
                                            type="internal_error").body())
                    break
            yield _sse("[DONE]")
        finally:
            await call.close()

    # run the stream up to its first event here: a started generator is closed (its
    # finally frees the request) even if the response is cancelled before it iterates
    stream_ = events()
    head = await stream_.__anext__()

    async def body() -> AsyncIterator[bytes]:
        yield head
        async for b in stream_:
            yield b

    return StreamingResponse(body(), media_type="text/event-stream", headers=_SSE_HEADERS)


def build_app(engine, cfg) -> FastAPI:
    """The FastAPI app over ``engine`` (an ``AsyncEngine``) and ``cfg`` (its ``SpadeConfig``)."""
    state = ServerState(engine, cfg)
    app = FastAPI(title="spade", version=_version(), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.spade = state

    @app.exception_handler(oai.APIError)
    async def _api_error(request: Request, e: oai.APIError):
        if e.status == 400:
            state.metrics.reject("bad_request")
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        typ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {e.detail}", "type": typ,
                                       "param": None, "code": None}}, status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return JSONResponse({"error": {"message": f"internal error: {type(e).__name__}: {e}", "type": "internal_error",
                                       "param": None, "code": None}}, status_code=500)

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(state.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        card = {"id": state.model_name, "object": "model", "created": _STARTED, "owned_by": "spade",
                "root": cfg.model.name, "max_model_len": cfg.model.max_seq_len, "spade": state.metadata}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        state.check_auth(request)
        req = oai.parse_request(oai.CompletionRequest, await _read_json(request))
        state.check_model(req.model)
        prompt = state.completion_prompt(req)
        params = state.sampling(req, prompt, "prompt",  # 16: OpenAI's default for completions
                                default_max=state.scfg.default_max_tokens or 16)
        return await _complete(state, request, prompt, params, stream=req.stream, chat=False,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.check_auth(request)
        req = oai.parse_request(oai.ChatCompletionRequest, await _read_json(request))
        state.check_model(req.model)
        prompt = state.chat_prompt(req)
        params = state.sampling(req, prompt, "messages",  # None: the rest of the context
                                default_max=state.scfg.default_max_tokens)
        return await _complete(state, request, prompt, params, stream=req.stream, chat=True,
                               include_usage=bool(req.stream_options and req.stream_options.include_usage))

    return app


_STARTED = int(time.time())


def _version() -> str:
    from spade import __version__

    return __version__


class _Server(uvicorn.Server):
    """uvicorn's server, exiting 0 on SIGTERM / SIGINT: uvicorn re-raises the signal after
    its graceful shutdown (the process would die of it); spade's shutdown is the normal
    end of ``spade serve``."""

    def __init__(self, config, on_started=None, on_exit=None):
        super().__init__(config)
        self._on_started = on_started
        self._on_exit = on_exit

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def handle_exit(self, sig, frame) -> None:
        if self._on_exit is not None:
            self._on_exit()
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._on_started is not None:
            self._on_started(self)


def bound_address(server: uvicorn.Server) -> tuple[str, int]:
    sock = server.servers[0].sockets[0]
    host, port = sock.getsockname()[:2]
    return host, port


async def serve(cfg, *, engine=None, host: str | None = None, port: int | None = None,
                log=print) -> int:
    """Build an ``AsyncEngine`` (unless given), serve it until SIGTERM / SIGINT, close it.

    Returns 0 after a clean shutdown. Runs on the caller's event loop."""
    host = host or cfg.serve.host
    port = cfg.serve.port if port is None else port
    if engine is None:
        from spade.serving.engine import AsyncEngine

        engine = AsyncEngine(cfg)
    app = build_app(engine, cfg)
    state: ServerState = app.state.spade

    def started(server):
        h, p = bound_address(server)
        log(f"spade serve: listening on http://{h}:{p} (model {state.model_name}, policy {cfg.policy.name}, "
            f"topology {cfg.runtime.topology}, transport {cfg.runtime.transport.name})")

    def stopping():
        state.draining = True

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=cfg.serve.shutdown_grace_s, timeout_keep_alive=5)
    server = _Server(config, on_started=started, on_exit=stopping)
    try:
        try:
            await server.serve()
        except SystemExit:  # uvicorn's answer to a port it cannot bind (it logged why)
            pass
    finally:
        state.draining = True
        for rid in list(state.live):  # past the grace period: abort what is left
            await _abort(state, rid)
        await engine.close()
    if not server.started:
        raise ConfigError(f"serve.host / serve.port: could not listen on {host}:{port} (see the message above); "
                          "pick a free port (0: any) or another address")
    log("spade serve: stopped")
    return 0


def run_server(cfg, *, host: str | None = None, port: int | None = None) -> int:
    """``spade serve`` as a function: a new event loop (uvloop when installed), ``serve``."""
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(serve(cfg, host=host, port=port, log=lambda m: print(m, file=sys.stderr, flush=True)))


__all__ = ["build_app", "serve", "run_server", "ServerState", "bound_address"]
