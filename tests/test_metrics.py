"""The metrics module against the real API, the real NATS and the real litellm call paths."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from shared import bus, metrics
from shared.embeddings import LOCAL_MODEL, register_local_provider
from shared.servers import free_port
from shared.settings import Settings

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
    "memories_lag_poll_errors_total",
]


def sample(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def count(name: str, **labels: str) -> float:
    return sample(name, **labels) or 0.0


@pytest_asyncio.fixture
async def nc(settings: Settings) -> AsyncIterator[NatsClient]:
    assert settings.nats_url
    connection = await bus.connect(settings.nats_url, name="test-metrics")
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
        count("memories_extraction_skips_total", reason="guard"),
    ]
    metrics.observe_write_failure("EMBEDDING_UNAVAILABLE")
    metrics.observe_dead_letter("writer")
    metrics.observe_extraction("written")
    metrics.observe_extraction_skip("guard")
    after = [
        count("memories_write_failures_total", code="EMBEDDING_UNAVAILABLE"),
        count("memories_dead_letters_total", origin="writer"),
        count("memories_extractions_total", outcome="written"),
        count("memories_extraction_skips_total", reason="guard"),
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


async def test_lag_poller_sets_a_gauge_per_consumer_of_the_layout(nc: NatsClient, settings: Settings) -> None:
    js = nc.jetstream()
    await bus.ensure_layout(js, settings)
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

        await subscription.unsubscribe()
        await js.delete_consumer(stream, consumer)
        await metrics.poll_consumer_lag(js, [(stream, consumer)], streams=[stream])
        assert sample("memories_consumer_pending", stream=stream, consumer=consumer) is None
        assert sample("memories_stream_messages", stream=stream) == 3
    finally:
        await js.delete_stream(stream)
    await metrics.poll_consumer_lag(js, [], streams=[stream])
    assert sample("memories_stream_messages", stream=stream) is None


async def test_lag_poller_survives_a_lost_connection_and_counts_it(settings: Settings) -> None:
    assert settings.nats_url
    closed = await bus.connect(settings.nats_url, name="test-metrics-closed")
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

    server = metrics.MetricsServer(0, ready, host="127.0.0.1")
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
    assert await metrics.serve_metrics(settings) is None
    port = free_port()
    server = await metrics.serve_metrics(
        settings.model_copy(update={"memories_metrics_port": port}), lambda: True
    )
    assert server is not None and server.port == port
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
    finally:
        await server.stop()
