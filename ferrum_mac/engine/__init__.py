"""The engine: conversations on a model, turn by turn, reusing each conversation's KV cache.

    engine = Engine.open()                          # $FERRUM_MODEL or the bundled smollm2:135m
    conv = engine.conversation(system="Be brief.", max_tokens=64)
    for event in conv.send("What is the capital of France?"):
        if isinstance(event, TextDelta): print(event.text, end="")
        elif isinstance(event, Done): print(f"\\n{event.decode_tps:.1f} tok/s")
    conv.close()

Settings: `ChatSettings` (system prompt, `SamplingParams`, max_tokens, thinking, stop strings,
context policy "error" or "truncate-oldest"). A turn that does not fit under "error" raises
`ContextLimitError` and leaves the conversation as it was.

The engine never imports MLX or torch: it asks the model for a sampler (`model.sampler`).
"""

from ferrum_mac.engine.context import ContextLimitError
from ferrum_mac.engine.conversation import CONTEXT_POLICIES, ERROR, TRUNCATE_OLDEST, ChatSettings, Conversation
from ferrum_mac.engine.defaults import DEFAULT_MODEL, MODEL_ENV, default_model_name, sampling_defaults
from ferrum_mac.engine.engine import Engine
from ferrum_mac.engine.events import (
    CANCELLED, CONTEXT, EOS, MAX_TOKENS, STOP_STRING, Done, Event, Notice, ReasoningDelta, TextDelta,
)
from ferrum_mac.engine.sampling import Sampler, SamplingError, SamplingParams

__all__ = [
    "CANCELLED", "CONTEXT", "CONTEXT_POLICIES", "DEFAULT_MODEL", "EOS", "ERROR", "MAX_TOKENS", "MODEL_ENV",
    "STOP_STRING", "TRUNCATE_OLDEST", "ChatSettings", "ContextLimitError", "Conversation", "Done", "Engine", "Event",
    "Notice", "ReasoningDelta", "Sampler", "SamplingError", "SamplingParams", "TextDelta", "default_model_name",
    "sampling_defaults",
]
