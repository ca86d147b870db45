"""The published contracts match the code: docs/asyncapi.json from shared/events.py, docs/openapi.json
from the routes, the bus's users in deploy/nats/ from shared/bus_permissions.py. Regenerate with
`memories asyncapi`, `memories openapi` and `memories nats-auth`."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from services.cli import main
from services.cli_contracts import DOCS, asyncapi, openapi, render
from shared import bus_permissions, events


def test_asyncapi_document_is_current() -> None:
    assert (DOCS / "asyncapi.json").read_text() == render(asyncapi())


def test_openapi_document_is_current() -> None:
    assert (DOCS / "openapi.json").read_text() == render(openapi())


def test_the_bus_users_in_deploy_are_current() -> None:
    for path, text in bus_permissions.rendered().items():
        assert path.read_text() == text, f"{path} is out of date: run `memories nats-auth`"


def test_the_bus_users_can_be_rendered_outside_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An installed package has no deploy/nats/ to write to.
    target = tmp_path / "nats"
    assert main(["nats-auth", "--output", str(target)]) == 0
    assert {path.name: path.read_text() for path in target.iterdir()} == {
        path.name: text for path, text in bus_permissions.rendered().items()
    }
    assert main(["nats-auth", "--output", str(target), "--check"]) == 0
    (target / "auth.conf").write_text("# edited by hand\n")
    assert main(["nats-auth", "--output", str(target), "--check"]) == 1
    # Without --output, an installed package (no deploy/nats/ beside it) is told to give one, not written into.
    monkeypatch.setattr(bus_permissions, "DEPLOY_NATS", tmp_path / "site-packages" / "deploy" / "nats")
    assert main(["nats-auth"]) == 2
    assert "--output" in capsys.readouterr().err and not (tmp_path / "site-packages").exists()


def test_every_event_model_is_in_the_asyncapi_document() -> None:
    document = json.loads((DOCS / "asyncapi.json").read_text())
    published = set(document["components"]["messages"])
    event_models = {
        name for name, value in vars(events).items()
        if isinstance(value, type) and issubclass(value, events.Event) and value is not events.Event
    }
    assert event_models <= published


def test_every_route_has_a_summary() -> None:
    document = openapi()
    missing = [
        f"{method.upper()} {path}"
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        if not operation.get("summary")
    ]
    assert missing == []


def test_every_success_with_a_body_says_its_shape() -> None:
    # POST /generations/completed answered {generation_id, status} with no schema at all: generated clients got an
    # untyped body. A 204 has none.
    untyped = [
        f"{method.upper()} {path} {status}"
        for path, operations in openapi()["paths"].items() if path.startswith("/api/v1")
        for method, operation in operations.items()
        for status, response in operation["responses"].items()
        if status.startswith("2") and status != "204"
        and not response.get("content", {}).get("application/json", {}).get("schema")
    ]
    assert untyped == []
    # Nor a page of free-form objects: /usage's rows were `dict[str, Any]`, fields a client had to guess.
    schemas = openapi()["components"]["schemas"]
    free_form = [name for name, schema in schemas.items() if name.startswith("Page_")
                 and "$ref" not in schema["properties"]["data"]["items"]]
    assert free_form == []


def test_an_event_time_without_a_zone_is_read_as_utc() -> None:
    # A platform publishing turns itself may leave the zone out; its times are compared with ours.
    turn = events.GenerationCompleted.model_validate(
        {"event_id": "evt_1", "occurred_at": "2026-12-01T10:00:00", "project_id": "proj_1",
         "generation_id": "gen_1", "agent": {}}
    )
    assert turn.occurred_at == datetime(2026, 12, 1, 10, tzinfo=UTC)
    assert turn.occurred_at < events.utcnow()  # comparable: no TypeError between naive and aware


def test_the_document_tells_the_error_envelope_not_fastapis_422() -> None:
    document = openapi()
    operations = [
        (path, method, operation) for path, methods in document["paths"].items() if path.startswith("/api/v1")
        for method, operation in methods.items()
    ]
    envelope = {"$ref": "#/components/schemas/ErrorEnvelope"}
    for path, method, operation in operations:
        responses = operation["responses"]
        assert "422" not in responses, (method, path)
        for status in ("400", "401", "403", "503", "default"):
            assert responses[status]["content"]["application/json"]["schema"] == envelope, (method, path, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for path in ("/api/v1/memory-entries", "/api/v1/orchestration/memory-write"):
        responses = document["paths"][path]["post"]["responses"]
        assert {status: responses[status]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
                for status in ("200", "201", "202")} == {"200": "EntryWritten", "201": "EntryWritten", "202": "WriteAccepted"}


def test_the_document_says_every_route_takes_a_bearer_credential() -> None:
    # Without it a generated client sent no token (every call a 401), and /docs had no way to give one.
    document = openapi()
    scheme = document["components"]["securitySchemes"]["bearer"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer") and "API key" in scheme["description"]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            expected = [{"bearer": []}] if path.startswith("/api/v1") else None  # the probes are open
            assert operation.get("security") == expected, (method, path)


def test_every_operation_has_a_unique_camel_case_id() -> None:
    # FastAPI's default, `create_memory_api_v1_memories_post`, became a generated client's method name.
    ids = [operation["operationId"] for methods in openapi()["paths"].values() for operation in methods.values()]
    assert len(ids) == len(set(ids)) and "createMemory" in ids
    assert [i for i in ids if not re.fullmatch(r"[a-z]+(?:[A-Z][a-z]*)*", i)] == []


def test_every_time_is_published_as_a_date_time() -> None:
    # Published as plain strings, the times reached generated clients as text to parse by hand.
    schemas = openapi()["components"]["schemas"]
    times = {(name, field): json.dumps(spec) for name, schema in schemas.items()
             for field, spec in schema.get("properties", {}).items() if field.endswith("_at")}
    assert ("EntryOut", "created_at") in times
    assert [where for where, spec in times.items() if '"format": "date-time"' not in spec] == []


def test_every_bound_is_published_as_json_schema_knows_it() -> None:
    # Pydantic writes `ge`/`le` (no JSON Schema keyword, so generated clients drop the range) for a bound it
    # meets after a validator in an Annotated type; `minimum`/`maximum` otherwise.
    def keys(value: object) -> set[str]:
        if isinstance(value, dict):
            return set(value).union(*(keys(child) for child in value.values()))
        if isinstance(value, list):
            return set().union(*(keys(child) for child in value))
        return set()

    for document in (openapi(), asyncapi()):
        assert keys(document) & {"ge", "le", "gt", "lt"} == set()
    search = openapi()["components"]["schemas"]["KnowledgeSearch"]["properties"]["min_score"]
    assert {"minimum": -1.0, "maximum": 1.0}.items() <= search["anyOf"][0].items()
