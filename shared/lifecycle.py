"""Process lifecycle helpers shared by every service's entry point."""

from __future__ import annotations

import asyncio
import gc
import signal


async def wait_for_shutdown_signal(stop: asyncio.Event) -> None:
    """Until SIGINT or SIGTERM sets `stop`, or the process itself does."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def freeze_long_lived_objects() -> None:
    """Take everything allocated so far out of the cyclic garbage collector's sight, for good.

    Called when a service has started, and when litellm has been imported: modules, classes and tables
    that live as long as the process, yet every full collection walks them all. With litellm loaded that
    is about half a million objects and ~225 ms (~70 ms for the API without it), while the event loop
    stands still; frozen, a full collection looks only at what was allocated after."""
    gc.collect()
    gc.freeze()
