"""Serving many clients: continuous batching on each model (`batching`, no HTTP there) under the HTTP server of `ferrum serve`.

`core` is the protocol-neutral server (`Server`, `Answer`), `protocols` the APIs it speaks
(OpenAI's, Ollama's, Anthropic's), `checks` the one validation layer every request passes, and
`app` the starlette app that puts them together."""

from ferrum_mac.serve.batching.request import EventQueue, Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.batching.scheduler import Scheduler, SchedulerStats

__all__ = ["EventQueue", "Failed", "GenerationRequest", "RequestHandle", "Scheduler", "SchedulerStats"]
