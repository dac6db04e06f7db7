"""gpt-oss (engine.models.gpt_oss): greedy tokens equal transformers' (eager attention, float32)
with attention sinks, biases, yarn rope, layers alternating window 16 and global, experts with
biases and the clamped SwiGLU; however the cache is filled (prefix hits, chunks across the
window's edge, preemption, the torch backend), at TP=2, and from an MXFP4 checkpoint (OpenAI's
published format) against transformers' own dequantization: as GGUF blocks on one CPU rank,
and kept 4-bit on the fused Triton MoE kernel (CUDA's path; here under the interpreter, at one
rank, TP=2 and with expert parallelism)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.quantization.mxfp4_blocks import FP4_VALUES, dequantize_mxfp4, to_gguf_mxfp4
from engine.models.loader import load_hf_config
from tests.engine.test_llm_exactness import (
    SW_NUM_NEW,
    assert_agrees_but_near_ties,
    engine_greedy,
    hf_greedy,
    hf_greedy_gaps,
    sliding_window_prompts,
)

_REFERENCE: dict = {}


def _reference(model_dir):
    key = str(model_dir)
    if key not in _REFERENCE:
        prompts = sliding_window_prompts(load_hf_config(model_dir).vocab_size)
        _REFERENCE[key] = (
            prompts,
            hf_greedy(model_dir, prompts, SW_NUM_NEW, attn_implementation="eager"),
        )
    return _REFERENCE[key]


def test_config(tiny_gpt_oss_dir):
    cfg = load_hf_config(tiny_gpt_oss_dir)
    assert cfg.attention_sinks and cfg.norm_topk_prob and cfg.o_proj_bias
    assert cfg.layer_sliding_windows == [16, None, 16]  # hybrid: every block kept
    assert cfg.kv_sliding_window() is None
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.num_experts == 8


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("prefix-caching", dict(enable_prefix_caching=True)),
        ("chunked-prefill-across-the-edge", dict(block_size=8, max_num_batched_tokens=11)),
        ("torch-backend", dict(attention_backend="torch", max_num_batched_tokens=32)),
        ("preemption", dict(num_kv_blocks=12, max_model_len=112, max_num_batched_tokens=64)),
    ],
)
def test_greedy_matches_hf(tiny_gpt_oss_dir, name, kwargs):
    prompts, expected = _reference(tiny_gpt_oss_dir)
    got, stats = engine_greedy(tiny_gpt_oss_dir, prompts, num_new=SW_NUM_NEW, **kwargs)
    assert [g[0] for g in got] == expected
    if name == "prefix-caching":
        assert stats.prefix_cache_hits >= 32, "the shared prefix was not served from the cache"
    if name == "preemption":
        assert stats.num_preemptions > 0, "the pool was meant to force preemption"


@pytest.mark.slow
def test_tp2_matches_hf(tiny_gpt_oss_dir):
    """Two gloo ranks: heads (and their sinks) and every expert's I split, the down bias
    added once."""
    torch.set_num_threads(1)
    prompts, expected = _reference(tiny_gpt_oss_dir)
    llm = LLM(str(tiny_gpt_oss_dir), dtype="float32", tensor_parallel_size=2, num_kv_blocks=96)
    try:
        params = SamplingParams(max_tokens=SW_NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


# -- MXFP4 -------------------------------------------------------------------------------


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]):
    each group of 32 scaled by a power of two so its largest value fits 6, then each value
    rounded to the nearest e2m1 value; two codes a byte, the even element's in the low nibble
    (OpenAI's layout, as transformers reads it)."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 135, (3, 40, 4), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    got = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, rows, K]
    assert torch.equal(got.transpose(1, 2), want)
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :3], torch.float32)


@pytest.fixture(scope="module")
def mxfp4_pair(tiny_gpt_oss_dir, tmp_path_factory):
    """(an MXFP4 checkpoint of the tiny model's experts, the float model with each expert
    weight replaced by transformers' dequantization of those bytes)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    base = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    quant, ref = base / "mxfp4", base / "dequantized"
    for d in (quant, ref):
        shutil.copytree(tiny_gpt_oss_dir, d)
    tensors = load_file(str(tiny_gpt_oss_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2))  # [E, rows, K]: K grouped
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert dequantized[name].shape == t.shape
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, str(quant / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    config = json.loads((quant / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (quant / "config.json").write_text(json.dumps(config))
    return quant, ref


def test_gguf_mxfp4_blocks_hold_the_same_values():
    """MXFP4 pairs as GGUF MXFP4 rows: gguf-py's own dequantization gives the checkpoint's
    values exactly, for every E8M0 scale (0 and 1 included: float32 subnormals) and code."""
    from gguf import GGMLQuantizationType, quants

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 5, 4), dtype=torch.uint8, generator=g)
    scales[0, 0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)
    rows = to_gguf_mxfp4(blocks, scales)
    assert rows.shape == (3, 5, 4 * 17)
    got = quants.dequantize(rows.reshape(15, -1).numpy(), GGMLQuantizationType.MXFP4)
    want = dequantize_mxfp4(blocks, scales, torch.float32).reshape(15, -1)
    assert torch.equal(torch.from_numpy(got), want)


@pytest.mark.parametrize("tp", [1, 2])
def test_mxfp4_checkpoint_matches_its_dequantized_reference(mxfp4_pair, tiny_gpt_oss_dir, tp):
    """One rank: the experts as GGUF MXFP4 blocks (the same bits) on the GGUF kernels. Their
    larger-batch path (every row forced onto it) multiplies the exact values: HF's tokens, token
    for token. Their dot kernels (every row forced onto them, so the same integer sums on every
    CPU) take x as int8 per 32 (~0.5% of a product): a token may differ only where HF's top-2
    gap is under 0.15 (the GGUF blocks tests' wide tolerance). Which rows a CPU sends to each
    path by default is its own plan (2 rows with AMX, 16 without), so neither is left to it.
    TP=2: dequantized, sliced, token for token."""
    from engine.kernels.cpu import gguf as cpu_gguf
    from engine.layers.moe import FusedMoE

    quant, ref = mxfp4_pair
    prompts, _ = _reference(ref)
    params = SamplingParams(max_tokens=SW_NUM_NEW, temperature=0.0, ignore_eos=True)
    if tp == 1:
        reference = hf_greedy_gaps(ref, prompts, SW_NUM_NEW)
        expected = [t for t, _ in reference]
        hidden = json.loads((quant / "config.json").read_text())["hidden_size"]
        for dot_rows in (0, 16):
            with cpu_gguf.forced_dot_rows(dot_rows):
                llm = LLM(str(quant), dtype="float32", seed=0, max_num_batched_tokens=32,
                          device="cpu")  # fmt: skip
                try:
                    model = llm.engine.executor.runner.model
                    w13 = next(m for m in model.modules() if isinstance(m, FusedMoE)).w13_weight
                    blocks = w13.dtype == torch.uint8 and w13.shape[-1] == hidden // 32 * 17
                    outs = llm.generate(prompts, params, use_tqdm=False)
                finally:
                    llm.shutdown()
            assert blocks == cpu_gguf.available()  # 4.25 bits a weight where the kernels are
            got = [list(o.outputs[0].token_ids) for o in outs]
            if dot_rows == 0 or not blocks:
                assert got == expected
            else:
                assert_agrees_but_near_ties(got, reference, 0.15)
    else:
        expected = hf_greedy(ref, prompts, SW_NUM_NEW, attn_implementation="eager")
        torch.set_num_threads(1)
        llm = LLM(str(quant), dtype="float32", tensor_parallel_size=2, num_kv_blocks=96)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
    _, float_expected = _reference(tiny_gpt_oss_dir)
    assert expected != float_expected  # the 4-bit experts are what was served


# -- MXFP4 experts kept 4-bit on the fused Triton MoE kernel (CUDA's path) ----------------------


def _mxfp4_triton_greedy(quant, prompts, dtype="float32", num_new=SW_NUM_NEW, **kwargs
                         ) -> tuple[list[list[int]], dict]:  # fmt: skip
    """LLM(quant)'s greedy tokens with the MXFP4 experts on the fused Triton kernel (on CUDA,
    or on CPU tensors under the interpreter: TESSERA_MXFP4_KERNEL=triton, which the caller
    sets), and rank 0's experts' tensors (dtype, shape)."""
    from engine.layers.moe import FusedMoE

    llm = LLM(str(quant), dtype=dtype, seed=0, num_kv_blocks=96, **kwargs)
    try:
        model = llm.engine.executor.runner.model
        moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
        held = {n: (p.dtype, tuple(p.shape)) for n, p in moe.named_parameters()}
        assert moe.fused_quantized is not None, "the experts are not on the fused kernel"
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], held


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("one-rank", {}),
        ("one-rank-bf16", dict(dtype="bfloat16")),
        # down's shard of I = 16 starts mid-group; ~1 min each under the interpreter
        pytest.param("tp2", dict(tensor_parallel_size=2), marks=pytest.mark.slow),
        pytest.param(
            "tp2-expert-parallel",
            dict(tensor_parallel_size=2, enable_expert_parallel=True),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_mxfp4_experts_on_the_triton_kernel(mxfp4_pair, monkeypatch, name, kwargs):
    """The CUDA path on CPU tensors: the experts stay the checkpoint's MXFP4 bytes (codes
    [E, 2I, H / 2] and [E, H, I / 2], one E8M0 byte per 32), decoded in the fused kernel's
    inner loop with their biases and the clamped SwiGLU; greedy tokens equal transformers' on
    the same bytes dequantized (float32; bf16: but where its top-2 gap is under 0.05), at
    TP=2 too (each rank its slice of I; down's starting inside a group of 32) and with expert
    parallelism (4 whole experts a rank)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    tp = "tensor_parallel_size" in kwargs
    if tp and not interpreted:  # a GPU machine: one GPU, and no interpreter for CPU ranks
        pytest.skip("TP on CPU ranks runs the Triton kernel under the interpreter only")
    if not (interpreted or torch.cuda.is_available()):
        pytest.skip("no GPU and not under the Triton interpreter")
    monkeypatch.setenv("TESSERA_MXFP4_KERNEL", "triton")
    if tp:
        torch.set_num_threads(1)
        kwargs = dict(kwargs, device="cpu")
    quant, ref = mxfp4_pair
    prompts, _ = _reference(ref)
    num_new = SW_NUM_NEW
    if interpreted:  # every kernel call interpreted: three prompts (under, across and over the
        prompts, num_new = prompts[:3], 16  # window) and 16 tokens; a GPU runs them all
        if tp:  # the ranks' shards under test: the longest prompt and 8 tokens
            prompts, num_new = prompts[2:3], 8
    if "dtype" in kwargs:  # bf16: the reference's near ties may go either way (0.05, as the
        reference = hf_greedy_gaps(ref, prompts, num_new)  # quantized checkpoints' tests)
    else:
        expected = hf_greedy(ref, prompts, num_new, attn_implementation="eager")
    got, held = _mxfp4_triton_greedy(quant, prompts, num_new=num_new, **kwargs)
    cfg = json.loads((quant / "config.json").read_text())
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    if name == "tp2":
        i //= 2
    if name == "tp2-expert-parallel":
        e //= 2
    groups = 1 if name == "tp2" else i // 32  # rank 0's I = 16: the first group's scales
    assert held == {
        "w13_weight": (torch.uint8, (e, 2 * i, h // 2)),
        "w13_weight_scale": (torch.uint8, (e, 2 * i, h // 32)),
        "w2_weight": (torch.uint8, (e, h, i // 2)),
        "w2_weight_scale": (torch.uint8, (e, h, groups)),
        "w13_bias": (getattr(torch, kwargs.get("dtype", "float32")), (e, 2 * i)),
        "w2_bias": (getattr(torch, kwargs.get("dtype", "float32")), (e, h)),
    }
    if "dtype" in kwargs:
        assert_agrees_but_near_ties(got, reference, 0.05)
    else:
        assert got == expected


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-3), ("bfloat16", 0.05)])
def test_mxfp4_experts_stay_4bit_on_cuda(mxfp4_pair, monkeypatch, dtype, tol):
    """On a GPU, with no flag: the experts are the MXFP4 bytes on the compiled fused kernel
    (CUDA graphs included), and the greedy tokens are transformers' on the dequantized bytes
    (float32) wherever its top-2 gap is clear (the quantized checkpoints' tolerances)."""
    monkeypatch.delenv("TESSERA_MXFP4_KERNEL", raising=False)
    quant, ref = mxfp4_pair
    prompts = sliding_window_prompts(load_hf_config(ref).vocab_size)
    reference = hf_greedy_gaps(ref, prompts, SW_NUM_NEW)
    got, held = _mxfp4_triton_greedy(quant, prompts, dtype=dtype, device="cuda")
    assert held["w13_weight"][0] == torch.uint8 and held["w2_weight"][0] == torch.uint8
    assert_agrees_but_near_ties(got, reference, tol)


def test_mxfp4_experts_kernel_choice(monkeypatch):
    """Which path a layer's MXFP4 experts take: the Triton kernel on CUDA, GGUF blocks on one
    CPU rank (where the C kernels are built), dequantized where the kernel cannot slice down's
    bytes (an odd share of I); a bad TESSERA_MXFP4_KERNEL names its values."""
    pytest.importorskip("triton")
    from engine.kernels.cpu import gguf as cpu_gguf
    from engine.layers.moe import FusedMoE
    from engine.layers.quantization.mxfp4 import experts_kernel

    monkeypatch.delenv("TESSERA_MXFP4_KERNEL", raising=False)
    moe = FusedMoE(8, 2, 64, 32, renormalize=True, bias=True, activation="swigluoai")
    assert experts_kernel(moe, torch.device("cuda"))[0] == "triton"
    cpu = experts_kernel(moe, torch.device("cpu"))[0]
    assert cpu == ("gguf" if cpu_gguf.available() else "dequantize")
    monkeypatch.setenv("TESSERA_MXFP4_KERNEL", "triton")
    assert experts_kernel(moe, torch.device("cpu"))[0] == "triton"
    odd = FusedMoE(8, 2, 64, 31, renormalize=True, bias=True, activation="swigluoai")
    kernel, why = experts_kernel(odd, torch.device("cuda"))
    assert kernel == "dequantize" and "odd" in why
    monkeypatch.setenv("TESSERA_MXFP4_KERNEL", "fast")
    with pytest.raises(ValueError, match="TESSERA_MXFP4_KERNEL.*triton, gguf, dequantize"):
        experts_kernel(moe, torch.device("cpu"))
