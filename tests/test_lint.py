"""ruff stays clean on the project's code (the house style asks for it; CI checks it here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "shared", "services", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
