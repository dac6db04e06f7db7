"""Tool calling, request side: `tools` / `tool_choice` / `parallel_tool_calls` -> a ToolPlan.

    plan = plan_tools(data, parser)           # 400s name the field; None: no tools asked for
    messages, kwargs = template_input(messages, plan, parser)   # what the chat template gets
    params = await constrain(params, plan, engine)   # required / named / generic: grammar
    plan.streamer()                           # reads the calls out of each choice's output

With a template that renders tools itself (hermes, llama3_json, mistral, pythonic) the tools
go to the template as `tools=` and `auto` replies are parsed in the template's own format (the
parser's hooks: its call ids, history rewritten for its template, special tokens kept). With
the generic parser (a template that knows nothing of tools, like the bundled default's) the
tools are described in a system message, history turns with calls and results become plain
text, and the reply is held to a JSON envelope by the grammar. `required` and a named function always
use the envelope, under a JSON schema built from the functions' parameter schemas, so the
arguments always parse and match.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from api.openai.structured import compile_or_400
from api.openai.tools import PARSERS, EnvelopeParser, ToolStreamer, resolve_parser
from api.server.errors import APIError, invalid_request
from engine.protocol import EngineClient
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_output.schema_refs import check_schema_refs

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CHOICES = ("none", "auto", "required")


@dataclass(slots=True)
class ToolPlan:
    choice: str  # none | auto | required | named
    parser: str  # the active parser: a name in PARSERS
    tools: list[dict[str, Any]]  # OpenAI-shaped: {"type": "function", "function": {...}}
    named: str | None = None
    parallel: bool = True
    functions: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def uses_envelope(self) -> bool:
        return self.active and (self.choice in ("required", "named") or self.parser == "generic")

    def streamer(self) -> ToolStreamer | None:
        """A fresh reader for one choice's output; None: the output is plain content."""
        if not self.active:
            return None
        parser = EnvelopeParser() if self.uses_envelope else PARSERS[self.parser]()
        # Ids in the model's own shape even for forced calls: they come back in the history.
        new_id = PARSERS[self.parser].call_id
        return ToolStreamer(parser, max_calls=None if self.parallel else 1, new_id=new_id)


def active_parser(setting: str, tokenizer: Any) -> str | None:
    """The parser this server uses for the model (--tool-call-parser, `auto`: detected from
    the chat template); None: tool calling is off."""
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
    return resolve_parser(setting, str(template) if template else None)


def plan_tools(data: Any, parser: str | None) -> ToolPlan | None:
    """Validate the request's tool fields; None when it asks for no tools."""
    choice = data.tool_choice
    if not data.tools:
        if choice is None or choice == "none":
            return None
        raise invalid_request("tool_choice is only allowed when tools are given.", "tool_choice")
    functions: dict[str, dict[str, Any]] = {}
    tools = []
    for i, tool in enumerate(data.tools):
        if tool.type != "function":
            raise invalid_request(
                f"tools[{i}].type must be 'function'; got {tool.type!r}.", f"tools[{i}].type"
            )
        fn = tool.function
        if not _NAME.match(fn.name):
            raise invalid_request(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'; "
                f"got {fn.name!r}.",
                f"tools[{i}].function.name",
            )
        if fn.name in functions:
            raise invalid_request(
                f"tools[{i}]: the function name {fn.name!r} is given twice.",
                f"tools[{i}].function.name",
            )
        spec: dict[str, Any] = {"name": fn.name}
        if fn.description is not None:
            spec["description"] = fn.description
        spec["parameters"] = fn.parameters if fn.parameters else _NO_ARGUMENTS
        functions[fn.name] = spec
        tools.append({"type": "function", "function": spec})
    named = None
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        if choice.type != "function":
            raise invalid_request("tool_choice.type must be 'function'.", "tool_choice")
        named = choice.function.name
        if named not in functions:
            raise invalid_request(
                f"tool_choice names the function {named!r}, which is not among the tools.",
                "tool_choice",
            )
        choice = "named"
    elif choice not in _CHOICES:
        raise invalid_request(
            "tool_choice must be none, auto, required or "
            f'{{"type": "function", "function": {{"name": ...}}}}; got {choice!r}.',
            "tool_choice",
        )
    if parser is None and choice != "none":
        raise invalid_request(
            "Tool calling is off on this server (--tool-call-parser none).", "tools"
        )
    parallel = True if data.parallel_tool_calls is None else data.parallel_tool_calls
    return ToolPlan(choice, parser or "generic", tools, named, parallel, functions)


_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


# --- prompt ----------------------------------------------------------------------------------


def template_input(
    messages: list[dict[str, Any]], plan: ToolPlan | None, parser: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for the chat template."""
    if parser != "generic":
        if parser is not None:
            messages = PARSERS[parser].template_messages(messages)
        if plan is not None and plan.active:
            return messages, {"tools": plan.tools}
        return messages, {}
    return _generic_messages(messages, plan), {}


def _generic_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict]:
    """History with calls and results as text, and the tools described up front."""
    envelope = plan is not None and plan.active
    names: dict[str, str] = {}  # call id -> function name, for the results
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call["function"]
                names[call.get("id") or ""] = fn["name"]
                calls.append({"name": fn["name"], "arguments": fn["arguments"]})
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls})})
        elif role == "assistant" and envelope:
            out.append({"role": "assistant", "content": json.dumps({"content": m["content"]})})
        elif role == "tool":
            call_id = m.get("tool_call_id") or ""
            name = names.get(call_id, "the tool")
            text = f"Result of {name} (call {call_id}):\n{m['content']}"
            out.append({"role": "user", "content": text})
        else:
            out.append({"role": role, "content": m["content"]})
    if not envelope:
        return out
    assert plan is not None
    system = _describe(plan)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out


def _describe(plan: ToolPlan) -> str:
    lines = ["You can call these tools (each with the JSON schema of its arguments):"]
    lines += [json.dumps(spec) for spec in plan.functions.values()]
    call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}'
    if plan.choice == "named":
        lines.append(f"Call the tool {plan.named}. Reply with this JSON object only: {call}")
    elif plan.choice == "required":
        lines.append(f"Call one or more of the tools. Reply with this JSON object only: {call}")
    else:
        lines.append(
            f"To call tools, reply with this JSON object only: {call}\n"
            'To answer without a tool, reply with this JSON object only: {"content": "<answer>"}'
        )
    return "\n".join(lines)


# --- grammar ---------------------------------------------------------------------------------


async def constrain(
    params: SamplingParams, plan: ToolPlan | None, engine: EngineClient
) -> SamplingParams:
    """params held to the envelope's JSON schema (compiled, or a 400 naming `tools`) where
    the plan needs it; special tokens kept in the text where the parser reads them (Mistral's
    [TOOL_CALLS]); unchanged otherwise."""
    if plan is None or not plan.active:
        return params
    if not plan.uses_envelope:
        if PARSERS[plan.parser].keeps_special_tokens and params.skip_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params
    if params.structured_outputs is not None:
        raise invalid_request(
            f"tool_choice {plan.choice!r} constrains the output itself; it cannot be combined "
            "with response_format or structured outputs.",
            "tool_choice",
        )
    so = StructuredOutputsParams(json=envelope_schema(plan))
    try:
        await compile_or_400(engine, so, "tools")  # cached after the first request
    except APIError:
        _check_parameters(plan)  # a $ref problem, named in the tool's own schema
        raise
    return dataclasses.replace(params, structured_outputs=so)


def _check_parameters(plan: ToolPlan) -> None:
    """A $ref cycle or a dangling $ref in a function's parameters, named in that schema's
    own pointers (the envelope moves its $defs): a 400 naming the tool. Only once the
    envelope failed to compile: the compile checks the same, cached per schema."""
    for i, (name, spec) in enumerate(plan.functions.items()):
        if plan.choice == "named" and name != plan.named:
            continue
        try:
            check_schema_refs(spec["parameters"])
        except ValueError as e:
            param = f"tools[{i}].function.parameters"
            raise invalid_request(f"Invalid {param}: {e}", param) from None


def envelope_schema(plan: ToolPlan) -> dict[str, Any]:
    """{"tool_calls": [call, ...]} (or, for auto, {"content": str}) as a JSON schema; each
    call's arguments follow its function's parameters, their $defs moved to the root."""
    defs: dict[str, dict[str, Any]] = {}
    names = [plan.named] if plan.choice == "named" else list(plan.functions)
    items = [_call_schema(plan.functions[n], defs) for n in names]
    calls: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if plan.choice == "named" or not plan.parallel:
        calls["maxItems"] = 1
    schema: dict[str, Any] = _closed({"tool_calls": calls})
    if plan.choice == "auto":
        schema = {"anyOf": [_closed({"content": {"type": "string"}}), schema]}
    for key, value in defs.items():
        schema.setdefault(key, {}).update(value)
    return schema


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def _close_objects(schema: Any) -> Any:
    """Objects that list their properties but leave additionalProperties open get it false
    (as xgrammar's strict mode does): a call's arguments then hold the schema's keys only,
    and a small model cannot ramble on with invented ones until max_tokens. An object
    schema without `properties` stays free-form."""
    if not isinstance(schema, dict):
        return schema
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                _close_objects(sub)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                _close_objects(sub)
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(schema.get(key), dict):
            _close_objects(schema[key])
    return schema


def _closed(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _call_schema(spec: dict[str, Any], defs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    parameters = _close_objects(copy.deepcopy(spec["parameters"]))
    for key in ("$defs", "definitions"):  # '#/$defs/X' refs resolve against the root
        for name, sub in (parameters.pop(key, None) or {}).items():
            known = defs.setdefault(key, {})
            if name in known and known[name] != sub:
                raise invalid_request(
                    f"Two tools define {key}/{name} differently; give them distinct names.",
                    "tools",
                )
            known[name] = sub
    return _closed({"name": {"type": "string", "enum": [spec["name"]]}, "arguments": parameters})
