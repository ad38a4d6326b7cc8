"""``ovshard api``: an OpenAI-compatible HTTP server (Starlette on uvicorn) over one head and its streams.

    GET  /v1/models             the bundle, as one model
    POST /v1/chat/completions   messages -> the bundle's chat template -> tokens (stream: server-sent events)
    POST /v1/completions        prompt text (or token ids) -> tokens
    GET  /health                each stage's state (a Ping, or a probe when the chain is down)
    GET  /metrics               Prometheus text (runtime/serve/metrics.py)
    GET  /v1/pipeline           the live view: each stage's host, layers, compute ms; network ms, tokens/s
    GET  /                      a chat page with that live view (runtime/serve/web/index.html: plain HTML + JS)

Requests run on the head's :class:`Scheduler`: as many at once as the stages' KV blocks hold (or ``--streams``),
``--queue`` more waiting in order; beyond that 429 with ``Retry-After`` (client/admission.py). A client that
disconnects, streaming or not, cancels its request: a running one frees its stream and KV blocks on every
stage, a waiting one leaves the queue. A stage that is down past ``--retry-s`` answers 503 naming the stage; so
does every request while the head is refused (``ovshard up``: what is left of the cluster cannot hold the
model), naming why. The HTTP stack lives in the ``api`` extra.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ovshard.bundle.manifest import Manifest
from ovshard.errors import OvshardError
from ovshard.runtime.client.head import Head
from ovshard.runtime.client.local_head import LocalHead
from ovshard.runtime.client.scheduler import Busy, Scheduler
from ovshard.runtime.client.text import Text, TextStream
from ovshard.runtime.engine.sampler import SamplingConfig
from ovshard.runtime.scheduling.requests import Request
from ovshard.runtime.serve.metrics import Metrics
from ovshard.runtime.serve.openai_types import Answer, ApiError, Params, parse_messages, parse_params, sse
from ovshard.runtime.serve.pipeline_view import PipelineView

log = logging.getLogger(__name__)


class ApiService:
    """What the routes need, without HTTP: prompts to ids, a request's run with stop strings, its text."""

    def __init__(self, bundle: Path, manifest: Manifest, head: Head | LocalHead, session: Scheduler, text: Text,
                 model: str, default_max_tokens: int = 256) -> None:
        self.bundle, self.manifest, self.head, self.session, self.text = bundle, manifest, head, session, text
        self.model, self.default_max_tokens = model, default_max_tokens
        self.metrics = Metrics(lambda: session.waiting, lambda: session.active, head.planner_stats,
                               lambda: (head.retargets, head.refusals, head.replayed_tokens))
        self._view, self._view_of = PipelineView(manifest, list(head.addresses)), head.retargets
        self.eos_ids = tuple(manifest.generation.eos_token_ids)
        self.chat_stop_ids = tuple(text.stops) if text.chat is not None else self.eos_ids
        text.pieces()  # every stream's detokenizer looks plain tokens up instead of decoding them
        self._mailbox: Mailbox | None = None

    def events(self) -> Events:
        """A new run's events, delivered through the running event loop's mailbox."""
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        return Events(self._mailbox)

    @property
    def view(self) -> PipelineView:
        """The live view of the chain the head serves from (a new one after the stages moved)."""
        if self._view_of != self.head.retargets:
            self._view, self._view_of = PipelineView(self.head.manifest, list(self.head.addresses)), self.head.retargets
        return self._view

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation rendered by the bundle's chat template with the generation prompt, tokenized with
        no special tokens added (the template wrote them); without a template, the contents one per line."""
        if self.text.tok is None:
            return self.encode_text("\n".join(m["content"] for m in messages))  # a 400 naming the prompt
        return self.text.encode_conversation(messages)

    def encode_text(self, prompt: str) -> list[int]:
        if self.text.tok is None:
            raise ApiError(400, "this bundle has no tokenizer: send the prompt as a list of token ids",
                           param="prompt")
        return self.text.tokenize(prompt)

    def prompt_ids(self, prompt: Any) -> list[int]:
        vocab = self.manifest.architecture.vocab_size
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            return self.encode_text(prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < vocab for t in prompt):
            return list(prompt)
        raise ApiError(400, f"prompt: expected one non-empty string or a list of token ids in [0, {vocab}), "
                            f"found {prompt!r:.80}", param="prompt")

    def start(self, ids: list[int], params: Params, events: Events, chat: bool) -> Run:
        if self.head.down is not None:
            raise ApiError(503, f"the pipeline cannot serve: {self.head.down}", kind="server_error",
                           code="stage_unavailable")
        limit = self.manifest.runtime_hints.max_positions
        if len(ids) >= limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this bundle serves {limit} positions in all",
                           param="messages", code="context_length_exceeded")
        config = SamplingConfig(temperature=params.temperature, top_p=params.top_p, seed=params.seed,
                                max_tokens=params.max_tokens,
                                eos_token_ids=self.chat_stop_ids if chat else self.eos_ids)
        run = Run(self, ids, params, events, config.eos_token_ids)
        try:
            run.request = self.session.submit(ids, config, run.on_token)
        except Busy as e:
            raise ApiError(429, str(e), kind="rate_limit_error", code="busy", retry_after=e.retry_after) from e
        return run


class Mailbox:
    """Events handed from the engine's thread to one event loop: the first event since the loop last looked wakes
    it; those that follow ride along, so a tick of tokens for every client costs the loop one wakeup."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.lock = loop, threading.Lock()
        self.pending: list[tuple[Events, str, Any]] = []

    def put(self, events: Events, kind: str, value: Any) -> None:
        with self.lock:
            self.pending.append((events, kind, value))
            if len(self.pending) > 1:
                return  # a wakeup is on its way already
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the server is shutting down: nobody listens any more
            pass

    def _drain(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for events, kind, value in pending:
            events.items.append((kind, value))
            events.ready.set()


class Events:
    """One run's events (text deltas, the end) as the event loop reads them: :meth:`take` waits for some and
    returns every one that arrived (put from any thread through the loop's :class:`Mailbox`)."""

    def __init__(self, mailbox: Mailbox) -> None:
        self.mailbox = mailbox
        self.items: list[tuple[str, Any]] = []
        self.ready = asyncio.Event()

    def put(self, kind: str, value: Any = None) -> None:
        self.mailbox.put(self, kind, value)

    async def take(self) -> list[tuple[str, Any]]:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        items, self.items = self.items, []
        return items


class Run:
    """One request in flight. The slot thread only hands each token over (:meth:`on_token`); detokenizing, stop
    strings and the end's usage happen where the events are read (:meth:`absorb`, on the event loop), so a
    stream's decode loop asks for its next step at once and its group's next tick is not held back."""

    def __init__(self, service: ApiService, ids: list[int], params: Params, events: Events,
                 stop_ids: tuple[int, ...]) -> None:
        self.service, self.ids, self.params, self.events = service, ids, params, events
        self.request: Request | None = None
        self.stream = TextStream(service.text, ids, turn=False, stop_ids=stop_ids, stop_strings=params.stop)
        self.received = time.perf_counter()
        self.last: float | None = None
        self.completion_tokens = 0
        self.steps_seen = 0  # decode steps handed to the service's PipelineView

    def on_token(self, token: int | None) -> None:
        """Called by the slot thread with each token, then None at the end."""
        if token is None:
            self.events.put("end")
            return
        now = time.perf_counter()
        metrics = self.service.metrics
        (metrics.ttft.observe(now - self.received) if self.last is None else metrics.itl.observe(now - self.last))
        self.last = now
        if self.request is not None:
            self.steps_seen = self.service.view.record(self.request.stats, self.steps_seen)
        self.events.put("token", token)

    def absorb(self, kind: str, value: Any) -> list[tuple[str, Any]]:
        """What one event of the slot thread means to the client: ("text", piece), ("error", ApiError) or
        ("end", (finish_reason, usage)), none for a token that adds no text."""
        if kind == "token":
            if self.stream.stopped:  # a stop string ended the text: the rest is not wanted
                return []
            self.completion_tokens += 1
            piece = self.stream.push(value)
            if self.stream.stopped:
                assert self.request is not None
                self.request.cancel()
            return [("text", piece)] if piece else []
        request = self.request
        assert request is not None
        piece = self.stream.finish()
        out: list[tuple[str, Any]] = [("text", piece)] if piece else []
        self.service.metrics.observe(request.stats)
        self.service.view.record(request.stats, self.steps_seen)
        self.service.view.finished(request.stats)
        usage = Answer.usage(len(self.ids), self.completion_tokens, request.stats.cached_tokens)
        if request.error is not None:
            return [*out, ("error", ApiError(503, f"the pipeline failed: {request.error}", kind="server_error",
                                             code="stage_unavailable"))]
        finish = "stop" if self.stream.stopped or request.stats.finish_reason == "stop" else "length"
        return [*out, ("end", (finish, usage))]


async def _body(request: Any) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _check_model(service: ApiService, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != service.model:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {service.model!r} (GET /v1/models)",
                       param="model", code="model_not_found")


async def _stream(run: Run, answer: Answer) -> AsyncIterator[bytes]:
    """Server-sent events of one run, one event per text piece; the events queued by the time the loop
    gets to them go out in one write. A client that goes away cancels the run (the stream is freed)."""
    try:
        yield sse(answer.chunk(None, None, first=True))
        while True:
            events = await run.events.take()
            out, ended = _events(run, answer, [e for kind, value in events for e in run.absorb(kind, value)])
            if out:
                yield out
            if ended:
                return
    finally:
        if run.request is not None and not run.request.done:
            run.request.cancel()


def _events(run: Run, answer: Answer, events: list[tuple[str, Any]]) -> tuple[bytes, bool]:
    """The bytes of some events of a run, and whether the last of them ended it."""
    out: list[bytes] = []
    for kind, value in events:
        if kind == "text":
            out.append(answer.text_event(value))
        elif kind == "error":
            return b"".join([*out, sse(value.body()), sse("[DONE]")]), True
        else:
            finish, usage = value
            out.append(sse(answer.chunk(None, finish)))
            if run.params.include_usage:
                out.append(sse(answer.usage_chunk(usage)))
            return b"".join([*out, sse("[DONE]")]), True
    return b"".join(out), False


async def _whole(run: Run, answer: Answer, http: Any) -> dict:
    """The whole answer of a run that is not streamed; a client that goes away meanwhile (while its request
    waits or runs) cancels it at once."""
    parts: list[str] = []
    gone = asyncio.ensure_future(_disconnect(http))
    event: asyncio.Future | None = None
    try:
        while True:
            event = asyncio.ensure_future(run.events.take())
            await asyncio.wait((event, gone), return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                assert run.request is not None
                run.request.cancel()
                raise ApiError(499, "the client went away")
            for kind, value in [e for item in event.result() for e in run.absorb(*item)]:
                if kind == "text":
                    parts.append(value)
                elif kind == "error":
                    raise value
                else:
                    finish, usage = value
                    return answer.whole("".join(parts), finish, usage)
    finally:
        gone.cancel()
        if event is not None:
            event.cancel()  # a no-op once it is done


async def _disconnect(http: Any) -> None:
    """Returns when the client of ``http`` (its body read already) closes its connection."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


_OPEN_PATHS = ("/health", "/")  # no key needed: the state of the stages, and the page (static, no data in it)


class _Authorize:
    """ASGI middleware: a request outside ``_OPEN_PATHS`` needs ``Authorization: Bearer <key>`` (401 otherwise).
    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which costs every streamed chunk a hop through a
    memory stream."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        import hmac

        from starlette.responses import JSONResponse

        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        error = ApiError(401, "expected Authorization: Bearer <the server's --api-key>", code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401)(scope, receive, send)


def make_app(service: ApiService, api_key: str | None = None) -> Any:
    """The Starlette application serving ``service``; with ``api_key``, every request but /health and the page
    needs ``Authorization: Bearer <api_key>`` (what OpenAI clients send; the page asks for the key)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def failed(endpoint: str, error: ApiError) -> JSONResponse:
        service.metrics.requests.labels(endpoint, str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    async def generate(http: HttpRequest, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            body = await _body(http)
            _check_model(service, body)
            params = parse_params(body, service.default_max_tokens)
            if chat:
                messages = parse_messages(body)
                ids = await asyncio.to_thread(service.encode_chat, messages)
            else:
                ids = await asyncio.to_thread(service.prompt_ids, body.get("prompt"))
            run = service.start(ids, params, service.events(), chat)
            answer = Answer(service.model, chat)
            if params.stream:
                service.metrics.requests.labels(endpoint, "200").inc()
                return StreamingResponse(_stream(run, answer), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            result = await _whole(run, answer, http)
        except ApiError as e:
            return failed(endpoint, e)
        service.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(result)

    async def chat(http: HttpRequest) -> Response:
        return await generate(http, True)

    async def completions(http: HttpRequest) -> Response:
        return await generate(http, False)

    async def models(http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": service.model, "object": "model", "created": 0,
                                                         "owned_by": "ovshard"}]})

    async def health(http: HttpRequest) -> Response:
        stages = await asyncio.to_thread(service.head.health)
        up = all(s["state"] == "up" for s in stages)
        return JSONResponse({"status": "ok" if up else "degraded", "stages": stages}, status_code=200 if up else 503)

    async def metrics(http: HttpRequest) -> Response:
        data, content_type = service.metrics.render()
        return Response(data, media_type=content_type)

    async def pipeline(http: HttpRequest) -> Response:
        return JSONResponse(service.view.snapshot(service.model, service.session.active, service.session.waiting,
                                                 service.head.planner_stats()))

    page = (Path(__file__).parent / "web" / "index.html").read_bytes()

    async def index(http: HttpRequest) -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/v1/pipeline", pipeline), Route("/", index),
                             Route("/health", health), Route("/metrics", metrics)],
                     middleware=[Middleware(_Authorize, key=api_key)] if api_key is not None else [])


def serve_api(service: ApiService, host: str, port: int, announce: Any = None, api_key: str | None = None) -> None:
    """Serve until interrupted; ``announce(address)`` is called once the socket listens (port 0: a free one)."""
    import socket

    import uvicorn

    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise OvshardError(f"--listen {host}:{port}: {e.strerror or e}; choose another port, or 0 for a free one") from e
    address = "{}:{}".format(*sock.getsockname()[:2])
    if announce is not None:
        announce(address)
    server = uvicorn.Server(uvicorn.Config(make_app(service, api_key), log_level="warning", lifespan="off"))
    server.run(sockets=[sock])


