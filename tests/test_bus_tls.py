"""The bus over TLS: a NATS server that requires it and verifies its clients' certificates, reached by the API, a
writer (FastStream's consumers included) and a one-shot command with the authority and certificate the settings
name (NATS_TLS_*)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import trustme
from pydantic import ValidationError

from services.writer.main import Writer
from shared import bus_connection
from shared.servers import LOOPBACK, free_port, nats_server_binary
from shared.settings import Settings
from tests.conftest import make_settings, open_api


@dataclass
class TlsBus:
    url: str
    files: dict[str, Path]  # ca, cert, key: what a client is given

    def settings(self, database_url: str, **overrides: object) -> Settings:
        values = {"nats_tls_ca_file": self.files["ca"], "nats_tls_cert_file": self.files["cert"],
                  "nats_tls_key_file": self.files["key"], **overrides}
        return make_settings((database_url, self.url), **values)


@pytest.fixture(scope="module")
def tls_bus() -> Iterator[TlsBus]:
    root = Path(tempfile.mkdtemp(prefix="memories-tls-"))
    authority = trustme.CA()
    server_cert = authority.issue_cert(LOOPBACK, "localhost")
    client_cert = authority.issue_cert("memories-writer")
    files = {"ca": root / "ca.pem", "server": root / "server.pem", "cert": root / "client.pem", "key": root / "client.key"}
    authority.cert_pem.write_to_path(files["ca"])
    server_cert.private_key_and_cert_chain_pem.write_to_path(files["server"])
    client_cert.cert_chain_pems[0].write_to_path(files["cert"])
    client_cert.private_key_pem.write_to_path(files["key"])
    port = free_port()
    # Clients that start TLS at once (NATS_TLS_HANDSHAKE_FIRST) and, after 300 ms without, those that wait for INFO.
    (root / "server.conf").write_text(json.dumps({
        "listen": f"{LOOPBACK}:{port}",
        "jetstream": {"store_dir": str(root / "store")},
        "tls": {"cert_file": str(files["server"]), "key_file": str(files["server"]), "ca_file": str(files["ca"]),
                "verify": True, "handshake_first": "300ms"},
    }))  # JSON is NATS configuration too
    with open(root / "nats.log", "wb") as log:
        server = subprocess.Popen([str(nats_server_binary()), "-c", str(root / "server.conf")],
                                  stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not _accepts(port):
            assert server.poll() is None and time.monotonic() < deadline, (root / "nats.log").read_text()
            time.sleep(0.1)
        yield TlsBus(f"nats://{LOOPBACK}:{port}", {name: files[name] for name in ("ca", "cert", "key")})
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1):
            return True
    except OSError:
        return False


@pytest_asyncio.fixture
async def writer(tls_bus: TlsBus, server_urls: tuple[str, str]) -> AsyncIterator[Writer]:
    writer = Writer(tls_bus.settings(server_urls[0], nats_tls_handshake_first=True))
    await asyncio.wait_for(writer.start(), 60)  # FastStream's consumers connect on their own, and would hang on TLS
    try:
        yield writer
    finally:
        await writer.stop()


async def test_a_write_crosses_a_bus_that_asks_for_tls_and_a_client_certificate(
    tls_bus: TlsBus, writer: Writer, server_urls: tuple[str, str]
) -> None:
    async with open_api(tls_bus.settings(server_urls[0], nats_tls_handshake_first=True)) as (_app, client):
        project = (await client.post("/projects", json={"name": "tls"})).json()
        memory = (await client.post("/memories", json={"project_id": project["id"], "name": "prefs"})).json()
        written = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "The user likes tea"})
        assert written.status_code == 201 and written.json()["action"] == "created", written.text


async def test_a_client_that_waits_for_the_servers_first_message_gets_tls_too(
    tls_bus: TlsBus, server_urls: tuple[str, str]
) -> None:
    nc = await bus_connection.connect(tls_bus.url, name="test-tls", one_shot=True, settings=tls_bus.settings(server_urls[0]))
    try:
        assert nc.is_connected and (await nc.jetstream().account_info()).streams >= 0
    finally:
        await nc.close()


async def test_a_handshake_that_fails_stops_a_process_saying_what_to_set(
    tls_bus: TlsBus, server_urls: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bus_connection, "LOGIN_REFUSED_FOR_S", 1.0)
    untrusting = tls_bus.settings(server_urls[0], nats_tls_ca_file=None)
    uncertified = tls_bus.settings(server_urls[0], nats_tls_cert_file=None, nats_tls_key_file=None)
    # A server without TLS is refused by a client that starts with it: it would have read the login in clear.
    plain_server = make_settings(server_urls, nats_tls_handshake_first=True)
    for settings, url, said in (
        (untrusting, tls_bus.url, "does not trust .*set NATS_TLS_CA_FILE"),  # nats-py alone hung for ever
        (uncertified, tls_bus.url, "asks for a client certificate: set NATS_TLS_CERT_FILE"),
        (plain_server, server_urls[1], "TLS handshake failed .*need TLS with `handshake_first`"),
    ):
        with pytest.raises(bus_connection.BusUnreachable, match=said):
            await asyncio.wait_for(bus_connection.connect(url, name="test-tls", one_shot=True, settings=settings), 20)
        with pytest.raises(bus_connection.BusRefused, match=said):
            await asyncio.wait_for(bus_connection.connect(url, name="test-tls-service", settings=settings), 20)


def test_the_tls_settings_are_checked_as_the_process_starts(tmp_path: Path) -> None:
    # Else a process started, then failed with a traceback as it first connected.
    not_pem = tmp_path / "client.pem"
    not_pem.write_text("not a certificate")
    for values, field, said in (
        ({"nats_tls_cert_file": not_pem}, "nats_tls_key_file", "must be set together"),
        ({"nats_tls_cert_file": not_pem, "nats_tls_key_file": not_pem}, "nats_tls_key_file", "not a certificate and its key"),
        ({"nats_tls_ca_file": not_pem}, "nats_tls_ca_file", "no PEM certificate"),
        ({"nats_tls_ca_file": tmp_path / "missing.pem"}, "nats_tls_ca_file", "does not point to a file"),
    ):
        with pytest.raises(ValidationError, match=said) as refused:
            Settings(**values)
        assert refused.value.errors()[0]["loc"] == (field,)
