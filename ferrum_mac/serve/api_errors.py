"""The one exception every route answers errors with (`ApiError`), in the shape of the request's API.

Each API module registers its renderer for its path prefix (`error_shapes["/api/"] =
ollama_error`); the longest matching prefix wins, and any other path gets OpenAI's
`{"error": {message, type, param, code}}`."""

from __future__ import annotations

import re
from typing import Callable, Mapping

from starlette.responses import JSONResponse, Response


class ApiError(Exception):
    """A request refused or failed: its HTTP `status`, and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# An absolute or home path where a message quotes one: at its start or after a space, quote or bracket.
ABSOLUTE_PATH = re.compile(r"(?:(?<=^)|(?<=[\s'\"(\[=]))~?/[^\s'\"()\[\]]*")


def hide_paths(text: str) -> str:
    """`text` with each absolute path cut to its last part: an error a client reads must not
    show the server's folders (its log has them whole)."""
    return ABSOLUTE_PATH.sub(lambda m: m.group().rstrip("/").rsplit("/", 1)[-1] or "/", text)


Renderer = Callable[[ApiError], dict]

error_shapes: dict[str, Renderer] = {}


def openai_error(error: ApiError) -> dict:
    return error.body()


def renderer_for(path: str) -> Renderer:
    prefixes = [p for p in error_shapes if path.startswith(p)]
    return error_shapes[max(prefixes, key=len)] if prefixes else openai_error


def error_body(path: str, error: ApiError) -> dict:
    return renderer_for(path)(error)


def error_response(path: str, error: ApiError, headers: Mapping[str, str] | None = None) -> Response:
    return JSONResponse(error_body(path, error), status_code=error.status, headers=headers)
