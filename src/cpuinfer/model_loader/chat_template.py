"""Render a chat template the way transformers does: jinja2's sandbox, trim/lstrip blocks, raise_exception."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **kwargs,
) -> str:
    """The prompt text for messages under template (special tokens appear as text; encode it without adding BOS).
    Extra keyword arguments (`tools`, `documents`, a template's own switches) become template variables."""
    variables = {**kwargs, "bos_token": bos_token or "", "eos_token": eos_token or ""}
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
