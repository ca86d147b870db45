"""The bus: `memories bus init`, `status`, `reroute` and `prune`, and the one way every one-shot
command reaches JetStream (the configured NATS, or the local run's)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from shared.local_run import NATS_URL_MISSING, nats_url_for
from shared.settings import Settings, get_settings

if TYPE_CHECKING:
    from nats.js import JetStreamContext

# nats-py (and aiohttp with it) and the bus modules are imported by the commands that use them: every `memories`
# command registers this module's verbs, and a REST verb would otherwise pay ~0.25 s for them at each call.

T = TypeVar("T")
log = logging.getLogger("memories.cli")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds this module's verbs to the `memories` parser."""
    verbs = subparsers.add_parser("bus", help="NATS JetStream layout").add_subparsers(dest="bus_command", required=True)
    verbs.add_parser("init", help="create or update streams and consumers").set_defaults(func=cmd_bus_init)
    verbs.add_parser("status", help="each consumer's backlog, in flight and redelivered").set_defaults(
        func=cmd_bus_status
    )
    verbs.add_parser(
        "prune", help="delete consumers the layout no longer has (after lowering the partition count), if idle"
    ).set_defaults(func=cmd_bus_prune)
    verbs.add_parser(
        "reroute",
        help="move the writes queued on partitions beyond the count (sent by a publisher left on the old count) to "
        "their memory's partition",
    ).set_defaults(func=cmd_bus_reroute)


def with_jetstream(work: Callable[[JetStreamContext], Awaitable[T]]) -> T | None:
    """Run `work` on the bus of the settings (or of the local run): None (told) when no bus is configured; exits 1
    when it cannot be reached."""
    settings = get_settings()
    nats_url = nats_url_for(settings.nats_url, settings.data_dir)
    if not nats_url:
        print(NATS_URL_MISSING, file=sys.stderr)
        return None
    return on_jetstream(nats_url, work)


def on_jetstream(nats_url: str, work: Callable[[JetStreamContext], Awaitable[T]]) -> T:
    """Run `work` on the bus at `nats_url`; exits 1, in one line, when it cannot be reached."""
    import nats.errors
    import nats.js.errors

    from shared import bus_connection

    async def run() -> T:
        nc = await bus_connection.connect(nats_url, name="memories-cli", one_shot=True, settings=get_settings())
        try:
            return await work(nc.jetstream())
        finally:
            await nc.close()

    try:
        return asyncio.run(run())
    except nats.js.errors.ServiceUnavailableError as exc:
        if exc.err_code is not None or exc.description is not None:  # a real 503 (a cluster electing): said as is
            print(str(exc), file=sys.stderr)
            raise SystemExit(1) from None
        # No responder for the JetStream API: nats-py says only "code=None … description='None'".
        print(
            f"JetStream is not available on the NATS server at {bus_connection.redacted_servers(nats_url)}: start the server "
            "with JetStream enabled (nats-server -js, or jetstream {} in its configuration)",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    except (bus_connection.BusUnreachable, nats.errors.Error) as exc:  # unreachable, or JetStream refused: one line, no traceback
        print(str(exc) or type(exc).__name__, file=sys.stderr)
        raise SystemExit(1) from None


def lay_out_for_the_local_run(nats_url: str, settings: Settings) -> str | None:
    """What `memories up` does with the NATS it started, before it starts any service: nothing publishes or consumes
    yet, the one moment a changed MEMORIES_PARTITIONS can be applied (as `bus init` would), the partitions it drops
    pruned, and the writes the last run's writer held released at once (`bus_admin.release_held_writes`). The refusal,
    when writes of the old count are still queued; None once laid out."""
    from shared import bus, bus_admin

    async def apply(js: JetStreamContext) -> None:
        await bus.ensure_layout(js, settings, bus.Role.ADMIN)
        await bus_admin.prune_consumers(js, settings)
        if released := await bus_admin.release_held_writes(js, settings):
            log.info("%d writes the last run's writer held are queued again, in order", released)

    try:
        on_jetstream(nats_url, apply)
    except bus.PartitionCountMismatch as exc:
        return (
            f"{exc}: start `memories up` once with the count it had, so that its writer decides them, then with "
            "the new one"
        )
    return None


def cmd_bus_init(_args: argparse.Namespace) -> int:
    from shared import bus

    settings = get_settings()

    async def apply(js: JetStreamContext) -> bool:
        await bus.ensure_layout(js, settings, bus.Role.ADMIN)
        return True

    try:
        if with_jetstream(apply) is None:
            return 2
    except bus.PartitionCountMismatch as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"streams and consumers applied ({settings.memories_partitions} partitions)")
    return 0


def cmd_bus_status(_args: argparse.Namespace) -> int:
    from shared import bus, bus_admin

    settings = get_settings()
    status = with_jetstream(lambda js: bus_admin.bus_status(js, settings))
    if status is None:
        return 2
    laid_out = "not laid out yet" if status.partitions is None else f"laid out for {status.partitions} partitions"
    print(f"{bus.WRITES_STREAM}: {laid_out}, {status.queued_writes} writes queued")
    if status.stranded_writes:
        print(f"{status.stranded_writes} of them on partitions beyond the count: `memories bus reroute`")
    width = max([len("CONSUMER"), *(len(state.consumer) for state in status.consumers)])
    print(f"{'STREAM':16}  {'CONSUMER':{width}}  {'PENDING':>8}  {'IN FLIGHT':>9}  {'REDELIVERED':>11}  NOTE")
    notes = {"layout": "", "stale": "a partition beyond the count: `memories bus prune`", "other": "not the service's"}
    for state in status.consumers:
        counts = f"{state.pending:>8}  {state.in_flight:>9}  {state.redelivered:>11}"
        note = notes[state.role]
        if state.role == "stale" and state.pending and not state.pulling:
            note = "a partition beyond the count, writes stranded on it: `memories bus reroute`"
        print(f"{state.stream:16}  {state.consumer:{width}}  {counts}  {note}".rstrip())
    return 0


def cmd_bus_prune(_args: argparse.Namespace) -> int:
    from shared import bus_admin

    deleted, busy = _on_the_recorded_count(bus_admin.prune_consumers)
    print(f"deleted: {', '.join(deleted) or 'none'}")
    return _refused_for(
        busy,
        "kept, messages still wait on them or writers of the old count still pull from them (stop those writers, let "
        "them drain, then prune again)",
    )


def cmd_bus_reroute(_args: argparse.Namespace) -> int:
    from shared import bus_admin

    moved, consumed = _on_the_recorded_count(bus_admin.reroute_stranded_writes)
    print(
        f"moved {moved} writes to their memory's partition, each after that memory's writes queued there"
        + (" (`memories bus prune` deletes the consumers left idle)" if moved else "")
    )
    return _refused_for(
        consumed,
        "left in place, writers of the old count still consume them (they decide those writes; stop them and reroute "
        "again)",
    )


def _on_the_recorded_count(work: Callable[[JetStreamContext, Settings], Awaitable[T]]) -> T:
    """`work` with this configuration, whose partition count must be the one the bus is laid out for: exits 1,
    saying why, when it is not (`bus.PartitionCountMismatch`), and 2 when no bus is configured."""
    from shared import bus

    settings = get_settings()
    try:
        done = with_jetstream(lambda js: work(js, settings))
    except bus.PartitionCountMismatch as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(1) from None
    if done is None:
        raise SystemExit(2)
    return done


def _refused_for(consumers: list[str], why: str) -> int:
    """Exit status 1, the consumers named, when any was left alone."""
    if consumers:
        print(f"{why}: {', '.join(consumers)}", file=sys.stderr)
        return 1
    return 0
