"""The OpenAPI document (`/openapi.json`) as the server really answers.

FastAPI's generated document lists a 422 validation error the server never sends (it answers
400 in OpenAI's shape) and none of the other answers; this one lists each route's status codes
with their bodies, the event stream beside the JSON body of the generation routes, and the
bearer key when one is required. schemathesis checks the server against it (tests/).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from medha.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ErrorResponse,
    Health,
    ModelList,
)

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "invalid request: a field out of range, of the wrong type or not supported, a prompt "
    "that does not fit the context, text that is not valid UTF-8; `param` names the field",
    "401": "missing or wrong API key",
    "404": "the model is not served here",
    "413": "the body is larger than --max-request-bytes",
    "429": "--max-waiting requests are waiting for their first token; retry after Retry-After",
    "500": "the request failed on its own after admission (the server goes on)",
    "503": "the engine has stopped after a fatal error",
}


def document(app: FastAPI, api_key: bool) -> dict:
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    keys, defs = models_json_schema(
        [
            (m, "serialization")
            for m in (
                ErrorResponse,
                CompletionResponse,
                CompletionChunk,
                ChatCompletionResponse,
                ChatCompletionChunk,
                ModelList,
                Health,
            )
        ],
        ref_template=_REF,
    )
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas.update(defs["$defs"])

    def ref(model) -> dict:
        return {"$ref": _REF.format(model=model.__name__)}

    def json_body(model, description: str) -> dict:
        return {"description": description, "content": {"application/json": {"schema": ref(model)}}}

    def errors(*codes: str) -> dict:
        return {c: json_body(ErrorResponse, _ERRORS[c]) for c in codes if c != "401" or api_key}

    generation = ("400", "401", "404", "413", "429", "500", "503")
    responses = {
        "/v1/completions": {
            "200": _generated(ref(CompletionResponse), ref(CompletionChunk)),
            **errors(*generation),
        },
        "/v1/chat/completions": {
            "200": _generated(ref(ChatCompletionResponse), ref(ChatCompletionChunk)),
            **errors(*generation),
        },
        "/v1/models": {"200": json_body(ModelList, "the served model"), **errors("401")},
        "/health": {
            "200": json_body(Health, "the engine runs"),
            "503": json_body(Health, "the engine has stopped after a fatal error"),
        },
        "/metrics": {
            "200": {
                "description": "Prometheus metrics",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    }
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            if path in responses:
                operation["responses"] = responses[path]
            if api_key and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = schema
    return schema


def _generated(body_ref: dict, chunk_ref: dict) -> dict:
    # OpenAPI 3.1 reads an event stream's schema as the schema of one event
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                chunk_ref,
                                {"$ref": _REF.format(model=ErrorResponse.__name__)},
                            ]
                        },
                    },
                ]
            },
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
    }
    return {
        "description": "the completion, or with `stream: true` server-sent events: one "
        "JSON chunk per `data:` line, an error object if the request fails mid-stream, "
        "then `data: [DONE]`",
        "content": {
            "application/json": {"schema": body_ref},
            "text/event-stream": {"schema": event},
        },
    }
