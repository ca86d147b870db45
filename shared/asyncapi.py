"""The AsyncAPI document of the bus, generated from the event models in shared.events (the contract)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from shared import bus
from shared.events import (
    ApiKeyRevoked,
    ConversationDeleted,
    DeadLetter,
    ExtractionCompleted,
    GenerationCompleted,
    GenerationDeleted,
    MemoryEntryChanged,
    MemoryWriteOutcome,
    MemoryWriteRequested,
)


def _channel(address: str, message: type[BaseModel], description: str, **parameters: str) -> dict[str, Any]:
    channel: dict[str, Any] = {
        "address": address,
        "description": description,
        "messages": {message.__name__: {"$ref": f"#/components/messages/{message.__name__}"}},
    }
    if parameters:
        channel["parameters"] = {name: {"description": text} for name, text in parameters.items()}
    return channel


CHANNELS: dict[str, tuple[str, type[BaseModel], str, dict[str, str], str, str]] = {
    # name: (address, message, description, parameters, action, who)
    "memoryWrites": (
        f"{bus.WRITE_SUBJECT_ROOT}.{{partition}}.{{memory_id}}",
        MemoryWriteRequested,
        (
            f"Stream {bus.WRITES_STREAM} (work queue). One write to decide. Nats-Msg-Id: the write id "
            "(plus an attempt suffix). Every write to one memory lands on one partition."
        ),
        {"partition": "crc32(memory_id) mod MEMORIES_PARTITIONS", "memory_id": "the target memory"},
        "receive",
        (
            "writer (one durable pull consumer per partition, max_ack_pending two batches, pinned to one writer "
            "replica at a time: priority group 'writers', policy pinned_client)"
        ),
    ),
    "writeOutcomes": (
        "{reply_subject}",
        MemoryWriteOutcome,
        "Core NATS. The writer's answer, sent after its transaction committed, to the write's reply_subject.",
        {"reply_subject": "named by the write event"},
        "send",
        "writer",
    ),
    "entryChanges": (
        f"{bus.EVENT_SUBJECT_ROOT}.{{project_id}}.{{kind}}",
        MemoryEntryChanged,
        f"Stream {bus.EVENTS_STREAM}. The change feed, published after each commit.",
        {"project_id": "the project", "kind": "created, updated, superseded or deleted"},
        "send",
        "writer",
    ),
    "generationsCompleted": (
        f"{bus.GENERATION_COMPLETED_ROOT}.{{project_id}}",
        GenerationCompleted,
        (
            f"Stream {bus.GENERATIONS_STREAM}. A model turn completed; published by the agent platform (or "
            "POST /api/v1/generations/completed). Nats-Msg-Id: generation:<project>:<generation_id>."
        ),
        {"project_id": "the project"},
        "receive",
        "extractor (one durable consumer shared by all replicas)",
    ),
    "extractionCompleted": (
        f"{bus.EXTRACTION_COMPLETED_ROOT}.{{project_id}}",
        ExtractionCompleted,
        f"Stream {bus.GENERATIONS_STREAM}. The extraction summary of a generation, for the platform.",
        {"project_id": "the project"},
        "send",
        "extractor",
    ),
    "generationsDeleted": (
        f"{bus.GENERATION_DELETED_ROOT}.{{project_id}}",
        GenerationDeleted,
        f"Stream {bus.GENERATIONS_STREAM}. Entries forget the generation; their facts stay.",
        {"project_id": "the project"},
        "receive",
        "writer",
    ),
    "conversationsDeleted": (
        f"{bus.CONVERSATION_DELETED_ROOT}.{{project_id}}",
        ConversationDeleted,
        f"Stream {bus.GENERATIONS_STREAM}. Entries forget the conversation; their facts stay.",
        {"project_id": "the project"},
        "receive",
        "writer",
    ),
    "apiKeyRevocations": (
        bus.API_KEY_REVOKED_SUBJECT,
        ApiKeyRevoked,
        (
            "Core NATS. A key was revoked: every API process forgets it (they remember live keys briefly) and "
            "answers the message's reply subject with an empty message; the revoking request waits for those."
        ),
        {},
        "send",
        "api (and every api process receives it)",
    ),
    "deadLetters": (
        f"{bus.DEAD_LETTER_ROOT}.{{origin}}",
        DeadLetter,
        f"Stream {bus.DEAD_LETTER_STREAM}. Messages a consumer gave up on; `memories dlq list|replay`.",
        {"origin": "writer or extractor"},
        "send",
        "writer, extractor",
    ),
}


def asyncapi_document(version: str) -> dict[str, Any]:
    models = sorted({spec[1] for spec in CHANNELS.values()}, key=lambda model: model.__name__)
    _, schemas = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/components/schemas/{model}"
    )
    channels = {name: _channel(spec[0], spec[1], spec[2], **spec[3]) for name, spec in CHANNELS.items()}
    operations = {
        f"{spec[4]}{name[0].upper()}{name[1:]}": {
            "action": spec[4],
            "channel": {"$ref": f"#/channels/{name}"},
            "summary": spec[5],
        }
        for name, spec in CHANNELS.items()
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Memories bus",
            "version": version,
            "description": "NATS JetStream subjects of the memory service. Payloads are JSON; every event "
            "carries event_id, version and occurred_at; fields are only ever added. A write event "
            "(MemoryWriteRequested) leaves its unset optional fields out, so a field added to it reaches readers "
            "of an older version only when it is used. Times without a zone are read as UTC. As deployed "
            "(deploy/), every client logs in as a NATS user allowed only its own subjects, and takes its replies "
            "on its own inboxes, `_INBOX.<user>.`: an agent platform publishing turns and their deletions logs in "
            "as memories-platform (docs/operations.md, \"The bus's users\").",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {
            "messages": {model.__name__: {"payload": {"$ref": f"#/components/schemas/{model.__name__}"}}
                         for model in models},
            "schemas": schemas.get("$defs", {}),
        },
    }
