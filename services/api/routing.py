"""The route class of every API route: what no route takes is refused before FastAPI reads the request.

A route class rather than a dependency: it runs on every request, and as two router-level dependencies these
checks cost ~30 µs of FastAPI's dependency solving per request (a write costs the API ~1 ms), here ~2 µs.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from types import UnionType
from typing import Any, Union, get_args, get_origin

from fastapi import Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from shared.events import has_lone_surrogate


class CheckedRoute(APIRoute):
    """A route that refuses, with the 400 of any invalid field:
    - a query parameter it does not take, as an unknown body field is refused: a misspelt or differently encoded
      filter (`tag=`, `tags[]=`) must not quietly list everything; and one that takes a single value given twice
      (`project_id=A&project_id=B` listed B's alone);
    - a body with a Content-Encoding (gzip, …): a 415;
    - a body that is not UTF-8 (RFC 8259; Python's parser would also take UTF-16, and UTF-8 with encoded
      surrogates), or that holds a lone surrogate (`"\\ud800"`: valid JSON, half of a UTF-16 pair, as a JavaScript
      client that cut a string through an emoji sends it): no UTF-8 text, so no column, log line or event, holds it.
    """

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()
        # The route's own parameters and its dependencies'. A dependency given to `include_router(dependencies=…)`
        # is not in this route's dependant: a query parameter only it takes would be refused (none does today).
        taken = _query_parameters(self.dependant)
        takes_body = self.body_field is not None  # a body sent to a route that takes none is never read

        async def checked(request: Request) -> Response:
            if request.query_params:
                _refuse_query_parameters_not_taken(request, taken)
            if takes_body:
                _refuse_encoded_bodies(request)
                _refuse_text_that_is_not_unicode(await _body_of(request))
            return await handler(request)

        return checked


def _refuse_encoded_bodies(request: Request) -> None:
    """A compressed body is not read as one: refused as such (a 415), not as text that is no UTF-8, nor, when it
    happens to be plain, taken as sent."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise HTTPException(415, f"Content-Encoding {encoding!r} is not accepted: send the body as it is")


async def _body_of(request: Request) -> bytes:
    """Read once (FastAPI reuses it), failing as FastAPI's own reading does: a client gone mid-body is a 400,
    not an unhandled error; a body over the size limit still raises its 413."""
    try:
        return await request.body()
    except HTTPException:
        raise
    except Exception as exc:  # FastAPI turns any failure to read the body into this same 400
        raise HTTPException(400, "There was an error parsing the body") from exc


def _refuse_query_parameters_not_taken(request: Request, taken: Mapping[str, bool]) -> None:
    given = Counter(name for name, _ in request.query_params.multi_items())
    errors = [
        {"type": "extra_forbidden", "loc": ("query", name), "msg": "unknown query parameter"}
        for name in given
        if name not in taken
    ] + [
        {"type": "repeated", "loc": ("query", name), "msg": "given more than once: it takes one value"}
        for name, count in given.items()
        if count > 1 and taken.get(name) is False
    ]
    if errors:
        raise RequestValidationError(errors)


def _query_parameters(dependant: Dependant) -> dict[str, bool]:
    """Each query parameter of the route and its dependencies, and whether it takes several values (a list)."""
    taken = {field.alias: _takes_several(field.field_info.annotation) for field in dependant.query_params}
    for sub in dependant.dependencies:
        taken.update(_query_parameters(sub))
    return taken


def _takes_several(annotation: Any) -> bool:
    """A list (or set, tuple), optional or not: `list[str] | None` takes repeats as `list[str]` does."""
    if get_origin(annotation) in (Union, UnionType):
        return any(_takes_several(member) for member in get_args(annotation))
    return get_origin(annotation) in (list, tuple, set, frozenset)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a surrogate, paired or not: in a strict UTF-8 body, the only way a lone one gets in."""


def _refuse_text_that_is_not_unicode(body: bytes) -> None:
    """A body without a surrogate escape (nearly all) costs a decode and one scan of its bytes."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"must be UTF-8 text: byte {exc.start} is not"
        raise RequestValidationError([{"type": "utf8", "loc": ("body",), "msg": message}]) from None
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return  # FastAPI's own parsing says what is wrong
    where = _lone_surrogate_at(value)
    if where is not None:
        message = "must be Unicode text: a lone surrogate (half of a UTF-16 pair) is no character"
        raise RequestValidationError([{"type": "lone_surrogate", "loc": ("body", *where), "msg": message}])


def _lone_surrogate_at(value: Any) -> tuple[str | int, ...] | None:
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while pending:  # not recursive: the body may nest as deep as the parser let it
        path, item = pending.pop()
        if isinstance(item, str) and has_lone_surrogate(item):
            return path
        if isinstance(item, dict):
            for key, child in item.items():
                if has_lone_surrogate(key):
                    return (*path, key)  # shown as U+FFFD by the envelope
                pending.append(((*path, key), child))
        elif isinstance(item, list):
            pending.extend(((*path, index), child) for index, child in enumerate(item))
    return None
