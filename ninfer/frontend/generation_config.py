"""The artifact's `frontend/generation_config.json`: the model's own stop tokens."""

from __future__ import annotations

import json

GENERATION_CONFIG = "frontend/generation_config.json"


def model_stop_ids(artifact) -> frozenset[int]:
    """The generation_config's eos_token_id (an id or a list): the model's default stop tokens (none if absent)."""
    if GENERATION_CONFIG not in artifact:
        return frozenset()
    eos = json.loads(artifact.resource(GENERATION_CONFIG)).get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(e) for e in (eos if isinstance(eos, list) else [eos]))
