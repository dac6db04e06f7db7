"""Options written once: a dataclass field that carries its help text, parser and choices.

EngineArgs (engine.args) declares the engine's options this way and the server's Settings
(api.server.settings) extends it with its own; the `tessera serve` flags and the TESSERA_*
variables are generated from the fields, and `LLM(...)` takes the same names as keywords.
No torch here: the CLI builds its parser from this before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, '1024' -> 1024 (bytes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"expected a size such as 4GiB, 512MiB, 2GB or a number of bytes; got {text!r}"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true/false (1/0, yes/no, on/off); got {text!r}")


def parse_list(text: str | list[str]) -> list[str]:
    """A repeated flag's values, or one comma-separated variable."""
    if isinstance(text, list):
        return text
    return [k.strip() for k in str(text).split(",") if k.strip()]


def optional_int(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else int(text)


def auto_int(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else optional_int(text)


def optional_float(text: str) -> float | None:
    return None if text.strip().lower() in ("", "none") else float(text)


def option(
    help: str,
    default: Any = None,
    parse: Callable[[str], Any] = str,
    *,
    choices: Sequence[str] | None = None,
    kind: str = "value",  # value | bool | list
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag and an environment variable."""
    meta = {"help": help, "parse": parse, "choices": choices, "kind": kind}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def redefault(cls: type, name: str, default: Any) -> Any:
    """The option `name` of dataclass `cls` with another default, for a subclass whose use
    wants one (the server queues at most 1,024 requests; the offline API has no queue limit):
    the help, parser and choices stay written once, in `cls`."""
    base = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field(default=default, metadata=base.metadata)


def parse_value(f: dataclasses.Field, raw: str) -> Any:
    """An option's value from a string (an environment variable), checked against its choices."""
    meta = f.metadata
    if meta["kind"] == "bool":
        return parse_bool(raw)
    if meta["kind"] == "list":
        return parse_list(raw)
    value = meta["parse"](raw)
    if meta["choices"] and value not in meta["choices"]:
        raise ValueError(f"must be one of {', '.join(meta['choices'])}; got {raw!r}")
    return value
