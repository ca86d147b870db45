"""Which model serves an agent's extraction, and its merges: the seed's resolution order, as a pure function.

Provider: `extraction.ai_provider_id` → the agent's pinned provider → the agent's `model_route_id` → the
project's default route. Model, for the provider cases: `extraction.model` → the override provider's
`default_model` (when `ai_provider_id` is set) → the agent's `model` → the agent provider's `default_model`.
A route's targets each name their own model and are tried in order (failover).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.agents import AgentSpec, ExtractionConfig
from shared.events import AgentContext, GenerationAgent


@dataclass(frozen=True, slots=True)
class Provider:
    id: str
    provider: str  # litellm prefix: openai, anthropic, ollama, scripted, …
    api_base: str | None = None
    api_key_env: str | None = None
    default_model: str | None = None


@dataclass(frozen=True, slots=True)
class Target:
    """One model to try: what litellm is called with, and whom the usage is metered against."""

    model: str
    ai_provider_id: str | None = None
    api_base: str | None = None
    api_key_env: str | None = None

    def context(self, agent_id: str | None) -> AgentContext:
        return AgentContext(
            agent_id=agent_id,
            model=self.model,
            api_base=self.api_base,
            api_key_env=self.api_key_env,
            ai_provider_id=self.ai_provider_id,
        )


class ResolutionError(Exception):
    """No model can serve: the reason is recorded as the extraction's skip reason."""


IN_PROCESS_PROVIDERS = frozenset({"scripted"})
"""Served inside the process (shared.scripted_llm, where tests register it): nameable, as they reach no network."""


def nameable(model: str, providers: frozenset[str]) -> str:
    """`model`, named by a request itself (no registered provider or route behind it), as litellm is to be called
    with it, if the service may call it. Its provider is the part before the first "/", or for a bare name
    (`gpt-4o-mini`) the one litellm knows it by, which is then made explicit. Some litellm providers take the
    address to call from the model's name (`oobabooga/http://…`) or call a local server (`ollama/…`), so a tenant
    naming any model could make the service post to an address of its choice and read the answer back.
    Raises ResolutionError."""
    provider, slash, _ = model.partition("/")
    if not slash:
        provider = _known_provider_of(model)
    if not provider or _SAME_ENDPOINT_AS.get(provider, provider) not in providers | IN_PROCESS_PROVIDERS:
        shown = model if len(model) <= 80 else model[:80] + "…"
        raise ResolutionError(
            f"model {shown!r}: a request may name models of {', '.join(sorted(providers)) or 'no provider'} only"
            " (MEMORIES_AGENT_MODEL_PROVIDERS); register an AI provider for others"
        )
    return model if slash else f"{provider}/{model}"


_SAME_ENDPOINT_AS = {"text-completion-openai": "openai"}
"""litellm's names for a provider's other API on the same address and key (`gpt-3.5-turbo-instruct`)."""


def _known_provider_of(model: str) -> str | None:
    from shared.litellm_loader import load_litellm

    try:
        return str(load_litellm().get_llm_provider(model)[1])
    except Exception:  # noqa: BLE001 - litellm raises its own errors for a name it cannot place
        return None


def litellm_model(provider: str, model: str) -> str:
    return model if model.startswith(f"{provider}/") else f"{provider}/{model}"


def _target(provider: Provider, model: str | None) -> Target:
    if not model:
        raise ResolutionError(f"no model: provider {provider.id} has no default_model and none was given")
    return Target(litellm_model(provider.provider, model), provider.id, provider.api_base, provider.api_key_env)


def _route(route_id: str, routes: dict[str, list[dict[str, Any]]], providers: dict[str, Provider]) -> list[Target]:
    targets = routes.get(route_id)
    if not targets:
        raise ResolutionError(f"model route {route_id} does not exist in this project or has no targets")
    resolved = []
    for target in targets:
        provider = providers.get(str(target.get("ai_provider_id")))
        if provider is None:
            raise ResolutionError(f"model route {route_id} names an unknown provider")
        resolved.append(_target(provider, target.get("model") or provider.default_model))
    return resolved


def resolve_targets(
    extraction: ExtractionConfig,
    agent: GenerationAgent,
    *,
    providers: dict[str, Provider],
    routes: dict[str, list[dict[str, Any]]],
    default_route_id: str | None,
    service_model: str | None = None,
    nameable_providers: frozenset[str] = frozenset(),
) -> list[Target]:
    """The models to try in order. `providers` and `routes` are the project's own (isolation).

    On a provider, the model is the first of: `extraction.model`, the override provider's `default_model`
    (with `extraction.ai_provider_id`), the agent's `model`, the agent's provider's `default_model`. Without
    a provider or route, a model the request names must be of `nameable_providers` (see `nameable`)."""
    pinned = providers.get(agent.ai_provider_id) if agent.ai_provider_id else None
    agent_model = agent.model or (pinned.default_model if pinned else None)
    if extraction.ai_provider_id:
        override = providers.get(extraction.ai_provider_id)
        if override is None:
            raise ResolutionError("extraction.ai_provider_id names no provider of this project")
        return [_target(override, extraction.model or override.default_model or agent_model)]
    if agent.ai_provider_id:
        if pinned is None:
            raise ResolutionError("the agent's ai_provider_id names no provider of this project")
        return [_target(pinned, extraction.model or agent_model)]
    if agent.model_route_id:
        return _route(agent.model_route_id, routes, providers)
    if default_route_id:
        return _route(default_route_id, routes, providers)
    # A platform without a registry may send a full litellm model name; else the service's own model.
    requested = extraction.model or agent.model
    if requested:
        return [Target(nameable(requested, nameable_providers))]
    if service_model:
        return [Target(service_model)]
    raise ResolutionError("no model: configure an AI provider, a model route or MEMORIES_MERGE_MODEL")


def agent_for_merges(
    agent: AgentSpec,
    *,
    providers: dict[str, Provider],
    routes: dict[str, list[dict[str, Any]]],
    default_route_id: str | None,
    service_model: str | None = None,
    nameable_providers: frozenset[str] = frozenset(),
) -> AgentSpec:
    """A `write_memory` call's agent with the model its merges use, resolved as for its extraction: the
    first target (a write carries one model), the service's own model (`MEMORIES_MERGE_MODEL`) when it names
    none. An agent that names its endpoint itself (`api_base`, `api_key_env`: the admin token only) keeps it;
    one with no model anywhere merges nothing. Raises ResolutionError when it names a provider or route the
    project does not have, or a model it may not name."""
    if agent.api_base or agent.api_key_env:
        return agent
    spec = GenerationAgent(
        id=agent.id, model=agent.model, ai_provider_id=agent.ai_provider_id, model_route_id=agent.model_route_id
    )
    try:
        target = resolve_targets(
            ExtractionConfig(), spec, providers=providers, routes=routes, default_route_id=default_route_id,
            service_model=service_model, nameable_providers=nameable_providers,
        )[0]
    except ResolutionError:
        if agent.ai_provider_id or agent.model_route_id or agent.model:
            raise
        return agent  # no model anywhere: the write creates where it would merge
    return agent.model_copy(
        update={
            "model": target.model,
            "api_base": target.api_base,
            "api_key_env": target.api_key_env,
            "ai_provider_id": target.ai_provider_id,
        }
    )
