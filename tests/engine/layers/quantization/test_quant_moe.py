"""Quantized mixture-of-experts checkpoints (engine.layers.quantization.experts): compressed-
tensors' FP8 (float-quantized), W4A16 / W8A16 (pack-quantized) and W8A8 (int-quantized)
experts, written by the `compressed-tensors` package itself, and GPTQ / AWQ experts and
act-order ones (GPTQ desc_act, compressed-tensors' actorder "group": each expert its own
g_idx) packed by hand (quant_writers).

Checked: one MoE layer's quantized experts (CPU kernels, and the fused Triton kernel under its
interpreter) against dequantize-then-matmul with tokens routed unevenly and some experts getting
none; tiny random Qwen3-MoE and Mixtral models' greedy tokens through LLM(dir) against HF
transformers on the dequantized weights (within the dense tests' top-2 gap tolerance; W8A8's
int8 activations a wider one); TP=2 shards against one process (and one rank's act-order shard,
down keeping every group's scales, against its dequantized weights); start-up refusals naming
the field.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels.cpu import gemm as cpu_gemm
from engine.kernels.cpu import isa as cpu_isa
from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.moe import DOWN, GATE, UP, FusedMoE
from engine.layers.quantization.checkpoint import build_config
from engine.layers.quantization.compressed_tensors import CTPackedLinearMethod
from engine.layers.quantization.experts import (
    ExpertParts,
    Fp8ExpertsMethod,
    FusedFp8Experts,
    FusedIntExperts,
    IntExpertsMethod,
)
from tests.conftest import MOE_MODELS
from tests.engine.layers.quantization import quant_writers as qw
from tests.engine.layers.quantization.test_quant_checkpoints import (
    GAP_TOL,
    PROMPTS,
    _assert_greedy_agrees,
    _hf_greedy,
    _load,
    _tp2,
    _tp_logits,
)
from tests.engine.layers.test_moe import naive_moe, uneven_ids

pytest.importorskip("compressed_tensors")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else the interpreter

FP8_CHANNEL = dict(
    fmt="float-quantized",
    weights=dict(num_bits=8, type="float", strategy="channel"),
    input_activations=dict(num_bits=8, type="float", strategy="token", dynamic=True),
)
FP8_TENSOR = dict(
    fmt="float-quantized",
    weights=dict(num_bits=8, type="float", strategy="tensor"),
    input_activations=dict(num_bits=8, type="float", strategy="tensor", dynamic=False),
)
W4_GROUP_ASYM = dict(
    fmt="pack-quantized",
    weights=dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=False),
)
W4A8_GROUP = dict(  # llm-compressor's W4A8: the w4 tiles quantize x themselves
    fmt="pack-quantized",
    weights=dict(num_bits=4, type="int", strategy="group", group_size=32, symmetric=True),
    input_activations=dict(num_bits=8, type="int", strategy="token", dynamic=True),
)
W4_CHANNEL = dict(
    fmt="pack-quantized", weights=dict(num_bits=4, type="int", strategy="channel", symmetric=True)
)
W8_CHANNEL = dict(
    fmt="pack-quantized", weights=dict(num_bits=8, type="int", strategy="channel", symmetric=True)
)
W8_GROUP_ASYM = dict(
    fmt="pack-quantized",
    weights=dict(num_bits=8, type="int", strategy="group", group_size=32, symmetric=False),
)
# W8A8 (RedHat's Qwen3-30B-A3B quantized.w8a8 form): int8 weights, int8 activations
W8A8_CHANNEL = dict(
    fmt="int-quantized",
    weights=dict(num_bits=8, type="int", strategy="channel", symmetric=True),
    input_activations=dict(num_bits=8, type="int", strategy="token", dynamic=True),
)
W8A8_TENSOR_STATIC = dict(
    fmt="int-quantized",
    weights=dict(num_bits=8, type="int", strategy="tensor", symmetric=True),
    input_activations=dict(num_bits=8, type="int", strategy="tensor", dynamic=False),
)
# GPTQ and AWQ checkpoints, packed by hand (quant_writers): the same experts path
WRITERS = {
    "gptq4-g32-sym": functools.partial(qw.write_gptq, bits=4, group=32),
    "gptq4-g32-asym-v2": functools.partial(qw.write_gptq, bits=4, group=32, sym=False, v2=True),
    "gptq8-channel": functools.partial(qw.write_gptq, bits=8, group=-1),
    "gptq3-g32-asym": functools.partial(qw.write_gptq, bits=3, group=32, sym=False),
    "awq-g32": functools.partial(qw.write_awq, group=32),
    "fp8": qw.write_fp8,  # quant_method "fp8": per-tensor scales, static input scales
    # act-order: every expert's gate_up and down their own g_idx
    "gptq4-actorder": functools.partial(qw.write_gptq, bits=4, group=32, desc_act=True),
    "gptq4-actorder-asym-v2": functools.partial(
        qw.write_gptq, bits=4, group=32, sym=False, desc_act=True, v2=True
    ),  # fmt: skip
    "gptq8-actorder": functools.partial(qw.write_gptq, bits=8, group=32, desc_act=True),
    "ct-w4a16-actorder": qw.write_ct_actorder,
}
SCHEMES = {
    "fp8-channel": FP8_CHANNEL,
    "fp8-tensor": FP8_TENSOR,
    "w4a16-group-asym": W4_GROUP_ASYM,
    "w4a16-channel": W4_CHANNEL,
    "w4a8-group": W4A8_GROUP,
    "w8a16-channel": W8_CHANNEL,
    "w8a16-group-asym": W8_GROUP_ASYM,
    "w8a8-channel": W8A8_CHANNEL,
    "w8a8-tensor-static": W8A8_TENSOR_STATIC,
}


def _method(scheme: dict):
    if scheme["fmt"] == "float-quantized":
        return Fp8ExpertsMethod()
    return _config_method(scheme)


def _ct_config(scheme: dict):
    group = {"targets": ["Linear"], "format": scheme["fmt"], "weights": scheme["weights"],
             "input_activations": scheme.get("input_activations")}  # fmt: skip
    return build_config("compressed-tensors", {"config_groups": {"g": group},
                                               "ignore": ["lm_head", "re:.*mlp.gate$"]})  # fmt: skip


def _config_method(scheme: dict):
    """The experts method the checkpoint's quantization_config gives (the start-up's way)."""
    sources = ["model.layers.0.mlp.experts.0.gate_proj"]
    return _ct_config(scheme).experts_method("model.layers.0.mlp.experts", sources)


def _gptq_method(bits: int, sym: bool, v2: bool, desc_act: bool = True):
    config = build_config("gptq", {"bits": bits, "group_size": 32, "desc_act": desc_act,
                                   "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"})  # fmt: skip
    return config.experts_method("model.layers.0.mlp.experts", ["x.experts.0.gate_proj"])


# act-order experts, one MoE layer: (experts method, compress(w, g_idx) -> (tensors, dequantized))
ACT_ORDER = {
    "gptq4-actorder": (lambda: _gptq_method(4, True, False),
                       lambda w, g: qw.gptq_tensors(w, 4, 32, True, g)),
    "gptq4-actorder-asym-v2": (lambda: _gptq_method(4, False, True),
                               lambda w, g: qw.gptq_tensors(w, 4, 32, False, g, v2=True)),
    "gptq8-actorder": (lambda: _gptq_method(8, True, False),
                       lambda w, g: qw.gptq_tensors(w, 8, 32, True, g)),
    "gptq3-actorder-v2": (lambda: _gptq_method(3, True, True),
                          lambda w, g: qw.gptq_tensors(w, 3, 32, True, g, v2=True)),
    "ct-w4a16-actorder": (
        lambda: _config_method(dict(fmt="pack-quantized", weights=dict(
            num_bits=4, type="int", strategy="group", group_size=32, symmetric=True,
            actorder="group"))),
        lambda w, g: qw.ct_actorder_tensors(w, 32, g),
    ),
}  # fmt: skip


def _ct_compress(scheme: dict):
    def compress(w, name):
        return qw.ct_compress(w, scheme["fmt"], scheme["weights"], scheme.get("input_activations"))

    return compress


def _act_order_compress(compress, seed: int):
    orders = qw.ActOrders(True, 32, seed)  # gate and up of an expert share theirs
    return lambda w, name: compress(w, orders(name, w.shape[1]))


def _loaded_layer(scheme, experts: int, hidden: int, inter: int, dtype, seed: int,
                  tp: tuple[int, int] = (0, 1)):  # fmt: skip
    """A FusedMoE given the scheme's method (SCHEMES: the package's compression; ACT_ORDER: by
    hand) and, through its parameters' weight_loaders, random expert weights of intermediate
    size `inter` (not yet processed); returns it, the method and the dequantized w13 [E, 2I, H],
    w2 [E, H, I] of the whole experts. tp (rank, size): the layer is that rank's shard."""
    gen = torch.Generator().manual_seed(seed)
    rank, size = tp
    moe = FusedMoE(experts, 2, hidden, inter // size, renormalize=True)
    # what a rank of a tensor-parallel group holds: its slice of every expert's I
    moe.tp_rank, moe.tp_size = moe.slice_rank, moe.inter_slices = rank, size
    moe.prefix, moe.model_dtype = "experts", dtype
    if scheme in ACT_ORDER:
        make, compress = ACT_ORDER[scheme]
        method, compress = make(), _act_order_compress(compress, seed)
    else:
        method, compress = _method(SCHEMES[scheme]), _ct_compress(SCHEMES[scheme])
    method.create_weights(moe)
    params = dict(moe.named_parameters())
    w13 = torch.empty(experts, 2 * inter, hidden)
    w2 = torch.empty(experts, hidden, inter)
    shapes = ((GATE, (inter, hidden)), (UP, (inter, hidden)), (DOWN, (hidden, inter)))
    for e in range(experts):
        for shard, (n, k) in shapes:
            w = torch.randn(n, k, generator=gen) * 0.2
            proj = ("gate_proj", "up_proj", "down_proj")[shard]
            tensors, deq = compress(w, f"experts.{e}.{proj}")
            side = "w2" if shard == DOWN else "w13"
            for suffix, t in tensors.items():
                param = params[f"{side}_{suffix}"]
                param.weight_loader(param, t, (e, shard))
            if shard == DOWN:
                w2[e] = deq
            else:
                w13[e, shard * inter : (shard + 1) * inter] = deq
    return moe, method, w13, w2


def _routing(tokens: int, experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = uneven_ids(tokens, experts, top_k, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    if tokens > experts:
        assert torch.bincount(ids.reshape(-1), minlength=experts)[-1] == 0  # one gets none
    return torch.randn(tokens, 64, generator=gen), ids, weights


def _close(got: torch.Tensor, want: torch.Tensor, dtype, int8_acts: bool = False) -> None:
    # float32: the exact dequantized weights; bfloat16: x, the intermediate and the w4 tiles'
    # float16 group minimums rounded; int8_acts: x (and the intermediate) as int8 per row
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    tol = 3e-2 if int8_acts else tol  # seen: 0.014 in float32
    err = (got.double() - want).abs().max()
    assert err <= tol * want.abs().max(), float(err / want.abs().max())


# the CPU kernel each new scheme takes in a bfloat16 model (where this CPU has it)
BF16_PATHS = {
    "gptq4-actorder": ("w4 tiles, rows sorted by group", cpu_w4.available),
    "gptq4-actorder-asym-v2": ("w4 tiles, rows sorted by group", cpu_w4.available),
    "ct-w4a16-actorder": ("w4 tiles, rows sorted by group", cpu_w4.available),
    "gptq8-actorder": ("rows sorted by group (act-order)", cpu_w4.q8_available),
    "w8a8-channel": ("int8 rows (w8a8", lambda: True),
    "w8a8-tensor-static": ("int8 rows (w8a8", lambda: True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", [*SCHEMES, *ACT_ORDER])
@pytest.mark.parametrize("tokens", [1, 37])
def test_quantized_experts_match_dequantize_then_matmul(scheme, dtype, tokens):
    """The CPU path: FusedMoE.forward on the processed layer (expert_linear per expert). At 37
    tokens the busy experts get more rows than W8A8's int8-activation threshold (13, 8 on AMX),
    one expert none."""
    experts, inter, top_k = 8, 64, 2
    moe, method, w13, w2 = _loaded_layer(scheme, experts, 64, inter, dtype, tokens)
    path = method.process_weights_after_loading(moe)
    if scheme.startswith("w4") and dtype == torch.bfloat16 and cpu_w4.available():
        assert "w4 tiles" in path, path
    if scheme in BF16_PATHS and dtype == torch.bfloat16 and BF16_PATHS[scheme][1]():
        assert BF16_PATHS[scheme][0] in path, path
    if scheme.startswith("w") or scheme in ACT_ORDER:  # no float copy of the integer experts
        assert moe.w13_weight is None and moe.w2_weight is None
    x, ids, weights = _routing(tokens, experts, top_k, tokens)
    # router logits whose top-2 are ids, with weights as their renormalized softmax
    logits = torch.full((tokens, experts), -30.0).scatter_(1, ids, torch.log(weights))
    got = moe(x.to(dtype), logits)
    want = naive_moe(x.to(dtype).float(), w13, w2, weights / weights.sum(-1, keepdim=True), ids)
    _close(got, want, dtype, int8_acts="w8a8" in path)


def _int_parts(moe, method) -> dict[str, ExpertParts]:
    """The loaded integer experts as process_weights_after_loading hands them to the kernel."""
    names, parts = method.names, {}
    for side, k in (("w13", moe.hidden_size), ("w2", moe.inter)):
        zp = getattr(moe, f"{side}_{names['zeros']}", None) if names["zeros"] else None
        g_idx = getattr(moe, f"{side}_{method.dense.G_IDX}") if method.act_order else None
        parts[side] = ExpertParts(
            getattr(moe, f"{side}_{names['codes']}").data,
            getattr(moe, f"{side}_{names['scales']}").data,
            None if zp is None else zp.data,
            k if method.group_size <= 0 else method.group_size,
            None if g_idx is None else g_idx.data,
        )  # fmt: skip
    return parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", [*SCHEMES, *ACT_ORDER])
def test_fused_triton_kernel_on_quantized_experts(scheme, dtype):
    """The CUDA path's objects and kernel (fused_experts_quantized), here under Triton's
    interpreter, on the loaded tensors as process_weights_after_loading hands them over
    (act-order: rows sorted by group, x and the activation read through each expert's order;
    W8A8: the int8 weights alone, the activations in the model dtype)."""
    pytest.importorskip("triton")
    experts, hidden, inter, top_k, tokens = 8, 64, 64, 2, 37
    moe, method, w13, w2 = _loaded_layer(scheme, experts, hidden, inter, dtype, 3)
    moe.to(DEVICE)
    if isinstance(method, Fp8ExpertsMethod):
        fused = FusedFp8Experts(moe.w13_weight.data, moe.w2_weight.data,
                                moe.w13_weight_scale.data[..., 0],
                                moe.w2_weight_scale.data[..., 0])  # fmt: skip
    else:
        fused = FusedIntExperts(_int_parts(moe, method), method.bits)
        if scheme in ACT_ORDER:  # every expert's own order, groups contiguous once sorted
            assert all(w.perm is not None and w.g_idx is None for w in fused.weights)
    x, ids, weights = _routing(tokens, experts, top_k, 3)
    got = fused(x.to(dtype).to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)).cpu()
    _close(got, naive_moe(x.to(dtype).float(), w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("kernel", ["cpu", "triton"])
@pytest.mark.parametrize("scheme", ["gptq4-actorder", "gptq8-actorder", "ct-w4a16-actorder"])
def test_act_order_shard_of_a_tensor_parallel_rank(scheme, kernel):
    """Rank 1 of 2: gate / up its rows of I, down its columns of I, whose rows' groups lie
    anywhere in the full I, so down keeps every group's scales (as a dense row-parallel layer
    does); its output is the rank's share of the sum, against the shard's dequantized weights."""
    experts, hidden, inter, top_k, tokens, dtype = 8, 64, 128, 2, 37, torch.float32
    moe, method, w13, w2 = _loaded_layer(scheme, experts, hidden, inter, dtype, 5, tp=(1, 2))
    half = inter // 2
    assert moe.inter == half
    scales = getattr(moe, f"w2_{method.names['scales']}")
    assert scales.shape == (experts, hidden, inter // 32)  # every group's
    rows = torch.cat([torch.arange(half, inter), torch.arange(inter + half, 2 * inter)])
    w13_shard, w2_shard = w13[:, rows], w2[:, :, half:]
    x, ids, weights = _routing(tokens, experts, top_k, 5)
    want = naive_moe(x.float(), w13_shard, w2_shard, weights, ids)
    if kernel == "triton":
        pytest.importorskip("triton")
        moe.to(DEVICE)
        fused = FusedIntExperts(_int_parts(moe, method), method.bits)
        assert fused.weights[1].g_idx is not None  # down's groups: not k // group
        got = fused(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)).cpu()
    else:
        method.process_weights_after_loading(moe)
        logits = torch.full((tokens, experts), -30.0).scatter_(1, ids, torch.log(weights))
        got = moe(x, logits)
        want = naive_moe(x.float(), w13_shard, w2_shard, weights / weights.sum(-1, keepdim=True),
                         ids)  # fmt: skip
    _close(got, want, dtype)


# -- whole models: greedy tokens against HF on the dequantized weights ------------------------

# I = 64: the experts' down projection takes the w4 tiles (K a multiple of 64) and splits into
# two groups of 32 per rank under TP=2
MOE_I64 = {
    "qwen3_moe": {**MOE_MODELS["qwen3_moe"], "moe_intermediate_size": 64},
    "mixtral": {**MOE_MODELS["mixtral"], "intermediate_size": 64},
    "qwen2_moe": {**MOE_MODELS["qwen2_moe"], "moe_intermediate_size": 64,
                  "shared_expert_intermediate_size": 64},
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_written(make_tiny_model, tmp_path_factory):
    """(arch, scheme) -> (float folder, quantized folder, dequantized weights), written once."""
    cache: dict = {}

    def get(arch: str, scheme: str):
        if (arch, scheme) not in cache:
            src = make_tiny_model(f"tiny-{arch}-i64", arch=arch, **MOE_I64[arch])
            dst = tmp_path_factory.mktemp(f"{arch}-{scheme}")
            if scheme in WRITERS:
                folder, deq = WRITERS[scheme](src, dst)
            else:
                s = SCHEMES[scheme]
                folder, deq = qw.write_compressed_tensors(
                    src, dst, fmt=s["fmt"], weights=s["weights"],
                    input_activations=s.get("input_activations"),
                )  # fmt: skip
            cache[arch, scheme] = (src, folder, deq)
        return cache[arch, scheme]

    return get


def _greedy(folder, dtype: str, num_new: int = 8, tp: int = 1, device: str = "cpu",
            ep: bool = False) -> list[list[int]]:  # fmt: skip
    llm = LLM(str(folder), dtype=dtype, seed=0, num_kv_blocks=64, max_model_len=256,
              tensor_parallel_size=tp, device=device, enable_expert_parallel=ep)  # fmt: skip
    try:
        qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
        runner = llm.engine.executor.runner
        assert runner.quantization == qcfg["quant_method"]  # no flag
        experts = runner.model.model.layers[0].mlp.experts
        assert experts.tp_size == tp  # rank 0's shard
        if ep:  # rank 0 holds the first half of the experts, whole
            assert experts.num_local_experts == experts.num_experts // tp
            assert experts.first_expert == 0 and experts.inter_slices == 1
        if device == "cuda":  # the fused Triton kernel on the quantized weights
            assert experts.fused_quantized is not None
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY_CASES = [
    ("qwen3_moe", "fp8-channel", "bfloat16"),
    ("qwen3_moe", "fp8-tensor", "float32"),
    ("qwen3_moe", "w4a16-group-asym", "bfloat16"),
    ("qwen3_moe", "w4a16-channel", "float32"),
    ("qwen3_moe", "w4a8-group", "bfloat16"),
    ("qwen3_moe", "w8a16-channel", "bfloat16"),
    ("qwen3_moe", "w8a16-group-asym", "bfloat16"),
    ("mixtral", "fp8-channel", "bfloat16"),
    ("mixtral", "w4a16-group-asym", "bfloat16"),
    ("qwen3_moe", "gptq4-g32-sym", "bfloat16"),
    ("qwen3_moe", "gptq4-g32-asym-v2", "float32"),
    ("qwen3_moe", "gptq8-channel", "bfloat16"),
    ("qwen3_moe", "gptq3-g32-asym", "bfloat16"),
    ("qwen3_moe", "gptq3-g32-asym", "float32"),
    ("qwen3_moe", "awq-g32", "bfloat16"),
    ("mixtral", "gptq4-g32-sym", "bfloat16"),
    ("mixtral", "awq-g32", "float32"),
    ("qwen3_moe", "fp8", "bfloat16"),
    # act-order: each expert's rows sorted by its own g_idx
    ("qwen3_moe", "gptq4-actorder", "bfloat16"),
    ("qwen3_moe", "gptq4-actorder-asym-v2", "float32"),
    ("qwen3_moe", "gptq8-actorder", "bfloat16"),
    ("qwen3_moe", "ct-w4a16-actorder", "bfloat16"),
    ("mixtral", "gptq4-actorder", "bfloat16"),
    ("qwen2_moe", "gptq4-actorder", "bfloat16"),
    # W8A8: int8 activations where a call has enough rows (the dense layers' prefill, the busy
    # experts'), an approximation the reference's near ties allow for
    ("qwen3_moe", "w8a8-channel", "bfloat16"),
    ("qwen3_moe", "w8a8-tensor-static", "float32"),
    ("mixtral", "w8a8-channel", "bfloat16"),
    ("qwen2_moe", "w8a8-channel", "bfloat16"),
]


# W8A8: x as int8 per row in every quantized layer moves this tiny model's logits by a few
# hundredths (seen: a float32 run flips a top-2 gap of 0.016; bfloat16 alone one of 0.055)
INT8_ACTS_GAP_TOL = 0.1
# 4-bit weights in bfloat16 where a w4 path takes x as int8 per 32 (AVX2: every call; AVX512-VNNI
# without AMX: calls above 12 rows, the prompts' prefill): seen flipping top-2 gaps of 0.05-0.21
# on this tiny model (AVX2), 0.21 (Zen 4's batch kernel, qwen3_moe gptq3)
W4_INT8_X_GAP_TOL = 0.3
W4_SCHEMES = ("gptq4", "gptq3", "awq", "w4a16", "w4a8")


def _gap_tol(scheme: str, dtype: str) -> float:
    if scheme.startswith("w8a8"):
        return INT8_ACTS_GAP_TOL
    if dtype == "bfloat16" and scheme.startswith(W4_SCHEMES) and cpu_isa.w4_int8_x_from_rows():
        return W4_INT8_X_GAP_TOL
    return GAP_TOL[dtype]


@pytest.mark.parametrize("arch, scheme, dtype", GREEDY_CASES)
def test_greedy_tokens_follow_the_dequantized_reference(moe_written, arch, scheme, dtype):
    src, folder, deq = moe_written(arch, scheme)
    assert any(".experts." in name for name in deq)  # the experts are quantized
    ref = qw.reference_model(src, deq)
    tol = _gap_tol(scheme, dtype)
    for prompt, ours in zip(PROMPTS, _greedy(folder, dtype), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(ours, theirs, gaps, tol)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp8-channel", "w4a16-group-asym", "gptq4-g32-sym",
                                    "gptq4-actorder"])  # fmt: skip
def test_tp2_greedy_tokens_follow_the_dequantized_reference(moe_written, scheme):
    """LLM(dir, tensor_parallel_size=2): two worker ranks, each with its shard of every expert."""
    src, folder, deq = moe_written("qwen3_moe", scheme)
    ref = qw.reference_model(src, deq)
    for prompt, ours in zip(PROMPTS, _greedy(folder, "float32", tp=2), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(ours, theirs, gaps, GAP_TOL["float32"])


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["fp8-channel", "w4a16-group-asym", "gptq4-actorder",
                                    "w8a8-channel", "awq-g32"])  # fmt: skip
def test_tp2_expert_parallel_greedy_tokens_follow_the_dequantized_reference(moe_written, scheme):
    """--enable-expert-parallel over two ranks: each holds half the experts whole (their codes,
    scales, zero points and g_idx as the checkpoint has them: no shard of I), the others'
    tensors are not even kept."""
    src, folder, deq = moe_written("qwen3_moe", scheme)
    ref = qw.reference_model(src, deq)
    tol = INT8_ACTS_GAP_TOL if scheme.startswith("w8a8") else GAP_TOL["float32"]
    for prompt, ours in zip(PROMPTS, _greedy(folder, "float32", tp=2, ep=True), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(ours, theirs, gaps, tol)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "scheme",
    [
        "fp8-channel",
        "w4a16-group-asym",
        "gptq4-g32-sym",
        "gptq4-actorder",
        "w8a8-channel",
        "gptq3-g32-asym",
    ],
)
def test_cuda_greedy_tokens_follow_the_dequantized_reference(moe_written, scheme):
    """On a GPU: the fused Triton kernel compiled, through the whole engine."""
    src, folder, deq = moe_written("qwen3_moe", scheme)
    ref = qw.reference_model(src, deq)
    for prompt, ours in zip(PROMPTS, _greedy(folder, "bfloat16", device="cuda"), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(ours, theirs, gaps, GAP_TOL["bfloat16"])  # W8A8: weight-only


def test_start_up_log_names_the_experts_kernel(moe_written):
    _, folder, _ = moe_written("qwen3_moe", "w4a16-group-asym")
    model, paths = _load(folder, "bfloat16")
    assert sum(paths["experts"].values()) == 2  # layer 1 is dense (mlp_only_layers)
    want = "w4 tiles" if cpu_w4.available() else "fallback"
    assert all(want in why for why in paths["experts"]), paths["experts"]
    layer = model.model.layers[0].mlp.experts
    assert layer.w13_weight is None and layer.w2_weight is None  # no float copy kept
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16  # the router: float


# -- tensor parallelism: the experts' codes, scales and zero points split over 2 gloo ranks ------

TP_SCHEMES = ["fp8-channel", "w4a16-group-asym", "w8a16-channel", "gptq4-g32-asym-v2", "awq-g32",
              "gptq4-actorder", "gptq8-actorder", "ct-w4a16-actorder"]  # fmt: skip


@pytest.mark.slow
def test_tp2_shards_give_the_logits_of_one_process(moe_written, tmp_path):
    torch.set_num_threads(1)
    folders = [moe_written("qwen3_moe", s)[1] for s in TP_SCHEMES]
    folders.append(moe_written("mixtral", "w4a16-group-asym")[1])
    expected = [_tp_logits(f) for f in folders]
    logits, paths0, paths1 = _tp2(folders, tmp_path, "float32")
    for folder, got, want in zip(folders, logits, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=str(folder))
    assert paths0 == paths1
    assert all("experts" in p for p in paths0)


@pytest.mark.slow
def test_tp2_shards_on_the_cpu_kernels(moe_written, tmp_path):
    """bfloat16: each rank's expert shards on the w4 tiles / int8 rows."""
    torch.set_num_threads(1)
    folders = [moe_written("qwen3_moe", s)[1] for s in TP_SCHEMES]
    expected = [_tp_logits(f, None, "bfloat16") for f in folders]
    logits, paths0, paths1 = _tp2(folders, tmp_path, "bfloat16")
    # one process runs the down projection (K = I = 64) on the w4 tiles, each rank its half
    # (K = 32) on the exact fallback: x's int8 rounding on AVX2 (seen 0.15) is in the gap
    bound = 0.2 if cpu_w4.x_as_int8() else 0.08
    for scheme, got, want in zip(TP_SCHEMES, logits, expected, strict=True):
        assert (got - want).abs().max() <= bound * want.abs().max(), scheme
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8, scheme
    assert paths0 == paths1
    if cpu_w4.available():
        assert any("w4 tiles" in why for why in paths0[1]["experts"])


@pytest.mark.slow
def test_tp2_w8a8_experts_near_one_process(moe_written, tmp_path):
    """W8A8 over 2 ranks: each rank quantizes its own shard of the activation for down (its
    own row scales), so the logits are one process's only within int8 activations' error
    (float32; in bfloat16 this tiny model's last norm amplifies that error past any bound)."""
    torch.set_num_threads(1)
    folder = moe_written("qwen3_moe", "w8a8-channel")[1]
    want = _tp_logits(folder)
    (got,), paths0, paths1 = _tp2([folder], tmp_path, "float32")
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # seen: 0.02
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    assert paths0 == paths1
    if cpu_gemm.available(torch.float32, torch.int8):
        assert all("w8a8" in why for why in paths0[0]["experts"])


# -- refusals ------------------------------------------------------------------------------------


def test_w8a8_and_act_order_experts_get_the_dense_layers_scheme():
    """The configs that were refused for MoE experts: each expert as a dense layer of its
    scheme (int8 activations, act-order's g_idx)."""
    w8a8 = _config_method(W8A8_CHANNEL)
    assert isinstance(w8a8, IntExpertsMethod) and w8a8.act_quant and not w8a8.act_order
    for method, name in ((_gptq_method(4, True, False), "g_idx"),
                          (ACT_ORDER["ct-w4a16-actorder"][0](), "weight_g_idx")):  # fmt: skip
        assert isinstance(method, IntExpertsMethod) and method.act_order
        assert name == method.dense.G_IDX  # the checkpoint tensor it loads
    # without desc_act a GPTQ g_idx is the trivial order, read and dropped
    assert not _gptq_method(4, True, False, desc_act=False).act_order


def test_gate_and_up_with_different_act_orders_are_refused():
    """One gate_up reads x through one order: an expert whose gate and up disagree fails at
    load, naming the layer and the expert."""
    moe = FusedMoE(4, 2, 64, 32, renormalize=True)
    moe.prefix = "model.layers.0.mlp.experts"
    method = _gptq_method(4, True, False)
    method.create_weights(moe)
    gen = torch.Generator().manual_seed(0)
    param = moe.w13_g_idx
    param.weight_loader(param, qw.act_order_g_idx(64, 32, gen), (2, GATE))
    with pytest.raises(ValueError, match="experts: expert 2's gate and up .* different g_idx"):
        param.weight_loader(param, qw.act_order_g_idx(64, 32, gen), (2, UP))


def test_a_quantized_router_is_refused_naming_the_ignore_list():
    group = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}  # fmt: skip
    config = build_config("compressed-tensors", {"config_groups": {"g": group},
                                                 "ignore": ["lm_head"]})  # fmt: skip
    sources = ["model.layers.0.mlp.experts.0.gate_proj"]
    with pytest.raises(ValueError, match=r"quantization_config.ignore.*model.layers.0.mlp.gate"):
        config.experts_method("model.layers.0.mlp.experts", sources)


def test_a_group_that_does_not_divide_a_tp_shard_is_named():
    moe = FusedMoE(4, 2, 64, 32, renormalize=True)
    moe.prefix = "model.layers.0.mlp.experts"
    with pytest.raises(ValueError, match="group_size 64 does not divide"):
        IntExpertsMethod(CTPackedLinearMethod(4, 64, True, False)).create_weights(moe)
