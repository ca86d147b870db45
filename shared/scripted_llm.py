"""A deterministic litellm provider, `scripted/<name>`, for tests and benchmarks: never the network.

Each model name gets a script: a fixed reply, a function of the messages, or an exception to raise.
Every call is recorded, so a test can assert what the service asked and how often.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.litellm_loader import load_litellm

litellm = load_litellm()  # before any other litellm import: it sets the offline cost map

from litellm.llms.custom_llm import CustomLLM, CustomLLMError
from litellm.types.utils import Choices, Message, ModelResponse, Usage

PROVIDER = "scripted"

Reply = str | Exception | Callable[[list[dict[str, Any]]], str]


@dataclass
class ScriptedCall:
    model: str
    messages: list[dict[str, Any]]
    temperature: float | None


@dataclass
class ScriptedLLM(CustomLLM):
    scripts: dict[str, Reply] = field(default_factory=dict)
    calls: list[ScriptedCall] = field(default_factory=list)
    latency_s: float = 0.0
    latencies: dict[str, float] = field(default_factory=dict)  # a model's own, instead of latency_s

    def __post_init__(self) -> None:
        super().__init__()

    def script(self, name: str, reply: Reply, *, latency_s: float | None = None) -> str:
        """Program `scripted/<name>` (answering after `latency_s`, if given); returns the full litellm model string."""
        self.scripts[name] = reply
        if latency_s is not None:
            self.latencies[name] = latency_s
        return f"{PROVIDER}/{name}"

    def calls_to(self, name: str) -> list[ScriptedCall]:
        return [call for call in self.calls if call.model == name]

    def _asked(self, model: str, messages: list[dict[str, Any]], optional_params: dict[str, Any]) -> str:
        """The call recorded as it is made (before any latency); the script's name."""
        name = model.removeprefix(f"{PROVIDER}/")
        self.calls.append(ScriptedCall(name, messages, optional_params.get("temperature")))
        return name

    def _reply(self, name: str, model: str, messages: list[dict[str, Any]]) -> ModelResponse:
        reply = self.scripts.get(name)
        if reply is None:
            raise CustomLLMError(status_code=404, message=f"no script for {PROVIDER}/{name}")
        if isinstance(reply, Exception):
            # As a provider error, so litellm reports it like any provider failure.
            raise CustomLLMError(status_code=503, message=f"{type(reply).__name__}: {reply}")
        text = reply(messages) if callable(reply) else reply
        words = sum(len(str(m.get("content", "")).split()) for m in messages)
        return ModelResponse(
            model=model,
            choices=[Choices(index=0, finish_reason="stop", message=Message(role="assistant", content=text))],
            usage=Usage(prompt_tokens=words, completion_tokens=len(text.split()), total_tokens=words + len(text.split())),
        )

    def completion(self, model: str, messages: list[Any], *args: Any, **kwargs: Any) -> ModelResponse:
        return self._reply(self._asked(model, messages, kwargs.get("optional_params") or {}), model, messages)

    async def acompletion(self, model: str, messages: list[Any], *args: Any, **kwargs: Any) -> ModelResponse:
        name = self._asked(model, messages, kwargs.get("optional_params") or {})
        if latency := self.latencies.get(name, self.latency_s):
            await asyncio.sleep(latency)
        return self._reply(name, model, messages)


_instance: ScriptedLLM | None = None


def scripted_llm() -> ScriptedLLM:
    """The process's scripted provider, registered with litellm beside any other custom provider."""
    global _instance
    if _instance is None:
        _instance = ScriptedLLM()
    current = list(litellm.custom_provider_map or [])
    if not any(entry.get("custom_handler") is _instance for entry in current):
        others = [entry for entry in current if entry.get("provider") != PROVIDER]
        litellm.custom_provider_map = [*others, {"provider": PROVIDER, "custom_handler": _instance}]
    return _instance


def install_scripts(spec: str) -> ScriptedLLM:
    """Program the provider from JSON (`MEMORIES_SCRIPTED_LLM`), for service processes under test."""
    provider = scripted_llm()
    for name, script in json.loads(spec).items():
        provider.script(name, str(script["reply"]))
        provider.latency_s = float(script.get("latency_s", provider.latency_s))
    return provider
