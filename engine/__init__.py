"""Tessera's engine: paged KV cache, continuous batching, Llama-family model runner.

Public API: LLM (offline), LLMEngine, AsyncEngine, EngineConfig, SamplingParams.
The engine never imports the web layer (api/, console/).
"""

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
__version__ = "0.1.0"
