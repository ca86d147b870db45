"""Text embeddings: every model through litellm, with an offline default model served in-process.

The default, `local/all-minilm-l6-v2-int8`, is all-MiniLM-L6-v2 (int8 ONNX, 384 dimensions) run
by onnxruntime on the CPU, registered with litellm as the custom provider "local". Remote models
(`openai/text-embedding-3-small`, …) go through the very same call.

Importing this package is cheap: litellm, onnxruntime and the tokenizer load on first use.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "LOCAL_DIMENSIONS",
    "LOCAL_MODEL",
    "LOCAL_PREFIX",
    "EmbeddingError",
    "cosine",
    "embed_texts",
    "preload",
    "register_local_provider",
]

LOCAL_MODEL = "local/all-minilm-l6-v2-int8"
LOCAL_DIMENSIONS = 384
LOCAL_PREFIX = "local/"
REMOTE_TIMEOUT_S = 30.0
"""How long a remote model may take over one call (a search's query, a batch of writes' texts) before the call
counts as failed: litellm's own default is 6,000 s, and a hung provider would hold a writer's embeddings, every
partition's, as long. The in-process model has none: its calls are CPU work that waits for nothing."""


class EmbeddingError(Exception):
    """The embedding model failed, or answered something unusable. The message names the model.

    `transient`: a remote provider that may well answer the same call later (no answer in time, a rate limit, a
    connection or server failure). A writer waits that out, as it does an outage of its database; any other failure
    (a text or a request the provider rejects, an unusable answer, the in-process model's) would recur."""

    def __init__(self, model: str, reason: str, *, transient: bool = False) -> None:
        super().__init__(f"embedding model {model!r} failed: {reason}")
        self.model = model
        self.reason = reason
        self.transient = transient


def register_local_provider() -> None:
    """Make `local/…` models callable through litellm. Idempotent and thread-safe."""
    from . import _provider  # imports litellm, with its offline cost map

    _provider.register()


def preload(model: str) -> None:
    """Import litellm and load `model` when it runs in-process: seconds of work that a first call would do on its
    caller's event loop, stalling every request of the process meanwhile. Blocking: run it in a thread. Raises
    EmbeddingError when the model cannot be loaded (each call would then fail the same way)."""
    register_local_provider()
    from ._provider import load_model

    if model.startswith(LOCAL_PREFIX):
        try:
            load_model(model).warm_up()
        except Exception as exc:
            raise EmbeddingError(model, str(exc)) from exc


async def embed_texts(
    texts: list[str], *, model: str, dimensions: int | None = None, purpose: str = "write"
) -> list[list[float]]:
    """One L2-normalised vector per text, in order, from one litellm call for the whole batch.

    `dimensions`, when given, is both asked of providers that can shorten their vectors and
    checked on every returned vector. `purpose` (a `shared.metrics.Purpose`) labels the call's metrics.
    """
    if not texts:
        return []
    register_local_provider()
    from shared import metrics  # imported on first use, like litellm: importing this package stays cheap

    from ._provider import litellm

    local = model.startswith(LOCAL_PREFIX)
    kwargs: dict[str, Any] = {}
    if dimensions is not None and not local:
        # litellm rejects `dimensions` for custom providers outright, and for remote models that
        # cannot shorten; drop_params turns that into "ignored", and the length check below decides.
        kwargs.update(dimensions=dimensions, drop_params=True)
    # An unusable answer counts as a failed call too: for the caller it is one.
    with metrics.track_embedding(model, purpose) as call:
        try:
            asked = litellm.aembedding(model=model, input=list(texts), **kwargs)
            response = await (asked if local else asyncio.wait_for(asked, REMOTE_TIMEOUT_S))
        except TimeoutError as exc:
            raise EmbeddingError(model, f"no answer within {REMOTE_TIMEOUT_S:g} s", transient=True) from exc
        except Exception as exc:  # litellm maps provider failures onto many exception types
            from shared.llm import describe_failure

            # The reason reaches tenants (a 503's message, a write's status): no traceback, no echoed key.
            reason = f"{type(exc).__name__}: {describe_failure(exc)}"
            raise EmbeddingError(model, reason, transient=not local and _may_pass(exc)) from exc
        call.record_usage(response)
        return _unit_vectors(response, model, len(texts), dimensions)


_PASSING_STATUSES = frozenset({408, 429, 502, 503, 504})
"""A timeout, a rate limit, an upstream unreachable or overloaded. Not a 500: litellm gives it also to any exception
it cannot place (a bug, an answer it cannot read), which would recur on every try and hold a writer's partition."""


def _may_pass(failure: Exception) -> bool:
    """Whether a remote provider's failure may pass on its own: a passing HTTP status, or, whatever litellm called
    it, a failure of the network under it (a connection refused or dropped, a timeout)."""
    import httpx

    if getattr(failure, "status_code", None) in _PASSING_STATUSES:
        return True
    cause: BaseException | None = failure
    while cause is not None:
        if isinstance(cause, OSError | TimeoutError | httpx.TransportError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _unit_vectors(response: Any, model: str, expected: int, dimensions: int | None) -> list[list[float]]:
    data = list(getattr(response, "data", None) or [])
    if len(data) != expected:
        raise EmbeddingError(model, f"{len(data)} vectors returned for {expected} texts")

    def field(item: Any, name: str) -> Any:
        # Providers hand back plain dicts or openai `Embedding` objects.
        return item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)

    if all(isinstance(field(item, "index"), int) for item in data):
        data.sort(key=lambda item: field(item, "index"))
    raw = [field(item, "embedding") for item in data]
    if not all(isinstance(v, Sequence) and not isinstance(v, str) for v in raw):
        raise EmbeddingError(model, "a returned embedding is not a list of floats")
    lengths = {len(v) for v in raw}
    if dimensions is not None and lengths != {dimensions}:
        raise EmbeddingError(model, f"vectors of length {sorted(lengths)} returned, {dimensions} expected")
    if len(lengths) != 1:
        raise EmbeddingError(model, f"vectors of differing lengths {sorted(lengths)} returned")
    matrix = np.asarray(raw, dtype=np.float64)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    # A zero or non-finite vector has no direction, so no cosine can be computed against it.
    if not np.all(np.isfinite(norms)) or np.any(norms == 0.0):
        raise EmbeddingError(model, "a returned vector is zero or not finite")
    unit: list[list[float]] = (matrix / norms).tolist()
    return unit


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity; 0.0 when either vector is zero (no direction, so no similarity)."""
    if len(a) != len(b):
        raise ValueError(f"cosine of vectors of lengths {len(a)} and {len(b)}")
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0
