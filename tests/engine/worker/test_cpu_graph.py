"""The one-call decode step (engine.worker.cpu_graph, the CPU's step graph): the same bytes as the modules,
on 4-bit weights (1-12 rows; 1-7 on AMX; a GGUF's tiles on AMX-bf16 above 12 rows) and on
int8 activations (from 13 rows; 8), both KV
cache dtypes, with and without biases; the steps it leaves to the modules; and the switch
that turns it off."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import amx_bf16 as cpu_amx
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import w4 as cpu_w4
from engine.kernels.cpu import w8a8 as cpu_w8a8


def _generate(path, quantization: str, kv_cache_dtype: str, plan: bool, monkeypatch):
    from engine import LLM, SamplingParams

    monkeypatch.setenv("TESSERA_DECODE_PLAN", "1" if plan else "0")
    llm = LLM(
        str(path), dtype="bfloat16", quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        num_kv_blocks=128, enable_prefix_caching=False, max_num_seqs=16,
    )  # fmt: skip
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, logprobs=3)
    # one prompt, two, five, ten, then fourteen at once (steps of 1, 2, 5, 10 and 14 decode
    # rows; 10 sits between the int8-activation thresholds on AMX (8) and VNNI (13); short
    # prompts' prefills run on the attention kernel too, and so in the plan), then sixteen
    outs = llm.generate([list(range(50, 83))], params, use_tqdm=False)
    outs += llm.generate([list(range(5, 25)), list(range(30, 37))], params, use_tqdm=False)
    for n in (5, 10, 14):
        prompts = [list(range(40 + 9 * i, 49 + 9 * i + i % 7)) for i in range(n)]
        outs += llm.generate(prompts, params, use_tqdm=False)
    # sixteen 40-token prompts: one prefill step of 640 rows, past the packed GEMM's old bound
    prompts = [list(range(100 + 3 * i, 140 + 3 * i)) for i in range(16)]
    outs += llm.generate(prompts, params, use_tqdm=False)
    runner = llm.engine.executor.runner
    model, plan = runner.model.model, runner._step_graph
    runs = None if plan is None else dict(plan.runs)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    firsts = {m.quant_method.w8a8_min_rows(m, m.weight.shape[1]) for m in linears}
    llm.shutdown()
    return (
        [(o.outputs[0].token_ids, [repr(lp) for lp in o.outputs[0].logprobs]) for o in outs],
        runs,
        firsts,
    )


@pytest.mark.parametrize("quantization", ["w4a8", "w8a8"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_plan_writes_what_the_modules_write(
    make_tiny_model, monkeypatch, quantization, kv_cache_dtype, arch
):
    """Greedy tokens and every logprob equal with and without the plan (qwen2: q/k/v biases);
    w8a8 has no 4-bit weights, so its steps of up to 12 rows stay with the modules."""
    packed = cpu_w8a8.pack_weight(torch.zeros(16, 4, dtype=torch.int8)) is not None
    if not cpu_w4.available() or (quantization == "w8a8" and not packed):
        pytest.skip("the plan runs the 4-bit (AVX512-VNNI or AVX2) and packed int8 kernels")
    path = make_tiny_model(f"tiny-{arch}-plan", arch=arch, seed=3)
    with_plan, runs, firsts = _generate(path, quantization, kv_cache_dtype, True, monkeypatch)
    without, no_runs, _ = _generate(path, quantization, kv_cache_dtype, False, monkeypatch)
    assert no_runs is None  # switched off: never built
    (first,) = firsts  # 13, or 8 where the packed GEMMs run on AMX tiles: one for all layers
    # without the packed int8 GEMM (AVX2) w4a8's steps of 13 rows and more stay with the modules
    taken = ((1, 2, 5, 10) + ((14, 640) if packed else ())) if quantization == "w4a8" else (14, 640)
    if quantization == "w8a8" and first <= 10:
        taken += (10,)
    assert runs is not None and all(runs.get(rows, 0) > 0 for rows in taken), runs
    if quantization == "w8a8":
        assert min(runs) >= first, runs  # fewer rows: int8 weights alone, the modules' path
    assert with_plan == without


def _assert_plan_writes_what_the_modules_write(llm) -> None:
    """Batches of 1, 5 and 14 prompts greedy with the runner's plan, then on the modules (the
    same weights and KV cache): the same tokens and logprobs. Shuts llm down."""
    from engine import SamplingParams

    runner = llm.engine.executor.runner
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0, logprobs=3)
    batches = [[list(range(40 + 9 * i, 49 + 9 * i + i % 7)) for i in range(n)] for n in (1, 5, 14)]

    def run() -> list:
        outs = []
        for prompts in batches:
            outs += llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [repr(lp) for lp in o.outputs[0].logprobs]) for o in outs]

    with_plan = run()
    runner._step_graph = None  # the modules, on the same weights and KV cache
    without = run()
    llm.shutdown()
    assert with_plan == without


def test_plan_on_a_gguf_files_tiles_writes_what_the_modules_write(tiny_llama_dir, tmp_path):
    """A Q4_1 file's blocks as w4 tiles (the default for a .gguf): the plan's W4 steps take
    exactly the rows the layers' w4 kernels take (every batch with AVX2, or with VNNI and no
    AMX: the batch kernel above 12 rows; 1-12 rows with AMX), with the same tokens and
    logprobs as the modules on the same weights."""
    if not cpu_w4.available():
        pytest.skip("the w4 kernel needs AVX512-VNNI or AVX2 and a C compiler")
    from engine import LLM
    from engine.layers.quantization.gguf import GGUFW4LinearMethod, apply_gguf_blocks
    from tests.engine.gguf.gguf_files import write_gguf

    path = tmp_path / "tiny-q4_1.gguf"
    write_gguf(tiny_llama_dir, path, "Q4_1")
    llm = LLM(
        str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=128, enable_prefix_caching=False,
        max_num_seqs=16,
    )  # fmt: skip
    runner = llm.engine.executor.runner
    apply_gguf_blocks(runner.model, path)  # what a .gguf model loads with (test: an HF folder)
    layers = [m for m in runner.model.modules() if hasattr(m, "quant_method")]
    assert sum(isinstance(m.quant_method, GGUFW4LinearMethod) for m in layers) == 3 * 4
    runner._step_graph = runner._build_step_graph()
    plan = runner._step_graph
    assert plan is not None and plan.w4
    _assert_plan_writes_what_the_modules_write(llm)
    assert all(plan.runs.get(rows, 0) > 0 for rows in (1, 5)), plan.runs
    every_batch = cpu_w4.max_rows() >= 14 or (cpu_w4.batch_available() and not cpu_isa.plan().amx)
    assert plan.w4_amx == (cpu_isa.plan().amx and cpu_amx.available())
    if every_batch or plan.w4_amx:  # AVX2's w4 kernel, VNNI's batch kernel above 12 rows (no
        # AMX), or AMX-bf16 on the tiles above 12 rows (the gate_up GEMM with SiLU-and-mul)
        assert plan.runs.get(14, 0) > 0 and max(plan.runs) > 14, plan.runs
    else:  # AMX tiles, but the kernels not built: the modules
        assert max(plan.runs) <= cpu_w4.max_rows(), plan.runs


def test_a_model_with_qk_norms_runs_through_the_modules(make_tiny_model, monkeypatch):
    """Qwen3's per-head q/k norms are not in the plan: a w4a8 Qwen3 builds none (the same
    arguments build one for a Llama, above) and its tokens are the modules' own."""
    if not cpu_w4.available():
        pytest.skip("the plan runs the 4-bit (AVX512-VNNI or AVX2) kernels")
    path = make_tiny_model("tiny-qwen3-plan", arch="qwen3", head_dim=32, seed=3)
    with_plan, runs, _ = _generate(path, "w4a8", "auto", True, monkeypatch)
    without, _, _ = _generate(path, "w4a8", "auto", False, monkeypatch)
    assert runs is None and with_plan == without


def test_a_sliding_window_model_runs_through_the_modules(tiny_mistral_sw_dir, monkeypatch):
    """The plan passes no window to the attention kernel: a Mistral whose layers have one
    (16 tokens; prompts up to 140) builds none, and its tokens are the modules' own, which
    pass it (bf16, 4-bit weights, the int8 cache: the kernel's every windowed path)."""
    if not cpu_w4.available():
        pytest.skip("the plan runs the 4-bit (AVX512-VNNI or AVX2) kernels")
    with_plan, runs, _ = _generate(tiny_mistral_sw_dir, "w4a8", "int8", True, monkeypatch)
    without, _, _ = _generate(tiny_mistral_sw_dir, "w4a8", "int8", False, monkeypatch)
    assert runs is None and with_plan == without


@pytest.mark.parametrize("weights", ["gguf-q4_1", "w8a8"])
def test_plan_with_lora_adapters_writes_what_the_modules_write(tiny_llama_dir, tmp_path, weights):
    """Steps mixing three adapters (ranks 8 and 16, one on q/v alone) and the base run in the
    plan (each GEMM followed by the C LoRA kernel; the MLP's two GEMMs apart) with the same
    tokens and logprobs as the modules with the same adapters."""
    if not cpu_w4.available():
        pytest.skip("the plan's kernels need AVX512-VNNI or AVX2 and a C compiler")
    packed = cpu_w8a8.pack_weight(torch.zeros(16, 4, dtype=torch.int8)) is not None
    if weights == "w8a8" and not packed:
        pytest.skip("the packed int8 GEMM is not built on this CPU")
    from engine import LLM, LoRARequest, SamplingParams
    from engine.layers.quantization.gguf import apply_gguf_blocks
    from tests.engine.gguf.gguf_files import write_gguf
    from tests.engine.lora.lora_testing import make_adapter

    adapters = [
        make_adapter(tiny_llama_dir, tmp_path / "a0", r=8, seed=0),
        make_adapter(tiny_llama_dir, tmp_path / "a1", r=16, seed=1),
        make_adapter(tiny_llama_dir, tmp_path / "a2", r=8, targets=["q_proj", "v_proj"], seed=2),
    ]
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    llm = LLM(
        str(tiny_llama_dir), dtype="bfloat16", num_kv_blocks=128, enable_prefix_caching=False,
        max_num_seqs=16, enable_lora=True, max_loras=3, max_lora_rank=16,
        quantization="w8a8" if weights == "w8a8" else None,
    )  # fmt: skip
    runner = llm.engine.executor.runner
    if weights != "w8a8":
        path = tmp_path / "tiny-q4_1.gguf"
        write_gguf(tiny_llama_dir, path, "Q4_1")
        apply_gguf_blocks(runner.model, path)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0, logprobs=3)
    batches = [[list(range(40 + 9 * i, 49 + 9 * i + i % 7)) for i in range(n)] for n in (1, 5, 14)]

    def run() -> list:
        outs = []
        for prompts in batches:  # the first prompt of each batch on an adapter: every step has one
            loras = [None if i % 4 == 3 else requests[i % 3] for i in range(len(prompts))]
            outs += llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        return [(o.outputs[0].token_ids, [repr(lp) for lp in o.outputs[0].logprobs]) for o in outs]

    runner._step_graph = runner._build_step_graph()
    plan = runner._step_graph
    assert plan is not None and plan.takes_lora
    with_plan = run()
    runner._step_graph = None  # the modules, on the same weights, adapters and KV cache
    without = run()
    llm.shutdown()
    assert with_plan == without
    assert plan.runs, "no step ran in the plan"


def test_plan_on_bitsandbytes_nf4_writes_what_the_modules_write(tiny_llama_dir, tmp_path):
    """A bitsandbytes NF4 checkpoint (transformers + bitsandbytes' own) on the LUT4 kernel: the
    plan's LUT4 steps take exactly the layers' LUT4 rows (1-8 on the dot kernel, 9-32 on the
    decoded tiles with AVX512-BF16), with the same tokens and logprobs as the modules on the
    same weights; larger steps stay with the modules."""
    pytest.importorskip("bitsandbytes")
    from engine import LLM
    from engine.kernels.cpu import lut4 as cpu_lut4
    from tests.engine.layers.quantization import quant_writers as qw

    if not cpu_lut4.available():
        pytest.skip("the LUT4 kernel needs the CPU kernels")
    folder, _ = qw.write_bnb(tiny_llama_dir, tmp_path / "nf4", "bnb-nf4-dq")
    llm = LLM(
        str(folder), dtype="bfloat16", num_kv_blocks=128, enable_prefix_caching=False,
        max_num_seqs=16,
    )  # fmt: skip
    runner = llm.engine.executor.runner
    plan = runner._step_graph
    assert plan is not None and plan.lut4 and not (plan.w4 or plan.w8a8)
    _assert_plan_writes_what_the_modules_write(llm)
    assert all(plan.runs.get(rows, 0) > 0 for rows in (1, 5)), plan.runs
    tiles = cpu_lut4.tiles_max_rows()  # 9-32 rows on the decoded tiles (AVX512-BF16)
    assert (plan.runs.get(14, 0) > 0) == (tiles >= 14), plan.runs
    assert max(plan.runs) <= max(cpu_lut4.DOT_MAX_ROWS, tiles), plan.runs
