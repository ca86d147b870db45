"""The one settings tree. Nothing else in the project reads the environment."""

from __future__ import annotations

import ssl
from functools import lru_cache
from pathlib import Path

from pydantic import Field, FilePath, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

WRITE_TIMEOUT_MAX_S = 20.0
"""A caller waits for its write (after up to 5 s to publish it) less than `write_records.STALE_PENDING`, after which a
retry with the same key takes the write over: a longer wait would let the retry republish while the first caller
still waits."""


class ConfiguredUnlike(RuntimeError):
    """A service configured unlike what its servers hold (the bus's partition count, the stored vectors' dimension):
    it refuses to start, saying what to change, rather than fail every write it takes."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", case_sensitive=False)

    # Servers. Unset means "start the embedded ones" (local run, tests).
    database_url: str | None = Field(default=None, description="postgresql+psycopg://… of a PostgreSQL with pgvector")
    nats_url: str | None = Field(default=None, description="nats://host:port[,nats://…] of a JetStream-enabled NATS")
    nats_user: str | None = Field(
        default=None,
        description="this process's NATS user (memories-api, memories-writer, memories-extractor, memories-admin: "
        "deploy/nats/auth.conf); unset: no authentication",
    )
    nats_password: SecretStr | None = Field(default=None, description="that user's password")
    nats_tls_ca_file: FilePath | None = Field(
        default=None,
        description="PEM certificates of the authorities that signed the NATS servers' certificates (unset: the "
        "system's); TLS is used when a server asks for it, unless NATS_TLS_HANDSHAKE_FIRST",
    )
    nats_tls_cert_file: FilePath | None = Field(
        default=None, description="this process's PEM client certificate, for servers that verify their clients"
    )
    nats_tls_key_file: FilePath | None = Field(
        default=None, validate_default=True, description="the private key of that certificate"
    )
    nats_tls_handshake_first: bool = Field(
        default=False,
        description="start TLS before the server sends anything, so that no server without TLS (nor anyone between) "
        "reads the login; the servers need `handshake_first` in their `tls` block",
    )

    @field_validator("nats_tls_ca_file")
    @classmethod
    def _an_authority_that_loads(cls, path: Path | None) -> Path | None:
        if path is not None:
            try:
                ssl.create_default_context(cafile=path)
            except ssl.SSLError as exc:
                raise ValueError(f"{path} holds no PEM certificate ssl can load ({exc.reason or exc})") from exc
        return path

    @field_validator("nats_tls_key_file")
    @classmethod
    def _a_certificate_with_its_key(cls, key: Path | None, info: ValidationInfo) -> Path | None:
        certificate = info.data.get("nats_tls_cert_file")
        if (certificate is None) != (key is None):
            raise ValueError("NATS_TLS_CERT_FILE and NATS_TLS_KEY_FILE must be set together")
        if certificate is not None:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(certificate, key)
            except ssl.SSLError as exc:
                raise ValueError(f"{certificate} and {key} are not a certificate and its key ({exc.reason or exc})") from exc
        return key

    memories_data_dir: Path = Field(default=Path(".memories"), description="where the embedded servers keep data")

    # API process.
    memories_host: str = "127.0.0.1"
    memories_port: int = Field(default=8000, ge=1, le=65535)
    memories_admin_token: str | None = Field(default=None, description="bearer token of the admin routes")
    memories_write_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=WRITE_TIMEOUT_MAX_S,
        description="wait for the writer before a 202 (at most 20 s: a claim older than 30 s is taken over by a retry)",
    )
    memories_keep_alive_s: int = Field(
        default=75,
        ge=1,
        le=3600,
        description="how long the API keeps an idle client connection open (docs/operations.md: longer than a load "
        "balancer's idle timeout)",
    )
    memories_api_key_cache_s: float = Field(
        default=10.0,
        ge=0,
        description="how long an API process may remember a live API key (revocations are broadcast; 0: read it on every request)",
    )

    # Bus layout. Changing the partition count means draining MEMORY_WRITES first (docs/operations.md).
    memories_partitions: int = Field(default=16, ge=1, le=1024)
    memories_stream_replicas: int = Field(default=1, ge=1, le=5)
    memories_duplicate_window_s: float = Field(default=120.0, gt=0)
    memories_ack_wait_s: float = Field(default=30.0, gt=0)
    memories_max_deliver: int = Field(default=5, ge=1)
    memories_retry_backoff_s: float = Field(default=1.0, gt=0, description="a failed message is redelivered after twice this, then doubling (at most 30 s); an outage's first pause")
    memories_write_batch: int = Field(
        default=32, ge=1, le=512, description="queued writes of a partition a writer decides in one transaction"
    )

    # Models. The embedding dimension is fixed by the first migration.
    embedding_model: str = "local/all-minilm-l6-v2-int8"
    embedding_dimensions: int = Field(default=384, ge=1, le=16000)

    @field_validator("embedding_dimensions")
    @classmethod
    def _the_local_models_own(cls, dimensions: int, info: ValidationInfo) -> int:
        # The first migration makes the column this wide: a wrong value for the local model broke the install for
        # good (every write failed and was dead-lettered, even once the setting was corrected).
        from shared.embeddings import LOCAL_DIMENSIONS, LOCAL_PREFIX

        model = info.data.get("embedding_model", "")
        if model.startswith(LOCAL_PREFIX) and dimensions != LOCAL_DIMENSIONS:
            raise ValueError(f"the local model {model} makes vectors of {LOCAL_DIMENSIONS} dimensions")
        return dimensions
    memories_merge_model: str | None = Field(
        default=None, description="litellm model for merges when the agent context names none"
    )
    memories_agent_model_providers: str = Field(
        default="",
        description="litellm providers (comma-separated, e.g. openai,anthropic) whose models a request may name "
        "itself (agent.model, extraction.model: provider/model, or a bare name litellm knows the provider of) with "
        "no registered AI provider behind it; always also MEMORIES_MERGE_MODEL's provider, written provider/model",
    )
    memories_llm_timeout_s: float = Field(default=30.0, gt=0)
    memories_scripted_llm: str | None = Field(
        default=None,
        description='tests and benchmarks only: JSON {"name": {"reply": "...", "latency_s": 0.2}} served as '
        "scripted/<name> by a deterministic in-process provider, never the network",
    )

    # Metrics port of the writer and extractor processes (0 = off), and the address it listens on: every
    # interface in a container, where Prometheus and the probes come from outside; `memories up` keeps it local.
    memories_metrics_port: int = Field(default=0, ge=0, le=65535)
    memories_metrics_host: str = "0.0.0.0"

    # Log lines of every process: one JSON object each, or text for a person (docs/operations.md).
    memories_log_format: str = Field(
        default="auto", pattern="^(auto|json|text)$", description="auto: text on a terminal, JSON otherwise"
    )

    # The resource verbs of the CLI (`memories create-memory`, …): which service, with which token.
    memories_url: str = Field(
        default="http://127.0.0.1:8000", description="the service the CLI talks to; unset: this machine's MEMORIES_PORT"
    )
    memories_token: str | None = Field(
        default=None,
        description="the CLI's bearer token; unset: MEMORIES_ADMIN_TOKEN, else <data dir>/admin_token when it exists",
    )

    # How many completed turns one extractor replica works on at once (its LLM calls overlap).
    memories_extractor_concurrency: int = Field(default=8, ge=1, le=256)

    @property
    def agent_model_providers(self) -> frozenset[str]:
        """The providers of `memories_agent_model_providers` (shared.providers.nameable)."""
        named = {name.strip() for name in self.memories_agent_model_providers.split(",")}
        merge_provider, slash, _ = (self.memories_merge_model or "").partition("/")
        return frozenset(name for name in (*named, merge_provider if slash else "") if name)

    @property
    def data_dir(self) -> Path:
        return self.memories_data_dir.expanduser().resolve()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def is_service_variable(name: str) -> bool:
    """Whether an environment variable is one of the service's settings (read case-insensitively), or in its
    namespace: what no AI provider may name as its key."""
    return name.upper().startswith("MEMORIES_") or name.lower() in Settings.model_fields

