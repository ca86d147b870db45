"""The write decision: one function over an incoming write and its candidates, no I/O.

The caller (shared.writes) gathers the exact-hash match and the nearest valid entry inside the memory's
lock, calls `decide`, and applies the result. The steps that may leave the process are injected callables: a
merge by a model (`consolidate`, agent paths), arbitration by a model (`arbitrate`, arbitrated memories) and the
check of a model's rewrite against the facts it rewrites (`relatedness`, an embedding). Whatever a model does
wrong falls back to a rule that keeps the fact (`created`, or the guard's verdict), so no write can lose one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from enum import StrEnum

from shared.events import WriteAction, WritePolicy
from shared.guard import meaning_change, normalize_content

log = logging.getLogger("memories.decision")

MERGE_FLOOR = 0.75
"""Agent writes scoring in [MERGE_FLOOR, duplicate_threshold) are consolidated with the nearest entry."""

MERGED_CONTENT_MAX_CHARS = 2_000
"""A merge longer than this is a paragraph, not an atomic fact: create instead."""

REWRITE_FLOOR = 0.50
"""A model's rewrite of two facts must score at least this against each. Measured with the default embedder:
refusals, `[]`, `null`, "OK" score −0.04–0.25 against the facts; faithful merges 0.73–0.99, also for pairs at the
bottom of the merge band (a pair at 0.759 whose literal merge scores 0.744 against the older fact)."""

REWRITE_MIN_SHARE = 0.5
"""A rewrite of two facts states both, so it reaches half the longer one: "Alice." for "Alice prefers email over
phone calls." and "Alice prefers email, especially in the morning." still scores 0.53 and 0.55 against them, above
REWRITE_FLOOR. Where the facts conflict the new one wins and may be short ("Bob works at Globex." for a long
sentence about his former employer): then half the shorter fact."""

ARBITRATION_FLOOR = 0.60
ARBITRATION_SHORTLIST = 5
"""Arbitration shows the model at most this many valid entries scoring at least the floor."""


class Rule(StrEnum):
    EXACT_COPY = "exact_copy"
    NEAR_DUPLICATE = "near_duplicate"
    NO_CANDIDATE = "no_candidate"
    BELOW_THRESHOLD = "below_threshold"
    MERGED = "merged"
    MERGE_FAILED = "merge_failed"
    GUARD = "guard"
    ARBITRATED = "arbitrated"
    ARBITRATION_FAILED = "arbitration_failed"
    ARBITRATION_UNAVAILABLE = "arbitration_unavailable"


class Operation(StrEnum):
    ADD = "add"
    UPDATE = "update"
    SUPERSEDE = "supersede"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Arbitration:
    """A model's verdict on a write; `target` is always one of the shortlisted candidates."""

    operation: Operation
    target: Candidate | None = None
    content: str | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    entry_id: str
    content: str
    score: float


@dataclass(frozen=True, slots=True)
class IncomingWrite:
    content: str
    duplicate_threshold: float
    policy: WritePolicy = WritePolicy.SEED


@dataclass(frozen=True, slots=True)
class Decision:
    action: WriteAction
    rule: str
    target: Candidate | None = None
    merged_content: str | None = None

    @property
    def score(self) -> float | None:
        return self.target.score if self.target else None


Consolidate = Callable[[str, str], Awaitable[str | None]]
"""(existing fact, incoming fact) -> one merged fact, or None when the model gave nothing usable."""

Relatedness = Callable[[str, list[str]], Awaitable[list[float]]]
"""(a text, facts) -> its cosine similarity to each fact: how a model's rewrite is checked to still state them."""

Arbitrate = Callable[[str, list[Candidate]], Awaitable[Arbitration | None]]
"""(incoming fact, shortlist) -> a verdict, or None when the model gave nothing usable."""


async def decide(
    incoming: IncomingWrite,
    *,
    exact_match: Candidate | None,
    nearest: list[Candidate],
    consolidate: Consolidate | None = None,
    arbitrate: Arbitrate | None = None,
    relatedness: Relatedness | None = None,
) -> Decision:
    """Skip, merge, supersede or create.

    `nearest` is sorted by descending score. `consolidate` is given only on agent paths; `arbitrate` only
    when the policy is ARBITRATE and a model is available. A failed merge falls back to the seed's rule; an
    arbitration that fails, or that no model can make, to the guarded rule (never skip a changed fact), and so does
    a verdict to skip a near-duplicate the guard sees changed, so an arbitrated memory never guards less than a
    guarded one.

    A model's rewrite replaces a stored fact, so it must still state both facts it rewrites: with `relatedness`,
    it must score at least REWRITE_FLOOR against each of them (a refusal, an apology or a stray `[]` scores near
    0). A rewrite that does not is a failed one. `relatedness` failing (the embedder is down) is not the model's
    failure: it propagates, and the write is retried.
    """
    if exact_match is not None:
        return Decision(WriteAction.SKIPPED, Rule.EXACT_COPY, exact_match)
    if incoming.policy is WritePolicy.ARBITRATE and arbitrate is None:
        return await _guarded_instead(Rule.ARBITRATION_UNAVAILABLE, incoming, nearest, consolidate, relatedness)
    if incoming.policy is WritePolicy.ARBITRATE and arbitrate is not None:
        shortlist = [c for c in nearest if c.score >= ARBITRATION_FLOOR][:ARBITRATION_SHORTLIST]
        if not shortlist:
            return Decision(WriteAction.CREATED, Rule.NO_CANDIDATE)
        try:
            verdict = await arbitrate(incoming.content, shortlist)
        except Exception:  # a failed call falls back to the guarded rule
            # The model steps report a model's own failures themselves: what reaches here is unexpected (a bug).
            log.warning("arbitration failed; the guarded rule decides instead", exc_info=True)
            verdict = None
        decision = await _apply_verdict(incoming, verdict, relatedness)
        if decision is not None:
            return decision
        return await _guarded_instead(Rule.ARBITRATION_FAILED, incoming, nearest, consolidate, relatedness)
    return await _seed_rule(incoming, nearest[0] if nearest else None, consolidate, relatedness)


async def _guarded_instead(
    why: Rule,
    incoming: IncomingWrite,
    nearest: list[Candidate],
    consolidate: Consolidate | None,
    relatedness: Relatedness | None,
) -> Decision:
    guarded = replace(incoming, policy=WritePolicy.GUARDED)
    fallback = await _seed_rule(guarded, nearest[0] if nearest else None, consolidate, relatedness)
    return replace(fallback, rule=f"{why}:{fallback.rule}")


async def _usable_rewrite(
    text: str | None, existing: str, incoming: str, relatedness: Relatedness | None
) -> str | None:
    """A model's rewrite of the stored and the new fact as one fact, or None: blank, a paragraph, a JSON structure
    instead of a sentence, one that loses a fact, or not about those facts."""
    rewrite = (text or "").strip()
    if not rewrite or len(rewrite) > MERGED_CONTENT_MAX_CHARS or rewrite[0] in "[{":
        return None
    if _drops_a_fact(rewrite, existing, incoming):
        return None
    if relatedness is None:
        return rewrite
    scores = await relatedness(rewrite, [existing, incoming])
    return rewrite if len(scores) == 2 and min(scores) >= REWRITE_FLOOR else None


def _drops_a_fact(rewrite: str, existing: str, incoming: str) -> bool:
    """Whether the rewrite loses a fact. Where the facts conflict (the guard sees a changed value, a negation or
    an order), the new fact wins and may be short: the rewrite must reach half the shorter fact and must not copy
    the stored one back. Otherwise it states both: it reaches half the longer fact, and if it copies one, that is
    the longer (the one that may say all the other does; a copy of the shorter drops the other's detail)."""
    text, stored, new = normalize_content(rewrite), normalize_content(existing), normalize_content(incoming)
    if meaning_change(existing, incoming) is not None:
        return len(text) < REWRITE_MIN_SHARE * min(len(stored), len(new)) or text == stored
    longest = max(len(stored), len(new))
    return len(text) < REWRITE_MIN_SHARE * longest or (text in (stored, new) and len(text) < longest)


async def _apply_verdict(
    incoming: IncomingWrite, verdict: Arbitration | None, relatedness: Relatedness | None
) -> Decision | None:
    """The model's verdict as a decision, or None when it is unusable (then the guarded rule decides)."""
    if verdict is None:
        return None
    rule = f"{Rule.ARBITRATED}:{verdict.operation}"
    if verdict.operation is Operation.ADD:
        return Decision(WriteAction.CREATED, rule)
    if verdict.target is None:
        return None
    if verdict.operation is Operation.SKIP:
        if meaning_change(verdict.target.content, incoming.content) is not None:
            # Skipping a changed fact loses it: the guarded rule decides. Contradictions score below the duplicate
            # threshold too (0.85-0.95), so this holds at any score; a richer stored fact the cheap rules read as
            # changed is stored again rather than lost.
            return None
        return Decision(WriteAction.SKIPPED, rule, verdict.target)
    if verdict.operation is Operation.SUPERSEDE:
        return Decision(WriteAction.SUPERSEDED, rule, verdict.target)
    merged = await _usable_rewrite(verdict.content, verdict.target.content, incoming.content, relatedness)
    if merged is None:
        return None
    return Decision(WriteAction.UPDATED, rule, verdict.target, merged_content=merged)


async def _seed_rule(
    incoming: IncomingWrite,
    nearest: Candidate | None,
    consolidate: Consolidate | None,
    relatedness: Relatedness | None,
) -> Decision:
    if nearest is None:
        return Decision(WriteAction.CREATED, Rule.NO_CANDIDATE)

    if nearest.score >= incoming.duplicate_threshold:
        if incoming.policy is not WritePolicy.GUARDED:
            return Decision(WriteAction.SKIPPED, Rule.NEAR_DUPLICATE, nearest)
        changed = meaning_change(nearest.content, incoming.content)
        if changed is None:
            return Decision(WriteAction.SKIPPED, Rule.NEAR_DUPLICATE, nearest)
        return Decision(WriteAction.CREATED, f"{Rule.GUARD}:{changed}", nearest)

    if consolidate is None or nearest.score < MERGE_FLOOR:
        return Decision(WriteAction.CREATED, Rule.BELOW_THRESHOLD, nearest)

    try:
        merged = await consolidate(nearest.content, incoming.content)
    except Exception:  # the seed: a failed completion creates instead
        log.warning("the merge failed; the write is created instead", exc_info=True)
        merged = None
    merged = await _usable_rewrite(merged, nearest.content, incoming.content, relatedness)
    if merged is None:
        return Decision(WriteAction.CREATED, Rule.MERGE_FAILED, nearest)
    return Decision(WriteAction.UPDATED, Rule.MERGED, nearest, merged_content=merged)
