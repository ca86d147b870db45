"""The event contract: every payload that crosses the bus, and nothing else.

Events are frozen, reject unknown fields, and carry an id, a schema version and a timestamp.
Fields are only ever added (with defaults), so old consumers keep reading new events.
`memories asyncapi` publishes this module as the AsyncAPI document in docs/asyncapi.json.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CONTENT_MAX_CHARS = 8_000
TAG_MAX_CHARS = 128
TAGS_MAX_COUNT = 64
METADATA_MAX_BYTES = 16_384
DEFAULT_DUPLICATE_THRESHOLD = 0.95


def utcnow() -> datetime:
    return datetime.now(UTC)


class SourceType(StrEnum):
    MANUAL = "manual"
    AGENT = "agent"
    EXTRACTION = "extraction"
    ORCHESTRATION = "orchestration"


class WriteAction(StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    SKIPPED = "skipped"
    SUPERSEDED = "superseded"


class WritePolicy(StrEnum):
    """How a memory decides near-copies; set per memory, and selectable per write."""

    SEED = "seed"  # the product document's rule: skip at or above duplicate_threshold
    GUARDED = "guarded"  # skip a near-copy only when no cheap rule says the meaning changed
    ARBITRATE = "arbitrate"  # a model decides add / update / supersede / skip over a shortlist


class Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: str = Field(description="unique per event; also the JetStream Nats-Msg-Id")
    version: Literal[1] = 1
    occurred_at: datetime = Field(default_factory=utcnow)


class AgentContext(BaseModel):
    """Present only on agent write paths (write_memory tool, extraction): it is what allows a merge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str | None = None
    model: str = Field(description="litellm model used for merge and arbitration, e.g. openai/gpt-4o-mini")
    api_base: str | None = None
    api_key_env: str | None = Field(default=None, description="name of the env variable holding the key")


class MemoryWriteRequested(Event):
    """Subject `memories.write.<partition>.<memory_id>`; stream MEMORY_WRITES; consumed by the writer."""

    project_id: str
    memory_id: str
    content: str = Field(min_length=1, max_length=CONTENT_MAX_CHARS)
    source_type: SourceType = SourceType.MANUAL
    tags: list[str] | None = None
    metadata: dict[str, Any] | None = None
    duplicate_threshold: float = Field(default=DEFAULT_DUPLICATE_THRESHOLD, ge=0.0, le=1.0)
    write_policy: WritePolicy | None = Field(default=None, description="overrides the memory's policy")
    agent: AgentContext | None = None
    source_generation_id: str | None = None
    source_conversation_id: str | None = None
    reply_subject: str | None = Field(default=None, description="core NATS subject that awaits the outcome")

    @property
    def write_id(self) -> str:
        return self.event_id


class WriteError(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    code: str
    message: str
    status: int


class MemoryWriteOutcome(BaseModel):
    """Sent by the writer to a write's `reply_subject` after its transaction committed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    write_id: str
    action: WriteAction | None = None
    entry_id: str | None = None
    score: float | None = None
    error: WriteError | None = None


class EntryChangeKind(StrEnum):
    CREATED = "created"
    UPDATED = "updated"
    SUPERSEDED = "superseded"
    DELETED = "deleted"


class MemoryEntryChanged(Event):
    """Subject `memories.events.<project_id>.<kind>`; stream MEMORY_EVENTS: the change feed, after commit."""

    project_id: str
    memory_id: str
    entry_id: str
    kind: EntryChangeKind
    write_id: str | None = None
    superseded_entry_id: str | None = None


class GenerationDeleted(Event):
    """Subject `generations.deleted.<project_id>`; stream GENERATIONS: entries forget the generation id."""

    project_id: str
    generation_id: str = Field(min_length=1, max_length=255)


class ConversationDeleted(Event):
    """Subject `conversations.deleted.<project_id>`; stream GENERATIONS: entries forget the conversation id."""

    project_id: str
    conversation_id: str = Field(min_length=1, max_length=255)
