"""SQL of the model registry (AI providers, model routes, a project's default route), LLM usage and
extraction outcomes. Functions take a session and never commit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, null, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared.db.models import AiProvider, GenerationExtraction, LlmUsage, ModelRoute, ProjectSettings
from shared.ids import PROVIDER_PREFIX, ROUTE_PREFIX, is_valid_id, new_id
from shared.providers import Provider
from shared.repository import lock_key, visible

if TYPE_CHECKING:
    from shared.extraction import ExtractionResult
    from shared.llm import Completion

async def lock_registry(session: AsyncSession, project_id: str) -> None:
    """Until the transaction ends, no other change of the project's providers, routes or default route: what a
    change checks (a route's targets exist, no route names a provider being deleted, the default route exists)
    still holds when it commits. Creating a provider needs it not: nothing refers to a new one yet."""
    await lock_key(session, f"registry:{project_id}")


async def create_provider(session: AsyncSession, project_id: str, **values: Any) -> AiProvider:
    provider = AiProvider(id=new_id(PROVIDER_PREFIX), project_id=project_id, **values)
    session.add(provider)
    await session.flush()
    await session.refresh(provider)
    return provider


async def list_providers(session: AsyncSession, project_id: str) -> list[AiProvider]:
    query = select(AiProvider).where(AiProvider.project_id == project_id).order_by(AiProvider.created_at, AiProvider.id)
    return list((await session.scalars(query)).all())


async def get_provider(session: AsyncSession, project_id: str | None, provider_id: str) -> AiProvider | None:
    """None also for what is no provider id (a malformed one is not found, as any unknown id)."""
    if not is_valid_id(provider_id, PROVIDER_PREFIX):
        return None
    return visible(await session.get(AiProvider, provider_id), project_id)


async def delete_provider(session: AsyncSession, provider: AiProvider) -> None:
    await session.execute(delete(AiProvider).where(AiProvider.id == provider.id))


async def create_route(session: AsyncSession, project_id: str, name: str, targets: list[dict[str, Any]]) -> ModelRoute:
    route = ModelRoute(id=new_id(ROUTE_PREFIX), project_id=project_id, name=name, targets=targets)
    session.add(route)
    await session.flush()
    await session.refresh(route)
    return route


async def list_routes(session: AsyncSession, project_id: str) -> list[ModelRoute]:
    query = select(ModelRoute).where(ModelRoute.project_id == project_id).order_by(ModelRoute.created_at, ModelRoute.id)
    return list((await session.scalars(query)).all())


async def get_route(session: AsyncSession, project_id: str | None, route_id: str) -> ModelRoute | None:
    """None also for what is no route id (a malformed one is not found, as any unknown id)."""
    if not is_valid_id(route_id, ROUTE_PREFIX):
        return None
    return visible(await session.get(ModelRoute, route_id), project_id)


async def delete_route(session: AsyncSession, route: ModelRoute) -> None:
    await session.execute(delete(ModelRoute).where(ModelRoute.id == route.id))


async def set_default_route(session: AsyncSession, project_id: str, route_id: str | None) -> None:
    await session.execute(
        insert(ProjectSettings)
        .values(project_id=project_id, default_model_route_id=route_id)
        .on_conflict_do_update(
            index_elements=[ProjectSettings.project_id],
            set_={"default_model_route_id": route_id, "updated_at": func.now()},
        )
    )


async def get_default_route(session: AsyncSession, project_id: str) -> str | None:
    settings = await session.get(ProjectSettings, project_id)
    return settings.default_model_route_id if settings else None


async def load_model_registry(
    session: AsyncSession, project_id: str
) -> tuple[dict[str, Provider], dict[str, list[dict[str, Any]]], str | None]:
    """Everything resolution needs, of this project only."""
    providers = {
        p.id: Provider(p.id, p.provider, p.api_base, p.api_key_env, p.default_model)
        for p in await list_providers(session, project_id)
    }
    routes = {r.id: list(r.targets) for r in await list_routes(session, project_id)}
    return providers, routes, await get_default_route(session, project_id)


@dataclass(frozen=True)
class Spent:
    """One model call's tokens, metered to the provider that served it (None: a model named without one)."""

    ai_provider_id: str | None
    purpose: str
    completion: Completion


async def record_usage(sessions: async_sessionmaker[AsyncSession], project_id: str, spent: Sequence[Spent]) -> None:
    """Stored at once, in a transaction of its own: the work that asked the models may still fail (and be tried
    again), and the tokens were spent all the same."""
    if not spent:
        return
    async with sessions.begin() as session:
        session.add_all(
            LlmUsage(
                project_id=project_id,
                ai_provider_id=call.ai_provider_id,
                model=call.completion.model,
                purpose=call.purpose,
                prompt_tokens=call.completion.prompt_tokens,
                completion_tokens=call.completion.completion_tokens,
            )
            for call in spent
        )


async def usage_summary(session: AsyncSession, project_id: str) -> list[dict[str, Any]]:
    query = (
        select(
            LlmUsage.ai_provider_id,
            LlmUsage.model,
            LlmUsage.purpose,
            func.count().label("calls"),
            func.sum(LlmUsage.prompt_tokens).label("prompt_tokens"),
            func.sum(LlmUsage.completion_tokens).label("completion_tokens"),
        )
        .where(LlmUsage.project_id == project_id)
        .group_by(LlmUsage.ai_provider_id, LlmUsage.model, LlmUsage.purpose)
        # Every grouped column: two providers serving the same model for the same purpose tied, and a page could
        # repeat or skip a row.
        .order_by(LlmUsage.model, LlmUsage.purpose, LlmUsage.ai_provider_id.asc().nulls_first())
    )
    return [dict(row._mapping) for row in (await session.execute(query)).all()]


EXTRACTED = ("completed", "skipped")
"""The statuses of a turn extracted for good: reported or delivered again, it is not extracted twice."""


async def save_extraction(
    session: AsyncSession, project_id: str, generation_id: str, result: ExtractionResult
) -> bool:
    """Whether `result` was stored: a failure or a skip is not, over a turn extracted for good meanwhile."""
    values = {
        "status": result.status,
        "reason": result.reason,
        "model": result.model,
        **result.summary.model_dump(),
    }
    if result.status in EXTRACTED:
        values["facts"] = null()  # written, or never to be: kept only while a retry might need them (SQL NULL)
    changes = dict(values)
    if result.status == "failed":
        # The saved facts and the model that answered stay for the retry, which writes those and merges with it.
        del changes["model"]
    stored = await session.scalar(
        insert(GenerationExtraction)
        .values(project_id=project_id, generation_id=generation_id, **values)
        .on_conflict_do_update(
            index_elements=[GenerationExtraction.project_id, GenerationExtraction.generation_id],
            set_={**changes, "updated_at": func.now()},
            # A turn extracted for good stays so: a late delivery that failed or was skipped (two deliveries of one
            # turn at once) must not undo the outcome of the one that completed it.
            where=None if result.status == "completed" else GenerationExtraction.status.not_in(EXTRACTED),
        )
        .returning(GenerationExtraction.status)
    )
    return stored is not None


@dataclass(frozen=True, slots=True)
class SavedFacts:
    facts: list[str]
    model: str | None
    status: str  # `completed` or `skipped`: another extraction of the turn finished it first (write nothing)


async def save_extracted_facts(
    session: AsyncSession, project_id: str, generation_id: str, facts: list[str], model: str
) -> SavedFacts:
    """Keep the model's facts for a turn before any is written, and return the facts (and model) in effect: the
    first saved wins, so two extractions of one turn racing each other write one wording; one that finished
    already (its facts cleared) is said by the status."""
    await session.execute(
        insert(GenerationExtraction)
        .values(project_id=project_id, generation_id=generation_id, status="pending", facts=facts, model=model)
        .on_conflict_do_update(
            index_elements=[GenerationExtraction.project_id, GenerationExtraction.generation_id],
            set_={"facts": facts, "model": model, "updated_at": func.now()},
            where=GenerationExtraction.facts.is_(None) & GenerationExtraction.status.not_in(EXTRACTED),
        )
    )
    kept = (
        await session.execute(
            select(GenerationExtraction.facts, GenerationExtraction.model, GenerationExtraction.status).where(
                GenerationExtraction.project_id == project_id, GenerationExtraction.generation_id == generation_id
            )
        )
    ).one()
    return SavedFacts(list(kept.facts if kept.facts is not None else facts), kept.model, kept.status)


@dataclass(frozen=True, slots=True)
class ReportedTurn:
    status: str
    """The turn's extraction status now: `pending` (new, a retry, or not done yet), or `completed` / `skipped`
    when it was extracted already (reported again, it is not extracted twice)."""
    retry_of: str | None = None
    """For a retry of a failed extraction, the time of that failure: tells this attempt from the first on the bus."""
    first_reported_at: datetime | None = None
    """When the turn was first known here (None: now). Its facts cite its generation and conversation as of then:
    reported again after a forgetting, the turn is no newer than it was."""

    @property
    def reported_before(self) -> bool:
        """Pending from an earlier report (not a new turn, nor a retry): its event was published then."""
        return self.first_reported_at is not None and self.retry_of is None


async def mark_extraction_pending(session: AsyncSession, project_id: str, generation_id: str) -> ReportedTurn:
    """Record a reported turn as pending, unless it is known. A turn whose extraction failed is a retry: it is
    pending again."""
    known = (
        await session.execute(
            select(GenerationExtraction.status, GenerationExtraction.updated_at, GenerationExtraction.created_at)
            .where(GenerationExtraction.project_id == project_id, GenerationExtraction.generation_id == generation_id)
            .with_for_update()
        )
    ).first()
    if known is None:
        await session.execute(
            insert(GenerationExtraction)
            .values(project_id=project_id, generation_id=generation_id, status="pending")
            .on_conflict_do_nothing()
        )
        return ReportedTurn("pending")
    if known.status != "failed":
        return ReportedTurn(known.status, first_reported_at=known.created_at)
    await session.execute(
        update(GenerationExtraction)
        .where(GenerationExtraction.project_id == project_id, GenerationExtraction.generation_id == generation_id)
        .values(status="pending", reason=None, updated_at=func.now())
    )
    return ReportedTurn("pending", retry_of=known.updated_at.isoformat(), first_reported_at=known.created_at)


async def fail_unpublished_extraction(session: AsyncSession, project_id: str, generation_id: str) -> None:
    """A report that could not be published leaves the turn failed (a retry as it found it), so that the caller's next
    report is a retry: under its first message id the stream's duplicate window could swallow it."""
    await session.execute(
        update(GenerationExtraction)
        .where(
            GenerationExtraction.project_id == project_id,
            GenerationExtraction.generation_id == generation_id,
            GenerationExtraction.status == "pending",
        )
        .values(status="failed", reason="the turn could not be published; report the turn again", updated_at=func.now())
    )


async def get_extraction(session: AsyncSession, project_id: str, generation_id: str) -> GenerationExtraction | None:
    return await session.get(GenerationExtraction, (project_id, generation_id))
