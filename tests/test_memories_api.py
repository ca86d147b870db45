"""Projects and memories over REST, against the real database."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import repository as repo
from tests.conftest import wait_until_blocked_by


async def test_requests_without_a_valid_token_are_401(client: httpx.AsyncClient) -> None:
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        response = await client.get("/projects", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "UNAUTHORIZED"


async def test_create_and_list_projects(client: httpx.AsyncClient, project: dict[str, Any]) -> None:
    assert project["id"].startswith("proj_") and len(project["id"]) == 21
    listing = (await client.get("/projects", params={"limit": 100})).json()
    assert listing["limit"] == 100 and listing["offset"] == 0 and listing["total"] >= 1


async def test_create_memory_returns_every_field(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    assert set(memory) >= {"id", "project_id", "name", "description", "tags", "created_at", "updated_at"}
    assert memory["id"].startswith("mem_") and len(memory["id"]) == 20
    assert memory["tags"] == ["customer", "crm"] and memory["description"] is None
    assert memory["created_at"].endswith("Z")
    fetched = (await client.get(f"/memories/{memory['id']}")).json()
    assert fetched == memory


@pytest.mark.parametrize(
    ("body", "meta_key", "fields"),
    [
        ({"name": "x", "colour": "red"}, "unknown_fields", ["colour"]),
        ({"description": "no name"}, "missing_fields", ["name"]),
    ],
)
async def test_create_memory_rejects_unknown_and_missing_fields(
    client: httpx.AsyncClient, project: dict[str, Any], body: dict[str, Any], meta_key: str, fields: list[str]
) -> None:
    response = await client.post("/memories", json={"project_id": project["id"], **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_FAILED"
    assert error["meta"][meta_key] == fields


@pytest.mark.parametrize(
    "body",
    [
        {"name": ""},
        {"name": "x" * 256},
        {"name": 5},
        {"name": "x", "tags": "crm"},
        {"name": "x", "tags": [1, 2]},
        {"name": "x", "tags": ["t"] * 65},
        {"name": "x", "tags": ["t" * 129]},
        {"name": "bad\u0000name"},
        {"name": "\u200b"},  # nothing to see
        {"name": "\u3164\u2800"},  # a Hangul filler and the blank braille pattern: nothing to see either
        {"name": "two\nlines"},  # breaks the lists, the tables, an agent's context
        {"name": "a\tb"},
        {"name": "\x1b[31mred"},  # a terminal escape
        {"name": "x", "tags": ["  "]},  # a tag of nothing to see, and one of two lines: accepted before
        {"name": "x", "tags": ["role:\nadmin"]},
    ],
)
async def test_create_memory_validates_types_and_sizes(
    client: httpx.AsyncClient, project: dict[str, Any], body: dict[str, Any]
) -> None:
    response = await client.post("/memories", json={"project_id": project["id"], **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "VALIDATION_FAILED"


async def test_malformed_json_is_a_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/memories", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "VALIDATION_FAILED"


async def test_oversized_body_is_a_413(client: httpx.AsyncClient, project: dict[str, Any]) -> None:
    response = await client.post("/memories", json={"project_id": project["id"], "name": "x", "description": "y" * 300_000})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"


async def test_admin_must_name_an_existing_project(client: httpx.AsyncClient) -> None:
    missing = await client.post("/memories", json={"name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["meta"]["missing_fields"] == ["project_id"]
    unknown = await client.post("/memories", json={"name": "x", "project_id": "proj_0000000000000000"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "RESOURCE_NOT_FOUND"


@pytest.mark.parametrize("memory_id", ["mem_0000000000000000", "mem_short", "mem_entry_0000000000000000", "x" * 40])
async def test_unknown_or_malformed_memory_ids_are_404(client: httpx.AsyncClient, memory_id: str) -> None:
    for method in ("GET", "PUT", "DELETE"):
        response = await client.request(method, f"/memories/{memory_id}", json={} if method == "PUT" else None)
        assert response.status_code == 404, (method, response.text)
        assert response.json()["error"]["code"] == "RESOURCE_NOT_FOUND"


async def test_update_applies_only_present_fields(client: httpx.AsyncClient, project: dict[str, Any]) -> None:
    created = (
        await client.post(
            "/memories", json={"project_id": project["id"], "name": "n", "description": "d", "tags": ["a"]}
        )
    ).json()
    renamed = (await client.put(f"/memories/{created['id']}", json={"name": "renamed"})).json()
    assert renamed["name"] == "renamed" and renamed["description"] == "d" and renamed["tags"] == ["a"]
    assert renamed["updated_at"] >= created["updated_at"]
    cleared = (await client.put(f"/memories/{created['id']}", json={"description": None, "tags": None})).json()
    assert cleared["description"] is None and cleared["tags"] is None and cleared["name"] == "renamed"
    bad = await client.put(f"/memories/{created['id']}", json={"name": None})
    assert bad.status_code == 400
    unknown = await client.put(f"/memories/{created['id']}", json={"nme": "typo"})
    assert unknown.status_code == 400 and unknown.json()["error"]["meta"]["unknown_fields"] == ["nme"]


async def test_an_update_that_changes_nothing_keeps_updated_at(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    # The same name sent again moved updated_at, as if the memory had changed.
    url = f"/memories/{memory['id']}"
    same = (await client.put(url, json={"name": memory["name"], "write_policy": memory["write_policy"]})).json()
    assert same["updated_at"] == memory["updated_at"]
    assert (await client.put(url, json={"name": "renamed"})).json()["updated_at"] > memory["updated_at"]


async def test_no_tags_are_one_value_for_a_memory_however_sent(client: httpx.AsyncClient, project: dict[str, Any]) -> None:
    # As for an entry: [] was stored and served as [], and sent to a memory without tags it moved updated_at.
    created = (await client.post("/memories", json={"project_id": project["id"], "name": "bare", "tags": []})).json()
    assert created["tags"] is None
    same = (await client.put(f"/memories/{created['id']}", json={"tags": []})).json()
    assert same["tags"] is None and same["updated_at"] == created["updated_at"]
    tagged = (await client.put(f"/memories/{created['id']}", json={"tags": ["a"]})).json()
    cleared = (await client.put(f"/memories/{created['id']}", json={"tags": []})).json()
    assert tagged["tags"] == ["a"] and cleared["tags"] is None and cleared["updated_at"] > tagged["updated_at"]


async def test_an_update_does_not_wait_for_a_decision_on_the_memory(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # A rename waited behind a merge asking its model (the memory's decisions lock) and, past the lock timeout, was a
    # 503: it changes nothing a decision reads. A delete still waits for the decision (its entries go).
    url = f"/memories/{memory['id']}"
    async with sessions.begin() as session:
        await repo.lock_memory(session, memory["id"])  # a writer deciding on the memory
        await repo.insert_entry(
            session, memory_id=memory["id"], project_id=memory["project_id"], content="Being decided",
            content_hash="h", embedding=[1.0] + [0.0] * 383, embedding_model="m", source_type="manual", tags=None,
            metadata_=None, source_generation_id=None, source_conversation_id=None,
        )
        renamed = await asyncio.wait_for(client.put(url, json={"name": "renamed", "write_policy": "arbitrate"}), 5)
        assert renamed.status_code == 200 and renamed.json()["name"] == "renamed", renamed.text
        deleting = asyncio.create_task(client.delete(url))
        await wait_until_blocked_by(session, "deleting the memory")
    assert (await deleting).status_code == 204


async def _names(client: httpx.AsyncClient, project_id: str, *patterns: str) -> list[str]:
    response = await client.get("/memories", params={"project_id": project_id, "tags": list(patterns)})
    assert response.status_code == 200, response.text
    return [m["name"] for m in response.json()["data"]]


async def test_tag_globs(client: httpx.AsyncClient, project: dict[str, Any]) -> None:
    for name, tags in [
        ("crm", ["crm"]),
        ("support", ["customer-support"]),
        ("prefs", ["user-prefs", "Customer"]),
        ("xrefs", ["user-xrefs"]),
        ("percent", ["100%_done"]),
        ("untagged", None),
    ]:
        await client.post("/memories", json={"project_id": project["id"], "name": name, "tags": tags})
    pid = project["id"]
    assert await _names(client, pid, "crm") == ["crm"]
    assert await _names(client, pid, "customer*") == ["support", "prefs"]  # case-insensitive
    assert await _names(client, pid, "user-?refs") == ["prefs", "xrefs"]
    assert await _names(client, pid, "crm", "user-x*") == ["crm", "xrefs"]  # ORed
    assert await _names(client, pid, "CRM") == ["crm"]
    assert await _names(client, pid, "100%_done") == ["percent"]
    assert await _names(client, pid, "100__done") == []  # `_` is literal, not a wildcard
    assert await _names(client, pid, "%") == []  # `%` is literal
    assert len(await _names(client, pid)) == 6
    # A pattern obeys a tag's rules, as a search's `memory_tags` do; `?tags=` is an empty pattern, not "no filter".
    for pattern, reason in [("t" * 129, "at most 128 characters"), ("a\x00b", "NUL"), ("", "at least 1 character")]:
        refused = await client.get("/memories", params={"project_id": pid, "tags": [pattern]})
        assert refused.status_code == 400, pattern
        (problem,) = refused.json()["error"]["meta"]["invalid_fields"]
        assert problem["field"].startswith("tags") and reason in problem["message"]


async def test_a_tag_matches_itself_in_any_script(client: httpx.AsyncClient, project: dict[str, Any]) -> None:
    # Lowered on both sides by the database: Python lowers "Σ" at a word's end to "ς" and "İ" to two characters.
    await client.post("/memories", json={"project_id": project["id"], "name": "greek", "tags": ["ΟΔΟΣ", "İzmir"]})
    for pattern in ("ΟΔΟΣ", "οδοσ", "ΟΔΟ*", "İzmir", "izmir", "İZMİR"):
        assert await _names(client, project["id"], pattern) == ["greek"], pattern
    memory_id = (await client.get("/memories", params={"project_id": project["id"]})).json()["data"][0]["id"]
    await client.post("/memory-entries", json={"memory_id": memory_id, "content": "A café", "tags": ["ΚΑΦΕΣ"]})
    found = await client.post("/knowledge/search", json={"project_id": project["id"], "memory_tags": ["ΚΑΦΕΣ"]})
    assert [hit["content"] for hit in found.json()["results"]] == ["A café"]  # an entry's own tag


async def test_list_envelope_order_and_paging(client: httpx.AsyncClient, project: dict[str, Any]) -> None:
    for i in range(5):
        await client.post("/memories", json={"project_id": project["id"], "name": f"m{i}"})
    page = (await client.get("/memories", params={"project_id": project["id"], "limit": 2, "offset": 1})).json()
    assert page["total"] == 5 and page["limit"] == 2 and page["offset"] == 1
    assert [m["name"] for m in page["data"]] == ["m1", "m2"]
    past_the_end = (await client.get("/memories", params={"project_id": project["id"], "offset": 7})).json()
    assert past_the_end["data"] == [] and past_the_end["total"] == 5
    clamped = (await client.get("/memories", params={"project_id": project["id"], "limit": 1000})).json()
    assert clamped["limit"] == 100
    assert (await client.get("/memories", params={"project_id": project["id"], "limit": 0})).json()["limit"] == 1
    negative = await client.get("/memories", params={"project_id": project["id"], "offset": -1})
    assert negative.status_code == 400
    not_a_number = await client.get("/memories", params={"project_id": project["id"], "limit": "ten"})
    assert not_a_number.status_code == 400
    # Read as 10, 3 and 5 before (Python's and pydantic's lenient parsing): a typo is told, not guessed at.
    for lenient in ("1_0", " 3 ", "5.0"):
        guessed = await client.get("/memories", params={"project_id": project["id"], "limit": lenient})
        assert guessed.status_code == 400 and "digits" in guessed.text, lenient


async def test_delete_memory_removes_its_entries(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    entry = (await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "A fact"})).json()
    assert (await client.delete(f"/memories/{memory['id']}")).status_code == 204
    assert (await client.get(f"/memories/{memory['id']}")).status_code == 404
    assert (await client.get(f"/memory-entries/{entry['id']}")).status_code == 404


@pytest.mark.parametrize("change", [{"method": "PUT", "json": {"name": "Renamed"}}, {"method": "DELETE"}])
async def test_a_memory_deleted_while_an_edit_waits_is_404(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    change: dict[str, Any],
) -> None:
    memory = (await client.post("/memories", json={"project_id": project["id"], "name": "Going"})).json()
    async with sessions.begin() as session:
        # A concurrent DELETE that has not committed yet: the edit must wait for it, then find nothing.
        await session.execute(text("DELETE FROM memories WHERE id = :id"), {"id": memory["id"]})
        edit = asyncio.create_task(client.request(url=f"/memories/{memory['id']}", **change))
        await wait_until_blocked_by(session, "the edit")
    response = await edit
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "RESOURCE_NOT_FOUND"


async def test_a_memory_delete_waits_for_a_decision_in_progress_on_it(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    """A writer decision or an entry edit holds the memory's lock; the delete's cascade must not land between
    the entry it read and the row it writes."""
    async with sessions.begin() as session:
        await repo.lock_memory(session, memory["id"])
        deleting = asyncio.create_task(client.delete(f"/memories/{memory['id']}"))
        await wait_until_blocked_by(session, "the delete")
        assert not deleting.done()
    assert (await deleting).status_code == 204


async def test_every_refused_field_has_the_same_shape(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    """`meta.invalid_fields` holds `{field, message}` objects, whether a model or a route refused the field."""
    for body in ({"name": None}, {"write_policy": None}, {"name": ""}):
        refused = await client.put(f"/memories/{memory['id']}", json=body)
        assert refused.status_code == 400, refused.text
        [problem] = refused.json()["error"]["meta"]["invalid_fields"]
        assert problem["field"] == next(iter(body)) and isinstance(problem["message"], str)
