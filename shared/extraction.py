"""Automatic extraction: facts from a completed turn, each written through the one write algorithm.

Gating, the prompt and the parser are pure functions. `Extractor.extract` is the unit of work the
extractor service runs per `generation.completed` event: resolve the model, ask it for facts (failover
across a route's targets), submit one write per fact with an id derived from (generation, index, content)
so a redelivered event writes nothing twice, and store the summary.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import metrics, registry, write_records
from shared import repository as repo
from shared.agents import ExtractionConfig, KnowledgeConfig
from shared.context import without_reference_context
from shared.db.models import GenerationExtraction
from shared.events import (
    CONTENT_MAX_CHARS,
    ExtractionSummary,
    GenerationCompleted,
    MemoryWriteOutcome,
    MemoryWriteRequested,
    SourceType,
    WriteAction,
    is_blank,
    storable,
    utcnow,
)
from shared.ids import MEMORY_PREFIX, WRITE_PREFIX, is_valid_id
from shared.llm import LlmError, PromptTooLong, RateLimited, complete
from shared.metrics import Purpose
from shared.providers import ResolutionError, Target, resolve_targets
from shared.write_gateway import PublishOrder, WriteGateway
from shared.writes import REFUSED_FOR_NOW

log = logging.getLogger("memories.extraction")

MAX_CANDIDATES = 20

DEFAULT_INSTRUCTIONS = (
    "Read the conversation below and list the discrete facts in it that are worth remembering long-term: "
    "facts about the user, their preferences, their world, decisions taken and constraints discovered. "
    "Each fact must be atomic and written as one self-contained sentence that makes sense without the "
    "conversation. Skip greetings, small talk, thanks, and anything transient."
)
CONTRACT_LINE = "Respond with a JSON array of strings and nothing else; [] if there is nothing."


@dataclass(frozen=True, slots=True)
class Gate:
    run: bool
    reason: str | None = None  # why not, when run is False
    config: KnowledgeConfig | None = None


def gate(event: GenerationCompleted) -> Gate:
    """The seed's rules for whether a turn is extracted; every refusal has a reason."""
    if event.streamed:
        return Gate(False, "streamed")
    if event.status != "completed":
        return Gate(False, f"status_{event.status}")
    try:
        config = KnowledgeConfig.parse_stored(event.agent.knowledge_config)
    except ValidationError:
        return Gate(False, "invalid_knowledge_config")
    if not config.write_memory_id:
        return Gate(False, "no_write_memory_id")
    if event.extract is False:
        return Gate(False, "turn_opted_out")
    extraction = config.extraction
    enabled = event.extract is True or extraction is True or (
        isinstance(extraction, ExtractionConfig) and extraction.enabled
    )
    if not enabled:
        return Gate(False, "extraction_disabled")
    if not transcript_lines(event):  # instructions and reference material only: no model call for nothing
        return Gate(False, "nothing_said")
    return Gate(True, config=config)


NOT_SAID = frozenset({"system", "developer"})
"""Roles whose messages are the agent's instructions, not the conversation: doctrine, never a memory."""


def transcript_lines(event: GenerationCompleted) -> list[str]:
    """What was said in the turn, one `role: content` line a message. Left out: instructions, and the
    reference context this service handed the model (its facts are stored already; extracting them again
    would copy read-only memories into the write memory). Line breaks are folded, so that no message can
    forge a line of another role."""
    said = [
        (role, content) for m in event.messages
        if (role := _one_line(m.role)).strip().casefold() not in NOT_SAID
        and (content := without_reference_context(m.content or ""))
    ]
    if event.output and (not event.messages or event.messages[-1].content != event.output):
        said.append(("assistant", event.output))
    return [f"{role}: {_one_line(content)}" for role, content in said]


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


def build_prompt(event: GenerationCompleted, extraction: ExtractionConfig | None) -> list[dict[str, str]]:
    """A custom prompt replaces the instructions only: the contract line and the transcript always follow."""
    instructions = (extraction.prompt if extraction and extraction.prompt else None) or DEFAULT_INSTRUCTIONS
    transcript = "\n".join(transcript_lines(event))
    return [{"role": "user", "content": f"{instructions}\n\n{CONTRACT_LINE}\n\nConversation:\n{transcript}"}]


class UnreadableAnswer(LlmError):
    """The model began an array of facts it did not finish (cut off, malformed): not "no facts" (`[]`), which would
    be stored as the turn's answer for good, but a failure, asked again."""


_DECODER = json.JSONDecoder()
_FACTS_BEGIN = re.compile(r"\[\s*[\"'{]")
"""Where an array of facts (strings or objects) begins: `["`, `['`, `[{`."""
_DRAFT_END = re.compile(r"</(?:think|thinking|reasoning)>", re.IGNORECASE)
_DRAFT_START = re.compile(r"<(?:think|thinking|reasoning)>", re.IGNORECASE)
"""A reasoning model's draft, which some servers leave in the answer's text (DeepSeek-R1 or Qwen3 on Ollama or vLLM
without a reasoning parser): the facts come after it, and the draft may quote the conversation's own brackets. Its
opening tag is often the chat template's, so only the closing one is in the text."""
_PYTHON_LIST_BEGIN = re.compile(r"\[\s*['\"]")
_PYTHON_LISTS_TRIED = 64
"""Python-style readings of an answer at most: each is a parse of up to the whole answer, and a hostile one (a
model steered by the conversation) with a thousand `['` would otherwise hold the extractor for minutes."""
_UNPARSABLE = (ValueError, RecursionError)  # JSON nested past Python's stack is no answer either
ANSWER_MAX_CHARS = 200_000
"""The longest answer read: twenty facts of 8,000 characters, in JSON. A longer one is no list of atomic facts."""
_ARRAY_STARTS_TRIED = 256
"""`[`s of an answer read as the start of its array at most: each reading may run to the answer's end."""


def _without_draft(text: str) -> str:
    """The answer after its reasoning draft. UnreadableAnswer for a draft never ended (the model ran out of tokens
    thinking): there is no answer to read, only the draft's words."""
    ends = list(_DRAFT_END.finditer(text))
    if ends:
        text = text[ends[-1].end() :]
    if _DRAFT_START.search(text):
        raise UnreadableAnswer("the model's answer is a reasoning draft it did not end")
    return text


def _python_list_at(text: str, start: int, tries: list[int]) -> list[Any] | None:
    """A Python-style list of literals beginning at `start` (`['A', "B's"]`, what small models often write), up to
    one of the next `]`s; None when there is none, or when `tries` (the readings left for the answer) runs out."""
    if not _PYTHON_LIST_BEGIN.match(text, start):
        return None
    end = text.find("]", start)
    while end >= 0 and tries[0] > 0:
        tries[0] -= 1
        with contextlib.suppress(ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            written = ast.literal_eval(text[start : end + 1])  # literals only: nothing is run
            if isinstance(written, list):
                return written
        end = text.find("]", end + 1)
    return None


def _facts_array(text: str) -> list[Any]:
    """The answer's array of facts, its reasoning draft left out. As the contract reads it, from the first `[` to
    the last `]`, as JSON or as a Python list (`['…']`, what small models often write); an object's `facts`; else
    the first array in the text that holds a string or an object (prose with brackets of its own around it:
    "…] I skipped greetings [as instructed]." lost the facts before it). None in prose alone ("I found no facts
    [only greetings]"). UnreadableAnswer when an array of facts was begun and none was finished."""
    if len(text) > ANSWER_MAX_CHARS:
        raise UnreadableAnswer(f"the model's answer is {len(text)} characters long, over {ANSWER_MAX_CHARS}")
    text = _without_draft(text)
    first, last = text.find("["), text.rfind("]")
    if 0 <= first < last:
        with contextlib.suppress(*_UNPARSABLE):
            whole = json.loads(text[first : last + 1])
            if isinstance(whole, list):
                return whole
    opened, closed = text.find("{"), text.rfind("}")
    if 0 <= opened < closed:
        with contextlib.suppress(*_UNPARSABLE):
            answer = json.loads(text[opened : closed + 1])
            if isinstance(answer, dict) and isinstance(answer.get("facts"), list):
                return list(answer["facts"])
    begun = False
    start = first
    tries = [_PYTHON_LISTS_TRIED]
    for _ in range(_ARRAY_STARTS_TRIED):
        if start < 0:
            break
        try:
            items, _end = _DECODER.raw_decode(text, start)
        except _UNPARSABLE:
            items = _python_list_at(text, start, tries)
            begun = begun or (items is None and _FACTS_BEGIN.match(text, start) is not None)
        if isinstance(items, list) and any(isinstance(item, str | dict) for item in items):
            return items
        start = text.find("[", start + 1)
    if begun:
        raise UnreadableAnswer(f"the model's answer ({len(text)} characters) begins an array of facts it does not end")
    return []


def _fact_of(item: Any) -> Any:
    """A string item, or the first of an object's `content`, `fact` and `text` that holds one."""
    if not isinstance(item, dict):
        return item
    return next((item[key] for key in ("content", "fact", "text") if isinstance(item.get(key), str)), None)


def parse_candidates(text: str) -> list[str]:
    """The answer's array of facts (`_facts_array`): strings or objects holding one (`content`, or `fact` or `text`
    as models also name it); empty and over-long ones dropped; at most 20."""
    items = _facts_array(text)
    facts = []
    for item in items:
        content = _fact_of(item)
        if isinstance(content, str):
            content = storable(content).strip()
            # An over-long "fact" is a paragraph, not an atomic fact: dropped, not cut mid-sentence (a cut can
            # change what it says).
            if not is_blank(content) and len(content) <= CONTENT_MAX_CHARS:
                facts.append(content)
    return facts[:MAX_CANDIDATES]


def candidate_write_id(project_id: str, generation_id: str, index: int, content: str) -> str:
    digest = hashlib.sha256(f"{project_id}\x00{generation_id}\x00{index}\x00{content}".encode()).hexdigest()
    return WRITE_PREFIX + digest[:32]


@dataclass(frozen=True, slots=True)
class ExtractionResult:
    status: str  # completed | skipped | failed
    reason: str | None
    summary: ExtractionSummary
    model: str | None = None
    replayed: bool = False  # the stored outcome of an earlier delivery: nothing was decided now


class Extractor:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        gateway: WriteGateway,
        *,
        llm_timeout: float,
        write_timeout: float,
        service_model: str | None = None,
        nameable_providers: frozenset[str] = frozenset(),
        rate_limit_retries: int = 4,
    ) -> None:
        self._sessions = sessions
        self._gateway = gateway
        self._llm_timeout = llm_timeout
        self._write_timeout = write_timeout
        self._service_model = service_model
        self._nameable_providers = nameable_providers
        self._rate_limit_retries = rate_limit_retries

    async def extract(self, event: GenerationCompleted, *, arrived_at: datetime | None = None) -> ExtractionResult:
        """Raises LlmError when every target failed (or gave an unreadable answer): the caller lets JetStream
        redeliver (then dead-letters); WritesPending or WritesRefused when facts are queued or refused for now.

        `arrived_at`: when the turn reached the bus (the same on every redelivery); default now."""
        # The turn's time (a forgetting since then applies to its facts), never later than its arrival: a platform's
        # clock running ahead must not make a turn look newer than a forgetting made meanwhile.
        turn_time = min(event.occurred_at, arrived_at or utcnow())
        async with self._sessions() as session:
            done = await registry.get_extraction(session, event.project_id, event.generation_id)
        if done is not None and done.status in registry.EXTRACTED:
            # A redelivery after the outcome was stored: asking the model again could word facts differently.
            return _replay_of(done)
        decision = gate(event)
        if not decision.run or decision.config is None:
            return await self._finish(event, ExtractionResult("skipped", decision.reason, ExtractionSummary()))
        config = decision.config
        extraction = config.extraction if isinstance(config.extraction, ExtractionConfig) else ExtractionConfig()
        async with self._sessions() as session:
            write_memory_id = config.write_memory_id or ""
            memory = (
                await repo.get_memory(session, event.project_id, write_memory_id)
                if is_valid_id(write_memory_id, MEMORY_PREFIX) else None
            )
            saved_facts = done.facts if done is not None else None
            try:
                targets = await self._targets(session, event, extraction)
            except ResolutionError as exc:
                if saved_facts is None:
                    return await self._finish(event, ExtractionResult("skipped", str(exc), ExtractionSummary()))
                # The model answered, and some of its facts may be written already: the rest are written too, without
                # a model to merge with (its provider or route was removed since).
                targets = []
        if memory is None:
            reason = "write_memory_id names no memory of this project"
            return await self._finish(event, ExtractionResult("skipped", reason, ExtractionSummary()))

        if done is not None and saved_facts is not None:
            # Asked before, and its facts perhaps partly written: those facts again, never a second answer.
            facts, model = list(saved_facts), done.model
        else:
            try:
                asked, candidates = await self._complete(event, targets, build_prompt(event, extraction))
            except PromptTooLong as exc:  # asked again, it would fail again, every delivery, and cost each time
                reason = f"{metrics.PROMPT_TOO_LONG}: {exc}"
                return await self._finish(event, ExtractionResult("skipped", reason, ExtractionSummary()))
            async with self._sessions.begin() as session:
                # Another extraction of this turn may have saved its answer first: that one is written; or finished
                # the turn meanwhile: nothing is.
                saved = await registry.save_extracted_facts(
                    session, event.project_id, event.generation_id, candidates, asked.model
                )
            if saved.status in registry.EXTRACTED:
                return await self._replayed(event)
            facts, model = saved.facts, saved.model
        # The target of the model that answered (its merges use it too); the first when none is known.
        target = next((t for t in targets if t.model == model), targets[0] if targets else None)
        summary = await self._write(event, memory.id, facts, target, turn_time)
        return await self._finish(event, ExtractionResult("completed", None, summary, target.model if target else model))

    async def _replayed(self, event: GenerationCompleted) -> ExtractionResult:
        async with self._sessions() as session:
            done = await registry.get_extraction(session, event.project_id, event.generation_id)
        assert done is not None
        return _replay_of(done)

    async def _targets(
        self, session: AsyncSession, event: GenerationCompleted, extraction: ExtractionConfig
    ) -> list[Target]:
        providers, routes, default_route = await registry.load_model_registry(session, event.project_id)
        return resolve_targets(
            extraction,
            event.agent,
            providers=providers,
            routes=routes,
            default_route_id=default_route,
            service_model=self._service_model,
            nameable_providers=self._nameable_providers,
        )

    async def _complete(
        self, event: GenerationCompleted, targets: list[Target], prompt: list[dict[str, str]]
    ) -> tuple[Target, list[str]]:
        """The facts of the first target that answers readably, in turn (failover: an answer cut off or malformed
        counts as a failure of its target); a rate limit is retried on the same target after a pause (the
        service keeps telling JetStream the message is in progress meanwhile). Raises the last failure, or
        PromptTooLong when the prompt fit no target (no delivery will change that)."""
        failures: list[LlmError] = []
        for target in targets:
            agent = target.context(event.agent.id)
            for attempt in range(self._rate_limit_retries + 1):
                try:
                    completion = await complete(prompt, agent=agent, timeout=self._llm_timeout, purpose=Purpose.EXTRACTION)
                except RateLimited as exc:
                    failures.append(exc)
                    if attempt < self._rate_limit_retries:  # the last one fails over at once
                        await _pause_after_rate_limit(attempt)
                    continue
                except LlmError as exc:
                    failures.append(exc)
                    break
                spent = registry.Spent(target.ai_provider_id, Purpose.EXTRACTION, completion)
                await registry.record_usage(self._sessions, event.project_id, [spent])
                try:
                    return target, parse_candidates(completion.text)
                except UnreadableAnswer as exc:
                    failures.append(exc)
                    break
        retryable = [failure for failure in failures if not isinstance(failure, PromptTooLong)]
        raise (retryable or failures or [LlmError("no target to try")])[-1]

    async def _write(
        self, event: GenerationCompleted, memory_id: str, facts: list[str], target: Target | None, turn_time: datetime
    ) -> ExtractionSummary:
        writes = [
            MemoryWriteRequested(
                event_id=candidate_write_id(event.project_id, event.generation_id, index, fact),
                project_id=event.project_id,
                memory_id=memory_id,
                content=fact,
                source_type=SourceType.EXTRACTION,
                agent=target.context(event.agent.id) if target else None,
                source_generation_id=event.generation_id,
                source_conversation_id=event.conversation_id,
                sources_seen_at=turn_time,
            )
            for index, fact in enumerate(facts)
        ]
        # One memory, so the writer decides them one at a time anyway; submitting together saves round trips, and
        # they are published in the model's order (a later fact may correct an earlier one).
        # A fact the writer failed for good (set aside for an operator) is counted failed, not submitted again:
        # resubmitted, it would be failed again and again while the turn waited for it.
        try:
            async with asyncio.TaskGroup() as group:  # one failing stops the others: none is left publishing alone
                submitted = [
                    group.create_task(self._gateway.submit(w, timeout=self._write_timeout, retry_failed=REFUSED_FOR_NOW,
                                                           order=place))
                    for w, place in zip(writes, PublishOrder.chain(len(writes)), strict=True)
                ]
        except ExceptionGroup as failed:
            raise PublishOrder.cause(failed) from None
        outcomes = [task.result() for task in submitted]
        # Extracted again, the turn finds the decided writes by their ids, waits for the queued ones and submits
        # the refused ones again; counted as failed, a fact refused while the embedder was down would be lost.
        if refused := sum(1 for outcome in outcomes if outcome is not None and _refused_for_now(outcome)):
            raise WritesRefused(f"{refused} of {len(writes)} writes refused while a dependency was down")
        if queued := [write.write_id for write, outcome in zip(writes, outcomes, strict=True) if outcome is None]:
            raise WritesPending(f"{len(queued)} of {len(writes)} writes not decided in time", queued)
        counts = {"created": 0, "updated": 0, "skipped": 0, "failed": 0}
        for outcome in outcomes:
            assert outcome is not None
            if outcome.error is not None or outcome.action is None:
                counts["failed"] += 1
            elif outcome.action in (WriteAction.CREATED, WriteAction.SUPERSEDED):
                counts["created"] += 1
            else:
                counts[outcome.action.value] += 1
        return ExtractionSummary(candidates=len(facts), **counts)

    async def decided(self, write_ids: list[str]) -> bool:
        """Whether the writer has decided each of these writes (applied, or failed): read, not claimed."""
        async with self._sessions() as session:
            records = await write_records.get_write_outcomes(session, write_ids)
        return all(record.status != "pending" for record in records.values())

    async def record_failure(self, event: GenerationCompleted, reason: str) -> ExtractionResult:
        """The last delivery failed too: the outcome says so before the event is dead-lettered."""
        return await self._finish(event, ExtractionResult("failed", reason, ExtractionSummary()))

    async def _finish(self, event: GenerationCompleted, result: ExtractionResult) -> ExtractionResult:
        """`result` stored; or, when another delivery extracted the turn for good meanwhile, that one's outcome
        (`replayed`): this one is neither counted nor announced as the turn's."""
        async with self._sessions.begin() as session:
            stored = await registry.save_extraction(session, event.project_id, event.generation_id, result)
        return result if stored else await self._replayed(event)


async def _pause_after_rate_limit(attempt: int) -> None:
    await asyncio.sleep(min(0.5 * 2**attempt, 8.0))


def _replay_of(done: GenerationExtraction) -> ExtractionResult:
    summary = ExtractionSummary.model_validate(done, from_attributes=True)
    return ExtractionResult(done.status, done.reason, summary, done.model, replayed=True)


class WritesPending(Exception):
    """Some candidate writes were not decided in time (`write_ids`); the event is retried."""

    def __init__(self, message: str, write_ids: list[str]) -> None:
        super().__init__(message)
        self.write_ids = write_ids


class WritesRefused(Exception):
    """Some candidate writes were refused for now (503: the embedder down), an outage: the turn waits, then writes
    them again."""


def _refused_for_now(outcome: MemoryWriteOutcome) -> bool:
    """The writer could not decide the write because a dependency (the embedder) was down: retrying may succeed."""
    return outcome.error is not None and outcome.error.code in REFUSED_FOR_NOW
