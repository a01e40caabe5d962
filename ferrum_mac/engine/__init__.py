"""The engine: conversations on a model, turn by turn, reusing each conversation's KV cache.

    engine = Engine.open()                          # $FERRUM_MODEL or the bundled smollm2:135m
    conv = engine.conversation(system="Be brief.", max_tokens=64)
    for event in conv.send("What is the capital of France?"):
        if isinstance(event, TextDelta): print(event.text, end="")
        elif isinstance(event, Done): print(f"\\n{event.decode_tps:.1f} tok/s")
    conv.close()

Settings: `ChatSettings` (system prompt, `SamplingParams`, max_tokens, thinking, stop strings,
context policy "error" or "truncate-oldest", `ResponseFormat`: JSON, or JSON valid against a
schema, enforced token by token). `send(text, tools=...)` offers tools (`engine.tools`): a call
the model makes comes as `ToolCallRequested`, and `add_tool_results` + `continue_answer` let it
answer with their results. A turn that does not fit under "error" raises
`ContextLimitError` and leaves the conversation as it was.

The engine never imports MLX or torch: it asks the model for a sampler (`model.sampler`).

`ChatEngine` declares the surface the chat interfaces use (a local `Engine`, a `RemoteEngine`);
`LocalEngine` adds the model, tokenizer and template the server batches on. The rules of one
answer are written once, for the engine's turns and the server's batches alike: how it starts
from its prompt (`engine.prompt`), and token by token (`AnswerState`, `CallSplitter`), to its
`Done` (`done_event`, which the remote client uses too).
"""

from ferrum_mac.engine.answer import AnswerState, CallSplitter, Timing, done_event, with_calls
from ferrum_mac.engine.answer_text import AnswerText
from ferrum_mac.engine.context import ContextLimitError
from ferrum_mac.engine.conversation import CONTEXT_POLICIES, ERROR, TRUNCATE_OLDEST, ChatSettings, Conversation
from ferrum_mac.engine.defaults import FALLBACK_SAMPLING, sampling_defaults
from ferrum_mac.engine.engine import Engine
from ferrum_mac.engine.events import (
    CANCELLED,
    CONTEXT,
    EOS,
    LOOP,
    MAX_TOKENS,
    STOP_STRING,
    TOOL_CALLS,
    Done,
    Event,
    Notice,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallRequested,
)
from ferrum_mac.engine.sampling import SEED_LIMIT, Sampler, SamplingError, SamplingParams
from ferrum_mac.engine.structured import Constraints, ResponseFormat
from ferrum_mac.engine.surface import ChatEngine, LocalEngine

__all__ = [
    "CANCELLED",
    "CONTEXT",
    "CONTEXT_POLICIES",
    "EOS",
    "ERROR",
    "FALLBACK_SAMPLING",
    "MAX_TOKENS",
    "SEED_LIMIT",
    "STOP_STRING",
    "LOOP",
    "TOOL_CALLS",
    "TRUNCATE_OLDEST",
    "AnswerState",
    "AnswerText",
    "CallSplitter",
    "ChatEngine",
    "ChatSettings",
    "Constraints",
    "ContextLimitError",
    "Conversation",
    "Done",
    "Engine",
    "Event",
    "LocalEngine",
    "Notice",
    "ReasoningDelta",
    "ResponseFormat",
    "Sampler",
    "SamplingError",
    "SamplingParams",
    "TextDelta",
    "TokenLogprob",
    "ToolCallRequested",
    "Timing",
    "done_event",
    "sampling_defaults",
    "with_calls",
]
