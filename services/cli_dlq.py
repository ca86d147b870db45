"""Dead letters: `memories dlq list` and `memories dlq replay`."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds this module's verbs to the `memories` parser."""
