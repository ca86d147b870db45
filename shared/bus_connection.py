"""How a process reaches NATS: a service waits out an outage for as long as it lasts, a one-shot command gives up
after a few tries; both log in as the process's NATS user (NATS_USER) and take their replies on that user's own
inboxes (shared.bus_permissions)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
from collections.abc import Callable
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NatsClient

from shared.settings import ConfiguredUnlike, Settings

log = logging.getLogger(__name__)


class BusUnreachable(Exception):
    """A one-shot command could not reach any NATS server."""


_CONNECTION_ERRORS = (
    OSError, TimeoutError, nats.errors.ConnectionClosedError, nats.errors.StaleConnectionError,
    nats.errors.UnexpectedEOF, nats.errors.NoServersError,
    nats.errors.DrainTimeoutError,  # a stop that gave the messages in hand DRAIN_TIMEOUT_S: they come back
)


async def report_connection_error(error: Exception) -> None:
    """What nats-py reports while it reconnects (a timeout, a refused connection): one line each; its default logs
    every one at ERROR with a traceback, for an outage the service waits out. Anything else it reports (an error
    raised in a subscription's callback, a slow consumer dropping messages) is a fault: at ERROR, with its trace."""
    if isinstance(error, _CONNECTION_ERRORS) or refused_login(error):
        log.warning("NATS connection: %s", str(error) or type(error).__name__)
    else:
        log.error("NATS client error: %s", str(error) or type(error).__name__, exc_info=error)


DRAIN_TIMEOUT_S = 5.0
"""How long a stopping service waits for its subscriptions to finish the messages they hold (nats-py's default,
30 s, outlasts the grace a container is given)."""
DRAIN_FLUSH_S = 10.0
"""nats-py's drain then flushes what is buffered, waiting up to its flush's fixed default for the answer."""


def connection_options(settings: Settings | None, *, name: str) -> dict[str, Any]:
    """How a service connects, for nats-py and for FastStream's broker alike: it retries the bus for as long as it is
    down (FastStream's own default gives up after ~2 minutes, and its consumers with it), and logs in as the NATS
    user of `settings`, if any, with replies on inboxes of its own (`inbox_prefix`)."""
    options: dict[str, Any] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 5,
        # A server that hangs (not one that closes) is left once a third ping is due with two unanswered:
        # ~45 s, not nats-py's default ~8 minutes (with 3 outstanding it took ~60 s, measured).
        "ping_interval": 15,
        "max_outstanding_pings": 2,
        "drain_timeout": DRAIN_TIMEOUT_S,
        "error_cb": report_connection_error,
    }
    if settings is not None and settings.nats_user:
        options["inbox_prefix"] = inbox_prefix(settings.nats_user)
    return options


def tls_options(settings: Settings | None) -> dict[str, Any]:
    """nats-py's TLS arguments: how the servers' certificates are checked and the certificate this process shows,
    when the settings name either (else nats-py's default, the system's authorities, when a server asks for TLS),
    and whether TLS starts before the server says anything. FastStream takes them in its security object instead
    (`ConsumerProcess`), with the login, as `login` gives them to nats-py."""
    if settings is None:
        return {}
    options: dict[str, Any] = {"tls_handshake_first": True} if settings.nats_tls_handshake_first else {}
    if settings.nats_tls_ca_file is not None or settings.nats_tls_cert_file is not None:
        context = ssl.create_default_context(cafile=settings.nats_tls_ca_file)
        if settings.nats_tls_cert_file is not None:
            context.load_cert_chain(settings.nats_tls_cert_file, settings.nats_tls_key_file)
        options["tls"] = context
    return options


def inbox_prefix(user: str) -> str:
    """Where a user's replies come (JetStream's answers, the messages it pulls, a write's outcome): a subject tree
    only that user may subscribe to (shared.bus_permissions)."""
    return f"_INBOX.{user}"


def login(settings: Settings | None) -> dict[str, str]:
    """The user and password nats-py sends, when one is configured (deploy/nats/auth.conf names the users)."""
    if settings is None or not settings.nats_user:
        return {}
    password = settings.nats_password.get_secret_value() if settings.nats_password else ""
    return {"user": settings.nats_user, "password": password}


async def connect(url: str, *, name: str, one_shot: bool = False, settings: Settings | None = None) -> NatsClient:
    """A service retries the bus for as long as it is down; a one-shot command (`memories bus init`, `dlq`)
    tries each server a few times, then raises BusUnreachable instead of hanging. It logs in as the NATS user of
    `settings`, if any; `url` is apart from them, as a command may reach the local run's NATS, which they do not name."""
    servers = url.split(",")
    if not one_shot:
        return await _connect_service(servers, name, settings)

    errors: list[Exception] = []
    hung: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    watch_handshakes = _handshake_watch(hung, servers)

    async def quiet(error: Exception) -> None:
        # A failed attempt to connect is reported by the caller, once; a refusal once connected is said at once,
        # or the command would only time out ("nats: timeout").
        if "permissions violation" in str(error).lower():
            log.error("NATS refused %s: %s (the bus and dlq commands need the admin user)", _user_of(settings), error)
        watch_handshakes(error)
        errors.append(error)

    nc = NatsClient()
    options = {**connection_options(settings, name=name), "max_reconnect_attempts": 3, "connect_timeout": 2}
    connecting = asyncio.ensure_future(
        nc.connect(servers=servers, **{**options, "error_cb": quiet}, **tls_options(settings), **login(settings))
    )
    try:
        await _connected_unless(connecting, hung, BusUnreachable)
        return nc
    except BusUnreachable:
        await _abandon(nc)
        raise
    except Exception as exc:  # nats-py raises its own errors and OSError alike for "no server answered"
        await _abandon(nc)
        if any(refused_login(error) for error in errors):
            raise BusUnreachable(_login_refused(servers, settings)) from exc
        if handshakes := [error for error in errors if isinstance(error, ssl.SSLError)]:
            raise BusUnreachable(_tls_refused(servers, handshakes[-1])) from exc
        raise BusUnreachable(f"cannot reach NATS at {redacted_servers(url)}: {type(exc).__name__} {exc}".rstrip()) from exc


async def _abandon(nc: NatsClient) -> None:
    with contextlib.suppress(Exception):
        await nc.close()


TLS_SILENCE_S = 8.0
"""nats-py waits for ever after a TLS upgrade that fails (a server certificate it cannot verify, a server that does
not speak TLS first): it then waits for the plain connection to close, which nothing closes. A handshake error
followed by this long without another attempt (a connect timeout and a retry's pause) is taken as one of those."""


def _handshake_watch(hung: asyncio.Future[str], servers: list[str]) -> Callable[[Exception], None]:
    """What to call with each error nats-py reports while it connects: answers `hung` with what to set once a
    failed TLS handshake left it hanging; at once for a certificate it does not trust, which always does."""
    loop = asyncio.get_running_loop()
    reported = 0

    def watch(error: Exception) -> None:
        nonlocal reported
        reported += 1
        if hung.done() or not isinstance(error, ssl.SSLError):
            return
        if isinstance(error, ssl.SSLCertVerificationError):
            hung.set_result(_tls_refused(servers, error))
            return
        seen = reported

        def unless_retried() -> None:
            if reported == seen and not hung.done():
                hung.set_result(_tls_refused(servers, error))

        loop.call_later(TLS_SILENCE_S, unless_retried)

    return watch


async def _connected_unless(
    connecting: asyncio.Future[None], refused: asyncio.Future[str], refusal: type[Exception]
) -> None:
    """Waits for `connecting` unless `refused` is answered first, which raises `refusal` with its message: a
    refusal nats-py would retry for ever, or a handshake it hangs after (`TLS_SILENCE_S`). A connection not made is
    given up, nothing left trying in the background."""
    try:
        await asyncio.wait({connecting, refused}, return_when=asyncio.FIRST_COMPLETED)
        if connecting.done() and connecting.exception() is None:
            return
        if refused.done():  # also when nats-py gave up on its own since: the refusal says more than "no servers"
            raise refusal(refused.result())
        connecting.result()
    finally:
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await connecting


def _tls_refused(servers: list[str], error: ssl.SSLError) -> str:
    where = f"NATS at {redacted_servers(','.join(servers))}"
    if isinstance(error, ssl.SSLCertVerificationError):
        return (f"{where} showed a TLS certificate this process does not trust ({error.verify_message}): set "
                "NATS_TLS_CA_FILE to the authority that signed it")
    if "CERTIFICATE_REQUIRED" in str(error.reason):
        return f"{where} asks for a client certificate: set NATS_TLS_CERT_FILE and NATS_TLS_KEY_FILE"
    return (f"{where}: the TLS handshake failed ({error.reason or error}); with NATS_TLS_HANDSHAKE_FIRST the servers "
            "need TLS with `handshake_first`")


class BusRefused(ConfiguredUnlike):
    """NATS refused this process as it started: its user and password, or its TLS (a server certificate it does not
    trust, or no client certificate where the server asks for one)."""


def refused_login(error: Exception) -> bool:
    # nats-py raises a plain Error with the server's message as it connects, AuthorizationError for one a live
    # connection is sent.
    return isinstance(error, nats.errors.AuthorizationError) or "authorization violation" in str(error).lower()


class _ServiceClient(NatsClient):
    """Knows whether its own code closed it. A close it did not ask for stops the service; its last error does not
    tell the two apart (it may be a refused login from an attempt that a later one got past)."""

    closed_on_purpose = False

    async def close(self) -> None:
        self.closed_on_purpose = True
        await super().close()

    async def drain(self) -> None:
        self.closed_on_purpose = True
        await super().drain()


LOGIN_REFUSED_FOR_S = 10.0
"""How long a starting service is refused its login (or its TLS handshake) before it stops: a node restarted with a
new password refuses until the service's own is renewed, and a service on one address (a Kubernetes Service) reaches
a random node."""


async def _connect_service(servers: list[str], name: str, settings: Settings | None) -> NatsClient:
    """Waits for a bus that is down, but not on a login it refuses: refused for LOGIN_REFUSED_FOR_S, and at least
    twice per server named, a wrong NATS_USER or NATS_PASSWORD stops the service at start, in one line. A node that
    refuses while others accept (a password rotated node by node) is not the end: the service connects to another.
    So does a TLS handshake refused as long (a client certificate missing), or one nats-py hangs after
    (`TLS_SILENCE_S`). Once connected, a refusal on a reconnect is waited out like an outage."""
    nc = _ServiceClient()
    loop = asyncio.get_running_loop()
    refusals = 0
    first_refusal = 0.0
    refused: asyncio.Future[str] = loop.create_future()
    watch_handshakes = _handshake_watch(refused, servers)
    connected = False

    async def on_error(error: Exception) -> None:
        nonlocal refusals, first_refusal
        if not connected:
            watch_handshakes(error)
        # Refused logins, and handshakes nats-py retries (a client certificate missing, a node restarting).
        if not connected and (refused_login(error) or isinstance(error, ssl.SSLError)):
            refusals, first_refusal = refusals + 1, first_refusal or loop.time()
            if (refusals >= 2 * len(servers) and loop.time() - first_refusal >= LOGIN_REFUSED_FOR_S
                    and not refused.done()):
                refused.set_result(
                    _tls_refused(servers, error) if isinstance(error, ssl.SSLError) else _login_refused(servers, settings)
                )
        await report_connection_error(error)

    async def on_closed() -> None:
        # Closed for good, not by this process: nats-py reconnects after an outage, but not after a server's error
        # on a live connection (its login revoked by a reload of the configuration, among others).
        if connected and not nc.closed_on_purpose:
            log.critical("the NATS connection was closed for good (%s): stopping, to be started again",
                         nc.last_error or "no error given")
            stop_this_process()

    options = {**connection_options(settings, name=name), "error_cb": on_error, "closed_cb": on_closed}
    connecting = asyncio.ensure_future(nc.connect(servers=servers, **options, **tls_options(settings), **login(settings)))
    try:
        await _connected_unless(connecting, refused, BusRefused)
        connected = True
        return nc
    finally:
        if not connected:  # refused, failed, or the caller cancelled
            await _abandon(nc)


def stop_this_process() -> None:
    """As an orchestrator stops it (SIGTERM): the service shuts down in order, and is started again."""
    os.kill(os.getpid(), signal.SIGTERM)


def _user_of(settings: Settings | None) -> str:
    return (settings.nats_user if settings else None) or "no user"


def _login_refused(servers: list[str], settings: Settings | None) -> str:
    return (
        f"NATS at {redacted_servers(','.join(servers))} refused the login ({_user_of(settings)}): set NATS_USER and NATS_PASSWORD "
        "to a user of its configuration (deploy/nats/auth.conf)"
    )


def redacted_servers(url: str) -> str:
    """The NATS servers of `url` as a log or an error may show them: no password (a Job's log is read widely).
    nats-py reads a server without a scheme as nats://, and so does this."""
    from shared.agents import redact_address

    return ",".join(redact_address(s if "://" in s else f"nats://{s}") for s in url.split(","))
