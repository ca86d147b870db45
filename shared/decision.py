"""The write decision: one function over an incoming write and its candidates, no I/O.

The caller (shared.writes) gathers the exact-hash match and the nearest valid entry inside the memory's
lock, calls `decide`, and applies the result. The only step that may leave the process is the injected
`consolidate` callable (an LLM merge on agent paths); whatever it does wrong falls back to `created`,
so no write can lose a fact.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from shared.events import WriteAction
from shared.guard import meaning_change

MERGE_FLOOR = 0.75
"""Agent writes scoring in [MERGE_FLOOR, duplicate_threshold) are consolidated with the nearest entry."""

MERGED_CONTENT_MAX_CHARS = 2_000
"""A merge longer than this is a paragraph, not an atomic fact: create instead."""


class WritePolicy(StrEnum):
    SEED = "seed"  # the product document's rule: skip at or above duplicate_threshold
    GUARDED = "guarded"  # skip a near-copy only when no cheap rule says the meaning changed


class Rule(StrEnum):
    EXACT_COPY = "exact_copy"
    NEAR_DUPLICATE = "near_duplicate"
    NO_CANDIDATE = "no_candidate"
    BELOW_THRESHOLD = "below_threshold"
    MERGED = "merged"
    MERGE_FAILED = "merge_failed"
    GUARD = "guard"


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


async def decide(
    incoming: IncomingWrite,
    *,
    exact_match: Candidate | None,
    nearest: Candidate | None,
    consolidate: Consolidate | None = None,
) -> Decision:
    """Skip, merge or create. `consolidate` is given only on agent paths; any failure of it creates."""
    if exact_match is not None:
        return Decision(WriteAction.SKIPPED, Rule.EXACT_COPY, exact_match)
    if nearest is None:
        return Decision(WriteAction.CREATED, Rule.NO_CANDIDATE)

    if nearest.score >= incoming.duplicate_threshold:
        if incoming.policy is WritePolicy.SEED:
            return Decision(WriteAction.SKIPPED, Rule.NEAR_DUPLICATE, nearest)
        changed = meaning_change(nearest.content, incoming.content)
        if changed is None:
            return Decision(WriteAction.SKIPPED, Rule.NEAR_DUPLICATE, nearest)
        return Decision(WriteAction.CREATED, f"{Rule.GUARD}:{changed}", nearest)

    if consolidate is None or nearest.score < MERGE_FLOOR:
        return Decision(WriteAction.CREATED, Rule.BELOW_THRESHOLD, nearest)

    try:
        merged = await consolidate(nearest.content, incoming.content)
    except Exception:  # noqa: BLE001 - the seed: a failed completion creates instead
        merged = None
    merged = (merged or "").strip()
    if not merged or len(merged) > MERGED_CONTENT_MAX_CHARS:
        return Decision(WriteAction.CREATED, Rule.MERGE_FAILED, nearest)
    return Decision(WriteAction.UPDATED, Rule.MERGED, nearest, merged_content=merged)
