"""The bus as deployed: a NATS server that asks every client for a login, with the users and permissions of
deploy/nats/auth.conf (rendered from shared/bus_permissions.py). Every service runs under its own user through
the paths that touch the bus, and the server must log no permission violation meanwhile."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nats
import nats.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig

from services.extractor.main import ExtractorService
from services.writer.main import Writer
from shared import bus, bus_connection, bus_permissions, dead_letters
from shared.events import ConversationDeleted
from shared.scripted_llm import ScriptedLLM
from shared.servers import EmbeddedNats
from shared.settings import Settings
from tests.conftest import make_settings, open_api

ROLES = {user.role: user for user in bus_permissions.USERS}


@dataclass
class SecuredBus:
    url: str
    passwords: dict[str, str]
    server: EmbeddedNats

    def settings(self, database_url: str, role: str) -> Settings:
        return make_settings(
            (database_url, self.url), nats_user=ROLES[role].user, nats_password=self.passwords[role]
        )

    async def connect(self, role: str, name: str) -> NatsClient:
        user = ROLES[role].user
        return await nats.connect(self.url, user=user, password=self.passwords[role], name=name,
                                  inbox_prefix=bus_connection.inbox_prefix(user), max_reconnect_attempts=1)

    def log_size(self) -> int:
        return self.server.log_path.stat().st_size

    def violations(self, since: int = 0) -> list[str]:
        """What the server refused (it logs each refusal), from byte `since` of its log on."""
        with open(self.server.log_path, "rb") as log:
            log.seek(since)
            return [line for line in log.read().decode().splitlines() if "Violation" in line]


@pytest.fixture(scope="module")
def secured_bus() -> Iterator[SecuredBus]:
    root = Path(tempfile.mkdtemp(prefix="memories-auth-"))
    passwords = {role: secrets.token_hex(16) for role in ROLES}
    shutil.copy(bus_permissions.SERVER_CONFIG, root / "auth.conf")  # an include is read relative to its file
    (root / "server.conf").write_text("include ./auth.conf\n")
    server = EmbeddedNats(root / "nats", extra_args=["-c", str(root / "server.conf")],
                          login=(ROLES["admin"].user, passwords["admin"]))
    # The server reads each password from its environment, as in deploy/ (a Secret's keys, or compose's .env).
    with pytest.MonkeyPatch.context() as patch:
        for role, password in passwords.items():
            patch.setenv(ROLES[role].password_variable, password)
        url = server.start()
    try:
        yield SecuredBus(url, passwords, server)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest_asyncio.fixture(scope="module")
async def services(
    secured_bus: SecuredBus, server_urls: tuple[str, str]
) -> AsyncIterator[tuple[httpx.AsyncClient, SecuredBus, int]]:
    """The API, a writer and an extractor, each under its own user; and where the server's log stood before they
    started (their start applies the layout and subscribes)."""
    log_mark = secured_bus.log_size()
    database_url = server_urls[0]
    writer = Writer(secured_bus.settings(database_url, "writer"))
    extractor = ExtractorService(secured_bus.settings(database_url, "extractor"), concurrency=2)
    await writer.start()
    await extractor.start()
    try:
        async with open_api(secured_bus.settings(database_url, "api")) as (_app, client):
            yield client, secured_bus, log_mark
    finally:
        await extractor.stop()
        await writer.stop()


def admin_cli(secured: SecuredBus, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NATS_URL": secured.url, "NATS_USER": ROLES["admin"].user,
           "NATS_PASSWORD": secured.passwords["admin"]}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


async def eventually(check: Any, what: str, timeout: float = 15) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (result := await check()):
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.1)
    return result


async def test_every_service_does_its_work_under_its_own_user(
    services: tuple[httpx.AsyncClient, SecuredBus, int], llm: ScriptedLLM
) -> None:
    client, secured, log_mark = services
    project = (await client.post("/projects", json={"name": "secured bus"})).json()
    memory = (await client.post("/memories", json={"project_id": project["id"], "name": "prefs"})).json()

    # A REST write: the API publishes it, a writer decides it and answers on the API's inbox.
    written = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "The user likes tea"})
    assert written.status_code == 201 and written.json()["action"] == "created", written.text
    entry = written.json()

    # An edit: the change feed, from the API.
    edited = await client.put(f"/memory-entries/{entry['id']}", json={"tags": ["drinks"]})
    assert edited.status_code == 200, edited.text

    # A turn reported through the API, extracted, its fact written by the extractor, its outcome announced.
    model = llm.script("secured-extract", json.dumps(["The user lives in Lisbon"]))
    turn = {
        "project_id": project["id"], "generation_id": "gen_secured", "conversation_id": "conv_secured",
        "agent": {"id": "agent_1", "model": model,
                  "knowledge_config": {"write_memory_id": memory["id"], "extraction": True}},
        "messages": [{"role": "user", "content": "I live in Lisbon now."}], "output": "Noted.",
    }
    assert (await client.post("/generations/completed", json=turn)).status_code == 202

    async def extracted() -> dict[str, Any] | None:
        response = await client.get("/generations/gen_secured/extraction", params={"project_id": project["id"]})
        return response.json() if response.status_code == 200 and response.json()["status"] != "pending" else None

    assert (await eventually(extracted, "the turn was never extracted"))["status"] == "completed"

    # A platform reports a deletion on the bus directly; the writer applies it.
    platform = await secured.connect("platform", "test-platform")
    try:
        deletion = ConversationDeleted(event_id="evt_secured_forget", project_id=project["id"], conversation_id="conv_secured")
        await platform.jetstream().publish(
            bus.conversation_deleted_subject(project["id"]), deletion.model_dump_json().encode()
        )
    finally:
        await platform.close()

    async def forgotten() -> bool:
        listed = (await client.get("/memory-entries", params={"memory_id": memory["id"]})).json()["data"]
        lisbon = [e for e in listed if e["content"] == "The user lives in Lisbon"]
        return bool(lisbon) and lisbon[0]["source_conversation_id"] is None

    await eventually(forgotten, "the conversation's deletion was never applied")

    # An API key revoked: the broadcast to every API process, and their answers.
    key = (await client.post("/api-keys", json={"project_id": project["id"], "name": "k", "actions": ["memories:*"]})).json()
    assert (await client.delete(f"/api-keys/{key['id']}")).status_code == 204

    # A write no writer can read is dead-lettered by the writer, and the admin lists it.
    admin = await secured.connect("admin", "test-admin")
    try:
        await admin.jetstream().publish(bus.write_subject(memory["id"], 4), b"{not json", stream=bus.WRITES_STREAM)
        js = admin.jetstream()
        await eventually(lambda: dead_letters.list_dead_letters(js), "the unreadable write was never dead-lettered")
    finally:
        await admin.close()
    listed = admin_cli(secured, "dlq", "list", "--json")
    assert listed.returncode == 0 and "writer" in listed.stdout, listed.stderr
    assert secured.violations(since=log_mark) == []


async def test_no_client_gets_in_without_its_password(secured_bus: SecuredBus, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(nats.errors.NoServersError):
        await nats.connect(secured_bus.url, max_reconnect_attempts=1, connect_timeout=2)
    wrong = make_settings(("unused", secured_bus.url), nats_user=ROLES["writer"].user, nats_password="not-it")
    with pytest.raises(bus_connection.BusUnreachable, match="refused the login \\(memories-writer\\)"):
        await bus_connection.connect(secured_bus.url, name="test-wrong", one_shot=True, settings=wrong)
    # A service waits for a bus that is down, not for one that refuses its login: it stops, saying what to set.
    # Not at the first refusal (a node restarted with a new password refuses until the service's is renewed).
    monkeypatch.setattr(bus_connection, "LOGIN_REFUSED_FOR_S", 2.0)
    started = time.monotonic()
    with pytest.raises(bus_connection.BusRefused, match="refused the login \\(memories-writer\\): set NATS_USER"):
        await asyncio.wait_for(bus_connection.connect(secured_bus.url, name="test-wrong-service", settings=wrong), 15)
    assert time.monotonic() - started >= 2.0


async def test_one_node_refusing_a_login_others_take_does_not_stop_a_service(
    secured_bus: SecuredBus, server_urls: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As while a password is rotated node by node: the service connects to a node that takes its login.
    options = bus_connection.connection_options
    monkeypatch.setattr(bus_connection, "connection_options",  # the refusing node first, not in a random order
                        lambda *args, **kwargs: {**options(*args, **kwargs), "dont_randomize": True})
    stopped: list[bool] = []
    monkeypatch.setattr(bus_connection, "stop_this_process", lambda: stopped.append(True))
    settings = make_settings(server_urls, nats_user=ROLES["writer"].user, nats_password="the-old-one")
    nc = await asyncio.wait_for(
        bus_connection.connect(f"{secured_bus.url},{server_urls[1]}", name="test-rotation", settings=settings), 20
    )
    try:
        assert nc.is_connected and nc.connected_url is not None
        assert nc.connected_url.port == int(server_urls[1].rsplit(":", 1)[1])
        assert nc.last_error is not None and bus_connection.refused_login(nc.last_error)
    finally:
        await nc.close()
    # Its last error is the refusal it got past; closed by its own code, it is not taken for a login revoked.
    assert stopped == []


async def test_a_service_user_cannot_erase_the_queues_nor_publish_outside_its_subjects(
    secured_bus: SecuredBus, server_urls: tuple[str, str]
) -> None:
    log_mark = secured_bus.log_size()
    admin = await secured_bus.connect("admin", "test-admin")
    await bus.ensure_layout(admin.jetstream(), secured_bus.settings(server_urls[0], "admin"), bus.Role.ADMIN)
    kept = await admin.jetstream().publish(bus.dead_letter_subject("test"), b"{}", stream=bus.DEAD_LETTER_STREAM)
    before = (await admin.jetstream().stream_info(bus.DEAD_LETTER_STREAM)).state.messages
    extractor = await secured_bus.connect("extractor", "test-extractor")
    platform = await secured_bus.connect("platform", "test-platform")
    try:
        js = extractor.jetstream(timeout=1)
        shrunk = (await admin.jetstream().stream_info(bus.DEAD_LETTER_STREAM)).config
        shrunk.max_msgs = 1
        for erase in (
            js.purge_stream(bus.DEAD_LETTER_STREAM),
            js.delete_msg(bus.DEAD_LETTER_STREAM, kept.seq),
            js.delete_stream(bus.GENERATIONS_STREAM),
            js.update_stream(shrunk),
        ):
            with pytest.raises(nats.errors.TimeoutError):  # the server drops the request, and says so in its log
                await erase
        # Nor may it acknowledge (and so remove from the work queue) what the writers consume, pull from a writer's
        # consumer, or read a stream through a consumer of its own.
        await extractor.publish(f"$JS.ACK.{bus.WRITES_STREAM}.writer-p0.1.1.1.0.0", b"+ACK")
        await extractor.publish(f"$JS.API.CONSUMER.MSG.NEXT.{bus.WRITES_STREAM}.writer-p0", b'{"batch": 1}')
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_consumer(bus.EVENTS_STREAM, ConsumerConfig(name="reader", durable_name="reader"))
        with pytest.raises(nats.errors.TimeoutError):
            await platform.jetstream(timeout=1).publish(bus.write_subject("mem_elsewhere", 4), b"{}")
        # No user reads another's inboxes: where the messages a consumer pulls, and the writes' outcomes, arrive.
        await platform.subscribe("_INBOX.>")
        await platform.flush()
        assert (await admin.jetstream().stream_info(bus.DEAD_LETTER_STREAM)).state.messages == before
        assert (await admin.jetstream().stream_info(bus.GENERATIONS_STREAM)).config.name == bus.GENERATIONS_STREAM
    finally:
        for client in (extractor, platform):
            await client.close()
        await admin.jetstream().delete_msg(bus.DEAD_LETTER_STREAM, kept.seq)
        await admin.close()
    refused = secured_bus.violations(since=log_mark)
    for user, subject in [
        ("memories-extractor", "$JS.API.STREAM.PURGE.DEAD_LETTERS"),
        ("memories-extractor", "$JS.API.STREAM.MSG.DELETE.DEAD_LETTERS"),
        ("memories-extractor", "$JS.API.STREAM.DELETE.GENERATIONS"),
        ("memories-extractor", "$JS.API.STREAM.UPDATE.DEAD_LETTERS"),
        ("memories-extractor", f"$JS.ACK.{bus.WRITES_STREAM}.writer-p0"),
        ("memories-extractor", f"$JS.API.CONSUMER.MSG.NEXT.{bus.WRITES_STREAM}.writer-p0"),
        ("memories-extractor", f"$JS.API.CONSUMER.CREATE.{bus.EVENTS_STREAM}.reader"),
        ("memories-platform", "memories.write."),
        ("memories-platform", "Subscription Violation - Subject \"_INBOX.>\""),
    ]:
        assert any(user in line and subject in line for line in refused), (user, subject, refused)


async def test_a_service_whose_login_is_revoked_while_it_runs_stops_to_be_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nats-py reconnects after an outage, not after this: it closed for good, and the service ran on without its bus.
    config = tmp_path / "server.conf"
    config.write_text('authorization { users: [ {user: "memories-writer", password: "before"} ] }\n')
    server = EmbeddedNats(tmp_path / "nats", extra_args=["-c", str(config)], login=("memories-writer", "before"))
    url = server.start()
    stopped = asyncio.Event()
    monkeypatch.setattr(bus_connection, "stop_this_process", stopped.set)
    try:
        settings = make_settings(("unused", url), nats_user="memories-writer", nats_password="before")
        nc = await bus_connection.connect(url, name="test-revoked", settings=settings)
        config.write_text('authorization { users: [ {user: "memories-writer", password: "after"} ] }\n')
        assert server.pid is not None
        os.kill(server.pid, signal.SIGHUP)  # the configuration reloaded, as the Helm chart's reloader does
        await asyncio.wait_for(stopped.wait(), 10)
        assert nc.is_closed
    finally:
        server.stop()


def test_a_service_whose_consumers_connection_is_closed_for_good_exits_at_once(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FastStream's pull loop fetches again at once when a fetch fails on a closed connection, without yielding to
    the event loop: the process spun at full CPU and never handled SIGTERM (seen with a login revoked)."""
    from shared import consumer_process

    exits: list[bool] = []
    monkeypatch.setattr(consumer_process, "exit_at_once", lambda: exits.append(True))
    writer = Writer(settings)
    assert writer.broker._connection_kwargs["closed_cb"] == writer._consumers_closed  # what FastStream's client calls
    asyncio.run(writer._consumers_closed())
    assert exits == [True]
    writer._stopping = True  # closed by its own stop: nothing to say
    asyncio.run(writer._consumers_closed())
    assert exits == [True]
