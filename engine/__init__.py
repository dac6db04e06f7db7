"""Tessera's engine: paged KV cache, continuous batching, Llama-family model runner.

Public API: LLM (offline), LLMEngine, AsyncEngine, EngineArgs (every option, written once),
EngineConfig, SamplingParams, StructuredOutputsParams, LoRARequest.
The engine never imports the web layer (api/, console/).
"""

from engine.args import EngineArgs
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.lora.request import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "CacheConfig",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "ModelConfig",
    "ParallelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"

# The engine classes pull in torch and transformers: import them on first use, so that
# `tessera --help` and the config types stay quick to import.
_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncEngine": "engine.async_engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
