"""Typed errors of the client: one class per status of the API's envelope `{"error": {code, message, meta}}`."""

from __future__ import annotations

from typing import Any

import httpx


class MemoriesError(Exception):
    """A failed call. `status` is the HTTP status (None when no response arrived); `code`, `message` and
    `meta` are the envelope's. `replayed`: a write's first outcome given again for its Idempotency-Key (e.g. its
    entry deleted since: a 409); this call changed nothing."""

    def __init__(
        self, status: int | None, code: str, message: str, meta: dict[str, Any] | None = None, replayed: bool = False
    ) -> None:
        named = fields_named(meta or {})
        # What to fix, in the text a traceback shows: the message alone ("request validation failed") does not say.
        super().__init__(f"{code}: {message}" + (f" ({'; '.join(named)})" if named else ""))
        self.status = status
        self.code = code
        self.message = message
        self.meta: dict[str, Any] = meta or {}
        self.replayed = replayed

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields, so that it crosses a process pool or a task queue (pickle, copy).
        return type(self), (self.status, self.code, self.message, self.meta, self.replayed)


def fields_named(meta: dict[str, Any]) -> list[str]:
    """The fields an envelope's `meta` names as wrong: `field: why` for each invalid one, then the missing and
    unknown ones."""
    named = [
        f"{problem.get('field')}: {problem.get('message')}" if isinstance(problem, dict) else str(problem)
        for problem in meta.get("invalid_fields") or []
    ]
    for kind in ("missing_fields", "unknown_fields"):
        if fields := meta.get(kind):
            named.append(f"{kind.replace('_', ' ')}: {', '.join(map(str, fields))}")
    return named


class ValidationFailed(MemoriesError):
    """400: `meta` may name `unknown_fields`, `missing_fields` or `invalid_fields`."""


class Unauthorized(MemoriesError):
    """401: no token, or not one the service knows."""


class Forbidden(MemoriesError):
    """403: the key does not hold the action."""


class NotFound(MemoriesError):
    """404: also what a resource of another project looks like."""


class Conflict(MemoriesError):
    """409."""


class PayloadTooLarge(MemoriesError):
    """413."""


class ServiceUnavailable(MemoriesError):
    """503: the database or the bus is down; retrying (with the same Idempotency-Key) is safe."""


class ConnectionFailed(MemoriesError):
    """No HTTP response at all: the service is unreachable or the connection broke."""


class TimedOut(ConnectionFailed):
    """The request was sent and no answer came within the client's timeout: it may have been applied. A write
    retried with the same Idempotency-Key is applied once. A ConnectionFailed, as timeouts were before."""


class InvalidRequest(MemoriesError):
    """Nothing was sent: the request cannot be sent as given (a number JSON cannot carry, NaN or Infinity; a
    token that is not visible ASCII; an Idempotency-Key that is not 1 to 255 visible ASCII characters, which the
    service would refuse; a malformed URL; an empty id)."""


_BY_STATUS: dict[int, type[MemoriesError]] = {
    400: ValidationFailed,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    503: ServiceUnavailable,
}


def error_of(response: httpx.Response) -> MemoriesError:
    """The typed error of a failed response, also when a proxy in between answered without an envelope."""
    code, message, meta = f"HTTP_{response.status_code}", response.reason_phrase or "request failed", None
    try:
        body = response.json()
    except ValueError:
        body = None
    envelope = body.get("error") if isinstance(body, dict) else None
    if isinstance(envelope, dict):
        code = str(envelope.get("code") or code)
        message = str(envelope.get("message") or message)
        meta = envelope.get("meta") if isinstance(envelope.get("meta"), dict) else None
    kind = _BY_STATUS.get(response.status_code, MemoriesError)
    return kind(response.status_code, code, message, meta, replayed=is_replayed(response))


def is_replayed(response: httpx.Response) -> bool:
    """The service answered with the first outcome of the write's Idempotency-Key (header Idempotent-Replayed)."""
    return response.headers.get("Idempotent-Replayed") == "true"


def raise_for_error(response: httpx.Response) -> httpx.Response:
    # Not only 4xx/5xx: no API route answers with a redirect, so a 3xx (e.g. an empty id: "/memories/"
    # redirects to the list) did not do what was asked either.
    if not response.is_success:
        raise error_of(response)
    return response


def unsent_or_unanswered(exc: Exception, url: str) -> MemoriesError:
    """The typed error of a request that got no response: never sent (refused here), unanswered in time, or
    unable to reach the service."""
    reason = str(exc) or type(exc).__name__
    # A protocol error on our side (an illegal header value) is a TransportError too, but nothing left.
    # An address without a scheme httpx can use (`notaurl`, `ftp://x`) is the caller's to fix, as a malformed one is.
    unsendable = httpx.LocalProtocolError | httpx.InvalidURL | httpx.UnsupportedProtocol | ValueError
    if isinstance(exc, unsendable):  # UnicodeEncodeError included
        return InvalidRequest(None, "INVALID_REQUEST", f"the request cannot be sent: {reason}")
    if isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout):
        return TimedOut(
            None, "TIMED_OUT", f"{url} did not answer in time; the request may have been applied ({reason})"
        )
    return ConnectionFailed(None, "CONNECTION_FAILED", f"cannot reach {url}: {reason}")
