"""EngineConfig and its parts: validated dataclasses, no file or network I/O.

Each part raises ValueError with a message that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.attention.backends import ATTENTION_BACKEND_CHOICES
from engine.attention.kv_spec import KV_CACHE_DTYPE_CHOICES
from engine.core.request_queue import POLICIES
from engine.layers.quantization import QUANTIZATION_CHOICES
from engine.pooling_params import RUNNER_CHOICES, PoolerConfig
from engine.reasoning import REASONING_PARSER_CHOICES
from engine.spec_decode.config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"  # resolved by engine.gguf.source to the bundled GGUF
# Which steps replay CUDA graphs (engine.worker.cuda_graph): vLLM's cudagraph_mode values
CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
# bitsandbytes: vLLM's name for its bitsandbytes loader, taken as safetensors with
# quantization bitsandbytes (ModelConfig)
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "gguf", "dummy", "bitsandbytes")
# --kv-cache-dtype's values: KV_CACHE_DTYPE_CHOICES, the KV cache specs' registry
# (engine.attention.kv_spec), imported above; CacheConfig.kv_cache_dtype says what each stores.


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # Exactly this many blocks (tests, benchmarks); otherwise sized from kv_cache_memory.
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; None = a share of free RAM (CPU)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # auto: the model's dtype; int8: int8 values with a float32 scale per token and head
    # (engine.attention.kv_int8): half the bytes, so twice the tokens and less to read; fp8:
    # float8 e4m3 with per-tensor scales (engine.attention.kv_fp8), the triton backend's.
    # The choices are the KV cache specs' registry (engine.attention.kv_spec).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        bs = self.block_size
        _check(
            isinstance(bs, int) and 8 <= bs <= 128 and bs & (bs - 1) == 0,
            f"block_size must be a power of two between 8 and 128, got {bs}",
        )
        if self.num_blocks is not None:
            _check(
                self.num_blocks >= 2,
                f"num_blocks must be at least 2 (block 0 is reserved), got {self.num_blocks}",
            )
        if self.kv_cache_memory is not None:
            _check(
                self.kv_cache_memory > 0,
                f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}",
            )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPE_CHOICES,
            f"kv_cache_dtype must be {', '.join(KV_CACHE_DTYPE_CHOICES[:-1])} or "
            f"{KV_CACHE_DTYPE_CHOICES[-1]}, got {self.kv_cache_dtype!r}",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # or "priority", or "fair" (engine.core.request_queue)
    enable_chunked_prefill: bool = True
    block_size: int = 16
    # Schedule step t+1 while step t computes (engine.async_scheduling): None = auto, on for
    # CUDA with one rank; the engine replaces it with the resolved value (vLLM's name).
    async_scheduling: bool | None = None
    # LoRA: the most distinct adapters one step may mix (None: LoRA off); requests of other
    # adapters wait for a slot while the rest run.
    max_loras: int | None = None
    # Speculative decoding (engine.spec_decode): None = off. The scheduler proposes the
    # drafts; the engine turns async scheduling off while it is on.
    speculative_config: SpeculativeConfig | None = None
    # The batch limits left unset on a GPU: the engine sizes them from the device's memory and
    # the model once its config is read (engine.batch_limits).
    sized_by_engine: tuple[str, ...] = ()
    # A request's output goes out once every stream_interval new tokens (and with its first
    # token and when it finishes): fewer, larger stream chunks (vLLM's --stream-interval).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        _check(
            self.stream_interval >= 1,
            f"stream_interval must be at least 1, got {self.stream_interval}",
        )
        _check(
            self.max_model_len >= 1, f"max_model_len must be at least 1, got {self.max_model_len}"
        )
        _check(
            self.max_num_batched_tokens >= self.block_size,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must cover at least one block "
            f"({self.block_size} tokens)",
        )
        if not self.enable_chunked_prefill:
            _check(
                self.max_num_batched_tokens >= self.max_model_len,
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len})",
            )
        _check(
            self.policy in POLICIES,
            f"policy must be {', '.join(map(repr, POLICIES[:-1]))} or {POLICIES[-1]!r}, "
            f"got {self.policy!r}",
        )


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Pipeline stages (engine.models.pipeline): contiguous layers each, tp ranks per stage.
    pipeline_parallel_size: int = 1
    # MoE layers: whole experts per tensor-parallel rank (engine.layers.moe), not slices
    enable_expert_parallel: bool = False
    # Where ranks beyond one run: mp (worker processes, engine.worker.multiproc) | ray
    # (one Ray actor per rank, engine.worker.ray_executor).
    distributed_executor_backend: str = "mp"
    # CPU threads that small steps leave to a serving front end (engine.worker.step_threads);
    # None: measured per band of step sizes (all threads or all but one, whichever is faster).
    frontend_threads: int | None = 0
    # How long a rank waits for its peers in a collective (and the driver for a worker's
    # reply) before the tensor-parallel group is declared dead (engine.worker.multiproc).
    collective_timeout_s: float = 300.0

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size per stage, pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        _check(
            self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}",
        )
        _check(
            self.distributed_executor_backend in DISTRIBUTED_EXECUTOR_BACKENDS,
            "distributed_executor_backend must be mp or ray, got "
            f"{self.distributed_executor_backend!r}",
        )
        _check(
            self.pipeline_parallel_size >= 1,
            f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}",
        )
        _check(
            self.collective_timeout_s > 0,
            f"collective_timeout_s must be positive seconds, got {self.collective_timeout_s}",
        )
        _check(
            self.frontend_threads is None or self.frontend_threads >= 0,
            f"frontend_threads must be at least 0 (or None: measured), got {self.frontend_threads}",
        )


@dataclass(slots=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the model's own context length
    load_format: str = "auto"  # auto | safetensors | gguf | dummy (| bitsandbytes: vLLM's)
    # None (unset: gguf for a .gguf model on the CPU, else none) | none (float weights: a
    # .gguf model dequantized) | int8 (weight-only) | w8a8 | w4a8 | gguf (a GGUF file's own
    # quantization) (CPU); engine.layers.quantization.resolve_method decides an unset one
    quantization: str | None = None
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # auto: triton on CUDA where it imports, the C kernels on the CPU where they run, else
    # torch (engine.attention.backends)
    attention_backend: str = "auto"
    # No CUDA graphs: every step eager (engine.worker.cuda_graph); vLLM's name.
    enforce_eager: bool = False
    # full_and_piecewise: decode (and verification) steps as whole graphs, mixed and prefill
    # steps as piecewise ones; full_decode_only: those eager
    cudagraph_mode: str = "full_and_piecewise"
    # A reasoning model's think-section format (engine.reasoning): grammars wait for its end.
    reasoning_parser: str | None = None
    # Sampling defaults: auto (the model's generation_config.json) | vllm (none) | a folder.
    generation_config: str = "auto"
    # A chat template replacing the tokenizer's: a file's path or the template itself.
    chat_template: str | None = None
    # generate | pooling | auto (engine.pooler_config.resolve_runner); the engine replaces
    # auto with the resolved one, and sets `pooler` (how a pooling model pools) from the folder.
    runner: str = "auto"
    pooler: PoolerConfig | None = None

    def __post_init__(self) -> None:
        _check(
            self.runner in RUNNER_CHOICES,
            f"runner must be one of {', '.join(RUNNER_CHOICES)}; got {self.runner!r}",
        )
        _check(
            self.dtype in DTYPE_CHOICES,
            f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}",
        )
        _check(
            self.load_format in LOAD_FORMAT_CHOICES,
            f"load_format must be one of {', '.join(LOAD_FORMAT_CHOICES)}; "
            f"got {self.load_format!r}",
        )
        if self.load_format == "bitsandbytes":  # vLLM's spelling of a bitsandbytes model
            _check(
                self.quantization in (None, "bitsandbytes"),
                "load_format bitsandbytes loads a bitsandbytes model: quantization must be "
                f"bitsandbytes or unset; got {self.quantization!r}",
            )
            self.load_format, self.quantization = "safetensors", "bitsandbytes"
        _check(
            self.quantization in (None, *QUANTIZATION_CHOICES),
            f"quantization must be {', '.join(QUANTIZATION_CHOICES)} or unset; "
            f"got {self.quantization!r}",
        )
        _check(
            self.device in ("auto", "cpu", "cuda"),
            f"device must be auto, cpu or cuda; got {self.device!r}",
        )
        _check(
            self.attention_backend in ATTENTION_BACKEND_CHOICES,
            f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}; "
            f"got {self.attention_backend!r}",
        )
        _check(
            self.cudagraph_mode in CUDAGRAPH_MODES,
            f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}; "
            f"got {self.cudagraph_mode!r}",
        )
        _check(
            self.reasoning_parser in (None, *REASONING_PARSER_CHOICES),
            f"reasoning_parser must be {', '.join(REASONING_PARSER_CHOICES)} or unset; "
            f"got {self.reasoning_parser!r}",
        )
        if self.max_model_len is not None:
            _check(
                self.max_model_len >= 1,
                f"max_model_len must be at least 1, got {self.max_model_len}",
            )


MAX_LORA_RANK_LIMIT = 512


@dataclass(slots=True)
class LoRAConfig:
    """Multi-LoRA serving (engine.lora), when enabled: max_loras adapters resident at once
    (the most one step mixes), max_lora_rank the largest rank an adapter may have (the slots'
    width), and max_cpu_loras loaded adapters kept in host memory (an LRU), resident ones
    included."""

    enabled: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        _check(self.max_loras >= 1, f"max_loras must be at least 1, got {self.max_loras}")
        _check(
            1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT,
            f"max_lora_rank must be between 1 and {MAX_LORA_RANK_LIMIT}, got {self.max_lora_rank}",
        )
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _check(
            self.max_cpu_loras >= self.max_loras,
            f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})",
        )


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Served name for the API; defaults to the model argument.
    served_model_name: str | None = None
    # Longest waiting queue before add_request refuses (None: unbounded).
    max_num_queued_requests: int | None = None
    # Multi-LoRA serving; off by default (a request naming an adapter is refused).
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        _check(
            self.scheduler.block_size == self.cache.block_size,
            "scheduler.block_size must equal cache.block_size",
        )
        if self.lora.enabled:
            self.scheduler.max_loras = self.lora.max_loras
        _check(
            self.max_num_queued_requests is None or self.max_num_queued_requests >= 0,
            f"max_num_queued_requests must be >= 0, got {self.max_num_queued_requests}",
        )
        spec = self.scheduler.speculative_config
        _check(
            spec is None or self.parallel.pipeline_parallel_size == 1 or spec.method == "ngram",
            "speculative_config with pipeline_parallel_size > 1 takes the ngram method only (a "
            "draft model or EAGLE head runs beside the first stage, which does not learn a "
            "step's tokens before the next step); use ngram or drop one of them",
        )
        draft_tp = spec.draft_tensor_parallel_size if spec is not None else None
        tp = self.parallel.tensor_parallel_size
        _check(
            draft_tp in (None, 1) or (draft_tp == tp and spec.method == "draft_model"),
            f"speculative_config: draft_tensor_parallel_size {draft_tp} must be 1 (the draft "
            f"whole on the driver) or, for a draft model, tensor_parallel_size ({tp}: split "
            "over the ranks like the target); EAGLE heads run whole",
        )
        if self.cache.kv_cache_dtype == "fp8":
            backend, device = self.model.attention_backend, self.model.device
            _check(
                backend in ("auto", "triton") and device != "cpu",
                "kv_cache_dtype fp8 needs the triton attention backend on a CUDA device; got "
                f"attention_backend {backend!r} on device {device!r} (use int8 on the CPU)",
            )
