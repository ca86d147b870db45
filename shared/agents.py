"""What the service knows of an agent, and the writes that agents and orchestrations make.

An agent platform sends the agent's stored `knowledge_config` as it has it, snake_case or camelCase;
it is normalised on read. The `write_memory` tool's target is the config's `write_memory_id`, never a
memory the model names.
"""

from __future__ import annotations

import json
import math
import unicodedata
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
)

from shared.events import (
    CONTENT_MAX_CHARS,
    METADATA_MAX_DEPTH,
    AgentContext,
    EitherCase,
    MemoryWriteRequested,
    ModelName,
    Reference,
    SourceType,
    Tag,
    Text,
    json_text,
    nested_deeper_than,
    refuse_nul,
)
from shared.ids import new_write_id
from shared.search import KnowledgeFilter
from shared.settings import is_service_variable


def _one_or_many(value: Any) -> Any:
    """A scalar where a list is expected is a list of one (`"memory_ids": "mem_…"` is a common slip)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


MAX_MEMORY_IDS = 100
MAX_TAG_PATTERNS = 20

MemoryIdList = Annotated[
    list[Annotated[str, StringConstraints(max_length=64), AfterValidator(refuse_nul)]],
    BeforeValidator(_one_or_many),
    Field(max_length=MAX_MEMORY_IDS),
]
TagPatternList = Annotated[
    list[Tag],  # a pattern obeys the rules of a tag
    BeforeValidator(_one_or_many),
    Field(max_length=MAX_TAG_PATTERNS),
]
def _refuse_boolean(value: Any) -> Any:
    # Pydantic's lax mode reads `true` as 1: no platform storing `"limit": true` meant a limit of one.
    if isinstance(value, bool):
        raise ValueError("a number, not a boolean")  # noqa: TRY004 - pydantic reports only a ValueError
    return value


# The bounds first: after a validator, pydantic publishes them as `ge`/`le`, which JSON Schema does not know.
MinScore = Annotated[float, Field(ge=-1.0, le=1.0, allow_inf_nan=False), BeforeValidator(_refuse_boolean)]


class _EitherCase(EitherCase):
    """Accepts snake_case or camelCase keys (a Formation may store either); refuses unknown ones."""

    model_config = ConfigDict(extra="forbid")


class ExtractionConfig(_EitherCase):
    enabled: bool = True
    ai_provider_id: Reference | None = None
    model: ModelName | None = None
    prompt: Text | None = Field(default=None, max_length=CONTENT_MAX_CHARS)


class KnowledgeConfig(_EitherCase):
    """An agent's `knowledge_config`: what it reads (search) and where it writes (tool, extraction)."""

    # pydantic copies a default per instance (ruff cannot tell this class is a model through its base).
    memory_ids: MemoryIdList = []  # noqa: RUF012
    memory_tags: TagPatternList = []  # noqa: RUF012
    limit: Annotated[int, BeforeValidator(_refuse_boolean)] | None = Field(
        default=None, description="default 10; clamped to 1..100"
    )
    min_score: MinScore | None = None
    write_memory_id: Reference | None = None
    extraction: bool | ExtractionConfig | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> KnowledgeConfig:
        return cls.model_validate(raw or {})

    @classmethod
    def parse_stored(cls, raw: dict[str, Any] | None) -> KnowledgeConfig:
        """The config as a platform stored it with its agent and sends it on the bus: keys the service does not
        know (a platform's own retrieval settings) are ignored, not a reason to skip its extraction; the keys it
        knows are validated all the same."""
        return StoredKnowledgeConfig.model_validate(raw or {})

    @property
    def filters(self) -> KnowledgeFilter:
        return KnowledgeFilter(memory_ids=tuple(self.memory_ids), tag_patterns=tuple(self.memory_tags))


class StoredExtractionConfig(ExtractionConfig):
    model_config = ConfigDict(extra="ignore")


class StoredKnowledgeConfig(KnowledgeConfig):
    model_config = ConfigDict(extra="ignore")

    extraction: bool | StoredExtractionConfig | None = None


def refuse_service_variable(name: str) -> str:
    if is_service_variable(name):
        raise ValueError("names a setting of the service (its admin token, its database): not a provider key")
    return name


_KEY_PARAMETERS = frozenset(
    {"api_key", "apikey", "api-key", "key", "token", "access_token", "code", "sig", "signature", "subscription-key",
     "x-api-key"}
)


def web_address(address: str) -> str:
    """litellm calls a provider's address over HTTP: a `file:` or `gopher:` one, or one holding a line break (shown
    otherwise than stored), is a mistake or worse."""
    if any(char.isspace() or unicodedata.category(char) == "Cc" for char in address):
        raise ValueError("must be a URL without spaces or control characters")
    parts = urlsplit(address)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    return address


def refuse_credentials(address: str) -> str:
    """A key in a provider's address is shown to whoever reads the registry, travels with every write event and
    into dead letters, and fails next to the bearer key anyway: the key belongs in the variable `api_key_env`
    names."""
    parts = urlsplit(address)
    if parts.username or parts.password:
        raise ValueError("must not carry credentials (user:password@): name the key's variable in api_key_env")
    if any(name.lower() in _KEY_PARAMETERS for name, _ in parse_qsl(parts.query, keep_blank_values=True)):
        raise ValueError("must not carry a key in its query: name the key's variable in api_key_env")
    return address


def redact_address(address: str) -> str:
    """`address` with any credentials it carries replaced by `***` (one stored before they were refused)."""
    parts = urlsplit(address)
    host = parts.hostname or ""
    netloc = f"***@{host}" if parts.username or parts.password else parts.netloc
    if parts.port and (parts.username or parts.password):
        netloc += f":{parts.port}"
    query = urlencode(
        [
            (name, "***" if name.lower() in _KEY_PARAMETERS else value)
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        ],
        safe="*",
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


ProviderAddress = Annotated[
    str,
    StringConstraints(max_length=2048),
    AfterValidator(refuse_nul),
    AfterValidator(web_address),
    AfterValidator(refuse_credentials),
]
"""Where a provider's models answer (litellm's api_base), without credentials."""

KeyVariable = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"), AfterValidator(refuse_service_variable)
]
"""The NAME of the environment variable holding a provider's key (the key itself is never stored)."""


class AgentSpec(EitherCase):
    """The agent fields a platform sends with a tool call or a completed turn, snake_case or camelCase."""

    model_config = ConfigDict(extra="ignore")

    id: Reference | None = None
    model: ModelName | None = Field(
        default=None,
        description="litellm model, e.g. openai/gpt-4o-mini; with no registered provider or route behind it, called "
        "only if its provider is allowed (MEMORIES_AGENT_MODEL_PROVIDERS)",
    )
    ai_provider_id: Reference | None = Field(default=None, description="the agent's provider, registered for the project")
    model_route_id: Reference | None = Field(default=None, description="the agent's model route")
    api_base: ProviderAddress | None = None
    api_key_env: KeyVariable | None = Field(default=None, description="name of the env variable with the provider key")
    knowledge_config: KnowledgeConfig = Field(default_factory=KnowledgeConfig)

    def context(self) -> AgentContext | None:
        """The agent context a write carries; without a model there is nothing to merge with."""
        if not self.model:
            return None
        return AgentContext(
            agent_id=self.id,
            model=self.model,
            api_base=self.api_base,
            api_key_env=self.api_key_env,
            ai_provider_id=self.ai_provider_id,
        )


def write_memory_event(
    *, project_id: str, memory_id: str, content: str, agent: AgentSpec, generation_id: str | None
) -> MemoryWriteRequested:
    """The `write_memory` tool's write: source_type agent, provenance of the generation, no conversation."""
    return MemoryWriteRequested(
        event_id=new_write_id(),
        project_id=project_id,
        memory_id=memory_id,
        content=content,
        source_type=SourceType.AGENT,
        agent=agent.context(),
        source_generation_id=generation_id,
        source_conversation_id=None,
    )


def flatten_tags(tags: Any) -> Any:
    """An orchestration's `{key: value}` tag map becomes `["key:value", …]`, in key order: a map's order means
    nothing in JSON, so a retry that sends it otherwise is the same request (its Idempotency-Key is not refused
    as reused). Anything else is left as it is, for the tag rules to judge."""
    if not isinstance(tags, dict):
        return tags
    if not all(isinstance(value, str | int | float | bool) for value in tags.values()):
        raise ValueError("tag map values must be strings, numbers or booleans")
    if any(isinstance(value, float) and not math.isfinite(value) for value in tags.values()):
        raise ValueError("tag map values must not be NaN or Infinity (not JSON numbers)")
    # Values spelled as in the JSON they came from: `urgent:true`, not Python's `urgent:True`.
    return [f"{key}:{json.dumps(value) if isinstance(value, bool) else value}" for key, value in sorted(tags.items())]


def encode_content(content: Any) -> Any:
    """An orchestration's mapped input may be any JSON value; non-strings are stored as JSON (a null is
    left as it is: there is no input)."""
    if content is None or isinstance(content, str):
        return content
    if nested_deeper_than(content, METADATA_MAX_DEPTH):
        raise ValueError(f"must be nested at most {METADATA_MAX_DEPTH} levels deep")
    return json_text(content, sort_keys=True)


def orchestration_event(
    *,
    project_id: str,
    memory_id: str,
    content: str,
    tags: list[str] | None = None,
    metadata: dict[str, Any] | None = None,
    source_type: SourceType = SourceType.ORCHESTRATION,
    write_id: str | None = None,
) -> MemoryWriteRequested:
    """An orchestration `memory_write` node's write, from content and tags already encoded and flattened
    (`encode_content`, `flatten_tags`, applied where the request is read). It carries no agent context, so it
    never merges."""
    return MemoryWriteRequested(
        event_id=write_id or new_write_id(),
        project_id=project_id,
        memory_id=memory_id,
        content=content,
        source_type=source_type,
        tags=tags,
        metadata=metadata,
    )
