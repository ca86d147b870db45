"""The API's one error map: every failure leaves as `{"error": {"code", "message", "meta"?}}`."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from shared.events import problem_of, storable

log = logging.getLogger("memories.api")

_CODES = {
    400: "VALIDATION_FAILED",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "RESOURCE_NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    409: "CONFLICT",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    503: "SERVICE_UNAVAILABLE",
    500: "INTERNAL_ERROR",
}


_LOCK_NOT_AVAILABLE = "55P03"
"""The API's `lock_timeout` passed (shared.db.session.create_engine)."""


class ErrorDetail(BaseModel):
    code: str = Field(description="one of " + ", ".join(dict.fromkeys(_CODES.values())), examples=["VALIDATION_FAILED"])
    message: str
    meta: dict[str, Any] | None = Field(
        default=None, description="details, e.g. `invalid_fields` [{field, message}], `unknown_fields`, `write_id`"
    )


class ErrorEnvelope(BaseModel):
    """Every failure of the API, whatever its status."""

    error: ErrorDetail


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, meta: dict[str, Any] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code or _CODES.get(status, "INTERNAL_ERROR")
        self.message = message
        self.meta = meta


def invalid(message: str, *fields: str, status: int = 400) -> ApiError:
    """A refusal of named fields, in the shape request validation gives: `meta.invalid_fields` of
    `{field, message}`."""
    return ApiError(status, message, meta={"invalid_fields": [{"field": f, "message": message} for f in fields]})


_ID_SHOWN_CHARS = 80  # ids are at most 64 characters: a longer one is not an id, and is not echoed whole


def not_found(kind: str, identifier: str) -> ApiError:
    if not identifier:
        return ApiError(404, f"no {kind} has an empty id")
    shown = identifier if len(identifier) <= _ID_SHOWN_CHARS else f"{identifier[:_ID_SHOWN_CHARS]}…"
    return ApiError(404, f"{kind} {shown} not found")


class _EnvelopeResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        # A message may quote what the caller sent, and a JSON body can carry a lone surrogate (`"mem_\\ud800"`)
        # that no UTF-8 text holds: shown as U+FFFD, the envelope is still sent (not a 500 and a reset) and is
        # Unicode that strict parsers take (an escaped lone surrogate is not).
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return storable(text).encode("utf-8")


_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="memories"'}
"""What a 401 must name (RFC 9110): the scheme that would be accepted."""


def envelope(
    status: int,
    message: str,
    *,
    code: str | None = None,
    meta: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    error: dict[str, Any] = {"code": code or _CODES.get(status, "INTERNAL_ERROR"), "message": message}
    if meta:
        error["meta"] = meta
    if status == 401:
        headers = {**_CHALLENGE, **(headers or {})}
    return _EnvelopeResponse({"error": error}, status_code=status, headers=headers)


def _field(loc: tuple[Any, ...]) -> str:
    # ("body", "tags", 3) -> "tags[3]"; the "body"/"query" prefix says nothing to a client.
    parts = [str(p) for p in loc[1:]] if loc and loc[0] in ("body", "query", "path", "header") else list(map(str, loc))
    return ".".join(parts) or str(loc[0] if loc else "body")


def _problem(error: dict[str, Any]) -> dict[str, str]:
    if error.get("type") == "json_invalid":
        # Its location is the character where the JSON broke, not a field.
        at = error["loc"][-1] if len(error.get("loc", ())) > 1 else None
        return {"field": "body", "message": problem_of(error) + (f" at character {at}" if at is not None else "")}
    return {"field": _field(error["loc"]), "message": problem_of(error)}


def validation_response(errors: list[dict[str, Any]]) -> JSONResponse:
    unknown = [_field(e["loc"]) for e in errors if e.get("type") == "extra_forbidden"]
    missing = [_field(e["loc"]) for e in errors if e.get("type") == "missing"]
    too_large = [e for e in errors if e.get("type") in {"string_too_long"} and _field(e["loc"]) == "content"]
    problems = [_problem(e) for e in errors if e.get("type") not in {"extra_forbidden", "missing"}]
    meta: dict[str, Any] = {}
    if unknown:
        meta["unknown_fields"] = unknown
    if missing:
        meta["missing_fields"] = missing
    if problems:
        meta["invalid_fields"] = problems
    if too_large and not unknown and not missing:
        return envelope(413, "content is too long", meta=meta)
    if any(e.get("type") == "json_invalid" for e in errors):
        return envelope(400, "request body is not valid JSON", meta=meta)
    if any(tuple(e.get("loc", ())) == ("body",) and e.get("type") == "model_attributes_type" for e in errors):
        # Most often a client that forgot the header: say what to send instead of a schema error.
        return envelope(400, "the body must be a JSON object sent with Content-Type: application/json", meta=meta)
    return envelope(400, "request validation failed", meta=meta)


# SQLSTATEs of a value the client chose that PostgreSQL cannot store: too long, out of range, not valid in the
# encoding, not valid for the column's type.
_CLIENT_VALUE_STATES = frozenset({"22001", "22003", "22021", "22P02", "22P05"})


def _refused_client_value(exc: DataError) -> bool:
    sqlstate = getattr(exc.orig, "sqlstate", None)
    # psycopg refuses a NUL in a text parameter itself, before any statement reaches the server.
    return sqlstate in _CLIENT_VALUE_STATES or (sqlstate is None and "NUL" in str(exc.orig))


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return envelope(exc.status, exc.message, code=exc.code, meta=exc.meta)

    @app.exception_handler(RequestValidationError)
    async def request_validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        headers = exc.headers
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": _methods_of(request, (headers or {}).get("Allow"))}
        return envelope(exc.status_code, message, headers=headers)

    @app.exception_handler(OperationalError)
    async def database_down(_request: Request, exc: OperationalError) -> JSONResponse:
        if getattr(exc.orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE:
            log.warning("gave up waiting for a lock: %s", exc.orig)
            return envelope(503, "what this request changes is busy with work in progress (a write being decided); retry")
        log.warning("database unavailable: %s", exc)
        return envelope(503, "the database is unavailable; retry later")

    @app.exception_handler(PoolTimeout)
    async def no_connection_free(_request: Request, exc: PoolTimeout) -> JSONResponse:
        log.warning("no database connection free: %s", exc)
        return envelope(503, "the service is busy; retry")

    @app.exception_handler(DataError)
    async def unstorable_value(_request: Request, exc: DataError) -> JSONResponse:
        if not _refused_client_value(exc):  # e.g. a vector of the wrong dimensions: our fault, not the client's
            log.exception("database error", exc_info=exc)
            return envelope(500, "internal error")
        # A value the request models let through but the database refuses: the client's, so a 400, and a
        # gap in validation worth a warning.
        log.warning("value refused by the database: %s", exc.orig)
        if "NUL" in str(exc.orig):  # say what to change, not which database refused it
            return envelope(400, "a value in the request contains a NUL character, which cannot be stored")
        return envelope(400, f"a value in the request cannot be stored: {str(exc.orig).splitlines()[0]}")

    @app.exception_handler(DBAPIError)
    async def database_error(_request: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            return envelope(503, "the database connection was lost; retry later")
        log.exception("database error", exc_info=exc)
        return envelope(500, "internal error")

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return envelope(500, "internal error")


def _methods_of(request: Request, told: str | None) -> str:
    """Every method the routes of the request's path take. Starlette names those of the first route that matches
    the path only (one route per method here), and FastAPI keeps an included router's routes inside it
    (`effective_route_contexts`); what Starlette said is kept when nothing else is found."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        nested = getattr(route, "effective_route_contexts", None)
        for candidate in nested() if nested else (route,):
            match, _ = candidate.matches(request.scope)
            if match is not Match.NONE:
                methods.update(getattr(candidate, "methods", None) or ())
    if "GET" in methods:
        methods.add("HEAD")  # services.api.observed.HeadAsGet
    return ", ".join(sorted(methods)) if methods else told or ""


_ERRORS_BY_STATUS = {
    "400": "invalid input (`meta.invalid_fields`, `meta.unknown_fields`)",
    "401": "no or unknown credential",
    "403": "the credential may not do this",
    "404": "no such resource in the caller's project",
    "413": "body or content too large",
    "503": "the database or the bus is unavailable; retry later",
    "default": "any other failure (e.g. 409 CONFLICT), in the same envelope",
}


def document_errors(app: FastAPI, prefix: str) -> None:
    """The OpenAPI document tells what the API answers on failure: the envelope, never FastAPI's 422 (every
    validation failure is a 400 here), so that a client generated from it knows its errors."""
    build = app.openapi
    documented = False

    def openapi() -> dict[str, Any]:
        nonlocal documented
        schema = build()  # FastAPI's, kept on the app once built
        if documented:
            return schema
        components = schema.setdefault("components", {})
        # Every route of the prefix takes a bearer credential (services.api.deps); a generated client sends it.
        components["securitySchemes"] = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "the admin token (MEMORIES_ADMIN_TOKEN) or a project's API key (`sk_…`)",
            }
        }
        schemas = components.setdefault("schemas", {})
        envelope_schema = ErrorEnvelope.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(envelope_schema.pop("$defs", {}))
        schemas["ErrorEnvelope"] = envelope_schema
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        reference = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}}
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                responses = operation["responses"]
                responses.pop("422", None)
                if not path.startswith(prefix):
                    continue
                operation["security"] = [{"bearer": []}]
                statuses = ["400", "401", "403", "503", "default"]
                if "{" in path:
                    statuses.append("404")
                if "requestBody" in operation:
                    statuses.append("413")
                for status in sorted(statuses):
                    responses.setdefault(status, {"description": _ERRORS_BY_STATUS[status], **reference})
        documented = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

