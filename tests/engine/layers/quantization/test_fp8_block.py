"""Block-wise FP8 checkpoints (engine.layers.quantization.fp8_block; experts: experts.py's
Fp8BlockExpertsMethod): `quant_method: "fp8"` with `weight_block_size` (written here by hand,
as Qwen3-*-FP8 ships it: `weight_scale_inv` per block) and compressed-tensors' float-quantized
`strategy: "block"` (written by the package's own compressor, FP8_BLOCK's per-token-group
activations in the config).

Tiny random Llama, Qwen3, Qwen3-MoE and Mixtral models with blocks of [128, 128] (one partial
block per layer) and [48, 32] (merged q|k|v and gate|up parts whose rows are not block
multiples; TP=2 shards of q that start inside a block). The reference is HF transformers on the
same model with every weight its exact dequantized value. Checked: each loaded layer holds
exactly those values; greedy tokens follow the reference (within the other formats' near-tie
tolerance), also at TP=2; the CUDA path's Triton GEMM and fused MoE kernel (under the
interpreter) on loaded layers against the CPU's; start-up errors naming the field.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.kernels.cpu import fp8 as cpu_fp8
from engine.layers.moe import DOWN, GATE, UP, FusedMoE
from engine.layers.quantization.checkpoint import (
    apply_checkpoint_methods,
    build_config,
    finish_checkpoint_methods,
)
from engine.layers.quantization.experts import (
    CpuFp8Experts,
    Fp8BlockExpertsMethod,
    FusedFp8Experts,
)
from engine.layers.quantization.fp8_block import Fp8BlockLinearMethod
from engine.models.loader import load_model
from tests.conftest import MOE_MODELS
from tests.engine.layers.quantization import quant_writers as qw
from tests.engine.layers.quantization.test_quant_checkpoints import (
    GAP_TOL,
    MERGED,
    PROMPTS,
    _assert_greedy_agrees,
    _hf_greedy,
    _load,
    _tp2,
    _tp_logits,
)
from tests.engine.layers.test_moe import naive_moe, uneven_ids

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else the interpreter
CT_BLOCK_ACTS = dict(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True)


def _ct_block(block):
    return functools.partial(
        qw.write_compressed_tensors, fmt="float-quantized",
        weights=dict(num_bits=8, type="float", strategy="block", block_structure=list(block)),
        input_activations=CT_BLOCK_ACTS,
    )  # fmt: skip


WRITERS = {
    "fp8-128": functools.partial(qw.write_fp8_block, block=(128, 128)),
    "fp8-48x32": functools.partial(qw.write_fp8_block, block=(48, 32)),
    "ct-48x32": _ct_block((48, 32)),
}
MOE_I64 = {
    "qwen3_moe": {**MOE_MODELS["qwen3_moe"], "moe_intermediate_size": 64},
    "mixtral": {**MOE_MODELS["mixtral"], "intermediate_size": 64},
}
DENSE = {"llama": {}, "qwen3": {"head_dim": 32, "seed": 3}}


@pytest.fixture(scope="module")
def written(make_tiny_model, tmp_path_factory):
    """(arch, format) -> (float folder, block-FP8 folder, {layer: dequantized weight})."""
    cache: dict = {}

    def get(arch: str, fmt: str):
        if (arch, fmt) not in cache:
            if fmt.startswith("ct-"):
                pytest.importorskip("compressed_tensors")
            extra = MOE_I64.get(arch) or DENSE[arch]
            src = make_tiny_model(f"tiny-{arch}-fp8block", arch=arch, **extra)
            folder, deq = WRITERS[fmt](src, tmp_path_factory.mktemp(f"{arch}-{fmt}"))
            cache[arch, fmt] = (src, folder, deq)
        return cache[arch, fmt]

    return get


def _greedy(folder, dtype: str, tp: int = 1, device: str = "cpu") -> list[list[int]]:
    llm = LLM(str(folder), dtype=dtype, seed=0, num_kv_blocks=64, max_model_len=256,
              tensor_parallel_size=tp, device=device)  # fmt: skip
    try:
        qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
        runner = llm.engine.executor.runner
        assert runner.quantization == qcfg["quant_method"]  # no flag
        if device == "cuda":  # float8 kept on the device: the Triton GEMM / fused MoE kernel
            layer = runner.model.model.layers[0]
            assert layer.self_attn.qkv_proj.weight is None
            experts = getattr(layer.mlp, "experts", None)
            assert experts is None or experts.fused_quantized is not None
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _follows_reference(src, folder, deq, dtype: str, tp: int = 1, device: str = "cpu") -> None:
    ref = qw.reference_model(src, deq)
    for prompt, ours in zip(PROMPTS, _greedy(folder, dtype, tp, device), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(ours, theirs, gaps, GAP_TOL[dtype])


# -- dense layers -------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", [True, False], ids=["fp8-kernels", "dequantized"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "fmt"), [("llama", "fp8-128"), ("llama", "fp8-48x32"),
                                           ("qwen3", "ct-48x32")])  # fmt: skip
def test_each_layer_holds_the_dequantized_checkpoint(written, arch, fmt, dtype, kernels,
                                                      monkeypatch):  # fmt: skip
    """The CPU's forms: the checkpoint's codes and one row of block scales per output row for
    the CPU's FP8 kernels, or, without them, the weight dequantized at load; either way each
    value times its block's scale in fp32, rounded once to the model dtype, merged parts each
    with their own blocks."""
    if not kernels:
        monkeypatch.setattr(cpu_fp8, "available", lambda: False)
    elif not cpu_fp8.available():
        pytest.skip("no CPU kernels here")
    _, folder, deq = written(arch, fmt)
    model, paths = _load(folder, dtype)
    checked = 0
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue
        assert isinstance(module.quant_method, Fp8BlockLinearMethod), name
        parts = [name[: -len(kind)] + p for p in MERGED.get(kind, (kind,))]
        want = torch.cat([deq[p] for p in parts]).to(getattr(torch, dtype))
        if kernels:
            assert module.weight is None and module.fp8_cpu.codes.dtype == torch.uint8, name
            got = module.fp8_cpu.dequantize(getattr(torch, dtype))
        else:
            got = module.weight.data
        assert torch.equal(got, want), name
        checked += 1
    assert checked == 4 * model.config.num_hidden_layers
    want_path = "one byte a weight" if kernels else "dequantized at load into " + dtype
    assert all(want_path in why for why in paths["qkv_proj"]), paths


@pytest.mark.parametrize(
    ("arch", "fmt", "dtype"),
    [("llama", "fp8-128", "bfloat16"), ("llama", "fp8-48x32", "float32"),
     ("qwen3", "fp8-128", "float32"), ("qwen3", "ct-48x32", "bfloat16")],
)  # fmt: skip
def test_greedy_tokens_follow_the_dequantized_reference(written, arch, fmt, dtype):
    _follows_reference(*written(arch, fmt), dtype)


def _load_both(folder):
    """The model loaded twice in float32: on the CPU path, and with every block-FP8 layer on
    the Triton GEMM (on the GPU where there is one, else under the interpreter)."""
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    models = []
    for triton, device in ((False, "cpu"), (True, DEVICE)):
        config = build_config(qcfg["quant_method"], qcfg)
        model = load_model(folder, dtype="float32", device=device,
                           prepare=functools.partial(apply_checkpoint_methods, config=config))  # fmt: skip
        for m in model.modules():
            if isinstance(getattr(m, "quant_method", None), Fp8BlockLinearMethod):
                m.quant_method.triton = triton
        finish_checkpoint_methods(model, config)
        models.append(model)
    return models


@pytest.mark.parametrize(("arch", "fmt"), [("llama", "fp8-48x32"), ("qwen3", "ct-48x32")])
def test_the_triton_gemm_serves_the_loaded_layers(written, arch, fmt):
    pytest.importorskip("triton")
    cpu, gpu = _load_both(written(arch, fmt)[1])
    gpu_layers = dict(gpu.named_modules())
    checked = 0
    for name, layer in cpu.named_modules():
        if not isinstance(getattr(layer, "quant_method", None), Fp8BlockLinearMethod):
            continue
        other = gpu_layers[name]
        assert other.weight is None and "Triton" in other.quant_path  # no float copy
        for rows in (1, 9):
            k = layer.fp8_cpu.in_features if layer.weight is None else layer.weight.shape[1]
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            want = layer.quant_method.apply(layer, x)
            got = other.quant_method.apply(other, x.to(DEVICE)).cpu()
            torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
        checked += 1
    assert checked == 4 * cpu.config.num_hidden_layers


@pytest.mark.slow
def test_tp2_shards_give_the_logits_of_one_process(written, tmp_path):
    """Column shards of q that start inside a block of 48 rows, row shards of 32 inputs."""
    torch.set_num_threads(1)
    folders = [written("llama", "fp8-48x32")[1], written("qwen3", "ct-48x32")[1],
               written("qwen3_moe", "fp8-48x32")[1]]  # fmt: skip
    expected = [_tp_logits(f) for f in folders]
    logits, paths0, paths1 = _tp2(folders, tmp_path, "float32")
    for folder, got, want in zip(folders, logits, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=str(folder))
    assert paths0 == paths1
    assert "experts" in paths0[2]


@pytest.mark.slow
def test_tp2_greedy_tokens_follow_the_dequantized_reference(written):
    _follows_reference(*written("llama", "fp8-48x32"), "float32", tp=2)


# -- experts ------------------------------------------------------------------------------------


def _moe_layer(block, experts=8, hidden=64, inter=64, dtype=torch.float32, seed=0):
    """A FusedMoE with Fp8BlockExpertsMethod's parameters filled through their weight_loaders
    (not yet processed); returns it, the method and the dequantized w13 [E, 2I, H], w2."""
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(experts, 2, hidden, inter, renormalize=True)
    moe.prefix, moe.model_dtype = "experts", dtype
    method = Fp8BlockExpertsMethod(block, "weight_scale_inv", "weight_block_size")
    method.create_weights(moe)
    params = dict(moe.named_parameters())
    w13, w2 = torch.empty(experts, 2 * inter, hidden), torch.empty(experts, hidden, inter)
    for e in range(experts):
        for shard, (n, k) in (
            (GATE, (inter, hidden)),
            (UP, (inter, hidden)),
            (DOWN, (hidden, inter)),
        ):
            q, scales, deq = qw.quantize_blocks_fp8(torch.randn(n, k, generator=gen) * 0.2, block)
            side = "w2" if shard == DOWN else "w13"
            for suffix, t in (("weight", q), ("weight_scale_inv", scales)):
                param = params[f"{side}_{suffix}"]
                param.weight_loader(param, t, (e, shard))
            if shard == DOWN:
                w2[e] = deq
            else:
                w13[e, shard * inter : (shard + 1) * inter] = deq
    return moe, method, w13, w2


def _routing(tokens: int, experts: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = uneven_ids(tokens, experts, 2, gen)
    weights = torch.rand(tokens, 2, generator=gen)
    return torch.randn(tokens, 64, generator=gen), ids, weights / weights.sum(-1, keepdim=True)


@pytest.mark.parametrize("block", [(48, 32), (128, 128)])
def test_experts_on_the_cpu_and_the_fused_kernel_match_dequantize_then_matmul(block):
    moe, method, w13, w2 = _moe_layer(block)
    q13, q2 = moe.w13_weight.data.clone(), moe.w2_weight.data.clone()
    s13, s2 = moe.w13_weight_scale_inv.data.clone(), moe.w2_weight_scale_inv.data.clone()
    x, ids, weights = _routing(37, 8, seed=block[0])
    want = naive_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
    path = method.process_weights_after_loading(moe)
    if cpu_fp8.available():  # the experts' codes on the CPU's FP8 kernels, no float stacks
        assert "one byte a weight" in path and moe.w13_weight is None
        assert isinstance(moe.expert_linear, CpuFp8Experts)
    else:
        assert "dequantized at load" in path
    logits = torch.full((37, 8), -30.0).scatter_(1, ids, torch.log(weights))
    torch.testing.assert_close(moe(x, logits).double(), want, atol=1e-4, rtol=1e-4)
    pytest.importorskip("triton")  # the CUDA path's kernel, under the interpreter here
    fused = FusedFp8Experts(*(t.to(DEVICE) for t in (q13, q2, s13, s2)), block[1])
    got = fused(*(t.to(DEVICE) for t in (x, weights, ids))).cpu()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("arch", "fmt", "dtype"),
    [("qwen3_moe", "fp8-128", "bfloat16"), ("qwen3_moe", "fp8-48x32", "float32"),
     ("mixtral", "ct-48x32", "float32")],
)  # fmt: skip
def test_moe_greedy_tokens_follow_the_dequantized_reference(written, arch, fmt, dtype):
    src, folder, deq = written(arch, fmt)
    assert any(".experts." in name for name in deq)  # the experts are quantized
    _follows_reference(src, folder, deq, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize(("arch", "fmt"), [("llama", "fp8-48x32"), ("qwen3_moe", "fp8-128")])
def test_cuda_greedy_tokens_follow_the_dequantized_reference(written, arch, fmt):
    """On a GPU: the block-FP8 GEMM and the fused MoE kernel compiled, through the engine."""
    _follows_reference(*written(arch, fmt), "bfloat16", device="cuda")


# -- start-up refusals --------------------------------------------------------------------------


@pytest.mark.parametrize("block", [[128], [0, 128], "128x128", [128, 128, 1], [True, 128],
                                   [128.0, 128]])  # fmt: skip
def test_a_wrong_block_list_is_refused_naming_the_field(block):
    with pytest.raises(ValueError, match=r"quantization_config.weight_block_size = .*two positive"):
        build_config("fp8", {"quant_method": "fp8", "weight_block_size": block})
    group = {"targets": ["Linear"], "format": "float-quantized", "input_activations": CT_BLOCK_ACTS,
             "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                         "block_structure": block}}  # fmt: skip
    with pytest.raises(ValueError, match=r"config_groups.g.weights.block_structure = "):
        build_config("compressed-tensors", {"config_groups": {"g": group}})


def test_other_fp8_formats_and_static_group_activations_are_refused():
    with pytest.raises(ValueError, match=r"quantization_config.fmt = 'e5m2'.*e4m3"):
        build_config("fp8", {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]})
    group = {"targets": ["Linear"], "format": "float-quantized",
             "input_activations": {**CT_BLOCK_ACTS, "dynamic": False},
             "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                         "block_structure": [128, 128]}}  # fmt: skip
    with pytest.raises(ValueError, match=r"config_groups.g.input_activations.dynamic = False"):
        build_config("compressed-tensors", {"config_groups": {"g": group}})


def _row_parallel(k: int) -> nn.Module:
    layer = nn.Module()
    layer.prefix, layer.tp_dim, layer.tp_size, layer.tp_rank = (
        "model.layers.0.mlp.down_proj",
        1,
        2,
        0,
    )
    return layer


def test_a_block_that_does_not_tile_a_tp_shard_is_named():
    method = Fp8BlockLinearMethod((128, 128), "weight_scale_inv", "weight_block_size")
    with pytest.raises(ValueError, match=r"down_proj: quantization_config.weight_block_size = "
                       r"\[128, 128\].*\(64 of 128 inputs with tensor_parallel_size 2\)"):  # fmt: skip
        method.create_weights(_row_parallel(64), 64, 64, False)
    method.create_weights(_row_parallel(256), 256, 64, False)  # two blocks a shard: fine
    moe = FusedMoE(4, 2, 64, 32, renormalize=True)
    moe.prefix, moe.tp_size, moe.inter_slices = "model.layers.0.mlp.experts", 2, 2
    moe.inter = 16  # rank 0's I
    with pytest.raises(
        ValueError, match=r"experts \(down\): quantization_config.weight_block_size"
    ):
        Fp8BlockExpertsMethod((32, 32), "weight_scale_inv", "weight_block_size").create_weights(moe)


def test_scales_of_another_block_size_fail_naming_the_layer(written, tmp_path):
    _, folder, _ = written("llama", "fp8-48x32")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [32, 32]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers.0.*block scales of shape .* in blocks of 32"):
        _load(bad, "float32")
