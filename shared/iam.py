"""IAM actions of the API keys (docs/api.md, Callers) and the rules that match them. Pure.

A key holds a list of action patterns. A pattern is either a known action (`memories:GetMemory`) or a glob
whose only wildcard is `*` (`memories:*`, `memories:Get*`, `*`) that matches at least one known action; a
pattern that can match nothing is a typo, so key creation refuses it instead of storing a dead grant.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

ACTIONS: frozenset[str] = frozenset(
    {
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
)

SECRET_PREFIX = "sk_"
DISPLAY_PREFIX_CHARS = 8
"""Characters of the secret after `sk_` kept in clear so an operator can tell keys apart; ~48 of ~238 bits."""

_PATTERN_CHARS = re.compile(r"[A-Za-z:*]{1,128}")


def matches(pattern: str, action: str) -> bool:
    """Case-sensitive, as the action names are; `*` spans any characters, the `:` included.

    At most len(pattern) × len(action) steps: a regular expression of `.*`s backtracks exponentially in the stars
    (`**********:*x`, a 400 in the end, held the API's event loop for 15 s)."""
    if "*" not in pattern:
        return pattern == action
    p = a = 0
    star, resume = -1, 0  # the last `*` seen, and where in the action it would next stop spanning
    while a < len(action):
        if p < len(pattern) and pattern[p] == "*":
            star, resume = p, a
            p += 1
        elif p < len(pattern) and pattern[p] == action[a]:
            p += 1
            a += 1
        elif star >= 0:  # the last `*` spans one character more
            resume += 1
            p, a = star + 1, resume
        else:
            return False
    return pattern[p:].strip("*") == ""


def is_valid_pattern(pattern: str) -> bool:
    if pattern in ACTIONS:
        return True
    if "*" not in pattern or _PATTERN_CHARS.fullmatch(pattern) is None:
        return False
    return any(matches(pattern, action) for action in ACTIONS)


def allows(patterns: Iterable[str], action: str) -> bool:
    return any(matches(pattern, action) for pattern in patterns)


def secret_hash(secret: str) -> str:
    """What the database keeps instead of the secret. A plain SHA-256 suffices: the secrets are long and
    random, so a slow, salted hash would guard against nothing, and a lookup stays one index probe."""
    return hashlib.sha256(secret.encode()).hexdigest()


def display_prefix(secret: str) -> str:
    return secret[: len(SECRET_PREFIX) + DISPLAY_PREFIX_CHARS]
