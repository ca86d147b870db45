"""Reading and replaying the DEAD_LETTERS stream (`memories dlq list|replay`).

A dead letter is the envelope `shared.bus.dead_letter` wrote (`shared.events.DeadLetter`): the original subject,
the reason and the body.
Replaying republishes the body to its original subject, into the stream that owns that subject, then deletes
the dead letter. Every consumer is idempotent by its event id, so replaying a message that was in fact
processed has no second effect.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from shared import bus
from shared.events import DeadLetter

REPLAY_MSG_ID_PREFIX = "dlq-replay"
"""Replays carry `dlq-replay.<dead letter seq>` as Nats-Msg-Id: new to the duplicate window, which still
dropped the original id, yet the same when one replay is retried after a crash before the delete."""

_GENERATION_ROOTS = ("generations.", "conversations.")  # the subjects of bus.GENERATIONS_STREAM


@dataclass(frozen=True, slots=True)
class StoredDeadLetter:
    sequence: int
    time: datetime | None
    origin: str
    origin_subject: str
    reason: str
    body: str

    def as_json(self) -> dict[str, Any]:
        values = asdict(self)
        values["time"] = self.time.isoformat() if self.time else None
        return values


@dataclass(frozen=True, slots=True)
class Replayed:
    sequence: int
    subject: str
    stream: str | None
    error: str | None = None  # None: republished and removed from DEAD_LETTERS

    @property
    def ok(self) -> bool:
        return self.error is None


def stream_of(subject: str) -> str | None:
    """The stream whose subjects include `subject`, or None for a subject no stream of ours takes."""
    if subject.startswith(f"{bus.WRITE_SUBJECT_ROOT}."):
        return bus.WRITES_STREAM
    if subject.startswith(_GENERATION_ROOTS):
        return bus.GENERATIONS_STREAM
    return None


def _filter(origin: str | None) -> str:
    return bus.dead_letter_subject(origin) if origin else f"{bus.DEAD_LETTER_ROOT}.>"


def _decode(sequence: int, subject: str, time: datetime | None, data: bytes | None) -> StoredDeadLetter:
    origin = subject.removeprefix(f"{bus.DEAD_LETTER_ROOT}.")
    try:
        letter = DeadLetter.model_validate_json(data or b"")
    except ValidationError:
        # Not written by bus.dead_letter: shown, never replayed.
        return StoredDeadLetter(sequence, time, origin, "", "unreadable dead-letter envelope",
                                (data or b"").decode("utf-8", "replace"))
    return StoredDeadLetter(sequence, time, origin, letter.origin_subject, letter.reason, letter.body)


async def get_dead_letter(js: JetStreamContext, sequence: int) -> StoredDeadLetter | None:
    try:
        raw = await js.get_msg(bus.DEAD_LETTER_STREAM, seq=sequence)
    except NotFoundError:
        return None
    return _decode(sequence, raw.subject or "", raw.time, raw.data)


async def list_dead_letters(
    js: JetStreamContext, *, origin: str | None = None, limit: int | None = None
) -> list[StoredDeadLetter]:
    """The oldest `limit` dead letters (all when None), optionally of one origin (`writer`, `extractor`)."""
    found: list[StoredDeadLetter] = []
    sequence = 1
    while limit is None or len(found) < limit:
        try:
            # "Next message at or after seq on this filter": deleted (replayed) sequences cost nothing.
            raw = await js.get_msg(bus.DEAD_LETTER_STREAM, seq=sequence, subject=_filter(origin), next=True)
        except NotFoundError:
            break
        assert raw.seq is not None
        found.append(_decode(raw.seq, raw.subject or "", raw.time, raw.data))
        sequence = raw.seq + 1
    return found


async def replay(js: JetStreamContext, sequences: list[int]) -> list[Replayed]:
    """Republish each dead letter to its original subject and delete it; one result per sequence."""
    results: list[Replayed] = []
    for sequence in sequences:
        letter = await get_dead_letter(js, sequence)
        if letter is None:
            results.append(Replayed(sequence, "", None, "no such dead letter"))
            continue
        results.append(await _replay_one(js, letter))
    return results


async def replay_all(js: JetStreamContext, *, origin: str | None = None) -> list[Replayed]:
    """Replay every dead letter present now (of one origin, or all). Those that fail again come back later,
    with new sequences, and are not replayed a second time by this call."""
    letters = await list_dead_letters(js, origin=origin)
    return [await _replay_one(js, letter) for letter in letters]


async def discard(js: JetStreamContext, sequences: list[int]) -> list[tuple[int, bool]]:
    """Delete dead letters not to be replayed (a client retried the write; an event no version will take): each
    sequence, and whether there was such a dead letter."""
    results = []
    for sequence in sequences:
        # Looked up first: deleting past the stream's last sequence is a server error ("stream store EOF").
        found = await get_dead_letter(js, sequence) is not None
        if found:
            await js.delete_msg(bus.DEAD_LETTER_STREAM, sequence)
        results.append((sequence, found))
    return results


async def _replay_one(js: JetStreamContext, letter: StoredDeadLetter) -> Replayed:
    stream = stream_of(letter.origin_subject)
    if stream is None:
        return Replayed(letter.sequence, letter.origin_subject, None, "no stream takes the original subject")
    subject = await _current_subject(js, letter.origin_subject)
    await js.publish(
        subject,
        letter.body.encode(),
        stream=stream,
        headers={"Nats-Msg-Id": f"{REPLAY_MSG_ID_PREFIX}.{letter.sequence}"},
    )
    # Deleted only after the stream acknowledged the publish: a crash in between replays twice, harmlessly.
    await js.delete_msg(bus.DEAD_LETTER_STREAM, letter.sequence)
    return Replayed(letter.sequence, subject, stream)


async def _current_subject(js: JetStreamContext, subject: str) -> str:
    """A write's subject for the partition count the bus is laid out for now: dead-lettered before the count
    changed, it would go back to a partition that no longer has a writer."""
    root, _, rest = subject.partition(f"{bus.WRITE_SUBJECT_ROOT}.")
    if root or "." not in rest:
        return subject  # not a write
    partitions = await bus.recorded_partitions(js)
    return bus.write_subject(rest.split(".", 1)[1], partitions) if partitions else subject
