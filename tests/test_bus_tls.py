"""The bus over TLS: a NATS server that requires it and verifies its clients' certificates, reached by the API, a
writer (FastStream's consumers included) and a one-shot command with the authority and certificate the settings
name (NATS_TLS_*)."""

from __future__ import annotations

import asyncio
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
    with open(root / "nats.log", "wb") as log:
        server = subprocess.Popen(
            [str(nats_server_binary()), "-js", "-sd", str(root / "store"), "-a", LOOPBACK, "-p", str(port),
             "--tlsverify", "--tlscert", str(files["server"]), "--tlskey", str(files["server"]),
             "--tlscacert", str(files["ca"])],
            stdout=subprocess.DEVNULL, stderr=log,
        )
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
    writer = Writer(tls_bus.settings(server_urls[0]))
    await asyncio.wait_for(writer.start(), 60)  # FastStream's consumers connect on their own, and would hang on TLS
    try:
        yield writer
    finally:
        await writer.stop()


async def test_a_write_crosses_a_bus_that_asks_for_tls_and_a_client_certificate(
    tls_bus: TlsBus, writer: Writer, server_urls: tuple[str, str]
) -> None:
    async with open_api(tls_bus.settings(server_urls[0])) as (_app, client):
        project = (await client.post("/projects", json={"name": "tls"})).json()
        memory = (await client.post("/memories", json={"project_id": project["id"], "name": "prefs"})).json()
        written = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "The user likes tea"})
        assert written.status_code == 201 and written.json()["action"] == "created", written.text


async def test_without_the_authority_or_the_certificate_a_process_stops_saying_which(
    tls_bus: TlsBus, server_urls: tuple[str, str]
) -> None:
    # nats-py hung for ever after a server certificate it could not verify, a command and a starting service alike.
    untrusting = tls_bus.settings(server_urls[0], nats_tls_ca_file=None)
    uncertified = tls_bus.settings(server_urls[0], nats_tls_cert_file=None, nats_tls_key_file=None)
    for settings, said in ((untrusting, "does not trust .*set NATS_TLS_CA_FILE"),
                           (uncertified, "refused the TLS handshake .*set NATS_TLS_CERT_FILE")):
        with pytest.raises(bus_connection.BusUnreachable, match=said):
            await asyncio.wait_for(
                bus_connection.connect(tls_bus.url, name="test-tls", one_shot=True, settings=settings), 20
            )
        with pytest.raises(bus_connection.BusRefused, match=said):
            await asyncio.wait_for(bus_connection.connect(tls_bus.url, name="test-tls-service", settings=settings), 20)


def test_a_client_certificate_needs_its_key_and_the_files_must_exist(tmp_path: Path) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("not read here")
    with pytest.raises(ValidationError, match="set together"):
        Settings(nats_tls_cert_file=cert)
    with pytest.raises(ValidationError, match="nats_tls_ca_file"):
        Settings(nats_tls_ca_file=tmp_path / "missing.pem")
