"""`ferrum run [MODEL] [PROMPT...]`: one answer streamed to stdout, or a REPL.

The first word is the model when it names one (see `looks_like_model`); otherwise every word
is the prompt and the default model answers ($FERRUM_MODEL, else the bundled smollm2:135m).
With no prompt, piped stdin is the prompt; on a terminal (or with --interactive) the REPL starts.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ferrum_mac.cli.options import CONTEXT_DEFAULT
from ferrum_mac.cli.printer import EventPrinter
from ferrum_mac.engine import ChatEngine, ChatSettings, Conversation, Notice, ResponseFormat, SamplingParams
from ferrum_mac.engine.speculation import DRAFT, Speculate, check_speculate, draft_name, same_vocabulary
from ferrum_mac.errors import FerrumError

FORMATS = ("text", "json")


@dataclass
class RunOptions:
    system: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    think: bool | None = None
    hide_thinking: bool = False
    verbose: bool = False
    json: bool = False
    backend: str = "auto"
    device: str | None = None
    kv_capacity: int | None = None
    context: str = CONTEXT_DEFAULT
    pull: bool = True
    interactive: bool = False
    remote: str | None = None  # an OpenAI-compatible server's URL instead of a local model
    api_key: str | None = None
    format: str = "text"  # "json": every answer a JSON object
    schema: Path | None = None  # every answer JSON valid against the schema in this file
    speculate: str = "auto"  # auto, ngram, draft:MODEL or off

    def response_format(self) -> ResponseFormat | None:
        """What every answer must be (None: free text); a bad --format or schema file raises."""
        if self.format not in FORMATS:
            raise FerrumError(f"unknown --format {self.format!r}; choose one of: {', '.join(FORMATS)}")
        if self.schema is not None:
            return ResponseFormat.from_file(self.schema)
        return ResponseFormat.parse(self.format)

    def sampling_changes(self) -> dict:
        return dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repeat_penalty,
            seed=self.seed,
        )


def run(words: list[str], options: RunOptions) -> None:
    model, prompt = split_model_and_prompt(words)
    if prompt is not None and not prompt.strip():
        raise FerrumError('the prompt is empty; give some text (`ferrum run "Hi"`), or none for the REPL')
    check_options(options)
    if prompt is None and not options.interactive and not sys.stdin.isatty():
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise FerrumError("the prompt on stdin is empty; pipe some text in or give the prompt as an argument")
    engine = open_engine(model, options)
    say_when_demo_model(model, options)
    settings = engine.settings(
        system=options.system,
        sampling=engine.default_sampling.replace(**options.sampling_changes()),
        max_tokens=options.max_tokens,
        think=options.think,
        context_policy=options.context,
        stop=tuple(options.stop),
        response_format=options.response_format(),
        speculate=speculate_setting(engine, options),
    )
    printer = EventPrinter(show_reasoning=not options.hide_thinking, verbose=options.verbose)
    if prompt is None:
        from ferrum_mac.cli.repl import Repl

        Repl(engine, engine.conversation(settings), printer).run()
    elif options.json:
        print(
            json.dumps(answer_as_json(engine, engine.conversation(settings, prepare=False), prompt), ensure_ascii=False)
        )
    else:
        # One answer: no warm-up, which would only move the kernels' first-use cost earlier.
        for event in engine.conversation(settings, prepare=False).send(prompt):
            printer.print(event)


def open_engine(model: str | None, options: RunOptions) -> ChatEngine:
    """A local Engine, or with --remote a RemoteEngine (the same surface for everything below)."""
    if options.remote:
        from ferrum_mac.remote import RemoteEngine

        return RemoteEngine(options.remote, api_key=options.api_key, model=model)
    from ferrum_mac.compose import open_engine as open_local

    return open_local(
        model, backend=options.backend, device=options.device, pull=options.pull, kv_capacity=options.kv_capacity
    )


def say_when_demo_model(model: str | None, options: RunOptions) -> None:
    """On stderr, one line when the bundled demo model answers: it is small, and what to pull instead."""
    if options.remote:
        return
    from ferrum_mac.compose import choose_backend, default_model_name
    from ferrum_mac.store.recommend import demo_model_notice

    line = demo_model_notice(model or default_model_name(), choose_backend(options.backend))
    if line:
        print(f"ferrum: {line}", file=sys.stderr)


def split_model_and_prompt(words: list[str]) -> tuple[str | None, str | None]:
    if not words:
        return None, None
    if looks_like_model(words[0]):
        return words[0], " ".join(words[1:]) if len(words) > 1 else None
    return None, " ".join(words)


def looks_like_model(word: str) -> bool:
    """Whether the first word names the model: a model folder or .gguf file, a path (a missing one is
    an error, not a prompt), an alias (`qwen3:8b`; an unknown one is an error) or a repo id. A word
    that is a folder but no model, or that ends in ':' ("docs", "Translate:"), starts the prompt."""
    if not word or any(c.isspace() for c in word):
        return False
    path = Path(word).expanduser()
    if path.exists():
        return path.suffix == ".gguf" or (path / "config.json").is_file() or any(path.glob("*.gguf"))
    if word.endswith(".gguf") or word.startswith(("./", "../", "~", "/")):
        return True
    from ferrum_mac.errors import ModelNotFoundError
    from ferrum_mac.store.aliases import is_alias_like, parse_repo_id

    if is_alias_like(word):
        return re.fullmatch(r"[\w.-]+(:[\w.-]+)?", word) is not None  # (`phi4`: a family of one size)
    try:
        parse_repo_id(word)
    except ModelNotFoundError:
        return False
    return True


def check_options(options: RunOptions) -> None:
    """Refuse bad values before the model loads."""
    SamplingParams().replace(**options.sampling_changes())
    ChatSettings(max_tokens=options.max_tokens, context_policy=options.context).checked()
    options.response_format()
    check_speculate(options.speculate)
    if options.remote and draft_name(options.speculate):
        raise FerrumError("--speculate draft:MODEL needs a local model; a remote server decodes on its own")
    if options.kv_capacity is not None:
        if options.kv_capacity < 2:
            raise FerrumError(f"--kv-capacity {options.kv_capacity} is too small; give at least 2 tokens")


def speculate_setting(engine: ChatEngine, options: RunOptions) -> Speculate:
    """--speculate as a setting; `draft:MODEL` loads the draft model beside the engine's."""
    name = draft_name(options.speculate)
    if name is None:
        return Speculate.parse(options.speculate)
    return open_draft(engine, name, backend=options.backend, device=options.device, pull=options.pull)


def open_draft(engine: ChatEngine, name: str, *, backend: str = "auto", device=None, pull: bool = True) -> Speculate:
    """The draft model `name` (an alias, repo id, folder or .gguf) as a `Speculate` for
    `engine`'s model, or a FerrumError when its vocabulary is not the same."""
    from ferrum_mac.compose import choose_backend, open_model
    from ferrum_mac.store import resolve_model
    from ferrum_mac.text import load_tokenizer

    path = Path(name).expanduser()
    if not path.exists():
        path = resolve_model(name, backend=choose_backend(backend), pull=pull)
    if not same_vocabulary(load_tokenizer(path), engine.tokenizer):
        raise FerrumError(
            f"the draft model {name!r} has another vocabulary than {engine.name or 'the model'}; "
            "choose a draft of the same family (the same tokenizer)"
        )
    return Speculate(DRAFT, open_model(path, backend=backend, device=device, pull=pull), name)


def answer_as_json(engine: ChatEngine, conv: Conversation, prompt: str) -> dict:
    events = list(conv.send(prompt))
    answer = conv.messages[-1]
    return {
        "model": engine.name,
        "text": answer["content"],
        "reasoning": answer.get("reasoning_content", ""),
        "notices": [e.text for e in events if isinstance(e, Notice)],
        "stats": events[-1].as_dict(),
    }
