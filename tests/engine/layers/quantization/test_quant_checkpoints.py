"""Quantized checkpoints as people download them: GPTQ, AWQ, compressed-tensors and FP8.

A tiny random Llama is written in each format (quant_writers: GPTQ and AWQ packed by hand,
compressed-tensors by its own package); the reference is HF transformers with every quantized
weight replaced by its exact dequantized value. Checked: each layer's loaded form unpacks to
exactly those values (through the kernel's own layout), the engine's greedy tokens follow the
reference's wherever its top-2 logit gap is clear, the start-up picks the method from
config.json and names each layer kind's kernel, and unsupported schemes fail at start-up
naming the field.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels.cpu import w4 as cpu_w4
from engine.layers.quantization import QUANTIZATION_CHOICES
from engine.layers.quantization.checkpoint import (
    apply_checkpoint_methods,
    build_config,
    finish_checkpoint_methods,
    resolve_checkpoint,
)
from engine.layers.quantization.fp8 import Fp8LinearMethod
from engine.layers.quantization.int8 import Int8LinearMethod
from engine.layers.quantization.int_weight import (
    CheckpointInt8LinearMethod,
    CheckpointW8A8LinearMethod,
    DequantLinearMethod,
    GroupedDequantLinearMethod,
    PackedQ8LinearMethod,
    PackedW4LinearMethod,
    PermutedW4LinearMethod,
)
from engine.layers.quantization.packed import dequantize
from engine.models.loader import load_model
from tests.engine.layers.quantization import quant_writers as qw

W4A16 = dict(num_bits=4, type="int", strategy="group", group_size=32)
FORMATS = {
    # id: (writer, the CPU path a bfloat16 model takes)
    "gptq4-g32-sym": (functools.partial(qw.write_gptq, bits=4, group=32), PackedW4LinearMethod),
    "gptq4-g32-asym": (
        functools.partial(qw.write_gptq, bits=4, group=32, sym=False),
        PackedW4LinearMethod,
    ),
    "gptq4-actorder": (
        functools.partial(qw.write_gptq, bits=4, group=32, desc_act=True),
        PermutedW4LinearMethod,
    ),
    # 2- and 3-bit: the codes shifted into the 4-bit kernels' range (engine/.../gptq.py)
    "gptq3-g32-sym": (functools.partial(qw.write_gptq, bits=3, group=32), PackedW4LinearMethod),
    "gptq3-g32-asym-v2": (
        functools.partial(qw.write_gptq, bits=3, group=32, sym=False, v2=True),
        PackedW4LinearMethod,
    ),
    "gptq3-actorder": (
        functools.partial(qw.write_gptq, bits=3, group=32, desc_act=True),
        PermutedW4LinearMethod,
    ),
    "gptq2-g32-asym": (
        functools.partial(qw.write_gptq, bits=2, group=32, sym=False),
        PackedW4LinearMethod,
    ),
    "gptq8-channel": (
        functools.partial(qw.write_gptq, bits=8, group=-1),
        CheckpointInt8LinearMethod,
    ),
    "gptq8-g32-asym-v2": (
        functools.partial(qw.write_gptq, bits=8, group=32, sym=False, v2=True),
        PackedQ8LinearMethod,
    ),
    "gptq8-g32-actorder": (
        functools.partial(qw.write_gptq, bits=8, group=32, desc_act=True),
        PackedQ8LinearMethod,
    ),
    "awq-g32": (functools.partial(qw.write_awq, group=32), PackedW4LinearMethod),
    "ct-w4a16-group-sym": (
        functools.partial(
            qw.write_compressed_tensors, fmt="pack-quantized", weights={**W4A16, "symmetric": True}
        ),  # fmt: skip
        PackedW4LinearMethod,
    ),
    "ct-w4a16-group-asym": (
        functools.partial(
            qw.write_compressed_tensors, fmt="pack-quantized", weights={**W4A16, "symmetric": False}
        ),  # fmt: skip
        PackedW4LinearMethod,
    ),
    "ct-w4a16-channel": (
        functools.partial(
            qw.write_compressed_tensors,
            fmt="pack-quantized",
            weights=dict(num_bits=4, type="int", strategy="channel"),
        ),  # fmt: skip
        PackedW4LinearMethod,
    ),
    "ct-w4a16-actorder": (qw.write_ct_actorder, PermutedW4LinearMethod),
    # W4A8: the w4 tiles quantize x themselves (the reference keeps it float)
    "ct-w4a8-group-sym": (
        functools.partial(
            qw.write_compressed_tensors,
            fmt="pack-quantized",
            weights={**W4A16, "symmetric": True},
            input_activations=dict(num_bits=8, type="int", strategy="token", dynamic=True),
        ),  # fmt: skip
        PackedW4LinearMethod,
    ),
    "ct-w8a16-channel": (
        functools.partial(
            qw.write_compressed_tensors,
            fmt="pack-quantized",
            weights=dict(num_bits=8, type="int", strategy="channel"),
        ),  # fmt: skip
        CheckpointInt8LinearMethod,
    ),
    "ct-w8a8-int": (
        functools.partial(
            qw.write_compressed_tensors,
            fmt="int-quantized",
            weights=dict(num_bits=8, type="int", strategy="channel"),
            input_activations=dict(num_bits=8, type="int", strategy="token", dynamic=True),
        ),  # fmt: skip
        CheckpointW8A8LinearMethod,
    ),
    "ct-fp8-channel-dynamic": (
        functools.partial(
            qw.write_compressed_tensors,
            fmt="float-quantized",
            weights=dict(num_bits=8, type="float", strategy="channel"),
            input_activations=dict(num_bits=8, type="float", strategy="token", dynamic=True),
        ),  # fmt: skip
        Fp8LinearMethod,
    ),
    "ct-fp8-tensor-static": (
        functools.partial(
            qw.write_compressed_tensors,
            fmt="float-quantized",
            weights=dict(num_bits=8, type="float", strategy="tensor"),
            input_activations=dict(num_bits=8, type="float", strategy="tensor", dynamic=False),
        ),  # fmt: skip
        Fp8LinearMethod,
    ),
    "fp8": (qw.write_fp8, Fp8LinearMethod),
}
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
NUM_NEW = 8


@pytest.fixture(scope="module")
def written(tiny_llama_dir, tmp_path_factory):
    """{format id: (folder, {checkpoint layer name: dequantized weight})}, written once."""
    cache: dict[str, tuple] = {}

    def get(fmt: str):
        if fmt not in cache:
            if fmt.startswith("ct-"):  # written by the package (the test extra's)
                pytest.importorskip("compressed_tensors")
            writer = FORMATS[fmt][0]
            cache[fmt] = writer(tiny_llama_dir, tmp_path_factory.mktemp(fmt))
        return cache[fmt]

    return get


def _loaded_weight(layer) -> torch.Tensor:
    """The float32 [N, K] a loaded layer multiplies by, read back from its kernel's form."""
    m = layer.quant_method
    if isinstance(m, PackedW4LinearMethod):
        return cpu_w4.dequantize(layer.w4)
    if isinstance(m, PermutedW4LinearMethod):  # tile row k is the checkpoint's act_perm[k]
        w = torch.empty(layer.w4.out_features, layer.w4.in_features)
        w[:, layer.act_perm] = cpu_w4.dequantize(layer.w4)
        return w
    if isinstance(m, DequantLinearMethod):
        return dequantize(layer.packed).t()
    if isinstance(m, GroupedDequantLinearMethod):
        w = layer.codes.float() * layer.group_scales.float() - layer.group_zs.float()
        w = w.reshape(-1, w.shape[-1]).t()  # [N, K], rows sorted by group under act-order
        if layer.act_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, layer.act_perm] = w
        return out
    if isinstance(m, PackedQ8LinearMethod):  # tile row k is the checkpoint's act_perm[k]
        x = torch.eye(layer.q8.in_features, dtype=torch.bfloat16)  # one-hot rows: x as int8 exact
        w = cpu_w4.linear_q8(x, layer.q8).t()
        if layer.act_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, layer.act_perm] = w
        return out
    if isinstance(m, Fp8LinearMethod) and layer.weight is None:  # the CPU's FP8 kernels' codes
        return layer.fp8_cpu.dequantize(torch.float32)
    if isinstance(m, (Int8LinearMethod, Fp8LinearMethod)):
        return layer.weight.float() * layer.weight_scale[:, None]
    raise AssertionError(f"unexpected method {type(m).__name__}")


def _load(folder, dtype: str):
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    method, _ = resolve_checkpoint(None, qcfg)
    config = build_config(method, qcfg)
    model = load_model(
        folder, dtype=dtype, prepare=functools.partial(apply_checkpoint_methods, config=config)
    )
    return model, finish_checkpoint_methods(model, config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_layer_unpacks_to_the_checkpoints_values(written, fmt, dtype):
    folder, deq = written(fmt)
    model, paths = _load(folder, dtype)
    want_bf16 = FORMATS[fmt][1]
    checked = 0
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue
        parts = [name[: -len(kind)] + p for p in MERGED.get(kind, (kind,))]
        want = torch.cat([deq[p] for p in parts])
        got = _loaded_weight(module)
        if dtype == "bfloat16":
            if (
                want_bf16 in (PackedW4LinearMethod, PermutedW4LinearMethod)
                and not cpu_w4.available()
            ):
                want_bf16 = DequantLinearMethod
            assert isinstance(module.quant_method, want_bf16), (name, paths)
        # exact, but for the scales' rounding to the model dtype (fallback) or a group minimum's
        # to float16 (w4 tiles)
        tol = 1e-6 if dtype == "float32" else 2e-2
        scale = want.abs().amax()
        assert (got - want).abs().max() <= tol * scale, (name, type(module.quant_method))
        checked += 1
    assert checked == 4 * model.config.num_hidden_layers
    assert "lm_head" in paths


def _hf_greedy(ref, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The reference's greedy tokens and, at each, its top-2 logit gap."""
    tokens, gaps = [], []
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(NUM_NEW):
            logits = ref(input_ids=ids).logits[0, -1]
            top = logits.topk(2).values
            tokens.append(int(logits.argmax()))
            gaps.append(float(top[0] - top[1]))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, gaps


PROMPTS = [[5, 17, 99, 3, 42], [200, 7, 7, 31, 64, 80, 11, 150, 3, 9, 12, 13, 14, 2, 300, 6, 8]]
GAP_TOL = {"float32": 1e-3, "bfloat16": 0.05}


def _assert_greedy_agrees(ours: list[int], theirs: list[int], gaps: list[float], tol: float):
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:  # allowed only where the reference's own choice was a near tie
            assert gaps[i] < tol, f"token {i}: {a} != {b} with a top-2 gap of {gaps[i]:.4f}"
            return


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_greedy_tokens_follow_the_dequantized_reference(written, tiny_llama_dir, fmt, dtype):
    folder, deq = written(fmt)
    ref = qw.reference_model(tiny_llama_dir, deq)
    llm = LLM(str(folder), dtype=dtype, seed=0, num_kv_blocks=64, max_model_len=256)
    try:
        qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
        assert llm.engine.executor.runner.quantization == qcfg["quant_method"]  # no flag
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(list(out.outputs[0].token_ids), theirs, gaps, GAP_TOL[dtype])


@pytest.mark.parametrize("fmt", ["gptq4-g32-asym", "awq-g32", "fp8"])
def test_qwen2_biases_and_tied_embeddings(tiny_qwen2_dir, tmp_path, fmt):
    folder, deq = FORMATS[fmt][0](tiny_qwen2_dir, tmp_path / fmt)
    ref = qw.reference_model(tiny_qwen2_dir, deq)
    llm = LLM(str(folder), dtype="float32", seed=0, num_kv_blocks=64, max_model_len=256)
    try:
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(list(out.outputs[0].token_ids), theirs, gaps, GAP_TOL["float32"])


@pytest.mark.parametrize(
    "writer",
    [
        functools.partial(qw.write_awq, group=32, skip=("down_proj", "o_proj")),
        functools.partial(qw.write_fp8, skip=("down_proj", "o_proj")),
        functools.partial(qw.write_compressed_tensors, fmt="pack-quantized",
                          weights={**W4A16, "symmetric": True}, skip=("down_proj", "o_proj")),
    ],
    ids=["awq-modules_to_not_convert", "fp8-ignored_layers", "ct-ignore"],
)  # fmt: skip
def test_ignore_lists_keep_those_layers_in_float(tiny_llama_dir, tmp_path, writer):
    if "compressed" in str(writer.func):
        pytest.importorskip("compressed_tensors")
    folder, deq = writer(tiny_llama_dir, tmp_path / "q")
    model, paths = _load(folder, "float32")
    assert set(paths["down_proj"]) == {"unquantized (not quantized in the checkpoint)"}
    assert set(paths["o_proj"]) == {"unquantized (not quantized in the checkpoint)"}
    assert "unquantized (not quantized in the checkpoint)" not in paths["qkv_proj"]
    from safetensors.torch import load_file

    float_state = load_file(str(tiny_llama_dir / "model.safetensors"))
    layer = model.model.layers[1].mlp.down_proj
    assert torch.equal(layer.weight, float_state["model.layers.1.mlp.down_proj.weight"])
    ref = qw.reference_model(tiny_llama_dir, deq)
    llm = LLM(str(folder), dtype="float32", seed=0, num_kv_blocks=64, max_model_len=256)
    try:
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(list(out.outputs[0].token_ids), theirs, gaps, GAP_TOL["float32"])


@pytest.mark.parametrize(
    ("fmt", "says", "not_said"),
    [
        ("gptq4-g32-sym", "Quantization gptq: GPTQ 4-bit, group size 32, symmetric",
         "served as 4-bit codes"),
        ("gptq3-g32-sym", "GPTQ 3-bit, group size 32, symmetric, gptq (v1: zero points stored "
         "minus 1); served as 4-bit codes", "int8 activations"),
        ("ct-w4a8-group-sym", "int4 group 32 sym, int8 activations: on the CPU's w4 tiles as "
         "the kernel quantizes x", "served as 4-bit codes"),
    ],
)  # fmt: skip
def test_start_up_log_names_the_method_and_each_layer_kinds_kernel(written, caplog, fmt, says,
                                                                   not_said):  # fmt: skip
    if fmt.startswith("ct-"):
        pytest.importorskip("compressed_tensors")
    folder, _ = written(fmt)
    with caplog.at_level(logging.INFO, logger="tessera.engine"):
        _load(folder, "bfloat16")
    text = caplog.text
    assert says in text and not_said not in text
    for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
        assert f"  {kind}: " in text
    if cpu_w4.available():
        assert "w4 tiles" in text


def test_fp8_on_a_float_checkpoint_quantizes_at_load(tiny_llama_dir):
    from engine.layers.quantization.fp8 import quantize_rows_fp8

    llm = LLM(str(tiny_llama_dir), dtype="float32", quantization="fp8", num_kv_blocks=64,
              max_model_len=256)  # fmt: skip
    try:
        model = llm.engine.executor.runner.model
        layer = model.model.layers[0].self_attn.o_proj
        assert isinstance(layer.quant_method, Fp8LinearMethod)
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    from safetensors.torch import load_file

    state = load_file(str(tiny_llama_dir / "model.safetensors"))
    deq = {}
    for name in qw._linear_names(state):
        q, s = quantize_rows_fp8(state[f"{name}.weight"])
        deq[name] = q.float() * s[:, None]
    ref = qw.reference_model(tiny_llama_dir, deq)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(list(out.outputs[0].token_ids), theirs, gaps, GAP_TOL["float32"])


# -- detection and start-up errors -----------------------------------------------------------


def test_the_registry_gives_the_flag_its_choices():
    for name in ("gptq", "awq", "compressed-tensors", "fp8"):
        assert name in QUANTIZATION_CHOICES


def test_the_checkpoints_method_is_picked_and_a_contradicting_flag_refused():
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert resolve_checkpoint(None, gptq)[0] == "gptq"
    assert resolve_checkpoint("gptq", gptq)[0] == "gptq"
    assert resolve_checkpoint(None, None) is None
    assert resolve_checkpoint("fp8", None)[0] == "fp8"  # quantized at load
    with pytest.raises(ValueError, match="--quantization int8 contradicts.*'gptq'"):
        resolve_checkpoint("int8", gptq)
    with pytest.raises(ValueError, match="--quantization none contradicts"):
        resolve_checkpoint("none", gptq)
    with pytest.raises(ValueError, match="--quantization gptq needs a checkpoint"):
        resolve_checkpoint("gptq", None)
    with pytest.raises(ValueError, match="quant_method = 'hqq'.*supported: gptq"):
        resolve_checkpoint(None, {"quant_method": "hqq"})


CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                               "group_size": 32, "symmetric": True}}  # fmt: skip


@pytest.mark.parametrize(
    ("method", "qcfg", "field"),
    [
        ("gptq", {"bits": 5, "group_size": 128}, "bits = 5.*supported: 2, 3, 4, 8"),
        ("gptq", {"bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
        ("gptq", {"bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
        ("awq", {"bits": 4, "group_size": 128, "version": "gemv"}, "version = 'gemv'.*gemm"),
        ("awq", {"bits": 8, "group_size": 128}, "bits = 8"),
        ("fp8", {"activation_scheme": "dynamic", "weight_block_size": [128]},
         "weight_block_size"),
        ("fp8", {"activation_scheme": "weird"}, "activation_scheme"),
        ("compressed-tensors", {"format": "marlin-24", "config_groups": {"g": CT_GROUP}},
         "format = 'marlin-24'.*pack-quantized"),
        ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": {
            **CT_GROUP, "weights": {**CT_GROUP["weights"], "num_bits": 2}}}},
         "config_groups.g.weights.num_bits = 2"),
        ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": {
            **CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "block"}}}},
         "config_groups.g.weights.strategy = 'block'"),
        ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": {
            **CT_GROUP, "input_activations": {"num_bits": 8, "type": "int"}}}},
         "config_groups.g.input_activations"),
        ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": {
            **CT_GROUP, "weights": {**CT_GROUP["weights"], "num_bits": 8},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                  "dynamic": True}}}},
         "config_groups.g.input_activations.*8-bit pack-quantized weights are weight-only"),
        ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": {
            **CT_GROUP, "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor",
                                              "dynamic": False}}}},
         "config_groups.g.input_activations.strategy = 'tensor'.*token, dynamic"),
        ("compressed-tensors", {"format": "pack-quantized", "config_groups": {"g": CT_GROUP},
                                "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ],
)  # fmt: skip
def test_unsupported_schemes_name_the_field(method, qcfg, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        build_config(method, {"quant_method": method, **qcfg})


def test_a_quantized_lm_head_is_refused_at_start_up(tiny_llama_dir):
    config = build_config("compressed-tensors", {"config_groups": {"g": CT_GROUP}, "ignore": []})
    with pytest.raises(ValueError, match="quantization_config.ignore.*lm_head"):
        load_model(tiny_llama_dir, prepare=functools.partial(apply_checkpoint_methods,
                                                             config=config))  # fmt: skip


def test_start_up_errors_come_from_the_engine(written, tmp_path):
    folder, _ = written("gptq4-g32-sym")
    with pytest.raises(ValueError, match="--quantization w8a8 contradicts"):
        LLM(str(folder), quantization="w8a8", num_kv_blocks=64, max_model_len=256)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 5
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config.bits = 5"):
        LLM(str(bad), num_kv_blocks=64, max_model_len=256)
    # a config whose bits misstate the tensors' packing: the layer and tensor are named
    cfg["quantization_config"]["bits"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\..*: checkpoint tensor \(16, 64\): 3-bit codes"
    ):
        LLM(str(bad), num_kv_blocks=64, max_model_len=256)


def test_a_group_that_does_not_divide_the_layer_is_named(written, tmp_path):
    folder, _ = written("gptq4-g32-sym")
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 48
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        _load(bad, "float32")


# -- tensor parallelism: qweight / scales / zeros / g_idx split across 2 gloo ranks ---------------

TP_FORMATS = ["gptq4-g32-asym", "gptq4-actorder", "gptq8-channel", "awq-g32", "ct-w4a16-channel",
              "ct-w8a16-channel", "ct-fp8-tensor-static", "ct-w4a16-group-asym", "gptq8-g32-asym-v2",
              "ct-w4a16-actorder", "gptq3-g32-asym-v2", "gptq2-g32-asym"]  # fmt: skip
TP_PROMPT = [7, 99, 250, 3, 18, 41, 300, 5, 120, 64, 11]


def _tp_logits(folder, paths: list | None = None, dtype: str = "float32") -> torch.Tensor:
    from engine.attention.backends.torch import TorchAttentionBackend
    from engine.attention.metadata import common_metadata_from_seqs
    from engine.distributed import get_tp_size

    model, taken = _load(folder, dtype)
    torch_dtype = getattr(torch, dtype)
    if paths is not None:
        paths.append({kind: dict(c) for kind, c in taken.items()})
    cfg = model.config
    hkv = cfg.num_key_value_heads // get_tp_size()
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(2, 8, 8, hkv, cfg.head_dim, dtype=torch_dtype)
        attn.kv_scales = None
    heads = cfg.num_attention_heads // get_tp_size()
    backend = TorchAttentionBackend(8, heads, hkv, cfg.head_dim, torch_dtype)
    for attn in model.attention_layers():
        attn.backend = backend
    with torch.inference_mode():
        meta = backend.build_metadata(common_metadata_from_seqs([(0, len(TP_PROMPT), [5, 2])], 8))
        positions = torch.arange(len(TP_PROMPT))
        return model.compute_logits(model(torch.tensor(TP_PROMPT), positions, meta)).float()


def _tp_worker(rank: int, port: int, folders: list, out_file: str, dtype: str) -> None:
    from engine.distributed import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        paths: list = []
        results = [_tp_logits(f, paths, dtype) for f in folders]
        torch.save((results, paths), f"{out_file}.{rank}")
    finally:
        destroy_distributed()


def _tp2(folders: list, tmp_path, dtype: str) -> tuple[list, list, list]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"tp2-{dtype}.pt"
    mp.spawn(_tp_worker, args=(port, folders, str(out), dtype), nprocs=2, join=True)
    (logits, paths0), (_, paths1) = (torch.load(f"{out}.{rank}") for rank in (0, 1))
    return logits, paths0, paths1


@pytest.mark.slow
def test_tp2_shards_give_the_logits_of_one_process(written, tmp_path):
    torch.set_num_threads(1)
    folders = [written(f)[0] for f in TP_FORMATS]
    expected = [_tp_logits(f) for f in folders]
    logits, paths0, paths1 = _tp2(folders, tmp_path, "float32")
    for fmt, got, want in zip(TP_FORMATS, logits, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=fmt)
    assert paths0 == paths1  # both ranks' shards take the same kernels
    int8 = paths0[TP_FORMATS.index("gptq8-channel")]
    assert set(int8["o_proj"]) == {"int8 rows (int8 C GEMM)"}  # g_idx rebased on rank 1 too


TP_KERNEL_FORMATS = ["gptq4-g32-asym", "gptq4-actorder", "gptq8-g32-asym-v2", "ct-w4a16-group-sym"]


@pytest.mark.slow
def test_tp2_shards_on_the_cpu_kernels(written, tmp_path):
    """bfloat16: each rank's shards on the w4 / Q8 tiles (act-order's row-parallel shards on
    the fallback), against one process within bf16 and the kernels' x rounding."""
    torch.set_num_threads(1)
    folders = [written(f)[0] for f in TP_KERNEL_FORMATS]
    expected = [_tp_logits(f, None, "bfloat16") for f in folders]
    logits, paths0, paths1 = _tp2(folders, tmp_path, "bfloat16")
    for fmt, got, want in zip(TP_KERNEL_FORMATS, logits, expected, strict=True):
        assert (got - want).abs().max() <= 0.08 * want.abs().max(), fmt  # seen: 0.013-0.046
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8, fmt
    assert paths0 == paths1
    if cpu_w4.available():
        assert any("w4 tiles" in why for why in paths0[0]["qkv_proj"])
        assert any("w4 tiles" in why for why in paths0[0]["o_proj"])
