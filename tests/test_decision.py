"""The write decision, branch by branch, with no servers."""

from __future__ import annotations

import pytest

from shared.decision import MERGE_FLOOR, Candidate, IncomingWrite, Rule, WritePolicy, decide
from shared.events import WriteAction

EXISTING = "Customer prefers email over phone calls"


def near(score: float, content: str = EXISTING) -> Candidate:
    return Candidate(entry_id="mem_entry_AAAAAAAAAAAAAAAA", content=content, score=score)


async def merged(existing: str, incoming: str) -> str | None:
    return f"{existing}; {incoming}"


async def blank(_existing: str, _incoming: str) -> str | None:
    return "   "


async def failing(_existing: str, _incoming: str) -> str | None:
    raise TimeoutError("model timed out")


async def too_long(_existing: str, _incoming: str) -> str | None:
    return "x" * 5000


@pytest.mark.parametrize(
    ("content", "policy", "threshold", "exact", "nearest", "consolidate", "action", "rule"),
    [
        # An exact normalised copy is skipped before any similarity is looked at.
        ("x", WritePolicy.SEED, 0.95, near(1.0), None, None, WriteAction.SKIPPED, Rule.EXACT_COPY),
        ("x", WritePolicy.SEED, 0.95, None, None, None, WriteAction.CREATED, Rule.NO_CANDIDATE),
        ("x", WritePolicy.SEED, 0.95, None, near(0.95), None, WriteAction.SKIPPED, Rule.NEAR_DUPLICATE),
        ("x", WritePolicy.SEED, 0.95, None, near(0.9499), None, WriteAction.CREATED, Rule.BELOW_THRESHOLD),
        ("x", WritePolicy.SEED, 0.5, None, near(0.6), None, WriteAction.SKIPPED, Rule.NEAR_DUPLICATE),
        ("x", WritePolicy.SEED, 1.0, None, near(0.999), None, WriteAction.CREATED, Rule.BELOW_THRESHOLD),
        # Merge: agent paths only (a consolidate callable), between the floor and the threshold.
        ("x", WritePolicy.SEED, 0.95, None, near(0.8), merged, WriteAction.UPDATED, Rule.MERGED),
        ("x", WritePolicy.SEED, 0.95, None, near(MERGE_FLOOR), merged, WriteAction.UPDATED, Rule.MERGED),
        ("x", WritePolicy.SEED, 0.95, None, near(0.7499), merged, WriteAction.CREATED, Rule.BELOW_THRESHOLD),
        ("x", WritePolicy.SEED, 0.95, None, near(0.97), merged, WriteAction.SKIPPED, Rule.NEAR_DUPLICATE),
        ("x", WritePolicy.SEED, 0.95, None, near(0.8), blank, WriteAction.CREATED, Rule.MERGE_FAILED),
        ("x", WritePolicy.SEED, 0.95, None, near(0.8), failing, WriteAction.CREATED, Rule.MERGE_FAILED),
        ("x", WritePolicy.SEED, 0.95, None, near(0.8), too_long, WriteAction.CREATED, Rule.MERGE_FAILED),
        # Guarded: a near-copy that changes meaning is created, one that does not is skipped.
        (
            "Customer prefers phone calls over email",
            WritePolicy.GUARDED, 0.95, None, near(0.99), None, WriteAction.CREATED, "guard:order",
        ),
        (
            "Customer does not prefer email over phone calls",
            WritePolicy.GUARDED, 0.95, None, near(0.97), None, WriteAction.CREATED, "guard:negation",
        ),
        (
            "The customer prefers email over phone calls",
            WritePolicy.GUARDED, 0.95, None, near(0.99), None, WriteAction.SKIPPED, Rule.NEAR_DUPLICATE,
        ),
        # The seed policy keeps the product rule even for a contradiction.
        (
            "Customer prefers phone calls over email",
            WritePolicy.SEED, 0.95, None, near(0.99), None, WriteAction.SKIPPED, Rule.NEAR_DUPLICATE,
        ),
    ],
)
async def test_decide(content, policy, threshold, exact, nearest, consolidate, action, rule) -> None:
    decision = await decide(
        IncomingWrite(content=content, duplicate_threshold=threshold, policy=policy),
        exact_match=exact,
        nearest=nearest,
        consolidate=consolidate,
    )
    assert decision.action is action
    assert decision.rule == rule


async def test_merge_carries_the_merged_text_and_the_target() -> None:
    decision = await decide(
        IncomingWrite(content="Customer also accepts SMS", duplicate_threshold=0.95),
        exact_match=None,
        nearest=near(0.8),
        consolidate=merged,
    )
    assert decision.merged_content == f"{EXISTING}; Customer also accepts SMS"
    assert decision.target == near(0.8)
    assert decision.score == 0.8
