"""A flag or argument that takes a JSON object (vLLM's --speculative-config, --hf-overrides, --pooler-config): given as
JSON text on the command line or as a dict from Python, checked in one place. A shared leaf (CONTRIBUTING.md)."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: str | dict[str, Any] | None, flag: str) -> dict[str, Any] | None:
    """value as a dict (None stays None); ValueError naming `flag` when it is not JSON or not an object."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    return value
