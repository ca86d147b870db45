"""Every Prometheus metric of the project, declared once with fixed label sets, and what feeds them.

Services never create metric objects: they call the small `observe_*` / `track_*` functions below, so a
metric's name, labels and buckets live in this one place (the Grafana dashboard in deploy/ reads them).
The API renders `REGISTRY` on `/metrics`; the writer and the extractor, which have no HTTP of their own,
serve it with `/healthz` and `/readyz` through `MetricsServer` on MEMORIES_METRICS_PORT.

Consumer lag is not observed by the consumers: `poll_consumer_lag` reads it from JetStream, so it shows
the backlog even while no consumer runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from shared import bus
from shared.events import SourceType, WriteAction
from shared.settings import Settings

log = logging.getLogger("memories.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST
LAG_POLL_INTERVAL_S = 15.0
"""Prometheus scrapes every 15 s by default: polling faster would only produce values nobody reads."""

# A registry of our own: what a scrape returns is exactly what this module declares (plus the process).
# The `*_created` timestamp series double every counter's series for no dashboard's benefit.
disable_created_metrics()
REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

# From a 5 ms synchronous write to a write that waited minutes in a backlog.
_WRITE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# From a 2 ms in-process embedding to a slow remote LLM call.
_MODEL_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Purpose(StrEnum):
    """The `purpose` label of model metrics: why a model was called."""

    WRITE = "write"  # embedding an incoming entry
    SEARCH = "search"  # embedding a query
    MERGE = "merge"  # generating merged content (a rewrite is embedded as a write)
    ARBITRATION = "arbitration"
    EXTRACTION = "extraction"


class TokenKind(StrEnum):
    PROMPT = "prompt"
    COMPLETION = "completion"


def _counter(name: str, documentation: str, *labels: str) -> Counter:
    return Counter(name, documentation, labels, registry=REGISTRY)


def _gauge(name: str, documentation: str, *labels: str) -> Gauge:
    return Gauge(name, documentation, labels, registry=REGISTRY)


def _histogram(name: str, documentation: str, buckets: Sequence[float], *labels: str) -> Histogram:
    return Histogram(name, documentation, labels, buckets=buckets, registry=REGISTRY)


WRITE_DECISIONS = _counter(
    "memories_write_decisions", "Writes decided by the writer", "action", "source_type"
)
WRITE_FAILURES = _counter("memories_write_failures", "Write attempts stored as failed, by error code", "code")
WRITE_LATENCY = _histogram(
    "memories_write_latency_seconds",
    "From the API building the write event to the writer's committed decision (redeliveries included)",
    _WRITE_BUCKETS,
    "source_type",
)
EMBEDDING_SECONDS = _histogram(
    "memories_embedding_seconds", "Embedding calls", _MODEL_BUCKETS, "model", "purpose"
)
EMBEDDING_ERRORS = _counter("memories_embedding_errors", "Failed embedding calls", "model", "purpose")
EMBEDDING_TOKENS = _counter(
    "memories_embedding_tokens", "Tokens the embedding model reported", "model", "purpose"
)
LLM_SECONDS = _histogram("memories_llm_seconds", "Generative model calls", _MODEL_BUCKETS, "model", "purpose")
LLM_ERRORS = _counter("memories_llm_errors", "Failed generative model calls", "model", "purpose")
LLM_TOKENS = _counter(
    "memories_llm_tokens", "Tokens the generative model reported", "model", "purpose", "kind"
)
EXTRACTIONS = _counter("memories_extractions", "Generation turns handled by the extractor", "outcome")
EXTRACTION_SKIPS = _counter("memories_extraction_skips", "Extraction candidates or turns skipped", "reason")
DEAD_LETTERS = _counter("memories_dead_letters", "Messages this process sent to DEAD_LETTERS", "origin")
HTTP_RESPONSES = _counter(
    "memories_http_responses", "API responses (every status) by method, route template and status", "method", "route", "status"
)
CONSUMER_PENDING = _gauge(
    "memories_consumer_pending",
    "Messages not yet delivered to the durable consumer (its lag)",
    "stream",
    "consumer",
)
CONSUMER_ACK_PENDING = _gauge(
    "memories_consumer_ack_pending",
    "Messages delivered to the consumer, not acknowledged yet",
    "stream",
    "consumer",
)
CONSUMER_REDELIVERIES = _gauge(
    "memories_consumer_redeliveries",
    "Unacknowledged messages of the consumer that were delivered more than once",
    "stream",
    "consumer",
)
STREAM_MESSAGES = _gauge(
    "memories_stream_messages", "Messages stored in the stream (DEAD_LETTERS: its backlog; MEMORY_WRITES: writes queued)", "stream"
)
STREAM_BYTES = _gauge(
    "memories_stream_bytes",
    "Bytes the stream stores, on each NATS node that holds a replica of it (what fills the JetStream volumes)",
    "stream",
)
WRITES_SET_ASIDE = _gauge(
    "memories_writes_set_aside",
    "Writes a writer holds aside, in the lane of a memory whose write waits on a model or on another transaction",
)
LAG_POLL_ERRORS = _counter("memories_lag_poll_errors", "Lag polls that could not read JetStream")

# Series of known label values exist from the start, so rate() and alerts see a 0 rather than nothing.
for _action in WriteAction:
    for _source in SourceType:
        WRITE_DECISIONS.labels(_action.value, _source.value)
for _source in SourceType:
    WRITE_LATENCY.labels(_source.value)
for _outcome in ("completed", "skipped", "failed"):
    EXTRACTIONS.labels(_outcome)
# A counter first seen at 2 has increase() 0 over its first scrapes: the first dead letters would never alert.
for _origin in ("writer", "extractor"):
    DEAD_LETTERS.labels(_origin)
for _code in ("EMBEDDING_UNAVAILABLE", "INTERNAL_ERROR", "RESOURCE_NOT_FOUND"):
    WRITE_FAILURES.labels(_code)


def render() -> bytes:
    """The Prometheus text exposition of everything above."""
    return generate_latest(REGISTRY)


# --- the write path -----------------------------------------------------------------------------------


def observe_write_decision(action: str, source_type: str, requested_at: datetime | None = None) -> None:
    """One committed decision; `requested_at` is the event's `occurred_at`, stamped by the API."""
    WRITE_DECISIONS.labels(action, source_type).inc()
    if requested_at is not None:
        # Clocks of two hosts can disagree by a little: never a negative latency.
        elapsed = (datetime.now(UTC) - requested_at).total_seconds()
        WRITE_LATENCY.labels(source_type).observe(max(0.0, elapsed))


def observe_write_failure(code: str) -> None:
    WRITE_FAILURES.labels(code).inc()


def observe_http_response(method: str, route: str, status: int) -> None:
    """`route` is the matched template as its router declares it (`/memory-entries/{entry_id}`, without the
    `/api/v1` prefix), never the path: a label per id would be a series per id."""
    HTTP_RESPONSES.labels(method, route, str(status)).inc()


def observe_dead_letter(origin: str) -> None:
    DEAD_LETTERS.labels(origin).inc()


def observe_extraction(outcome: str) -> None:
    EXTRACTIONS.labels(outcome).inc()


_TURN_GATE_REASONS = frozenset(
    {"streamed", "turn_opted_out", "extraction_disabled", "no_write_memory_id", "invalid_knowledge_config",
     "nothing_said"}
)


PROMPT_TOO_LONG = "the turn does not fit the model's context window"
"""How the stored reason of a turn skipped as too long for every model begins (shared.extraction)."""


def extraction_skip_label(reason: str | None) -> str:
    """The `reason` label of a skipped turn, from the free-text reason the extractor stores.

    Stored reasons can embed a client's status string or a provider's id; a label must not (each value is
    a series forever). The gate's own reasons (shared.extraction.gate) pass through; the rest are grouped:
    `turn_not_completed`, `unknown_memory`, `prompt_too_long`, `no_model` (shared.providers.ResolutionError), `other`.
    """
    if reason is None:
        return "other"
    if reason in _TURN_GATE_REASONS:
        return reason
    if reason.startswith("status_"):
        return "turn_not_completed"
    if reason.startswith("write_memory_id"):
        return "unknown_memory"
    if reason.startswith(PROMPT_TOO_LONG):  # before `no_model`: it names the model too, and needs no configuration
        return "prompt_too_long"
    if "model" in reason or "provider" in reason:
        return "no_model"
    return "other"


def observe_extraction_skip(reason: str | None) -> None:
    EXTRACTION_SKIPS.labels(extraction_skip_label(reason)).inc()


for _reason in (*_TURN_GATE_REASONS, "turn_not_completed", "unknown_memory", "prompt_too_long", "no_model", "other"):
    EXTRACTION_SKIPS.labels(_reason)


# --- model calls --------------------------------------------------------------------------------------


def _usage_field(usage: Any, name: str) -> int:
    value = usage.get(name) if isinstance(usage, Mapping) else getattr(usage, name, None)
    return value if isinstance(value, int) and value > 0 else 0


def _usage_of(response: Any) -> Any:
    return response.get("usage") if isinstance(response, Mapping) else getattr(response, "usage", None)


MODEL_LABELS_MAX = 100
"""Distinct `model` label values per process; the rest are counted as "other". Agents name their own models, so
without a bound every name a tenant sends would be a set of series for as long as the process runs."""

_model_labels: set[str] = set()
_service_models: set[str] = set()


def reserve_model_labels(*models: str | None) -> None:
    """The service's own models (the embedder, `MEMORIES_MERGE_MODEL`) keep their label however many names
    agents send before them."""
    _service_models.update(model for model in models if model)


def model_label(model: str) -> str:
    if model in _model_labels or model in _service_models:
        return model
    if len(_model_labels) >= MODEL_LABELS_MAX or len(model) > 128:
        return "other"
    _model_labels.add(model)
    return model


class EmbeddingCall:
    """The handle `track_embedding` yields: report what the provider counted."""

    def __init__(self, label: str, purpose: str) -> None:
        self._tokens = EMBEDDING_TOKENS.labels(label, purpose)

    def add_tokens(self, count: int) -> None:
        if count > 0:
            self._tokens.inc(count)

    def record_usage(self, response: Any) -> None:
        """Tokens from a litellm EmbeddingResponse (or its dict form); providers that count none add 0."""
        usage = _usage_of(response)
        if usage is not None:
            self.add_tokens(_usage_field(usage, "prompt_tokens") or _usage_field(usage, "total_tokens"))


class LlmCall:
    """The handle `track_llm` yields: report what the provider counted."""

    def __init__(self, label: str, purpose: str) -> None:
        self._model, self._purpose = label, purpose

    def add_tokens(self, *, prompt: int = 0, completion: int = 0) -> None:
        for kind, count in ((TokenKind.PROMPT, prompt), (TokenKind.COMPLETION, completion)):
            if count > 0:
                LLM_TOKENS.labels(self._model, self._purpose, kind.value).inc(count)

    def record_usage(self, response: Any) -> tuple[int, int]:
        """Tokens from a litellm ModelResponse (or its dict form), counted and returned: (prompt, completion)."""
        usage = _usage_of(response)
        if usage is None:
            return 0, 0
        prompt, completion = _usage_field(usage, "prompt_tokens"), _usage_field(usage, "completion_tokens")
        self.add_tokens(prompt=prompt, completion=completion)
        return prompt, completion


@contextmanager
def track_embedding(model: str, purpose: str) -> Iterator[EmbeddingCall]:
    """Time one embedding call (failed ones too) and count it as an error if the block raises.

    Cancellation is not an error: it is the caller giving up, not the model failing.
    """
    started, label = time.perf_counter(), model_label(model)
    try:
        yield EmbeddingCall(label, purpose)
    except Exception:
        EMBEDDING_ERRORS.labels(label, purpose).inc()
        raise
    finally:
        EMBEDDING_SECONDS.labels(label, purpose).observe(time.perf_counter() - started)


@contextmanager
def track_llm(model: str, purpose: str) -> Iterator[LlmCall]:
    """Like `track_embedding`, for generative calls (merge, arbitration, extraction)."""
    started, label = time.perf_counter(), model_label(model)
    try:
        yield LlmCall(label, purpose)
    except Exception:
        LLM_ERRORS.labels(label, purpose).inc()
        raise
    finally:
        LLM_SECONDS.labels(label, purpose).observe(time.perf_counter() - started)


# --- consumer lag, read from JetStream ----------------------------------------------------------------

ConsumerRef = tuple[str, str]
"""(stream, durable consumer name)."""


def writer_consumers(settings: Settings, partitions: Sequence[int] | None = None) -> list[ConsumerRef]:
    """The writer partition consumers: all of them, or those one writer replica is bound to."""
    chosen = range(settings.memories_partitions) if partitions is None else partitions
    return [(bus.WRITES_STREAM, bus.writer_durable(p)) for p in chosen]


def queue_consumers(settings: Settings) -> list[ConsumerRef]:
    """Every other durable consumer of the layout: those shared by all replicas of a service (extractor, …)."""
    partition_consumers = set(writer_consumers(settings))
    return [
        (consumer.stream, consumer.durable)
        for consumer in bus.layout(settings).consumers
        if (consumer.stream, consumer.durable) not in partition_consumers
    ]


def _forget(gauges: Iterable[Gauge], *labels: str) -> None:
    for gauge in gauges:
        with suppress(KeyError):
            gauge.remove(*labels)


async def poll_consumer_lag(
    js: JetStreamContext,
    consumers: Iterable[ConsumerRef],
    streams: Iterable[str] = bus.STREAMS,
) -> None:
    """One pass: set the lag gauges of `consumers` and the message gauges of `streams`.

    A consumer or stream that no longer exists loses its series (e.g. after the partition count was
    lowered) instead of showing its last value forever. Any other failure ends the pass and propagates.
    """
    for stream, consumer in consumers:
        try:
            info = await js.consumer_info(stream, consumer)
        except NotFoundError:
            _forget((CONSUMER_PENDING, CONSUMER_ACK_PENDING, CONSUMER_REDELIVERIES), stream, consumer)
            continue
        CONSUMER_PENDING.labels(stream, consumer).set(info.num_pending or 0)
        CONSUMER_ACK_PENDING.labels(stream, consumer).set(info.num_ack_pending or 0)
        CONSUMER_REDELIVERIES.labels(stream, consumer).set(info.num_redelivered or 0)
    for stream in streams:
        try:
            stream_info = await js.stream_info(stream)
        except NotFoundError:
            _forget((STREAM_MESSAGES, STREAM_BYTES), stream)
            continue
        STREAM_MESSAGES.labels(stream).set(stream_info.state.messages)
        STREAM_BYTES.labels(stream).set(stream_info.state.bytes)


async def run_lag_poller(
    js: JetStreamContext,
    consumers: Sequence[ConsumerRef],
    streams: Sequence[str] = bus.STREAMS,
    interval_s: float = LAG_POLL_INTERVAL_S,
) -> None:
    """Poll until cancelled; run it as a task next to the consumers. Failures are counted, not raised."""
    this = asyncio.current_task()
    while True:
        try:
            await poll_consumer_lag(js, consumers, streams)
        except Exception as exc:  # noqa: BLE001 - NATS away for a moment: try again next round
            LAG_POLL_ERRORS.inc()
            log.warning("could not read consumer lag: %s", exc or type(exc).__name__)
        if this is not None and this.cancelling():
            # Python 3.11's wait_for (under nats-py's requests) loses a cancellation that lands as the reply does;
            # the request to stop still counts, or the service's shutdown would wait on this loop for ever.
            raise asyncio.CancelledError
        await asyncio.sleep(interval_s)
