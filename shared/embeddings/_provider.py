"""The in-process models as a litellm custom provider, so every embedding goes through litellm.

Importing this module imports litellm: `shared.embeddings` only imports it from inside functions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from shared.litellm_loader import load_litellm

litellm = load_litellm()  # before any other litellm import: it sets the offline cost map

from litellm.llms.custom_llm import CustomLLM, CustomLLMError
from litellm.types.utils import EmbeddingResponse, Usage

from ._onnx import MiniLMEncoder, get_encoder

__all__ = ["MODELS", "PROVIDER", "LocalEmbeddingHandler", "litellm", "load_model", "register"]

PROVIDER = "local"
# litellm strips the "local/" prefix before it calls the handler, so these are bare names.
MODELS: dict[str, Callable[[], MiniLMEncoder]] = {"all-minilm-l6-v2-int8": get_encoder}


def load_model(model: str) -> MiniLMEncoder:
    """The in-process model `model` names, with or without the prefix (loaded on first use, then kept)."""
    name = model.removeprefix(f"{PROVIDER}/")
    factory = MODELS.get(name)
    if factory is None:
        known = ", ".join(f"{PROVIDER}/{m}" for m in sorted(MODELS))
        raise CustomLLMError(status_code=404, message=f"unknown local embedding model {model!r} (known: {known})")
    return factory()


class LocalEmbeddingHandler(CustomLLM):
    """Serves `local/<name>` embeddings; litellm passes the model name without the prefix."""

    def embedding(  # litellm's base signature, plus **kwargs for arguments later versions add
        self,
        model: str,
        input: list[Any],  # litellm passes it by this name
        model_response: EmbeddingResponse,
        print_verbose: Callable[..., Any],
        logging_obj: Any,
        optional_params: dict[str, Any],
        api_key: str | None = None,
        api_base: str | None = None,
        timeout: Any = None,
        litellm_params: Any = None,
        **kwargs: Any,
    ) -> EmbeddingResponse:
        # The sync entry point runs on the caller's thread, like any blocking litellm call.
        encoder, texts = load_model(model), _as_texts(input)
        vectors, tokens = encoder.encode_counted(texts)
        return _fill(model_response, model, vectors, tokens)

    async def aembedding(
        self,
        model: str,
        input: list[Any],
        model_response: EmbeddingResponse,
        print_verbose: Callable[..., Any],
        logging_obj: Any,
        optional_params: dict[str, Any],
        api_key: str | None = None,
        api_base: str | None = None,
        timeout: Any = None,
        litellm_params: Any = None,
        **kwargs: Any,
    ) -> EmbeddingResponse:
        # litellm awaits this coroutine on the event loop itself, so the CPU work must leave it;
        # onnxruntime releases the GIL while it runs.
        encoder, texts = load_model(model), _as_texts(input)
        vectors, tokens = await asyncio.to_thread(encoder.encode_counted, texts)
        return _fill(model_response, model, vectors, tokens)


def _as_texts(input: object) -> list[str]:
    # litellm hands a bare string through unchanged (litellm.embedding(input="x")).
    texts = [input] if isinstance(input, str) else list(input)  # type: ignore[call-overload]
    if not all(isinstance(t, str) for t in texts):
        raise CustomLLMError(status_code=400, message="local embedding models take text input only")
    return texts


def _fill(response: EmbeddingResponse, model: str, vectors: np.ndarray, tokens: int) -> EmbeddingResponse:
    response.model = model
    response.object = "list"
    response.data = [
        {"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)
    ]
    response.usage = Usage(prompt_tokens=tokens, completion_tokens=0, total_tokens=tokens)
    # A stamped cost is taken as it is; otherwise litellm prices the free call again after it returns.
    response._hidden_params["response_cost"] = 0.0
    return response


_FREE_EMBEDDING = {
    "litellm_provider": PROVIDER,
    "mode": "embedding",
    "input_cost_per_token": 0.0,
    "output_cost_per_token": 0.0,
    "cache_creation_input_token_cost": 0.0,
    "cache_read_input_token_cost": 0.0,
}

_handler: LocalEmbeddingHandler | None = None
_register_lock = threading.Lock()


def register() -> None:
    """Put our handler in litellm.custom_provider_map (again, if someone replaced the map)."""
    global _handler
    with _register_lock:
        if _handler is None:
            _handler = LocalEmbeddingHandler()
            # Priced (at nothing) in litellm's cost map: an unknown model sends each call's cost lookup
            # through litellm's fallback name matching, ~0.5 ms of CPU per embedding call.
            litellm.register_model({f"{PROVIDER}/{name}": _FREE_EMBEDDING for name in MODELS})
        current = list(litellm.custom_provider_map or [])
        if any(entry.get("custom_handler") is _handler for entry in current):
            return
        # Keep other custom providers; replace only a stale "local" entry.
        others = [entry for entry in current if entry.get("provider") != PROVIDER]
        litellm.custom_provider_map = [*others, {"provider": PROVIDER, "custom_handler": _handler}]
