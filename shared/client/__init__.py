"""Python client of the Memories REST API, blocking and asyncio, with typed results and typed errors.

    with MemoriesClient("http://127.0.0.1:8000", token) as memories:
        memory = memories.create_memory("Customer Preferences", project_id=project, tags=["crm"])
        written = memories.create_entry(memory.id, "Customer prefers email over phone calls")
        written.action  # WriteAction.CREATED, or SKIPPED for a known fact

It needs httpx and pydantic, the enums of shared.events and (for bulk imports) the id scheme of shared.ids;
not the server's code.
"""

from shared.client._calls import UNSET, Call, Unset
from shared.client._clients import DEFAULT_URL, AsyncMemoriesClient, MemoriesClient, api_base
from shared.client.errors import (
    Conflict,
    ConnectionFailed,
    Forbidden,
    InvalidRequest,
    MemoriesError,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    TimedOut,
    Unauthorized,
    ValidationFailed,
)
from shared.client.models import (
    AiProvider,
    ApiKey,
    ApiKeyCreated,
    ContextMessage,
    DefaultModelRoute,
    EntryHistory,
    EntryWrite,
    ExtractionStatus,
    ExtractionSummary,
    GenerationAccepted,
    HistoryRecord,
    KnowledgeContext,
    KnowledgeResult,
    Memory,
    MemoryEntry,
    ModelRoute,
    ModelRouteTarget,
    ModelUsage,
    Page,
    Project,
    ProvenanceCleared,
    ToolResult,
    WriteFailure,
    WriteStatus,
)
from shared.events import SourceType, WriteAction, WritePolicy

__all__ = [
    "DEFAULT_URL",
    "UNSET",
    "AiProvider",
    "ApiKey",
    "ApiKeyCreated",
    "AsyncMemoriesClient",
    "Call",
    "Conflict",
    "ConnectionFailed",
    "ContextMessage",
    "DefaultModelRoute",
    "EntryHistory",
    "EntryWrite",
    "ExtractionStatus",
    "ExtractionSummary",
    "Forbidden",
    "GenerationAccepted",
    "HistoryRecord",
    "InvalidRequest",
    "KnowledgeContext",
    "KnowledgeResult",
    "MemoriesClient",
    "MemoriesError",
    "Memory",
    "MemoryEntry",
    "ModelRoute",
    "ModelRouteTarget",
    "ModelUsage",
    "NotFound",
    "Page",
    "PayloadTooLarge",
    "Project",
    "ProvenanceCleared",
    "ServiceUnavailable",
    "SourceType",
    "TimedOut",
    "ToolResult",
    "Unauthorized",
    "Unset",
    "ValidationFailed",
    "WriteAction",
    "WriteFailure",
    "WritePolicy",
    "WriteStatus",
    "api_base",
]
