"""ModelRunner: owns the model and its paged KV cache on one rank, and runs a step.

execute_model: apply the step's changes to the persistent input batch (engine.worker.
input_batch) -> copy blocks (copy-on-write for forked samples) -> flatten the scheduled
chunks (decodes first, sorted by context length) -> one step over the flattened batch (the
step graph where it takes the step, engine.worker.step_graph: the CPU's one-call decode plan,
cpu_graph, or on CUDA the captured decode graphs, cuda_graph; else the eager forward) ->
logits of each sampling request's last token -> Sampler (on CUDA the sync-free GpuSampler,
engine.layers.gpu_sampler, unless a request asks for logprobs) -> the sampled tokens appended
to the input batch (rank 0; the other ranks get them with the next step, see multiproc.py).

With LoRA enabled (engine.lora) the runner's LoRAManager puts each step's adapters into
resident slots and maps the step's rows to them before the forward; a step with adapters runs
in the CPU decode plan (its GEMMs followed by the C LoRA kernel, engine.kernels.cpu.lora) or
a CUDA graph (captured with the LoRA Triton kernels over fixed segment buffers), unless its
adapters need what the graph does not hold (LoRAManager.graph_blockers: DoRA's rescaling; on
CUDA also embedding and experts' deltas): then eagerly.

Pipeline parallelism (engine.models.pipeline): this rank holds one stage's layers and their
KV cache only. A stage after the first receives the hidden states and residual from the one
before (engine.distributed.pp_recv), a stage before the last sends its own on; the first TP
rank of the last stage samples, and its output goes back to the driver in its reply (it
learns its own tokens, like every rank but the driver, from the next step's payload). Steps
under pipeline parallelism run eager on the CPU (its decode plan runs whole models); on CUDA
each stage replays graphs of its own layers, the previous stage's tensors copied into their
static buffers after the receive (the sends and receives stay outside the graphs).

Speculative decoding (engine.spec_decode): a request scheduled with drafts is a chunk of its
last known token and the drafts (on CUDA a verification graph takes the step, every
request padded to 1 + k tokens, cuda_graph.py; the CPU's decode plan takes it too, the
attention kernel having their rows), its logits are
computed at every one of those positions, and engine.spec_decode.rejection keeps the drafts
the target agrees with and adds one token of its own; on the host sampler, whatever the
device, of the rank that samples (under PP the last stage's first: n-gram drafts only).
With a draft model (engine.spec_decode.draft_model) the runner also holds the draft and its
KV cache (same block ids; kv_block_bytes counts both, copy_blocks copies both); after each
step the draft reads the step's kept tokens and proposes the next drafts
(ModelRunnerOutput.draft_token_ids); an EAGLE head (engine.spec_decode.eagle) reads the
step's hidden states too (EAGLE-3, engine.spec_decode.eagle3: the inputs of three layers,
kept by the eager forward and by CUDA graphs; the CPU's decode plan keeps none, so there
EAGLE-3's steps run eager). The drafter's forwards run in a step graph of its own where the
device has one (DraftModel.build_graph). Under tensor parallelism only the driver holds the
drafter.

With async scheduling (engine.async_scheduling, one rank) execute_model returns a
PendingOutput instead: the sampled ids stay on the device, placeholders stand for them in the
input batch and the next step feeds them from the device (engine.worker.async_output).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention.backends import select_backend
from engine.attention.backends.base import AttentionBackend
from engine.attention.kv_spec import KVCacheSpec
from engine.attention.metadata import CommonAttentionMetadata, common_metadata_from_seqs
from engine.config import EngineConfig
from engine.core.kv_cache_manager import blocks_per_request
from engine.distributed import (
    get_pp_rank,
    get_pp_size,
    get_tp_rank,
    get_tp_size,
    is_first_stage,
    is_last_stage,
    pp_recv,
    pp_send,
    set_expert_parallel,
)
from engine.gguf.source import gguf_source
from engine.layers.gpu_sampler import GpuSampler
from engine.layers.quantization import CHECKPOINT_METHODS
from engine.layers.quantization.checkpoint import (
    apply_checkpoint_methods,
    build_config,
    finish_checkpoint_methods,
)
from engine.layers.quantization.gguf import block_parameters
from engine.layers.quantization.quantize import quantize_model, resolve_method
from engine.layers.sampler import Sampler
from engine.models.loader import load_hf_config, load_model, max_model_len_for, resolve_model
from engine.models.pipeline import IntermediateTensors, layer_range
from engine.options import parse_bytes
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from engine.pooler_config import resolve_runner
from engine.spec_decode.rejection import verify as verify_drafts
from engine.stats import StageStats
from engine.structured_output.bitmask import RowMask
from engine.worker import host_memory
from engine.worker.async_output import (
    PLACEHOLDER,
    AsyncGpuSampler,
    PendingOutput,
    PrevTokens,
    TokenCopies,
)
from engine.worker.cpu_graph import DecodePlan
from engine.worker.cuda_graph import (
    MAX_CAPTURE_SIZE,
    CudaGraphRunner,
    ReplayGraphRunner,
    aux_module,
)
from engine.worker.input_batch import CachedRequestState, InputBatch, SamplingTensors
from engine.worker.pooler import pool_step
from engine.worker.prompt_logprobs import compute_prompt_logprobs
from engine.worker.step_graph import (
    StepGraph,
    StepGraphConfig,
    StepInputs,
    build_eager_inputs,
    run_step,
)
from engine.worker.step_threads import StepThreads

if TYPE_CHECKING:
    from engine.structured_output.manager import GrammarBitmask

logger = logging.getLogger("tessera.engine")

_CPU_KV_SHARE = 0.2  # of MemAvailable, when neither num_blocks nor kv_cache_memory is given
_CPU_KV_CAP = 8 << 30
_KV_MEMORY_ENV = "TESSERA_KV_CACHE_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


# A rank's index among the ranks on its node, and their number (a Ray actor sees only the GPU
# its bundle holds: local rank 0 of 1); unset: the global rank and world size.
LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV = "TESSERA_LOCAL_RANK", "TESSERA_LOCAL_WORLD_SIZE"


def resolve_device(device: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """The device tensor-parallel rank `rank` runs on: auto = CUDA when there is one; on
    CUDA each rank gets its own GPU, cuda:<rank> (one node: the rank is the local rank)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda":
        return torch.device(device)
    if not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    if LOCAL_RANK_ENV in os.environ:  # placed by Ray (ray_executor): its GPUs, its index
        rank = int(os.environ[LOCAL_RANK_ENV])
        world_size = int(os.environ.get(LOCAL_WORLD_SIZE_ENV, "1"))
    check_visible_gpus(world_size, torch.cuda.device_count())
    return torch.device("cuda", rank)


def check_visible_gpus(world_size: int, visible: int) -> None:
    """One GPU per tensor-parallel rank: say so at start rather than stack ranks on one."""
    if world_size > visible:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ValueError(
            f"tensor_parallel_size {world_size} needs {world_size} GPUs, one per rank, but "
            f"{visible} {'is' if visible == 1 else 'are'} visible{where}: lower "
            "--tensor-parallel-size or make more GPUs visible"
        )


def tune_malloc() -> None:
    """Keep large freed blocks in glibc's heap instead of returning them to the OS.

    By default every allocation over 32 MiB (the logits of a big batch, the float32 copy the
    sampler reads) is a fresh mmap, and touching it costs ~12k page faults: ~18 ms a step at
    256 sequences. Process-wide; TESSERA_TUNE_MALLOC=0 leaves the allocator alone.
    """
    if os.environ.get("TESSERA_TUNE_MALLOC", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 256 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 512 << 20)
    except (OSError, AttributeError):
        pass


def release_freed_heap() -> None:
    """Return the heap's free pages to the OS once, after loading: tune_malloc keeps freed
    blocks of up to 512 MiB in the heap, which at load are the float weights a quantized
    model dropped (the bundled model: ~200 MiB of 410 MiB resident). glibc only."""
    if platform.libc_ver()[0] != "glibc":
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _spec_mask(
    grammar_bitmask: GrammarBitmask | None, spec: list[ScheduledRequest]
) -> RowMask | None:
    """The verification's grammar masks: each constrained drafted request's bitmask rows
    (1 + len(drafts), in order) at its rows of the verified logits."""
    if grammar_bitmask is None:
        return None
    base, at = {}, 0
    for r in spec:
        base[r.request_id] = at
        at += 1 + len(r.spec_token_ids)
    rows, keep, seen = [], [], {}
    for j, rid in enumerate(grammar_bitmask.request_ids):
        if rid in base:
            rows.append(base[rid] + seen.get(rid, 0))
            seen[rid] = seen.get(rid, 0) + 1
            keep.append(j)
    if not rows:
        return None
    bitmask = grammar_bitmask.result()
    return RowMask(rows, bitmask[keep] if len(keep) < bitmask.shape[0] else bitmask)


def _row_mask(grammar_bitmask: GrammarBitmask | None, to_sample: list[str]) -> RowMask | None:
    """The step's grammar bitmask (filled by the engine while the forward ran; this waits for
    it) as rows of the sampling list. Only the driver samples, so only it reads the mask."""
    if grammar_bitmask is None:
        return None
    bitmask = grammar_bitmask.result()
    position = {rid: i for i, rid in enumerate(to_sample)}
    keep = [j for j, rid in enumerate(grammar_bitmask.request_ids) if rid in position]
    if not keep:
        return None
    if len(keep) < len(grammar_bitmask.request_ids):
        bitmask = bitmask[keep]
    return RowMask([position[grammar_bitmask.request_ids[j]] for j in keep], bitmask)


def _wants_drafts(state: CachedRequestState) -> bool:
    """Whether the scheduler would schedule drafts for the request (Scheduler._propose):
    none for n > 1 samples, seeded or grammar-constrained ones."""
    sp = state.sampling_params
    return sp.n == 1 and sp.seed is None and sp.structured_outputs is None


def kv_cache_memory_from_env() -> int | None:
    """TESSERA_KV_CACHE_MEMORY, the server's --kv-cache-memory variable: an engine built
    without the option (LLM(...), a benchmark) reads it too, so one variable sizes every
    engine of a process tree (the test suite sets it: at a share of RAM, each of its engines
    would commit gigabytes)."""
    text = os.environ.get(_KV_MEMORY_ENV)
    if not text:
        return None
    try:
        budget = parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"{_KV_MEMORY_ENV}: {e}") from None
    if budget <= 0:
        raise ValueError(f"{_KV_MEMORY_ENV} must be a positive size, got {text!r}")
    return budget


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path | None = None, rank: int = 0):
        self.config = config
        self.rank = rank
        self.model_dir = (
            Path(model_dir)
            if model_dir
            else resolve_model(config.model.model, load_format=config.model.load_format)
        )
        self.hf_config = load_hf_config(self.model_dir)
        # pooling: the model has no LM head, and its requests are pooled, never sampled
        self.runner = resolve_runner(
            config.model.runner, self.model_dir, self.hf_config.architecture
        )
        tp = config.parallel.tensor_parallel_size
        pp = config.parallel.pipeline_parallel_size
        self.device = resolve_device(config.model.device, rank, tp * pp)
        if self.device.type == "cuda":  # this rank's GPU is the current one (kernel launches)
            torch.cuda.set_device(self.device)
        self.block_size = config.cache.block_size
        # Raises if the requested length exceeds what the model allows (max_position_embeddings).
        self.max_model_len = max_model_len_for(
            self.hf_config, config.model.max_model_len or config.scheduler.max_model_len
        )
        if get_tp_size() != tp or get_pp_size() != pp:
            raise ValueError(
                f"tensor_parallel_size is {tp} and pipeline_parallel_size {pp}, but this "
                f"process is in a group of {get_tp_size()} x {get_pp_size()}: call "
                "engine.distributed.init_distributed() before building the runner"
            )
        self.pp_size = pp
        # This stage's layers; the rank that samples: the last stage's first TP rank.
        start, end = layer_range(self.hf_config.num_hidden_layers, get_pp_rank(), pp)
        self.num_layers = end - start
        self.samples = is_last_stage() and get_tp_rank() == 0
        self.num_kv_heads = self.hf_config.num_key_value_heads // tp
        self.model: torch.nn.Module | None = None
        self.quantization: str | None = None  # the method the model loaded with (resolve_method)
        self.dtype: torch.dtype | None = None
        self.kv_caches: list[torch.Tensor] = []  # as allocated (block copies index these)
        self.kv_scales: list[torch.Tensor] = []  # where the KV dtype keeps scales: one per layer
        self.num_blocks = 0
        self.sampler = Sampler(seed=config.model.seed)
        # On CUDA the sampling parameters also live on the device, for the sync-free sampler.
        on_gpu = self.device.type == "cuda"
        params = SamplingTensors(self.device) if on_gpu else None
        self.input_batch = InputBatch(params)  # the requests this rank holds, across steps
        # Async scheduling: the engine resolved the option (engine.async_scheduling).
        self.async_scheduling = bool(config.scheduler.async_scheduling)
        sampler_cls = AsyncGpuSampler if self.async_scheduling else GpuSampler
        self.gpu_sampler = sampler_cls(params, seed=config.model.seed) if params else None
        self._prev: PrevTokens | None = None  # the last step's ids, on the device
        self._spec_generator: torch.Generator | None = None  # draft acceptance draws
        self._copies = TokenCopies(self.device)
        self.attn_backend: AttentionBackend | None = None  # chosen when the model loads
        self._threads: StepThreads | None = None  # CPU only: set when the model loads
        # A planned or captured step over static buffers (engine.worker.step_graph), built
        # once the KV cache is bound: run(StepInputs) -> hidden, or None for the steps it
        # does not take. The CPU's is the one-call decode plan; other devices' CUDA graphs.
        self._graph_type: type[StepGraph] = (
            DecodePlan if self.device.type == "cpu" else CudaGraphRunner
        )
        if os.environ.get("TESSERA_STEP_GRAPH") == "replay":  # CUDA graphs' logic anywhere
            self._graph_type = ReplayGraphRunner
        self._step_graph: StepGraph | None = None
        self._graph_reserve: int | None = None  # bytes the profiled budget kept for graphs
        self.lora_manager = None  # engine.lora.manager.LoRAManager, when LoRA is enabled
        self.drafter = None  # engine.spec_decode.draft_model.DraftModel (or EAGLE's), if any
        self._step_hidden: tuple[torch.Tensor, dict[str, int]] | None = None
        # Cumulative step time (stage_stats): steps run, seconds in execute_model, and of
        # those waiting for the previous stage's activations and sending them on.
        self._steps, self._step_s, self._recv_s, self._send_s = 0, 0.0, 0.0, 0.0

    # -- set-up ---------------------------------------------------------------------------

    def load_model(self) -> None:
        m = self.config.model
        if self.device.type == "cpu":
            tune_malloc()
            self._threads = StepThreads(self.config.parallel.frontend_threads)
        gguf = gguf_source(m.model)
        qcfg = self.hf_config.quantization_config
        self.quantization, why = resolve_method(
            m.quantization,
            gguf,
            self.device,
            m.load_format,
            get_tp_size() * self.pp_size,
            checkpoint=qcfg,
        )
        # a checkpoint format: validated now, its layers' methods given before the weights load
        ckpt = (
            build_config(self.quantization, qcfg)
            if self.quantization in CHECKPOINT_METHODS
            else None
        )
        if self.quantization == "gguf" and self.pp_size > 1:
            raise ValueError(
                "--quantization gguf (a GGUF file's blocks) runs on one rank: drop "
                "--pipeline-parallel-size, or load the float weights (--quantization none)"
            )

        def blocks_first(model: torch.nn.Module) -> set[str]:
            # the file's blocks go in before the float weights, which then skip those layers:
            # their float copies are never read (the bundled model's load peak 825 -> 416 MiB)
            quantize_model(model, "gguf", gguf_path=gguf)
            return block_parameters(model)

        prepare = None
        if self.quantization == "gguf":
            prepare = blocks_first
        elif ckpt is not None:  # the checkpoint's tensors, not float weights, in those layers
            prepare = functools.partial(apply_checkpoint_methods, config=ckpt)
        set_expert_parallel(self.config.parallel.enable_expert_parallel)
        self.model = load_model(
            self.model_dir,
            dtype=m.dtype,
            load_format=m.load_format,
            device=self.device,
            max_position=self.max_model_len,
            seed=m.seed,
            prepare=prepare,
            runner=self.runner,
        )
        self.dtype = self.model.model.own_layers()[0].input_layernorm.weight.dtype
        if ckpt is not None:
            finish_checkpoint_methods(self.model, ckpt)
        elif self.quantization != "gguf":
            quantize_model(self.model, self.quantization, gguf_path=gguf)
        if self.config.lora.enabled:
            from engine.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(
                self.model, self.hf_config, self.config.lora, self.dtype, self.device
            )
        if self.device.type == "cpu":
            release_freed_heap()
        head_dim = self.hf_config.head_dim
        choice = select_backend(
            m.attention_backend,
            self.device,
            self.dtype,
            self.config.cache.kv_cache_dtype,
            self.num_kv_heads,
            head_dim,
        )
        self.attn_backend = choice.backend(
            self.block_size,
            self.hf_config.num_attention_heads // get_tp_size(),
            self.num_kv_heads,
            head_dim,
            self.dtype,
            self.device,
        )
        for attn in self.model.attention_layers():
            attn.backend = self.attn_backend
        self._log_kv_scales()
        self._load_drafter()
        if self.rank == 0:
            logger.info(
                "Model %s loaded: %s%s (%s) on %s; attention backend: %s (%s)",
                self.model_dir.name,
                str(self.dtype).removeprefix("torch."),
                f" with {self.quantization} weights" if self.quantization else "",
                why,
                self.device,
                self.attn_backend.name,
                choice.reason,
            )

    def _log_kv_scales(self) -> None:
        """Say whether a checkpoint's calibrated KV-cache scales (FP8-KV) are in use."""
        layers = self.model.attention_layers()
        scaled = sum(a.checkpoint_kv_scales for a in layers)
        if not scaled or self.rank != 0:
            return
        kv_dtype = self.config.cache.kv_cache_dtype
        if kv_dtype == "fp8":
            logger.info("fp8 KV cache with the checkpoint's K/V scales (%d of %d layers; the "
                        "others 1.0)", scaled, len(layers))  # fmt: skip
        else:
            logger.info("The checkpoint's KV-cache scales (%d layers) are unused: the %s cache "
                        "keeps K/V %s; --kv-cache-dtype fp8 (triton backend) stores them with "
                        "those scales", scaled, kv_dtype,
                        "exactly" if kv_dtype == "auto" else "with its own per-row scales")  # fmt: skip

    def _load_drafter(self) -> None:
        """A draft model or EAGLE head beside the target (same device and dtype). Under
        tensor parallelism it lives on the driver alone, whole (draft TP 1: its drafts reach
        every rank in the next step's payload; the other ranks only help gather the target's
        vocabulary tables an EAGLE head reads), or, a draft model with
        draft_tensor_parallel_size the target's, split over the ranks as the target is:
        every rank holds its shard and its KV cache's, and runs the step's draft forwards
        (DraftModel.follow)."""
        spec = self.config.scheduler.speculative_config
        if spec is None or not spec.uses_model:
            return
        from engine.distributed import single_rank
        from engine.spec_decode.draft_model import DraftModel
        from engine.spec_decode.eagle import EagleProposer, target_vocab
        from engine.spec_decode.eagle3 import Eagle3Proposer

        extra: tuple = ()
        if spec.method in ("eagle", "eagle3"):  # (every rank: an all-gather under TP)
            extra = (self.model, target_vocab(self.model, lm_head=spec.method == "eagle"))
        sharded = (spec.draft_tensor_parallel_size or 1) > 1
        if self.rank != 0 and not sharded:
            return
        cls = {"eagle": EagleProposer, "eagle3": Eagle3Proposer}.get(spec.method, DraftModel)
        m = self.config.model
        with contextlib.nullcontext() if sharded else single_rank():
            self.drafter = cls(
                *extra,
                spec.model,
                spec.num_speculative_tokens,
                self.hf_config,
                self.device,
                self.dtype,
                self.block_size,
                self.max_model_len,
                m.attention_backend,
                self.config.cache.kv_cache_dtype,
                m.seed,
            )
        self.drafter.sharded = sharded

    @property
    def _aux_hidden_eager(self) -> bool:
        """An EAGLE-3 head reads layers' inputs, which the modules' forward keeps and CUDA
        graphs keep as outputs of their own (keeps_aux_hidden), the CPU's decode plan not:
        there every step eager on every rank (the ranks' steps stay alike)."""
        spec = self.config.scheduler.speculative_config
        reads = spec is not None and spec.method == "eagle3"
        return reads and not self._graph_type.keeps_aux_hidden

    def kv_cache_spec(self) -> KVCacheSpec:
        """The KV cache's layout for --kv-cache-dtype, as the attention backend lays it out."""
        assert self.attn_backend is not None, "load_model() first"
        return self.attn_backend.kv_cache_spec(self.config.cache.kv_cache_dtype)

    def kv_block_bytes(self) -> int:
        """Bytes one block takes across all layers (K and V, scales included) on this rank;
        with a draft model, its cache's too (the same block ids address both)."""
        own = self.num_layers * self.kv_cache_spec().bytes_per_block
        return own + (self.drafter.kv_block_bytes() if self.drafter is not None else 0)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            num = cache.num_blocks
        else:
            budget = cache.kv_cache_memory or kv_cache_memory_from_env()
            if budget is None and self.device.type == "cuda":
                budget = self._profile_cuda_budget()
            elif budget is None:
                budget = min(int(mem_available_bytes() * _CPU_KV_SHARE), _CPU_KV_CAP)
            num = budget // self.kv_block_bytes()
        self._check_fits(num)
        return num

    def _profile_cuda_budget(self) -> int:
        """GPU bytes left for the KV cache (engine.worker.kv_budget): measured around the
        largest step the scheduler can send, then the arithmetic."""
        from engine.worker.kv_budget import GpuMemoryProfile, kv_cache_budget

        assert self.model is not None and self.attn_backend is not None
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        self._profile_step()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        torch.cuda.empty_cache()  # the step's activations go back: "in use" is what stays
        free, total = torch.cuda.mem_get_info(dev)
        profile = GpuMemoryProfile(
            total=total,
            free=free,
            torch_allocated=torch.cuda.memory_allocated(dev),
            peak_growth=max(0, peak - before),
        )
        blocks = self._blocks_per_request() + 1  # one request + block 0
        self._graph_reserve = self.graph_reserve_bytes()
        budget = kv_cache_budget(
            profile,
            self.config.cache.gpu_memory_utilization,
            blocks * self.kv_block_bytes(),
            graph_reserve=self._graph_reserve,
        )
        if self.rank == 0:
            logger.info(
                "GPU memory: %.2f GiB total, %.2f GiB in use after loading, activation peak "
                "%.2f GiB, CUDA graphs reserve %.2f GiB: %.2f GiB for the KV cache",
                total / 2**30,
                profile.in_use / 2**30,
                profile.peak_growth / 2**30,
                self._graph_reserve / 2**30,
                budget / 2**30,
            )
        return budget

    def step_graph_config(self) -> StepGraphConfig:
        """What the step graph is built and reserved for (load_model first)."""
        assert self.attn_backend is not None and self.dtype is not None
        cfg = self.config
        spec = cfg.scheduler.speculative_config
        aux = aux_module(self.model)  # an EAGLE-3 head's layers, kept by the graphs too
        return StepGraphConfig(
            backend=self.attn_backend,
            device=self.device,
            dtype=self.dtype,
            hf_config=self.hf_config,
            num_kv_heads=self.num_kv_heads,
            max_num_seqs=cfg.scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            enforce_eager=cfg.model.enforce_eager,
            tp_size=get_tp_size(),
            log=self.rank == 0,
            verify_len=1 + spec.num_speculative_tokens if spec is not None else 0,
            piece_tokens=(
                min(cfg.scheduler.max_num_batched_tokens, MAX_CAPTURE_SIZE)
                if cfg.model.cudagraph_mode == "full_and_piecewise"
                else 0
            ),
            aux_outputs=len(aux.aux_hidden_layers) if aux is not None else 0,
            first_stage=is_first_stage(),
            last_stage=is_last_stage(),
        )

    def graph_reserve_bytes(self) -> int:
        """The step graph's device memory, reserved before the cache is sized (it is built
        after): the CUDA graphs' pool where they will be captured, else 0."""
        config = self.step_graph_config()
        draft = 0
        if self.drafter is not None and self.drafter.graphs:  # its own graphs (build_graph)
            draft = self._graph_type.reserve_bytes(self.drafter.step_graph_config(config))
        if (self.pp_size > 1 and not self._graph_type.runs_stages) or self._aux_hidden_eager:
            return draft  # eager steps (_build_step_graph)
        return self._graph_type.reserve_bytes(config) + draft

    @torch.inference_mode()
    def _profile_step(self) -> torch.Tensor:
        """The largest step: a prefill of the whole token budget (no KV cache yet: it writes
        nowhere), then the logits of max_num_seqs rows (with speculative decoding, of every
        draft position the budget allows) and the sampler's float32 probabilities."""
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        common = common_metadata_from_seqs(
            [(0, n, [0] * (-(-n // self.block_size)))], self.block_size
        )
        meta = self.attn_backend.build_metadata(common)
        hidden = self.model(ids, pos, meta, self._dummy_intermediate(n))
        if not is_last_stage():  # a stage before the last: no LM head (measured apart)
            return hidden.hidden
        if self.runner == "pooling":  # no LM head: the hidden states are the output
            return hidden
        num_rows = self.config.scheduler.max_num_seqs
        spec = self.config.scheduler.speculative_config
        if spec is not None:  # verification: logits at every draft position (budget-bound)
            num_rows = max(num_rows, min(num_rows * (1 + spec.num_speculative_tokens), n))
        rows = torch.arange(num_rows, device=self.device) % n
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        torch.softmax(logits.float(), dim=-1)
        return logits

    def _dummy_intermediate(self, n: int) -> IntermediateTensors | None:
        """Zeros standing for the previous stage's output (a profile run's input)."""
        if is_first_stage():
            return None
        shape = (n, self.hf_config.hidden_size)
        z = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return IntermediateTensors(z, z.clone())

    def device_info(self) -> tuple[str, int | None]:
        """(this rank's device, the process's current CUDA device or None): where it runs."""
        current = torch.cuda.current_device() if self.device.type == "cuda" else None
        return str(self.device), current

    def _blocks_per_request(self) -> int:
        """The most blocks one request holds (engine.core.kv_cache_manager): its context, or
        where every layer has a sliding window and prefill is chunked, its window and chunk."""
        sched = self.config.scheduler
        return blocks_per_request(
            self.max_model_len,
            self.block_size,
            self.hf_config.kv_sliding_window(),
            sched.max_num_batched_tokens if sched.enable_chunked_prefill else None,
        )

    def _check_fits(self, num_blocks: int) -> None:
        usable = (num_blocks - 1) * self.block_size  # block 0 is reserved
        per_request = self._blocks_per_request()
        if num_blocks - 1 < per_request:
            need = (per_request + 1) * self.kv_block_bytes()
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {self.block_size} tokens, {max(usable, 0)} "
                f"usable tokens) cannot hold one request of max_model_len {self.max_model_len} "
                f"tokens ({per_request} blocks): lower --max-model-len to at most "
                f"{max(usable, 0)}, or raise --kv-cache-memory to at least {need} bytes "
                f"({need / 2**20:.1f} MiB)"
            )

    def init_kv_cache(self, num_blocks: int) -> None:
        assert self.model is not None, "load_model() first"
        self._check_fits(num_blocks)
        spec = self.kv_cache_spec()
        kv = spec.allocate(num_blocks, self.device, num_layers=self.num_layers, zeros=self._zeros)
        self.kv_caches, self.kv_scales = kv.storage, kv.scales
        for i, attn in enumerate(self.model.attention_layers()):
            attn.kv_cache, attn.kv_scales = kv.layer(i)
            attn.kv_spec = spec
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks, self._zeros)
        self.num_blocks = num_blocks
        self._step_graph = self._build_step_graph()
        if self.drafter is not None and self.drafter.graphs:
            self.drafter.build_graph(self._graph_type, self.step_graph_config())
        self._log_graph_pool()
        tokens = (num_blocks - 1) * self.block_size
        if self.rank == 0:
            logger.info(
                "KV cache: %d blocks (%d tokens, %s); max concurrency at %d tokens/request: %.2f",
                num_blocks,
                tokens,
                str(spec.cache_dtype).removeprefix("torch."),
                self.max_model_len,
                tokens / self.max_model_len,
            )

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A KV cache tensor: on the CPU in huge pages (host_memory says why)."""
        if self.device.type == "cpu":
            return host_memory.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _log_graph_pool(self) -> None:
        """The captured graphs' measured pool against what the KV budget reserved for it."""
        graphs = [self._step_graph, self.drafter.graph if self.drafter is not None else None]
        graphs = [g for g in graphs if g is not None]
        reserve = self._graph_reserve
        if not graphs or reserve is None or self.rank != 0:  # reserved on CUDA only
            return
        measured = sum(g.graph_bytes for g in graphs)
        if measured > reserve:
            logger.warning(
                "CUDA graphs took %.0f MiB, over the %.0f MiB the KV budget reserved: the "
                "device may run out of memory under load; lower --gpu-memory-utilization",
                measured / 2**20,
                reserve / 2**20,
            )
        else:
            logger.info(
                "CUDA graphs took %.0f MiB of the %.0f MiB reserved",
                measured / 2**20,
                reserve / 2**20,
            )

    def _build_step_graph(self) -> StepGraph | None:
        if self._step_graph is not None:  # a re-bound cache: the old graph reads the old one
            self._step_graph.close()
        if self.pp_size > 1 and not self._graph_type.runs_stages:
            # The CPU's decode plan runs a whole model from ids to hidden; a stage starts
            # from (or ends with) intermediate tensors: eager. CUDA graphs run stages.
            if self.rank == 0:
                logger.info("Pipeline parallel: every step eager (no step graph)")
            return None
        if self._aux_hidden_eager:
            if self.rank == 0:
                logger.info("EAGLE-3: every step eager (the head reads the layers' inputs)")
            return None
        return self._graph_type.build(self.model, self.step_graph_config())

    # -- a step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every layer's K/V of block src into dst; all copies read the pre-copy state."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        drafts = self.drafter.cache_tensors() if self.drafter is not None else ()
        for t in (*self.kv_caches, *self.kv_scales, *drafts):
            t.index_copy_(1, dst, t.index_select(1, src))

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        """The step's output; with async scheduling a PendingOutput for a step that samples."""
        start = time.perf_counter()
        if self.async_scheduling:
            out = self._execute_async(scheduler_output)
        else:
            out = self._execute(scheduler_output)
            if self.drafter is not None and scheduler_output.scheduled and self.rank != 0:
                self.drafter.follow(self.input_batch.requests)  # a sharded draft's other rank
            elif self.drafter is not None and scheduler_output.scheduled:
                hidden, last_row = self._step_hidden or (None, None)
                out.draft_token_ids = self.drafter.propose(
                    scheduler_output.scheduled,
                    self.input_batch.requests,
                    out.sampled_token_ids,
                    _wants_drafts,
                    hidden,
                    last_row,
                )
            self._step_hidden = None
        if self._threads is not None:
            self._threads.finish()  # while it measures small steps (step_threads)
        self._steps += bool(scheduler_output.scheduled)
        self._step_s += time.perf_counter() - start
        return out

    def stage_stats(self) -> StageStats:
        """This rank's step time so far (cumulative: difference two to time a run)."""
        return StageStats(
            rank=self.rank,
            pp_rank=get_pp_rank(),
            steps=self._steps,
            step_s=self._step_s,
            input_wait_s=self._recv_s,
            send_s=self._send_s,
            graph_steps=self._graph_steps(),
        )

    def _graph_steps(self) -> int:
        """The steps this rank's step graph has taken (0 without one)."""
        graph = self._step_graph
        kinds = ("runs", "verify_runs", "piece_runs")
        return sum(sum(getattr(graph, kind, {}).values()) for kind in kinds)

    def _begin_step(self, so: SchedulerOutput) -> bool:
        """Apply the step's changes to the input batch and the cache; whether it runs."""
        assert self.model is not None and self.attn_backend is not None and self.kv_caches
        if so.finished_request_ids or so.preempted_request_ids:
            self.sampler.drop([*so.finished_request_ids, *so.preempted_request_ids])
        self.input_batch.update(so)
        if so.blocks_to_copy:
            self.copy_blocks(so.blocks_to_copy)
        if not so.scheduled:
            return False
        if self._threads is not None:
            self._threads.apply(so.num_batched_tokens)
        return True

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if not self._begin_step(so):
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self.input_batch
        hidden, last_row = self._forward(so.scheduled)
        if self.drafter is not None:  # an EAGLE head reads the step's hidden states
            self._step_hidden = (self.drafter.step_features(hidden), last_row)
        sampled = {r.request_id: [] for r in so.scheduled}
        prompt_lps = self._prompt_logprobs(hidden, so.scheduled, last_row)
        out = ModelRunnerOutput(sampled_token_ids=sampled, prompt_logprobs=prompt_lps)
        if hidden is None:  # a stage before the last: the last stage samples
            return out
        if self.runner == "pooling":  # nothing is sampled: the finished prompts' vectors
            if self.samples:
                out.pooled = pool_step(hidden, so.scheduled, last_row, batch.requests)
            return out
        spec = [r for r in so.scheduled if r.spec_token_ids]
        if (
            spec
            and self._verify_drafts(hidden, last_row, spec, out, so.grammar_bitmask)
            and self.rank == 0
        ):
            batch.append_sampled({r.request_id: sampled[r.request_id] for r in spec})
        to_sample = [r.request_id for r in so.scheduled if r.sample and not r.spec_token_ids]
        if not to_sample:
            return out
        states = [batch[rid] for rid in to_sample]
        if self.gpu_sampler is not None:
            drawn = self._sample_on_device(hidden, last_row, to_sample, states, so.grammar_bitmask)
            if drawn is None:  # not the driver: it ran the LM head's collectives, no more
                return out
            tokens, logprobs = drawn
        else:
            rows = torch.tensor(
                self._head_rows([last_row[rid] for rid in to_sample]), device=self.device
            )
            last = hidden.index_select(0, rows)
            greedy = self.model.greedy_tokens(last) if self.sampler.plain_greedy(states) else None
            if greedy is not None:  # argmax in the LM head's GEMM: no logits (one rank only)
                tokens, logprobs = [[t] for t in greedy.tolist()], [None] * len(states)
            else:
                logits = self.model.compute_logits(last)
                if not self.samples:  # one rank samples; the others ran the collectives
                    return out
                mask = _row_mask(so.grammar_bitmask, to_sample)
                tokens, logprobs = self.sampler(logits, states, mask)
        for rid, toks, lps in zip(to_sample, tokens, logprobs, strict=True):
            sampled[rid] = toks
            if lps is not None:
                out.logprobs[rid] = lps
        if self.rank == 0:
            batch.append_sampled({rid: sampled[rid] for rid in to_sample})
        return out

    def _verify_drafts(
        self,
        hidden: torch.Tensor,
        last_row: dict[str, int],
        spec: list[ScheduledRequest],
        out: ModelRunnerOutput,
        grammar_bitmask: GrammarBitmask | None = None,
    ) -> bool:
        """Logits at each drafted request's last len(drafts) + 1 rows, then the rejection
        sampler (engine.spec_decode.rejection): the kept drafts and one more token into out,
        a constrained request's positions under its grammar's masks (the bitmask's rows for
        it, one per position). Every rank computes the logits (the LM head's collectives);
        only the rank that samples verifies (returns True): the driver, or under PP the last
        stage's first."""
        rows: list[int] = []
        for r in spec:
            last, k = last_row[r.request_id], len(r.spec_token_ids)
            rows.extend(range(last - k, last + 1))
        index = torch.tensor(self._head_rows(rows), dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        if not self.samples:
            return False
        states = [self.input_batch[r.request_id] for r in spec]
        if self._spec_generator is None:
            self._spec_generator = torch.Generator(self.device).manual_seed(self.config.model.seed)
        tokens, logprobs = verify_drafts(
            logits,
            states,
            [r.spec_token_ids for r in spec],
            self.sampler,
            self._spec_generator,
            _spec_mask(grammar_bitmask, spec),
        )
        for r, toks, lps in zip(spec, tokens, logprobs, strict=True):
            out.sampled_token_ids[r.request_id] = toks
            if lps is not None:
                out.logprobs[r.request_id] = lps
        return True

    def _execute_async(self, so: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        """The step without waiting for its ids: each sampled request gets a placeholder in
        the input batch, the ids stay on the device for the next step (self._prev) and go to
        the host in the background (engine.worker.async_output)."""
        assert self.rank == 0, "async scheduling runs on one rank"
        assert self.runner != "pooling", "a pooling engine runs with async scheduling off"
        if not self._begin_step(so):
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self.input_batch
        hidden, last_row = self._forward(so.scheduled)
        scheduled = [r.request_id for r in so.scheduled]
        prompt_lps = self._prompt_logprobs(hidden, so.scheduled, last_row)
        to_sample = [r.request_id for r in so.scheduled if r.sample]
        if not to_sample:
            return ModelRunnerOutput(
                sampled_token_ids={rid: [] for rid in scheduled}, prompt_logprobs=prompt_lps
            )
        states = [batch[rid] for rid in to_sample]
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if self.gpu_sampler is not None:
            device_ids, logits = self._draw_on_device(
                hidden, last_row, to_sample, states, so.grammar_bitmask
            )
            tokens = self._copies.start(device_ids)
            if logits is not None and any(s.sampling_params.logprobs is not None for s in states):
                rows = [
                    row[: s.num_samples] for row, s in zip(tokens.tolist(), states, strict=True)
                ]
                # (logprobs need the ids on the host: this step waits for them)
                lps = self.gpu_sampler.logprobs(logits, states, rows)
                logprobs = {rid: lp for rid, lp in zip(to_sample, lps, strict=True) if lp}
            first = device_ids[:, 0].long()  # (an argmax kernel's ids may be int32)
        else:
            rows_t = torch.tensor(
                self._head_rows([last_row[rid] for rid in to_sample]), device=self.device
            )
            last = hidden.index_select(0, rows_t)
            greedy = self.model.greedy_tokens(last) if self.sampler.plain_greedy(states) else None
            if greedy is not None:
                tokens, first = [[t] for t in greedy.tolist()], greedy.long()
            else:
                mask = _row_mask(so.grammar_bitmask, to_sample)
                tokens, lps = self.sampler(self.model.compute_logits(last), states, mask)
                logprobs = {rid: lp for rid, lp in zip(to_sample, lps, strict=True) if lp}
                first = torch.tensor([t[0] for t in tokens], dtype=torch.long)
        self._prev = PrevTokens(first, {rid: i for i, rid in enumerate(to_sample)})
        slots = []
        for state in states:  # one placeholder each (a parent's first keeps only its first)
            slots.append(len(state.output_token_ids))
            state.append_tokens([PLACEHOLDER])
        return PendingOutput(
            batch,
            scheduled,
            to_sample,
            states,
            slots,
            tokens,
            [s.num_samples for s in states],
            logprobs,
            prompt_lps,
        )

    def _draw_on_device(
        self,
        hidden: torch.Tensor,
        last_row: dict[str, int],
        to_sample: list[str],
        states: list[CachedRequestState],
        grammar_bitmask: GrammarBitmask | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled ids [S, m] on the device, and the logits (None for plain greedy)."""
        sampler = self.gpu_sampler
        assert isinstance(sampler, AsyncGpuSampler) and self.input_batch.sampling is not None
        columns = self.input_batch.sampling.column
        rows = sampler.stage(
            [last_row[rid] for rid in to_sample],
            [columns[rid] for rid in to_sample],
            [len(s.output_token_ids) for s in states],
        )
        self._head_rows([last_row[rid] for rid in to_sample])
        last = hidden.index_select(0, rows.hidden_rows)
        greedy = self.model.greedy_tokens(last) if Sampler.plain_greedy(states) else None
        logits = self.model.compute_logits(last) if greedy is None else None
        mask = _row_mask(grammar_bitmask, to_sample) if logits is not None else None
        return sampler.sample_on_device(logits, states, rows, greedy, mask), logits

    def _sample_on_device(
        self,
        hidden: torch.Tensor,
        last_row: dict[str, int],
        to_sample: list[str],
        states: list[CachedRequestState],
        grammar_bitmask: GrammarBitmask | None = None,
    ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]] | None:
        """The GPU sampler's tokens and logprobs (None on ranks other than the driver): the
        step's rows in one copy, the LM head (its argmax alone for plain greedy steps), the
        draw, and one wait for the ids' copy back."""
        assert self.gpu_sampler is not None and self.input_batch.sampling is not None
        columns = self.input_batch.sampling.column
        rows = self.gpu_sampler.stage(
            [last_row[rid] for rid in to_sample],
            [columns[rid] for rid in to_sample],
            [len(s.output_token_ids) for s in states],
        )
        self._head_rows([last_row[rid] for rid in to_sample])
        last = hidden.index_select(0, rows.hidden_rows)
        greedy = self.model.greedy_tokens(last) if Sampler.plain_greedy(states) else None
        logits = None
        if greedy is None:
            logits = self.model.compute_logits(last)
            if not self.samples:
                return None
        mask = _row_mask(grammar_bitmask, to_sample) if logits is not None else None
        tokens = self.gpu_sampler.sample(logits, states, rows, greedy, mask).tolist()
        if logits is None or all(s.sampling_params.logprobs is None for s in states):
            return tokens, [None] * len(states)
        return tokens, self.gpu_sampler.logprobs(logits, states, tokens)

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor | None,
        scheduled: list[ScheduledRequest],
        last_row: dict[str, int],
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """The prompt logprobs of this step's prompt rows, for the requests that ask
        (engine.worker.prompt_logprobs); every rank of the last stage runs the LM head, its
        first keeps them (a stage before the last has no hidden states: None)."""
        if hidden is None:
            return {}
        return compute_prompt_logprobs(
            self.model,
            hidden,
            scheduled,
            last_row,
            self.input_batch.requests,
            self.hf_config.vocab_size,
            keep=self.samples,
            head_rows=self._head_rows,
        )

    def append_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Another rank's view: the driver's samples of the previous step (see multiproc.py)."""
        self.input_batch.append_sampled(sampled)

    def _forward(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor | None, dict[str, int]]:
        """Run the flattened batch; return hidden [T, H] (None on a stage before the last)
        and each request's last row."""
        ids, positions, seqs, last_row = self.input_batch.step_inputs(scheduled)
        fed = self._prev.feed(ids, last_row, self.device) if self._prev is not None else None
        common = common_metadata_from_seqs(seqs, self.block_size)
        eager = False
        if self.lora_manager is not None:  # each request's rows -> its adapter's slot
            requests = self.input_batch.requests
            rows = [
                (
                    requests[r.request_id].lora_request,
                    last_row[r.request_id] - r.num_tokens + 1,
                    r.num_tokens,
                )
                for r in scheduled
            ]
            eager = self.lora_manager.prepare(rows)
            hidden = self._run_model(ids, positions, common, fed, eager)
            self.lora_manager.end_forward()
            return hidden, last_row
        return self._run_model(ids, positions, common, fed, eager), last_row

    def _head_rows(self, rows: list[int]) -> list[int]:
        """rows of the step's hidden states for the LM head's next call: with LoRA, each
        row's adapter is set for it (engine.lora.manager)."""
        if self.lora_manager is not None:
            self.lora_manager.head_rows(rows)
        return rows

    def _run_model(
        self,
        ids: list[int],
        positions: list[int],
        common: CommonAttentionMetadata,
        fed: tuple[torch.Tensor, torch.Tensor] | None = None,
        eager: bool = False,
    ) -> torch.Tensor | None:
        """The step graph's output where it takes this step, else the eager forward's.
        fed: (rows, device values) of input ids that are placeholders (async scheduling);
        eager: a step with LoRA adapters, which only a graph that takes_lora runs."""
        step = StepInputs(ids, positions, common, fed)
        graph = self._step_graph
        if eager and graph is not None and not self._graph_takes_lora(graph):
            graph = None
        if self.pp_size > 1:
            return self._run_stage(step, graph)
        return run_step(graph, self.model, step, self._eager_inputs)

    def _graph_takes_lora(self, graph) -> bool:
        """Whether the step graph holds what this step's adapters need."""
        return graph.takes_lora and not graph.lora_blockers & self.lora_manager.graph_blockers

    def _run_stage(self, step: StepInputs, graph: StepGraph | None) -> torch.Tensor | None:
        """This pipeline stage's share of the step: the previous stage's tensors in, this
        stage's layers (its graph where it takes the step), its tensors out to the next stage
        (None) or the last's hidden."""
        if graph is None:  # the eager inputs while the previous stage computes
            self._eager_inputs(step)
        if not is_first_stage():
            shape = (len(step.ids), self.hf_config.hidden_size)
            start = time.perf_counter()
            step.intermediate = IntermediateTensors(
                *pp_recv([shape, shape], self.dtype, self.device)
            )
            self._recv_s += time.perf_counter() - start
        out = run_step(graph, self.model, step, self._eager_inputs)
        if is_last_stage():
            return out
        start = time.perf_counter()
        pp_send([out.hidden, out.residual])
        self._send_s += time.perf_counter() - start
        return None

    def _eager_inputs(self, step: StepInputs) -> None:
        """The eager forward's tensors for the step (step_graph.build_eager_inputs)."""
        build_eager_inputs(step, self.attn_backend, self.device)
