"""The extractor: turns completed generation turns into write events (issue 5 builds the consumer).

Until a generative model is configured it stays up, says so, and consumes nothing.
"""

from __future__ import annotations

import logging

from shared.lifecycle import wait_for_shutdown_signal
from shared.settings import Settings

log = logging.getLogger("memories.extractor")


async def run(settings: Settings) -> None:
    if not settings.memories_merge_model:
        log.warning("extraction is off: no LLM provider is configured (set MEMORIES_MERGE_MODEL)")
    await wait_for_shutdown_signal()
