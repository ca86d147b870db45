"""Request and response bodies of the REST API (docs/api.md, docs/openapi.json). Strict: unknown fields are a 400."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import cache
from typing import Annotated, Any, Generic, TypeVar, get_args

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictFloat,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)

from shared.db.models import Memory, MemoryEntry, Project, WriteOutcome
from shared.events import (
    DEFAULT_DUPLICATE_THRESHOLD,
    EntryState,
    SourceType,
    Tags,
    WriteAction,
    WritePolicy,
    WrittenContent,
    WrittenMetadata,
    one_visible_line,
    refuse_nul,
)


def _utc(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


_DATE_TIME = WithJsonSchema({"type": "string", "format": "date-time"}, mode="serialization")
"""Said in the published schema, so that a generated client reads a time, not a plain string."""
Timestamp = Annotated[datetime, PlainSerializer(_utc, return_type=str), _DATE_TIME]
OptionalTimestamp = Timestamp | None
Name = Annotated[
    str,
    StringConstraints(min_length=1, max_length=255, strip_whitespace=True),
    AfterValidator(refuse_nul),
    AfterValidator(one_visible_line),
]
Description = Annotated[str, StringConstraints(max_length=4_000), AfterValidator(refuse_nul)]
# Numbers must be JSON numbers: "0.5" or true is a client bug to report, not to guess at.
Threshold = Annotated[StrictFloat, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


@cache
def _null_means_default(model: type[BaseModel]) -> frozenset[str]:
    """The keys of a body naming a field of `model` that may be left out but cannot be null: each such field's
    name and every alias it is read by (`knowledgeConfig: null` means the default as `knowledge_config: null` does)."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        if field.is_required() or field.default is None or type(None) in get_args(field.annotation):
            continue
        keys.add(name)
        aliases = field.validation_alias
        choices = aliases.choices if isinstance(aliases, AliasChoices) else [aliases]
        keys.update(choice for choice in choices if isinstance(choice, str))
    return frozenset(keys)


class Strict(BaseModel):
    """A request body: unknown fields are refused, and null for a field that has a default and cannot be null
    means that default (generated clients send null for every optional field they were not given)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_of_defaulted_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = _null_means_default(cls)
        if not any(data.get(name, 0) is None for name in defaulted):
            return data
        return {name: value for name, value in data.items() if value is not None or name not in defaulted}


# Projects -----------------------------------------------------------------------------------------


class ProjectCreate(Strict):
    name: Name


class ProjectOut(BaseModel):
    id: str
    name: str
    created_at: Timestamp
    updated_at: Timestamp

    @classmethod
    def of(cls, project: Project) -> ProjectOut:
        return cls.model_validate(project, from_attributes=True)


# Memories -----------------------------------------------------------------------------------------


class MemoryCreate(Strict):
    name: Name
    description: Description | None = None
    tags: Tags | None = None
    project_id: str | None = None
    write_policy: WritePolicy = Field(
        default=WritePolicy.SEED, description="`seed` (the product rule) or `guarded` (never skip a changed fact)"
    )


class MemoryUpdate(Strict):
    name: Name | None = None
    description: Description | None = None
    tags: Tags | None = None
    write_policy: WritePolicy | None = None


class MemoryOut(BaseModel):
    id: str
    project_id: str
    name: str
    description: str | None
    tags: list[str] | None
    write_policy: str
    created_at: Timestamp
    updated_at: Timestamp

    @classmethod
    def of(cls, memory: Memory) -> MemoryOut:
        return cls.model_validate(memory, from_attributes=True)


# Entries ------------------------------------------------------------------------------------------


class EntryCreate(Strict):
    memory_id: str
    content: WrittenContent
    source_type: SourceType = SourceType.MANUAL
    tags: Tags | None = None
    metadata: WrittenMetadata = None
    duplicate_threshold: Threshold = DEFAULT_DUPLICATE_THRESHOLD
    write_policy: WritePolicy | None = Field(default=None, description="this write only; default: the memory's")


class EntryUpdate(Strict):
    content: WrittenContent | None = None
    tags: Tags | None = None
    metadata: WrittenMetadata = None


# The fields are the bus's (shared.events.EntryState): the writer's reply and the REST answer are one shape.
class EntryOut(EntryState):
    """A memory entry, also an invalidated one (audit); timestamps in UTC."""

    model_config = ConfigDict(frozen=False, extra="ignore")

    invalidated_at: OptionalTimestamp
    created_at: Timestamp
    updated_at: Timestamp

    @classmethod
    def of(cls, entry: MemoryEntry) -> EntryOut:
        values = {field: getattr(entry, field) for field in cls.model_fields if field != "metadata"}
        return cls(**values, metadata=entry.metadata_)


class EntryWritten(EntryOut):
    action: WriteAction
    write_id: str


class WriteAccepted(BaseModel):
    write_id: str
    status: str = Field(description="`pending`: the writer has not decided yet; poll GET /memory-writes/{id}")


class WriteStatus(BaseModel):
    write_id: str
    status: str = Field(description="`pending`, `applied` or `failed`")
    action: WriteAction | None = None
    entry_id: str | None = None
    score: float | None = None
    error: dict[str, Any] | None = None

    @classmethod
    def of(cls, outcome: WriteOutcome) -> WriteStatus:
        error = None
        if outcome.status == "failed":
            error = {"code": outcome.error_code, "message": outcome.error_message}
        action = WriteAction(outcome.action) if outcome.action else None
        return cls(
            write_id=outcome.write_id,
            status=outcome.status,
            action=action,
            entry_id=outcome.entry_id,
            score=outcome.score,
            error=error,
        )


# Lists --------------------------------------------------------------------------------------------

Item = TypeVar("Item")


class Page(BaseModel, Generic[Item]):
    data: list[Item]
    total: int
    limit: int
    offset: int
