"""EngineArgs: every engine option, written once with its default, parser, choices and help.

`LLM(model, **options)` takes these names as keywords; `tessera serve` extends the dataclass
with the server's own options (api.server.settings.Settings) and generates a `--flag` and a
TESSERA_* variable from every field; `create_engine_config` is the one place they are
mapped onto EngineConfig's validated parts. A new engine option is one field here (plus the
config part that uses it). Flag names follow vLLM's so its users need not relearn them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.attention.backends import ATTENTION_BACKEND_CHOICES
from engine.attention.kv_spec import KV_CACHE_DTYPE_CHOICES
from engine.batch_limits import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    LARGE_GPU_MAX_NUM_BATCHED_TOKENS,
    LARGE_GPU_MAX_NUM_SEQS,
    default_batch_limits,
)
from engine.config import (
    CUDAGRAPH_MODES,
    DEFAULT_MODEL,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPE_CHOICES,
    LOAD_FORMAT_CHOICES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.core.request_queue import POLICIES
from engine.layers.quantization import QUANTIZATION_CHOICES
from engine.options import (
    auto_int,
    option,
    optional_int,
    parse_bool,
    parse_bytes,
)
from engine.pooling_params import RUNNER_CHOICES
from engine.reasoning import REASONING_PARSER_CHOICES
from engine.spec_decode.config import parse_speculative_config

# CPU: measured on 2 Zen 5 cores (tessera bench compare, 128-token prompts and outputs): 1024
# against 2048 gave TTFT p50 0.7 vs 1.3 s at 32 streams and 1.2 vs 1.5 s at 128, throughput
# the same or 1-4% better (smaller prefill chunks interleave with the decodes instead of
# stalling them). GPUs: by memory class and model (engine.batch_limits), once the model's
# config is read; until then the smaller GPU class's.


def resolve_device_type(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_max_num_batched_tokens(device: str) -> int:
    """The default before the model is known (the smaller GPU class on CUDA)."""
    return default_batch_limits(resolve_device_type(device)).max_num_batched_tokens


@dataclass(slots=True, kw_only=True)
class EngineArgs:
    # --- model ---
    model: str = option(
        "Model: a local Hugging Face folder, a .gguf file, or the bundled default.", DEFAULT_MODEL
    )
    served_model_name: str | None = option(
        "Name clients use in the `model` field (default: the model argument)."
    )
    tokenizer: str | None = option("Tokenizer folder (default: the model folder).")
    dtype: str = option("Weight and activation dtype.", "auto", choices=DTYPE_CHOICES)
    load_format: str = option(
        "How to load weights (dummy = random weights of the model's shape).",
        "auto",
        choices=LOAD_FORMAT_CHOICES,
    )
    quantization: str | None = option(
        "Weight quantization: none = float weights (a .gguf model dequantized to --dtype); "
        "int8 = weight-only int8 with a scale per row (CPU; half the bytes of bf16 per decode "
        "step, at some accuracy cost); w8a8 = the same weights and int8 activations from 13 "
        "rows (the CPU's int8 dot products: more throughput under load, at about the accuracy "
        "of a 4-bit GGUF); w4a8 = w8a8 plus 4-bit weight groups for steps of 1-12 rows (CPUs "
        "with AVX512-VNNI, bfloat16: the fastest single stream); gguf = a .gguf model's linear "
        "weights in the file's own quantization (Q4_0/Q4_1 as the 4-bit kernel's tiles, bit for "
        "bit; Q8_0, Q4_K, Q5_K, Q6_K as the file's blocks; other types stay dequantized); "
        "gptq, awq, compressed-tensors, fp8, bitsandbytes = a quantized checkpoint's own format, read from its "
        "config.json quantization_config with no flag (naming another method is a start-up "
        "error); fp8 on a float checkpoint quantizes its weights to FP8 at load (one byte a "
        "weight: on the CPU half the memory, a single stream's decode ~1.5x faster); bitsandbytes = "
        "a bitsandbytes checkpoint (NF4 / FP4 / LLM.int8, picked with no flag), or NF4 at load "
        "on a float checkpoint. Default: the "
        "checkpoint's quantization_config, else gguf for a .gguf model (the default model too) "
        "on the CPU, else none.",
        None,
        choices=QUANTIZATION_CHOICES,
    )
    device: str = option("Device.", "auto", choices=("auto", "cpu", "cuda"))
    runner: str = option(
        "What the model serves: generate = text (chat, completions); pooling = embeddings "
        "(/v1/embeddings, LLM.embed): the prompt's final hidden states pooled as the model's "
        "sentence-transformers modules say (last token, mean or CLS; normalized or not), else "
        "last token + L2 normalize. auto = pooling for an embedding model (a `*Model` "
        "architecture without an LM head such as Qwen3Model, or a folder with modules.json), "
        "else generate.",
        "auto",
        choices=RUNNER_CHOICES,
    )
    attention_backend: str = option(
        "Attention backend: auto = triton on CUDA where it imports, the C kernels on the CPU "
        "where they run, else torch; torch = dense gather + SDPA (the reference, any device); "
        "cpu = the C kernels; triton = the Triton paged-attention kernels (CUDA, the gpu extra).",
        "auto",
        choices=ATTENTION_BACKEND_CHOICES,
    )
    enforce_eager: bool = option(
        "Run every step eagerly: no CUDA graphs (CUDA only).",
        False,
        parse_bool,
        kind="bool",
    )
    cudagraph_mode: str = option(
        "Which steps replay CUDA graphs (CUDA only): full_and_piecewise = decode and "
        "verification steps as whole graphs, mixed and prefill steps of up to 512 tokens "
        "(and --max-num-batched-tokens) as piecewise graphs, attention run eagerly between "
        "the pieces (vLLM's default); full_decode_only = mixed and prefill steps eager (less "
        "capture time and graph memory).",
        "full_and_piecewise",
        choices=CUDAGRAPH_MODES,
    )
    seed: int = option("Seed for weights (dummy) and for unseeded sampling.", 0, int)
    reasoning_parser: str | None = option(
        "A reasoning model's think-section format: qwen3 or deepseek_r1 (`<think>` ... "
        "`</think>`). Chat replies then carry the thinking as `reasoning_content` and the "
        "answer as `content` (streamed as such too); a grammar (response_format, a forced "
        "tool call) applies after the thinking where the chat template opened it for the "
        "model, and from the first token otherwise. Default: none (the think section stays "
        "in `content`).",
        None,
        choices=REASONING_PARSER_CHOICES,
    )
    max_model_len: int | None = option(
        "Context length: prompt + output tokens (default: the model's).", None, optional_int
    )
    generation_config: str = option(
        "Sampling defaults for what a request leaves unset (temperature, top_p, top_k, "
        "min_p, repetition_penalty, and max_new_tokens as max_tokens): auto = the model "
        "folder's generation_config.json (logged at start; none where it has none), vllm = "
        "none (temperature 1, no top-p/k), or a folder holding a generation_config.json.",
        "auto",
    )
    chat_template: str | None = option(
        "A chat template to use instead of the tokenizer's: a file's path, or the Jinja "
        "template itself (default: the tokenizer's).",
    )
    # --- scheduler ---
    max_num_seqs: int | None = option(
        f"Most sequences in one batch (default: {CPU_MAX_NUM_SEQS} on CPU; on a GPU by its "
        f"memory and the model, up to {LARGE_GPU_MAX_NUM_SEQS}: see the README; logged at "
        "start).",
        None,
        optional_int,
    )
    max_num_batched_tokens: int | None = option(
        f"Token budget of one engine step (default: {CPU_MAX_NUM_BATCHED_TOKENS} on CPU; on a "
        f"GPU by its memory and the model, up to {LARGE_GPU_MAX_NUM_BATCHED_TOKENS}: see the "
        "README; logged at start).",
        None,
        optional_int,
    )
    stream_interval: int = option(
        "A streamed request gets its output with its first token, then once every N new "
        "tokens, and when it finishes (vLLM's --stream-interval): fewer, larger chunks cost "
        "the server's event loop and the engine's output processing less per token, at the "
        "price of chunkier streaming. 1: every token.",
        1,
        int,
    )
    max_num_queued_requests: int | None = option(
        "Longest waiting queue; beyond it requests are refused (the server answers 503 with "
        "Retry-After). none: unbounded.",
        None,
        optional_int,
    )
    scheduling_policy: str | None = option(
        "fcfs: first come, first served; priority: lower priority (the key's, or a request's "
        "`priority` no better than it) runs first; fair: each tenant (a team of keys) "
        "gets its weighted share of tokens (VTC), priority classes still on top. Default: "
        "fair when requests carry API keys (--auth keys or static), else fcfs.",
        None,
        choices=POLICIES,
    )
    enable_chunked_prefill: bool = option(
        "Split long prompts over steps so decodes keep running beside them.",
        True,
        parse_bool,
        kind="bool",
    )
    async_scheduling: bool | None = option(
        "Schedule the next step while the device computes this one (vLLM's async "
        "scheduling): default on for CUDA with one rank, off on the CPU.",
        None,
        parse_bool,
        kind="bool",
    )
    speculative_config: str | dict | None = option(
        "Speculative decoding, vLLM's JSON: "
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1} proposes the tokens that followed the last n-gram earlier in '
        "the request (prompt lookup) and verifies them in one step; greedy output is token for "
        "token the same, sampling keeps its distribution. Pays on copy-heavy outputs "
        "(editing, quoting, code); by default a step drafts only where the engine measures "
        'that drafting emits more tokens per second ("adaptive": false: every step); turns '
        "async scheduling off. "
        '{"model": PATH, "num_speculative_tokens": 3}: a draft model sharing the target\'s '
        "tokenizer proposes them (whole on the driver under tensor parallelism); "
        '{"method": "eagle", "model": PATH}: an EAGLE-1 head over the target\'s hidden '
        'states; {"method": "eagle3", "model": PATH}: an EAGLE-3 head over three of its '
        "layers. Default: off.",
        None,
    )
    # --- KV cache ---
    block_size: int = option("KV cache block size in tokens.", 16, int)
    num_kv_blocks: int | None = option(
        "Exact number of KV cache blocks (overrides --kv-cache-memory).", None, optional_int
    )
    kv_cache_memory: int | None = option(
        "Memory for the KV cache, e.g. 4GiB (default: a share of free memory).", None, parse_bytes
    )
    kv_cache_dtype: str = option(
        "KV cache storage: auto = the model's dtype; int8 = int8 with a scale per token and "
        "head (half the memory and half the bytes read per decode step, so more throughput "
        "at large batches; next-token KL ~0.003 from bf16 on the default model); fp8 = float8 "
        "e4m3 with per-tensor scales of 1.0 (CUDA, the triton backend: twice the tokens of bf16).",
        "auto",
        choices=KV_CACHE_DTYPE_CHOICES,
    )
    gpu_memory_utilization: float = option(
        "Share of GPU memory the engine may use (CUDA only).", 0.9, float
    )
    enable_prefix_caching: bool = option(
        "Reuse KV blocks of shared prompt prefixes.", True, parse_bool, kind="bool"
    )
    # --- LoRA adapters ---
    enable_lora: bool = option(
        "Serve LoRA adapters (PEFT folders) over the base model: a request names one "
        "(LLM.generate's lora_request), and a batch mixes requests of several adapters and "
        "the base. Steps with adapters run eagerly (no CPU decode plan, no CUDA graph).",
        False,
        parse_bool,
        kind="bool",
    )
    max_loras: int = option(
        "LoRA: adapters resident at once, the most one step mixes; requests of further "
        "adapters wait for a slot while the others run.",
        1,
        int,
    )
    max_lora_rank: int = option(
        "LoRA: the largest adapter rank accepted (the slots are this wide).", 16, int
    )
    max_cpu_loras: int | None = option(
        "LoRA: loaded adapters kept in host memory (least recently used evicted), resident "
        "ones included (default: max_loras).",
        None,
        optional_int,
    )
    # --- parallelism ---
    tensor_parallel_size: int = option("Tensor-parallel ranks (worker processes).", 1, int)
    pipeline_parallel_size: int = option(
        "Pipeline stages: each holds a contiguous share of the layers (and their KV cache) "
        'on tensor_parallel_size ranks of its own; TESSERA_PP_LAYER_PARTITION="a,b,..." '
        "overrides the balanced split.",
        1,
        int,
    )
    enable_expert_parallel: bool = option(
        "Mixtures of experts: each tensor-parallel rank holds whole experts (E / "
        "tensor_parallel_size of them) instead of a slice of every expert; a token's "
        "routed experts run where they live and one all-reduce sums them (vLLM's flag).",
        False,
        parse_bool,
        kind="bool",
    )
    distributed_executor_backend: str = option(
        "Where the ranks run when there are several: mp = worker processes on this machine; "
        "ray = one Ray actor per rank in a placement group (the cluster at RAY_ADDRESS, else "
        "a local one; needs the `ray` extra).",
        "mp",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    collective_timeout: float = option(
        "Seconds a tensor-parallel rank waits for its peers (a collective, a worker's reply) "
        "before the engine is declared dead (the server exits non-zero).",
        300.0,
        float,
    )
    frontend_threads: int | None = option(
        "CPU threads that small engine steps (<= 4 tokens) leave to the HTTP front end, so "
        "streams are not stalled by a descheduled compute thread. Unset or `auto`: steps of "
        "1-4 and of 5-16 tokens are measured apart, a band's first steps alternating between "
        "all threads and all but one, and the faster median takes the band (logged; measured "
        "again every 4,096 of its steps); 0: use every thread (the offline API's default).",
        0,
        auto_int,
    )

    def create_engine_config(self) -> EngineConfig:
        """The validated config; ValueError (from its parts) names a bad value."""
        device_type = resolve_device_type(self.device)
        provisional = default_batch_limits(device_type)
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            max_num_seqs = provisional.max_num_seqs
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = provisional.max_num_batched_tokens
        # On a GPU, what was left unset is sized again once the model is read (LLMEngine).
        unset = tuple(
            name
            for name in ("max_num_seqs", "max_num_batched_tokens")
            if getattr(self, name) is None and device_type == "cuda"
        )
        return EngineConfig(
            model=ModelConfig(
                model=self.model or DEFAULT_MODEL,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                load_format=self.load_format,
                quantization=self.quantization,
                seed=self.seed,
                device=self.device,
                attention_backend=self.attention_backend,
                enforce_eager=self.enforce_eager,
                cudagraph_mode=self.cudagraph_mode,
                reasoning_parser=self.reasoning_parser,
                generation_config=self.generation_config,
                chat_template=self.chat_template,
                runner=self.runner,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_kv_blocks,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                sized_by_engine=unset,
                # Replaced by the resolved model length once the model's config is read.
                max_model_len=max(self.max_model_len or max_num_batched_tokens, 1),
                enable_chunked_prefill=self.enable_chunked_prefill,
                block_size=self.block_size,
                policy=self.scheduling_policy or "fcfs",
                async_scheduling=self.async_scheduling,
                speculative_config=parse_speculative_config(self.speculative_config),
                stream_interval=self.stream_interval,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                distributed_executor_backend=self.distributed_executor_backend,
                frontend_threads=self.frontend_threads,
                collective_timeout_s=self.collective_timeout,
            ),
            served_model_name=self.served_model_name,
            max_num_queued_requests=self.max_num_queued_requests,
            lora=LoRAConfig(
                enabled=self.enable_lora,
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                max_cpu_loras=self.max_cpu_loras,
            ),
        )
