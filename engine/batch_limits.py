"""Default batch limits (max_num_seqs, max_num_batched_tokens) from the device and the model.

A pure function of (device type, device memory, model shape), as vLLM picks its defaults per
device class (EngineArgs.get_batch_defaults: GPUs of 70 GiB and more take 8192 batched tokens
and 1024 sequences for the API server, smaller ones 2048 and 256), then held to what this
model leaves room for on this device:

- CPU: 256 sequences, 1024 tokens a step (measured on 2 cores: smaller prefill chunks
  interleave with the decodes instead of stalling them), whatever the model.
- CUDA, under 70 GiB: 256 / 2048; 70 GiB and more (H100, H200): 1024 / 8192 (vLLM also
  keeps the 80 GB A100 in the smaller class, by its name, from a measured regression; this
  rule knows the memory only: pass the two options on an A100).
- Seats: no more sequences than the KV cache (90% of the memory less the weights) can give
  MIN_TOKENS_PER_SEQ tokens each (a power of two, at least MIN_SEQS): a model that nearly
  fills the GPU gets fewer seats than it could never fill anyway.
- Tokens: a step's activations (ACTIVATION_ROWS hidden-sized rows a token) within
  ACTIVATION_SHARE of the memory (a power of two), and never fewer than the seats (a decode
  of every seat is one step).

The engine applies it once the model's config is read (apply_to_config), to the options left
unset, and logs the result with its reasons. The rule imports no torch: the tests call it
with made-up devices and models.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GiB = 1 << 30
CPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_BATCHED_TOKENS = 1024
GPU_MAX_NUM_SEQS = 256
GPU_MAX_NUM_BATCHED_TOKENS = 2048
LARGE_GPU_MEMORY = 70 * GiB  # vLLM's line between the two GPU classes
LARGE_GPU_MAX_NUM_SEQS = 1024
LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 8192
MEMORY_FRACTION = 0.9  # the engine's default gpu_memory_utilization
MIN_TOKENS_PER_SEQ = 256  # the context a seat should hold at least (a short chat turn)
MIN_SEQS = 16
ACTIVATION_ROWS = 16  # live hidden-sized rows a token of a step (residual, norms, attention)
ACTIVATION_SHARE = 0.05


@dataclass(slots=True, frozen=True)
class ModelShape:
    """What sizing needs of a model, on one rank: its layers and hidden size, the KV bytes a
    token takes (every layer, K and V), and its weight bytes (0: estimate from the layers)."""

    num_layers: int
    hidden_size: int
    kv_bytes_per_token: int
    weight_bytes: int = 0

    def weights(self) -> int:
        """weight_bytes, or 12 h^2 parameters a layer in 16 bits where unknown."""
        return self.weight_bytes or 24 * self.num_layers * self.hidden_size**2


@dataclass(slots=True, frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    why: str  # how they were chosen, for the start-up log


def _floor_pow2(n: float) -> int:
    return 1 << max(int(n), 1).bit_length() - 1


def default_batch_limits(
    device_type: str, device_memory: int | None = None, shape: ModelShape | None = None
) -> BatchLimits:
    """The defaults for this device class and model (see the module docstring)."""
    if device_type != "cuda":
        return BatchLimits(CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS, "the CPU defaults")
    memory = device_memory or 0
    if memory >= LARGE_GPU_MEMORY:
        seqs, tokens = LARGE_GPU_MAX_NUM_SEQS, LARGE_GPU_MAX_NUM_BATCHED_TOKENS
        why = [f"a GPU of {memory / GiB:.0f} GiB (70 GiB or more)"]
    else:
        seqs, tokens = GPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS
        why = [f"a GPU of {memory / GiB:.0f} GiB (under 70 GiB)" if memory else "a GPU"]
    if shape is None or not memory:
        return BatchLimits(seqs, tokens, why[0])
    kv_room = MEMORY_FRACTION * memory - shape.weights()
    seats = kv_room / max(shape.kv_bytes_per_token * MIN_TOKENS_PER_SEQ, 1)
    if seats < seqs:
        seqs = max(MIN_SEQS, _floor_pow2(seats))
        why.append(
            f"{seqs} seats: the KV cache left beside {shape.weights() / GiB:.1f} GiB of weights "
            f"holds {max(kv_room, 0) / GiB:.1f} GiB, {MIN_TOKENS_PER_SEQ} tokens a seat"
        )
    act_tokens = ACTIVATION_SHARE * memory / (ACTIVATION_ROWS * shape.hidden_size * 2)
    if act_tokens < tokens:
        tokens = _floor_pow2(act_tokens)
        why.append(f"{tokens} tokens: a step's activations within 5% of the memory")
    if tokens < seqs:
        tokens = seqs
        why.append("tokens raised to the seats (a decode of every seat is one step)")
    return BatchLimits(seqs, tokens, "; ".join(why))


def model_shape(hf_config, dtype_bytes: int, kv_elem_bytes: int, tp: int = 1) -> ModelShape:
    """A ModelShape from an HFModelConfig (engine.models.hf_config): the weights of its
    attention, MLP or experts, and embeddings at dtype_bytes (quantized weights are counted
    unquantized: fewer seats, never too many); KV at kv_elem_bytes a value; per rank."""
    c = hf_config
    h, layers = c.hidden_size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = 2 * h * q + 2 * h * kv
    if c.num_experts:
        mlp = c.num_experts * 3 * h * c.moe_intermediate_size + h * c.num_experts
        mlp += 3 * h * c.shared_expert_intermediate_size
    else:
        mlp = 3 * h * c.intermediate_size
    embeddings = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
    params = layers * (attention + mlp) + embeddings
    kv_per_token = layers * 2 * kv * kv_elem_bytes
    return ModelShape(layers, h, kv_per_token // tp, params * dtype_bytes // tp)


def apply_to_config(config, hf_config, device) -> str:
    """Size the limits the options left unset on a GPU (config.scheduler.sized_by_engine) for
    this device's memory and this model, in place; the start-up log's words for both."""
    sched = config.scheduler
    why = "as given" if device.type == "cuda" else "the CPU defaults where not given"
    if sched.sized_by_engine and device.type == "cuda":
        import torch

        from engine.models.loader import resolve_dtype

        memory = torch.cuda.get_device_properties(device).total_memory
        dtype_bytes = resolve_dtype(config.model.dtype, hf_config, device).itemsize
        kv_bytes = 1 if config.cache.kv_cache_dtype in ("fp8", "int8") else dtype_bytes
        shape = model_shape(hf_config, dtype_bytes, kv_bytes, config.parallel.world_size)
        limits = default_batch_limits("cuda", memory, shape)
        sized = {name: getattr(limits, name) for name in sched.sized_by_engine}
        if "max_num_batched_tokens" in sized and not sched.enable_chunked_prefill:
            sized["max_num_batched_tokens"] = max(
                sized["max_num_batched_tokens"], sched.max_model_len
            )
        given = sorted({"max_num_seqs", "max_num_batched_tokens"} - set(sized))
        why = f"{', '.join(sized)} by {limits.why}" + (f"; {given[0]} as given" if given else "")
        if (
            given == ["max_num_batched_tokens"]
            and sized["max_num_seqs"] > sched.max_num_batched_tokens
        ):
            # no more seats than a step's tokens: a decode of every seat is one step
            sized["max_num_seqs"] = sched.max_num_batched_tokens
            why += ", which caps the seats"
        config.scheduler = sched = dataclasses.replace(sched, **sized)
    return (
        f"max_num_seqs {sched.max_num_seqs}, max_num_batched_tokens "
        f"{sched.max_num_batched_tokens} ({why})"
    )
