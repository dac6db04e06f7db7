"""`--lora-modules`: the adapters served from the start, vLLM's two spellings.

    parse_lora_module("sql=/adapters/sql")                                     # NAME=PATH
    parse_lora_module('{"name": "sql", "path": "/adapters/sql", "base_model_name": "m"}')

Plain data, no torch: Settings.validate parses them (a bad spelling is a start-up error), the
folders are checked against the model once the engine is loaded (api/lora/registry.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# What an adapter may be called: it is a `model` value, a path segment and a metrics label.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


@dataclass(slots=True, frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def check_name(name: object, field: str = "lora_name") -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(
            f"{field}: {name!r} is not a valid adapter name (1-200 characters: letters, "
            "digits and . _ : / @ + -, starting with a letter or digit)"
        )
    return name


def parse_lora_module(text: str) -> LoRAModule:
    """NAME=PATH, or a JSON object {"name", "path"[, "base_model_name"]}; ValueError names
    the field at fault."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"--lora-modules {text!r}: not a JSON object")
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(
                f"--lora-modules {text!r}: unknown field(s) {', '.join(unknown)} "
                "(name, path, base_model_name)"
            )
        name = check_name(obj.get("name"), "--lora-modules name")
        path = obj.get("path")
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {name}: base_model_name must be a string")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(
                f"--lora-modules {text!r}: expected NAME=PATH or a JSON object "
                '{"name": ..., "path": ...}'
            )
        name = check_name(name.strip(), "--lora-modules name")
        path, base = path.strip(), None
    if not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {name}: path must be a non-empty string")
    return LoRAModule(name, path, base)


def parse_lora_modules(values: list[str]) -> list[LoRAModule]:
    """Every --lora-modules value; two with one name are an error."""
    modules = [parse_lora_module(v) for v in values]
    seen: set[str] = set()
    for m in modules:
        if m.name in seen:
            raise ValueError(f"--lora-modules: the name {m.name!r} is given twice")
        seen.add(m.name)
    return modules
