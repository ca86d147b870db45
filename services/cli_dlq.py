"""Dead letters: `memories dlq list`, `memories dlq replay` and `memories dlq delete`."""

from __future__ import annotations

import argparse
import json
import sys

from services.cli_bus import with_jetstream

ORIGINS = ("writer", "extractor")
_REASON_WIDTH = 80

def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds this module's verbs to the `memories` parser."""
    dlq = subparsers.add_parser("dlq", help="inspect and replay dead letters (stream DEAD_LETTERS)")
    verbs = dlq.add_subparsers(dest="dlq_command", required=True)
    listing = verbs.add_parser("list", help="dead letters, oldest first")
    listing.add_argument("--origin", choices=ORIGINS, help="only those dead-lettered by this service")
    listing.add_argument("--limit", type=_count, default=100, help="at most this many (default 100; 0 = all)")
    listing.add_argument("--json", action="store_true", help="one JSON object per line, with the body")
    listing.set_defaults(func=cmd_dlq_list)
    replay = verbs.add_parser("replay", help="republish to the original subject, then delete the dead letter")
    replay.add_argument("sequences", nargs="*", type=_sequence, metavar="SEQ", help="sequences shown by `dlq list`")
    replay.add_argument("--all", action="store_true", help="every dead letter (of --origin, if given)")
    replay.add_argument("--origin", choices=ORIGINS, help="with --all: only this service's dead letters")
    replay.set_defaults(func=cmd_dlq_replay)
    delete = verbs.add_parser("delete", help="delete dead letters not to be replayed (their body is gone for good)")
    delete.add_argument("sequences", nargs="+", type=_sequence, metavar="SEQ", help="sequences shown by `dlq list`")
    delete.set_defaults(func=cmd_dlq_delete)


def _count(text: str) -> int:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _sequence(text: str) -> int:
    value = _number(text)
    if value < 1:  # a stream's sequences start at 1; NATS would answer 0 or less with a raw error
        raise argparse.ArgumentTypeError(f"a sequence is 1 or more, not {value}")
    return value


def cmd_dlq_list(args: argparse.Namespace) -> int:
    from shared import dead_letters  # nats-py with it: see services.cli_bus

    letters = with_jetstream(
        lambda js: dead_letters.list_dead_letters(js, origin=args.origin, limit=args.limit or None)
    )
    if letters is None:
        return 2
    if args.json:
        for letter in letters:
            print(json.dumps(letter.as_json()))
        return 0
    if not letters:
        print("no dead letters")
        return 0
    print(f"{'SEQ':>6}  {'TIME (UTC)':19}  {'ORIGIN':9}  {'SUBJECT':40}  REASON")
    for letter in letters:
        when = letter.time.strftime("%Y-%m-%d %H:%M:%S") if letter.time else "-"
        reason = " ".join(letter.reason.split())
        reason = reason if len(reason) <= _REASON_WIDTH else reason[: _REASON_WIDTH - 1] + "…"
        print(f"{letter.sequence:>6}  {when:19}  {letter.origin:9}  {letter.origin_subject:40}  {reason}")
    return 0


def cmd_dlq_replay(args: argparse.Namespace) -> int:
    from shared import dead_letters  # nats-py with it: see services.cli_bus

    if args.all == bool(args.sequences):
        print("give either sequences or --all", file=sys.stderr)
        return 2
    if args.origin and not args.all:
        print("--origin goes with --all", file=sys.stderr)
        return 2
    results = with_jetstream(
        lambda js: dead_letters.replay_all(js, origin=args.origin)
        if args.all
        else dead_letters.replay(js, list(args.sequences))
    )
    if results is None:
        return 2
    for result in results:
        if result.ok:
            print(f"replayed {result.sequence} -> {result.subject} ({result.stream})")
        else:
            print(f"not replayed {result.sequence}: {result.error}", file=sys.stderr)
    print(f"{sum(r.ok for r in results)} replayed, {sum(not r.ok for r in results)} not replayed")
    return 0 if all(r.ok for r in results) else 1


def cmd_dlq_delete(args: argparse.Namespace) -> int:
    from shared import dead_letters  # nats-py with it: see services.cli_bus

    results = with_jetstream(lambda js: dead_letters.discard(js, list(args.sequences)))
    if results is None:
        return 2
    for sequence, deleted in results:
        if deleted:
            print(f"deleted {sequence}")
        else:
            print(f"not deleted {sequence}: no such dead letter", file=sys.stderr)
    return 0 if all(deleted for _, deleted in results) else 1
