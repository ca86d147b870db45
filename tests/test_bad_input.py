"""Hostile and broken input, over REST and on every subject a consumer reads: always a 4xx with the
envelope (never a 5xx), and on the bus a dead letter with a reason (never a crashed consumer)."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any, Optional

import httpx
import nats
import pytest

from shared import bus
from shared.events import MemoryWriteRequested
from shared.ids import new_write_id
from shared.settings import Settings


def assert_envelope(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["code"], str) and isinstance(error["message"], str)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # deep nesting (also over the size limit)
        b'{"memory_id": ' + b"[" * 5_000 + b"]" * 5_000 + b', "content": "x"}',  # deep, small
        b'{"memory_id": "mem_AAAAAAAAAAAAAAAA", "content": "\xff\xfe broken utf-8"}',
        b'{"memory_id": "mem_AAAAAAAAAAAAAAAA", "content": "x", "duplicate_threshold": NaN}',
        b'{"memory_id": "mem_AAAAAAAAAAAAAAAA", "content": "x", "duplicate_threshold": -Infinity}',
        b"",
        b"null",
        b'"just a string"',
    ],
)
async def test_malformed_bodies_are_4xx(client: httpx.AsyncClient, raw: bytes) -> None:
    response = await client.post("/memory-entries", content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    assert "error" in response.json()


async def test_ten_thousand_tags_and_non_string_tags(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    many = await client.post(
        "/memory-entries", json={"memory_id": memory["id"], "content": "x", "tags": [f"t{i}" for i in range(10_000)]}
    )
    assert many.status_code in (400, 413) and "error" in many.json()
    for tags in ([1, 2], [None], [{"a": 1}], "crm", [""]):
        assert_envelope(await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "x",
                                                                   "tags": tags}), 400)


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"k": value}
    return value


async def test_huge_and_nested_metadata(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    # 600 levels parse, and used to exhaust the stack of a recursive depth check (a 500).
    for levels in (200, 600):
        too_deep = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Nested metadata",
                                                              "metadata": nested(levels)})
        assert_envelope(too_deep, 400)
        deep_content = await client.post("/orchestration/memory-write",
                                         json={"memory_id": memory["id"], "content": nested(levels)})
        assert_envelope(deep_content, 400)
    shallow = {"a": {"b": {"c": [1, 2, {"d": "e"}]}}}
    accepted = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Shallow metadata",
                                                          "metadata": shallow})
    assert accepted.status_code == 201 and accepted.json()["metadata"] == shallow
    big = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "x",
                                                     "metadata": {"blob": "y" * 100_000}})
    assert_envelope(big, 400)
    # 1.2 KB sent, but stored and served without exponents: 31 KB, and 50 times that for 2,000 of them.
    exponents = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "x",
                                                           "metadata": {"a": [1e308] * 100}})
    assert_envelope(exponents, 400)
    # The bus event takes it still: a write an API of an earlier version accepted is decided, not dead-lettered.
    queued = MemoryWriteRequested(event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"],
                                  content="x", metadata={"a": [1e308] * 100})
    assert queued.metadata == {"a": [1e308] * 100}
    small = {"price": 1.5, "ratio": 2.5e-3, "big": 1e20}
    kept = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Small numbers",
                                                      "metadata": small})
    assert kept.status_code == 201 and kept.json()["metadata"] == small, kept.text


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
async def test_numbers_json_has_not_are_refused_not_stored_as_null(
    client: httpx.AsyncClient, memory: dict[str, Any], number: float
) -> None:
    # Python's parser reads NaN, Infinity and 1e999; a client in another language may send them.
    for path, body in (
        ("/memory-entries", {"content": "Odd metadata", "metadata": {"n": number}}),
        ("/memory-entries", {"content": "Odd nested metadata", "metadata": {"a": [1, {"n": number}]}}),
        ("/orchestration/memory-write", {"content": {"v": number}}),
        ("/orchestration/memory-write", {"content": number}),
        ("/orchestration/memory-write", {"content": "Odd tag", "tags": {"k": number}}),
    ):
        raw = json.dumps({"memory_id": memory["id"], **body})  # NaN, Infinity, -Infinity: httpx sends none
        response = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert_envelope(response, 400)
        assert "NaN or Infinity" in response.text, response.text


async def test_a_trailing_slash_is_a_404_in_the_envelope_not_a_redirect(client: httpx.AsyncClient) -> None:
    """Starlette answered a bare 307 to the same path without the slash, at the host the request's Host header
    named (an address a client was then sent to)."""
    for method, path in (("GET", "/memories/"), ("POST", "/memory-entries/")):
        response = await client.request(method, path, headers={"Host": "evil.example"}, json={})
        assert_envelope(response, 404)
        assert "location" not in response.headers


async def test_a_method_a_route_does_not_take_is_a_405_that_says_which_it_takes(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    # The envelope was sent without Allow, which RFC 9110 requires of a 405 and clients read to find the methods.
    response = await client.patch(f"/memories/{memory['id']}", json={"name": "renamed"})
    assert_envelope(response, 405)
    assert response.json()["error"]["code"] == "METHOD_NOT_ALLOWED"
    assert set(response.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD", "PUT", "DELETE"}
    # An id that holds a "/" (the route's `:path`), and a route outside /api/v1: each names its own.
    assert (await client.get("/generations/run/42/provenance")).headers["allow"] == "DELETE"
    assert (await client.post(client.base_url.join("/metrics"))).headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize("memory_id", ["", "mem_", "mem_../../etc", "mem_%00", "mem_" + "A" * 500, "MEM_AAAAAAAAAAAAAAAA"])
async def test_malformed_ids_are_404(client: httpx.AsyncClient, memory_id: str) -> None:
    response = await client.get(f"/memories/{memory_id}") if memory_id else await client.get("/memories/%20")
    assert_envelope(response, 404)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/memory-entries", b'{"memory_id": "mem_\\ud800", "content": "x"}', "memory_id"),
        ("/memories", b'{"project_id": "proj_\\udc80AAAAAAAAAAAAAAA", "name": "x"}', "project_id"),
        ("/knowledge/search", b'{"project_id": "proj_\\ud800", "query": "x"}', "project_id"),
        # Fields that reached a log line, an event or a column, and failed there: a 500, or a turn left pending.
        ("/knowledge/context", b'{"knowledge_config": {"memory_ids": ["mem_x"]}, "message": "hi \\udc00"}', "message"),
        ("/tools/write_memory", b'{"content": "x", "generation_id": "g\\ud800", "agent": {"model": "m"}}', "generation_id"),
        ("/generations/completed", b'{"generation_id": "g", "agent": {"id": "a\\udfff"}, "messages": []}', "agent.id"),
        ("/generations/completed",
         b'{"generation_id": "g", "agent": {}, "messages": [{"role": "user", "content": "\\ud83d"}]}',
         "messages.0.content"),
        ("/memory-entries", b'{"memory_id": "mem_x", "content": "x", "metadata": {"k\\ud800": 1}}', "metadata.k\ufffd"),
        # Not escaped: UTF-8 bytes of a surrogate (Python's parser takes them), and UTF-16, no JSON text either.
        ("/generations/completed", b'{"generation_id": "g", "agent": {"id": "a\xed\xa0\x80"}, "messages": []}', "body"),
        ("/tools/write_memory", '{"content": "x", "generation_id": "g", "agent": {}}'.encode("utf-16"), "body"),
    ],
)
async def test_a_lone_surrogate_anywhere_in_a_body_is_a_400(
    client: httpx.AsyncClient, path: str, body: bytes, field: str
) -> None:
    # Valid JSON (an escape), and no UTF-8 text can hold it: refused at the door, before any route sees it.
    response = await client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_envelope(response, 400)
    assert [f["field"] for f in response.json()["error"]["meta"]["invalid_fields"]] == [field]
    assert b"\\ud" not in response.content  # what strict parsers refuse


async def test_an_escaped_surrogate_pair_is_a_character_like_any_other(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    # How Python's json.dumps and many other encoders send an emoji by default.
    body = b'{"memory_id": "%s", "content": "Loves \\ud83d\\ude00 and a literal \\\\ud800"}' % memory["id"].encode()
    response = await client.post("/memory-entries", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 201, response.text
    assert response.json()["content"] == "Loves \U0001f600 and a literal \\ud800"


@pytest.mark.parametrize(
    ("subject", "origin"),
    [
        ("generations.completed.proj_AAAAAAAAAAAAAAAA", "extractor"),
        ("generations.deleted.proj_AAAAAAAAAAAAAAAA", "writer"),
        ("conversations.deleted.proj_AAAAAAAAAAAAAAAA", "writer"),
    ],
)
async def test_malformed_events_on_every_subject_are_dead_lettered(
    settings: Settings, writers: list[Any], extractors: list[Any], subject: str, origin: str
) -> None:
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        dead = await js.subscribe(f"{bus.DEAD_LETTER_ROOT}.{origin}", stream=bus.DEAD_LETTER_STREAM,
                                  deliver_policy=nats.js.api.DeliverPolicy.NEW)
        for body in (b"\xff\xfe not json", json.dumps({"event_id": "x", "unexpected": True}).encode()):
            await js.publish(subject, body, stream=bus.GENERATIONS_STREAM)
            letter = json.loads((await dead.next_msg(timeout=15)).data)
            assert letter["origin_subject"] == subject and letter["reason"]
        await dead.unsubscribe()
        # Acknowledged after the dead letter, never left hanging (nor redelivered in a loop).
        durable = bus.EXTRACTOR_DURABLE if origin == "extractor" else (
            bus.WRITER_GENERATION_DELETIONS if subject.startswith("generations.") else bus.WRITER_CONVERSATION_DELETIONS
        )
        for _ in range(100):
            info = await js.consumer_info(bus.GENERATIONS_STREAM, durable)
            if info.num_ack_pending == 0 and info.num_pending == 0:
                break
            await asyncio.sleep(0.05)
        assert info.num_ack_pending == 0 and info.num_pending == 0
    finally:
        await nc.close()


async def test_an_oversized_write_event_is_dead_lettered(settings: Settings, writers: list[Any]) -> None:
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        dead = await js.subscribe(f"{bus.DEAD_LETTER_ROOT}.writer", stream=bus.DEAD_LETTER_STREAM,
                                  deliver_policy=nats.js.api.DeliverPolicy.NEW)
        event = {"event_id": "wr_" + "0" * 32, "project_id": "proj_AAAAAAAAAAAAAAAA",
                 "memory_id": "mem_AAAAAAAAAAAAAAAA", "content": "x" * 50_000}
        subject = bus.write_subject("mem_AAAAAAAAAAAAAAAA", settings.memories_partitions)
        await js.publish(subject, json.dumps(event).encode(), stream=bus.WRITES_STREAM)
        letter = json.loads((await dead.next_msg(timeout=15)).data)
        assert "invalid write event" in letter["reason"]
        await dead.unsubscribe()
    finally:
        await nc.close()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("DELETE", "/generations/a%00b/provenance?project_id={project}", None),
        ("DELETE", "/conversations/a%00b/provenance?project_id={project}", None),
        ("GET", "/generations/a%00b/extraction?project_id={project}", None),
        ("POST", "/ai-providers", {"project_id": "{project}", "name": "p", "provider": "openai", "api_base": "h\u0000"}),
        ("POST", "/ai-providers", {"project_id": "{project}", "name": "p", "provider": "openai", "default_model": "m\u0000"}),
        ("PUT", "/projects/{project}/default-model-route", {"model_route_id": "a\u0000"}),
        ("POST", "/tools/write_memory", {"content": "A fact", "agent": {"modelRouteId": "r\u0000"}}),
    ],
)
async def test_nul_anywhere_is_a_4xx(
    client: httpx.AsyncClient, memory: dict[str, Any], method: str, path: str, body: dict[str, Any] | None
) -> None:
    project = memory["project_id"]
    payload = json.loads(json.dumps(body).replace("{project}", project)) if body is not None else None
    response = await client.request(method, path.replace("{project}", project), json=payload)
    assert_envelope(response, 400)
    assert "NUL" in response.json()["error"]["message"] + json.dumps(response.json()["error"].get("meta"))
    assert "PostgreSQL" not in response.text  # what to change, not which database refused it


@pytest.mark.parametrize("malformed", ["a%00", "aip_x", "route_x", "x" * 300])
async def test_a_malformed_provider_or_route_id_is_not_found(
    client: httpx.AsyncClient, memory: dict[str, Any], malformed: str
) -> None:
    # A NUL reached the database, which refused it: a 400 and a warning of a gap in validation, where the docs
    # promise a 404 for a malformed id, as for any unknown one.
    requests = [("DELETE", f"/ai-providers/{malformed}", None), ("DELETE", f"/model-routes/{malformed}", None)]
    if "%" not in malformed:  # a NUL in a body is a 400, as in any field of the API
        target = {"project_id": memory["project_id"], "name": "r", "targets": [{"ai_provider_id": malformed}]}
        requests.append(("POST", "/model-routes", target))
    for method, path, body in requests:
        assert_envelope(await client.request(method, path, json=body), 404)


async def test_a_compressed_body_is_refused_as_such(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    # It was read as text ("must be UTF-8 text: byte 1 is not"), and a plain body declared gzip was taken.
    body = json.dumps({"memory_id": memory["id"], "content": "Compressed fact"}).encode()
    for sent, encoding in ((gzip.compress(body), "gzip"), (body, "gzip"), (body, "br")):
        response = await client.post("/memory-entries", content=sent,
                                     headers={"content-type": "application/json", "content-encoding": encoding})
        assert_envelope(response, 415)
        assert response.json()["error"]["code"] == "UNSUPPORTED_MEDIA_TYPE"
    plain = await client.post("/memory-entries", content=body,
                              headers={"content-type": "application/json", "content-encoding": "identity"})
    assert plain.status_code == 201, plain.text


async def test_a_body_without_the_json_content_type_is_explained(client: httpx.AsyncClient) -> None:
    response = await client.post("/memories", content=b'{"name": "x"}', headers={"content-type": "text/plain"})
    assert_envelope(response, 400)
    assert "Content-Type: application/json" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "fields",
    [{"conversation_id": "conv_\u0000"}, {"extract": "yes"}, {"extract": 1}, {"streamed": "false"},
     # Refused here as on the tool route, not published to be skipped by the extractor later.
     {"agent": {"id": "agent_1", "knowledge_config": {"write_memory_id": 5}}},
     # Accepted, it failed every query of the extraction, which ended failed "unexpectedly (DataError)".
     {"agent": {"id": "agent_1", "knowledge_config": {"write_memory_id": "mem_\u0000x"}}},
     {"agent": {"id": "agent_1", "knowledge_config": {"extraction": "maybe"}}},
     {"agent": {"id": "agent_1", "knowledge_config": {"bogus": 1}}},
     # NUL anywhere in the transcript, as in every other field of the API.
     {"messages": [{"role": "user", "content": "Hi\u0000"}]}, {"messages": [{"role": "us\u0000er", "content": "Hi"}]},
     {"output": "Noted\u0000"}, {"agent": {"id": "agent\u0000", "model": "m"}}, {"status": "done\u0000"},
     {"agent": {"id": "agent_1", "knowledge_config": {"extraction": {"enabled": True, "prompt": "p\u0000"}}}},
     {"generation_id": "\u200b"},  # an id no one can see, or type
     {"generation_id": "g\u0001ctl"}, {"generation_id": "g\u202eRTL"},  # shown otherwise than stored
     {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},  # read as no text
     # Accepted, it could not be forgotten: an empty one is refused by the forgetting route.
     {"conversation_id": ""}, {"conversation_id": " \u200b "}],
)
async def test_a_completed_turn_is_validated_before_it_is_published(
    client: httpx.AsyncClient, memory: dict[str, Any], fields: dict[str, Any]
) -> None:
    body = {"project_id": memory["project_id"], "generation_id": "gen_bad_input",
            "agent": {"id": "agent_1", "model": "m", "knowledge_config": {"writeMemoryId": memory["id"]}},
            "messages": [{"role": "user", "content": "Hi"}], **fields}
    response = await client.post("/generations/completed", json=body)
    assert_envelope(response, 400)
    meta = response.json()["error"]["meta"]
    named = [problem["field"] for problem in meta.get("invalid_fields", [])] + meta.get("unknown_fields", [])
    assert named and all(field.startswith(next(iter(fields))) for field in named), meta


@pytest.mark.parametrize("generation_id", ["", "   ", "\u200b", "gen 1", "g" * 256])
async def test_a_tool_calls_generation_id_is_held_to_the_rule_of_a_completed_turns(
    client: httpx.AsyncClient, memory: dict[str, Any], generation_id: str
) -> None:
    # It took any text: "   " was stored as the entry's generation, which no forgetting could name.
    body = {"project_id": memory["project_id"], "content": "Cats purr loudly", "generation_id": generation_id,
            "agent": {"id": "agent_1", "knowledge_config": {"write_memory_id": memory["id"]}}}
    response = await client.post("/tools/write_memory", json=body)
    assert_envelope(response, 400)
    assert [problem["field"] for problem in response.json()["error"]["meta"]["invalid_fields"]] == ["generation_id"]


async def test_a_generation_id_with_a_slash_can_be_looked_up_and_forgotten_an_empty_one_cannot(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    project = memory["project_id"]
    body = {"project_id": project, "generation_id": "run/42", "agent": {"id": "agent_1", "model": "m"},
            "messages": [{"role": "user", "content": "Hi"}]}
    assert (await client.post("/generations/completed", json=body)).status_code == 202
    status = await client.get("/generations/run%2F42/extraction", params={"project_id": project})
    assert status.status_code == 200 and status.json()["generation_id"] == "run/42", status.text
    cleared = await client.delete("/generations/run%2F42/provenance", params={"project_id": project})
    assert cleared.status_code == 200 and cleared.json() == {"cleared": 0}
    # An empty id (a path built from a missing variable) was a 200, and remembered as forgotten.
    for kind, reference in (("generations", ""), ("conversations", "")):
        refused = await client.delete(f"/{kind}/{reference}/provenance", params={"project_id": project})
        assert_envelope(refused, 400)


def test_a_refused_value_is_the_clients_fault_only_when_the_client_chose_it() -> None:
    from psycopg import DataError as DriverDataError
    from psycopg import errors
    from sqlalchemy.exc import DataError

    from services.api.errors import _refused_client_value

    def refused(orig: Exception) -> bool:
        return _refused_client_value(DataError("SELECT 1", {}, orig))

    assert refused(DriverDataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"))
    assert refused(errors.StringDataRightTruncation("value too long for type character varying(255)"))
    assert refused(errors.InvalidTextRepresentation("invalid input syntax"))
    # pgvector's "expected 384 dimensions" (22000) and other data exceptions are the service's bugs: a 500.
    assert not refused(errors.DataException("expected 384 dimensions, not 768"))
    assert not refused(errors.DivisionByZero("division by zero"))


async def test_a_query_parameter_the_route_does_not_take_is_refused_not_ignored(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    project_id = memory["project_id"]
    # How axios and qs send a list, and a misspelling: ignored, each listed every memory of the project.
    for params in ({"project_id": project_id, "tags[]": "tier:gold"}, {"project_id": project_id, "tag": "x"}):
        response = await client.get("/memories", params=params)
        assert_envelope(response, 400)
        assert response.json()["error"]["meta"]["unknown_fields"] == [next(k for k in params if k != "project_id")]
    # A parameter a dependency takes (paging) is known; one only another route takes is not.
    listed = await client.get("/memory-entries", params={"memory_id": memory["id"], "limit": 1, "offset": 0})
    assert listed.status_code == 200, listed.text
    refused = await client.get("/memory-entries", params={"memory_id": memory["id"], "tags": "x", "includeInvalidated": 1})
    assert_envelope(refused, 400)
    assert refused.json()["error"]["meta"]["unknown_fields"] == ["tags", "includeInvalidated"]
    assert (await client.get("/memories", params={"project_id": project_id, "tags": "a*"})).status_code == 200
    # A parameter given twice: a list takes both; one value of two was taken silently (the last project's page).
    both = await client.get("/memories", params=[("project_id", project_id), ("tags", "a*"), ("tags", "b*")])
    assert both.status_code == 200, both.text
    twice = await client.get("/memories", params=[("project_id", project_id), ("project_id", "proj_other")])
    assert_envelope(twice, 400)
    assert twice.json()["error"]["meta"]["invalid_fields"] == [
        {"field": "project_id", "message": "given more than once: it takes one value"}
    ]


async def test_a_404_does_not_echo_an_id_of_any_length(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    # A 5,000-character id made a 5 KB message; an empty one read "memory  not found".
    long = await client.get(f"/memories/{'m' * 5_000}")
    assert_envelope(long, 404)
    assert len(long.json()["error"]["message"]) < 120, long.json()
    empty = await client.get("/memory-entries", params={"memory_id": ""})
    assert_envelope(empty, 404)
    assert empty.json()["error"]["message"] == "no memory has an empty id"


def test_an_optional_list_parameter_takes_repeats_as_a_list_does() -> None:
    from services.api.routing import _takes_several

    assert _takes_several(list[str]) and _takes_several(list[str] | None) and _takes_several(Optional[set[int]])  # noqa: UP045
    assert not _takes_several(str) and not _takes_several(str | None) and not _takes_several(int)


async def test_a_validators_message_reaches_the_client_in_its_own_words(
    client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    blank = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": " \u200b "})
    assert_envelope(blank, 400)
    assert blank.json()["error"]["meta"]["invalid_fields"] == [{"field": "content", "message": "must not be blank"}]
    # Where the JSON broke is a character of the body, not a field named "14".
    broken = await client.post("/memory-entries", content=b'{"memory_id": ', headers={"content-type": "application/json"})
    assert_envelope(broken, 400)
    (problem,) = broken.json()["error"]["meta"]["invalid_fields"]
    assert problem["field"] == "body" and problem["message"].endswith("at character 14"), problem


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        # oobabooga and huggingface call the URL in a model's name, even behind a provider registered elsewhere.
        ("/tools/write_memory", {"content": "x", "agent": {"ai_provider_id": "aip_x", "model": "http://10.0.0.1/"}},
         "agent.model"),
        ("/generations/completed", {"generation_id": "g", "agent": {"model": "oobabooga/http://10.0.0.1"}},
         "agent.model"),
        ("/ai-providers", {"name": "p", "provider": "huggingface", "default_model": "https://10.0.0.1/x"},
         "default_model"),
        # Each name an agent sends is a metric label and a stored column; 240,000 characters were taken.
        ("/tools/write_memory", {"content": "x", "agent": {"model": "openai/" + "m" * 300}}, "agent.model"),
        ("/generations/completed", {"generation_id": "g", "agent": {"model": "m" * 256}, "messages": []}, "agent.model"),
        ("/knowledge/context",
         {"knowledge_config": {"memory_ids": ["mem_x"], "extraction": {"model": "m" * 256}}, "message": "x"},
         "knowledge_config.extraction.ExtractionConfig.model"),  # the branch of `bool | ExtractionConfig`
    ],
)
async def test_a_model_name_may_be_no_address_and_at_most_255_characters(
    client: httpx.AsyncClient, project: dict[str, Any], path: str, body: dict[str, Any], field: str
) -> None:
    response = await client.post(path, json={"project_id": project["id"], **body})
    assert_envelope(response, 400)
    assert field in [f["field"] for f in response.json()["error"]["meta"]["invalid_fields"]]


async def test_a_body_sent_to_a_route_that_takes_none_is_not_parsed(client: httpx.AsyncClient) -> None:
    # Deep enough to overflow Python's parser: a route without a body must not read it at all, token or not.
    deep = b"[" * 60_000 + b'"\\ud800"' + b"]" * 60_000
    for headers in ({}, {"Authorization": "Bearer not-a-token"}):
        response = await client.request("GET", "/memories", content=deep, headers=headers)
        without = await client.get("/memories", headers=headers)
        assert response.status_code == without.status_code < 500 and response.json() == without.json(), response.text


def test_every_api_route_refuses_what_no_route_takes() -> None:
    # A router made without the route class would take unknown parameters and broken text again, unnoticed.
    import importlib
    import pkgutil

    from fastapi.routing import APIRoute

    from services.api import routes
    from services.api.routing import CheckedRoute

    outside_the_api = {"health", "metrics"}  # probes and Prometheus, not under /api/v1
    modules = [importlib.import_module(f"{routes.__name__}.{m.name}") for m in pkgutil.iter_modules(routes.__path__)]
    api_routes = [r for m in modules if m.__name__.rsplit(".", 1)[1] not in outside_the_api for r in m.router.routes]
    assert len(api_routes) > 30 and all(isinstance(r, APIRoute) for r in api_routes)
    assert [r.path for r in api_routes if not isinstance(r, CheckedRoute)] == []


@pytest.mark.parametrize("value", ["yes", "on", "1", "t"])
async def test_a_query_boolean_is_true_or_false(client: httpx.AsyncClient, memory: dict[str, Any], value: str) -> None:
    # "yes", "on", "1" were read as true: a guess, where a query number that is no number is a 400.
    listed = await client.get("/memory-entries", params={"memory_id": memory["id"], "include_invalidated": value})
    assert_envelope(listed, 400)
    keys = await client.get("/api-keys", params={"project_id": memory["project_id"], "include_revoked": value})
    assert_envelope(keys, 400)
    for fine in ("true", "True", "false"):  # Python's urlencode writes True as "True"
        listed = await client.get("/memory-entries", params={"memory_id": memory["id"], "include_invalidated": fine})
        assert listed.status_code == 200, fine
