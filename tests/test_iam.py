"""IAM action patterns, table-driven, without servers."""

from __future__ import annotations

import fnmatch
import hashlib
import random

import pytest

from services.api.deps import Principal, require
from shared import iam

CONTRACT_ACTIONS = {
    "memories:ListMemories",
    "memories:CreateMemory",
    "memories:GetMemory",
    "memories:UpdateMemory",
    "memories:DeleteMemory",
    "memories:ListMemoryEntries",
    "memories:CreateMemoryEntry",
    "memories:GetMemoryEntry",
    "memories:UpdateMemoryEntry",
    "memories:DeleteMemoryEntry",
    "knowledge:SearchKnowledge",
}


def test_the_actions_are_the_contracts() -> None:
    assert iam.ACTIONS == CONTRACT_ACTIONS


@pytest.mark.parametrize(
    ("pattern", "action", "expected"),
    [
        ("memories:GetMemory", "memories:GetMemory", True),
        ("memories:GetMemory", "memories:GetMemoryEntry", False),  # an exact action is not a prefix
        ("memories:getmemory", "memories:GetMemory", False),  # case-sensitive
        ("memories:*", "memories:DeleteMemoryEntry", True),
        ("memories:*", "knowledge:SearchKnowledge", False),
        ("knowledge:*", "knowledge:SearchKnowledge", True),
        ("*", "knowledge:SearchKnowledge", True),
        ("*", "memories:ListMemories", True),
        ("memories:Get*", "memories:GetMemoryEntry", True),
        ("memories:Get*", "memories:ListMemories", False),
        ("memories:*Entry", "memories:UpdateMemoryEntry", True),
        ("memories:*Entry", "memories:UpdateMemory", False),
        ("*:SearchKnowledge", "knowledge:SearchKnowledge", True),
        ("memories.*", "memories:GetMemory", False),  # `.` is literal, not a regex wildcard
        ("memories:?etMemory", "memories:GetMemory", False),  # `?` is not a wildcard here
        ("", "memories:GetMemory", False),
    ],
)
def test_matches(pattern: str, action: str, expected: bool) -> None:
    assert iam.matches(pattern, action) is expected


@pytest.mark.parametrize(
    ("pattern", "valid"),
    [
        ("memories:CreateMemory", True),
        ("knowledge:SearchKnowledge", True),
        ("memories:*", True),
        ("knowledge:*", True),
        ("*", True),
        ("memories:Get*", True),
        ("memories:CreateMemory ", False),
        ("memories:Nope", False),
        ("memories:Nope*", False),  # a pattern that can match nothing is a typo
        ("billing:*", False),
        ("memories", False),
        ("", False),
        ("memories:.*", False),
        ("memories:[A-Z]*", False),
        ("*" * 129, False),
    ],
)
def test_is_valid_pattern(pattern: str, valid: bool) -> None:
    assert iam.is_valid_pattern(pattern) is valid


@pytest.mark.parametrize(
    ("patterns", "action", "expected"),
    [
        ([], "memories:GetMemory", False),
        (["memories:GetMemory", "memories:ListMemories"], "memories:ListMemories", True),
        (["knowledge:*"], "memories:ListMemories", False),
        (["knowledge:*", "memories:List*"], "memories:ListMemoryEntries", True),
    ],
)
def test_allows_any_pattern(patterns: list[str], action: str, expected: bool) -> None:
    assert iam.allows(patterns, action) is expected


def test_the_secret_is_kept_as_its_sha256_and_a_short_prefix() -> None:
    secret = "sk_" + "A1b2C3d4" + "x" * 32
    assert iam.secret_hash(secret) == hashlib.sha256(secret.encode()).hexdigest()
    assert iam.secret_hash(secret) != iam.secret_hash(secret[:-1] + "y")
    assert iam.display_prefix(secret) == "sk_A1b2C3d4"


@pytest.mark.parametrize(
    ("principal", "action", "can"),
    [
        (Principal(is_admin=True), "knowledge:SearchKnowledge", True),
        (
            Principal(is_admin=False, project_id="p", actions=frozenset({"memories:*"})),
            "memories:GetMemory",
            True,
        ),
        (
            Principal(is_admin=False, project_id="p", actions=frozenset({"memories:*"})),
            "knowledge:SearchKnowledge",
            False,
        ),
        (Principal(is_admin=False, project_id="p"), "memories:GetMemory", False),
    ],
)
def test_principal_can(principal: Principal, action: str, can: bool) -> None:
    assert principal.can(action) is can


@pytest.mark.parametrize("actions", [(), ("memories:GetMemorie",), ("memories:GetMemory", "memories:*")])
def test_require_refuses_anything_but_known_actions(actions: tuple[str, ...]) -> None:
    # Routes name exact actions; a typo must stop the app from starting, not silently deny everyone.
    with pytest.raises(ValueError):
        require(*actions)


def test_matching_agrees_with_shell_globs_of_stars() -> None:
    # `*` is the only wildcard, so on patterns without `?` or `[` the matcher must agree with fnmatch's.
    rng = random.Random(7)
    for _ in range(3_000):
        pattern = "".join(rng.choice("ab:*") for _ in range(rng.randint(0, 8)))
        action = "".join(rng.choice("ab:") for _ in range(rng.randint(0, 10)))
        assert iam.matches(pattern, action) is fnmatch.fnmatchcase(action, pattern), (pattern, action)


def test_a_pattern_of_many_stars_is_decided_at_once() -> None:
    # As a regular expression of `.*`s, 10 stars that match nothing took 5 s (12 took 161 s), on the API's event
    # loop: every request of the process waited. Under the old matcher this test would not finish.
    assert not iam.is_valid_pattern("*" * 40 + ":*x")
    assert iam.allows(["*" * 40 + "Memory"], "memories:GetMemory")
