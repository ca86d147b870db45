"""The one way to import litellm: offline model cost map, no debug banners, quiet logs."""

from __future__ import annotations

import logging
import os
from functools import cache
from types import ModuleType

from shared.lifecycle import freeze_long_lived_objects


@cache
def load_litellm() -> ModuleType:
    # Set before the first import: otherwise litellm fetches its model cost map over the network.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    # Otherwise every provider failure prints a "Give Feedback / Get Help" banner to stdout.
    litellm.suppress_debug_info = True
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Its import allocates some 350,000 objects that live as long as the process.
    freeze_long_lived_objects()
    return litellm
