"""Bodies of the knowledge routes (docs/api.md, Knowledge search). Strict like the others."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, AliasChoices, BaseModel, Field, StrictInt, StringConstraints
from pydantic import Strict as JsonTypesOnly

from services.api.schemas import Strict, Timestamp
from shared.agents import KnowledgeConfig, MemoryIdList, MinScore, TagPatternList
from shared.events import CONTENT_MAX_CHARS, refuse_nul
from shared.search import KnowledgeHit

Query = Annotated[str, StringConstraints(max_length=CONTENT_MAX_CHARS), AfterValidator(refuse_nul)]
# The last user message may be long; only its first CONTENT_MAX_CHARS characters are embedded.
UserMessage = Annotated[str, AfterValidator(refuse_nul)]


class KnowledgeSearch(Strict):
    project_id: str | None = None
    query: Query | None = Field(default=None, description="ranked by similarity when given")
    min_score: Annotated[MinScore, JsonTypesOnly()] | None = Field(default=None, description="cosine similarity, -1..1")
    limit: StrictInt | None = Field(default=None, description="default 10; clamped to 1..100")
    memory_ids: MemoryIdList = Field(default=[], description="a string is taken as a list of one")
    memory_tags: TagPatternList = Field(
        default=[], description="globs (`*`, `?`) on the memories' tags and on the entries' own tags"
    )


class KnowledgeContextRequest(Strict):
    project_id: str | None = None
    # An agent's config as the platform stores it, its key (and its own keys) camelCase or snake_case.
    knowledge_config: KnowledgeConfig = Field(
        default_factory=KnowledgeConfig, validation_alias=AliasChoices("knowledge_config", "knowledgeConfig")
    )
    message: UserMessage | None = Field(default=None, description="the last user message: the query")


class KnowledgeResult(BaseModel):
    source_type: str = "memory"
    entry_id: str
    memory_id: str
    memory_name: str
    content: str
    tags: list[str] | None
    score: float | None = Field(default=None, description="absent when there is no query")
    similarity_score: float | None = Field(default=None, description="equal to score")
    created_at: Timestamp
    updated_at: Timestamp

    @classmethod
    def json_of(cls, hit: KnowledgeHit) -> dict[str, Any]:
        result = cls(
            entry_id=hit.entry_id,
            memory_id=hit.memory_id,
            memory_name=hit.memory_name,
            content=hit.content,
            tags=hit.tags,
            score=hit.score,
            similarity_score=hit.score,
            created_at=hit.created_at,
            updated_at=hit.updated_at,
        )
        # Listed without a query, a result has no score at all rather than a null one.
        unscored = {"score", "similarity_score"} if hit.score is None else set()
        return result.model_dump(mode="json", exclude=unscored)


class KnowledgeSearchResponse(BaseModel):
    results: list[KnowledgeResult]


class ContextMessage(BaseModel):
    role: str
    content: str


class KnowledgeContextResponse(BaseModel):
    message: ContextMessage | None = Field(description="the user-role message to inject; null: nothing found")
    results: list[KnowledgeResult]
