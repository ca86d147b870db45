"""Contracts: `memories asyncapi` and `memories openapi` write the documents kept in docs/, `memories nats-auth` the
bus's users and permissions kept in deploy/nats/."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs"


def asyncapi() -> dict[str, Any]:
    from shared.asyncapi import asyncapi_document

    return asyncapi_document(_version())


def openapi() -> dict[str, Any]:
    from services.api.main import create_app
    from shared.settings import Settings

    return create_app(Settings()).openapi()


def _version() -> str:
    from importlib.metadata import version

    return version("memories")


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def _command(name: str, build: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        text = render(build())
        path = Path(args.output) if args.output else DOCS / f"{name}.json"
        if args.check:
            if not path.exists() or path.read_text() != text:
                print(f"{path} is out of date: run `memories {name}`", file=sys.stderr)
                return 1
            return 0
        if args.output == "-":
            sys.stdout.write(text)
        else:
            path.write_text(text)
            print(f"wrote {path}")
        return 0

    return run


def nats_auth(args: argparse.Namespace) -> int:
    from shared.bus_permissions import DEPLOY_NATS, rendered

    # Outside a checkout (an installed package) there is no deploy/nats/ to write to: --output names a directory.
    if not args.output and not DEPLOY_NATS.is_dir():
        print("memories nats-auth: not run in a checkout (no deploy/nats/): give --output DIR", file=sys.stderr)
        return 2
    files = {Path(args.output) / path.name if args.output else path: text for path, text in rendered().items()}
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    if args.check:
        again = f"memories nats-auth --output {args.output}" if args.output else "memories nats-auth"
        for path in stale:
            print(f"{path} is out of date: run `{again}`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)  # only --output's can be missing
        path.write_text(text)
        print(f"wrote {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for name, build, what in (
        ("asyncapi", asyncapi, "the AsyncAPI document of every bus subject, from shared/events.py"),
        ("openapi", openapi, "the OpenAPI document of the REST API"),
    ):
        parser = subparsers.add_parser(name, help=f"write {what} to docs/{name}.json")
        parser.add_argument("--output", help="another path, or - for stdout")
        parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the code")
        parser.set_defaults(func=_command(name, build))
    parser = subparsers.add_parser(
        "nats-auth", help="write the bus's users and permissions (shared/bus_permissions.py) to deploy/nats/"
    )
    parser.add_argument("--output", help="another directory (deploy/nats/ exists only in a checkout)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from the code")
    parser.set_defaults(func=nats_auth)
