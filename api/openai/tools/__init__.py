"""Tool-call parsers: read calls out of a model's output text, whole or as it streams.

    hermes       <tool_call>{"name": ..., "arguments": ...}</tool_call>   (Qwen2-family)
    llama3_json  {"name": ..., "parameters": ...}, maybe after <|python_tag|>  (Llama 3.1/3.2)
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": ...}] or [TOOL_CALLS]name[ARGS]{...}
    pythonic     [get_weather(city="Paris"), ...]   (Llama 3.2 / Llama 4 pythonic prompts)
    generic      the JSON envelope {"tool_calls": [...]} | {"content": ...}, for templates
                 that cannot render tools (the prompt describes them; a grammar keeps the
                 reply to the envelope) and for forced calls under any parser

The server picks one per model: --tool-call-parser, or `auto` = detect_parser(template).
"""

from __future__ import annotations

from api.openai.tools.base import ParsedCall, ToolParser, ToolStreamer, new_call_id
from api.openai.tools.envelope import EnvelopeParser
from api.openai.tools.harmony import HarmonyParser
from api.openai.tools.hermes import HermesParser
from api.openai.tools.llama3_json import Llama3JsonParser
from api.openai.tools.mistral import MistralParser
from api.openai.tools.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "generic": EnvelopeParser,
    "openai": HarmonyParser,
}
PARSER_CHOICES = ("auto", *PARSERS, "none")


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own tool format needs: a template that renders `tools`
    and writes <tool_call> is Hermes-style; one with [TOOL_CALLS] is Mistral's; one with
    <|python_tag|> or Llama 3's header tokens and `tools` is Llama 3 JSON; any other
    template gets the generic mode (pythonic is never guessed: name it). None: no template
    (chat is refused anyway)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template and "tools" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template and "tools" in chat_template:
        return "mistral"
    if "<|channel|>" in chat_template and "tools" in chat_template:
        return "openai"  # gpt-oss's harmony format
    if "tools" in chat_template and (
        "<|python_tag|>" in chat_template or "<|start_header_id|>" in chat_template
    ):
        return "llama3_json"
    return "generic"


def resolve_parser(setting: str, chat_template: str | None) -> str | None:
    """--tool-call-parser -> the active parser's name; None: tool calling is off."""
    if setting == "none":
        return None
    if setting == "auto":
        return detect_parser(chat_template)
    return setting


__all__ = [
    "PARSERS",
    "PARSER_CHOICES",
    "EnvelopeParser",
    "HarmonyParser",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedCall",
    "PythonicParser",
    "ToolParser",
    "ToolStreamer",
    "detect_parser",
    "new_call_id",
    "resolve_parser",
]
