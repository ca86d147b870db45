"""Knowledge search over REST against the real database: which entries, how they are ranked, and whose."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared.settings import Settings
from tests.conftest import connections_held_while_embedding, make_settings, open_api, open_client

RESULT_FIELDS = {
    "source_type",
    "entry_id",
    "memory_id",
    "memory_name",
    "content",
    "tags",
    "score",
    "similarity_score",
    "created_at",
    "updated_at",
}


async def new_memory(client: httpx.AsyncClient, project_id: str, name: str, tags: list[str] | None) -> str:
    response = await client.post("/memories", json={"project_id": project_id, "name": name, "tags": tags})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def write(client: httpx.AsyncClient, memory_id: str, content: str, **fields: Any) -> str:
    response = await client.post(
        "/memory-entries", json={"memory_id": memory_id, "content": content, **fields}
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


async def search(client: httpx.AsyncClient, project_id: str, **body: Any) -> list[dict[str, Any]]:
    response = await client.post("/knowledge/search", json={"project_id": project_id, **body})
    assert response.status_code == 200, response.text
    return list(response.json()["results"])


FACTS = (
    "Customer prefers email over phone calls",
    "The office moved to Berlin in March",
    "Invoices are sent on the first business day of each month",
    "The customer's dog is called Biscuit",
)


@pytest.fixture
async def facts(client: httpx.AsyncClient, memory: dict[str, Any]) -> dict[str, str]:
    return {content: await write(client, memory["id"], content) for content in FACTS}


async def test_a_query_ranks_by_cosine_similarity(
    client: httpx.AsyncClient, project: dict[str, Any], memory: dict[str, Any], facts: dict[str, str]
) -> None:
    results = await search(client, project["id"], query="How does the customer want to be contacted?")
    assert results[0]["entry_id"] == facts["Customer prefers email over phone calls"]
    assert len(results) == len(FACTS) and all(set(r) == RESULT_FIELDS for r in results)
    scores = [r["score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(-1 <= s <= 1 for s in scores)
    assert all(r["similarity_score"] == r["score"] for r in results)
    top = results[0]
    assert top["source_type"] == "memory" and top["memory_id"] == memory["id"]
    assert top["memory_name"] == "Customer Preferences" and top["created_at"].endswith("Z")


async def test_min_score_and_limit(
    client: httpx.AsyncClient, project: dict[str, Any], facts: dict[str, str]
) -> None:
    everything = await search(client, project["id"], query="customer contact preference")
    threshold = (everything[0]["score"] + everything[1]["score"]) / 2
    above = await search(client, project["id"], query="customer contact preference", min_score=threshold)
    assert [r["entry_id"] for r in above] == [everything[0]["entry_id"]]
    assert len(await search(client, project["id"], query="customer contact preference", limit=2)) == 2
    # Like the list endpoints, a limit out of range is clamped, not refused.
    assert len(await search(client, project["id"], query="customer", limit=0)) == 1
    assert len(await search(client, project["id"], query="customer", limit=1_000)) == len(FACTS)


async def test_the_default_limit_is_ten(
    client: httpx.AsyncClient, project: dict[str, Any], memory: dict[str, Any]
) -> None:
    for i in range(12):
        await write(client, memory["id"], f"Order number {i} shipped from warehouse {chr(65 + i)}")
    assert len(await search(client, project["id"], query="which orders shipped")) == 10
    assert len(await search(client, project["id"], memory_ids=[memory["id"]])) == 10
    assert len(await search(client, project["id"], memory_ids=[memory["id"]], limit=100)) == 12


async def test_without_a_query_entries_are_listed_oldest_first_without_scores(
    client: httpx.AsyncClient, project: dict[str, Any], memory: dict[str, Any], facts: dict[str, str]
) -> None:
    results = await search(client, project["id"], memory_ids=[memory["id"]])
    assert [r["entry_id"] for r in results] == list(facts.values())
    assert all("score" not in r and "similarity_score" not in r for r in results)
    assert all(set(r) == RESULT_FIELDS - {"score", "similarity_score"} for r in results)


@pytest.mark.parametrize(
    "body",
    [{}, {"query": ""}, {"query": "   "}, {"memory_ids": []}, {"memory_tags": []}, {"min_score": 0.5}],
)
async def test_neither_a_query_nor_a_filter_is_400(
    client: httpx.AsyncClient, project: dict[str, Any], body: dict[str, Any]
) -> None:
    response = await client.post("/knowledge/search", json={"project_id": project["id"], **body})
    assert response.status_code == 400 and response.json()["error"]["code"] == "VALIDATION_FAILED"


@pytest.mark.parametrize(
    ("body", "meta_key"),
    [
        ({"query": "x", "colour": "red"}, "unknown_fields"),
        ({"query": "x", "min_score": 1.5}, "invalid_fields"),
        ({"query": "x", "min_score": "high"}, "invalid_fields"),
        ({"query": "x", "limit": "ten"}, "invalid_fields"),
        ({"query": "x", "limit": "5"}, "invalid_fields"),
        ({"query": "x", "limit": True}, "invalid_fields"),
        ({"query": "x", "min_score": "0.5"}, "invalid_fields"),
        ({"query": "x" * 8_001}, "invalid_fields"),
        ({"query": "nul\u0000"}, "invalid_fields"),
        ({"memory_tags": ["t"] * 21}, "invalid_fields"),
        ({"memory_tags": [""]}, "invalid_fields"),
        ({"memory_ids": [7]}, "invalid_fields"),
    ],
)
async def test_invalid_requests_are_400(
    client: httpx.AsyncClient, project: dict[str, Any], body: dict[str, Any], meta_key: str
) -> None:
    response = await client.post("/knowledge/search", json={"project_id": project["id"], **body})
    assert response.status_code == 400, response.text
    assert meta_key in response.json()["error"]["meta"]


async def test_the_admin_must_name_the_project(client: httpx.AsyncClient) -> None:
    response = await client.post("/knowledge/search", json={"query": "anything"})
    assert response.status_code == 400 and response.json()["error"]["meta"]["missing_fields"] == [
        "project_id"
    ]
    unknown = await client.post(
        "/knowledge/search", json={"query": "x", "project_id": "proj_0000000000000000"}
    )
    assert unknown.status_code == 404


async def test_a_scalar_is_taken_as_a_list_of_one(
    client: httpx.AsyncClient, project: dict[str, Any], memory: dict[str, Any], facts: dict[str, str]
) -> None:
    by_id = await search(client, project["id"], memory_ids=memory["id"])
    by_tag = await search(client, project["id"], memory_tags="crm")
    assert [r["entry_id"] for r in by_id] == [r["entry_id"] for r in by_tag] == list(facts.values())


async def test_tags_select_whole_memories_and_single_entries_without_duplicates(
    client: httpx.AsyncClient, project: dict[str, Any]
) -> None:
    crm = await new_memory(client, project["id"], "CRM", ["customer", "crm"])
    ops = await new_memory(client, project["id"], "Ops", ["operations"])
    untagged = await new_memory(client, project["id"], "Untagged", None)
    crm_plain = await write(client, crm, "Customer pays by card")
    crm_role = await write(client, crm, "Refunds need a manager's approval", tags=["role:traffic-manager"])
    ops_role = await write(
        client, ops, "Reject refunds above $500", tags=["role:traffic-manager", "source:x"]
    )
    ops_plain = await write(client, ops, "Deploys happen on Tuesdays", tags=["role:developer"])
    loose = await write(client, untagged, "A fact nobody tagged")

    async def ids(**body: Any) -> list[str]:
        found = [r["entry_id"] for r in await search(client, project["id"], **body)]
        assert len(found) == len(set(found)), "an entry appeared twice"
        return found

    # Container level: every entry of a memory whose own tags match; case-insensitive globs.
    assert set(await ids(memory_tags=["CUST*"])) == {crm_plain, crm_role}
    # Entry level: only the entries whose own tags match, whatever their memory's tags.
    assert set(await ids(memory_tags=["role:traffic-?anager"])) == {crm_role, ops_role}
    # Both at once, and with ids: a union; crm_role matches twice but appears once.
    assert set(await ids(memory_tags=["crm", "role:traffic*"])) == {crm_plain, crm_role, ops_role}
    assert set(await ids(memory_ids=[untagged], memory_tags=["role:dev*"])) == {loose, ops_plain}
    assert set(await ids(query="refunds", memory_tags=["role:*"])) == {crm_role, ops_role, ops_plain}
    # `%` and `_` are literal characters, not wildcards.
    assert await ids(memory_tags=["role%"]) == [] and await ids(memory_tags=["rol_:developer"]) == []
    assert await ids(memory_tags=["nothing-matches-this"]) == []


async def test_invalidated_entries_never_appear(
    client: httpx.AsyncClient,
    project: dict[str, Any],
    memory: dict[str, Any],
    facts: dict[str, str],
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    retired = facts["The office moved to Berlin in March"]
    async with sessions.begin() as session:
        await session.execute(
            text("UPDATE memory_entries SET invalidated_at = now() WHERE id = :id"), {"id": retired}
        )
    for body in (
        {"query": "Where is the office?"},
        {"query": "Where is the office?", "memory_ids": [memory["id"]]},
        {"memory_ids": [memory["id"]]},
        {"memory_tags": ["customer"]},
    ):
        found = [r["entry_id"] for r in await search(client, project["id"], **body)]
        assert retired not in found and len(found) == len(FACTS) - 1


async def test_only_the_callers_project_is_searched(
    client: httpx.AsyncClient, project: dict[str, Any], memory: dict[str, Any], facts: dict[str, str]
) -> None:
    other = (await client.post("/projects", json={"name": "other tenant"})).json()
    foreign_memory = await new_memory(client, other["id"], "Customer Preferences", ["customer", "crm"])
    foreign = await write(client, foreign_memory, "Customer prefers email over phone calls")
    mine = set(facts.values())
    for body in (
        {"query": "customer email"},
        {"query": "customer email", "memory_tags": ["customer"]},
        {"memory_tags": ["crm"]},
        {"memory_ids": [memory["id"], foreign_memory]},
    ):
        found = {r["entry_id"] for r in await search(client, project["id"], **body)}
        assert foreign not in found and found <= mine and found
    # A memory of another project, an unknown one or a malformed id contributes nothing (no 404).
    for memory_ids in (
        [foreign_memory],
        ["mem_0000000000000000"],
        ["not-an-id", "mem_entry_0000000000000000"],
    ):
        assert await search(client, project["id"], query="customer email", memory_ids=memory_ids) == []
    seen_from_other = await search(client, other["id"], query="customer email")
    assert [r["entry_id"] for r in seen_from_other] == [foreign]


async def test_a_key_searches_its_own_project_and_needs_the_permission(
    client: httpx.AsyncClient, project: dict[str, Any], facts: dict[str, str]
) -> None:
    async def key(actions: list[str]) -> dict[str, str]:
        created = await client.post("/api-keys", json={"project_id": project["id"], "actions": actions})
        assert created.status_code == 201, created.text
        return {"Authorization": f"Bearer {created.json()['key']}"}

    allowed = await key(["knowledge:SearchKnowledge"])
    response = await client.post("/knowledge/search", json={"query": "customer"}, headers=allowed)
    assert response.status_code == 200 and {r["entry_id"] for r in response.json()["results"]} == set(
        facts.values()
    )
    denied = await client.post(
        "/knowledge/search", json={"query": "customer"}, headers=await key(["memories:*"])
    )
    assert denied.status_code == 403


async def test_an_embedding_failure_is_503(server_urls: tuple[str, str], project: dict[str, Any]) -> None:
    broken = make_settings(server_urls, embedding_model="local/no-such-model")
    async for other_client in open_client(broken):
        response = await other_client.post(
            "/knowledge/search", json={"project_id": project["id"], "query": "x"}
        )
        assert response.status_code == 503 and response.json()["error"]["code"] == "SERVICE_UNAVAILABLE"
        # Without a query nothing is embedded, so listing still works.
        listed = await other_client.post(
            "/knowledge/search", json={"project_id": project["id"], "memory_tags": ["*"]}
        )
        assert listed.status_code == 200


async def test_a_tag_matching_more_memories_than_a_statement_has_parameters_is_searched(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # One memory per end user, as the seed lays it out: 70,000 of them match `user:*`, more than the 65,535
    # parameters a PostgreSQL statement may carry.
    async with sessions.begin() as session:
        await session.execute(
            text(
                "INSERT INTO memories (id, project_id, name, tags)"
                " SELECT 'mem_u' || lpad(n::text, 12, '0'), :project, 'user ' || n, ARRAY['user:' || n]"
                " FROM generate_series(1, 70000) AS n"
            ),
            {"project": project["id"]},
        )
    one_user = await new_memory(client, project["id"], "user 70001", ["user:70001"])
    await write(client, one_user, "The user's favourite colour is green")
    try:
        for body in ({"memory_tags": ["user:*"]}, {"memory_tags": ["user:*"], "query": "favourite colour"}):
            assert [hit["memory_id"] for hit in await search(client, project["id"], **body)] == [one_user]
    finally:
        async with sessions.begin() as session:  # the other tests share this database
            await session.execute(text("DELETE FROM memories WHERE project_id = :project"), {"project": project["id"]})


@pytest.mark.parametrize("route", ["/knowledge/search", "/knowledge/context"])
async def test_an_admin_search_holds_no_database_connection_while_its_query_is_embedded(
    settings: Settings, project: dict[str, Any], monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    # The admin's project was read in the search's transaction, which stayed open over the model call (a remote
    # one may take up to 30 s): a pooled connection held for nothing.
    from shared import search as search_module

    async with open_api(settings) as (app, api):
        held = connections_held_while_embedding(monkeypatch, app, search_module)
        if route == "/knowledge/search":
            body = {"project_id": project["id"], "query": "refunds", "memory_tags": ["*"]}
        else:
            body = {"project_id": project["id"], "message": "refunds", "knowledge_config": {"memory_tags": ["*"]}}
        answer = await api.post(route, json=body)
    assert answer.status_code == 200, answer.text
    assert held == [0]
