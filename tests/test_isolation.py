"""API keys and tenant isolation over REST, against the real database and bus.

Two projects, one key each. A key never reads, lists, changes or learns of anything in the other project: a
foreign id answers exactly as an absent one does (404). A key lacking a route's action gets 403, a revoked
key 401 on its very next request, and the secret is shown only by the creation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api.main import API_PREFIX, create_app
from shared import registry
from shared import repository as repo
from shared.db.models import ApiKey
from shared.ids import ENTRY_PREFIX, MEMORY_PREFIX, PROJECT_PREFIX, new_id, new_write_id
from shared.llm import LlmError, provider_key
from shared.settings import Settings


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def create_key(client: httpx.AsyncClient, project_id: str, actions: list[str]) -> dict[str, Any]:
    response = await client.post(
        "/api-keys", json={"project_id": project_id, "name": "test key", "actions": actions}
    )
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


@dataclass(frozen=True)
class Target:
    """The ids a probe aims at."""

    project_id: str
    memory_id: str
    entry_id: str
    write_id: str


@dataclass
class Tenant:
    secret: str
    target: Target


async def populate(client: httpx.AsyncClient, secret: str, tag: str) -> Target:
    """A memory and an entry written with the key alone: no project_id named anywhere."""
    memory = await client.post(
        "/memories", json={"name": "notes", "tags": [tag, "shared-tag"]}, headers=bearer(secret)
    )
    assert memory.status_code == 201, memory.text
    entry = await client.post(
        "/memory-entries",
        json={"memory_id": memory.json()["id"], "content": f"The {tag} customer prefers email"},
        headers=bearer(secret),
    )
    assert entry.status_code == 201, entry.text
    written = entry.json()
    return Target(memory.json()["project_id"], memory.json()["id"], written["id"], written["write_id"])


@pytest_asyncio.fixture(scope="module")
async def tenants(client: httpx.AsyncClient) -> tuple[Tenant, Tenant]:
    made = []
    for name, actions in (("alpha", ["memories:*", "knowledge:SearchKnowledge"]), ("beta", ["*"])):
        project = (await client.post("/projects", json={"name": name})).json()
        key = await create_key(client, project["id"], actions)
        target = await populate(client, key["key"], name)
        assert target.project_id == project["id"]
        made.append(Tenant(key["key"], target))
    return made[0], made[1]


@dataclass(frozen=True)
class Probe:
    label: str
    method: str
    url: Callable[[Target], str]
    json: Callable[[Target], dict[str, Any]] | None = None
    params: Callable[[Target], dict[str, Any]] | None = None
    succeeds_with: frozenset[int] = frozenset({200})

    async def send(self, client: httpx.AsyncClient, secret: str, target: Target) -> httpx.Response:
        return await client.request(
            self.method,
            self.url(target),
            json=self.json(target) if self.json else None,
            params=self.params(target) if self.params else None,
            headers=bearer(secret),
        )


# Ordered so that the deletions come last: the same table runs against one fresh target.
PROBES = [
    Probe("get memory", "GET", lambda t: f"/memories/{t.memory_id}"),
    Probe("list memories", "GET", lambda t: "/memories", params=lambda t: {"project_id": t.project_id}),
    Probe(
        "list memories by tag",
        "GET",
        lambda t: "/memories",
        params=lambda t: {"project_id": t.project_id, "tags": "shared-*"},
    ),
    Probe(
        "create memory",
        "POST",
        lambda t: "/memories",
        json=lambda t: {"project_id": t.project_id, "name": "planted"},
        succeeds_with=frozenset({201}),
    ),
    Probe("update memory", "PUT", lambda t: f"/memories/{t.memory_id}", json=lambda t: {"name": "renamed"}),
    Probe(
        "create entry",
        "POST",
        lambda t: "/memory-entries",
        json=lambda t: {"memory_id": t.memory_id, "content": "The planted fact is true"},
        succeeds_with=frozenset({201}),
    ),
    Probe("list entries", "GET", lambda t: "/memory-entries", params=lambda t: {"memory_id": t.memory_id}),
    Probe("get entry", "GET", lambda t: f"/memory-entries/{t.entry_id}"),
    Probe(
        "update entry", "PUT", lambda t: f"/memory-entries/{t.entry_id}", json=lambda t: {"tags": ["edited"]}
    ),
    Probe("get write", "GET", lambda t: f"/memory-writes/{t.write_id}"),
    Probe(
        "delete entry", "DELETE", lambda t: f"/memory-entries/{t.entry_id}", succeeds_with=frozenset({204})
    ),
    Probe("delete memory", "DELETE", lambda t: f"/memories/{t.memory_id}", succeeds_with=frozenset({204})),
]


def absent_target() -> Target:
    return Target(new_id(PROJECT_PREFIX), new_id(MEMORY_PREFIX), new_id(ENTRY_PREFIX), new_write_id())


def masked(error: dict[str, Any], target: Target) -> dict[str, Any]:
    message = error["message"]
    for identifier in (target.project_id, target.memory_id, target.entry_id, target.write_id):
        message = message.replace(identifier, "<id>")
    return {**error, "message": message}


async def test_a_foreign_resource_answers_exactly_like_an_absent_one(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant]
) -> None:
    alpha, beta = tenants
    urls = (f"/memories/{beta.target.memory_id}", f"/memory-entries/{beta.target.entry_id}")
    before = [(await client.get(url)).json() for url in urls]
    absent = absent_target()
    for probe in PROBES:
        foreign = await probe.send(client, alpha.secret, beta.target)
        missing = await probe.send(client, alpha.secret, absent)
        assert foreign.status_code == 404, (probe.label, foreign.text)
        assert masked(foreign.json()["error"], beta.target) == masked(missing.json()["error"], absent), (
            probe.label
        )
    assert [(await client.get(url)).json() for url in urls] == before
    entries = await client.get("/memory-entries", params={"memory_id": beta.target.memory_id})
    assert entries.json()["total"] == 1
    memories = await client.get("/memories", params={"project_id": beta.target.project_id})
    assert [m["name"] for m in memories.json()["data"]] == ["notes"]


async def test_a_foreign_memory_busy_with_a_write_is_absent_at_once_not_waited_for(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant], sessions: async_sessionmaker[AsyncSession]
) -> None:
    alpha, beta = tenants
    async with sessions.begin() as session:
        await repo.lock_memory(session, beta.target.memory_id)  # a writer deciding on it, say with a slow model
        for method, body in (("PUT", {"name": "renamed"}), ("DELETE", None)):
            # Before, each waited the write timeout for the lock (a connection held all along), then got a 503.
            answered = await asyncio.wait_for(
                client.request(method, f"/memories/{beta.target.memory_id}", json=body, headers=bearer(alpha.secret)),
                timeout=5,
            )
            assert answered.status_code == 404, answered.text


async def test_every_route_works_within_the_keys_own_project(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant]
) -> None:
    alpha, _ = tenants
    own = await populate(client, alpha.secret, "scratch")
    for probe in PROBES:
        response = await probe.send(client, alpha.secret, own)
        assert response.status_code in probe.succeeds_with, (probe.label, response.text)
    assert (await client.get(f"/memories/{own.memory_id}")).status_code == 404


async def test_listing_with_the_project_omitted_shows_only_the_keys_project(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant]
) -> None:
    alpha, _ = tenants
    for tenant in tenants:
        listing = await client.get("/memories", params={"tags": "shared-*"}, headers=bearer(tenant.secret))
        assert listing.status_code == 200
        assert {m["project_id"] for m in listing.json()["data"]} == {tenant.target.project_id}
        assert tenant.target.memory_id in {m["id"] for m in listing.json()["data"]}
    other_tag = await client.get("/memories", params={"tags": "beta"}, headers=bearer(alpha.secret))
    assert other_tag.status_code == 200 and other_tag.json()["total"] == 0
    malformed = await client.get("/memories", params={"project_id": "nope"}, headers=bearer(alpha.secret))
    assert malformed.status_code == 404


@pytest.mark.parametrize(
    ("granted", "allowed", "denied"),
    [
        (
            ["memories:GetMemory"],
            ["get memory"],
            ["list memories", "update memory", "create entry", "get entry"],
        ),
        (["memories:List*"], ["list memories", "list entries"], ["get memory", "get entry", "get write"]),
        (["memories:CreateMemoryEntry"], ["get write"], ["get entry", "list entries", "delete entry"]),
        (["memories:GetMemoryEntry"], ["get write", "get entry"], ["create entry", "update entry"]),
        (["knowledge:*"], [], [p.label for p in PROBES]),
    ],
)
async def test_a_key_without_the_routes_action_is_forbidden(
    client: httpx.AsyncClient,
    tenants: tuple[Tenant, Tenant],
    granted: list[str],
    allowed: list[str],
    denied: list[str],
) -> None:
    alpha, beta = tenants
    secret = (await create_key(client, alpha.target.project_id, granted))["key"]
    probes = {p.label: p for p in PROBES}
    for label in allowed:
        response = await probes[label].send(client, secret, alpha.target)
        assert response.status_code == 200, (label, response.text)
    for label in denied:
        for target in (alpha.target, beta.target):  # the 403 comes first, so a foreign id stays unconfirmed
            response = await probes[label].send(client, secret, target)
            assert response.status_code == 403, (label, response.text)
            assert response.json()["error"]["code"] == "FORBIDDEN"


# Static documents that tell nothing about any project: any valid credential may read them.
UNGUARDED = {("GET", f"{API_PREFIX}/tools/write_memory")}


async def test_every_api_route_checks_a_permission(
    client: httpx.AsyncClient,
    tenants: tuple[Tenant, Tenant],
    sessions: async_sessionmaker[AsyncSession],
    settings: Settings,
) -> None:
    # The API refuses an empty grant; the repository does not, which gives a key that may do nothing.
    async with sessions() as session:
        _, secret = await repo.create_api_key(
            session, project_id=tenants[0].target.project_id, name="powerless", actions=[]
        )
        await session.commit()
    # The OpenAPI document lists every route the app serves, including ones added after this test was written.
    paths = create_app(settings).openapi()["paths"]
    operations = [(method.upper(), path) for path, item in paths.items() for method in item]
    assert len(operations) >= 15
    for method, path in operations:
        if not path.startswith(API_PREFIX) or (method, path) in UNGUARDED:
            continue
        url = path.removeprefix(API_PREFIX).replace("{", "").replace("}", "")
        response = await client.request(method, url, json={}, headers=bearer(secret))
        assert response.status_code == 403, (method, path, response.text)


async def test_revoking_a_key_takes_effect_on_the_next_request(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant]
) -> None:
    alpha, _ = tenants
    key = await create_key(client, alpha.target.project_id, ["memories:GetMemory"])
    url = f"/memories/{alpha.target.memory_id}"
    assert (await client.get(url, headers=bearer(key["key"]))).status_code == 200
    assert (await client.delete(f"/api-keys/{key['id']}")).status_code == 204
    revoked = await client.get(url, headers=bearer(key["key"]))
    assert revoked.status_code == 401 and revoked.json()["error"]["code"] == "UNAUTHORIZED"
    assert (await client.delete(f"/api-keys/{key['id']}")).status_code == 404
    listed = await client.get("/api-keys", params={"project_id": alpha.target.project_id, "limit": 100})
    assert key["id"] not in {k["id"] for k in listed.json()["data"]}
    audit = await client.get(
        "/api-keys", params={"project_id": alpha.target.project_id, "include_revoked": True, "limit": 100}
    )
    [row] = [k for k in audit.json()["data"] if k["id"] == key["id"]]
    assert row["revoked_at"] is not None
    for malformed in ("key_short", new_id("key_")):
        assert (await client.delete(f"/api-keys/{malformed}")).status_code == 404


async def test_the_secret_is_shown_once_and_stored_only_as_a_hash(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant], sessions: async_sessionmaker[AsyncSession]
) -> None:
    alpha, beta = tenants
    created = await client.post(
        "/api-keys", json={"project_id": alpha.target.project_id, "actions": ["memories:*", "memories:*"]}
    )
    assert created.status_code == 201 and created.headers["cache-control"] == "no-store"
    key = created.json()
    secret = key["key"]
    assert secret.startswith("sk_") and len(secret) >= 40 and key["prefix"] == secret[:11]
    assert key["id"].startswith("key_") and len(key["id"]) == 20
    assert key["actions"] == ["memories:*"] and key["name"] is None and key["revoked_at"] is None
    listed = await client.get("/api-keys", params={"project_id": alpha.target.project_id, "limit": 100})
    assert listed.status_code == 200 and secret not in listed.text and '"key"' not in listed.text
    [row] = [k for k in listed.json()["data"] if k["id"] == key["id"]]
    assert row["prefix"] == key["prefix"] and row["project_id"] == alpha.target.project_id
    other = await client.get("/api-keys", params={"project_id": beta.target.project_id, "limit": 100})
    assert key["id"] not in {k["id"] for k in other.json()["data"]}
    async with sessions() as session:
        stored = await session.scalar(select(ApiKey).where(ApiKey.id == key["id"]))
    assert stored is not None
    columns = [getattr(stored, c.key) for c in ApiKey.__mapper__.column_attrs]
    assert not any(secret in str(value) for value in columns)


OWN = "<the test's project>"


@pytest.mark.parametrize(
    ("body", "status", "meta_key"),
    [
        ({"actions": ["memories:GetMemory"]}, 400, "missing_fields"),
        ({"project_id": OWN, "actions": ["memories:Teleport"]}, 400, "invalid_fields"),
        ({"project_id": OWN, "actions": ["memories:Tele*"]}, 400, "invalid_fields"),
        ({"project_id": OWN, "actions": ["billing:*"]}, 400, "invalid_fields"),
        ({"project_id": OWN, "actions": []}, 400, "invalid_fields"),
        ({"project_id": OWN, "actions": "memories:*"}, 400, "invalid_fields"),
        ({"project_id": OWN, "actions": ["*"], "scope": "all"}, 400, "unknown_fields"),
        ({"project_id": new_id(PROJECT_PREFIX), "actions": ["*"]}, 404, None),
        ({"project_id": "proj_bad", "actions": ["*"]}, 404, None),
        ({"project_id": OWN, "actions": ["memories:*", "knowledge:SearchKnowledge"]}, 201, None),
        ({"project_id": OWN, "name": "ci", "actions": ["*"]}, 201, None),
    ],
)
async def test_key_creation_is_validated(
    client: httpx.AsyncClient,
    project: dict[str, Any],
    body: dict[str, Any],
    status: int,
    meta_key: str | None,
) -> None:
    payload = {field: project["id"] if value == OWN else value for field, value in body.items()}
    response = await client.post("/api-keys", json=payload)
    assert response.status_code == status, response.text
    if meta_key:
        assert meta_key in response.json()["error"]["meta"]


async def test_keys_cannot_manage_projects_or_keys(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant]
) -> None:
    alpha, _ = tenants
    everything = bearer(alpha.secret)
    project_id = alpha.target.project_id
    for method, url, body in (
        ("GET", "/projects", None),
        ("POST", "/projects", {"name": "x"}),
        ("POST", "/api-keys", {"project_id": project_id, "actions": ["*"]}),
        ("GET", f"/api-keys?project_id={project_id}", None),
        ("DELETE", f"/api-keys/{new_id('key_')}", None),
    ):
        response = await client.request(method, url, json=body, headers=everything)
        assert response.status_code == 403, (method, url, response.text)


@pytest.mark.parametrize("token", ["sk_" + "x" * 40, "sk_", "key_AAAAAAAAAAAAAAAA", "test-admin-tokenx"])
async def test_unknown_tokens_are_401(client: httpx.AsyncClient, memory: dict[str, Any], token: str) -> None:
    response = await client.get(f"/memories/{memory['id']}", headers=bearer(token))
    assert response.status_code == 401, token
    assert response.headers["www-authenticate"] == 'Bearer realm="memories"'  # the scheme it takes (RFC 9110)


async def test_the_admin_token_still_reaches_every_project(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant]
) -> None:
    for tenant in tenants:
        assert (await client.get(f"/memory-entries/{tenant.target.entry_id}")).status_code == 200
        assert (await client.get(f"/memory-writes/{tenant.target.write_id}")).json()["status"] == "applied"


async def test_the_tool_definition_needs_a_credential(client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant]) -> None:
    assert (await client.get("/tools/write_memory", headers=bearer(tenants[0].secret))).status_code == 200
    for headers in ({"Authorization": ""}, bearer("bogus")):
        refused = await client.get("/tools/write_memory", headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "UNAUTHORIZED"


@pytest.mark.parametrize(
    ("agent_fields", "refused_field"),
    [
        ({"api_base": "http://127.0.0.1:9/v1"}, "agent.api_base"),
        ({"api_key_env": "OPENAI_API_KEY"}, "agent.api_key_env"),
        ({"apiBase": "http://127.0.0.1:9/v1"}, "agent.api_base"),
    ],
)
async def test_a_project_key_cannot_point_the_writer_at_an_address_or_a_secret(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant], agent_fields: dict[str, str], refused_field: str
) -> None:
    """The writer would call that address with the value of that variable from its own environment. (A camelCase
    key is the same field: it was dropped unread, which was safe but told the platform nothing.)"""
    target = tenants[0].target
    body = {"content": "Alice likes tea", "generation_id": "gen_x",
            "agent": {"model": "openai/anything", "knowledge_config": {"write_memory_id": target.memory_id},
                      **agent_fields}}
    refused = await client.post("/tools/write_memory", json=body, headers=bearer(tenants[0].secret))
    assert refused.status_code == 403, refused.text
    fields = [problem["field"] for problem in refused.json()["error"]["meta"]["invalid_fields"]]
    assert fields == [refused_field]


@pytest.mark.parametrize("variable", ["MEMORIES_ADMIN_TOKEN", "database_url", "Nats_Url", "MEMORIES_ANYTHING"])
async def test_no_provider_may_name_a_setting_of_the_service_as_its_key(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant], variable: str
) -> None:
    """Its endpoint would receive the service's admin token or database URL as a bearer key."""
    provider = {"project_id": tenants[0].target.project_id, "name": "self-hosted", "provider": "openai",
                "api_base": "http://127.0.0.1:9/v1"}
    refused = await client.post("/ai-providers", json={**provider, "api_key_env": variable})
    assert refused.status_code == 400, refused.text
    assert [p["field"] for p in refused.json()["error"]["meta"]["invalid_fields"]] == ["api_key_env"]
    tool = {"content": "Alice likes tea", "agent": {"model": "openai/anything", "api_key_env": variable,
            "knowledge_config": {"write_memory_id": tenants[0].target.memory_id}}}
    assert (await client.post("/tools/write_memory", json=tool)).status_code == 400
    assert (await client.post("/ai-providers", json={**provider, "api_key_env": "ACME_OPENAI_KEY"})).status_code == 201


def test_a_provider_stored_before_the_rule_cannot_send_a_setting_either() -> None:
    with pytest.raises(LlmError, match="names a setting of the service"):
        provider_key("MEMORIES_ADMIN_TOKEN")
    assert provider_key(None) is None


@pytest.mark.parametrize(
    "api_base",
    ["https://user:secret@llm.example/v1", "https://llm.example/v1?api_key=sk-live", "https://llm.example/v1?KEY=x",
     "https://llm.example/v1?api_key",  # a key with no value was not seen as one, and shown without it
     # Not an address litellm calls over HTTP, or one shown otherwise than stored (the line break dropped).
     "file:///etc/passwd", "not a url", "http://llm.example/\r\nHost: elsewhere"],
)
async def test_a_provider_address_may_not_carry_a_key(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant], api_base: str
) -> None:
    # Shown to whoever reads the registry; the key's place is the variable api_key_env names.
    provider = {"project_id": tenants[0].target.project_id, "name": "with a key", "provider": "openai"}
    refused = await client.post("/ai-providers", json={**provider, "api_base": api_base})
    assert refused.status_code == 400 and [p["field"] for p in refused.json()["error"]["meta"]["invalid_fields"]] == ["api_base"]
    assert "secret" not in refused.text and "sk-live" not in refused.text
    kept = await client.post("/ai-providers", json={**provider, "api_base": "https://llm.example/v1?api-version=2024-06-01"})
    assert kept.status_code == 201
    tool = {"content": "Alice likes tea", "agent": {"model": "openai/anything", "api_base": api_base,
            "knowledge_config": {"write_memory_id": tenants[0].target.memory_id}}}
    assert (await client.post("/tools/write_memory", json=tool)).status_code == 400  # the admin's own, too


async def test_a_provider_stored_with_a_key_in_its_address_is_shown_without_it(
    client: httpx.AsyncClient, tenants: tuple[Tenant, Tenant], sessions: async_sessionmaker[AsyncSession]
) -> None:
    project_id = tenants[0].target.project_id
    async with sessions.begin() as session:  # stored before such addresses were refused
        await registry.create_provider(session, project_id, name="old", provider="openai", api_key_env=None,
                                       default_model=None, api_base="https://user:pw@llm.example:8443/v1?key=sk-live&v=2")
    listed = (await client.get("/ai-providers", params={"project_id": project_id})).json()["data"]
    [shown] = [p["api_base"] for p in listed if p["name"] == "old"]
    assert shown == "https://***@llm.example:8443/v1?key=***&v=2"
