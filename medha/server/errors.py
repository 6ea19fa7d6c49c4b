"""Error answers in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.

Validation errors are worded as the OpenAI API words them ("Invalid type for 'max_tokens':
expected an integer, but got a string instead.", with its codes), so that clients written
against it show the same messages. `param` names the field with dots (`messages.0.role`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

# pydantic's tags inside a location: union members and validator steps, not field names
_TYPE_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "dict",
    "list",
    "function-after",
    "function-before",
    "function-wrap",
    "nullable",
    "constrained-str",
    "int-str",
}
_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a decimal",
    "float_parsing": "a decimal",
    "string_type": "a string",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}
# fields medha refuses past a bound the OpenAI API allows: say why next to the bound
_HINTS = {
    "n": "n > 1 is not supported; send several requests",
    "best_of": "best_of > 1 is not supported",
}


class RequestError(ValueError):
    """A request medha refuses: HTTP status, message, and the offending parameter."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.type, self.code = param, status, type_, code

    def body(self) -> dict:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict | None = None) -> JSONResponse:
        return SafeJSONResponse(self.body(), status_code=self.status, headers=headers)


class SafeJSONResponse(JSONResponse):
    """JSON that always renders: a client's lone surrogate echoed in a message (a field name,
    a model name) is escaped instead of failing the UTF-8 encoding with a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(
            content, ensure_ascii=True, allow_nan=False, separators=(",", ":")
        ).encode()


def describe(value: Any) -> str:
    """How OpenAI names a JSON value's type in its messages."""
    if value is None:
        return "null"
    for kind, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a decimal"),
        (str, "a string"),
        (list, "an array"),
        (dict, "an object"),
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def field_path(loc: tuple) -> str | None:
    """'messages.0.role' from pydantic's ('body', 'messages', 0, 'role'): union tags end it."""
    parts = []
    for x in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(x, int):
            parts.append(str(x))
        elif isinstance(x, str) and x not in _TYPE_TAGS and "[" not in x:
            parts.append(x)
        else:
            break
    return ".".join(parts) or None


def from_validation(errors: list[dict]) -> RequestError:
    """A request's pydantic errors as OpenAI would answer them: the first field's. A field of
    several types (`stop`: a string or a list) fails once per type; the error of the type the
    value has (a constraint it breaks) says more than "expected a string"."""
    if not errors:
        return RequestError("invalid request")
    first = field_path(tuple(errors[0].get("loc", ())))
    same = [e for e in errors if field_path(tuple(e.get("loc", ()))) == first]
    return _translate(next((e for e in same if e.get("type") not in _EXPECTED), same[0]))


def _translate(err: dict) -> RequestError:
    kind, ctx, value = err.get("type", ""), err.get("ctx") or {}, err.get("input")
    if kind == "json_invalid":
        return RequestError(f"the body is not valid JSON: {ctx.get('error', err.get('msg'))}")
    param = field_path(tuple(err.get("loc", ())))
    if kind in ("model_attributes_type", "dict_type", "model_type") and param is None:
        return RequestError("the body must be a JSON object (Content-Type: application/json)")
    msg = str(err.get("msg", "invalid request"))
    if kind == "value_error":  # medha's own validators name the field first
        msg = msg.removeprefix("Value error, ")
        named, _, rest = msg.partition(": ")
        if rest and (param is None or named.startswith(param)):
            return RequestError(rest, named, code="invalid_value")
        return RequestError(msg, param, code="invalid_value")
    if kind == "missing":
        return RequestError(
            f"Missing required parameter: '{param}'.", param, code="missing_required_parameter"
        )
    if param == "prompt":  # a union: its members' errors say little one by one
        return RequestError(
            "prompt must be a non-empty string, a list of strings, a list of "
            "token ids or a list of token-id lists",
            "prompt",
            code="invalid_type",
        )
    if kind in _EXPECTED:
        return RequestError(
            f"Invalid type for '{param}': expected {_EXPECTED[kind]}, but got "
            f"{describe(value)} instead.",
            param,
            code="invalid_type",
        )
    if (out_of_range := _out_of_range(param, value, ctx)) is not None:
        return out_of_range
    if kind == "too_short":
        return RequestError(
            f"Invalid '{param}': empty array. Expected an array with minimum "
            f"length {ctx.get('min_length', 1)}, but got an empty array "
            "instead.",
            param,
            code="empty_array",
        )
    if kind == "too_long":
        return RequestError(
            f"Invalid '{param}': array too long. Expected an array with maximum "
            f"length {ctx.get('max_length')}, but got an array with length "
            f"{ctx.get('actual_length')} instead.",
            param,
            code="array_above_max_length",
        )
    if kind == "string_too_short":
        return RequestError(
            f"Invalid '{param}': empty string. Expected a string with minimum "
            f"length {ctx.get('min_length', 1)}, but got an empty string "
            "instead.",
            param,
            code="empty_string",
        )
    if kind == "literal_error":
        return RequestError(
            f"Invalid value: {value!r}. Supported values are: {ctx.get('expected')}.",
            param,
            code="invalid_value",
        )
    if kind == "extra_forbidden":
        return RequestError(
            f"Unrecognized request argument supplied: {param}", param, code="unknown_parameter"
        )
    if kind == "finite_number":
        return RequestError(
            f"Invalid '{param}': expected a finite number, but got {value!r} instead.",
            param,
            code="invalid_value",
        )
    return RequestError(f"{param}: {msg}" if param else msg, param)


def _out_of_range(param: str | None, value: Any, ctx: dict) -> RequestError | None:
    """A number past a bound (pydantic's ge, gt, le, lt), in OpenAI's words."""
    number = "integer" if isinstance(value, int) else "decimal"
    for bound, word, sign in (
        ("ge", "below minimum", ">="),
        ("gt", "below minimum", ">"),
        ("le", "above maximum", "<="),
        ("lt", "above maximum", "<"),
    ):
        if bound in ctx:
            hint = f" ({_HINTS[param]})" if param in _HINTS and word == "above maximum" else ""
            return RequestError(
                f"Invalid '{param}': {number} {word} value. Expected a value "
                f"{sign} {ctx[bound]}, but got {value!r} instead.{hint}",
                param,
                code=f"{number}_{word.replace(' ', '_')}_value",
            )
    return None
