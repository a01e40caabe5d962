"""Python functions as tools a model may call.

    from ferrum_mac.engine.tools import Toolbox, tool

    @tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        \"\"\"The current weather in a city.\"\"\"
        return f"18 degrees {unit} in {city}"

    box = Toolbox([get_weather])
    box.definitions()                       # OpenAI `tools`: for the chat template, or a server
    box.run("get_weather", '{"city": "Paris"}')   # -> '18 degrees celsius in Paris'

    for event in conv.send("Weather in Paris?", tools=box):   # a ToolCallRequested among the events
        ...
    conv.add_tool_results(box.results(calls))   # what each call answered (errors as text)
    for event in conv.continue_answer(tools=box): ...          # the model answers with the results

A tool's JSON schema comes from its signature (str, int, float, bool, None, list[...], dict,
Literal[...], Optional / `X | None`; a parameter with a default is optional) and its description
from the docstring's first paragraph; both can be given instead (`tool(parameters=..., description=...)`).
Nothing runs a tool on its own: the chat app asks the user first.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, Union

from ferrum_mac.errors import FerrumError

if TYPE_CHECKING:
    from ferrum_mac.text.tool_calls import ToolCall

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


class ToolError(FerrumError):
    """A tool that cannot be defined, a call it cannot take, or a run that failed."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of an object
    function: Callable[..., Any]

    def definition(self) -> dict:
        """The tool as OpenAI's `tools` lists it."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def run(self, arguments: str | Mapping[str, Any]) -> str:
        """Call the function with `arguments` (JSON text or a dict); its result as text (JSON
        unless it is a string). Arguments that do not fit, or a function that raises, is a `ToolError`."""
        args = _arguments(self.name, arguments)
        properties = self.parameters.get("properties", {})
        unknown = sorted(set(args) - set(properties)) if self.parameters.get("additionalProperties") is False else []
        missing = [p for p in self.parameters.get("required", ()) if p not in args]
        if unknown or missing:
            problem = f"unknown {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}"
            raise ToolError(f"tool '{self.name}' got arguments it cannot take ({problem})")
        try:
            result = self.function(**args)
        except Exception as e:  # noqa: BLE001  whatever the user's function raises is that call's failure
            raise ToolError(
                f"tool '{self.name}' failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            ) from e
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)


def tool(
    function: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict | None = None,
):
    """Make `function` a `Tool` (also a decorator, with or without arguments)."""

    def make(fn: Callable[..., Any]) -> Tool:
        tool_name = name or fn.__name__
        if not NAME.match(tool_name):
            raise ToolError(f"a tool name must be 1 to 64 letters, digits, '_' or '-'; {tool_name!r} is not")
        text = description if description is not None else _first_paragraph(inspect.getdoc(fn) or "")
        return Tool(tool_name, text, parameters if parameters is not None else schema_of(fn), fn)

    return make if function is None else make(function)


class Toolbox:
    """The tools one conversation offers, by name."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()):
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, t: Tool | Callable[..., Any]) -> Tool:
        made = t if isinstance(t, Tool) else tool(t)
        if made.name in self._tools:
            raise ToolError(f"a tool named '{made.name}' is registered already")
        self._tools[made.name] = made
        return made

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise ToolError(
                f"the model called '{name}', which is no tool here ({', '.join(self._tools) or 'none'})"
            ) from None

    def definitions(self) -> list[dict]:
        return [t.definition() for t in self._tools.values()]

    def run(self, name: str, arguments: str | Mapping[str, Any]) -> str:
        return self.get(name).run(arguments)

    def results(self, calls: Iterable["ToolCall"]) -> dict[str, str]:
        """Run every call; each call's id -> its result, or the one-line error that stopped it
        (the model reads either). For code that runs tools without asking anyone."""
        out = {}
        for call in calls:
            try:
                out[call.id] = self.run(call.name, call.arguments)
            except ToolError as e:
                out[call.id] = str(e)
        return out


Tools = Union[Toolbox, Sequence[Union[Tool, Mapping[str, Any]]]]  # what `Conversation.send` takes


@dataclass(frozen=True)
class ToolRequest:
    """The tools an answer may call (OpenAI `function` objects) and what it may do with them:
    `choice` is "auto", "required" or the name of the one function it must call; `parallel`:
    whether one answer may make several calls."""

    functions: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def of(cls, tools: Tools, choice: str | Mapping = "auto", parallel: bool = True) -> "ToolRequest | None":
        """From a `Toolbox`, `Tool`s or OpenAI tool objects; `choice` as OpenAI's `tool_choice`
        ("none", "auto", "required", a function's name or `{"type": "function", "function":
        {"name": ...}}`). None when the answer gets no tools."""
        functions = tuple(_function_of(t) for t in (tools.definitions() if isinstance(tools, Toolbox) else tools))
        names = [f["name"] for f in functions]
        if isinstance(choice, Mapping):
            choice = (choice.get("function") or {}).get("name", "")
        if choice == "none" or not functions:
            if choice not in ("none", "auto"):
                raise ToolError(f"tool_choice {choice!r} needs tools to choose from")
            return None
        if choice not in ("auto", "required") and choice not in names:
            raise ToolError(f"tool_choice names {str(choice)[:64]!r}, which is none of the tools ({', '.join(names)})")
        return cls(functions, str(choice), parallel)

    @property
    def forced(self) -> tuple[dict, ...]:
        """The functions a call must be one of, when a call is required; () when the model may answer in text."""
        if self.choice == "auto":
            return ()
        if self.choice == "required":
            return self.functions
        return tuple(f for f in self.functions if f["name"] == self.choice)

    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]

    def as_openai(self) -> dict:
        """The request fields of OpenAI's API for these tools (what a remote engine sends)."""
        choice: str | dict = self.choice
        if self.choice not in ("auto", "required"):
            choice = {"type": "function", "function": {"name": self.choice}}
        return {"tools": self.template_tools(), "tool_choice": choice, "parallel_tool_calls": self.parallel}


def _function_of(t: Tool | Mapping[str, Any]) -> dict:
    """The OpenAI `function` object of a tool given as a `Tool` or an OpenAI tool object."""
    if isinstance(t, Tool):
        return t.definition()["function"]
    function = t.get("function") if isinstance(t, Mapping) and t.get("type") == "function" else None
    if (
        not isinstance(function, Mapping)
        or not isinstance(function.get("name"), str)
        or not NAME.match(function["name"])
    ):
        raise ToolError("a tool must be a Tool or {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}")
    return dict(function)


def schema_of(function: Callable[..., Any]) -> dict:
    """The JSON schema of `function`'s keyword arguments, from its annotations."""
    hints = typing.get_type_hints(function)
    properties, required = {}, []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.name not in hints:
            raise ToolError(f"parameter '{parameter.name}' of {function.__name__} needs a type annotation to be a tool")
        properties[parameter.name] = _schema_of_type(hints[parameter.name], parameter.name)
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _schema_of_type(annotation: Any, where: str) -> dict:
    if annotation in _SIMPLE:
        return {"type": _SIMPLE[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema_of_type(a, where) for a in args]}
    if annotation is list or origin is list:
        return {"type": "array", **({"items": _schema_of_type(args[0], where)} if args else {})}
    if annotation is dict or origin is dict:
        return {"type": "object"}
    raise ToolError(
        f"parameter '{where}' has type {annotation!r}, which a tool cannot take; use str, int, float, bool, list, dict or Literal"
    )


def shortest_arguments(function: Mapping[str, Any]) -> dict:
    """A short arguments object `function`'s parameters allow (its required keys only), for a
    lower bound on what a call of it writes."""
    value = _shortest_instance(function.get("parameters") or {})
    return value if isinstance(value, dict) else {}


def _shortest_instance(schema: Any) -> Any:
    if not isinstance(schema, Mapping):
        return None
    if "const" in schema:
        return schema["const"]
    options = schema.get("enum") or [_shortest_instance(s) for s in schema.get("anyOf") or schema.get("oneOf") or ()]
    if options:
        return min(options, key=lambda v: len(json.dumps(v)))
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        required = [k for k in schema.get("required") or () if isinstance(k, str)]
        return {k: _shortest_instance(properties.get(k)) for k in required}
    return {"string": "", "integer": 0, "number": 0, "boolean": True, "array": []}.get(str(kind))


def _arguments(name: str, arguments: str | Mapping[str, Any]) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError as e:
            raise ToolError(f"the arguments for tool '{name}' are not JSON ({e})") from None
    if not isinstance(arguments, Mapping):
        raise ToolError(f"the arguments for tool '{name}' must be a JSON object")
    return dict(arguments)


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())
