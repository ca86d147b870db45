"""The Python client against the real API: the async client over the app in-process (ASGI), the blocking
one over HTTP to the app served by uvicorn, both backed by the real PostgreSQL, NATS and writers."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import pytest_asyncio

from services.api.serving import serve_in_thread
from shared.client import (
    UNSET,
    AiProvider,
    AsyncMemoriesClient,
    Call,
    Conflict,
    ConnectionFailed,
    EntryWrite,
    ExtractionStatus,
    Forbidden,
    InvalidRequest,
    MemoriesClient,
    MemoriesError,
    Memory,
    MemoryEntry,
    ModelRouteTarget,
    NotFound,
    PayloadTooLarge,
    ProvenanceCleared,
    ServiceUnavailable,
    SourceType,
    TimedOut,
    Unauthorized,
    ValidationFailed,
    WriteAction,
)
from shared.client._calls import model
from shared.scripted_llm import ScriptedLLM
from shared.servers import LOOPBACK, free_port
from shared.settings import Settings
from shared.tools import WRITE_MEMORY_TOOL
from tests.conftest import ADMIN_TOKEN, open_client

EMAIL = "Customer prefers email over phone calls"


def serve_api(settings: Settings) -> AbstractContextManager[str]:
    """The API on a free loopback port, run by uvicorn on a thread of its own (its own event loop)."""
    return serve_in_thread(settings)


@pytest.fixture(scope="module")
def api_url(settings: Settings, writers: list[Any]) -> Iterator[str]:
    with serve_api(settings) as url:
        yield url


@pytest_asyncio.fixture
async def memories(client: httpx.AsyncClient) -> AsyncIterator[AsyncMemoriesClient]:
    """The async client over the session's in-process app (an injected httpx client)."""
    async with AsyncMemoriesClient(http=client) as opened:
        yield opened


def extracting_agent(llm: ScriptedLLM, memory: Memory, name: str, fact: str) -> dict[str, Any]:
    """An agent whose turns are extracted into `memory` as the one `fact`, by a scripted model."""

    def reply(messages: list[dict[str, Any]]) -> str:
        # A blank merge answer (the system prompt's) writes the fact as new, however close another entry is.
        return "" if messages[0]["role"] == "system" else json.dumps([fact])

    model_name = llm.script(name, reply)
    return {"id": "agent_1", "model": model_name,
            "knowledge_config": {"write_memory_id": memory.id, "extraction": True}}


async def extracted(memories: AsyncMemoriesClient, generation_id: str, project_id: str) -> ExtractionStatus:
    for _ in range(300):
        outcome = await memories.extraction_status(generation_id, project_id=project_id)
        if outcome.status != "pending":
            return outcome
        await asyncio.sleep(0.05)
    raise AssertionError(f"the extraction of {generation_id} never finished")


@pytest_asyncio.fixture
async def target(memories: AsyncMemoriesClient) -> Memory:
    project = await memories.create_project("client tests")
    return await memories.create_memory(
        "Customer Preferences", project_id=project.id, tags=["customer", "crm"]
    )


async def test_memory_round_trip(memories: AsyncMemoriesClient) -> None:
    project = await memories.create_project("round trip")
    created = await memories.create_memory(
        "Customer Preferences",
        project_id=project.id,
        description="what customers like",
        tags=["Customer", "crm"],
    )
    assert isinstance(created, Memory) and created.id.startswith("mem_") and created.project_id == project.id
    await memories.create_memory("Billing", project_id=project.id, tags=["finance"])
    listed = await memories.list_memories(project_id=project.id, tags=["cust*", "nothing?"])
    one_pattern = await memories.list_memories(project_id=project.id, tags="cust*")  # not c, u, s, t, *
    assert [m.id for m in one_pattern.data] == [m.id for m in listed.data]
    assert [m.id for m in listed.data] == [created.id] and listed.total == 1
    assert (await memories.list_memories(project_id=project.id, limit=1)).total == 2
    assert await memories.get_memory(created.id) == created
    renamed = await memories.update_memory(created.id, name="Preferences", description=None)
    assert (renamed.name, renamed.description, renamed.tags) == ("Preferences", None, ["Customer", "crm"])
    assert (await memories.update_memory(created.id, tags=["vip"])).tags == ["vip"]
    projects = await memories.list_projects(limit=1)
    assert len(projects.data) == 1 and projects.limit == 1 and projects.total >= 1
    await memories.delete_memory(created.id)
    with pytest.raises(NotFound) as missing:
        await memories.get_memory(created.id)
    assert missing.value.status == 404 and missing.value.code == "RESOURCE_NOT_FOUND"


async def test_entries_created_skipped_edited_and_deleted(
    memories: AsyncMemoriesClient, target: Memory
) -> None:
    first = await memories.create_entry(target.id, EMAIL, tags=["channel"], metadata={"evidence": "high"})
    assert isinstance(first, EntryWrite) and first.status == "applied" and first.action is WriteAction.CREATED
    assert first.entry is not None and first.entry.source_type is SourceType.MANUAL
    assert first.entry.metadata == {"evidence": "high"} and first.entry.tags == ["channel"]
    again = await memories.create_entry(target.id, "customer prefers email over phone calls.")
    assert (
        again.action is WriteAction.SKIPPED and again.entry is not None and again.entry.id == first.entry.id
    )
    lower = await memories.create_entry(target.id, "Customer prefers email", duplicate_threshold=0.0)
    assert lower.action is WriteAction.SKIPPED  # everything is a duplicate at threshold 0

    keyed = await memories.create_entry(target.id, "Ships to Porto", idempotency_key="client-test-1")
    replay = await memories.create_entry(target.id, "Ships to Porto", idempotency_key="client-test-1")
    assert replay.write_id == keyed.write_id and replay.entry == keyed.entry
    assert (await memories.get_write(keyed.write_id)).entry_id == (keyed.entry.id if keyed.entry else None)

    entries = await memories.list_entries(target.id)
    assert [e.content for e in entries.data] == [EMAIL, "Ships to Porto"]
    assert all(isinstance(e, MemoryEntry) for e in entries.data)
    edited = await memories.update_entry(first.entry.id, content="Customer prefers email", metadata=None)
    assert (
        edited.content == "Customer prefers email" and edited.metadata is None and edited.tags == ["channel"]
    )
    unchanged = await memories.update_entry(first.entry.id, tags=UNSET)
    assert unchanged.tags == ["channel"]
    history = await memories.entry_history(first.entry.id)
    edits = [record for record in history.data if record.action == "edited"]
    assert (edits[0].content_before, edits[0].content_after) == (EMAIL, "Customer prefers email")

    await memories.delete_entry(first.entry.id)
    with pytest.raises(NotFound):
        await memories.get_entry(first.entry.id)
    remaining = await memories.list_entries(target.id, include_invalidated=True)
    assert [e.content for e in remaining.data] == ["Ships to Porto"]


async def test_errors_are_typed_with_the_envelope(memories: AsyncMemoriesClient, target: Memory) -> None:
    # The typed methods cannot send an unknown field; `send` takes any call.
    stray = Call("POST", "/memories", model(Memory), body={"name": "x", "colour": "red"})
    with pytest.raises(ValidationFailed) as unknown:
        await memories.send(stray)
    assert unknown.value.status == 400 and unknown.value.code == "VALIDATION_FAILED"
    assert unknown.value.meta["unknown_fields"] == ["colour"]
    assert str(unknown.value).endswith("(unknown fields: colour)")  # a traceback says what to fix, not just "failed"
    with pytest.raises(ValidationFailed) as out_of_range:
        await memories.create_entry(target.id, EMAIL, duplicate_threshold=1.5)
    assert [f["field"] for f in out_of_range.value.meta["invalid_fields"]] == ["duplicate_threshold"]
    assert "(duplicate_threshold: " in str(out_of_range.value)
    with pytest.raises(PayloadTooLarge) as too_long:
        await memories.create_entry(target.id, "x" * 8_001)
    assert too_long.value.status == 413 and too_long.value.code == "PAYLOAD_TOO_LARGE"
    with pytest.raises(NotFound):
        await memories.list_entries("mem_0000000000000000")
    with pytest.raises(InvalidRequest) as empty_id:  # "/memories/" is the list: refused before it is sent
        await memories.delete_memory("")
    assert empty_id.value.status is None and empty_id.value.code == "INVALID_REQUEST"
    assert (await memories.get_memory(target.id)).id == target.id
    with pytest.raises(MemoriesError) as no_search:
        await memories.search(project_id=target.project_id)
    assert isinstance(no_search.value, ValidationFailed) and "query" in no_search.value.meta["missing_fields"]


async def test_search_and_reference_context(memories: AsyncMemoriesClient, target: Memory) -> None:
    for content in (EMAIL, "The customer's budget is 40,000 euros", "The customer lives in Porto"):
        await memories.create_entry(target.id, content)
    project_id = target.project_id
    ranked = await memories.search(
        "Does the customer prefer email or phone?", memory_ids=[target.id], limit=2, project_id=project_id
    )
    assert len(ranked) == 2 and ranked[0].content == EMAIL  # cosine 0.76; the next is 0.30
    assert ranked[0].score is not None and ranked[1].score is not None and ranked[0].score > ranked[1].score
    assert ranked[0].score == ranked[0].similarity_score
    assert ranked[0].memory_name == "Customer Preferences"
    listed = await memories.search(memory_tags=["crm"], project_id=project_id)
    assert listed[0].content == EMAIL and all(r.score is None for r in listed)
    assert (
        await memories.search("contact", memory_ids=[target.id], min_score=0.99, project_id=project_id) == []
    )

    config = {"memoryIds": [target.id], "limit": 1}  # camelCase, as a platform may store it
    context = await memories.knowledge_context(
        config, "Which city is the customer in?", project_id=project_id
    )
    assert context.message is not None and context.message.role == "user"
    assert "<knowledge>" in context.message.content and "Porto" in context.message.content
    assert [r.content for r in context.results] == ["The customer lives in Porto"]


async def test_agent_tool_call_and_extraction_status(
    memories: AsyncMemoriesClient, target: Memory, extractors: list[Any]
) -> None:
    agent = {"id": "agent_1", "knowledge_config": {"write_memory_id": target.id, "extraction": False}}
    written = await memories.write_memory(
        EMAIL, agent, generation_id="gen_client", project_id=target.project_id
    )
    assert written.action is WriteAction.CREATED and written.error is None and written.entry_id
    assert (await memories.get_entry(written.entry_id)).source_generation_id == "gen_client"
    refused = await memories.write_memory(
        EMAIL, agent, memory_id="mem_0000000000000000", project_id=target.project_id
    )
    assert refused.error and refused.entry_id is None

    accepted = await memories.generation_completed(
        "gen_client_turn",
        agent,
        messages=[{"role": "user", "content": "I moved to Porto"}],
        output="Noted.",
        project_id=target.project_id,
    )
    assert (accepted.generation_id, accepted.status) == ("gen_client_turn", "pending")
    for _ in range(300):
        outcome = await memories.extraction_status("gen_client_turn", project_id=target.project_id)
        if outcome.status != "pending":
            break
        await asyncio.sleep(0.05)
    assert (outcome.status, outcome.reason) == ("skipped", "extraction_disabled")
    assert outcome.summary.candidates == 0


async def test_the_write_memory_tool_definition_is_the_one_the_service_executes(
    memories: AsyncMemoriesClient,
) -> None:
    definition = await memories.write_memory_tool()
    assert definition == WRITE_MEMORY_TOOL and definition["function"]["name"] == "write_memory"
    # A success that is no JSON object cannot be a tool definition: something else answered at this URL.
    not_an_object = httpx.MockTransport(lambda request: httpx.Response(200, json=["write_memory"]))
    elsewhere = MemoriesClient("http://memories.test", "t", transport=not_an_object)
    with elsewhere, pytest.raises(MemoriesError) as unexpected:
        elsewhere.write_memory_tool()
    assert unexpected.value.code == "INVALID_RESPONSE"


async def test_an_orchestration_write_stores_a_tag_map_and_replays_its_idempotency_key(
    memories: AsyncMemoriesClient, target: Memory
) -> None:
    order = {"order": 42, "status": "shipped"}
    first = await memories.orchestration_write(
        target.id, order, tags={"urgent": True, "channel": "email"}, metadata={"node": "n1"},
        idempotency_key="orchestration-1",
    )
    assert (first.status, first.action, first.replayed) == ("applied", WriteAction.CREATED, False)
    assert first.entry is not None and first.entry.source_type is SourceType.ORCHESTRATION
    assert first.entry.content == json.dumps(order) and first.entry.metadata == {"node": "n1"}
    assert first.entry.tags == ["channel:email", "urgent:true"]  # in key order, spelled as JSON spells them
    # A retry that builds its map in another order is the same request, not a reused key (a 409).
    replay = await memories.orchestration_write(
        target.id, order, tags={"channel": "email", "urgent": True}, metadata={"node": "n1"},
        idempotency_key="orchestration-1",
    )
    assert replay.replayed and (replay.write_id, replay.entry) == (first.write_id, first.entry)
    listed = await memories.orchestration_write(
        target.id, "Parcels leave at noon", tags=["logistics"], source_type=SourceType.MANUAL
    )
    assert listed.entry is not None and (listed.entry.tags, listed.entry.source_type) == (
        ["logistics"], SourceType.MANUAL)
    assert (await memories.list_entries(target.id)).total == 2


async def test_forgetting_a_generation_and_a_conversation_whose_ids_hold_a_slash(
    memories: AsyncMemoriesClient, target: Memory, api_url: str, extractors: list[Any], llm: ScriptedLLM
) -> None:
    project_id = target.project_id
    tool_agent = {"id": "agent_1", "knowledge_config": {"write_memory_id": target.id, "extraction": False}}
    written = await memories.write_memory(EMAIL, tool_agent, generation_id="run/42", project_id=project_id)
    assert written.entry_id and (await memories.get_entry(written.entry_id)).source_generation_id == "run/42"

    def forget_twice_over_http() -> list[ProvenanceCleared]:
        # Through uvicorn as well: the id must arrive whole from a real server's path decoding too.
        with MemoriesClient(api_url, ADMIN_TOKEN) as blocking:
            return [blocking.forget_generation("run/42", project_id=project_id) for _ in range(2)]

    first, again = await asyncio.to_thread(forget_twice_over_http)
    assert (first.cleared, again.cleared) == (1, 0)  # nothing cites it any more the second time
    forgotten = await memories.get_entry(written.entry_id)
    assert (forgotten.source_generation_id, forgotten.content) == (None, EMAIL)  # the fact stays

    agent = extracting_agent(llm, target, "client-extract-chat-7", "The user drives a blue van.")
    await memories.generation_completed(
        "gen_chat_7", agent, messages=[{"role": "user", "content": "I drive a blue van."}],
        conversation_id="chat/7", project_id=project_id,
    )
    assert (await extracted(memories, "gen_chat_7", project_id)).summary.created == 1
    [cited] = [e for e in (await memories.list_entries(target.id)).data if e.source_conversation_id == "chat/7"]
    assert (await memories.forget_conversation("chat/7", project_id=project_id)).cleared == 1
    assert (await memories.get_entry(cited.id)).source_conversation_id is None
    with pytest.raises(InvalidRequest):  # "/conversations//provenance" names no conversation
        await memories.forget_conversation("", project_id=project_id)


async def test_a_turn_reported_late_with_its_occurred_at_does_not_cite_a_conversation_forgotten_since(
    memories: AsyncMemoriesClient, target: Memory, extractors: list[Any], llm: ScriptedLLM
) -> None:
    project_id = target.project_id
    ended = datetime.now(UTC)
    assert (await memories.forget_conversation("chat/8", project_id=project_id)).cleared == 0
    # Both turns are reported after the forgetting: only the one whose occurred_at says it ended before loses the
    # citation, so a client that dropped occurred_at would leave both citing it.
    turns = (("gen_ended_before", "The user plays the cello.", ended), ("gen_ended_now", "The user keeps bees.", None))
    for generation_id, fact, occurred_at in turns:
        agent = extracting_agent(llm, target, f"client-extract-{generation_id}", fact)
        accepted = await memories.generation_completed(
            generation_id, agent, messages=[{"role": "user", "content": fact}], conversation_id="chat/8",
            occurred_at=occurred_at, project_id=project_id,
        )
        assert accepted.status == "pending"
        assert (await extracted(memories, generation_id, project_id)).summary.created == 1
    cited = {e.content: e.source_conversation_id for e in (await memories.list_entries(target.id)).data}
    assert cited == {"The user plays the cello.": None, "The user keeps bees.": "chat/8"}


async def test_the_model_registry_routes_an_agents_merges_and_meters_them(
    memories: AsyncMemoriesClient, target: Memory, llm: ScriptedLLM
) -> None:
    project_id = target.project_id
    merged = "Customer prefers email over phone calls, ideally in the morning."
    llm.script("client-merge", merged)
    provider = await memories.create_ai_provider(
        "ours", "scripted", project_id=project_id, default_model="client-merge"
    )
    assert isinstance(provider, AiProvider) and provider.id.startswith("aip_")
    assert (provider.project_id, provider.provider, provider.default_model) == (project_id, "scripted", "client-merge")
    assert [p.id for p in (await memories.list_ai_providers(project_id=project_id)).data] == [provider.id]
    route = await memories.create_model_route(
        "default", [ModelRouteTarget(ai_provider_id=provider.id)], project_id=project_id
    )
    assert route.targets == [ModelRouteTarget(ai_provider_id=provider.id, model=None)]
    assert [r.id for r in (await memories.list_model_routes(project_id=project_id)).data] == [route.id]
    assert (await memories.get_default_model_route(project_id)).model_route_id is None
    assert (await memories.set_default_model_route(project_id, route.id)).model_route_id == route.id
    assert (await memories.get_default_model_route(project_id)).model_route_id == route.id

    # An agent naming no model merges through the default route: proof the route took effect, and metered.
    bare = {"id": "agent_bare", "knowledge_config": {"write_memory_id": target.id}}
    first = await memories.write_memory(EMAIL, bare, project_id=project_id)
    detail = await memories.write_memory(
        "Customer prefers email over phone calls, ideally in the morning", bare, project_id=project_id
    )
    assert (detail.action, detail.entry_id) == (WriteAction.UPDATED, first.entry_id)
    [row] = (await memories.usage(project_id=project_id)).data
    assert (row.ai_provider_id, row.model, row.purpose, row.calls) == (provider.id, "scripted/client-merge", "merge", 1)
    assert row.prompt_tokens > 0 and row.completion_tokens == len(merged.split())

    with pytest.raises(Conflict) as still_routed:  # the route would fail every call it serves
        await memories.delete_ai_provider(provider.id)
    assert still_routed.value.meta["model_route_ids"] == [route.id]
    # None must reach the service as null (it clears), not be left out as an unset argument is.
    assert (await memories.set_default_model_route(project_id, None)).model_route_id is None
    assert (await memories.get_default_model_route(project_id)).model_route_id is None
    await memories.delete_model_route(route.id)
    await memories.delete_ai_provider(provider.id)
    assert (await memories.list_model_routes(project_id=project_id)).total == 0
    assert (await memories.list_ai_providers(project_id=project_id)).total == 0


async def test_api_keys_scope_and_revocation(
    memories: AsyncMemoriesClient, target: Memory, api_url: str
) -> None:
    created = await memories.create_api_key(target.project_id, ["memories:GetMemory"], name="reader")
    assert created.key.startswith("sk_") and created.prefix == created.key[:11]
    assert created.id in [k.id for k in (await memories.list_api_keys(project_id=target.project_id)).data]
    async with AsyncMemoriesClient(api_url, created.key) as reader:
        assert (await reader.get_memory(target.id)).id == target.id
        with pytest.raises(Forbidden) as denied:
            await reader.create_memory("not allowed")
        assert denied.value.status == 403 and denied.value.code == "FORBIDDEN"
        await memories.revoke_api_key(created.id)
        with pytest.raises(Unauthorized) as revoked:
            await reader.get_memory(target.id)
        assert revoked.value.status == 401 and revoked.value.code == "UNAUTHORIZED"
    listed = await memories.list_api_keys(project_id=target.project_id, include_revoked=True)
    assert [k.revoked_at is not None for k in listed.data if k.id == created.id] == [True]


async def test_a_pending_write_is_a_result_too(settings: Settings, target: Memory) -> None:
    """Not decided in time, a REST write and a tool call both answer pending with the write to follow; neither is
    an error, since the write is applied all the same (a model told "error" would write the fact again)."""
    impatient = settings.model_copy(update={"memories_write_timeout_s": 0.001})
    agent = {"id": "agent_1", "knowledge_config": {"write_memory_id": target.id, "extraction": False}}
    async for http in open_client(impatient):
        async with AsyncMemoriesClient(http=http) as memories:
            pending = await memories.create_entry(target.id, "A fact the writer decides later")
            assert (pending.status, pending.action, pending.entry) == ("pending", None, None)
            tool = await memories.write_memory("A fact the model gave late", agent, project_id=target.project_id)
            assert (tool.status, tool.action, tool.error, tool.entry_id) == ("pending", None, None, None)
            assert tool.message and "do not write it again" in tool.message
            for write_id, content in ((pending.write_id, "A fact the writer decides later"),
                                      (tool.write_id, "A fact the model gave late")):
                assert write_id
                for _ in range(200):
                    status = await memories.get_write(write_id)
                    if status.status != "pending":
                        break
                    await asyncio.sleep(0.05)
                assert status.status == "applied" and status.action is WriteAction.CREATED and status.entry_id
                assert (await memories.get_entry(status.entry_id)).content == content


async def test_the_blocking_client_over_http(api_url: str) -> None:
    def scenario() -> tuple[EntryWrite, EntryWrite, MemoriesError]:
        with MemoriesClient(api_url, ADMIN_TOKEN) as memories:
            project = memories.create_project("blocking client")
            memory = memories.create_memory("Notes", project_id=project.id)
            first = memories.create_entry(memory.id, EMAIL)
            second = memories.create_entry(memory.id, EMAIL)
            assert memories.list_entries(memory.id).total == 1
            try:
                memories.get_memory("mem_0000000000000000")
            except MemoriesError as exc:
                return first, second, exc
            raise AssertionError("a missing memory did not raise")

    # The writers run on the test loop: the blocking calls wait on a thread while it keeps running.
    first, second, missing = await asyncio.to_thread(scenario)
    assert (first.action, second.action) == (WriteAction.CREATED, WriteAction.SKIPPED)
    assert isinstance(missing, NotFound) and missing.code == "RESOURCE_NOT_FOUND"

    def with_a_wrong_token() -> None:
        with MemoriesClient(api_url, "not-a-token") as stranger:
            stranger.list_projects()

    with pytest.raises(Unauthorized):
        await asyncio.to_thread(with_a_wrong_token)


async def test_an_unreachable_service_is_a_typed_error() -> None:
    async with AsyncMemoriesClient(f"http://{LOOPBACK}:{free_port()}", ADMIN_TOKEN, timeout=5) as memories:
        with pytest.raises(ConnectionFailed) as unreachable:
            await memories.list_projects()
    assert unreachable.value.status is None and unreachable.value.code == "CONNECTION_FAILED"


def test_a_request_that_cannot_be_sent_is_refused_before_anything_is_sent(api_url: str) -> None:
    sent: list[httpx.Request] = []
    recording = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(500))
    memories = MemoriesClient("http://memories.test", "t", transport=recording)
    over_http = MemoriesClient(api_url, ADMIN_TOKEN)
    unsendable: list[Any] = [
        lambda: memories.create_entry("mem_a", "x", metadata={"score": float("nan")}),  # no JSON number
        lambda: memories.create_entry("mem_a", "x", tags={"a"}),  # type: ignore[arg-type]  # a set: no JSON
        lambda: memories.create_entry("mem_a", "x", metadata={"at": object()}),  # was httpx's TypeError
        lambda: memories.create_entry("mem_a", "x", idempotency_key="ключ"),  # no header value
        # Keys the service would refuse with a 400: refused alike, not sent.
        lambda: memories.create_entry("mem_a", "x", idempotency_key="a b"),
        lambda: memories.create_entry("mem_a", "x", idempotency_key=""),
        lambda: memories.create_entry("mem_a", "x", idempotency_key="k" * 256),
        lambda: memories.get_memory(""),  # "/memories/" is the list
        lambda: MemoriesClient("http://memories.test", "tökén"),
        lambda: MemoriesClient("http://[::1"),
        # No scheme httpx can use: the address is the caller's to fix (it was "cannot reach", as if the service were down).
        lambda: MemoriesClient("notaurl").get_memory("mem_a"),
        lambda: MemoriesClient("ftp://memories.test").get_memory("mem_a"),
        # Checked by the HTTP protocol on the way out: over a real connection.
        lambda: over_http.create_entry("mem_a", "x", idempotency_key=" padded "),
    ]
    with memories, over_http:
        for attempt in unsendable:
            with pytest.raises(InvalidRequest) as refused:
                attempt()
            assert refused.value.status is None and refused.value.code == "INVALID_REQUEST"
        with pytest.raises(InvalidRequest) as accented:  # was the codec's "'ascii' codec can't encode …"
            memories.create_entry("mem_a", "x", idempotency_key="clé")
        assert "Idempotency-Key must be 1 to 255 visible ASCII characters" in accented.value.message
    assert sent == []  # the mocked transport's cases never reached it


def test_a_request_left_unanswered_may_have_been_applied() -> None:
    with socket.create_server((LOOPBACK, 0)) as silent:  # accepts connections, never answers
        url = f"http://{LOOPBACK}:{silent.getsockname()[1]}"
        with MemoriesClient(url, "t", timeout=0.5) as memories, pytest.raises(TimedOut) as unanswered:
            memories.create_entry("mem_a", "x", idempotency_key="k1")
    assert unanswered.value.code == "TIMED_OUT" and "may have been applied" in unanswered.value.message
    assert isinstance(unanswered.value, ConnectionFailed)  # what a timeout raised before TimedOut existed


def test_errors_survive_pickling_and_copying() -> None:
    error = NotFound(404, "RESOURCE_NOT_FOUND", "no such memory", {"id": "mem_a"})
    for clone in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(clone) is NotFound and str(clone) == str(error)
        assert (clone.status, clone.code, clone.message, clone.meta) == (404, "RESOURCE_NOT_FOUND", "no such memory", {"id": "mem_a"})


@pytest.mark.parametrize(
    ("status", "body", "kind", "code"),
    [
        (502, "<html>Bad Gateway</html>", MemoriesError, "HTTP_502"),  # a proxy, not the API
        (503, '{"error": {"code": "SERVICE_UNAVAILABLE", "message": "bus down"}}', ServiceUnavailable, None),
        (
            409,
            '{"error": {"code": "CONFLICT", "message": "gone", "meta": {"write_id": "wr_1"}}}',
            Conflict,
            None,
        ),
        (200, "<html>a login page</html>", MemoriesError, "INVALID_RESPONSE"),
        (307, "", MemoriesError, "HTTP_307"),  # e.g. an empty id: "/memories/" redirects to the list
    ],
)
def test_answers_that_are_not_the_api_still_raise_typed_errors(
    status: int, body: str, kind: type[MemoriesError], code: str | None
) -> None:
    requested: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        requested.append(request.url.raw_path.decode())
        return httpx.Response(status, text=body)

    memories = MemoriesClient("http://memories.test/", "t", transport=httpx.MockTransport(answer))
    with memories, pytest.raises(kind) as raised:
        memories.get_memory("mem_a/../projects")
    assert type(raised.value) is kind and raised.value.status == status
    assert raised.value.code == (code or json.loads(body)["error"]["code"])
    # An id is one path segment: it cannot reach another route.
    assert requested == ["/api/v1/memories/mem_a%2F..%2Fprojects"]
