"""Start-up leaves the objects that live as long as the process out of the garbage collector's full passes.

A full collection walks every tracked object, ~225 ms with litellm loaded, while the event loop stands still.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from services.api.main import create_app
from services.extractor.main import ExtractorService
from shared.litellm_loader import load_litellm
from shared.settings import Settings


@pytest.fixture
def unfrozen() -> Iterator[None]:
    load_litellm()  # imported already, so that its own freeze does not stand in for the one under test
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    yield
    gc.freeze()  # as the suite's own services left it


async def test_the_api_freezes_what_its_start_allocated(settings: Settings, unfrozen: None) -> None:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 0


async def test_a_consumer_process_freezes_what_its_start_allocated(settings: Settings, unfrozen: None) -> None:
    extractor = ExtractorService(settings, concurrency=1)
    await extractor.start()
    try:
        assert gc.get_freeze_count() > 0
    finally:
        await extractor.stop()


def test_importing_litellm_freezes_once(unfrozen: None) -> None:
    load_litellm.cache_clear()
    load_litellm()
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    load_litellm()  # loaded already: no second collection
    assert gc.get_freeze_count() == 0
