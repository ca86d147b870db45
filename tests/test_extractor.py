"""The extractor end to end: generation.completed on the real bus → two extractor replicas → writer →
PostgreSQL, with the scripted litellm provider."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import httpx
import nats
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import bus, registry, write_records
from shared.events import ExtractionSummary, GenerationAgent, GenerationCompleted, utcnow
from shared.extraction import ExtractionResult, Extractor, WritesPending, WritesRefused, candidate_write_id
from shared.llm import LlmError
from shared.logs import ContextFilter
from shared.scripted_llm import CustomLLMError, ScriptedLLM  # after the cost-map setting
from shared.settings import Settings
from shared.write_gateway import WriteGateway
from tests.conftest import WriterWithoutEmbedder, open_api

FACTS = ["The user lives in Porto", "The user is allergic to peanuts", "The user's budget is 40,000 euros"]


def extraction_only(facts: list[str]) -> Any:
    """The facts for the extraction prompt; a blank answer to a merge prompt (so similar facts create)."""

    def reply(messages: list[dict[str, Any]]) -> str:
        return "" if messages[0]["role"] == "system" else json.dumps(facts)

    return reply


@pytest.fixture(autouse=True)
def _extractors(extractors: list[Any]) -> None:
    """Every test here needs the extractor replicas running."""


def turn_body(memory: dict[str, Any], model: str, generation_id: str, **fields: Any) -> dict[str, Any]:
    config = fields.pop("config", {"writeMemoryId": memory["id"], "extraction": True})
    return {
        "project_id": memory["project_id"],
        "generation_id": generation_id,
        "conversation_id": "conv_1",
        "agent": {"id": "agent_1", "model": model, "knowledge_config": config},
        "messages": [{"role": "user", "content": "Hi! I moved to Porto and I am allergic to peanuts."}],
        "output": "Welcome to Porto! I'll remember the allergy.",
        **fields,
    }


async def finished(client: httpx.AsyncClient, memory: dict[str, Any], generation_id: str) -> dict[str, Any]:
    for _ in range(300):
        response = await client.get(
            f"/generations/{generation_id}/extraction", params={"project_id": memory["project_id"]}
        )
        if response.status_code == 200 and response.json()["status"] != "pending":
            return response.json()
        await asyncio.sleep(0.05)
    raise AssertionError(f"extraction of {generation_id} never finished")


async def entries(client: httpx.AsyncClient, memory_id: str) -> list[dict[str, Any]]:
    return (await client.get("/memory-entries", params={"memory_id": memory_id, "limit": 100})).json()["data"]


async def test_extraction_writes_each_fact_with_provenance(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    model = llm.script("extract-facts", json.dumps(FACTS))
    accepted = await client.post("/generations/completed", json=turn_body(memory, model, "gen_facts"))
    assert accepted.status_code == 202 and accepted.json()["status"] == "pending"
    outcome = await finished(client, memory, "gen_facts")
    assert outcome["status"] == "completed" and outcome["model"] == model
    assert outcome["summary"] == {"candidates": 3, "created": 3, "updated": 0, "skipped": 0, "failed": 0}
    stored = await entries(client, memory["id"])
    assert sorted(e["content"] for e in stored) == sorted(FACTS)
    assert all(e["source_type"] == "extraction" for e in stored)
    assert all(e["source_generation_id"] == "gen_facts" and e["source_conversation_id"] == "conv_1" for e in stored)
    [call] = llm.calls_to("extract-facts")
    prompt = call.messages[0]["content"]
    assert call.temperature == 0 and "JSON array of strings" in prompt
    assert prompt.endswith("assistant: Welcome to Porto! I'll remember the allergy.")
    # Reported again: told it is extracted already, not that it is pending, and not extracted twice.
    again = await client.post("/generations/completed", json=turn_body(memory, model, "gen_facts"))
    assert again.status_code == 200 and again.json() == {"generation_id": "gen_facts", "status": "completed"}
    assert len(llm.calls_to("extract-facts")) == 1


async def test_skipped_turns_say_why(client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM) -> None:
    model = llm.script("extract-never", json.dumps(FACTS))
    cases = {
        "gen_streamed": {"streamed": True},
        "gen_opted_out": {"extract": False},
        "gen_requires_action": {"status": "requires_action"},
        "gen_disabled": {"config": {"writeMemoryId": memory["id"]}},
        "gen_no_target": {"config": {"extraction": True}, "extract": True},
    }
    for generation_id, fields in cases.items():
        await client.post("/generations/completed", json=turn_body(memory, model, generation_id, **fields))
    reasons = {g: (await finished(client, memory, g))["reason"] for g in cases}
    assert reasons == {
        "gen_streamed": "streamed",
        "gen_opted_out": "turn_opted_out",
        "gen_requires_action": "status_requires_action",
        "gen_disabled": "extraction_disabled",
        "gen_no_target": "no_write_memory_id",
    }
    assert llm.calls_to("extract-never") == [] and await entries(client, memory["id"]) == []


async def test_a_turns_agent_is_read_in_camel_case_too(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    """Platforms store agents camelCase. `aiProviderId` was ignored (only `knowledgeConfig` was read so), and the
    turn was extracted with the agent's bare model instead of the provider it names."""
    model = llm.script("extract-camel", json.dumps(FACTS))
    body = turn_body(memory, model, "gen_camel")
    body["agent"] = {"id": "agent_1", "model": model, "aiProviderId": "aip_gone",
                     "knowledgeConfig": {"writeMemoryId": memory["id"], "extraction": True}}
    assert (await client.post("/generations/completed", json=body)).status_code == 202
    outcome = await finished(client, memory, "gen_camel")
    assert outcome["status"] == "skipped" and "ai_provider_id names no provider" in outcome["reason"], outcome
    assert llm.calls_to("extract-camel") == []
    # Its ids are bounded like every id: they reach logs and stored reasons. Two spellings disagreeing are refused.
    for agent in ({"modelRouteId": "r" * 256}, {"aiProviderId": "aip_a", "ai_provider_id": "aip_b"}):
        body["agent"] = {**agent, "knowledgeConfig": {"writeMemoryId": memory["id"]}}
        refused = await client.post("/generations/completed", json={**body, "generation_id": "gen_camel_bad"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "VALIDATION_FAILED", refused.text


async def test_custom_prompt_keeps_the_contract(client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM) -> None:
    model = llm.script("extract-custom", "[]")
    config = {"write_memory_id": memory["id"], "extraction": {"prompt": "Only extract where the user lives."}}
    await client.post("/generations/completed", json=turn_body(memory, model, "gen_custom", config=config))
    outcome = await finished(client, memory, "gen_custom")
    assert outcome["status"] == "completed" and outcome["summary"]["candidates"] == 0
    prompt = llm.calls_to("extract-custom")[0].messages[0]["content"]
    assert prompt.startswith("Only extract where the user lives.")
    assert "JSON array of strings and nothing else" in prompt and "Conversation:\nuser: Hi!" in prompt


async def test_malformed_output_completes_with_no_candidates(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    model = llm.script("extract-garbage", "I could not find any facts, sorry.")
    await client.post("/generations/completed", json=turn_body(memory, model, "gen_garbage"))
    outcome = await finished(client, memory, "gen_garbage")
    assert outcome["status"] == "completed" and outcome["summary"]["candidates"] == 0
    assert await entries(client, memory["id"]) == []


async def test_at_most_twenty_and_duplicates_collapse(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    topics = ["tea", "Lisbon", "cycling", "jazz", "Python", "sushi", "chess", "Berlin", "yoga", "hiking", "opera",
              "golf", "Rome", "piano", "surfing", "ramen", "Kyoto", "tennis", "poetry", "sailing", "skiing", "Oslo"]
    facts = ["The user loves tea", "The user loves tea"] + [f"The user is interested in {t}" for t in topics]
    model = llm.script("extract-many", extraction_only(facts))
    await client.post("/generations/completed", json=turn_body(memory, model, "gen_many"))
    summary = (await finished(client, memory, "gen_many"))["summary"]
    assert summary["candidates"] == 20
    assert summary["created"] + summary["updated"] + summary["skipped"] + summary["failed"] == 20
    assert summary["skipped"] >= 1  # the repeated fact
    stored = await entries(client, memory["id"])
    assert [e["content"] for e in stored].count("The user loves tea") == 1
    assert len(stored) == summary["created"]


def turn_event(memory: dict[str, Any], model: str, generation_id: str, said: str = "facts") -> GenerationCompleted:
    """A completed turn as the bus carries it, extracting into `memory`."""
    return GenerationCompleted(
        event_id=f"evt_{generation_id}", project_id=memory["project_id"], generation_id=generation_id,
        agent=GenerationAgent(model=model, knowledge_config={"write_memory_id": memory["id"], "extraction": True}),
        messages=[{"role": "user", "content": said}],
    )


@asynccontextmanager
async def direct_gateway(settings: Settings, sessions: async_sessionmaker[AsyncSession]) -> AsyncIterator[WriteGateway]:
    """For an `Extractor` run in the test itself (not by the replicas): its writes go to the running writers."""
    nc = await nats.connect(settings.nats_url)
    try:
        gateway = WriteGateway(nc, sessions, settings.memories_partitions)
        await gateway.start()
        yield gateway
    finally:
        await nc.close()


async def test_a_slow_turn_holds_up_no_other_turn(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    # A fetched batch was handled together, the next fetched only when all of it was done: one turn waiting on a
    # slow model (or on its writes, up to ten minutes) held every other turn of the replica for as long.
    slow = llm.script("extract-slow", json.dumps(["The user is patient"]), latency_s=20.0)
    quick = llm.script("extract-quick", json.dumps(["The user is quick"]))
    for n in range(2):  # one after the other: each fetched alone, by either replica
        await client.post("/generations/completed", json=turn_body(memory, slow, f"gen_slow_{n}"))
        for _ in range(200):  # with its model
            if len(llm.calls_to("extract-slow")) > n:
                break
            await asyncio.sleep(0.05)
        assert len(llm.calls_to("extract-slow")) == n + 1
    await asyncio.sleep(0.3)
    for n in range(4):
        await client.post("/generations/completed", json=turn_body(memory, quick, f"gen_quick_{n}"))
    for n in range(4):
        assert (await finished(client, memory, f"gen_quick_{n}"))["status"] == "completed"
    for n in range(2):
        waiting = await client.get(f"/generations/gen_slow_{n}/extraction", params={"project_id": memory["project_id"]})
        assert waiting.json()["status"] == "pending"  # still with its model: the quick turns did not wait for it
    for n in range(2):
        await asyncio.sleep(1.0)
        for _ in range(30):  # finished polls 15 s: the model answers after 20
            status = await client.get(f"/generations/gen_slow_{n}/extraction", params={"project_id": memory["project_id"]})
            if status.json()["status"] != "pending":
                break
            await asyncio.sleep(1.0)
        assert status.json()["status"] == "completed"


async def test_a_redelivered_turn_writes_nothing_twice(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    model = llm.script("extract-redelivered", json.dumps(FACTS))
    event = turn_event(memory, model, "gen_redelivered")
    nc = await nats.connect(settings.nats_url)
    try:
        for msg_id in ("first", "second"):  # distinct ids: the stream's duplicate window does not help here
            await nc.jetstream().publish(
                bus.generation_completed_subject(memory["project_id"]), event.model_dump_json().encode(),
                stream=bus.GENERATIONS_STREAM, headers={"Nats-Msg-Id": msg_id + event.generation_id},
            )
            await finished(client, memory, "gen_redelivered")
        await asyncio.sleep(0.5)
        # Announced once: the second delivery's notice has the first's message id (two notices before).
        notices = await nc.jetstream().pull_subscribe(
            bus.extraction_completed_subject(memory["project_id"]), stream=bus.GENERATIONS_STREAM
        )
        announced = [json.loads(m.data)["generation_id"] for m in await notices.fetch(100, timeout=2)]
    finally:
        await nc.close()
    assert announced.count("gen_redelivered") == 1
    assert len(await entries(client, memory["id"])) == 3
    assert len(llm.calls_to("extract-redelivered")) == 1


def test_a_retry_that_fails_again_is_announced_too() -> None:
    # Every failure of a turn had one notice id: a retry failing again within the duplicate window announced nothing.
    from services.extractor.main import _notice_id
    from shared.events import ExtractionSummary

    first = turn_event({"project_id": "proj_x", "id": "mem_x"}, "scripted/x", "gen_x")
    retry = first.model_copy(update={"event_id": "evt_retry"})
    failed, completed = (ExtractionResult(status, None, ExtractionSummary()) for status in ("failed", "completed"))
    assert _notice_id(first, failed) != _notice_id(retry, failed)
    assert _notice_id(first, failed) == _notice_id(first, failed)  # the same delivery again: one notice
    assert _notice_id(first, completed) == _notice_id(retry, completed)  # one turn completes once


async def test_a_turn_retried_while_its_writes_wait_writes_the_first_answer_not_a_second(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    # The model words the facts differently each time it is asked (as real models do).
    answers = iter([["The customer's birthday is on 3 May"], ["The client was born on the third of May"]])
    model = llm.script("extract-reworded", lambda _messages: json.dumps(next(answers)))
    event = turn_event(memory, model, "gen_reworded", "My birthday is on 3 May.")
    async with direct_gateway(settings, sessions) as gateway:
        impatient = Extractor(sessions, gateway, llm_timeout=5, write_timeout=0.001)
        with pytest.raises(WritesPending):  # the writes are queued, not decided in time: the event is retried
            await impatient.extract(event)
        result = await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(event)
    assert result.status == "completed" and result.summary.candidates == 1
    assert len(llm.calls_to("extract-reworded")) == 1
    async with sessions() as session:  # written, so no longer kept
        assert (await registry.get_extraction(session, memory["project_id"], "gen_reworded")).facts is None
    assert [e["content"] for e in await entries(client, memory["id"])] == ["The customer's birthday is on 3 May"]


async def test_a_turn_retried_after_its_provider_was_removed_writes_the_facts_the_model_gave(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    # The retry resolved the agent's provider first, found it gone, and stored the turn as skipped: the saved facts
    # not written yet were dropped for good, and the turn said it had nothing, though some were written.
    llm.script("extract-then-gone", json.dumps(FACTS[:1]))
    provider = (await client.post("/ai-providers", json={"project_id": memory["project_id"], "name": "soon gone",
                                                          "provider": "scripted", "default_model": "extract-then-gone"}))
    event = turn_event(memory, "unused", "gen_provider_gone").model_copy(update={"agent": GenerationAgent(
        ai_provider_id=provider.json()["id"], knowledge_config={"write_memory_id": memory["id"], "extraction": True})})
    async with direct_gateway(settings, sessions) as gateway:
        with pytest.raises(WritesPending):
            await Extractor(sessions, gateway, llm_timeout=5, write_timeout=0.001).extract(event)
        assert (await client.delete(f"/ai-providers/{provider.json()['id']}")).status_code == 204
        result = await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(event)
    assert result.status == "completed" and result.summary.candidates == 1, result
    assert result.model == "scripted/extract-then-gone"
    assert [e["content"] for e in await entries(client, memory["id"])] == FACTS[:1]


async def test_an_unreadable_answer_fails_over_to_the_routes_next_target(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    # The answer was read after the failover loop: a target that cut its answer off was asked again at every
    # delivery, and the turn dead-lettered, its route's next target never asked.
    llm.script("cut-off", '["The user lives in Por')
    llm.script("whole", json.dumps(FACTS[:1]))
    project_id = memory["project_id"]
    provider = (await client.post("/ai-providers", json={"project_id": project_id, "name": "two",
                                                          "provider": "scripted"})).json()
    route = (await client.post("/model-routes", json={"project_id": project_id, "name": "cut", "targets": [
        {"ai_provider_id": provider["id"], "model": "cut-off"}, {"ai_provider_id": provider["id"], "model": "whole"},
    ]})).json()
    body = turn_body(memory, "unused", "gen_cut_off")
    body["agent"] = {"id": "agent_1", "model_route_id": route["id"],
                     "knowledge_config": {"write_memory_id": memory["id"], "extraction": True}}
    await client.post("/generations/completed", json=body)
    outcome = await finished(client, memory, "gen_cut_off")
    assert outcome["status"] == "completed" and outcome["model"] == "scripted/whole", outcome
    assert outcome["summary"]["candidates"] == 1 and len(llm.calls_to("cut-off")) == 1


async def test_a_failed_attempt_keeps_the_saved_facts_and_model_and_never_undoes_a_completed_turn(
    memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    project_id = memory["project_id"]
    async with sessions.begin() as session:
        await registry.save_extracted_facts(session, project_id, "gen_kept", ["Lunch is at noon"], "scripted/b")
        await registry.save_extraction(session, project_id, "gen_kept", ExtractionResult("failed", "x", ExtractionSummary()))
    async with sessions() as session:
        kept = await registry.get_extraction(session, project_id, "gen_kept")
    # The retry merges with the model that answered, not the route's first target.
    assert (kept.status, kept.facts, kept.model) == ("failed", ["Lunch is at noon"], "scripted/b")
    # Two deliveries of one turn at once: the late one's failure (or skip) leaves the other's completion standing.
    done = ExtractionResult("completed", None, ExtractionSummary(candidates=1, created=1), "scripted/b")
    async with sessions.begin() as session:
        assert await registry.save_extraction(session, project_id, "gen_kept", done) is True
        for late in ("failed", "skipped"):
            late_result = ExtractionResult(late, "late", ExtractionSummary())
            assert await registry.save_extraction(session, project_id, "gen_kept", late_result) is False
    async with sessions() as session:
        kept = await registry.get_extraction(session, project_id, "gen_kept")
    assert (kept.status, kept.created, kept.model) == ("completed", 1, "scripted/b")
    # The late delivery's caller is told the turn's outcome, so it neither dead-letters nor announces a failure.
    extractor = Extractor(sessions, None, llm_timeout=5, write_timeout=5)  # type: ignore[arg-type]
    told = await extractor.record_failure(turn_event(memory, "unused", "gen_kept"), "late")
    assert (told.status, told.replayed, told.summary.created) == ("completed", True, 1)


def recorded_publishes(monkeypatch: pytest.MonkeyPatch, refused: str | None = None) -> list[str]:
    """The facts the write gateway publishes, in order, as they go; the bus refuses the one that is `refused`."""
    published: list[str] = []
    publish = bus.publish_or_refuse

    async def recorded(nc: Any, subject: str, payload: bytes, **kwargs: Any) -> Any:
        content = json.loads(payload)["content"]
        if content == refused:
            raise bus.BusUnavailable("the stream refused it")
        published.append(content)
        return await publish(nc, subject, payload, **kwargs)

    monkeypatch.setattr(bus, "publish_or_refuse", recorded)
    return published


async def test_a_turns_facts_are_published_in_the_models_order(
    settings: Settings, memory: dict[str, Any], llm: ScriptedLLM, sessions: async_sessionmaker[AsyncSession],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each fact was published as soon as its own claim was stored, in whatever order those came back: a later fact
    # that corrects an earlier one ("the budget is now 40k") could be decided first, and be the one superseded.
    facts = [f"The budget was revised, version {n}" for n in range(5)]
    model = llm.script("extract-ordered", json.dumps(facts))
    claim = write_records.claim_write_id

    async def slower_for_earlier_facts(session: AsyncSession, write_id: str, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.05 * (len(facts) - order_of[write_id]))  # the last fact's claim returns first
        return await claim(session, write_id, *args, **kwargs)

    event = turn_event(memory, model, "gen_ordered")
    order_of = {candidate_write_id(event.project_id, event.generation_id, n, fact): n for n, fact in enumerate(facts)}
    monkeypatch.setattr(write_records, "claim_write_id", slower_for_earlier_facts)
    published = recorded_publishes(monkeypatch)
    async with direct_gateway(settings, sessions) as gateway:
        result = await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(event)
    assert result.status == "completed" and published == facts


async def test_a_fact_the_bus_refused_holds_back_the_facts_after_it(
    settings: Settings, memory: dict[str, Any], llm: ScriptedLLM, sessions: async_sessionmaker[AsyncSession],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The facts after it were published all the same, and the refused one again on the turn's retry: after them.
    facts = [f"The office moved, step {n}" for n in range(4)]
    model = llm.script("extract-refused", json.dumps(facts))
    published = recorded_publishes(monkeypatch, refused=facts[2])
    async with direct_gateway(settings, sessions) as gateway:
        with pytest.raises(bus.BusUnavailable, match="the stream refused it"):  # the cause, not the ones held back
            await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(turn_event(memory, model, "gen_refused"))
    assert published == facts[:2]


async def test_facts_refused_while_the_embedder_is_down_are_written_when_the_turn_is_retried(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    model = llm.script("extract-embedder-down", json.dumps(FACTS[:2]))
    event = turn_event(memory, model, "gen_embedder_down")

    with pytest.raises(WritesRefused, match="2 of 2 writes refused"):  # not a completed turn with two failed facts
        await Extractor(sessions, WriterWithoutEmbedder(sessions), llm_timeout=5, write_timeout=15).extract(event)  # type: ignore[arg-type]
    async with direct_gateway(settings, sessions) as gateway:
        result = await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(event)
    assert result.status == "completed"
    assert result.summary.created == 2 and result.summary.failed == 0
    assert sorted(e["content"] for e in await entries(client, memory["id"])) == sorted(FACTS[:2])
    assert len(llm.calls_to("extract-embedder-down")) == 1  # the retry writes the facts the model gave first


async def test_an_outage_is_waited_out_in_place_not_counted_as_a_delivery(settings: Settings) -> None:
    from sqlalchemy.exc import OperationalError

    from services.extractor.main import ExtractorService
    from shared.events import ExtractionSummary

    done = ExtractionResult("completed", None, ExtractionSummary())
    outcomes: list[Any] = [
        OperationalError("SELECT 1", {}, Exception("the database is down")),
        bus.BusUnavailable("no servers"),
        WritesRefused("1 of 1 writes refused while a dependency was down"),
        # The writer down: dead-lettered after ~80 s, the turn was left failed while its facts were written later.
        WritesPending("1 of 1 writes not decided in time", ["wr_queued"]),
        WritesPending("1 of 1 writes not decided in time", ["wr_queued"]),
        done,
    ]
    # Queued writes are waited for, not submitted again (extracted again, the turn published a fact anew each time
    # its claim went stale: a copy on the stream every ~40 s): extracted again only once they are decided.
    decisions = [False, False, True, True]

    class ThroughOutages:
        async def extract(self, _event: GenerationCompleted, **_options: Any) -> ExtractionResult:
            outcome = outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        async def decided(self, write_ids: list[str]) -> bool:
            assert write_ids == ["wr_queued"]
            return decisions.pop(0)

    service = ExtractorService(settings.model_copy(update={"memories_retry_backoff_s": 0.01}))
    service._extractor = ThroughOutages()  # type: ignore[assignment]
    event = GenerationCompleted(event_id="evt_x", project_id="proj_x", generation_id="gen_x", agent=GenerationAgent())
    assert await service.extract_through_outages(event, arrived_at=None) is done and outcomes == []
    assert decisions == []
    # Anything else is the turn's own failure: handed to the caller, which counts it towards MEMORIES_MAX_DELIVER.
    outcomes[:] = [LlmError("the model failed")]
    with pytest.raises(LlmError):
        await service.extract_through_outages(event, arrived_at=None)
    # So are queued facts that outlast the patience (a partition no writer reads): the turn is handed back.
    import services.extractor.main as extractor_main

    pending = WritesPending("1 of 1 writes not decided in time", ["wr_queued"])
    outcomes[:] = [pending] * 50 + [done]
    decisions[:] = [True] * 100
    with pytest.MonkeyPatch.context() as patience:
        patience.setattr(extractor_main, "QUEUED_WRITES_PATIENCE_S", 0.05)
        with pytest.raises(WritesPending):
            await service.extract_through_outages(event, arrived_at=None)
    assert done in outcomes
    # So are refusals that outlast MEMORIES_MAX_DELIVER waits: a text the embedder always rejects looks the same.
    refused = WritesRefused("1 of 1 writes refused while a dependency was down")
    outcomes[:] = [refused] * (settings.memories_max_deliver + 1) + [done]
    with pytest.raises(WritesRefused):
        await service.extract_through_outages(event, arrived_at=None)
    assert outcomes == [done]


async def test_a_turn_older_than_a_forgetting_of_its_conversation_is_written_without_it(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    model = llm.script("extract-forgotten", lambda messages: json.dumps([messages[0]["content"].split("user: ")[1]]))
    ended_before = turn_event(memory, model, "gen_before", "The user drives a blue van.")
    ended_before = ended_before.model_copy(update={"conversation_id": "conv_cleared"})
    await client.delete("/conversations/conv_cleared/provenance", params={"project_id": memory["project_id"]})
    ended_after = turn_event(memory, model, "gen_after", "The user plays the cello.")
    ended_after = ended_after.model_copy(update={"conversation_id": "conv_cleared"})
    async with direct_gateway(settings, sessions) as gateway:
        for turn in (ended_before, ended_after):
            result = await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(turn)
            assert result.status == "completed" and result.summary.created == 1
    cited = {e["content"]: e["source_conversation_id"] for e in await entries(client, memory["id"])}
    assert cited == {"The user drives a blue van.": None, "The user plays the cello.": "conv_cleared"}


async def test_a_turn_reported_again_after_a_forgetting_is_as_old_as_its_first_report(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    forget = {"params": {"project_id": memory["project_id"]}}
    # Its extraction fails (a model that is down); meanwhile its conversation is forgotten.
    down = llm.script("extract-down", RuntimeError("the model is down"))
    body = turn_body(memory, down, "gen_reported_again", conversation_id="conv_forgotten_since")
    assert (await client.post("/generations/completed", json=body)).status_code == 202
    assert (await finished(client, memory, "gen_reported_again"))["status"] == "failed"
    await client.delete("/conversations/conv_forgotten_since/provenance", **forget)
    # Reported again with a working model: its fact does not bring the conversation back.
    model = llm.script("extract-reported-again", json.dumps(["The user rides a green bicycle"]))
    body["agent"]["model"] = model
    assert (await client.post("/generations/completed", json=body)).status_code == 202
    assert (await finished(client, memory, "gen_reported_again"))["status"] == "completed"
    # A platform that reports a turn late names when it ended.
    ended = utcnow()
    await client.delete("/conversations/conv_forgotten_later/provenance", **forget)
    model = llm.script("extract-reported-late", json.dumps(["The user keeps bees"]))
    late = turn_body(memory, model, "gen_reported_late", conversation_id="conv_forgotten_later",
                     occurred_at=ended.isoformat())
    assert (await client.post("/generations/completed", json=late)).status_code == 202
    assert (await finished(client, memory, "gen_reported_late"))["status"] == "completed"
    cited = {e["content"]: e["source_conversation_id"] for e in await entries(client, memory["id"])}
    assert cited == {"The user rides a green bicycle": None, "The user keeps bees": None}


def from_a_clock_ahead(turn: GenerationCompleted, conversation_id: str) -> GenerationCompleted:
    """The turn as a platform whose clock runs an hour ahead stamps it."""
    return turn.model_copy(update={"conversation_id": conversation_id, "occurred_at": utcnow() + timedelta(hours=1)})


async def cited_by_its_fact(
    settings: Settings, sessions: async_sessionmaker[AsyncSession], client: httpx.AsyncClient,
    memory: dict[str, Any], turn: GenerationCompleted, **delivery: Any,
) -> str | None:
    """Extract `turn` (one fact); the conversation its entry cites."""
    async with direct_gateway(settings, sessions) as gateway:
        result = await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(turn, **delivery)
    assert result.status == "completed" and result.summary.created == 1
    [entry] = await entries(client, memory["id"])
    return entry["source_conversation_id"]


async def test_a_turn_stamped_by_a_clock_running_ahead_is_not_newer_than_a_forgetting_made_meanwhile(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM,
    sessions: async_sessionmaker[AsyncSession], monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = llm.script("extract-ahead", json.dumps(["The user collects stamps."]))
    ahead = from_a_clock_ahead(turn_event(memory, model, "gen_ahead", "I collect stamps."), "conv_ahead")
    ask_model = Extractor._complete

    async def forgotten_while_the_model_answers(self: Extractor, *args: Any) -> Any:
        await client.delete("/conversations/conv_ahead/provenance", params={"project_id": memory["project_id"]})
        return await ask_model(self, *args)

    monkeypatch.setattr(Extractor, "_complete", forgotten_while_the_model_answers)
    assert await cited_by_its_fact(settings, sessions, client, memory, ahead) is None


async def test_a_redelivered_turn_keeps_the_time_it_reached_the_bus(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    # Delivered again after a forgetting (its model failed the first time), by a platform whose clock runs ahead:
    # its time is when it reached the bus, the same on every delivery, not this delivery's.
    model = llm.script("extract-redelivered-ahead", json.dumps(["The user keeps bees."]))
    reached_bus = utcnow()
    again = from_a_clock_ahead(turn_event(memory, model, "gen_again", "I keep bees."), "conv_again")
    await client.delete("/conversations/conv_again/provenance", params={"project_id": memory["project_id"]})
    assert await cited_by_its_fact(settings, sessions, client, memory, again, arrived_at=reached_bus) is None


async def test_a_rate_limited_model_is_asked_again_after_a_pause(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    refusals = iter(range(2))

    def reply(_messages: list[dict[str, Any]]) -> str:
        if next(refusals, None) is not None:  # the first two calls: HTTP 429, as a provider says "slow down"
            raise CustomLLMError(status_code=429, message="rate limit reached")
        return json.dumps(["The user rides a red bicycle"])

    model = llm.script("extract-rate-limited", reply)
    event = turn_event(memory, model, "gen_rate_limited", "I ride a red bicycle.")
    async with direct_gateway(settings, sessions) as gateway:
        result = await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(event)
    # Retried on the same target within this delivery, not failed over or left to a redelivery.
    assert result.status == "completed" and result.summary.created == 1
    assert len(llm.calls_to("extract-rate-limited")) == 3


async def test_a_target_rate_limited_to_the_last_attempt_fails_over_without_a_pause(
    memory: dict[str, Any], llm: ScriptedLLM, sessions: async_sessionmaker[AsyncSession],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After its last attempt the extraction still paused (up to 8 s) before it asked the next target.
    from shared import extraction
    from shared.providers import Target

    pauses: list[int] = []

    async def pause(attempt: int) -> None:
        pauses.append(attempt)

    monkeypatch.setattr(extraction, "_pause_after_rate_limit", pause)
    def slow_down(_messages: list[dict[str, Any]]) -> str:
        raise CustomLLMError(status_code=429, message="rate limit reached")

    limited = llm.script("always-limited", slow_down)
    second = llm.script("second-target", json.dumps(["A fact"]))
    extractor = Extractor(sessions, None, llm_timeout=5, write_timeout=5, rate_limit_retries=2)  # type: ignore[arg-type]
    event = turn_event(memory, limited, "gen_limited")
    target, _completion = await extractor._complete(event, [Target(limited), Target(second)], [{"role": "user",
                                                                                                  "content": "hi"}])
    assert target.model == second and len(llm.calls_to("always-limited")) == 3
    assert pauses == [0, 1]


async def test_failover_to_the_second_route_target_and_usage(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    llm.script("primary", RuntimeError("primary is down"))
    llm.script("secondary", json.dumps(FACTS[:1]))
    project_id = memory["project_id"]
    provider = (await client.post("/ai-providers", json={"project_id": project_id, "name": "scripted",
                                                          "provider": "scripted"})).json()
    route = await client.post("/model-routes", json={"project_id": project_id, "name": "failover", "targets": [
        {"ai_provider_id": provider["id"], "model": "primary"},
        {"ai_provider_id": provider["id"], "model": "secondary"},
    ]})
    assert route.status_code == 201, route.text
    body = turn_body(memory, "unused", "gen_failover")
    body["agent"] = {"id": "agent_1", "model_route_id": route.json()["id"],
                     "knowledge_config": {"write_memory_id": memory["id"], "extraction": True}}
    await client.post("/generations/completed", json=body)
    outcome = await finished(client, memory, "gen_failover")
    assert outcome["status"] == "completed" and outcome["model"] == "scripted/secondary"
    assert len(llm.calls_to("primary")) == 1 and len(llm.calls_to("secondary")) == 1
    usage = (await client.get("/usage", params={"project_id": project_id})).json()["data"]
    assert [(u["model"], u["purpose"], u["ai_provider_id"]) for u in usage] == [
        ("scripted/secondary", "extraction", provider["id"])
    ]
    # A provider that a route still names cannot go: the route would fail every call it serves, silently.
    refused = await client.delete(f"/ai-providers/{provider['id']}")
    assert refused.status_code == 409 and refused.json()["error"]["meta"]["model_route_ids"] == [route.json()["id"]]
    assert (await client.delete(f"/model-routes/{route.json()['id']}")).status_code == 204
    assert (await client.delete(f"/ai-providers/{provider['id']}")).status_code == 204


async def test_a_fact_with_a_broken_character_is_written_not_retried_for_ever(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    # A lone surrogate escaped in the model's JSON: valid JSON, but no UTF-8 text can hold it.
    model = llm.script("extract-surrogate", '["The user lives in Porto \\ud800"]')
    await client.post("/generations/completed", json=turn_body(memory, model, "gen_surrogate"))
    outcome = await finished(client, memory, "gen_surrogate")
    assert outcome["status"] == "completed" and outcome["summary"]["created"] == 1
    assert [e["content"] for e in await entries(client, memory["id"])] == ["The user lives in Porto \ufffd"]
    assert len(llm.calls_to("extract-surrogate")) == 1


async def test_a_turn_the_model_always_rejects_is_dead_lettered(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    model = llm.script("extract-poison", RuntimeError("context length exceeded"))
    nc = await nats.connect(settings.nats_url)
    try:
        dead = await nc.jetstream().subscribe(
            f"{bus.DEAD_LETTER_ROOT}.extractor", stream=bus.DEAD_LETTER_STREAM,
            deliver_policy=nats.js.api.DeliverPolicy.NEW,
        )
        await client.post("/generations/completed", json=turn_body(memory, model, "gen_poison"))
        letter = json.loads((await dead.next_msg(timeout=30)).data)
        assert "context length exceeded" in letter["reason"]
    finally:
        await nc.close()
    outcome = await finished(client, memory, "gen_poison")
    assert outcome["status"] == "failed" and "context length exceeded" in outcome["reason"]
    assert len(llm.calls_to("extract-poison")) == settings.memories_max_deliver
    # Reported again once the model works, within the stream's duplicate window: a retry, extracted this time.
    llm.script("extract-poison", json.dumps(["The user retried the turn"]))
    again = await client.post("/generations/completed", json=turn_body(memory, model, "gen_poison"))
    assert again.status_code == 202
    outcome = await finished(client, memory, "gen_poison")
    assert outcome["status"] == "completed" and outcome["summary"]["created"] == 1
    # Once extracted, the turn delivered again (past the stream's duplicate window) is answered from its record.
    calls = len(llm.calls_to("extract-poison"))
    async with direct_gateway(settings, sessions) as gateway:
        again = await Extractor(sessions, gateway, llm_timeout=5, write_timeout=15).extract(
            turn_event(memory, model, "gen_poison"))
    assert again.status == "completed" and again.summary.created == 1
    assert len(llm.calls_to("extract-poison")) == calls


@pytest.mark.parametrize("body_project", ["another", "no id"])
async def test_a_turn_naming_another_project_than_its_subject_is_dead_lettered(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], llm: ScriptedLLM, body_project: str
) -> None:
    # Published on project A's subject, a body naming project B (and B's memory) was extracted into B: a platform
    # limited to its own project's subject could write into another's memories. A project id that is no id (a NUL)
    # failed every query, and every delivery, for ever.
    model = llm.script("extract-foreign", json.dumps(["The user lives in Lisbon"]))
    other = (await client.post("/projects", json={"name": "other"})).json()
    target = (await client.post("/memories", json={"project_id": other["id"], "name": "theirs"})).json()
    foreign = turn_event(target, model, f"gen_foreign_{body_project.replace(' ', '_')}")
    subject_project = memory["project_id"]
    if body_project == "no id":  # on its own subject, no other project's: only the id itself is wrong
        foreign = foreign.model_copy(update={"project_id": "proj_short"})
        subject_project = "proj_short"
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        dead = await js.subscribe(f"{bus.DEAD_LETTER_ROOT}.extractor", stream=bus.DEAD_LETTER_STREAM,
                                  deliver_policy=nats.js.api.DeliverPolicy.NEW)
        await js.publish(bus.generation_completed_subject(subject_project), foreign.model_dump_json().encode(),
                         stream=bus.GENERATIONS_STREAM)
        letter = json.loads((await dead.next_msg(timeout=15)).data)
    finally:
        await nc.close()
    assert "not the one its subject names" in letter["reason"]
    assert llm.calls_to("extract-foreign") == [] and await entries(client, target["id"]) == []


async def test_a_turn_too_long_for_the_model_is_skipped_not_asked_again(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    # A prompt past the context window failed every delivery (five paid calls), then the turn was dead-lettered.
    import litellm

    def too_long(_messages: list[dict[str, Any]]) -> str:
        raise litellm.ContextWindowExceededError("maximum context length exceeded", "scripted/too-long", "scripted")

    model = llm.script("too-long", too_long)
    await client.post("/generations/completed", json=turn_body(memory, model, "gen_too_long"))
    outcome = await finished(client, memory, "gen_too_long")
    assert outcome["status"] == "skipped" and "does not fit the model's context window" in outcome["reason"]
    assert len(llm.calls_to("too-long")) == 1


async def test_a_turn_that_fails_unexpectedly_is_dead_lettered_not_retried_for_ever(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = 0
    extract = Extractor.extract

    async def buggy(self: Extractor, event: GenerationCompleted, **options: Any) -> Any:
        nonlocal attempts
        if event.generation_id != "gen_bug":
            return await extract(self, event, **options)
        attempts += 1
        raise KeyError("a bug this turn meets on every delivery")

    monkeypatch.setattr(Extractor, "extract", buggy)
    nc = await nats.connect(settings.nats_url)
    try:
        dead = await nc.jetstream().subscribe(
            f"{bus.DEAD_LETTER_ROOT}.extractor", stream=bus.DEAD_LETTER_STREAM,
            deliver_policy=nats.js.api.DeliverPolicy.NEW,
        )
        await client.post("/generations/completed", json=turn_body(memory, "scripted/unused", "gen_bug"))
        letter = json.loads((await dead.next_msg(timeout=30)).data)
    finally:
        await nc.close()
    assert "failed unexpectedly (KeyError)" in letter["reason"]
    assert attempts == settings.memories_max_deliver
    outcome = await finished(client, memory, "gen_bug")
    assert outcome["status"] == "failed" and outcome["reason"] == "the extraction failed unexpectedly (KeyError)"


async def test_a_provider_failure_is_recorded_without_its_traceback(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    # litellm itself fails (a custom provider with no address), and its message carries a traceback.
    provider = (
        await client.post(
            "/ai-providers", json={"project_id": memory["project_id"], "name": "no address", "provider": "custom"}
        )
    ).json()
    body = turn_body(memory, "unconfigured", "gen_unconfigured")
    body["agent"]["ai_provider_id"] = provider["id"]
    await client.post("/generations/completed", json=body)
    outcome = await finished(client, memory, "gen_unconfigured")
    assert outcome["status"] == "failed" and "api_base not set" in outcome["reason"]
    assert "Traceback" not in outcome["reason"] and "\n" not in outcome["reason"]
    assert "github.com" not in outcome["reason"]


async def test_unknown_generation_is_404(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    response = await client.get("/generations/gen_nope/extraction", params={"project_id": memory["project_id"]})
    assert response.status_code == 404


async def test_a_turn_naming_another_projects_memory_writes_nothing(
    client: httpx.AsyncClient, memory: dict[str, Any], llm: ScriptedLLM
) -> None:
    model = llm.script("extract-foreign", json.dumps(FACTS))
    elsewhere = (await client.post("/projects", json={"name": "tenant B"})).json()
    foreign = (await client.post("/memories", json={"project_id": elsewhere["id"], "name": "theirs"})).json()
    body = turn_body(memory, model, "gen_foreign", config={"write_memory_id": foreign["id"], "extraction": True})
    await client.post("/generations/completed", json=body)
    outcome = await finished(client, memory, "gen_foreign")
    assert outcome["status"] == "skipped" and "no memory of this project" in outcome["reason"]
    assert await entries(client, foreign["id"]) == [] and llm.calls_to("extract-foreign") == []


async def test_the_first_saved_facts_of_a_turn_are_the_ones_written(
    memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # Two extractions of one turn at once (a re-report past the duplicate window): one wording, the first.
    for facts, model in ((["Lunch is at noon"], "scripted/a"), (["Lunch happens at 12:00"], "scripted/b")):
        async with sessions.begin() as session:
            kept = await registry.save_extracted_facts(session, memory["project_id"], "gen_race", facts, model)
        assert kept == registry.SavedFacts(["Lunch is at noon"], "scripted/a", "pending")
    # The first answer may be that the turn holds no fact: the second extraction then writes none either.
    for facts, model in (([], "scripted/a"), (["Lunch is at noon"], "scripted/b")):
        async with sessions.begin() as session:
            kept = await registry.save_extracted_facts(session, memory["project_id"], "gen_race_empty", facts, model)
        assert kept == registry.SavedFacts([], "scripted/a", "pending")
    # The first finished the turn (its facts cleared) before the second saved its answer: it was handed its own
    # wording back, and wrote it, near-copies of the facts written. Now it is told the turn is done.
    async with sessions.begin() as session:
        result = ExtractionResult("completed", None, ExtractionSummary(candidates=1, created=1), "scripted/a")
        await registry.save_extraction(session, memory["project_id"], "gen_race", result)
    async with sessions.begin() as session:
        late = await registry.save_extracted_facts(session, memory["project_id"], "gen_race", ["Lunch: 12:00"], "m")
    assert late.status == "completed"
    async with sessions() as session:
        stored = await session.scalar(text(
            "SELECT facts IS NULL FROM generation_extractions WHERE generation_id = 'gen_race'"))
    assert stored is True  # SQL NULL, not JSON null


async def test_a_report_that_cannot_be_published_leaves_the_turn_failed(
    settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # A retry of a failed turn, and a turn reported for the first time: left pending with no event on the bus, a
    # caller that gave up after the 503 saw it pending for ever.
    from shared.events import ExtractionSummary
    from shared.extraction import ExtractionResult

    async with sessions.begin() as session:
        failed = ExtractionResult("failed", "model down", ExtractionSummary())
        await registry.save_extraction(session, memory["project_id"], "gen_unpublished", failed)
        # Pending from an earlier report, its event on the bus: reported again meanwhile, it stays pending.
        await registry.mark_extraction_pending(session, memory["project_id"], "gen_published")

    class BusDown:
        is_connected = True  # connected, as far as the client knows, and the publish fails

        def jetstream(self) -> BusDown:
            return self

        async def publish(self, *_args: Any, **_kwargs: Any) -> None:
            raise nats.errors.NoServersError()

    async with open_api(settings) as (app, api):
        bus_client, app.state.nats = app.state.nats, BusDown()
        try:
            for generation_id in ("gen_unpublished", "gen_new_unpublished", "gen_published"):
                body = turn_body(memory, "scripted/unused", generation_id)
                assert (await api.post("/generations/completed", json=body)).status_code == 503
        finally:
            app.state.nats = bus_client
        statuses = [
            (await api.get(f"/generations/{generation_id}/extraction", params={"project_id": memory["project_id"]})).json()
            for generation_id in ("gen_unpublished", "gen_new_unpublished", "gen_published")
        ]
    # Failed, so that the caller's next report is published as a retry, not swallowed as a duplicate; the turn
    # reported before keeps its status (failed, its next report was a retry: a second extraction of one turn).
    assert [status["status"] for status in statuses] == ["failed", "failed", "pending"]
    assert "report the turn again" in statuses[1]["reason"]


async def test_a_turn_naming_a_model_of_a_provider_not_allowed_is_skipped_unasked(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    # ollama calls a server on the service's own host; asked, it would have failed the turn, not skipped it.
    await client.post("/generations/completed", json=turn_body(memory, "ollama/llama3", "gen_ollama"))
    config = {"writeMemoryId": memory["id"], "extraction": {"model": "ollama/llama3"}}
    await client.post("/generations/completed", json=turn_body(memory, "scripted/x", "gen_ollama_2", config=config))
    for generation_id in ("gen_ollama", "gen_ollama_2"):
        outcome = await finished(client, memory, generation_id)
        assert outcome["status"] == "skipped" and "MEMORIES_AGENT_MODEL_PROVIDERS" in outcome["reason"], outcome


async def test_a_turn_that_cannot_be_settled_is_logged_and_left_to_come_back(
    extractors: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # FastStream's own logging is off: a bus failure while dead-lettering an unreadable turn went unlogged.
    async def bus_down(*_args: Any, **_kwargs: Any) -> None:
        raise nats.errors.TimeoutError

    acked: list[bool] = []
    unreadable = SimpleNamespace(
        body=b"not json", raw_message=SimpleNamespace(subject="generations.completed.proj_x", metadata=None),
        ack=lambda: acked.append(True),
    )
    monkeypatch.setattr(bus, "dead_letter", bus_down)
    await extractors[0].handle(unreadable)  # type: ignore[arg-type]
    assert acked == []  # not settled: it comes back after the ack wait
    assert any(
        r.levelno == logging.ERROR and "could not be settled" in r.getMessage() and r.exc_info for r in caplog.records
    )


async def test_a_readable_turn_that_cannot_be_settled_is_logged_with_its_ids(
    extractors: list[Any], memory: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The line was written after the turn's log context had ended: the one failure of a turn that named no turn.
    async def settling_fails(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("the database went away while settling")

    monkeypatch.setattr(extractors[0], "_handle_event", settling_fails)
    caplog.handler.addFilter(ContextFilter())  # as the service's handler stamps each line with the context
    event = turn_event(memory, "unused", "gen_unsettled")
    turn = SimpleNamespace(body=event.model_dump_json().encode(), raw_message=SimpleNamespace(
        subject=bus.generation_completed_subject(memory["project_id"]), metadata=None))
    await extractors[0].handle(turn)  # type: ignore[arg-type]
    [line] = [r for r in caplog.records if "could not be settled" in r.getMessage()]
    assert (getattr(line, "generation_id", None), getattr(line, "project_id", None)) == ("gen_unsettled", memory["project_id"])


async def test_a_turn_waits_on_its_writes_until_each_is_applied_or_failed(
    sessions: async_sessionmaker[AsyncSession], memory: dict[str, Any]
) -> None:
    # What the extractor reads before extracting a turn again whose writes were queued (services.extractor.main).

    extractor = Extractor(sessions, gateway=None, llm_timeout=1, write_timeout=1)  # type: ignore[arg-type]
    ids = ["wr_decided_a", "wr_decided_b"]
    async with sessions.begin() as session:
        for write_id in ids:
            await write_records.claim_write_id(session, write_id, memory["project_id"], memory["id"])
    assert not await extractor.decided(ids)  # both pending: claimed, on the bus
    async with sessions.begin() as session:
        await session.execute(text("UPDATE write_outcomes SET status = 'applied' WHERE write_id = :id"), {"id": ids[0]})
    assert not await extractor.decided(ids)
    async with sessions.begin() as session:
        await session.execute(text("UPDATE write_outcomes SET status = 'failed' WHERE write_id = :id"), {"id": ids[1]})
    assert await extractor.decided(ids)
    # A write never claimed (its claim refused with the database down) is nothing to wait for.
    assert await extractor.decided(["wr_never_claimed"])
