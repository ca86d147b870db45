"""The event contract: every payload that crosses the bus, and nothing else.

Events are frozen and carry an id, a schema version and a timestamp. Fields are only ever added (with defaults).
The service's own events reject fields they do not know, so the reader of such an event is upgraded before its
writer (docs/operations.md); the events agent platforms publish (`GenerationCompleted` and what it holds) ignore
them, as a platform sends what it has; a write event is published without its unset
optional fields (shared.write_gateway), so an added one reaches older readers only when it is used.
`memories asyncapi` publishes this module as the AsyncAPI document in docs/asyncapi.json.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

CONTENT_MAX_CHARS = 8_000
TAG_MAX_CHARS = 128
TAGS_MAX_COUNT = 64
METADATA_MAX_BYTES = 16_384
METADATA_MAX_DEPTH = 32
"""Deeper is refused: the bus's JSON parser has a recursion limit the writer must never hit."""
DEFAULT_DUPLICATE_THRESHOLD = 0.95


def refuse_nul(value: str) -> str:
    # PostgreSQL text cannot hold NUL: refused where text comes in, a 400 rather than a failed write.
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    return _LONE_SURROGATE.search(text) is not None


def storable(text: str) -> str:
    """Text as PostgreSQL and UTF-8 can hold it, for text the service did not refuse at its door (a model's reply,
    an error message quoting what came in): NULs dropped, and lone surrogates (which a JSON escape such as
    `\\ud800` can produce, and no UTF-8 text can hold) replaced by U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", text.replace("\x00", ""))


def nested_deeper_than(value: Any, levels: int) -> bool:
    """Whether objects and arrays nest more than `levels` deep in a JSON value. Level by level, not
    recursively: a client may send thousands of levels, and the answer must not cost a RecursionError."""
    level = [value]
    for _ in range(levels + 1):
        containers = [item for item in level if isinstance(item, dict | list)]
        if not containers:
            return False
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return True


def json_text(value: Any, *, sort_keys: bool = False) -> str:
    """`value` as JSON text. Python's parser reads NaN, Infinity and 1e999, which JSON has not: refused here,
    rather than stored as null or as text no other JSON reader takes. NUL comes out escaped."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, sort_keys=sort_keys)
    except ValueError:
        raise ValueError("must not contain NaN or Infinity (not JSON numbers)") from None


def check_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Metadata as it may be stored: nested at most METADATA_MAX_DEPTH levels, at most METADATA_MAX_BYTES
    as JSON, no NUL in any key or value."""
    if value is None:
        return None
    if nested_deeper_than(value, METADATA_MAX_DEPTH):
        raise ValueError(f"must be nested at most {METADATA_MAX_DEPTH} levels deep")
    encoded = json_text(value)
    if "\\u0000" in encoded:
        raise ValueError("must not contain NUL characters")
    if len(encoded.encode()) > METADATA_MAX_BYTES:
        raise ValueError(f"must be at most {METADATA_MAX_BYTES} bytes as JSON")
    return value


def refuse_metadata_grown_as_stored(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """At most METADATA_MAX_BYTES as stored and served, numbers written out (after `check_metadata`, which measured
    it as sent: measured again only when its numbers grow)."""
    growth = 0 if value is None else _growth_of_numbers_as_stored(value)
    if growth and len(json_text(value).encode()) + growth > METADATA_MAX_BYTES:
        raise ValueError(f"must be at most {METADATA_MAX_BYTES} bytes as JSON, as stored (numbers without exponents)")
    return value


def _growth_of_numbers_as_stored(value: Any) -> int:
    """How many characters more PostgreSQL's JSONB writes the floats of `value` with: its numbers have no exponent,
    so 1e308 (5 characters sent) is stored and served as 309 digits. Level by level, as `nested_deeper_than`."""
    growth, level = 0, [value]
    while level:
        floats = [item for item in level if isinstance(item, float)]
        growth += sum(len(format(Decimal(repr(number)), "f")) - len(repr(number)) for number in floats)
        level = [child for item in level if isinstance(item, dict | list)
                 for child in (item.values() if isinstance(item, dict) else item)]
    return growth


# Invisible, yet not whitespace nor format characters (category Cf): Unicode's default-ignorable code points of
# other categories (the combining grapheme joiner, Hangul fillers, Khmer inherent vowels, Mongolian and other
# variation selectors, tags) and the blank braille pattern.
_INVISIBLE = frozenset(
    chr(code)
    for first, last in (
        (0x034F, 0x034F), (0x115F, 0x1160), (0x17B4, 0x17B5), (0x180B, 0x180F), (0x2065, 0x2065),
        (0x2800, 0x2800), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8),
        (0xE0000, 0xE0FFF),
    )
    for code in range(first, last + 1)
)


def is_blank(text: str) -> bool:
    """Nothing a reader would see: whitespace, control characters (a terminal escape, DEL), invisible format
    characters (zero-width space, BOM, …) and the other invisible characters (a Hangul filler, a variation
    selector, …)."""
    return all(char.isspace() or char in _INVISIBLE or unicodedata.category(char) in ("Cf", "Cc") for char in text)


def refuse_blank(value: str) -> str:
    if is_blank(value):
        raise ValueError("must not be blank")
    return value


def problem_of(error: Mapping[str, Any]) -> str:
    """A pydantic error's message as a client reads it: a validator's own words, without the "Value error, " that
    pydantic puts before them."""
    return str(error.get("msg", "")).removeprefix("Value error, ")


def one_visible_line(label: str) -> str:
    """A label (a name, a tag) is shown in lists, tables and an agent's context: a line break, a tab or a terminal
    escape in it breaks each of them, and one of nothing but invisible characters labels nothing."""
    if any(unicodedata.category(char) == "Cc" for char in label):
        raise ValueError("must be one line of text, without control characters (line breaks, tabs, escapes)")
    return refuse_blank(label)


Text = Annotated[str, AfterValidator(refuse_nul)]
Reference = Annotated[str, StringConstraints(max_length=255), AfterValidator(refuse_nul)]
"""An id a platform names something by (its agent, a registered provider, a model route): it reaches logs and
stored reasons, so it is bounded and holds no NUL."""


def _refuse_controls(value: str) -> str:
    if any(unicodedata.category(char) in ("Cc", "Cf") for char in value):
        raise ValueError("must not hold control or format characters (an escape, a right-to-left override)")
    return value


GenerationId = Annotated[
    str,
    StringConstraints(max_length=255, pattern=r"^\S+$"),
    AfterValidator(_refuse_controls),
    AfterValidator(refuse_blank),
    Field(description="1 to 255 characters, no whitespace, no control or invisible-only characters"),
]
"""A platform's id of a model turn, as a client sends it: one visible word (a path segment its extraction is looked
up and its facts forgotten by, shown as it is stored)."""
ConversationId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=255),
    AfterValidator(refuse_nul),
    AfterValidator(refuse_blank),
    Field(description="1 to 255 characters, not blank (whitespace or invisible characters only), no NUL"),
]
"""A platform's id of a conversation, as a client sends it: visible, or its facts could not be forgotten by it."""


class EitherCase(BaseModel):
    """An object as a platform may store it: a key naming one of the model's fields in camelCase is read as that
    field. One field given in both spellings with two values is refused: which one the platform meant cannot be
    told. Other keys pass as they are (ignored, or refused by a model that forbids extras)."""

    @model_validator(mode="before")
    @classmethod
    def _snake_case_keys(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        keys: dict[str, Any] = {}
        for key, item in value.items():
            name = re.sub(r"(?<!^)(?=[A-Z])", "_", str(key)).lower()
            if name not in cls.model_fields:
                name = key
            elif name in keys and keys[name] != item:
                raise ValueError(f"{name} is given twice, in two spellings, with different values")
            keys[name] = item
        return keys
StoredContent = Annotated[
    str, StringConstraints(min_length=1, max_length=CONTENT_MAX_CHARS), AfterValidator(refuse_nul)
]
WrittenContent = Annotated[StoredContent, AfterValidator(refuse_blank)]
"""What a client or a model may write as an entry's content (the bus event takes any StoredContent)."""
Tag = Annotated[
    str,
    StringConstraints(min_length=1, max_length=TAG_MAX_CHARS),
    AfterValidator(refuse_nul),
    AfterValidator(one_visible_line),
]
def refuse_address(model: str) -> str:
    # Some litellm providers (oobabooga, huggingface) call the URL a model's name holds, whatever the provider's
    # registered address: a model named by a request must never point the service somewhere.
    if "//" in model:
        raise ValueError("must be a model's name, not an address")
    return model


ModelName = Annotated[str, StringConstraints(max_length=255), AfterValidator(refuse_nul), AfterValidator(refuse_address)]
"""A litellm model name as an agent or a provider's registration names it (no provider's name is longer)."""


def distinct_tags(tags: list[str]) -> list[str]:
    """Each label once, as first given: a tag twice, in any case, is the same label (globs match tags case-blind)."""
    first: dict[str, str] = {}
    for tag in tags:
        first.setdefault(tag.lower(), tag)
    return list(first.values())


Tags = Annotated[list[Tag], Field(max_length=TAGS_MAX_COUNT), AfterValidator(distinct_tags)]
Metadata = Annotated[dict[str, Any] | None, AfterValidator(check_metadata)]
WrittenMetadata = Annotated[Metadata, AfterValidator(refuse_metadata_grown_as_stored)]
"""What a client may write as an entry's metadata (the bus event takes any Metadata: a write an API of an earlier
version accepted is still decided)."""


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    # A platform may publish a time without its zone: read as UTC, it stays comparable with ours.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


UtcDatetime = Annotated[datetime, AfterValidator(as_utc)]


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
    occurred_at: UtcDatetime = Field(default_factory=utcnow)


class AgentContext(BaseModel):
    """Present only on agent write paths (write_memory tool, extraction): it is what allows a merge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent_id: str | None = None
    model: str = Field(description="litellm model used for merge and arbitration, e.g. openai/gpt-4o-mini")
    api_base: str | None = None
    api_key_env: str | None = Field(default=None, description="name of the env variable holding the key")
    ai_provider_id: str | None = Field(default=None, description="the registry provider metered for its usage")


class MemoryWriteRequested(Event):
    """Subject `memories.write.<partition>.<memory_id>`; stream MEMORY_WRITES; consumed by the writer."""

    project_id: str
    memory_id: str
    content: StoredContent
    source_type: SourceType = SourceType.MANUAL
    tags: Tags | None = None
    metadata: Metadata = None
    duplicate_threshold: float = Field(default=DEFAULT_DUPLICATE_THRESHOLD, ge=0.0, le=1.0)
    write_policy: WritePolicy | None = Field(default=None, description="overrides the memory's policy")
    agent: AgentContext | None = None
    source_generation_id: Text | None = None
    source_conversation_id: Text | None = None
    sources_seen_at: UtcDatetime | None = Field(
        default=None,
        description="when the cited generation and conversation were known to exist (default: occurred_at); "
        "one forgotten after this time is left out of the entry, one forgotten before it is cited anew",
    )
    reply_subject: str | None = Field(default=None, description="core NATS subject that awaits the outcome")

    @property
    def write_id(self) -> str:
        return self.event_id


class WriteError(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    code: str
    message: str
    status: int


class EntryState(BaseModel):
    """An entry as a write's transaction left it. The REST API shows entries in this shape (`EntryOut`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    memory_id: str
    content: str
    source_type: str
    tags: list[str] | None
    metadata: dict[str, Any] | None
    source_generation_id: str | None
    source_conversation_id: str | None
    invalidated_at: datetime | None
    superseded_by_entry_id: str | None
    created_at: datetime
    updated_at: datetime


class MemoryWriteOutcome(BaseModel):
    """Sent by the writer to a write's `reply_subject` after its transaction committed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    write_id: str
    action: WriteAction | None = None
    entry_id: str | None = None
    score: float | None = None
    error: WriteError | None = None
    entry: EntryState | None = Field(
        default=None,
        description="the entry named by entry_id as of the commit, so the caller need not read it back; "
        "absent on a failure, and on an outcome read back from storage",
    )


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


class ApiKeyRevoked(Event):
    """Core NATS subject `memories.api-keys.revoked`: every API process forgets the key it may have remembered."""

    key_id: str


class GenerationDeleted(Event):
    """Subject `generations.deleted.<project_id>`; stream GENERATIONS: entries forget the generation id."""

    project_id: str
    generation_id: str = Field(min_length=1, max_length=255)


class ConversationDeleted(Event):
    """Subject `conversations.deleted.<project_id>`; stream GENERATIONS: entries forget the conversation id."""

    project_id: str
    conversation_id: str = Field(min_length=1, max_length=255)


def _text_of_parts(content: Any) -> Any:
    """A message's content as OpenAI's APIs may give it, a list of parts: its text parts (`text`, `input_text`,
    `output_text`: whatever carries a `text` string) joined by a space; other parts (an image, audio, a file)
    say nothing a transcript can hold."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(part, dict) for part in content):
        raise ValueError("a list of content parts must hold objects ({type, text, …})")
    return " ".join(part["text"] for part in content if isinstance(part.get("text"), str)) or None


class ChatMessage(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    role: str
    content: Annotated[
        str | None,
        BeforeValidator(_text_of_parts, json_schema_input_type=str | list[dict[str, Any]] | None),
        Field(description="text, or a list of content parts whose text parts are read"),
    ] = None


class GenerationAgent(EitherCase):
    """The agent as the platform stores it; its keys (and its `knowledge_config`'s) may be snake_case or camelCase."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: Reference | None = None
    model: ModelName | None = Field(
        default=None,
        description="the agent's model (a litellm model or a provider's); with no registered provider or route behind "
        "it, called only if its provider is allowed (MEMORIES_AGENT_MODEL_PROVIDERS)",
    )
    ai_provider_id: Reference | None = Field(default=None, description="the agent's pinned provider")
    model_route_id: Reference | None = None
    knowledge_config: dict[str, Any] | None = None


class GenerationCompleted(Event):
    """Subject `generations.completed.<project_id>`; stream GENERATIONS; consumed by the extractor.

    Published by the agent platform when a model turn ends (or through POST /generations/completed)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    project_id: str
    generation_id: Text = Field(min_length=1, max_length=255)
    conversation_id: Text | None = Field(default=None, max_length=255)
    agent: GenerationAgent
    extract: bool | None = Field(default=None, description="per-turn override of the agent's extraction default")
    streamed: bool = Field(
        default=False, description="a streamed turn is never extracted, whatever `extract` says (skipped: streamed)"
    )
    status: Annotated[Text, StringConstraints(max_length=64, strip_whitespace=True, to_lower=True)] = Field(
        default="completed", description="completed, requires_action, failed, … (any case); only completed is extracted"
    )
    messages: list[ChatMessage] = Field(default_factory=list, max_length=500)
    output: str | None = Field(default=None, description="the assistant's reply of this turn")


class ExtractionSummary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    candidates: int = 0
    created: int = 0
    updated: int = 0
    skipped: int = 0
    failed: int = 0


class ExtractionCompleted(Event):
    """Subject `generations.extraction.<project_id>`; stream GENERATIONS: for the platform to record on
    its generation. `status` is completed, skipped (with `reason`) or failed (with `reason`)."""

    project_id: str
    generation_id: str
    status: str
    reason: str | None = None
    summary: ExtractionSummary


class DeadLetter(BaseModel):
    """Subject `dlq.<origin>`; stream DEAD_LETTERS: a message a consumer gave up on, with why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    origin_subject: str
    reason: str
    body: str = Field(description="the original payload, as text")
