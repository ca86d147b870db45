"""The write decision, branch by branch, with no servers."""

from __future__ import annotations

import pytest

from shared.decision import (
    ARBITRATION_FLOOR,
    MERGE_FLOOR,
    REWRITE_FLOOR,
    Arbitration,
    Candidate,
    IncomingWrite,
    Operation,
    Rule,
    WritePolicy,
    decide,
)
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
        nearest=[nearest] if nearest else [],
        consolidate=consolidate,
    )
    assert decision.action is action
    assert decision.rule == rule


async def test_merge_carries_the_merged_text_and_the_target() -> None:
    decision = await decide(
        IncomingWrite(content="Customer also accepts SMS", duplicate_threshold=0.95),
        exact_match=None,
        nearest=[near(0.8)],
        consolidate=merged,
    )
    assert decision.merged_content == f"{EXISTING}; Customer also accepts SMS"
    assert decision.target == near(0.8)
    assert decision.score == 0.8


# Arbitration ------------------------------------------------------------------------------------

OTHER = Candidate(entry_id="mem_entry_BBBBBBBBBBBBBBBB", content="Customer lives in Lisbon", score=0.62)


def verdict(operation: Operation, target: Candidate | None = None, content: str | None = None):
    async def arbitrate(_incoming: str, shortlist: list[Candidate]) -> Arbitration | None:
        arbitrate.shortlists.append(shortlist)  # type: ignore[attr-defined]
        return Arbitration(operation, target, content)

    arbitrate.shortlists = []  # type: ignore[attr-defined]
    return arbitrate


async def arbitrate_fails(_incoming: str, _shortlist: list[Candidate]) -> Arbitration | None:
    raise RuntimeError("provider down")


async def arbitrate_unusable(_incoming: str, _shortlist: list[Candidate]) -> Arbitration | None:
    return None


REVERSED = "Customer prefers phone calls over email"


async def arbitrated(arbitrate, nearest: list[Candidate], consolidate=None, exact=None):
    return await decide(
        IncomingWrite(content=REVERSED, duplicate_threshold=0.95, policy=WritePolicy.ARBITRATE),
        exact_match=exact,
        nearest=nearest,
        consolidate=consolidate,
        arbitrate=arbitrate,
    )


@pytest.mark.parametrize(
    ("operation", "content", "action", "merged"),
    [
        (Operation.SUPERSEDE, None, WriteAction.SUPERSEDED, None),
        (Operation.SKIP, None, WriteAction.SKIPPED, None),
        (Operation.UPDATE, "Customer prefers phone calls, then email", WriteAction.UPDATED,
         "Customer prefers phone calls, then email"),
    ],
)
async def test_arbitration_operations_on_a_target(operation, content, action, merged) -> None:
    target = near(0.99, REVERSED + ".") if operation is Operation.SKIP else near(0.99)  # a skip: the same fact
    decision = await arbitrated(verdict(operation, target, content), [target, OTHER])
    assert decision.action is action and decision.target == target
    assert decision.merged_content == merged and decision.rule == f"arbitrated:{operation}"


async def test_a_verdict_to_skip_a_changed_near_duplicate_is_refused() -> None:
    # "Customer prefers phone calls over email" is no copy of "Customer prefers email over phone calls".
    decision = await arbitrated(verdict(Operation.SKIP, near(0.99)), [near(0.99), OTHER])
    assert decision.action is WriteAction.CREATED and decision.rule == "arbitration_failed:guard:order"
    # Contradictions score below the duplicate threshold too: refused there as well.
    below = await arbitrated(verdict(Operation.SKIP, near(0.9)), [near(0.9)])
    assert below.action is WriteAction.CREATED and below.rule.startswith("arbitration_failed:")


async def test_arbitration_add_creates() -> None:
    decision = await arbitrated(verdict(Operation.ADD), [near(0.99)])
    assert decision.action is WriteAction.CREATED and decision.rule == "arbitrated:add"


async def test_arbitration_sees_a_shortlist_of_five_above_the_floor() -> None:
    arbitrate = verdict(Operation.ADD)
    candidates = [near(0.99 - i * 0.05) for i in range(9)]  # 0.99 … 0.59
    await arbitrated(arbitrate, candidates)
    assert [c.score for c in arbitrate.shortlists[0]] == [c.score for c in candidates[:5]]
    assert all(c.score >= ARBITRATION_FLOOR for c in arbitrate.shortlists[0])


async def test_arbitration_is_not_asked_without_candidates_or_for_an_exact_copy() -> None:
    arbitrate = verdict(Operation.SKIP, near(0.5))
    assert (await arbitrated(arbitrate, [near(0.5)])).rule == Rule.NO_CANDIDATE
    assert (await arbitrated(arbitrate, [], exact=near(1.0))).rule == Rule.EXACT_COPY
    assert arbitrate.shortlists == []


@pytest.mark.parametrize(
    "arbitrate",
    [
        arbitrate_fails,
        arbitrate_unusable,
        verdict(Operation.SUPERSEDE, None),  # supersede without a target
        verdict(Operation.UPDATE, near(0.99), "  "),  # update without content
    ],
)
async def test_unusable_arbitration_falls_back_to_the_guarded_rule(arbitrate) -> None:
    # The reversed fact is a contradiction the guard sees: created, never skipped as a near-copy.
    decision = await arbitrated(arbitrate, [near(0.99)])
    assert decision.action is WriteAction.CREATED and decision.rule == "arbitration_failed:guard:order"
    # A true near-copy is still skipped, and below the threshold an agent's write still merges.
    same = await arbitrated(arbitrate, [near(0.99, REVERSED + "!")])
    assert same.action is WriteAction.SKIPPED and same.rule == f"arbitration_failed:{Rule.NEAR_DUPLICATE}"
    below = await arbitrated(arbitrate, [near(0.8)], consolidate=merged)
    assert below.action is WriteAction.UPDATED and below.rule == f"arbitration_failed:{Rule.MERGED}"


async def test_arbitration_without_a_model_is_the_guarded_rule_and_says_so() -> None:
    decision = await arbitrated(None, [near(0.99)])
    assert decision.action is WriteAction.CREATED and decision.rule == "arbitration_unavailable:guard:order"
    same = await arbitrated(None, [near(0.99, REVERSED + "!")])
    assert same.action is WriteAction.SKIPPED and same.rule == f"arbitration_unavailable:{Rule.NEAR_DUPLICATE}"


# A model's rewrite must still state the facts it rewrites ------------------------------------------


def scores(*values: float):
    async def relatedness(_text: str, facts: list[str]) -> list[float]:
        relatedness.asked.append(facts)  # type: ignore[attr-defined]
        return list(values)

    relatedness.asked = []  # type: ignore[attr-defined]
    return relatedness


async def unrelatable(_text: str, _facts: list[str]) -> list[float]:
    raise TimeoutError("embedder down")


def replying(text: str):
    async def consolidate(_existing: str, _incoming: str) -> str | None:
        return text

    return consolidate


async def merge_decision(consolidate, relatedness) -> object:
    return await decide(
        IncomingWrite(content="Customer also accepts SMS", duplicate_threshold=0.95),
        exact_match=None, nearest=[near(0.8)], consolidate=consolidate, relatedness=relatedness,
    )


@pytest.mark.parametrize(
    ("reply", "relatedness", "rule"),
    [
        ("Customer prefers email, also accepts SMS", scores(0.9, 0.88), Rule.MERGED),
        ("Customer prefers email, also accepts SMS", scores(REWRITE_FLOOR, REWRITE_FLOOR), Rule.MERGED),
        # A refusal or an apology replaces no fact, however well formed.
        ("I'm sorry, but I can't help with that.", scores(0.1, 0.08), Rule.MERGE_FAILED),
        # Close to one fact only: the other would be lost.
        ("Customer also accepts SMS", scores(0.4, 0.99), Rule.MERGE_FAILED),
        # Too short to state both facts, however it scores: a name, a word.
        ("Customer.", scores(0.9, 0.9), Rule.MERGE_FAILED),
        # A structure, not a sentence: never stored, whatever it scores.
        ("[]", scores(0.9, 0.9), Rule.MERGE_FAILED),
        ('{"merged": "Customer prefers email, also accepts SMS"}', scores(0.9, 0.9), Rule.MERGE_FAILED),
    ],
)
async def test_a_merge_must_still_state_both_facts(reply, relatedness, rule) -> None:
    decision = await merge_decision(replying(reply), relatedness)
    assert decision.rule == rule
    if rule == Rule.MERGED:
        assert decision.merged_content == reply and relatedness.asked == [[EXISTING, "Customer also accepts SMS"]]
    else:
        assert decision.action is WriteAction.CREATED and decision.merged_content is None


async def test_a_rewrite_that_copies_one_fact_must_not_lose_what_the_other_changes() -> None:
    berlin, munich = "User lives in Berlin with his wife and two kids", "User lives in Munich with his wife and two kids"
    detailed = EXISTING + ", especially in the morning"
    for existing, incoming, reply, rule in [
        (berlin, munich, berlin + ".", Rule.MERGE_FAILED),  # the move to Munich lost
        (berlin, munich, munich, Rule.MERGED),  # where they conflict, the new fact wins
        # Where they do not, a copy of the shorter fact drops the other's detail, and a short rewrite surely does.
        (EXISTING, detailed, EXISTING + ".", Rule.MERGE_FAILED),
        (EXISTING, detailed, detailed, Rule.MERGED),  # the longer new fact says all the stored one did
        (detailed, EXISTING, detailed, Rule.MERGED),  # the longer stored fact says all the new one does
        (EXISTING, detailed, "Customer prefers email", Rule.MERGE_FAILED),
        (EXISTING, detailed, "Customer prefers email over phone calls in the morning", Rule.MERGED),
        # Where they conflict the new fact wins, however short it is beside the old one.
        ("Bob works at Acme as a senior engineer in the Lisbon office since 2019", "Bob works at Globex",
         "Bob works at Globex.", Rule.MERGED),
    ]:
        decision = await decide(
            IncomingWrite(content=incoming, duplicate_threshold=0.95), exact_match=None,
            nearest=[near(0.9, existing)], consolidate=replying(reply), relatedness=scores(0.9, 0.9),
        )
        assert decision.rule == rule, (existing, incoming, reply)


async def test_an_embedder_failure_while_checking_a_rewrite_is_retried_not_a_failed_merge() -> None:
    # Not the model's failure: the write is retried (a merge_failed would store a near-copy for good).
    with pytest.raises(TimeoutError):
        await merge_decision(replying("Customer prefers email, also accepts SMS"), unrelatable)


@pytest.mark.parametrize(
    ("existing", "incoming", "rewrite"),
    [
        # Pairs at the bottom of the merge band, with their literal merges (measured with the default model).
        ("The user drives a Tesla", "The user drives a red Tesla Model 3 bought in 2021",
         "The user drives a red Tesla Model 3, bought in 2021"),
        ("The user is allergic to peanuts", "The user carries an EpiPen for a peanut allergy",
         "The user has a peanut allergy and carries an EpiPen"),
        ("The user is vegetarian", "The user is vegetarian but eats fish occasionally",
         "The user is vegetarian but occasionally eats fish"),
    ],
)
async def test_faithful_merges_pass_the_check_with_the_default_model(existing: str, incoming: str, rewrite: str) -> None:
    from shared.embeddings import LOCAL_MODEL, cosine, embed_texts

    async def relatedness(text: str, facts: list[str]) -> list[float]:
        first, *others = await embed_texts([text, *facts], model=LOCAL_MODEL)
        return [cosine(first, other) for other in others]

    for reply, rule in [(rewrite, Rule.MERGED), ("I'm sorry, but I can't help with that.", Rule.MERGE_FAILED)]:
        decision = await decide(
            IncomingWrite(content=incoming, duplicate_threshold=0.95), exact_match=None,
            nearest=[near(0.8, existing)], consolidate=replying(reply), relatedness=relatedness,
        )
        assert decision.rule == rule, (reply, await relatedness(reply, [existing, incoming]))


async def test_an_arbitrated_update_must_still_state_both_facts() -> None:
    update = verdict(Operation.UPDATE, near(0.99), "I cannot decide.")
    refused = await decide(
        IncomingWrite(content=REVERSED, duplicate_threshold=0.95, policy=WritePolicy.ARBITRATE),
        exact_match=None, nearest=[near(0.99)], arbitrate=update, relatedness=scores(0.1, 0.1),
    )
    assert refused.action is WriteAction.CREATED and refused.rule == "arbitration_failed:guard:order"
    rewrite = "The customer now prefers phone calls to email"
    kept = await decide(
        IncomingWrite(content=REVERSED, duplicate_threshold=0.95, policy=WritePolicy.ARBITRATE),
        exact_match=None, nearest=[near(0.99)], arbitrate=verdict(Operation.UPDATE, near(0.99), rewrite),
        relatedness=scores(REWRITE_FLOOR, 0.7),
    )
    assert kept.action is WriteAction.UPDATED and kept.merged_content == rewrite


async def test_a_model_step_that_raises_is_logged_with_its_trace(caplog: pytest.LogCaptureFixture) -> None:
    # The model steps report a model's failures themselves and answer None; an exception reaching the decision is
    # a bug in them, which turned every merge into `merge_failed` without a line saying why.
    incoming = IncomingWrite(content="x", duplicate_threshold=0.95, policy=WritePolicy.SEED)
    merge = await decide(incoming, exact_match=None, nearest=[near(0.8)], consolidate=failing)
    arbitration = await arbitrated(arbitrate_fails, [near(0.9)])
    assert merge.rule == Rule.MERGE_FAILED and arbitration.rule.startswith(Rule.ARBITRATION_FAILED)
    traced = [r for r in caplog.records if r.name == "memories.decision" and r.exc_info]
    assert [type(r.exc_info[1]) for r in traced if r.exc_info] == [TimeoutError, RuntimeError]
