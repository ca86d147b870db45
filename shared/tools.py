"""The `write_memory` tool an agent platform injects into a generation, and its execution in Python."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from shared import bus
from shared.agents import AgentSpec, write_memory_event
from shared.events import CONTENT_MAX_CHARS, WrittenContent, problem_of
from shared.write_gateway import WriteGateway

WRITE_MEMORY_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "write_memory",
        "description": (
            "Store one fact you learned that is worth remembering in later conversations: a preference, a "
            "decision, a constraint, a detail about the user or their world. Write one self-contained, atomic "
            "sentence. Do not store greetings, small talk, or instructions about how you should behave."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "content": {
                    "type": "string",
                    "description": "The fact, as one self-contained sentence.",
                    "maxLength": CONTENT_MAX_CHARS,
                }
            },
            "required": ["content"],
            "additionalProperties": False,
        },
    },
}


_CONTENT = TypeAdapter(WrittenContent)

NO_WRITE_MEMORY = "this agent has no write_memory_id: memory writing is not enabled"
PENDING_MESSAGE = "The fact is accepted and will be remembered shortly; do not write it again."


def content_problem(content: Any) -> str | None:
    """What is wrong with a model's `content` argument, told back to the model as the tool's `{error}`; None
    when it can be written (the rules of every other write: `events.WrittenContent`)."""
    if content is None:
        return "content is required: the fact to remember, as one sentence"
    try:
        _CONTENT.validate_python(content, strict=True)
    except ValidationError as exc:
        return f"content is not a fact that can be stored: {problem_of(exc.errors()[0])}"
    return None


async def call_write_memory(
    gateway: WriteGateway,
    *,
    project_id: str,
    agent: AgentSpec,
    content: Any,
    generation_id: str | None,
    timeout: float,
) -> dict[str, Any]:
    """Execute one `write_memory` tool call, its `content` as the model gave it; the result goes back to the
    model: `{action, entry_id}`, `{error}`, or `{status: "pending", write_id, message}` when the writer has not
    decided within `timeout` (the write is queued and will be applied: an error there would have the model write
    the fact again). The caller has checked that `write_memory_id` is a memory of
    `project_id`."""
    memory_id = agent.knowledge_config.write_memory_id
    if not memory_id:
        return {"error": NO_WRITE_MEMORY}
    if (problem := content_problem(content)) is not None:
        return {"error": problem}
    event = write_memory_event(
        project_id=project_id, memory_id=memory_id, content=content, agent=agent, generation_id=generation_id
    )
    try:
        outcome = await gateway.submit(event, timeout=timeout, fresh_id=True)  # its write id is new: nothing to claim
    except bus.BusUnavailable:
        return {"error": "memory is unavailable right now; try again later"}
    if outcome is None:
        return {"status": "pending", "write_id": event.write_id, "message": PENDING_MESSAGE}
    if outcome.error is not None:
        return {"error": outcome.error.message}
    return {"action": str(outcome.action), "entry_id": outcome.entry_id}
