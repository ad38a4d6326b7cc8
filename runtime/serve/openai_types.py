"""The OpenAI API's shapes, without HTTP: request bodies checked into :class:`Params`, answers and errors.

Only what ovshard serves: ``/v1/chat/completions`` and ``/v1/completions`` with ``n=1``. A body that asks
for something else gets an :class:`ApiError` naming the field (HTTP 400), never a silent default.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ovshard.errors import OvshardError

MAX_STOP = 4  # as OpenAI: up to 4 stop strings
_MARK = "\x00text\x00"  # where a chunk's text goes in the template of its event


class ApiError(OvshardError):
    """An error answered as OpenAI does: HTTP ``status`` and ``{"error": {message, type, param, code}}``;
    ``retry_after``: seconds for a ``Retry-After`` header (a 429)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Params:
    """One request's generation settings."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ApiError(400, f"{name}: expected a number in [{low}, {high}], found {value!r}", param=name)
    return float(value)


def _integer(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"{name}: expected an integer >= {low}, found {value!r}", param=name)
    return value


def parse_params(body: dict, default_max_tokens: int) -> Params:
    """The settings of a completion or chat body; ApiError 400 for anything out of range or unsupported."""
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise ApiError(400, f"n: this server returns one choice per request, found n={n}; send n=1 or leave it out",
                       param="n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise ApiError(400, "logprobs: not supported (the last stage returns only what sampling needs)",
                       param="logprobs")
    if body.get("echo"):
        raise ApiError(400, "echo: not supported; the answer holds only the generated text", param="echo")
    limit = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1) or default_max_tokens
    stop = body.get("stop")
    stops: tuple[str, ...] = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop) \
        if isinstance(stop, list) else (None,)  # type: ignore[assignment]
    if len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop: expected a non-empty string or a list of up to {MAX_STOP}, found {stop!r}",
                       param="stop")
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise ApiError(400, "stream: expected true or false; stream_options: an object", param="stream")
    return Params(max_tokens=limit, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                  top_p=_number(body, "top_p", 1.0, 1e-9, 1.0), seed=_integer(body, "seed", 0), stop=stops,
                  stream=stream, include_usage=bool(options.get("include_usage", False)))


def parse_messages(body: dict) -> list[dict[str, str]]:
    """A chat body's messages: role and text content (a list of text parts is joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of {role, content}", param="messages")
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            content = "".join(p for p in parts if isinstance(p, str)) if len(parts) == len(content) else None
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "developer", "user", "assistant") or not isinstance(content, str):
            raise ApiError(400, f"messages[{i}]: expected a role (system, user, assistant) and text content, "
                                f"found {message!r:.80}", param="messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def sse(obj: dict | str) -> bytes:
    """One server-sent event: ``data:`` and the JSON of ``obj`` (a string as it is, e.g. ``[DONE]``)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


class Answer:
    """The ids, times and shapes of one response (a chat completion or a text completion)."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        around = self._event(_MARK).split(json.dumps(_MARK).encode())
        self._around = around if len(around) == 2 else None  # a text chunk's event before and after its text

    def text_event(self, text: str) -> bytes:
        """The server-sent event of a chunk of ``text``: :meth:`chunk`'s JSON, only the text encoded anew."""
        if not text or self._around is None:  # no text: a chat delta without content; a model named like _MARK
            return self._event(text)
        before, after = self._around
        return before + json.dumps(text).encode() + after

    def _event(self, text: str) -> bytes:
        return sse(self.chunk(text, None))

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
        """OpenAI's usage object; ``cached``: prompt tokens whose KV the pipeline held already."""
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def whole(self, text: str, finish: str, usage: dict[str, Any]) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": None}
            return {**self._envelope("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**self._envelope("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, str] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            return {**self._envelope("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return {**self._envelope("text_completion"),
                "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage}
