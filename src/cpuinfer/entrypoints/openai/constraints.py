"""A request's output constraint, from whichever field set it: OpenAI's `response_format`, vLLM's
`structured_outputs` or its older `guided_*` fields, or a tool_choice that forces a call (tool_calls.py).
At most one may be given; the engine compiles it and refuses one that does not compile."""

from __future__ import annotations

from cpuinfer.entrypoints.openai.errors import APIError
from cpuinfer.entrypoints.openai.protocol import SamplingFields
from cpuinfer.sampling_params import StructuredOutputsParams


def request_constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request field it came from), or (None, None); a 400 when two fields set one."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((StructuredOutputsParams(json_object=True), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        found.append((StructuredOutputsParams(json=schema), "response_format.json_schema.schema"))
    so = req.structured_outputs
    if so is not None:
        try:
            found.append(
                (
                    StructuredOutputsParams(
                        json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object
                    ),
                    "structured_outputs",
                )
            )
        except ValueError as e:
            raise APIError(
                str(e).replace("StructuredOutputsParams", "structured_outputs"), 400, "structured_outputs"
            ) from e
    for name, field in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            try:
                found.append((StructuredOutputsParams(**{field: value}), name))
            except ValueError as e:
                raise APIError(f"{name}: {e}", 400, name) from e
    if len(found) > 1:
        names = ", ".join(f for _, f in found)
        raise APIError(f"Only one output constraint may be given; this request sets {names}.", 400, found[1][1])
    return found[0] if found else (None, None)


def engine_param(param: str | None, source: str | None) -> str | None:
    """The request field to name for an engine error about `param` (the engine says structured_outputs.<kind>)."""
    if param and source and param.startswith("structured_outputs"):
        return source if source != "structured_outputs" else param
    return param
