"""HF architecture name -> model class."""

from __future__ import annotations

from torch import nn

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.pooling import as_pooling_model
from engine.pooler_config import is_embedding_architecture

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str, runner: str = "generate") -> type[nn.Module]:
    """The class for a config's architecture; runner "pooling": its form without an LM head
    (a base-model architecture such as `Qwen3Model` takes `Qwen3ForCausalLM`'s layers)."""
    name = architecture
    if is_embedding_architecture(architecture):
        if runner != "pooling":
            raise ValueError(
                f"architecture {architecture} has no LM head, so it cannot generate: serve it "
                "with --runner pooling (runner='pooling')"
            )
        name = architecture.removesuffix("Model") + "ForCausalLM"
    try:
        cls = _MODELS[name]
    except KeyError:
        raise ValueError(
            f"model architecture {architecture or '(none)'!r} is not supported; "
            f"supported: {', '.join(supported_architectures())}"
            + (" (and their *Model forms with --runner pooling)" if runner == "pooling" else "")
        ) from None
    return as_pooling_model(cls) if runner == "pooling" else cls
