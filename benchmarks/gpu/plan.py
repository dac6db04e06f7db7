"""What one run of the device check measures: the model shapes, every section's sizes and
budgets (FULL on the GPU, QUICK for a smoke run), and the goals the figures are held to."""

from __future__ import annotations

from dataclasses import dataclass

DECODE_BANDWIDTH_GOAL = 0.70  # of the measured copy bandwidth, decode at B=256
OFFLINE_GOAL_TOK_S = 16_215  # SGLang's one-H100 figure on the Llama-3-8B shape
SERVE_SHARE_GOAL = 0.90  # the server's output tok/s over offline's, at the top concurrency
ATTENTION_BACKENDS = ("torch", "triton")  # looked up by name in engine.attention.backends
KV_DTYPES = ("auto", "fp8")  # "auto": the model's dtype (bf16 here)
# Worst max|out - ref| / max|ref| allowed: bf16 output and P rounding. The reference attends
# over the values the cache holds (K/V rounded to e4m3 for fp8), so this is the kernel's own
# error; what e4m3 itself costs against bf16 K/V is reported beside it.
TOLERANCE = {"auto": 2e-2, "fp8": 2e-2}
STALE_VALUE = 100.0  # written into every cache slot first: a kernel reading past a context shows

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
TINY_LLAMA = {
    **LLAMA3_8B,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
}

LLAMA3_8B_LINEARS = {  # name: (K, N)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}
# name: (input size, the output slices a LoRA targets): Llama-3-8B's merged linears
LLAMA3_8B_LORA_LINEARS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
MOE_SHAPES = {  # name: (experts, top_k, hidden, intermediate per expert)
    "Qwen3-30B-A3B": (128, 8, 2048, 768),
    "Mixtral-8x7B": (8, 2, 4096, 14336),
}


@dataclass(slots=True)
class Plan:
    """Every shape and budget of one run: FULL on the GPU, QUICK for a smoke run."""

    name: str
    # §1
    copy_bytes: int
    matmul_n: int
    # §2 and §3: the attention rig's heads
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    check_batches: tuple[int, ...]
    check_contexts: tuple[int, ...]
    check_chunk: int  # the prefill chunk of a "mixed" case (on a prefix where ctx allows)
    bench_batches: tuple[int, ...]
    bench_contexts: tuple[int, ...]
    # §4 and §5
    model: dict
    max_num_seqs: int
    chunk: int  # max_num_batched_tokens: the prefill chunk
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_warmup: int
    decode_steps: int
    requests: int
    input_mean: int
    output_mean: int
    kv_cache_memory: int | None  # None: the engine's own sizing (gpu_memory_utilization)
    # §6 quantized GEMMs: the linears {name: (K, N)} and rows
    quant_linears: dict[str, tuple[int, int]]
    quant_rows: tuple[int, ...]
    # §7 fused MoE: {name: (experts, top_k, hidden, intermediate)} and decode batches
    moe_shapes: dict[str, tuple[int, int, int, int]]
    moe_batches: tuple[int, ...]
    # §8 batched LoRA: the linears {name: output slices}, input size, rank, adapters, rows
    lora_linears: dict[str, tuple[int, tuple[int, ...]]]
    lora_rank: int
    lora_adapters: int
    lora_rows: int
    # §9 speculative verification: drafts per step and decode batches (on §4's model)
    spec_tokens: int
    spec_batches: tuple[int, ...]
    spec_context: int
    # §10 serving: client concurrencies (the top one is the server's max_num_seqs), requests
    # per stream, prompt words (about a token each with the word-level tokenizer), max_tokens
    serve_concurrency: tuple[int, ...]
    serve_rounds: int
    serve_input_words: int
    serve_output_len: int
    serve_modes: tuple[str, ...]  # "thread", "process" (--engine-process), "apiN": a server each
    # seconds: per section, and for the whole run
    budgets: dict[int, float]
    total_s: float
    serve_stream: bool = True  # §10: False asks for whole answers (bench serve --no-stream)


FULL = Plan(
    name="full",
    copy_bytes=2 << 30,
    matmul_n=8192,
    heads=32,
    kv_heads=8,
    head_dim=128,
    block_size=16,
    check_batches=(1, 7, 64),
    check_contexts=(1, 17, 1000, 4097),
    check_chunk=33,
    bench_batches=(1, 64, 256),
    bench_contexts=(1024, 4096, 8192),
    model=LLAMA3_8B,
    max_num_seqs=256,
    chunk=2048,
    decode_batches=(1, 64, 256),
    decode_context=1024,
    decode_warmup=3,
    decode_steps=10,
    requests=1000,
    input_mean=250,
    output_mean=200,
    kv_cache_memory=None,
    quant_linears=LLAMA3_8B_LINEARS,
    quant_rows=(1, 64, 256),
    moe_shapes=MOE_SHAPES,
    moe_batches=(1, 16, 64, 256),
    lora_linears=LLAMA3_8B_LORA_LINEARS,
    lora_rank=16,
    lora_adapters=8,
    lora_rows=64,
    spec_tokens=4,
    spec_batches=(1, 16, 64),
    spec_context=512,
    serve_concurrency=(64, 256),
    serve_rounds=4,
    serve_input_words=256,
    serve_output_len=128,
    serve_modes=("thread", "api4", "process"),  # the default, the scale-out, the split
    # every section but §10 in one device call: ~360 s with gpu_session.sh's tests in under
    # 10 min; §10 (three engine starts) in a call of its own
    budgets={1: 10, 2: 35, 3: 35, 4: 120, 5: 60, 6: 40, 7: 25, 8: 15, 9: 50, 10: 560},
    total_s=360,
)
QUICK = Plan(
    name="quick",
    copy_bytes=64 << 20,
    matmul_n=256,
    heads=8,
    kv_heads=2,
    head_dim=64,
    block_size=16,
    check_batches=(1, 3),
    check_contexts=(1, 17, 40),
    check_chunk=33,
    bench_batches=(1, 4),
    bench_contexts=(64, 256),
    model=TINY_LLAMA,
    max_num_seqs=16,
    chunk=128,
    decode_batches=(1, 4),
    decode_context=32,
    decode_warmup=1,
    decode_steps=3,
    requests=16,
    input_mean=24,
    output_mean=12,
    kv_cache_memory=64 << 20,  # a tiny model: millions of blocks would only cost start-up time
    quant_linears={"qkv": (256, 384), "down": (512, 256)},
    quant_rows=(1, 4),
    moe_shapes={"tiny 8 experts top-2": (8, 2, 64, 32)},
    moe_batches=(1, 4),
    lora_linears={"qkv": (64, (64, 32, 32)), "down": (96, (64,))},
    lora_rank=8,
    lora_adapters=2,
    lora_rows=6,
    spec_tokens=3,
    spec_batches=(1, 4),
    spec_context=32,
    serve_concurrency=(4, 16),
    serve_rounds=2,
    serve_input_words=24,
    serve_output_len=16,
    serve_modes=("thread",),
    budgets={1: 30, 2: 60, 3: 60, 4: 120, 5: 60, 6: 240, 7: 60, 8: 60, 9: 120, 10: 240},
    total_s=600,
)
