"""The device check: what Tessera's CUDA path reaches on this GPU, against the chip's own ceilings.

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--sections 1 2 3 4 5] [--quick]
        [--device cuda|cpu] [--json PATH]

It runs with whatever torch and Triton the machine has (nothing is installed, no web stack is
imported) in under 8 minutes on an H200: each section has a time budget and skips what is left
of it once the budget is spent (saying so), and the whole run stops at a global limit. A
section that fails prints its error in the table and the next one runs. The table goes to
stdout, progress to stderr, and every figure as JSON to $OUT/gpu_check.json when $OUT is set
(and to --json PATH).

1. ceilings: device, versions; device-to-device copy bandwidth (a large copy_, bytes read +
   written, best of several, CUDA events) and bf16 matmul TFLOP/s: what the rest is held to.
2. kernel correctness: each attention backend found by name in the registry (torch, triton),
   bf16 and fp8 KV cache, against an fp64 reference: B in {1, 7, 64} x context in {1, 17,
   1000, 4097}, decode steps and a prefill chunk on a cached prefix, block size 16, 32 query /
   8 KV heads, head dim 128, random non-contiguous block tables, stale values in the unused
   slots; the worst max|out - ref| / max|ref| per backend and KV dtype.
3. attention microbenchmark: one layer's decode forward, triton vs torch, B = 1/64/256 x
   context 1k/4k/8k: microseconds per call, KV bytes read per second, % of the copy ceiling
   (eager launches, CUDA events: the smallest shapes are bound by the launch, not the kernel).
4. end to end on the Llama-3-8B shape with dummy weights (LLM, token-id prompts): decode tok/s
   at B = 1/64/256 on a 1k context, eager and with the engine's default step graphs where the
   engine has `enforce_eager`; prefill tok/s of a 2,048-token prompt (one chunk) and of an
   8k one (chunks on growing prefixes), each timed from adding it to its end (async
   scheduling: a step's host time is not its chunk's); achieved bandwidth = (weight bytes +
   KV bytes read) / step time.
5. offline throughput like `tessera bench throughput`: 1,000 requests with ShareGPT-like
   lengths (lognormal, input ~250, output ~200 tokens, fixed seed), output tok/s through
   LLM.generate's own loop (every request added, then steps until done), with a deadline.

Goals (issue 18, H200): decode at B=256 reads at >= 70% of the measured copy bandwidth (§4;
§3 shows the attention kernel's share alone); offline output >= 16,215 tok/s (§5).

The attention rigs of §2 and §3 are a one-layer model of those head shapes built by the
engine's own ModelRunner (so a KV cache and any scales are allocated and bound the way the
engine does it, fp8 included); the backend's build_metadata / write_kv / forward are then called
directly. --quick: tiny shapes and a tiny model, a smoke run (`--quick --device cpu` is what CI
runs: the torch backend; triton and fp8 report "not available" where they are).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import inspect
import json
import math
import os
import platform
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # a fallback for `python3 benchmarks/gpu_check.py` alone
    sys.path.append(str(_ROOT))

DECODE_BANDWIDTH_GOAL = 0.70  # of the measured copy bandwidth, decode at B=256
OFFLINE_GOAL_TOK_S = 16_215  # SGLang's one-H100 figure on the Llama-3-8B shape
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
    # seconds: per section, and for the whole run
    budgets: dict[int, float]
    total_s: float


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
    budgets={1: 15, 2: 55, 3: 60, 4: 200, 5: 100},
    total_s=450,  # with python's start and the teardown: under 8 minutes
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
    budgets={1: 30, 2: 60, 3: 60, 4: 120, 5: 60},
    total_s=300,
)


# -- the report -------------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    section: int
    check: str
    result: str
    versus: str = ""  # against a ceiling or a goal
    note: str = ""


@dataclass(slots=True)
class SectionRecord:
    name: str
    status: str = "not run"  # ok | error | skipped | not run
    seconds: float = 0.0
    error: str | None = None
    results: list[dict] = field(default_factory=list)


class Report:
    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.sections: dict[int, SectionRecord] = {}

    def row(self, section: int, check: str, result: str, versus: str = "", note: str = "") -> Row:
        row = Row(section, check, result, versus, note)
        self.rows.append(row)
        progress(f"§{section} {check}: {result} {versus} {note}".rstrip())
        return row

    def result(self, section: int, **values) -> None:
        self.sections[section].results.append(values)


def progress(text: str) -> None:
    print(f"[gpu_check] {text}", file=sys.stderr, flush=True)


class TimeLimit(Exception):
    """The whole run's time limit (SIGALRM): the running section stops, the rest are skipped."""


class BudgetSpent(Exception):
    """A section's own budget ran out inside a measurement."""


class Budget:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def spent(self) -> bool:
        return self.left() <= 0


SKIPPED = "skipped: section budget spent"


# -- timing and ceilings ----------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, n: int) -> float:
    """Mean seconds of n back-to-back calls: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def best_seconds(
    fn: Callable[[], object], device: torch.device, target_s: float = 0.1, repeats: int = 3
) -> float:
    """Seconds per call: the best of `repeats` loops of about target_s each, after a warm-up
    (JIT compiling and autotuning happen there)."""
    fn()
    fn()
    sync(device)
    one = seconds_per_call(fn, device, 1)
    n = max(1, min(200, int(target_s / max(one, 1e-7))))
    return min(seconds_per_call(fn, device, n) for _ in range(repeats))


def measure_copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by one large device-to-device copy_, best of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = min(seconds_per_call(lambda: dst.copy_(src), device, 1) for _ in range(10))
    return 2 * nbytes / best


def measure_matmul_flops(device: torch.device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b, out=c)
    sync(device)
    best = min(seconds_per_call(lambda: torch.mm(a, b, out=c), device, 1) for _ in range(10))
    return 2 * n**3 / best


def fmt_bandwidth(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e12:
        return f"{bytes_per_s / 1e12:.2f} TB/s"
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def fmt_flops(flops: float) -> str:
    if flops >= 1e12:
        return f"{flops / 1e12:.0f} TFLOP/s"
    return f"{flops / 1e9:.1f} GFLOP/s"


def share(value: float, ceiling: float | None, of: str) -> str:
    return f"{value / ceiling:.0%} of {of}" if ceiling else f"(no {of} ceiling)"


def goal_mark(met: bool) -> str:
    return "met" if met else "NOT met"


def triton_version() -> str:
    try:  # the distribution's version: importing triton is the backend's business
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# -- model folders ----------------------------------------------------------------------------


def write_model_folder(folder: Path, config: dict, tokenizer: bool = True) -> Path:
    """config.json, a header-only safetensors placeholder (the loader wants a weights file in
    the folder; load_format="dummy" never reads it) and a word-level fast tokenizer with one
    token per id (the engine detokenizes; prompts are token ids)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    header = json.dumps({"__metadata__": {"tessera": "placeholder: dummy weights"}}).encode()
    header += b" " * (-len(header) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, config["vocab_size"])}}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
        fast.save_pretrained(str(folder))
    return folder


def layer_params(cfg: dict) -> int:
    """Weights of one decoder layer's GEMMs (q, k, v, o, gate, up, down)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return h * q + 2 * h * kv + q * h + 3 * h * i


def decode_weight_bytes(cfg: dict, elem: int = 2) -> int:
    """Weight bytes a decode step reads: every layer's GEMMs and the LM head (the embedding
    gives only B rows, the norms are noise)."""
    return (
        cfg["num_hidden_layers"] * layer_params(cfg) + cfg["vocab_size"] * cfg["hidden_size"]
    ) * elem


def kv_bytes_per_token(cfg: dict, elem: int = 2) -> int:
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * elem


def prefill_flops(cfg: dict, prefix: int, n: int) -> float:
    """GEMMs of n tokens plus attention (QK^T and PV) over the prefix and, causally, the chunk."""
    attn = 4 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"]
    return 2 * cfg["num_hidden_layers"] * layer_params(cfg) * n + attn * n * (prefix + (n + 1) / 2)


# -- the run's state --------------------------------------------------------------------------


class Check:
    def __init__(self, plan: Plan, device: torch.device, workdir: Path, report: Report) -> None:
        self.plan = plan
        self.device = device
        self.workdir = workdir
        self.report = report
        self.copy_ceiling: float | None = None
        self.matmul_ceiling: float | None = None
        self.shared_llm = None  # §4's default-mode engine, kept for §5 when §5 runs
        self.keep_llm_for_throughput = False
        self._folders: dict[str, Path] = {}

    def copy_bandwidth(self) -> float | None:
        if self.copy_ceiling is None:
            try:
                self.copy_ceiling = measure_copy_bandwidth(self.device, self.plan.copy_bytes)
            except Exception as e:  # a section without its ceiling still reports its figures
                progress(f"copy bandwidth: {type(e).__name__}: {e}")
        return self.copy_ceiling

    def matmul_flops(self) -> float | None:
        if self.matmul_ceiling is None:
            try:
                self.matmul_ceiling = measure_matmul_flops(self.device, self.plan.matmul_n)
            except Exception as e:
                progress(f"matmul: {type(e).__name__}: {e}")
        return self.matmul_ceiling

    def folder(self, name: str, config: dict, tokenizer: bool = True) -> Path:
        if name not in self._folders:
            self._folders[name] = write_model_folder(self.workdir / name, config, tokenizer)
        return self._folders[name]


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def option_supported(fn: Callable, name: str) -> bool:
    return name in inspect.signature(fn).parameters


# -- §1 ceilings ------------------------------------------------------------------------------


def device_description(device: torch.device) -> tuple[str, str]:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (
            p.name,
            f"sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs",
        )
    return platform.processor() or platform.machine(), f"CPU, {torch.get_num_threads()} threads"


def section_ceilings(chk: Check, out: Report, budget: Budget) -> None:
    name, detail = device_description(chk.device)
    out.row(1, "device", name, note=detail)
    out.row(
        1,
        "versions",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton_version()}",
        note=f"python {platform.python_version()}",
    )
    out.result(
        1,
        device=name,
        detail=detail,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=triton_version(),
    )
    copy = chk.copy_bandwidth()
    if copy is None:
        raise RuntimeError("the copy bandwidth could not be measured (see stderr)")
    out.row(
        1,
        "device-to-device copy",
        fmt_bandwidth(copy),
        note=f"copy_ of {chk.plan.copy_bytes / 2**30:.2g} GiB, bytes read + written, best of 10",
    )
    out.result(1, copy_bytes_per_s=copy)
    if budget.spent:
        out.row(1, "bf16 matmul", SKIPPED)
        return
    flops = chk.matmul_flops()
    n = chk.plan.matmul_n
    out.row(
        1,
        "bf16 matmul",
        fmt_flops(flops) if flops else "failed (see stderr)",
        note=f"{n} x {n} x {n}, best of 10",
    )
    out.result(1, matmul_flops=flops)


# -- the attention rig (§2, §3) ---------------------------------------------------------------


@dataclass(slots=True)
class Rig:
    """One attention layer as the engine builds it: the runner's backend, layer and cache."""

    runner: object
    backend: object
    layer: object
    cache: torch.Tensor
    num_blocks: int


def make_rig(
    chk: Check, backend: str, kv_cache_dtype: str, num_blocks: int, max_context: int
) -> tuple[Rig | None, str, str]:
    """(rig, "ok", ""), or (None, status, why): a backend missing from the registry, or one
    the engine refuses (ValueError) for this device or cache dtype, is "not available"; any
    other failure to build it is an "ERROR"."""
    from engine.attention.backends import BACKENDS

    if backend not in BACKENDS:
        return None, "not available", "not in engine.attention.backends.BACKENDS on this branch"
    from engine.worker.model_runner import ModelRunner

    p = chk.plan
    cfg = {
        **LLAMA3_8B,
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "vocab_size": 256,
        "max_position_embeddings": max_context,
    }
    folder = chk.folder(f"rig-{p.heads}-{p.kv_heads}-{p.head_dim}-{max_context}", cfg, False)
    options = dict(
        model=str(folder),
        dtype="bfloat16",
        load_format="dummy",
        device=chk.device.type,
        attention_backend=backend,
        kv_cache_dtype=kv_cache_dtype,
        block_size=p.block_size,
        num_kv_blocks=num_blocks,
        max_model_len=max_context,
        max_num_seqs=max(*p.check_batches, *p.bench_batches),
        enable_prefix_caching=False,
    )
    try:  # EngineArgs; a baseline tree from before it has EngineConfig.from_options
        from engine.args import EngineArgs

        options["enforce_eager"] = True  # the rig calls the backend itself: nothing to capture

        def make_config(**o):
            return EngineArgs(**o).create_engine_config()
    except ImportError:
        from engine.config import EngineConfig

        options["num_blocks"] = options.pop("num_kv_blocks")
        if option_supported(EngineConfig.from_options, "enforce_eager"):
            options["enforce_eager"] = True
        make_config = EngineConfig.from_options
    try:
        config = make_config(**options)
        runner = ModelRunner(config, model_dir=folder, rank=0)
        runner.load_model()
        runner.init_kv_cache(num_blocks)
    except (ValueError, ImportError, NotImplementedError) as e:
        return None, "not available", f"{type(e).__name__}: {e}"
    except Exception as e:
        traceback.print_exc()
        return None, "ERROR", f"{type(e).__name__}: {e}"
    layer = runner.model.attention_layers()[0]
    return Rig(runner, runner.attn_backend, layer, layer.kv_cache, num_blocks), "ok", ""


def kv_label(kv_cache_dtype: str) -> str:
    return "bf16" if kv_cache_dtype == "auto" else kv_cache_dtype


@dataclass(slots=True)
class Case:
    batch: int
    context: int
    mode: str  # "decode": one query token each; "mixed": the last request is a prefill chunk
    reqs: list[tuple[int, int]]  # (start position, query tokens) per request, batch order
    blocks: list[np.ndarray]  # each request's physical blocks, int32
    q: torch.Tensor  # [T, H, D]
    keys: torch.Tensor  # [B, context, Hkv, D]
    values: torch.Tensor


def check_cases(plan: Plan) -> list[tuple[int, int, str]]:
    cases = []
    for ctx in plan.check_contexts:
        for b in plan.check_batches:
            cases.append((b, ctx, "decode"))
            if ctx > 1:
                cases.append((b, ctx, "mixed"))
    return cases


def make_case(
    plan: Plan,
    batch: int,
    context: int,
    mode: str,
    num_blocks: int,
    seed: int,
    device: torch.device,
) -> Case:
    bs = plan.block_size
    reqs = [(context - 1, 1)] * batch
    if mode == "mixed":
        q_len = min(context, plan.check_chunk)
        reqs[-1] = (context - q_len, q_len)
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))  # scattered, in any order
    nb = -(-context // bs)
    blocks = [free[r * nb : (r + 1) * nb] for r in range(batch)]
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, context, plan.kv_heads, plan.head_dim)
    keys = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    values = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    t = sum(n for _, n in reqs)
    q = torch.randn(
        (t, plan.heads, plan.head_dim), generator=gen, device=device, dtype=torch.bfloat16
    )
    return Case(batch, context, mode, reqs, blocks, q, keys, values)


def stored(x: torch.Tensor, kv_cache_dtype: str, kv_scale: float) -> torch.Tensor:
    """x as the cache holds it, in fp64: rounded to e4m3 for an fp8 cache."""
    if kv_cache_dtype != "fp8":
        return x.double()
    from engine.attention import kv_fp8

    return kv_fp8.dequantize(kv_fp8.quantize(x, kv_scale), kv_scale, torch.float64)


def reference(case: Case, scale: float, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """fp64 attention of every query row over its request's context, causal, over K/V as the
    cache stores them: [T, H * D]."""
    from engine.attention import kv_fp8

    outs = []
    row = 0
    for r, (start, n) in enumerate(case.reqs):
        ctx = start + n
        q = case.q[row : row + n].double()  # [n, H, D]
        k = stored(case.keys[r, :ctx], kv_cache_dtype, kv_fp8.K_SCALE)  # [ctx, Hkv, D]
        v = stored(case.values[r, :ctx], kv_cache_dtype, kv_fp8.V_SCALE)
        hkv, d = k.shape[1], k.shape[2]
        qg = q.view(n, hkv, -1, d)  # the query heads that share a KV head
        s = torch.einsum("qhgd,khd->hgqk", qg, k) * scale
        q_pos = torch.arange(start, ctx, device=q.device)
        future = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]
        s = s.masked_fill(future, float("-inf"))
        o = torch.einsum("hgqk,khd->qhgd", torch.softmax(s, dim=-1), v)
        outs.append(o.reshape(n, -1))
        row += n
    return torch.cat(outs)


def run_case(rig: Rig, case: Case, block_size: int) -> torch.Tensor:
    """The cached prefixes written through the backend, then one step: write_kv + forward."""
    from engine.attention.metadata import common_metadata_from_seqs

    backend, layer, cache = rig.backend, rig.layer, rig.cache
    # Prefixes as one prefill step; the metadata wants one-token requests first.
    fill = sorted(
        ((r, start) for r, (start, _) in enumerate(case.reqs) if start > 0),
        key=lambda x: x[1] != 1,
    )
    if fill:
        seqs = [(0, start, case.blocks[r]) for r, start in fill]
        meta = backend.build_metadata(common_metadata_from_seqs(seqs, block_size))
        k = torch.cat([case.keys[r, :start] for r, start in fill])
        v = torch.cat([case.values[r, :start] for r, start in fill])
        backend.write_kv(layer, k, v, cache, meta)
    seqs = [(start, n, case.blocks[r]) for r, (start, n) in enumerate(case.reqs)]
    meta = backend.build_metadata(common_metadata_from_seqs(seqs, block_size))
    k = torch.cat([case.keys[r, s : s + n] for r, (s, n) in enumerate(case.reqs)])
    v = torch.cat([case.values[r, s : s + n] for r, (s, n) in enumerate(case.reqs)])
    backend.write_kv(layer, k, v, cache, meta)
    return backend.forward(layer, case.q, k, v, cache, meta)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.double().reshape(ref.shape)
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def poison(cache: torch.Tensor) -> None:
    with contextlib.suppress(RuntimeError, TypeError):  # a dtype without fill_: zeros stay
        cache.fill_(STALE_VALUE)


@torch.inference_mode()
def section_correctness(chk: Check, out: Report, budget: Budget) -> None:
    p = chk.plan
    cases = check_cases(p)
    num_blocks = 1 + max(b * -(-ctx // p.block_size) for b, ctx, _ in cases)
    max_context = max(p.check_contexts)
    rigs: dict[tuple[str, str], Rig] = {}
    for name in ATTENTION_BACKENDS:
        for kv in KV_DTYPES:
            rig, status, why = make_rig(chk, name, kv, num_blocks, max_context)
            if rig is None:
                out.row(2, f"correctness {name}, {kv_label(kv)} KV", status, note=why)
                out.result(2, backend=name, kv=kv_label(kv), status=status, why=why)
                continue
            poison(rig.cache)
            rigs[(name, kv)] = rig
    worst: dict[tuple[str, str], tuple[float, str]] = {key: (0.0, "") for key in rigs}
    failures: dict[tuple[str, str], str] = {}
    rounding: dict[str, float] = {}  # kv dtype -> worst error of its rounded K/V's reference
    done = 0
    for i, (b, ctx, mode) in enumerate(cases):
        if budget.spent or not rigs:
            break
        case = make_case(p, b, ctx, mode, num_blocks, seed=1000 + i, device=chk.device)
        refs: dict[str, torch.Tensor] = {}
        for key, rig in rigs.items():
            for kv in {"auto", key[1]} - refs.keys():
                refs[kv] = reference(case, rig.layer.scale, kv)
            if key[1] != "auto":  # what rounding K/V costs, whatever the kernel does
                cost = relative_error(refs[key[1]], refs["auto"])
                rounding[key[1]] = max(rounding.get(key[1], 0.0), cost)
            where = f"B={b}, ctx={ctx}, {mode}"
            try:
                err = relative_error(run_case(rig, case, p.block_size), refs[key[1]])
            except Exception as e:
                err = math.inf
                failures.setdefault(key, f"{where}: {type(e).__name__}: {e}")
                traceback.print_exc()
            if err >= worst[key][0]:
                worst[key] = (err, where)
            out.result(
                2, backend=key[0], kv=kv_label(key[1]), batch=b, context=ctx, mode=mode, rel_err=err
            )
        done += 1
        del case, refs
    for key in rigs:
        err, where = worst[key]
        tol = TOLERANCE[key[1]]
        note = f"worst at {where}" if done else ""
        if key in failures:
            note = f"raised at {failures[key]}"
        if key[1] in rounding:
            note += f"; e4m3 K/V alone cost {rounding[key[1]]:.2e} against bf16 K/V"
        if done < len(cases):
            note += f"; {len(cases) - done} cases skipped: section budget spent"
        out.row(
            2,
            f"correctness {key[0]}, {kv_label(key[1])} KV",
            f"worst rel err {err:.2e} ({done}/{len(cases)} cases)",
            f"tol {tol:.0e}: {'ok' if err <= tol and done else 'FAIL'}",
            note.strip("; "),
        )
    rigs.clear()


# -- §3 attention microbenchmark --------------------------------------------------------------


def time_decode_forward(
    rig: Rig, plan: Plan, batch: int, context: int, seed: int, device: torch.device
) -> float:
    """Seconds per forward of one decode step (B sequences of `context` keys) on one layer."""
    from engine.attention.metadata import common_metadata_from_seqs

    bs = plan.block_size
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, rig.num_blocks, dtype=np.int32))
    nb = -(-context // bs)
    seqs = [(context - 1, 1, free[r * nb : (r + 1) * nb]) for r in range(batch)]
    meta = rig.backend.build_metadata(common_metadata_from_seqs(seqs, bs))
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(
        (batch, plan.heads, plan.head_dim), generator=gen, device=device, dtype=torch.bfloat16
    )
    k = torch.randn(
        (batch, plan.kv_heads, plan.head_dim), generator=gen, device=device, dtype=torch.bfloat16
    )
    v = torch.randn_like(k)
    rig.backend.write_kv(rig.layer, k, v, rig.cache, meta)
    return best_seconds(lambda: rig.backend.forward(rig.layer, q, k, v, rig.cache, meta), device)


@torch.inference_mode()
def section_attention(chk: Check, out: Report, budget: Budget) -> None:
    p = chk.plan
    copy = chk.copy_bandwidth()
    shapes = [(b, ctx) for ctx in p.bench_contexts for b in p.bench_batches]
    num_blocks = 1 + max(p.bench_batches) * -(-max(p.bench_contexts) // p.block_size)
    max_context = max(p.bench_contexts)
    triton_rows: dict[tuple[int, int], tuple[Row, float]] = {}
    # triton first: it is what this section is for if the budget runs short
    for name, kv in (("triton", "auto"), ("torch", "auto"), ("triton", "fp8")):
        label = f"{name}, {kv_label(kv)} KV"
        if budget.spent:
            out.row(3, f"attention {label}", SKIPPED)
            continue
        rig, status, why = make_rig(chk, name, kv, num_blocks, max_context)
        if rig is None:
            out.row(3, f"attention {label}", status, note=why)
            out.result(3, backend=name, kv=kv_label(kv), status=status, why=why)
            continue
        for i, (b, ctx) in enumerate(shapes):
            if budget.spent:
                out.row(3, f"attention {label}", SKIPPED, note=f"{len(shapes) - i} shapes left")
                break
            t = time_decode_forward(rig, p, b, ctx, seed=2000 + i, device=chk.device)
            kv_bytes = b * ctx * p.kv_heads * p.head_dim * 2 * rig.cache.element_size()
            bw = kv_bytes / t
            versus = share(bw, copy, "copy")
            if b == 256 and copy:
                versus += f"; goal {DECODE_BANDWIDTH_GOAL:.0%}: {goal_mark(bw >= DECODE_BANDWIDTH_GOAL * copy)}"
            note = ""
            if name == "torch" and (b, ctx) in triton_rows:
                trow, t_triton = triton_rows[(b, ctx)]
                trow.note = f"{t / t_triton:.1f}x the torch reference"
                note = "the reference (gather + SDPA)"
            row = out.row(
                3,
                f"attention {label}, B={b}, ctx={ctx}",
                f"{t * 1e6:,.1f} µs",
                f"{fmt_bandwidth(bw)} = {versus}",
                note,
            )
            if name == "triton" and kv == "auto":
                triton_rows[(b, ctx)] = (row, t)
            out.result(
                3,
                backend=name,
                kv=kv_label(kv),
                batch=b,
                context=ctx,
                seconds=t,
                kv_bytes=kv_bytes,
                kv_bytes_per_s=bw,
            )
        rig = None
        free_memory()


# -- §4 end to end ----------------------------------------------------------------------------


def start_llm(chk: Check, enforce_eager: bool | None):
    """LLM on the §4/§5 model (dummy weights); enforce_eager None: the engine's default."""
    from engine.llm import LLM

    p = chk.plan
    folder = chk.folder(f"model-{p.name}", p.model)
    options = dict(
        load_format="dummy",
        dtype="bfloat16",
        device=chk.device.type,
        # the CPU's C kernels are another benchmark's business: the smoke run stays cheap
        attention_backend="torch" if chk.device.type == "cpu" else "auto",
        max_num_seqs=p.max_num_seqs,
        max_num_batched_tokens=p.chunk,
        seed=0,
    )
    if p.kv_cache_memory is not None:
        options["kv_cache_memory"] = p.kv_cache_memory
    if enforce_eager is not None:
        options["enforce_eager"] = enforce_eager
    if chk.device.type == "cuda":
        # The engine sizes its KV cache from what is free: an earlier engine or rig that was
        # not freed shows here.
        held = torch.cuda.memory_allocated(chk.device)
        if held > 1 << 30:
            progress(f"{held / 2**30:.1f} GiB still allocated before this engine starts")
    t = time.perf_counter()
    llm = LLM(str(folder), **options)
    sync(chk.device)
    return llm, time.perf_counter() - t


def engine_facts(llm) -> str:
    """What the engine chose (best effort: these are the runner's attributes on main)."""
    try:
        runner = llm.engine.executor.runner
        graph = getattr(runner, "_step_graph", None)
        graph_name = type(graph).__name__ if graph is not None else "none"
        return (
            f"attention {runner.attn_backend.name}, step graph {graph_name}, "
            f"{llm.engine.num_blocks:,} KV blocks"
        )
    except AttributeError as e:
        return f"(engine facts unavailable: {e})"


def token_prompts(rng: np.random.Generator, lengths, vocab_size: int) -> list[list[int]]:
    # ordinary ids, no special ones (0 and 1 are the tokenizer's)
    lo, hi = min(1000, vocab_size // 4), max(min(vocab_size, 30000), 3)
    return [rng.integers(lo, hi, size=int(n)).tolist() for n in lengths]


def measure_decode(
    llm, batch: int, context: int, warmup: int, steps: int, budget: Budget, seed: int
) -> tuple[list[float], list[int]]:
    """Step times and keys attended of the pure decode steps of `batch` requests of a
    `context`-token prompt, once every prefill is done (warm-up steps dropped)."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(seed)
    prompts = token_prompts(rng, [context] * batch, engine.vocab_size)
    # The prompts' prefill takes many chunked steps, and the first requests decode in each of
    # them: they must not reach max_tokens before the last prompt is in, or no step decodes
    # all `batch` at once. A step's chunk is what the decodes leave of the token budget.
    chunk = engine.config.scheduler.max_num_batched_tokens
    prefill_steps = math.ceil(batch * context / max(chunk - batch, 1)) + batch
    params = SamplingParams(
        max_tokens=prefill_steps + warmup + steps + 4, temperature=0.0, ignore_eos=True
    )
    ids = [f"decode-{seed}-{i}" for i in range(batch)]
    gen_start = engine.generation_tokens_total
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    times: list[float] = []
    keys: list[int] = []
    try:
        while engine.has_unfinished_requests() and len(times) < warmup + steps:
            if budget.spent:
                raise BudgetSpent(f"decode B={batch}")
            p0, g0 = engine.prompt_tokens_total, engine.generation_tokens_total
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if engine.prompt_tokens_total == p0 and engine.generation_tokens_total - g0 == batch:
                times.append(dt)
                keys.append(batch * context + g0 - gen_start)  # each attends prompt + sampled
    finally:
        for rid in ids:
            engine.abort_request(rid)
    if len(times) <= warmup:
        raise RuntimeError(f"decode B={batch}: only {len(times)} pure decode steps ran")
    return times[warmup:], keys[warmup:]


def measure_prefill(
    llm, length: int, repeats: int, budget: Budget, seed: int, device: torch.device
) -> list[float]:
    """Seconds from adding a fresh `length`-token prompt (max_tokens 1) to its end, the
    device synchronized, `repeats` times after a warm-up. Whole prompts, not single steps:
    with async scheduling a step returns before its work is done, so a step's host time is
    not its chunk's."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seconds = []
    for rep in range(repeats + 1):
        if budget.spent:
            raise BudgetSpent("prefill")
        rid = f"prefill-{seed}-{length}-{rep}"
        prompt = token_prompts(rng, [length], engine.vocab_size)[0]  # fresh: no prefix hit
        sync(device)
        t = time.perf_counter()
        engine.add_request(rid, prompt, params)
        try:
            while engine.has_unfinished_requests():
                engine.step()
            sync(device)
        finally:
            engine.abort_request(rid)
        if rep > 0:
            seconds.append(time.perf_counter() - t)
    return seconds


def section_end_to_end(chk: Check, out: Report, budget: Budget) -> None:
    from engine.llm import LLM

    p = chk.plan
    cfg = p.model
    weights = decode_weight_bytes(cfg)
    per_token = kv_bytes_per_token(cfg)
    copy = chk.copy_bandwidth()
    if chk.device.type != "cuda":
        why_not = "no CUDA device: the default path only"
    elif not option_supported(LLM.__init__, "enforce_eager"):
        why_not = "LLM has no enforce_eager option on this branch: the default path only"
    else:
        why_not = None
    if why_not is None:
        modes = [("eager", True), ("graphs", False)]
    else:
        modes = [("default", None)]
        out.row(4, "CUDA graphs", "not measured", note=why_not)
    shape = (
        f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads"
    )
    start_s = 0.0  # the last start's seconds: the next is not begun without that much left
    for m, (label, eager) in enumerate(modes):
        last = m == len(modes) - 1
        if budget.left() < start_s + 10:
            out.row(4, f"{label}: decode and prefill", SKIPPED)
            continue
        llm, start_s = start_llm(chk, eager)
        measured = False
        try:
            out.row(
                4,
                f"engine start ({label})",
                f"{start_s:.1f} s",
                note=f"{shape}; {engine_facts(llm)}",
            )
            out.result(4, mode=label, start_s=start_s, facts=engine_facts(llm))
            for b in p.decode_batches:
                if budget.spent:
                    out.row(4, f"decode {label}, B={b}", SKIPPED)
                    continue
                try:
                    times, keys = measure_decode(
                        llm,
                        b,
                        p.decode_context,
                        p.decode_warmup,
                        p.decode_steps,
                        budget,
                        seed=3000 + b,
                    )
                except BudgetSpent:
                    out.row(4, f"decode {label}, B={b}", SKIPPED)
                    continue
                step = float(np.median(times))
                read = weights + float(np.mean(keys)) * per_token
                bw = read / step
                versus = f"{fmt_bandwidth(bw)} = {share(bw, copy, 'copy')}"
                if b == 256 and copy:
                    versus += f"; goal {DECODE_BANDWIDTH_GOAL:.0%}: {goal_mark(bw >= DECODE_BANDWIDTH_GOAL * copy)}"
                out.row(
                    4,
                    f"decode {label}, B={b}, ctx {p.decode_context}",
                    f"{b / step:,.0f} tok/s ({step * 1e3:.2f} ms/step)",
                    versus,
                    f"median of {len(times)} steps; reads {read / 1e9:.1f} GB/step",
                )
                out.result(
                    4,
                    mode=label,
                    batch=b,
                    context=p.decode_context,
                    step_s=step,
                    tok_s=b / step,
                    bytes_read=read,
                    bytes_per_s=bw,
                    steps=times,
                )
            if last:
                prefill_rows(chk, out, budget, llm)
            measured = True
        finally:
            if last and measured and chk.keep_llm_for_throughput:
                chk.shared_llm = llm
            else:
                llm.shutdown()
            llm = None
            free_memory()


def prefill_rows(chk: Check, out: Report, budget: Budget, llm) -> None:
    """One chunk from scratch, and the longest prompt (its chunks on growing prefixes)."""
    p = chk.plan
    flops_ceiling = chk.matmul_flops()
    longest = llm.engine.max_model_len - 1
    for n, name in ((p.chunk, "one chunk"), (longest, f"{-(-longest // p.chunk)} chunks")):
        try:
            seconds = measure_prefill(llm, n, 2, budget, seed=4000 + n, device=chk.device)
        except BudgetSpent:
            out.row(4, f"prefill of {n:,} tokens", SKIPPED)
            continue
        t = min(seconds)
        flops = prefill_flops(p.model, 0, n) / t
        out.row(
            4,
            f"prefill of a {n:,}-token prompt ({name})",
            f"{n / t:,.0f} tok/s ({t * 1e3:.1f} ms)",
            f"{fmt_flops(flops)} = {share(flops, flops_ceiling, 'matmul')}",
            f"best of {len(seconds)}, add to finish; max_num_batched_tokens {p.chunk}",
        )
        out.result(4, prefill=name, tokens=n, seconds=t, flops_per_s=flops)


# -- §5 offline throughput --------------------------------------------------------------------


def sharegpt_like_workload(
    num: int, input_mean: int, output_mean: int, max_len: int, vocab_size: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and output lengths with ShareGPT's long-tailed shape: lognormal
    lengths (sigma 0.9) around the given means, at least 4 tokens, prompt + output within
    max_len. Fixed by the seed."""
    rng = np.random.default_rng(seed)
    sigma = 0.9

    def lengths(mean: int) -> np.ndarray:
        raw = rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, size=num)
        return np.clip(np.rint(raw), 4, max_len // 2).astype(int)

    ins, outs = lengths(input_mean), lengths(output_mean)
    prompts = token_prompts(rng, ins, vocab_size)
    return prompts, [int(o) for o in outs]


def section_throughput(chk: Check, out: Report, budget: Budget) -> None:
    from engine.sampling_params import SamplingParams

    p = chk.plan
    llm, chk.shared_llm = chk.shared_llm, None
    fresh = llm is None
    try:
        if fresh:
            llm, start_s = start_llm(chk, None)
            out.row(5, "engine start (default)", f"{start_s:.1f} s", note=engine_facts(llm))
        engine = llm.engine
        prompts, outs = sharegpt_like_workload(
            p.requests, p.input_mean, p.output_mean, engine.max_model_len, engine.vocab_size, seed=0
        )
        if fresh:  # warm-up: JIT, autotuning, the allocator (section 4 did it otherwise)
            warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:4], warm, use_tqdm=False)
        params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
        ids = [f"offline-{i}" for i in range(len(prompts))]
        finished, complete = 0, True
        g0 = engine.generation_tokens_total
        t0 = time.perf_counter()
        try:
            for rid, prompt, sp in zip(ids, prompts, params, strict=True):
                engine.add_request(rid, prompt, sp)
            while engine.has_unfinished_requests():
                if budget.spent:
                    complete = False
                    break
                finished += sum(o.finished for o in engine.step())
        finally:
            elapsed = time.perf_counter() - t0
            produced = engine.generation_tokens_total - g0
            if not complete:
                for rid in ids:
                    engine.abort_request(rid)
        if complete and produced != sum(outs):
            raise RuntimeError(f"{produced} output tokens, expected {sum(outs)}")
        tok_s = produced / elapsed
        total_s = (produced + sum(map(len, prompts))) / elapsed
        if p is FULL:
            versus = f"goal {OFFLINE_GOAL_TOK_S:,}: {goal_mark(tok_s >= OFFLINE_GOAL_TOK_S)}"
        else:
            versus = f"(goal {OFFLINE_GOAL_TOK_S:,} is for the full run)"
        note = (
            f"input {np.mean([len(x) for x in prompts]):.0f} / output {np.mean(outs):.0f} "
            f"tokens on average; {total_s:,.0f} tok/s in + out; {elapsed:.1f} s; "
            f"{finished}/{len(prompts)} requests"
        )
        if not complete:
            note += "; stopped at the section budget (partial)"
        out.row(
            5, f"offline output, {len(prompts):,} requests", f"{tok_s:,.0f} tok/s", versus, note
        )
        out.result(
            5,
            requests=len(prompts),
            finished=finished,
            complete=complete,
            output_tokens=produced,
            seconds=elapsed,
            output_tok_s=tok_s,
            total_tok_s=total_s,
        )
    finally:
        if llm is not None:
            llm.shutdown()
        llm = None
        free_memory()


# -- the driver -------------------------------------------------------------------------------

SECTIONS: dict[int, tuple[str, Callable[[Check, Report, Budget], None]]] = {
    1: ("ceilings", section_ceilings),
    2: ("kernel correctness", section_correctness),
    3: ("attention microbenchmark", section_attention),
    4: ("end to end", section_end_to_end),
    5: ("offline throughput", section_throughput),
}


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def print_table(report: Report, meta: dict) -> None:
    print(f"\n## Tessera device check: {meta['device']}, {meta['date']}, {meta['plan']} run\n")
    print(f"`{meta['command']}`; {meta['versions']}\n")
    print("| § | check | result | vs ceiling / goal | note |")
    print("|---|---|---|---|---|")
    for r in report.rows:
        print(
            f"| {r.section} | {_cell(r.check)} | {_cell(r.result)} | {_cell(r.versus)} | {_cell(r.note)} |"
        )
    times = ", ".join(
        f"§{n} {s.status} {s.seconds:.0f} s" for n, s in sorted(report.sections.items())
    )
    print(f"\nsections: {times}; total {meta['total_s']:.0f} s\n", flush=True)


def _on_alarm(signum, frame):
    raise TimeLimit("the run's time limit was reached")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="benchmarks/gpu_check.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--sections",
        type=int,
        nargs="+",
        choices=sorted(SECTIONS),
        default=sorted(SECTIONS),
        help="which sections to run (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and model: a smoke run")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="default: cuda when available, else cpu (only with --quick)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds for the whole run (default: the plan's)",
    )
    return parser


def run_sections(
    sections: list[int], plan: Plan, total: float, started: float, chk: Check, report: Report
) -> None:
    """Each section in its own try: one that fails leaves its error in the table."""
    for num in sorted(set(sections)):
        name, fn = SECTIONS[num]
        rec = report.sections[num] = SectionRecord(name)
        left = total - (time.monotonic() - started)
        if left <= 5:
            rec.status = "skipped"
            report.row(num, name, "skipped: the run's time limit was reached")
            continue
        budget = Budget(min(plan.budgets[num], left))
        progress(f"§{num} {name} (budget {budget.seconds:.0f} s)")
        t = time.monotonic()
        try:
            fn(chk, report, budget)
            rec.status = "ok"
        except Exception as e:  # TimeLimit included
            rec.status = "error"
            rec.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            report.row(num, f"{name}: ERROR", rec.error[:300])
        rec.seconds = time.monotonic() - t
        free_memory()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    if device.type == "cpu" and not args.quick:
        print("gpu_check: the full run needs a GPU; on the CPU use --quick", file=sys.stderr)
        return 2
    plan = QUICK if args.quick else FULL
    total = args.time_limit or plan.total_s
    report = Report()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-gpu-check-") as tmp:
        chk = Check(plan, device, Path(tmp), report)
        chk.keep_llm_for_throughput = 5 in args.sections
        use_alarm = hasattr(signal, "SIGALRM")
        if use_alarm:
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.alarm(max(1, int(total)))
        try:
            run_sections(args.sections, plan, total, started, chk, report)
        except TimeLimit:  # between two sections: the table still comes out
            progress("the run's time limit was reached")
        finally:
            if use_alarm:
                signal.alarm(0)
            if chk.shared_llm is not None:
                chk.shared_llm.shutdown()
                chk.shared_llm = None
    meta = {
        # (timezone.utc, not 3.11's UTC: this line must not be what fails on an older python)
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "command": " ".join(["python3", "benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
        "device": device_description(device)[0],
        "versions": f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton_version()}",
        "plan": plan.name,
        "sections": sorted(set(args.sections)),
        "total_s": time.monotonic() - started,
    }
    print_table(report, meta)
    result = {
        "meta": meta,
        "ceilings": {"copy_bytes_per_s": chk.copy_ceiling, "matmul_flops": chk.matmul_ceiling},
        "goals": {
            "decode_b256_share_of_copy": DECODE_BANDWIDTH_GOAL,
            "offline_output_tok_s": OFFLINE_GOAL_TOK_S,
        },
        "rows": [asdict(r) for r in report.rows],
        "sections": {str(n): asdict(s) for n, s in sorted(report.sections.items())},
    }
    paths = [Path(args.json)] if args.json else []
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "gpu_check.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=str))
        progress(f"figures written to {path}")
    return 0 if all(s.status == "ok" for s in report.sections.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
