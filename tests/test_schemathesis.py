"""Property-based requests generated from the served OpenAPI document (schemathesis), against the real API
on the real database and bus: no 5xx, every error in the envelope. Bounded: a few examples per operation."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from services.api.main import create_app
from services.api.serving import serve_in_thread
from shared.settings import Settings
from tests.conftest import ADMIN_TOKEN, make_settings

schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi())


@pytest.fixture(scope="module")
def api_url(server_urls: tuple[str, str]) -> Iterator[str]:
    """The API served by uvicorn in a thread of its own; writes answer 202 quickly (no writer needed)."""
    with serve_in_thread(make_settings(server_urls, memories_write_timeout_s=0.05)) as url:
        yield url


@pytest.fixture(scope="module")
def known_project(api_url: str) -> str:
    """A real project, so generated bodies that name it reach past the project check."""
    response = httpx.post(f"{api_url}/api/v1/projects", json={"name": "fuzzed"},
                          headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    return str(response.json()["id"])


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors_and_errors_in_the_envelope(case: schemathesis.Case, api_url: str, known_project: str) -> None:
    if isinstance(case.body, dict) and "project_id" in case.body:
        case.body["project_id"] = known_project
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {ADMIN_TOKEN}"}
    response = case.call(base_url=api_url, timeout=30)
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, response.text
        assert isinstance(body["error"]["code"], str) and isinstance(body["error"]["message"], str)
