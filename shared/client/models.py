"""What the client returns: the API's JSON bodies as frozen pydantic models, snake_case like the API.

Unknown fields are ignored, so a newer service does not break an older client.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from shared.events import SourceType, WriteAction


class Result(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


Item = TypeVar("Item", bound=Result)


class Page(Result, Generic[Item]):
    data: list[Item]
    total: int
    limit: int
    offset: int


class Project(Result):
    id: str
    name: str
    created_at: datetime
    updated_at: datetime


class Memory(Result):
    id: str
    project_id: str
    name: str
    description: str | None = None
    tags: list[str] | None = None
    write_policy: str | None = None
    created_at: datetime
    updated_at: datetime


class MemoryEntry(Result):
    id: str
    memory_id: str
    content: str
    source_type: SourceType
    tags: list[str] | None = None
    metadata: dict[str, Any] | None = None
    source_generation_id: str | None = None
    source_conversation_id: str | None = None
    invalidated_at: datetime | None = None
    superseded_by_entry_id: str | None = None
    created_at: datetime
    updated_at: datetime


class EntryWrite(Result):
    """The outcome of an entry write. `pending` (a 202): the writer has not decided yet, `action` and
    `entry` are None; poll `get_write(write_id)`. `replayed`: the first outcome of this Idempotency-Key, given
    again; this call wrote nothing."""

    write_id: str
    status: Literal["applied", "pending"]
    action: WriteAction | None = None
    entry: MemoryEntry | None = None
    replayed: bool = False


class WriteFailure(Result):
    code: str | None = None
    message: str | None = None


class WriteStatus(Result):
    write_id: str
    status: str  # pending, applied or failed
    action: WriteAction | None = None
    entry_id: str | None = None
    score: float | None = None
    error: WriteFailure | None = None


class HistoryRecord(Result):
    write_id: str | None = None
    entry_id: str
    related_entry_id: str | None = None
    action: str
    rule: str | None = None
    score: float | None = None
    candidate_ids: list[str] | None = None
    model: str | None = None
    prompt_version: str | None = None
    content_before: str | None = None
    content_after: str | None = None
    created_at: datetime


class EntryHistory(Page[HistoryRecord]):
    entry_id: str


class KnowledgeResult(Result):
    source_type: str = "memory"
    entry_id: str
    memory_id: str
    memory_name: str
    content: str
    tags: list[str] | None = None
    score: float | None = None  # absent when the search had no query
    similarity_score: float | None = None
    created_at: datetime
    updated_at: datetime


class ContextMessage(Result):
    role: str
    content: str


class KnowledgeContext(Result):
    message: ContextMessage | None  # None: nothing was found
    results: list[KnowledgeResult]


class ToolResult(Result):
    """What goes back to the model: `{action, entry_id}`, `{error}`, or `status` "pending" with the `write_id`
    to follow (`get_write`) and a `message` telling the model not to write the fact again."""

    action: WriteAction | None = None
    entry_id: str | None = None
    error: str | None = None
    status: str | None = None
    write_id: str | None = None
    message: str | None = None


class GenerationAccepted(Result):
    generation_id: str
    status: str


class ExtractionSummary(Result):
    candidates: int = 0
    created: int = 0
    updated: int = 0
    skipped: int = 0
    failed: int = 0


class ExtractionStatus(Result):
    generation_id: str
    status: str  # pending, completed, skipped or failed
    reason: str | None = None
    summary: ExtractionSummary
    model: str | None = None
    updated_at: datetime


class ProvenanceCleared(Result):
    cleared: int  # how many entries cited the generation or conversation


class AiProvider(Result):
    id: str
    project_id: str
    name: str
    provider: str  # litellm's prefix, e.g. openai
    api_base: str | None = None  # shown without credentials
    api_key_env: str | None = None  # the NAME of the variable holding the key
    default_model: str | None = None
    created_at: datetime


class ModelRouteTarget(Result):
    ai_provider_id: str
    model: str | None = None  # None: the provider's default_model


class ModelRoute(Result):
    id: str
    project_id: str
    name: str
    targets: list[ModelRouteTarget]  # tried in order
    created_at: datetime


class DefaultModelRoute(Result):
    model_route_id: str | None  # None: the project has no default route


class ModelUsage(Result):
    """The LLM calls of a project for one provider, model and purpose (extraction, merge, …)."""

    ai_provider_id: str | None = None  # None: a model not reached through a registered provider
    model: str
    purpose: str
    calls: int
    prompt_tokens: int
    completion_tokens: int


class ApiKey(Result):
    id: str
    project_id: str
    name: str | None = None
    prefix: str
    actions: list[str]
    created_at: datetime
    revoked_at: datetime | None = None


class ApiKeyCreated(ApiKey):
    key: str  # the bearer secret: shown once, by the creation
