"""Serving many clients: the continuous-batching scheduler of one model (no HTTP here) and, in
`app`, the HTTP server of `ferrum serve` on top of it (OpenAI's, Anthropic's and Ollama's APIs
over several models, `models`)."""

from ferrum_mac.serve.request import EventQueue, Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.scheduler import Scheduler, SchedulerStats

__all__ = ["EventQueue", "Failed", "GenerationRequest", "RequestHandle", "Scheduler", "SchedulerStats"]
