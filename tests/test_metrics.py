"""The metrics module against the real API, the real NATS and the real litellm call paths."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from services.extractor.main import ExtractorService
from services.writer.main import Writer
from shared import bus, bus_connection, metrics
from shared.agents import ExtractionConfig
from shared.embeddings import LOCAL_MODEL, EmbeddingError, embed_texts, register_local_provider
from shared.events import GenerationAgent, GenerationCompleted, MemoryWriteOutcome, MemoryWriteRequested
from shared.extraction import gate
from shared.metrics_server import MetricsServer, serve_metrics
from shared.providers import ResolutionError, resolve_targets
from shared.scripted_llm import scripted_llm
from shared.servers import LOOPBACK, free_port
from shared.settings import Settings
from tests.conftest import open_api

# The names the dashboard and the alerts are written against: renaming one breaks them.
EXPOSED_METRICS = [
    "memories_write_decisions_total",
    "memories_write_failures_total",
    "memories_write_latency_seconds",
    "memories_embedding_seconds",
    "memories_embedding_errors_total",
    "memories_embedding_tokens_total",
    "memories_llm_seconds",
    "memories_llm_errors_total",
    "memories_llm_tokens_total",
    "memories_extractions_total",
    "memories_extraction_skips_total",
    "memories_dead_letters_total",
    "memories_consumer_pending",
    "memories_consumer_ack_pending",
    "memories_consumer_redeliveries",
    "memories_stream_messages",
    "memories_stream_bytes",
    "memories_lag_poll_errors_total",
    "memories_writes_set_aside",
    "memories_http_responses_total",
]


def sample(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def count(name: str, **labels: str) -> float:
    return sample(name, **labels) or 0.0


@pytest_asyncio.fixture
async def nc(settings: Settings) -> AsyncIterator[NatsClient]:
    assert settings.nats_url
    connection = await bus_connection.connect(settings.nats_url, name="test-metrics")
    yield connection
    await connection.close()


async def test_api_serves_metrics_without_a_token(client: httpx.AsyncClient) -> None:
    # Prometheus scrapes without credentials, and the route lives outside /api/v1.
    request = client.build_request("GET", "http://test/metrics")
    del request.headers["Authorization"]
    response = await client.send(request)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    families = {line.split()[2] for line in response.text.splitlines() if line.startswith("# TYPE ")}
    assert set(EXPOSED_METRICS) <= families, sorted(set(EXPOSED_METRICS) - families)
    # Known label values exist before the first write, so rate() starts from 0.
    assert 'memories_write_decisions_total{action="skipped",source_type="extraction"}' in response.text


async def test_metrics_route_is_not_under_the_api_prefix(client: httpx.AsyncClient) -> None:
    assert (await client.get("/metrics")).status_code == 404


def test_write_decision_counts_and_times_from_the_event_timestamp() -> None:
    labels = {"action": "updated", "source_type": "agent"}
    decided = count("memories_write_decisions_total", **labels)
    timed = count("memories_write_latency_seconds_count", source_type="agent")
    total = count("memories_write_latency_seconds_sum", source_type="agent")
    slow_bucket = count("memories_write_latency_seconds_bucket", source_type="agent", le="1.0")

    metrics.observe_write_decision("updated", "agent", requested_at=datetime.now(UTC) - timedelta(seconds=2))

    assert count("memories_write_decisions_total", **labels) == decided + 1
    assert count("memories_write_latency_seconds_count", source_type="agent") == timed + 1
    assert 2.0 <= count("memories_write_latency_seconds_sum", source_type="agent") - total < 10.0
    assert count("memories_write_latency_seconds_bucket", source_type="agent", le="1.0") == slow_bucket


def test_a_clock_ahead_of_the_writer_gives_zero_latency_not_negative() -> None:
    total = count("memories_write_latency_seconds_sum", source_type="orchestration")
    metrics.observe_write_decision(
        "created", "orchestration", requested_at=datetime.now(UTC) + timedelta(minutes=1)
    )
    assert count("memories_write_latency_seconds_sum", source_type="orchestration") == total


def test_outcome_counters() -> None:
    before = [
        count("memories_write_failures_total", code="EMBEDDING_UNAVAILABLE"),
        count("memories_dead_letters_total", origin="writer"),
        count("memories_extractions_total", outcome="written"),
        count("memories_extraction_skips_total", reason="streamed"),
    ]
    metrics.observe_write_failure("EMBEDDING_UNAVAILABLE")
    metrics.observe_dead_letter("writer")
    metrics.observe_extraction("written")
    metrics.observe_extraction_skip("streamed")
    after = [
        count("memories_write_failures_total", code="EMBEDDING_UNAVAILABLE"),
        count("memories_dead_letters_total", origin="writer"),
        count("memories_extractions_total", outcome="written"),
        count("memories_extraction_skips_total", reason="streamed"),
    ]
    assert after == [value + 1 for value in before]


async def test_track_embedding_times_a_real_call_and_counts_its_tokens() -> None:
    from shared.embeddings._provider import litellm

    register_local_provider()
    labels = {"model": LOCAL_MODEL, "purpose": metrics.Purpose.SEARCH.value}
    calls = count("memories_embedding_seconds_count", **labels)
    tokens = count("memories_embedding_tokens_total", **labels)
    errors = count("memories_embedding_errors_total", **labels)

    with metrics.track_embedding(LOCAL_MODEL, metrics.Purpose.SEARCH) as call:
        response = await litellm.aembedding(model=LOCAL_MODEL, input=["the customer prefers email"])
        call.record_usage(response)

    assert count("memories_embedding_seconds_count", **labels) == calls + 1
    assert count("memories_embedding_tokens_total", **labels) - tokens >= 5  # [CLS] + 4 words + [SEP]
    assert count("memories_embedding_errors_total", **labels) == errors


async def test_track_embedding_counts_a_failed_call_as_error_and_still_times_it() -> None:
    from shared.embeddings._provider import litellm

    register_local_provider()
    model = "local/no-such-model"
    with pytest.raises(Exception), metrics.track_embedding(model, metrics.Purpose.WRITE):  # noqa: B017
        await litellm.aembedding(model=model, input=["x"])
    assert count("memories_embedding_errors_total", model=model, purpose="write") == 1
    assert count("memories_embedding_seconds_count", model=model, purpose="write") == 1
    assert count("memories_embedding_tokens_total", model=model, purpose="write") == 0


async def test_track_llm_counts_prompt_and_completion_tokens_of_a_litellm_response() -> None:
    from shared.embeddings._provider import litellm  # imported with the offline cost map

    model = "openai/scripted-merge"
    labels = {"model": model, "purpose": "merge"}
    with metrics.track_llm(model, metrics.Purpose.MERGE) as call:
        response = await litellm.acompletion(
            model=model,
            messages=[{"role": "user", "content": "merge these"}],
            mock_response="merged",
            api_key="x",
        )
        call.record_usage(response)
    usage = response.usage  # type: ignore[attr-defined]
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert count("memories_llm_tokens_total", **labels, kind="prompt") == usage.prompt_tokens
    assert count("memories_llm_tokens_total", **labels, kind="completion") == usage.completion_tokens
    assert count("memories_llm_seconds_count", **labels) == 1
    assert count("memories_llm_errors_total", **labels) == 0


async def test_track_llm_counts_provider_errors_but_not_cancellation() -> None:
    from shared.embeddings._provider import litellm

    model = "openai/scripted-arbiter"
    failure = litellm.RateLimitError("slow down", llm_provider="openai", model="scripted-arbiter")
    with pytest.raises(litellm.RateLimitError), metrics.track_llm(model, "arbitration"):
        await litellm.acompletion(
            model=model, messages=[{"role": "user", "content": "?"}], mock_response=failure
        )
    with pytest.raises(asyncio.CancelledError), metrics.track_llm(model, "arbitration"):
        raise asyncio.CancelledError
    assert count("memories_llm_errors_total", model=model, purpose="arbitration") == 1
    assert count("memories_llm_seconds_count", model=model, purpose="arbitration") == 2


def test_the_poller_watches_every_stream_of_the_layout(settings: Settings) -> None:
    # A stream the layout gains must show its storage too: the alert on the JetStream volumes sums them all.
    assert sorted(stream.name or "" for stream in bus.layout(settings).streams) == sorted(bus.STREAMS)


async def test_lag_poller_sets_a_gauge_per_consumer_of_the_layout(nc: NatsClient, settings: Settings) -> None:
    js = nc.jetstream()
    await bus.ensure_layout(js, settings, bus.Role.ADMIN)
    await metrics.poll_consumer_lag(js, metrics.writer_consumers(settings))
    for partition in range(settings.memories_partitions):
        consumer = bus.writer_durable(partition)
        info = await js.consumer_info(bus.WRITES_STREAM, consumer)
        assert (
            sample("memories_consumer_pending", stream=bus.WRITES_STREAM, consumer=consumer)
            == info.num_pending
        )
        assert (
            sample("memories_consumer_redeliveries", stream=bus.WRITES_STREAM, consumer=consumer) is not None
        )
    queues = metrics.queue_consumers(settings)
    assert (bus.GENERATIONS_STREAM, bus.EXTRACTOR_DURABLE) in queues
    assert not any(consumer.startswith("writer-p") for _, consumer in queues)
    await metrics.poll_consumer_lag(js, queues)
    for stream, consumer in queues:
        info = await js.consumer_info(stream, consumer)
        assert sample("memories_consumer_pending", stream=stream, consumer=consumer) == info.num_pending
    dead = await js.stream_info(bus.DEAD_LETTER_STREAM)
    assert sample("memories_stream_messages", stream=bus.DEAD_LETTER_STREAM) == dead.state.messages
    # Writes queued, whether a writer consumer sees them or not (one left on a partition since dropped).
    queued = await js.stream_info(bus.WRITES_STREAM)
    assert sample("memories_stream_messages", stream=bus.WRITES_STREAM) == queued.state.messages
    # What fills the JetStream volumes, every stream's: the change feed and the turns are kept for 7 days.
    for stream in bus.STREAMS:
        stored = (await js.stream_info(stream)).state.bytes
        assert sample("memories_stream_bytes", stream=stream) == stored, stream


async def test_lag_poller_reads_backlog_and_redeliveries_and_forgets_deleted_consumers(
    nc: NatsClient,
) -> None:
    js = nc.jetstream()
    token = uuid.uuid4().hex[:8]
    stream, consumer, subject = f"METRICS_PROBE_{token}", "probe", f"metricsprobe.{token}"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{subject}.>"]))
    try:
        await js.add_consumer(
            # One in flight at a time, like a writer partition: the next fetch must be the redelivery.
            stream,
            ConsumerConfig(
                durable_name=consumer, ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=1
            ),
        )
        for i in range(3):
            await js.publish(f"{subject}.{i}", b"x", stream=stream)
        subscription = await js.pull_subscribe_bind(consumer, stream=stream)
        [first] = await subscription.fetch(1, timeout=5)
        await first.nak()
        [again] = await subscription.fetch(1, timeout=5)
        assert again.metadata.num_delivered == 2

        await metrics.poll_consumer_lag(js, [(stream, consumer)], streams=[stream])
        assert sample("memories_consumer_pending", stream=stream, consumer=consumer) == 2
        assert sample("memories_consumer_ack_pending", stream=stream, consumer=consumer) == 1
        assert sample("memories_consumer_redeliveries", stream=stream, consumer=consumer) == 1
        assert sample("memories_stream_messages", stream=stream) == 3
        assert sample("memories_stream_bytes", stream=stream) == (await js.stream_info(stream)).state.bytes > 0

        await subscription.unsubscribe()
        await js.delete_consumer(stream, consumer)
        await metrics.poll_consumer_lag(js, [(stream, consumer)], streams=[stream])
        assert sample("memories_consumer_pending", stream=stream, consumer=consumer) is None
        assert sample("memories_stream_messages", stream=stream) == 3
    finally:
        await js.delete_stream(stream)
    await metrics.poll_consumer_lag(js, [], streams=[stream])
    assert sample("memories_stream_messages", stream=stream) is None
    assert sample("memories_stream_bytes", stream=stream) is None


async def test_lag_poller_survives_a_lost_connection_and_counts_it(settings: Settings) -> None:
    assert settings.nats_url
    closed = await bus_connection.connect(settings.nats_url, name="test-metrics-closed")
    await closed.close()
    errors = count("memories_lag_poll_errors_total")
    poller = asyncio.create_task(
        metrics.run_lag_poller(closed.jetstream(), metrics.writer_consumers(settings), interval_s=0.01)
    )
    try:
        async with asyncio.timeout(5):
            while count("memories_lag_poll_errors_total") < errors + 2:
                await asyncio.sleep(0.01)
        assert not poller.done()  # it keeps trying
    finally:
        poller.cancel()


async def test_metrics_server_serves_metrics_and_probes() -> None:
    state: dict[str, object] = {"ready": False}

    async def ready() -> bool:
        if isinstance(state["ready"], Exception):
            raise state["ready"]
        return bool(state["ready"])

    server = MetricsServer(0, ready, host="127.0.0.1")
    port = await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            scraped = await http.get("/metrics")
            assert scraped.status_code == 200
            assert scraped.headers["content-type"].startswith("text/plain")
            assert "# TYPE memories_consumer_pending gauge" in scraped.text
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).status_code == 503
            state["ready"] = True
            assert (await http.get("/readyz?verbose=1")).status_code == 200
            state["ready"] = RuntimeError("database down")
            assert (await http.get("/readyz")).status_code == 503
            assert (await http.get("/nothing")).status_code == 404
            assert (await http.post("/metrics")).status_code == 405
    finally:
        await server.stop()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(timeout=2) as http:
            await http.get(f"http://127.0.0.1:{port}/healthz")


async def test_serve_metrics_follows_the_metrics_port_setting(settings: Settings) -> None:
    assert settings.memories_metrics_port == 0
    assert await serve_metrics(settings) is None
    port = free_port()
    server = await serve_metrics(
        settings.model_copy(update={"memories_metrics_port": port}), lambda: True
    )
    assert server is not None and server.port == port
    try:
        assert server.addresses == ["0.0.0.0"]  # in a container Prometheus and the probes come from outside
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
    finally:
        await server.stop()
    local = await serve_metrics(settings.model_copy(update={"memories_metrics_port": free_port(),
                                                            "memories_metrics_host": "127.0.0.1"}))
    assert local is not None
    try:
        assert local.addresses == ["127.0.0.1"]  # as `memories up` runs it: unauthenticated, so not exposed
    finally:
        await local.stop()


# --- the metrics as the services feed them ------------------------------------------------------------


async def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


async def test_a_posted_entry_counts_one_decision_its_latency_and_its_embeddings(
    client: httpx.AsyncClient, memory: dict[str, Any], settings: Settings
) -> None:
    created = {"action": "created", "source_type": "manual"}
    writes = {"model": settings.embedding_model, "purpose": "write"}
    searches = {"model": settings.embedding_model, "purpose": "search"}
    decided = count("memories_write_decisions_total", **created)
    timed = count("memories_write_latency_seconds_count", source_type="manual")
    waited = count("memories_write_latency_seconds_sum", source_type="manual")
    write_embeddings = count("memories_embedding_seconds_count", **writes)
    search_embeddings = count("memories_embedding_seconds_count", **searches)

    posted = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Invoices go to Ana"})
    assert posted.status_code == 201, posted.text

    assert count("memories_write_decisions_total", **created) == decided + 1
    assert count("memories_write_latency_seconds_count", source_type="manual") == timed + 1
    assert 0 < count("memories_write_latency_seconds_sum", source_type="manual") - waited < 15
    assert count("memories_embedding_seconds_count", **writes) >= write_embeddings + 1
    assert count("memories_embedding_seconds_count", **searches) == search_embeddings

    found = await client.post("/knowledge/search", json={"project_id": memory["project_id"], "query": "invoices"})
    assert found.status_code == 200, found.text
    assert count("memories_embedding_seconds_count", **searches) == search_embeddings + 1


async def test_a_redelivered_write_is_answered_from_its_outcome_and_not_counted_again(
    client: httpx.AsyncClient, memory: dict[str, Any], settings: Settings, nc: NatsClient
) -> None:
    content = "The warehouse closes at six"
    posted = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": content})
    assert posted.status_code == 201, posted.text
    written = posted.json()
    decided = count("memories_write_decisions_total", action="created", source_type="manual")
    timed = count("memories_write_latency_seconds_count", source_type="manual")

    # What JetStream does after a writer committed but its ack was lost: the same event once more.
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    again = MemoryWriteRequested(
        event_id=written["write_id"],
        project_id=memory["project_id"],
        memory_id=memory["id"],
        content=content,
        reply_subject=inbox,
    )
    await nc.jetstream().publish(
        bus.write_subject(memory["id"], settings.memories_partitions),
        again.model_dump_json().encode(),
        stream=bus.WRITES_STREAM,
        headers={"Nats-Msg-Id": f"{again.write_id}.redelivered"},
    )
    outcome = MemoryWriteOutcome.model_validate_json((await replies.next_msg(timeout=15)).data)
    await replies.unsubscribe()

    assert outcome.action == "created" and outcome.entry_id == written["id"]
    assert count("memories_write_decisions_total", action="created", source_type="manual") == decided
    assert count("memories_write_latency_seconds_count", source_type="manual") == timed


async def test_an_undecodable_write_is_dead_lettered_and_counted(
    nc: NatsClient, settings: Settings, writers: list[Writer]
) -> None:
    dead = count("memories_dead_letters_total", origin="writer")
    subject = bus.write_subject("mem_undecodable", settings.memories_partitions)
    await nc.jetstream().publish(subject, b"not a write event", stream=bus.WRITES_STREAM)
    await wait_for(lambda: count("memories_dead_letters_total", origin="writer") >= dead + 1)
    await asyncio.sleep(0.2)  # nothing else was dead-lettered with it
    assert count("memories_dead_letters_total", origin="writer") == dead + 1


async def test_embed_texts_labels_its_calls_with_their_purpose() -> None:
    labels = {"model": LOCAL_MODEL, "purpose": "search"}
    calls = count("memories_embedding_seconds_count", **labels)
    tokens = count("memories_embedding_tokens_total", **labels)
    other_purpose = count("memories_embedding_seconds_count", model=LOCAL_MODEL, purpose="write")

    await embed_texts(["where does the customer live"], model=LOCAL_MODEL, purpose="search")

    assert count("memories_embedding_seconds_count", **labels) == calls + 1
    assert count("memories_embedding_tokens_total", **labels) - tokens >= 5
    assert count("memories_embedding_seconds_count", model=LOCAL_MODEL, purpose="write") == other_purpose

    missing = "local/metrics-missing-model"
    with pytest.raises(EmbeddingError):
        await embed_texts(["x"], model=missing, purpose="search")
    assert count("memories_embedding_errors_total", model=missing, purpose="search") == 1


def turn(memory: dict[str, Any], model: str, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "project_id": memory["project_id"],
        "generation_id": f"gen_metrics_{uuid.uuid4().hex[:12]}",
        "agent": {"id": "agent_metrics", "model": model, "knowledge_config": config},
        "messages": [{"role": "user", "content": "I keep my dashboards in Grafana."}],
        "output": "Noted.",
    }


async def test_extraction_outcomes_skip_reasons_and_model_calls_are_counted(
    client: httpx.AsyncClient, memory: dict[str, Any], extractors: list[ExtractorService]
) -> None:
    model = scripted_llm().script("metrics-extract", json.dumps(["The user keeps dashboards in Grafana"]))
    called = {"model": model, "purpose": "extraction"}
    completed = count("memories_extractions_total", outcome="completed")
    skipped = count("memories_extractions_total", outcome="skipped")
    disabled = count("memories_extraction_skips_total", reason="extraction_disabled")
    extracted = count("memories_write_decisions_total", action="created", source_type="extraction")

    for config in ({"writeMemoryId": memory["id"], "extraction": True}, {"writeMemoryId": memory["id"]}):
        accepted = await client.post("/generations/completed", json=turn(memory, model, config))
        assert accepted.status_code == 202, accepted.text
    await wait_for(
        lambda: count("memories_extractions_total", outcome="completed") > completed
        and count("memories_extractions_total", outcome="skipped") > skipped
    )

    assert count("memories_extractions_total", outcome="completed") == completed + 1
    assert count("memories_extractions_total", outcome="skipped") == skipped + 1
    assert count("memories_extraction_skips_total", reason="extraction_disabled") == disabled + 1
    assert count("memories_write_decisions_total", action="created", source_type="extraction") == extracted + 1
    assert count("memories_llm_seconds_count", **called) == 1
    assert count("memories_llm_tokens_total", **called, kind="prompt") > 0
    assert count("memories_llm_tokens_total", **called, kind="completion") > 0


def test_skip_reasons_become_a_bounded_label_set() -> None:
    def gate_reason(**fields: Any) -> str | None:
        agent = GenerationAgent(knowledge_config={"writeMemoryId": "mem_1"})
        event = GenerationCompleted(event_id="evt_1", project_id="proj_1", generation_id="g", agent=agent, **fields)
        return gate(event).reason

    def resolution_reason(agent: GenerationAgent) -> str:
        with pytest.raises(ResolutionError) as refused:
            resolve_targets(ExtractionConfig(), agent, providers={}, routes={}, default_route_id=None)
        return str(refused.value)

    labels = {
        gate_reason(streamed=True): "streamed",
        gate_reason(status="requires_action"): "turn_not_completed",
        gate_reason(status="a client's own words"): "turn_not_completed",
        resolution_reason(GenerationAgent()): "no_model",
        resolution_reason(GenerationAgent(model_route_id="route_gone")): "no_model",
        resolution_reason(GenerationAgent(ai_provider_id="prov_gone")): "no_model",
        "write_memory_id names no memory of this project": "unknown_memory",
        # It names the model too, yet no configuration is missing (it counted as `no_model`).
        f"{metrics.PROMPT_TOO_LONG}: 9000 tokens, the model takes 4096": "prompt_too_long",
        "something new": "other",
    }
    assert {reason: metrics.extraction_skip_label(reason) for reason in labels} == labels
    assert metrics.extraction_skip_label(None) == "other"


async def test_a_writer_serves_metrics_and_probes_on_its_own_port(settings: Settings) -> None:
    port = free_port()
    deletions = (bus.GENERATIONS_STREAM, bus.WRITER_GENERATION_DELETIONS)
    with suppress(KeyError):
        metrics.CONSUMER_PENDING.remove(*deletions)
    # Bound to no partition: it must not take writes from the session's writers.
    writer = Writer(settings.model_copy(update={"memories_metrics_port": port}), partitions=[])
    await writer.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).status_code == 200
            scraped = await http.get("/metrics")
            assert scraped.status_code == 200
            assert "# TYPE memories_write_decisions_total counter" in scraped.text
        # Its lag poller reports the consumers it binds to (the shared deletion consumers here).
        stream, consumer = deletions
        await wait_for(lambda: sample("memories_consumer_pending", stream=stream, consumer=consumer) is not None)
    finally:
        await writer.stop()
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(timeout=2) as http:
            await http.get(f"http://127.0.0.1:{port}/healthz")


async def test_a_service_waiting_for_its_bus_at_start_is_alive_and_not_ready(settings: Settings) -> None:
    # Its probe port opened only once started: a start that waited out a NATS outage longer than the startup probe
    # allows (60 s) was restarted, again and again, and came back minutes after the bus did.
    port = free_port()
    nowhere = f"nats://127.0.0.1:{free_port()}"  # nothing listens: the service retries for as long as it is down
    extractor = ExtractorService(
        settings.model_copy(update={"memories_metrics_port": port, "nats_url": nowhere}), concurrency=1
    )
    starting = asyncio.create_task(extractor.start())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            await wait_for_answer(http, "/healthz")
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).status_code == 503
        assert not starting.done()
    finally:
        starting.cancel()
        with suppress(asyncio.CancelledError):
            await starting
        await extractor.stop()


async def wait_for_answer(http: httpx.AsyncClient, path: str) -> None:
    for _ in range(100):
        with suppress(httpx.ConnectError):
            await http.get(path)
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"nothing answered {path} within 5 s")


async def test_an_extractor_serves_metrics_and_probes_on_its_own_port(settings: Settings) -> None:
    port = free_port()
    extractor = ExtractorService(settings.model_copy(update={"memories_metrics_port": port}), concurrency=1)
    assert not extractor.is_ready()
    await extractor.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).status_code == 200
            assert "# TYPE memories_extractions_total counter" in (await http.get("/metrics")).text
    finally:
        await extractor.stop()


async def test_the_api_reports_the_lag_of_every_consumer_whichever_replicas_run(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each writer reports only its own partitions: the backlog of a range whose writer is down shows through the API.
    polled: list[list[metrics.ConsumerRef]] = []

    async def record(_js: Any, consumers: Any, *_args: Any, **_kwargs: Any) -> None:
        polled.append(list(consumers))

    monkeypatch.setattr(metrics, "run_lag_poller", record)
    async with open_api(settings):
        await asyncio.sleep(0)
    assert polled == [metrics.writer_consumers(settings) + metrics.queue_consumers(settings)]
    assert len(metrics.writer_consumers(settings)) == settings.memories_partitions


def test_a_writer_whose_metrics_port_is_taken_exits_with_the_error(settings: Settings) -> None:
    # It failed at the end of its start, and the consumers started before kept the process alive, silent, for ever:
    # a restart policy never saw the failure.
    assert settings.database_url and settings.nats_url
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        env = {**os.environ, "DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url,
               "MEMORIES_PARTITIONS": str(settings.memories_partitions), "MEMORIES_METRICS_HOST": LOOPBACK,
               "MEMORIES_METRICS_PORT": str(taken.getsockname()[1]), "MEMORIES_LOG_FORMAT": "text"}
        writer = [sys.executable, "-m", "services.cli", "writer"]
        done = subprocess.run(writer, env=env, capture_output=True, timeout=90, check=False)
    assert done.returncode != 0
    assert "address already in use" in done.stderr.decode().lower()


async def test_api_responses_are_counted_by_route_template_and_status(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    entry_route, memory_route = "/memory-entries", "/memories/{memory_id}"  # as their routers declare them
    before = {
        "created": count("memories_http_responses_total", method="POST", route=entry_route, status="201"),
        "missing": count("memories_http_responses_total", method="GET", route=memory_route, status="404"),
        "unmatched": count("memories_http_responses_total", method="GET", route="unmatched", status="404"),
    }
    await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Counted by its route"})
    await client.get("/memories/mem_0000000000000000")
    await client.get("/memories/mem_1111111111111111")
    await client.get("/no/such/route")
    for probe in ("/healthz", "/readyz", "/metrics"):  # no client's requests
        assert (await client.get(client.base_url.join(probe))).status_code == 200
        assert count("memories_http_responses_total", method="GET", route=probe, status="200") == 0
    assert count("memories_http_responses_total", method="POST", route=entry_route, status="201") == before["created"] + 1
    assert count("memories_http_responses_total", method="GET", route=memory_route, status="404") == before["missing"] + 2
    assert count("memories_http_responses_total", method="GET", route="unmatched", status="404") == before["unmatched"] + 1


def test_failure_counters_exist_at_zero_before_the_first_failure() -> None:
    # Prometheus' increase() of a counter first scraped at 2 is 0: the first dead letters would never alert. A
    # fresh process, since this one's tests have counted failures already.
    script = (
        "from shared import metrics\n"
        "for m in metrics.REGISTRY.collect():\n"
        "    for s in m.samples:\n"
        "        if s.name.endswith('_total') and s.value == 0:\n"
        "            print(s.name, *sorted(s.labels.values()))\n"
    )
    started = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    at_zero = set(started.stdout.splitlines())
    for series in [
        "memories_dead_letters_total writer",
        "memories_dead_letters_total extractor",
        "memories_write_failures_total EMBEDDING_UNAVAILABLE",
        "memories_write_failures_total INTERNAL_ERROR",
        "memories_extraction_skips_total nothing_said",
        "memories_extraction_skips_total no_model",
    ]:
        assert series in at_zero, series


async def test_the_lag_poller_stops_when_a_request_swallowed_its_cancellation() -> None:
    # Python 3.11's asyncio.wait_for, under every nats-py request, returns the reply and drops the cancellation
    # when both land together: the shutdown that cancelled the poller then waited on it for ever.
    class Info:
        num_pending = num_ack_pending = num_redelivered = 0

    class ReplyLandsAsItIsCancelled:
        async def consumer_info(self, _stream: str, _consumer: str) -> Info:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # what wait_for does in that race
            return Info()

    poller = asyncio.create_task(
        metrics.run_lag_poller(ReplyLandsAsItIsCancelled(), [("S", "c")], streams=[], interval_s=0.01)  # type: ignore[arg-type]
    )
    await asyncio.sleep(0.05)
    poller.cancel()
    done, _ = await asyncio.wait({poller}, timeout=2)
    assert done == {poller} and poller.cancelled()


def test_model_labels_are_bounded_whatever_names_agents_send(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_model_labels", set())
    monkeypatch.setattr(metrics, "_service_models", set())
    monkeypatch.setattr(metrics, "MODEL_LABELS_MAX", 3)
    metrics.reserve_model_labels("scripted/bounded-service", None)
    names = [f"scripted/bounded-{i}" for i in range(6)] + ["scripted/" + "x" * 200, "scripted/bounded-service"]
    for name in names:
        with metrics.track_llm(name, "merge") as call:
            call.add_tokens(prompt=1)
    seen = {name: count("memories_llm_seconds_count", model=name, purpose="merge") for name in names}
    # The first three names agents sent, and the service's own model after all of them.
    assert seen == {name: 1 if index < 3 or name.endswith("service") else 0 for index, name in enumerate(names)}
    assert count("memories_llm_seconds_count", model="other", purpose="merge") >= 4
    assert count("memories_llm_tokens_total", model="scripted/bounded-5", purpose="merge", kind="prompt") == 0
