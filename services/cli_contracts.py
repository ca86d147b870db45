"""Contracts: `memories asyncapi` and `memories openapi` write the documents in docs/."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds this module's verbs to the `memories` parser."""
