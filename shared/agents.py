"""What the service knows of an agent, and the writes that agents and orchestrations make.

An agent platform sends the agent's stored `knowledge_config` as it has it, snake_case or camelCase;
it is normalised on read. The `write_memory` tool's target is the config's `write_memory_id`, never a
memory the model names.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.events import (
    AgentContext,
    MemoryWriteRequested,
    SourceType,
)
from shared.ids import new_write_id


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()


def snake_keys(value: Any) -> Any:
    """camelCase keys to snake_case, recursively (a Formation may store either)."""
    if isinstance(value, dict):
        return {_snake(str(k)): snake_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snake_keys(v) for v in value]
    return value


class ExtractionConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    enabled: bool = True
    ai_provider_id: str | None = None
    model: str | None = None
    prompt: str | None = None


class KnowledgeConfig(BaseModel):
    """An agent's knowledge_config; unknown keys belong to the platform and are ignored."""

    model_config = ConfigDict(extra="ignore")

    memory_ids: list[str] = Field(default_factory=list)
    memory_tags: list[str] = Field(default_factory=list)
    limit: int | None = None
    min_score: float | None = None
    write_memory_id: str | None = None
    extraction: bool | ExtractionConfig | None = None

    @field_validator("memory_ids", "memory_tags", mode="before")
    @classmethod
    def _scalar_as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> KnowledgeConfig:
        return cls.model_validate(snake_keys(raw or {}))


class AgentSpec(BaseModel):
    """The agent fields a platform sends with a tool call or a completed turn."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    model: str | None = Field(default=None, description="litellm model, e.g. openai/gpt-4o-mini")
    api_base: str | None = None
    api_key_env: str | None = Field(default=None, description="name of the env variable with the provider key")
    knowledge_config: dict[str, Any] | None = None

    def knowledge(self) -> KnowledgeConfig:
        return KnowledgeConfig.parse(self.knowledge_config)

    def context(self) -> AgentContext | None:
        """The agent context a write carries; without a model there is nothing to merge with."""
        if not self.model:
            return None
        return AgentContext(agent_id=self.id, model=self.model, api_base=self.api_base, api_key_env=self.api_key_env)


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


def flatten_tags(tags: list[Any] | dict[str, Any] | None) -> list[str] | None:
    """A `{key: value}` map becomes `["key:value", …]`; a list is kept (as strings)."""
    if tags is None:
        return None
    if isinstance(tags, dict):
        return [f"{key}:{value}" for key, value in tags.items()]
    return [str(tag) for tag in tags]


def encode_content(content: Any) -> str:
    """An orchestration's mapped input may be any JSON value; non-strings are stored as JSON."""
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False, sort_keys=True)


def orchestration_event(
    *,
    project_id: str,
    memory_id: str,
    content: Any,
    tags: list[Any] | dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    source_type: SourceType = SourceType.ORCHESTRATION,
    write_id: str | None = None,
) -> MemoryWriteRequested:
    """An orchestration `memory_write` node's write. It carries no agent context, so it never merges."""
    return MemoryWriteRequested(
        event_id=write_id or new_write_id(),
        project_id=project_id,
        memory_id=memory_id,
        content=encode_content(content),
        source_type=source_type,
        tags=flatten_tags(tags),
        metadata=metadata,
    )

