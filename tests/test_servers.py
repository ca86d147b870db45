"""The embedded servers start, serve, stop and restart on the same data dir with their data intact; connections
to them give up on a server that hangs."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
import nats.js.errors
import psutil
import pytest
from nats.js.api import StorageType

from shared import bus_connection, servers
from shared.db.session import create_engine
from shared.servers import EmbeddedNats, EmbeddedPostgres, ServerStartError, start_nats_cluster
from shared.settings import Settings

real_free_port = servers.free_port


def test_postgres_restart_keeps_data_and_pgvector_works(tmp_path: Path) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg")
    try:
        url = pg.start()
        assert url == f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/memories"
        assert pg.pid is not None
        with pg.connect() as conn:
            distance = conn.execute("SELECT '[1,2,3]'::vector <=> '[1,2,4]'::vector").fetchone()
            assert distance is not None and 0 < float(distance[0]) < 0.01
            conn.execute("CREATE TABLE kept (id int PRIMARY KEY, v vector(3))")
            conn.execute("INSERT INTO kept VALUES (1, '[1,2,3]')")

        pg.stop()
        assert pg.pid is None
        assert pg.start() == url  # same port again, so clients can reconnect
        with pg.connect() as conn:
            assert conn.execute("SELECT v::text FROM kept WHERE id = 1").fetchone() == ("[1,2,3]",)

        pg.kill()  # a crash: postmaster.pid stays behind
        assert (pg.data_dir / "postmaster.pid").exists()
        pg.start()
        with pg.connect() as conn:
            assert conn.execute("SELECT count(*) FROM kept").fetchone() == (1,)
    finally:
        pg.stop()


def test_postgres_start_failure_shows_log(tmp_path: Path) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg", extra_args=["-c", "no_such_setting=1"])
    with pytest.raises(ServerStartError, match="no_such_setting"):
        pg.start(timeout=20)
    assert pg.pid is None


ORPHAN_MAKER = """
import os, sys
from pathlib import Path
from shared.servers import EmbeddedNats, EmbeddedPostgres
pg, ns = EmbeddedPostgres(Path(sys.argv[1]) / "pg"), EmbeddedNats(Path(sys.argv[1]) / "nats")
pg.start(); ns.start()
print(pg.pid, ns.pid, flush=True)
os._exit(0)  # a crash: nobody stops the servers
"""


def test_servers_left_by_a_dead_parent_are_stopped_on_next_start(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", ORPHAN_MAKER, str(tmp_path)], cwd=root, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    orphans = [psutil.Process(int(pid)) for pid in out.split()]
    pg, ns = EmbeddedPostgres(tmp_path / "pg"), EmbeddedNats(tmp_path / "nats")
    try:
        pg.start()
        ns.start()
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in orphans)
    finally:
        pg.stop()
        ns.stop()
        for p in orphans:  # only if the test failed before they were stopped
            if p.is_running():
                p.kill()


def test_server_of_a_live_launcher_is_not_taken_over(tmp_path: Path) -> None:
    first = EmbeddedPostgres(tmp_path / "pg")
    first.start()
    proc = first._proc
    assert proc is not None
    first._reset()  # forget the child (private API, test only); this process, its launcher, still lives
    try:
        with pytest.raises(ServerStartError, match="of live launcher"):
            EmbeddedPostgres(tmp_path / "pg").start()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


async def test_nats_restart_keeps_stream(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    try:
        url = server.start()
        assert url == f"nats://127.0.0.1:{server.port}"
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name="KEPT", subjects=["kept.>"], storage=StorageType.FILE)
        ack = await js.publish("kept.one", b"hello")
        assert ack.seq == 1
        await nc.close()

        server.stop()
        assert server.start() == url
        nc = await nats.connect(url)
        msg = await nc.jetstream().get_msg("KEPT", 1)
        assert (msg.subject, msg.data) == ("kept.one", b"hello")
        await nc.close()

        server.kill()  # a crash: the acknowledged message survives it too
        server.start()
        nc = await nats.connect(url)
        assert (await nc.jetstream().stream_info("KEPT")).state.messages == 1
        await nc.close()
    finally:
        server.stop()


@pytest.mark.slow
async def test_nats_cluster_replicates(tmp_path: Path) -> None:
    nodes = start_nats_cluster(tmp_path / "cluster", size=3)
    try:
        nc = await nats.connect(servers=[n.url for n in nodes])
        js = nc.jetstream()
        # Serving JetStream is not yet placing replicas: until every peer has reported in, the meta leader
        # answers "no suitable peers for placement", as services see it at start (bus.ensure_layout retries).
        for attempt in range(40):
            try:
                await js.add_stream(name="R3", subjects=["r3.>"], storage=StorageType.FILE, num_replicas=3)
                break
            except nats.js.errors.BadRequestError:
                if attempt == 39:
                    raise
                await asyncio.sleep(0.25)
        await js.publish("r3.x", b"x")
        info = await js.stream_info("R3")
        assert info.config.num_replicas == 3 and info.state.messages == 1
        await nc.close()
    finally:
        for node in nodes:
            node.stop()


def test_a_port_taken_meanwhile_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))  # bound, not listening: a connect is refused, not left hanging
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        monkeypatch.setattr(servers, "free_port", lambda: next(picks, None) or real_free_port())
        with EmbeddedNats(tmp_path / "nats") as server:
            assert server.port not in (None, taken)
            assert "address already in use" in (tmp_path / "nats" / "nats-server.log").read_text().lower()
        with pytest.raises(ServerStartError, match="(?i)address already in use"):  # a fixed port is kept
            EmbeddedNats(tmp_path / "nats2", port=taken).start()


async def test_database_connections_give_up_on_a_vanished_server(settings: Settings) -> None:
    """libpq bounds a wait on a host that vanished without closing the connection (TCP keepalives and the user
    timeout; the kernel's defaults wait about two hours). A setting the URL makes itself is kept."""
    assert settings.database_url

    async def parameters(url: str) -> dict[str, str]:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.connect() as connection:
                raw = await connection.get_raw_connection()
                return dict(raw.driver_connection.info.get_parameters())  # type: ignore[union-attr]
        finally:
            await engine.dispose()

    chosen = await parameters(settings.database_url)
    assert {name: chosen.get(name) for name in ("keepalives", "keepalives_idle", "keepalives_count",
                                                "tcp_user_timeout", "connect_timeout")} == {
        "keepalives": "1", "keepalives_idle": "15", "keepalives_count": "6", "tcp_user_timeout": "45000",
        "connect_timeout": "5",
    }
    separator = "&" if "?" in settings.database_url else "?"
    operators = await parameters(f"{settings.database_url}{separator}keepalives_idle=120")
    assert (operators["keepalives_idle"], operators["keepalives_interval"]) == ("120", "5")


async def test_a_failed_statements_error_does_not_carry_its_parameters(settings: Settings) -> None:
    # Logged with its trace, it listed them: tenants' facts, a turn's extracted facts.
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    assert settings.database_url
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        async with engine.connect() as connection:
            with pytest.raises(DBAPIError) as failed:
                await connection.execute(text("SELECT 1 / :zero, :fact"), {"zero": 0, "fact": "Alice is pregnant"})
    finally:
        await engine.dispose()
    assert "division by zero" in str(failed.value) and "Alice is pregnant" not in str(failed.value)


async def test_a_service_refuses_an_embedding_dimension_unlike_the_stored_vectors(settings: Settings) -> None:
    # A wrong EMBEDDING_DIMENSIONS failed every write (each dead-lettered), with every service reporting ready.
    from pydantic import ValidationError

    from shared.db.session import DimensionMismatch, check_embedding_dimensions

    assert settings.database_url
    with pytest.raises(ValidationError, match="makes vectors of 384 dimensions"):  # before any migration makes it so
        Settings(embedding_dimensions=12)
    engine = create_engine(settings.database_url, pool_size=1)
    unreachable = create_engine("postgresql+psycopg://nobody@127.0.0.1:1/none", pool_size=1)
    try:
        await check_embedding_dimensions(engine, 384)
        with pytest.raises(DimensionMismatch, match="stores vectors of 384 dimensions"):
            await check_embedding_dimensions(engine, 1536)
        await check_embedding_dimensions(unreachable, 1536)  # not checked now: the service waits for its database
    finally:
        await engine.dispose()
        await unreachable.dispose()


async def test_a_nats_outage_is_logged_a_line_at_a_time_not_as_tracebacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-py's default error callback logged each failed reconnect at ERROR with a traceback (7 in 10 s of an
    outage the service waits out)."""

    server = EmbeddedNats(tmp_path / "nats")
    try:
        nc = await bus_connection.connect(server.start(), name="outage-test")
        server.stop()
        with caplog.at_level(logging.WARNING):
            for _ in range(100):
                if any(r.getMessage().startswith("NATS connection:") for r in caplog.records):
                    break
                await asyncio.sleep(0.05)
        reports = [r for r in caplog.records if r.getMessage().startswith("NATS connection:")]
        assert reports and all(r.exc_info is None and r.levelno == logging.WARNING for r in reports)
        assert not [r for r in caplog.records if r.name.startswith("nats") and r.exc_info], caplog.text
        await nc.close()
    finally:
        server.stop()


async def test_a_fault_nats_reports_is_not_taken_for_an_outage(caplog: pytest.LogCaptureFixture) -> None:
    """The same callback gets the errors raised in subscription callbacks: those are bugs, logged with their trace."""

    with caplog.at_level(logging.WARNING):
        await bus_connection.report_connection_error(TimeoutError())
        try:
            raise KeyError("write_id")
        except KeyError as exc:
            await bus_connection.report_connection_error(exc)
    outage, fault = caplog.records[-2:]
    assert (outage.levelno, outage.exc_info) == (logging.WARNING, None)
    assert fault.levelno == logging.ERROR and fault.exc_info is not None and "write_id" in fault.getMessage()
