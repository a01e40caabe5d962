"""Serving many clients on one model: the continuous-batching scheduler (no HTTP here) and,
in `openai_app`, the OpenAI-compatible HTTP API of `ferrum serve` on top of it."""

from ferrum_mac.serve.request import EventQueue, Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.scheduler import Scheduler, SchedulerStats

__all__ = ["EventQueue", "Failed", "GenerationRequest", "RequestHandle", "Scheduler", "SchedulerStats"]
