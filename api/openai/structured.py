"""Structured output on the wire -> StructuredOutputsParams, compiled before admission.

Three spellings, at most one per request: OpenAI's `response_format` (json_object, or
json_schema with name/schema/strict), vLLM's `structured_outputs` {json, regex, choice,
grammar, json_object}, and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. The spec is compiled (or found in the engine's cache) off the event loop
before the request is admitted, so an invalid or too costly one is a 400 naming the
parameter, in bounded time (the engine's compile timeout), and never reaches the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from api.server.errors import invalid_request
from engine.protocol import EngineClient
from engine.sampling_params import SamplingParams, StructuredOutputsParams

# The forms /v1/models lists: response_format types and vLLM's structured_outputs fields.
STRUCTURED_OUTPUT_FORMS = ["json_object", "json_schema", "regex", "choice", "grammar"]
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def supported_structured_outputs() -> list[str]:
    """What /v1/models reports under `structured_outputs`."""
    return list(STRUCTURED_OUTPUT_FORMS)


def structured_outputs_of(data: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The request's structured-output spec and the parameter it came from (for errors)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = getattr(data, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(spec)
    so = getattr(data, "structured_outputs", None)
    if so is not None:
        found.append(_structured_outputs_field(so))
    for name, form in _GUIDED.items():
        value = getattr(data, name, None)
        if value is not None:
            found.append((_params(name, **{form: value}), name))
    if len(found) > 1:
        names = ", ".join(param.split(".")[0] for _, param in found)
        raise invalid_request(
            f"Give at most one structured-output constraint; this request has {names}.",
            found[1][1].split(".")[0],
        )
    return found[0] if found else None


def _response_format(rf: Any) -> tuple[StructuredOutputsParams, str] | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if rf.type == "json_schema":
        js = rf.json_schema
        if js is None:
            raise invalid_request(
                "response_format of type json_schema needs a json_schema object "
                '({"name": ..., "schema": {...}}).',
                "response_format.json_schema",
            )
        if js.schema is None:  # OpenAI allows it: any JSON object then
            return StructuredOutputsParams(json_object=True), "response_format.json_schema"
        return StructuredOutputsParams(json=js.schema), "response_format.json_schema.schema"
    raise invalid_request(
        f"response_format.type must be text, json_object or json_schema; got {rf.type!r}.",
        "response_format.type",
    )


def _structured_outputs_field(so: Any) -> tuple[StructuredOutputsParams, str]:
    given = {
        f: getattr(so, f)
        for f in ("json", "regex", "choice", "grammar", "json_object")
        if getattr(so, f) not in (None, False)
    }
    if len(given) != 1:
        raise invalid_request(
            "structured_outputs must set exactly one of json, regex, choice, grammar and "
            f"json_object; got {', '.join(given) or 'none'}.",
            "structured_outputs",
        )
    (field,) = given
    return _params(f"structured_outputs.{field}", **given), f"structured_outputs.{field}"


def _params(param: str, **form: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**form)
    except ValueError as e:
        raise invalid_request(f"{param}: {e}", param) from None


async def with_structured_outputs(
    data: Any, params: SamplingParams, engine: EngineClient
) -> SamplingParams:
    """params with the request's structured output, compiled; unchanged without one.
    Raises a 400 naming the parameter for an invalid, too large or too slow spec."""
    found = structured_outputs_of(data)
    if found is None:
        return params
    so, param = found
    await compile_or_400(engine, so, param)
    return dataclasses.replace(params, structured_outputs=so)


async def compile_or_400(engine: EngineClient, so: StructuredOutputsParams, param: str) -> None:
    """Compile so (off the event loop, bounded by the compile timeout) or raise a 400 naming
    param. For any code that builds its own constraint (tool calling, say)."""
    try:
        await engine.compile_grammar(so)
    except ValueError as e:  # GrammarError: the message is for the user
        raise invalid_request(f"Invalid {param}: {e}", param) from None
