"""`RemoteEngine`: any OpenAI-compatible server (ferrum serve, vLLM, Ollama, LM Studio) in the
engine's place, streaming the same events (TextDelta, ReasoningDelta, one Done).

It has the part of `Engine`'s API that the REPL, `ferrum run` and the chat app use:
`name`, `default_sampling`, `settings()`, `conversation()` (an ordinary `Conversation`, so
`conv.send(text, cancel)` works as with a local model), `cancel()`, `kv_capacity()`, `close()`.

    engine = RemoteEngine("http://127.0.0.1:8000", api_key=None)
    conv = engine.conversation(max_tokens=64)
    for event in conv.send("Hi"): ...

Reasoning arrives as `reasoning_content` (vLLM, ferrum) or `reasoning` (Ollama); stats come
from ferrum's `stats` field where the server sends it, else from `usage` and local timing.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from typing import Iterator

from ferrum_mac.engine import (
    CANCELLED,
    EOS,
    FALLBACK_SAMPLING,
    MAX_TOKENS,
    TOOL_CALLS,
    ChatSettings,
    Conversation,
    Done,
    Event,
    ReasoningDelta,
    TextDelta,
    Timing,
    ToolCallRequested,
    done_event,
    with_calls,
)
from ferrum_mac.engine.tools import ToolRequest
from ferrum_mac.errors import FerrumError
from ferrum_mac.text.tool_calls import ToolCall, is_whole, new_call_id

TIMEOUT_S = 600.0  # a long answer from a slow server is still an answer
FINISH_REASONS = {"length": MAX_TOKENS, "stop": EOS, "tool_calls": TOOL_CALLS}
# SamplingParams field -> request field, sent only where the user changed it: left out, the
# server applies the model's own defaults, so a remote run samples as a local run does.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


class RemoteEngine:
    server_chooses_sampling = True  # what the user leaves alone, the server sets (the model's defaults)

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = TIMEOUT_S):
        import httpx

        self.base = base_url(url)
        self.path = self.base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
        self.default_sampling = FALLBACK_SAMPLING
        self._model = model
        self._capacity: int | None = None
        self._cancel: threading.Event | None = None
        self._ids = itertools.count(1)

    @property
    def name(self) -> str:
        """The model asked for, else the first one the server lists."""
        if self._model is None:
            models = self._get("/models").get("data") or []
            if not models:
                raise FerrumError(f"{self.base} lists no models; name one with the model argument")
            self._model = str(models[0].get("id"))
            self._capacity = models[0].get("max_model_len")
        return self._model

    def kv_capacity(self) -> int | None:
        """The server's context length where it says (ferrum and vLLM do), else None."""
        self.name
        return self._capacity

    # -- what Engine offers -----------------------------------------------------------------

    def settings(self, **changes) -> ChatSettings:
        return ChatSettings(sampling=self.default_sampling).replace(**changes)

    def conversation(self, settings: ChatSettings | None = None, *, prepare: bool = True, **changes) -> Conversation:
        return Conversation(self, f"remote-{next(self._ids)}", (settings or self.settings()).replace(**changes))

    def close_conversation(self, conv: Conversation) -> None:
        conv.closed = True

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def close(self) -> None:
        self.http.close()

    def send(
        self,
        conv: Conversation,
        text: str | None,
        cancel: threading.Event | None = None,
        response_format=None,
        tools: ToolRequest | None = None,
    ) -> Iterator[Event]:
        """Stream the answer to `text`; the user message and the answer so far join
        `conv.messages` whatever ends the turn. `response_format` (a `ResponseFormat`): this
        answer's, sent as the API's; None: the conversation's setting. `tools`: sent as the
        API's `tools` and `tool_choice`, the calls coming back as a `ToolCallRequested`;
        `text` None: the answer to the tool results the conversation ends with."""
        if conv.closed:
            raise FerrumError(f"conversation {conv.cache_id} is closed; open a new one")
        body = self._request_body(conv, text)
        if response_format is not None:
            body["response_format"] = response_format.as_openai()
        if tools is not None:
            body.update(tools.as_openai())
        if text is not None:
            conv.messages.append({"role": "user", "content": text})
        self._cancel = cancel = cancel or threading.Event()
        turn = RemoteTurn()
        try:
            yield from turn.read(self._stream(body), cancel)
        finally:
            self._cancel = None
            conv.messages.append(turn.message())
        if turn.tool_calls():
            yield ToolCallRequested(tuple(turn.tool_calls()))
        yield turn.done()

    # -- HTTP --------------------------------------------------------------------------------

    def _request_body(self, conv: Conversation, text: str | None) -> dict:
        s, sampling = conv.settings, conv.settings.sampling
        history = [_api_message(m) for m in conv.chat_messages()]
        body = {
            "model": self.name,
            "messages": history + ([{"role": "user", "content": text}] if text is not None else []),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body.update({k: v for k, v in (("max_tokens", s.max_tokens), ("seed", sampling.seed)) if v is not None})
        if s.stop:
            body["stop"] = list(s.stop)
        if s.think is not None:
            body["chat_template_kwargs"] = {"enable_thinking": s.think}
        if s.response_format is not None:
            body["response_format"] = s.response_format.as_openai()
        body.update(
            {
                name: getattr(sampling, f)
                for f, name in SAMPLING_FIELDS.items()
                if getattr(sampling, f) != getattr(self.default_sampling, f)
            }
        )
        return body

    def _stream(self, body: dict) -> Iterator[dict]:
        """The JSON chunks of a streamed answer."""
        import httpx

        try:
            with self.http.stream("POST", self.base + "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise self._refusal(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise FerrumError(f"{self.base}: {chunk['error'].get('message', chunk['error'])}")
                    yield chunk
        except httpx.HTTPError as e:
            raise FerrumError(f"cannot reach {self.base} ({e or type(e).__name__}); is the server running?") from None

    def _get(self, path: str) -> dict:
        import httpx

        try:
            response = self.http.get(self.base + path)
        except httpx.HTTPError as e:
            raise FerrumError(f"cannot reach {self.base} ({e or type(e).__name__}); is the server running?") from None
        if response.status_code != 200:
            raise self._refusal(response)
        return response.json()

    def _refusal(self, response) -> FerrumError:
        message = f"{self.base} answered {response.status_code}: {error_message(response)}"
        if response.status_code in (401, 403):
            message += "; give the server's key with --api-key KEY or $FERRUM_API_KEY"
        return FerrumError(message)


class RemoteTurn:
    """One streamed answer: its text, reasoning and the figures for its Done."""

    def __init__(self):
        self.timing = Timing()
        self.answer: list[str] = []
        self.reasoning: list[str] = []
        self.chunks = 0
        self.finish: str | None = None
        self.usage: dict = {}
        self.stats: dict = {}
        self.cancelled = False
        self.calls: dict[int, dict] = {}  # index -> id, name and the arguments so far

    def read(self, chunks: Iterator[dict], cancel: threading.Event) -> Iterator[Event]:
        for chunk in chunks:
            self.usage = chunk.get("usage") or self.usage
            self.stats = chunk.get("stats") or self.stats
            for choice in chunk.get("choices") or []:
                yield from self._deltas(choice.get("delta") or {"content": choice.get("text")})
                self.finish = choice.get("finish_reason") or self.finish
            if cancel.is_set():
                self.cancelled = True
                chunks.close()  # closing the stream tells the server to stop
                return

    def _deltas(self, delta: dict) -> Iterator[Event]:
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        if thought:
            self._token()
            self.reasoning.append(thought)
            yield ReasoningDelta(thought)
        if delta.get("content"):
            self._token()
            self.answer.append(delta["content"])
            yield TextDelta(delta["content"])
        for piece in delta.get("tool_calls") or ():
            call = self.calls.setdefault(piece.get("index", 0), {"id": "", "name": "", "arguments": ""})
            function = piece.get("function") or {}
            call["id"] = piece.get("id") or call["id"]
            call["name"] = function.get("name") or call["name"]
            call["arguments"] += function.get("arguments") or ""

    def tool_calls(self) -> list[ToolCall]:
        """The whole calls (one cut by the server's `max_tokens` is none)."""
        calls = [ToolCall(c["name"], c["arguments"], c["id"] or new_call_id()) for _, c in sorted(self.calls.items())]
        return [c for c in calls if is_whole(c)]

    def _token(self) -> None:
        self.chunks += 1
        self.timing.token()

    def message(self) -> dict:
        message: dict = {"role": "assistant", "content": "".join(self.answer)}
        if self.tool_calls():
            message["tool_calls"] = [c.as_openai() for c in self.tool_calls()]
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        return message

    def done(self) -> Done:
        done = self._done()  # ferrum's own stats say how the text ended
        return dataclasses.replace(done, stop_reason=with_calls(done.stop_reason, bool(self.tool_calls())))

    def _done(self) -> Done:
        if self.stats and not self.cancelled:
            fields = {k: self.stats[k] for k in Done.__dataclass_fields__ if k in self.stats}
            try:
                return Done(**fields)
            except TypeError:
                pass  # not ferrum's stats after all
        generated = self.usage.get("completion_tokens") or self.chunks
        prompt = self.usage.get("prompt_tokens") or 0
        reason = CANCELLED if self.cancelled else FINISH_REASONS.get(self.finish or "", EOS)
        return done_event(reason, prompt, 0, generated, self.timing, None)


def _api_message(message: dict) -> dict:
    """A history message as the API takes it: role and content, and a call's or result's ids."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    out.update({k: message[k] for k in ("tool_calls", "tool_call_id") if message.get(k)})
    return out


def base_url(url: str) -> str:
    """`http://host:port` or `.../v1` -> the API root ending in /v1."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url if url.endswith("/v1") else url + "/v1"


def error_message(response) -> str:
    try:
        error = response.json().get("error")
        return str(error.get("message") if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        return response.text.strip()[:200] or response.reason_phrase
