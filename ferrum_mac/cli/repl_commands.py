"""The REPL's slash commands. Each `_cmd_*` method takes the words after the command and
returns False to leave the REPL."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Callable

from ferrum_mac.cli.session import ChatSession
from ferrum_mac.engine import CONTEXT_POLICIES, ChatSettings, Engine, ResponseFormat, SamplingParams
from ferrum_mac.engine.speculation import Speculate, draft_name
from ferrum_mac.errors import FerrumError

HELP = """Available commands:
  /set parameter NAME VALUE   set a sampling parameter (/set NAME VALUE works too):
                              temperature, top_p, top_k, min_p, repeat_penalty, presence_penalty,
                              frequency_penalty, repeat_last_n, seed, num_predict (max tokens), stop
  /set system TEXT            set the system prompt
  /set think | nothink        turn the model's thinking mode on or off (/set think on|off)
  /set verbose | quiet        show or hide the stats line after each answer
  /set context error|truncate-oldest   what to do when the conversation outgrows the context
  /set format json | text     every answer a JSON object (enforced), or free text again
  /set speculate auto|ngram|draft:MODEL|off   speculative decoding (auto: prompt lookup where it pays)
  /show info|template|system|parameters
  /clear                      forget the conversation (keeps the system prompt and settings)
  /save NAME, /load NAME      save or restore the conversation
  /bye                        exit
  /?, /help                   this help
Use \"\"\" to begin and end a multi-line message. Ctrl-C stops an answer."""

# a bare /set: HELP's /set lines
SET_HELP = HELP.split("\n  /show", 1)[0].replace("Available commands:", "Available /set commands:", 1)

# REPL parameter name -> (SamplingParams field, type); Ollama's names and ferrum's own
SAMPLING_PARAMETERS: dict[str, tuple[str, Callable]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repeat_penalty": ("repetition_penalty", float),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "repeat_last_n": ("penalty_window", int),
    "seed": ("seed", int),
}
MAX_TOKENS_NAMES = ("num_predict", "max_tokens")
SAVE_NAME = re.compile(r"^[\w.-]+$")


class Commands:
    def __init__(self, session: ChatSession):
        self.session = session

    @property
    def conv(self):
        return self.session.conv

    def run(self, line: str) -> bool:
        """Carry out one slash command; False when the REPL should end."""
        name, *words = line.split(maxsplit=1)
        handler = getattr(self, "_cmd_" + name[1:].replace("?", "help").lower(), None)
        if handler is None:
            say(f"Unknown command '{name}'. Type /? for help")
            return True
        try:
            return handler(words[0] if words else "") is not False
        except FerrumError as e:
            say(f"ferrum: {e}")
            return True

    # -- /set -----------------------------------------------------------------------------

    def _cmd_set(self, rest: str) -> None:
        what, _, value = rest.partition(" ")
        value = value.strip()
        what = what.lower()
        if not what:
            say(SET_HELP)
            return
        if what == "parameter":
            what, _, value = value.partition(" ")
            value = value.strip()
        if what in SAMPLING_PARAMETERS or what in MAX_TOKENS_NAMES or what == "stop":
            self._set_parameter(what.lower(), value)
        elif what == "system":
            self._change(system=value or None)
            say("Set system message." if value else "Cleared the system message.")
        elif what in ("think", "nothink"):
            on = what == "think" and value.lower() not in ("off", "false", "no", "0")
            self._change(think=on)
            say(f"Set thinking mode {'on' if on else 'off'}.")
        elif what in ("verbose", "quiet"):
            self.session.printer.verbose = what == "verbose"
            say(f"Set {what} mode.")
        elif what == "context":
            if value not in CONTEXT_POLICIES:
                raise FerrumError(f"unknown context policy {value!r}; choose one of: {', '.join(CONTEXT_POLICIES)}")
            self._change(context_policy=value)
            say(f"Set context policy to {value}.")
        elif what == "format":
            if value.lower() not in ("json", "text"):
                raise FerrumError("/set format takes json or text, e.g. /set format json")
            self._change(response_format=ResponseFormat.parse(value.lower()))
            say(f"Set answer format to {value.lower()}.")
        elif what == "speculate":
            self._change(speculate=self._speculation(value))
            say(f"Set speculation to {self.conv.settings.speculate}.")
        else:
            say(f"Unknown setting '{what}'. Type /? for help")

    def _set_parameter(self, name: str, value: str) -> None:
        if not value:
            raise FerrumError(f"/set {name} needs a value, e.g. /set {name} {_example(name)}")
        if name == "stop":
            self._change(stop=tuple(value.split()))
        elif name in MAX_TOKENS_NAMES:
            tokens = _parse(name, value, int)
            self._change(max_tokens=None if tokens <= 0 else tokens)
        else:
            field, kind = SAMPLING_PARAMETERS[name]
            self._change(
                sampling=dataclasses.replace(self.conv.settings.sampling, **{field: _parse(name, value, kind)})
            )
        say(f"Set parameter '{name}' to '{value}'.")

    def _speculation(self, value: str) -> Speculate:
        name = draft_name(value)
        if name is None:
            return Speculate.parse(value)
        if not isinstance(self.session.engine, Engine):
            raise FerrumError("/set speculate draft:MODEL needs a local model; a remote server decodes on its own")
        from ferrum_mac.cli.run import open_draft

        return open_draft(self.session.engine, name)

    def _change(self, **changes) -> None:
        self.conv.settings = self.conv.settings.replace(**changes)

    # -- /show ----------------------------------------------------------------------------

    def _cmd_show(self, rest: str) -> None:
        what = rest.strip().lower()
        engine, settings = self.session.engine, self.conv.settings
        if what == "info" and not hasattr(engine, "model"):  # a RemoteEngine: only what the server says
            say(
                f"  model        {engine.name}\n  server       {engine.path}\n"
                f"  context      {engine.kv_capacity() or 'unknown'} tokens"
            )
        elif what == "info":
            c = engine.model.config
            say(
                f"  model        {engine.name}\n  path         {engine.path}\n  architecture {c.model_type}\n"
                f"  dtype        {c.dtype}\n  context      {engine.model.kv_capacity()} tokens\n"
                f"  template     {engine.template.name}"
            )
        elif what == "template":
            say(engine.template.source)
        elif what == "system":
            say(
                settings.system
                if settings.system is not None
                else "(no system message set; the template's default applies)"
            )
        elif what == "parameters":
            say(parameters_text(settings))
        else:
            say("Usage: /show info|template|system|parameters")

    # -- the rest -------------------------------------------------------------------------

    def _cmd_clear(self, rest: str) -> None:
        self.conv.clear()
        say("Cleared session context.")

    def _cmd_save(self, rest: str) -> None:
        path = saved_path(rest)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "model": self.session.engine.name,
            "settings": settings_to_dict(self.conv.settings),
            "messages": self.conv.messages,
        }
        path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
        say(f"Saved the conversation as '{rest.strip()}'.")

    def _cmd_load(self, rest: str) -> None:
        path = saved_path(rest)
        if not path.is_file():
            raise FerrumError(f"no saved conversation named {rest.strip()!r}; /save one first")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            settings = settings_from_dict(data["settings"])
            messages = [dict(m) for m in data["messages"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FerrumError(f"{path} is not a saved conversation ({e}); save it again") from None
        self.conv.settings, self.conv.messages = settings, messages
        say(f"Loaded '{rest.strip()}' ({len(messages)} messages).")

    def _cmd_bye(self, rest: str) -> bool:
        return False

    _cmd_exit = _cmd_bye

    def _cmd_help(self, rest: str) -> None:
        say(HELP)


def say(text: str) -> None:
    print(text, file=sys.stdout, flush=True)


def _parse(name: str, value: str, kind: Callable):
    try:
        return kind(value)
    except ValueError:
        raise FerrumError(f"{name} needs {'a whole number' if kind is int else 'a number'}, not {value!r}") from None


def _example(name: str) -> str:
    return {"stop": "'<|end|>'", "seed": "42", "top_k": "40"}.get(name, "0.7")


def parameters_text(settings: ChatSettings) -> str:
    s = settings.sampling
    rows = [
        (name, getattr(s, field)) for name, (field, _) in SAMPLING_PARAMETERS.items() if name != "repetition_penalty"
    ]
    rows += [
        ("num_predict", settings.max_tokens or "unlimited"),
        ("stop", " ".join(settings.stop) or "(none)"),
        ("think", {None: "template default", True: "on", False: "off"}[settings.think]),
        ("context", settings.context_policy),
        ("format", settings.response_format.describe() if settings.response_format else "text"),
        ("speculate", str(settings.speculate)),
    ]
    return "\n".join(f"  {name:<18}{value}" for name, value in rows)


def saved_path(name: str) -> Path:
    from ferrum_mac.settings import saved_conversations_dir

    name = name.strip()
    if not SAVE_NAME.match(name):
        raise FerrumError("give a name of letters, digits, '.', '-' or '_', e.g. /save trip-plans")
    return saved_conversations_dir() / f"{name}.json"


def settings_to_dict(settings: ChatSettings) -> dict:
    return {
        **dataclasses.asdict(settings),
        "sampling": settings.sampling.as_dict(),
        "stop": list(settings.stop),
        "speculate": str(settings.speculate),
    }


def settings_from_dict(data: dict) -> ChatSettings:
    sampling = dict(data.get("sampling", {}))
    sampling["logit_bias"] = {int(k): float(v) for k, v in sampling.get("logit_bias", {}).items()}
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    return ChatSettings(
        system=data.get("system"),
        sampling=SamplingParams(**{k: v for k, v in sampling.items() if k in known}),
        max_tokens=data.get("max_tokens"),
        think=data.get("think"),
        context_policy=data.get("context_policy", "error"),
        stop=tuple(data.get("stop", ())),
        response_format=_saved_format(data.get("response_format")),
        speculate=_saved_speculation(data.get("speculate")),
    ).checked()


def _saved_speculation(word) -> Speculate:
    """A saved conversation's speculation; a draft model is not loaded again (auto instead)."""
    try:
        return Speculate.parse(word) if isinstance(word, str) else Speculate()
    except FerrumError:
        return Speculate()


def _saved_format(data) -> ResponseFormat | None:
    """A saved conversation's format (`settings_to_dict` writes `{"schema": ...}` or null)."""
    return ResponseFormat(data.get("schema")) if isinstance(data, dict) else None
