"""Memory entries over REST: the manual write path through the bus, and the CRUD around it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import repository as repo
from shared.settings import Settings
from tests.conftest import connections_held_while_embedding, open_api, wait_until_blocked_by

ENTRY_FIELDS = {
    "id", "memory_id", "content", "source_type", "tags", "metadata", "source_generation_id",
    "source_conversation_id", "invalidated_at", "superseded_by_entry_id", "created_at", "updated_at",
}


async def write(client: httpx.AsyncClient, memory_id: str, content: str, **fields: Any) -> httpx.Response:
    return await client.post("/memory-entries", json={"memory_id": memory_id, "content": content, **fields})


async def test_create_then_repeat_is_skipped(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    created = await write(client, memory["id"], "Customer prefers email over phone calls")
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["action"] == "created" and set(body) >= ENTRY_FIELDS
    assert body["id"].startswith("mem_entry_") and body["source_type"] == "manual"
    assert body["source_generation_id"] is None and body["invalidated_at"] is None
    assert body["updated_at"] == body["created_at"]  # a fresh entry does not look edited

    for repeat in ("Customer prefers email over phone calls", "  customer PREFERS email over phone calls. "):
        skipped = await write(client, memory["id"], repeat)
        assert skipped.status_code == 200
        assert skipped.json()["action"] == "skipped" and skipped.json()["id"] == body["id"]


async def test_threshold_decides_near_duplicates(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    first = (await write(client, memory["id"], "Customer prefers email over phone calls")).json()
    paraphrase = "The customer would rather be emailed than phoned"
    lenient = await write(client, memory["id"], paraphrase, duplicate_threshold=0.5)
    assert lenient.json()["action"] == "skipped" and lenient.json()["id"] == first["id"]
    strict = await write(client, memory["id"], paraphrase)
    assert strict.status_code == 201 and strict.json()["action"] == "created"


async def test_facts_in_words_the_local_model_cannot_spell_are_not_lost_as_copies(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    """Thai, Amharic, emoji: the English vocabulary has no word for them. They were all one token to the model,
    so each second fact here scored 1.0 against the first and was skipped: a fact lost without a word."""
    facts = ["User likes 🍕", "User likes 🥦", "ผู้ใช้อาศัยอยู่ในกรุงเทพ", "ผู้ใช้ไม่ชอบกาแฟ", "ሰላም ልዑል", "ሰላም ዓለም"]
    for fact in facts:
        written = await write(client, memory["id"], fact)
        assert (written.status_code, written.json()["action"]) == (201, "created"), fact
    again = await write(client, memory["id"], "ผู้ใช้ไม่ชอบกาแฟ")
    assert again.json()["action"] == "skipped"


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"duplicate_threshold": 1.5}, 400),
        ({"duplicate_threshold": -0.1}, 400),
        ({"duplicate_threshold": "high"}, 400),
        ({"duplicate_threshold": "0.5"}, 400),  # numbers are JSON numbers, never guessed from strings
        ({"duplicate_threshold": False}, 400),  # nor from booleans (false would have skipped everything)
        ({"source_type": "robot"}, 400),
        ({"tags": ["t"] * 65}, 400),
        ({"tags": [7]}, 400),
        ({"metadata": [1, 2]}, 400),
        ({"metadata": {"blob": "x" * 20_000}}, 400),
        ({"surprise": True}, 400),
    ],
)
async def test_create_entry_validation(
    client: httpx.AsyncClient, memory: dict[str, Any], fields: dict[str, Any], status: int
) -> None:
    response = await write(client, memory["id"], "A fact", **fields)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == "VALIDATION_FAILED"


async def test_content_limits(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    too_long = await write(client, memory["id"], "x" * 8_001)
    assert too_long.status_code == 413 and too_long.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert (await write(client, memory["id"], "")).status_code == 400
    # Zero-width space, BOM, word joiner; a Hangul filler, the combining grapheme joiner, a variation selector and
    # the blank braille pattern (invisible, but no format characters: they were stored).
    # Control characters alone (a terminal escape, DEL, C1) show nothing either.
    for invisible in (" \n\t ", "\u200b\ufeff", " \u2060\u200d ", "\u3164", "\u034f", "\ufe0f\u2800",
                      "\x01\x02\x1b", "\x7f", "\x9f"):
        blank = await write(client, memory["id"], invisible)
        assert blank.status_code == 400 and blank.json()["error"]["meta"]["invalid_fields"][0]["field"] == "content"
    search = await client.post("/knowledge/search", json={"project_id": memory["project_id"], "query": "\u200b"})
    assert search.status_code == 400 and "query" in search.json()["error"]["meta"]["missing_fields"]
    assert (await write(client, memory["id"], "nul\u0000byte")).status_code == 400
    missing = await client.post("/memory-entries", json={"memory_id": memory["id"]})
    assert missing.json()["error"]["meta"]["missing_fields"] == ["content"]


async def test_unknown_memory_is_404(client: httpx.AsyncClient) -> None:
    for memory_id in ("mem_0000000000000000", "nope"):
        response = await write(client, memory_id, "A fact")
        assert response.status_code == 404 and response.json()["error"]["code"] == "RESOURCE_NOT_FOUND"


async def test_tags_metadata_and_source_type_are_stored(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    body = (
        await write(
            client,
            memory["id"],
            "Reject refunds above $500 for the traffic-manager role",
            # A tag given twice is kept once (it was stored twice), in the order given, in any case: globs match
            # tags case-blind, so "Role:Traffic-Manager" is the same label.
            tags=["role:traffic-manager", "source:rejected_approval", "role:traffic-manager", "Role:Traffic-Manager"],
            metadata={"evidence": "high"},
            source_type="orchestration",
        )
    ).json()
    assert body["tags"] == ["role:traffic-manager", "source:rejected_approval"]
    assert body["metadata"] == {"evidence": "high"} and body["source_type"] == "orchestration"


async def test_invalidated_entries_leave_list_and_dedup_but_stay_readable(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    old = (await write(client, memory["id"], "The office is in Berlin")).json()
    async with sessions.begin() as session:
        await session.execute(
            text("UPDATE memory_entries SET invalidated_at = now() WHERE id = :id"), {"id": old["id"]}
        )
    listed = (await client.get("/memory-entries", params={"memory_id": memory["id"]})).json()
    assert old["id"] not in [e["id"] for e in listed["data"]]
    with_invalid = (
        await client.get("/memory-entries", params={"memory_id": memory["id"], "include_invalidated": "true"})
    ).json()
    assert old["id"] in [e["id"] for e in with_invalid["data"]]
    fetched = (await client.get(f"/memory-entries/{old['id']}")).json()
    assert fetched["invalidated_at"] is not None
    # Restating retired knowledge creates a new entry: an invalidated entry is never a dedup candidate.
    restated = await write(client, memory["id"], "The office is in Berlin")
    assert restated.status_code == 201 and restated.json()["id"] != old["id"]


async def test_an_invalidated_entry_is_history_not_rewritten(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    old = (await write(client, memory["id"], "The office is in Paris")).json()
    new = (await write(client, memory["id"], "The office is in Lyon")).json()
    racing = (await write(client, memory["id"], "The office opens at eight")).json()
    async with sessions.begin() as session:
        await repo.invalidate_entry(session, old["id"], new["id"])
    for change in ({"content": "The office is in Nice"}, {"tags": ["moved"]}, {"metadata": {"k": 1}}):
        refused = await client.put(f"/memory-entries/{old['id']}", json=change)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["meta"] == {"superseded_by_entry_id": new["id"]}
    assert (await client.get(f"/memory-entries/{old['id']}")).json()["content"] == "The office is in Paris"
    # Invalidated while the edit waited for the memory's lock.
    async with sessions.begin() as session:
        await repo.lock_memory(session, memory["id"])
        edit = asyncio.create_task(client.put(f"/memory-entries/{racing['id']}", json={"content": "Opens at nine"}))
        await wait_until_blocked_by(session, "the edit")
        await repo.invalidate_entry(session, racing["id"], new["id"])
    assert (await edit).status_code == 409
    assert (await client.delete(f"/memory-entries/{old['id']}")).status_code == 204  # history may still go


async def test_list_entries_requires_a_known_memory(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    assert (await client.get("/memory-entries")).status_code == 400
    assert (await client.get("/memory-entries", params={"memory_id": "mem_0000000000000000"})).status_code == 404
    for content in ("First fact about shipping", "Second fact about billing", "Third fact about returns"):
        await write(client, memory["id"], content)
    page = (await client.get("/memory-entries", params={"memory_id": memory["id"], "limit": 2})).json()
    assert page["total"] == 3 and [e["content"] for e in page["data"]] == [
        "First fact about shipping",
        "Second fact about billing",
    ]


async def test_update_entry_replaces_and_reembeds_without_dedup(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    keep = (await write(client, memory["id"], "Deliveries arrive on Mondays")).json()
    entry = (await write(client, memory["id"], "Invoices go out monthly", tags=["a", "b"], metadata={"k": 1})).json()

    async def stored_embedding() -> str:
        async with sessions() as session:
            return str(await session.scalar(text("SELECT embedding FROM memory_entries WHERE id = :id"), {"id": entry["id"]}))

    before = await stored_embedding()
    tags_only = (await client.put(f"/memory-entries/{entry['id']}", json={"tags": ["c"]})).json()
    assert tags_only["tags"] == ["c"] and tags_only["metadata"] == {"k": 1}
    assert await stored_embedding() == before
    # No dedup on PUT: the same text as another entry is accepted as it is.
    edited = (await client.put(f"/memory-entries/{entry['id']}", json={"content": keep["content"]})).json()
    assert edited["content"] == keep["content"] and edited["id"] == entry["id"]
    assert await stored_embedding() != before
    cleared = (await client.put(f"/memory-entries/{entry['id']}", json={"tags": None, "metadata": None})).json()
    assert cleared["tags"] is None and cleared["metadata"] is None
    assert (await client.put(f"/memory-entries/{entry['id']}", json={"content": None})).status_code == 400
    assert (await client.put(f"/memory-entries/{entry['id']}", json={"memory_id": "x"})).status_code == 400


async def test_delete_entry(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    entry = (await write(client, memory["id"], "Temporary fact")).json()
    assert (await client.delete(f"/memory-entries/{entry['id']}")).status_code == 204
    assert (await client.get(f"/memory-entries/{entry['id']}")).status_code == 404
    assert (await client.delete(f"/memory-entries/{entry['id']}")).status_code == 404
    assert (await client.get("/memory-entries/mem_entry_bad")).status_code == 404


@pytest.mark.parametrize(
    "change", [{"method": "PUT", "json": {"tags": ["late"]}}, {"method": "PUT", "json": {"content": "New text"}},
               {"method": "DELETE"}],
)
async def test_an_entry_deleted_while_an_edit_waits_for_its_memory_is_404(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    change: dict[str, Any],
) -> None:
    entry = (await write(client, memory["id"], "A fact about to go")).json()
    async with sessions.begin() as session:
        # Another transaction holds the memory (as a writer decision or a second edit would) and deletes the
        # entry; the edit has read the entry by then and waits for the lock.
        await repo.lock_memory(session, memory["id"])
        edit = asyncio.create_task(client.request(url=f"/memory-entries/{entry['id']}", **change))
        await wait_until_blocked_by(session, "the edit")
        await session.execute(text("DELETE FROM memory_entries WHERE id = :id"), {"id": entry["id"]})
    response = await edit
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "RESOURCE_NOT_FOUND"


async def test_an_edits_content_wins_over_a_rewrite_made_while_it_waited(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    entry = (await write(client, memory["id"], "The office opens at nine")).json()
    async with sessions.begin() as session:
        await repo.lock_memory(session, memory["id"])
        # The client sets the text it read; a merge rewrites the entry before the edit gets the lock.
        edit = asyncio.create_task(client.put(f"/memory-entries/{entry['id']}", json={"content": entry["content"]}))
        await wait_until_blocked_by(session, "the edit")
        await session.execute(text("UPDATE memory_entries SET content = 'Merged meanwhile' WHERE id = :id"),
                              {"id": entry["id"]})
    response = await edit
    assert response.status_code == 200 and response.json()["content"] == entry["content"]
    assert (await client.get(f"/memory-entries/{entry['id']}")).json()["content"] == entry["content"]


async def test_null_for_an_optional_field_means_its_default(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    # Generated clients send null for every optional field they were not given.
    written = await write(client, memory["id"], "A fact from a generated client",
                          source_type=None, duplicate_threshold=None, write_policy=None, tags=None, metadata=None)
    assert written.status_code == 201, written.text
    assert written.json()["source_type"] == "manual" and written.json()["tags"] is None
    memory_body = {"project_id": memory["project_id"], "name": "Nulls", "write_policy": None, "description": None}
    created = await client.post("/memories", json=memory_body)
    assert created.status_code == 201 and created.json()["write_policy"] == "seed"
    # A required field stays required.
    assert (await write(client, memory["id"], None)).status_code == 400  # type: ignore[arg-type]


async def test_an_empty_edit_changes_nothing(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    entry = (await write(client, memory["id"], "A fact left alone")).json()
    for url in (f"/memory-entries/{entry['id']}", f"/memories/{memory['id']}"):
        before = (await client.get(url)).json()
        after = await client.put(url, json={})
        assert after.status_code == 200 and after.json()["updated_at"] == before["updated_at"], url
    history = (await client.get(f"/memory-entries/{entry['id']}/history")).json()["data"]
    assert [record["action"] for record in history] == ["created"]


async def test_no_tags_and_no_metadata_are_one_value_however_sent(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    # Written as [] and {} they were stored so, an edit stored them as none, and an edit of [] into [] was recorded
    # as a change of the tags (and moved updated_at).
    entry = (await write(client, memory["id"], "A fact without labels", tags=[], metadata={})).json()
    assert entry["tags"] is None and entry["metadata"] is None
    url = f"/memory-entries/{entry['id']}"
    edited = (await client.put(url, json={"tags": [], "metadata": {}})).json()
    assert edited["updated_at"] == entry["updated_at"]
    history = (await client.get(f"{url}/history")).json()["data"]
    assert [record["action"] for record in history] == ["created"]


async def test_an_entrys_history_is_paged_as_every_list_is(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    # Read whole before: an entry an agent writes again at every turn gathers a record per skip, each with its text.
    entry = (await write(client, memory["id"], "A fact written again and again")).json()
    for _ in range(3):
        assert (await write(client, memory["id"], "A fact written again and again")).json()["action"] == "skipped"
    url = f"/memory-entries/{entry['id']}/history"
    first = (await client.get(url, params={"limit": 2})).json()
    rest = (await client.get(url, params={"limit": 2, "offset": 2})).json()
    assert (first["entry_id"], first["total"], first["limit"], first["offset"]) == (entry["id"], 4, 2, 0)
    assert [record["action"] for record in first["data"] + rest["data"]] == ["created", "skipped", "skipped", "skipped"]
    assert (await client.get(url)).json()["limit"] == 50  # the contract's default page
    assert (await client.get(url, params={"limit": "many"})).status_code == 400


async def test_an_edits_record_names_what_it_changed(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    # A tags-only edit was recorded with the same text before and after, and nothing else: an edit of nothing.
    entry = (await write(client, memory["id"], "A fact to relabel", tags=["draft"])).json()
    url = f"/memory-entries/{entry['id']}"
    await client.put(url, json={"tags": ["final"], "metadata": {"reviewed": True}})
    await client.put(url, json={"tags": ["final"], "content": "A fact relabelled"})  # the same tags: not a change
    await client.put(url, json={"tags": ["final"]})  # nothing new: no record at all
    history = (await client.get(f"{url}/history")).json()["data"]
    assert [(record["action"], record["rule"]) for record in history] == [
        ("created", "no_candidate"), ("edited", "changed:tags,metadata"), ("edited", "changed:content")
    ], history


@pytest.mark.parametrize("caller", ["admin", "api key"])
async def test_an_edit_holds_no_database_connection_while_its_new_content_is_embedded(
    settings: Settings, memory: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caller: str
) -> None:
    # Its transaction stayed open over the model call (a remote one may take up to 30 s): some 30 edits against a
    # slow embedder emptied the API's pool, and every other request waited for a connection. With an API key read
    # from the database (not remembered), the key's read held one too.
    from services.api.routes import entries as entries_route

    async with open_api(settings.model_copy(update={"memories_api_key_cache_s": 0})) as (app, api):
        if caller == "api key":
            created = await api.post("/api-keys", json={"project_id": memory["project_id"], "actions": ["memories:*"]})
            api.headers["Authorization"] = f"Bearer {created.json()['key']}"
        held = connections_held_while_embedding(monkeypatch, app, entries_route)
        entry = (await api.post("/memory-entries", json={"memory_id": memory["id"], "content": "Old wording"})).json()
        edited = await api.put(f"/memory-entries/{entry['id']}", json={"content": "A new wording altogether"})
    assert edited.status_code == 200 and edited.json()["content"] == "A new wording altogether"
    assert held == [0]


async def test_deleting_an_entry_or_its_memory_keeps_none_of_its_texts(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # The history of a deleted entry, unreadable through the API, kept every text it had, for good.
    async def texts_of(entry_id: str) -> list[tuple[str, str | None, str | None]]:
        async with sessions() as session:
            rows = await session.execute(
                text("SELECT action, content_before, content_after FROM entry_history WHERE entry_id = :id ORDER BY id"),
                {"id": entry_id},
            )
            return [tuple(row) for row in rows]  # type: ignore[misc]

    memory = (await client.post("/memories", json={"project_id": project["id"], "name": "to forget"})).json()
    kept = (await write(client, memory["id"], "The alarm code is 4711")).json()
    assert (await write(client, memory["id"], "the alarm code is 4711.")).json()["action"] == "skipped"
    edited = await client.put(f"/memory-entries/{kept['id']}", json={"content": "The alarm code is 1234"})
    assert edited.status_code == 200
    assert [action for action, *_ in await texts_of(kept["id"])] == ["created", "skipped", "edited"]
    assert (await client.delete(f"/memory-entries/{kept['id']}")).status_code == 204
    # What happened stays, for audit; the texts do not.
    assert await texts_of(kept["id"]) == [("created", None, None), ("skipped", None, None), ("edited", None, None),
                                          ("deleted", None, None)]

    other = (await write(client, memory["id"], "The safe is behind the painting")).json()
    assert (await client.delete(f"/memories/{memory['id']}")).status_code == 204
    assert await texts_of(other["id"]) == [("created", None, None)]
