"""Public identifiers: a prefix and 16 characters of [A-Za-z0-9] (docs/contract)."""

from __future__ import annotations

import hashlib
import re
import secrets
import string
import uuid

_ALPHABET = string.ascii_letters + string.digits
_BODY_LENGTH = 16

PROJECT_PREFIX = "proj_"
MEMORY_PREFIX = "mem_"
ENTRY_PREFIX = "mem_entry_"
WRITE_PREFIX = "wr_"
API_KEY_PREFIX = "key_"
EVENT_PREFIX = "evt_"  # an event on the bus that is not a write: a change, a turn, a result, a revocation
PROVIDER_PREFIX = "aip_"
ROUTE_PREFIX = "route_"


def new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(_BODY_LENGTH))


def _pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(re.escape(prefix) + r"[A-Za-z0-9]{16}")


_PATTERNS = {
    prefix: _pattern(prefix)
    for prefix in (PROJECT_PREFIX, MEMORY_PREFIX, ENTRY_PREFIX, API_KEY_PREFIX, PROVIDER_PREFIX, ROUTE_PREFIX)
}


def is_valid_id(value: str, prefix: str) -> bool:
    """True when value is an id of that kind; `mem_entry_…` is never a memory id."""
    return _PATTERNS[prefix].fullmatch(value) is not None


_WRITE_ID = re.compile(re.escape(WRITE_PREFIX) + r"[0-9a-f]{32}")


def new_write_id() -> str:
    return WRITE_PREFIX + uuid.uuid4().hex


IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
"""What an Idempotency-Key may be: 1 to 255 visible ASCII characters (a header value, stored with the write)."""


def keyed_write_id(project_id: str, idempotency_key: str) -> str:
    """The same client key in the same project always names the same write; other projects cannot collide."""
    digest = hashlib.sha256(f"{project_id}\x00{idempotency_key}".encode()).hexdigest()
    return WRITE_PREFIX + digest[:32]


def is_valid_write_id(value: str) -> bool:
    return _WRITE_ID.fullmatch(value) is not None
