"""Request fields that clients send by default and that do not change the output: accepted, logged once per
field name at warning level, and otherwise ignored (as vLLM does with the fields it does not use).

A field that would change the output is never listed here: it is implemented, or refused with a 400 naming it
(protocol.OpenAIModel forbids unknown fields).
"""

from __future__ import annotations

import logging

logger = logging.getLogger("cpuinfer.server")

# field -> why ignoring it does not change the output
IGNORED_FIELDS = {
    "store": "OpenAI's stored-completions dashboard; nothing is stored here",
    "metadata": "tags for OpenAI's stored completions",
    "service_tier": "OpenAI's processing tier; this server has one",
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prompt_cache_key": "OpenAI's cache routing hint; prefix caching here needs none",
}

_logged: set[str] = set()


def log_ignored(given: set[str], route: str) -> None:
    """Log (once per field name, for the server's life) each ignored field a request set."""
    for name in sorted(given & IGNORED_FIELDS.keys() - _logged):
        _logged.add(name)
        logger.warning(
            "%s: the request field '%s' is accepted and ignored (%s); further requests setting it are not logged",
            route,
            name,
            IGNORED_FIELDS[name],
        )
