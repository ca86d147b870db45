"""Who may do what on a deployed bus: one NATS user per service, allowed the subjects its code uses and no others.

- Each user's replies come on inboxes of its own (`bus_connection.inbox_prefix`), which no other user may read: the
  messages a consumer pulls, JetStream's answers, a write's outcome.
- A service may read and create the streams (every service applies the layout as it starts) but not change them,
  and lay out, pull from and acknowledge only the consumers it consumes (their owner in `bus.layout`). Deleting, purging or
  updating a stream, deleting a stored message: that is the admin user's (`memories bus …`, `memories dlq …`, the
  init Job), which applies a changed layout before the services of a new version start.

A leaked service password can still do what that service does: publish what it publishes, read and acknowledge what
it consumes (a writer's: the queued writes, which acknowledging removes). It cannot read a stream another service
consumes, delete, purge or shrink a stream, delete a stored message, or read another user's replies.

The subjects come from `shared.bus`, so a renamed subject changes the permissions with it: `memories nats-auth`
renders them for the nats-server configuration of deploy/ (compose and the Helm chart), and a test runs every
service under them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared import bus, bus_connection
from shared.settings import Settings

DEPLOY_NATS = Path(__file__).resolve().parents[1] / "deploy" / "nats"
SERVER_CONFIG = DEPLOY_NATS / "auth.conf"
HELM_VALUES = DEPLOY_NATS / "helm-auth-values.yaml"
HELM_SECRET = "memories-nats-users"
"""The Secret in the NATS release's namespace holding each user's password under the user's role (api, writer…)."""

_STREAMS = (bus.WRITES_STREAM, bus.EVENTS_STREAM, bus.GENERATIONS_STREAM, bus.DEAD_LETTER_STREAM)
_APPLIES_THE_LAYOUT = [
    # Streams read and created, not updated: a service checks that they are as its version lays them out.
    *(f"$JS.API.STREAM.{verb}.{stream}" for stream in _STREAMS for verb in ("INFO", "CREATE")),
    # Any consumer's state (the lag metrics, the partition count a bus was laid out for); nothing of its messages.
    "$JS.API.CONSUMER.INFO.*.*",
    "$JS.API.CONSUMER.LIST.*",
    "$JS.API.CONSUMER.NAMES.*",
]


def _consumes(stream: str, durable: str) -> list[str]:
    """A durable consumer of the service's own (`*`: every one of the stream): laid out (created, or recreated when
    a setting cannot change in place), pulled from, a writer partition's pin given up, and what it delivers
    acknowledged, handed back and extended. No other service may do any of it."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.API.CONSUMER.UNPIN.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _consumers_of(role: bus.Role) -> list[str]:
    """What `role` may do with the consumers it consumes (their owner in `bus.layout`), every writer partition's as
    one."""
    plan = bus.layout(Settings.model_construct(memories_partitions=1))  # the durables' names, not the environment
    owned = {
        (consumer.stream, "*" if consumer.stream == bus.WRITES_STREAM else consumer.durable)
        for consumer in plan.consumers_of(role)
    }
    return [subject for stream, durable in sorted(owned) for subject in _consumes(stream, durable)]


def user_name(role: str) -> str:
    """The NATS user a service of this role logs in as (NATS_USER)."""
    return f"memories-{role}"


def inboxes_of(role: str) -> str:
    """The subjects a role's replies come on, only its own user's to read."""
    return f"{bus_connection.inbox_prefix(user_name(role))}.>"


@dataclass(frozen=True)
class BusUser:
    role: str
    publishes: list[str] | None
    """None: every subject (the admin)."""
    subscribes: list[str] = field(default_factory=list)

    @property
    def user(self) -> str:
        return user_name(self.role)

    @property
    def inboxes(self) -> str:
        return inboxes_of(self.role)

    @property
    def password_variable(self) -> str:
        """The environment variable of the NATS server that holds this user's password."""
        return f"MEMORIES_NATS_{self.role.upper()}_PASSWORD"

    def permissions(self) -> dict[str, Any] | None:
        if self.publishes is None:
            return None
        return {"publish": {"allow": self.publishes}, "subscribe": {"allow": [self.inboxes, *self.subscribes]}}


_TURNS = [f"{bus.GENERATION_COMPLETED_ROOT}.*", f"{bus.GENERATION_DELETED_ROOT}.*", f"{bus.CONVERSATION_DELETED_ROOT}.*"]

USERS = (
    BusUser(
        "api",
        publishes=[
            *_APPLIES_THE_LAYOUT,
            f"{bus.WRITE_SUBJECT_ROOT}.>",
            f"{bus.GENERATION_COMPLETED_ROOT}.*",
            f"{bus.EVENT_SUBJECT_ROOT}.>",
            bus.API_KEY_REVOKED_SUBJECT,
            inboxes_of("api"),  # answering another API process's revocation broadcast
        ],
        subscribes=[bus.API_KEY_REVOKED_SUBJECT],
    ),
    BusUser(
        "writer",
        publishes=[
            *_APPLIES_THE_LAYOUT,
            *_consumers_of(bus.Role.WRITER),
            f"{bus.EVENT_SUBJECT_ROOT}.>",
            f"{bus.DEAD_LETTER_ROOT}.writer",
            inboxes_of("api"),  # a write's outcome, to the process that published it
            inboxes_of("extractor"),
        ],
    ),
    BusUser(
        "extractor",
        publishes=[
            *_APPLIES_THE_LAYOUT,
            *_consumers_of(bus.Role.EXTRACTOR),
            f"{bus.WRITE_SUBJECT_ROOT}.>",
            f"{bus.EXTRACTION_COMPLETED_ROOT}.*",
            f"{bus.DEAD_LETTER_ROOT}.extractor",
        ],
    ),
    # An agent platform that reports its turns on the bus rather than through the API (docs/api.md), and may follow
    # their extractions (`generations.extraction.<project>`, live). Its client must take its replies (each publish's
    # acknowledgement) on its own inboxes: inbox prefix `_INBOX.memories-platform`. It may report turns of any
    # project: give a platform that serves one project a user of its own, its subjects ending in that project's id.
    BusUser("platform", publishes=_TURNS, subscribes=[f"{bus.EXTRACTION_COMPLETED_ROOT}.*"]),
    # `memories bus init|status|reroute|prune|release`, `memories dlq …`, the init Job.
    BusUser("admin", publishes=None),
)


def _entry(user: BusUser) -> dict[str, Any]:
    entry: dict[str, Any] = {"user": user.user, "password": f"${user.password_variable}"}
    if (permissions := user.permissions()) is not None:
        entry["permissions"] = permissions
    return entry


_HEADER = "Generated by `memories nats-auth` from shared/bus_permissions.py: change that, then run it again."


def server_config() -> str:
    """The `authorization` block for nats-server.conf (`include auth.conf`). Each password is an environment
    variable of the server: it fails to start when one is unset, rather than admit a user without one."""
    lines = [f"# {_HEADER}", "authorization {", "  users: ["]
    for user in USERS:
        entry = _entry(user)
        lines.append("    {")
        lines.append(f"      user: {json.dumps(entry['user'])}")
        lines.append(f"      password: {entry['password']}")  # unquoted: a variable reference
        if "permissions" in entry:
            permissions = json.dumps(entry["permissions"], indent=2).replace("\n", "\n      ")
            lines.append(f"      permissions: {permissions}")
        lines.append("    }")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def helm_values() -> str:
    """Values for the NATS Helm chart (1.x): the same users, merged into its configuration, the passwords read from
    the Secret HELM_SECRET into the server's environment (`<< $VAR >>` is the chart's unquoted reference)."""
    users = []
    for user in USERS:
        entry = _entry(user)
        entry["password"] = f"<< {entry['password']} >>"
        users.append(entry)
    env = {
        user.password_variable: {"valueFrom": {"secretKeyRef": {"name": HELM_SECRET, "key": user.role}}}
        for user in USERS
    }
    values = {"config": {"merge": {"authorization": {"users": users}}}, "container": {"env": env}}
    header = (
        f"# {_HEADER}\n"
        "# Use it with deploy/nats/helm-values.yaml: helm install nats nats/nats -f helm-values.yaml -f helm-auth-values.yaml\n"
        f"# after creating the Secret {HELM_SECRET} in the release's namespace (docs/operations.md, \"The bus's users\").\n"
    )
    return header + json.dumps(values, indent=2) + "\n"  # JSON is YAML, and keeps the `<< … >>` strings quoted


def rendered() -> dict[Path, str]:
    return {SERVER_CONFIG: server_config(), HELM_VALUES: helm_values()}
