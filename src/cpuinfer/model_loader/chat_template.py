"""Render a chat template the way transformers does: jinja2's sandbox, trim/lstrip blocks, raise_exception.

The sandbox also bounds what a template can make: a `*` or `**` whose result would be longer than the output
limit is refused before it is computed, and rendering stops once the output passes the limit (`max_output_chars`).
Time is bounded by the caller (the server renders request templates in a worker process it can stop).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

DEFAULT_MAX_OUTPUT_CHARS = 16 * 1024 * 1024


class TemplateOutputTooLarge(ValueError):
    """A chat template made (or was about to make) more text than the limit allows."""


def _size(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 0


@lru_cache(maxsize=8)
def _compile(template: str, max_output_chars: int):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                count = right if isinstance(right, int) else left if isinstance(left, int) else 1
                if max(_size(left), _size(right)) * max(count, 0) > max_output_chars:
                    raise TemplateOutputTooLarge(f"the template repeats a value past {max_output_chars} characters")
            elif operator == "**" and isinstance(right, int) and abs(right) > 1024:
                raise TemplateOutputTooLarge(f"the template raises a number to the power {right}")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    **kwargs,
) -> str:
    """The prompt text for messages under template (special tokens appear as text; encode it without adding BOS).
    Extra keyword arguments (`tools`, `documents`, a template's own switches) become template variables.
    Raises TemplateOutputTooLarge once the text would pass `max_output_chars`."""
    variables = {**kwargs, "bos_token": bos_token or "", "eos_token": eos_token or ""}
    compiled = _compile(template, max_output_chars)
    pieces: list[str] = []
    size = 0
    for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
        size += len(piece)
        if size > max_output_chars:
            raise TemplateOutputTooLarge(f"the template's output passed {max_output_chars} characters")
        pieces.append(piece)
    return "".join(pieces)
