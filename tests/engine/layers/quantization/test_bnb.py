"""bitsandbytes checkpoints (engine.layers.quantization.bnb), written by transformers with the
bitsandbytes package itself (its CPU quantizers): 4-bit NF4 (with and without double-quantized
absmax; its codes stored as bfloat16, FSDP-QLoRA's), 4-bit FP4 and 8-bit LLM.int8; and
`--quantization bitsandbytes` on a float checkpoint.

The reference is HF transformers on the same tiny model with every quantized weight
bitsandbytes' own float32 dequantization of it. Checked: each loaded layer holds those values
(bit for bit on the LUT4 kernel) and multiplies by them; greedy tokens follow the reference
with no flag; blocksizes other than transformers' 64 (128: mapped onto the kernel's 64s; 32:
dequantized at load); the dequantized fallback; TP=2; the CUDA path (the FP4 Triton GEMM's LUT4
kind, under the interpreter without a GPU, and through the engine on one); NF4 at load against
bitsandbytes' quantize_4bit; start-up errors naming the field.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import lut4 as cpu_lut4
from engine.layers.quantization import bnb
from engine.layers.quantization.checkpoint import (
    apply_checkpoint_methods,
    build_config,
    finish_checkpoint_methods,
    resolve_checkpoint,
)
from engine.models.loader import load_model
from tests.engine.layers.quantization import quant_writers as qw
from tests.engine.layers.quantization.test_nvfp4 import (
    DEVICE,
    check_cuda_greedy,
    check_triton_layers,
)
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

pytest.importorskip("bitsandbytes")

KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FOUR_BIT = ("bnb-nf4", "bnb-nf4-dq", "bnb-fp4")
WRITERS = {fmt: functools.partial(qw.write_bnb, fmt=fmt) for fmt in qw.BNB_FORMATS}
WRITERS["bnb-nf4-dq-128"] = functools.partial(qw.write_bnb, fmt="bnb-nf4-dq", blocksize=128)
WRITERS["bnb-fp4-32"] = functools.partial(qw.write_bnb, fmt="bnb-fp4", blocksize=32)


@pytest.fixture(scope="module")
def written(tiny_llama_dir, tmp_path_factory):
    return qw.written_once(WRITERS, tiny_llama_dir, tmp_path_factory)


def loaded_weight(layer) -> torch.Tensor:
    """The float32 [N, K] a loaded layer multiplies by, read back from its kernel's form."""
    if getattr(layer, "lut4_levels", None) is not None:
        return cpu_lut4.dequantize(
            layer.weight, layer.lut4_scales, layer.lut4_levels, layer.in_features, torch.float32
        )
    if layer.weight.dtype == torch.int8:
        return layer.weight.float() * layer.weight_scale[:, None]
    return layer.weight.float()


def _layers(model):
    for name, layer in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in KINDS:
            yield name, layer, [name[: -len(kind)] + p for p in MERGED.get(kind, (kind,))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", list(WRITERS))
def test_each_layer_holds_the_packages_values(written, fmt, dtype):
    _, folder, deq = written(fmt)
    model, paths = _load(folder, dtype)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for name, layer, parts in _layers(model):
        want = torch.cat([deq[p] for p in parts])
        got = loaded_weight(layer)
        if fmt == "bnb-int8":  # SCB / 127 once per row against the package's q * SCB * (1/127)
            assert torch.allclose(got, want, rtol=1e-6, atol=0), name
        elif layer.lut4_levels is not None or dtype == "float32":
            assert torch.equal(got, want), name  # bit for bit
        else:  # dequantized into bf16: the package's values rounded once
            assert torch.equal(got, want.bfloat16().float()), name
        x = torch.randn(5, want.shape[1], generator=gen).to(getattr(torch, dtype))
        y = layer.quant_method.apply(layer, x)
        ref = F.linear(x.float(), want)
        assert y.dtype == x.dtype
        tol = 1e-5 if dtype == "float32" else 1e-2
        assert (y.float() - ref).norm() / ref.norm() < tol, name
        checked += 1
    assert checked == 4 * model.config.num_hidden_layers
    if fmt == "bnb-int8":
        assert all("LLM.int8 as int8 rows (int8 C GEMM)" in why for why in paths["qkv_proj"])
    elif cpu_lut4.available():
        lut = "LUT4 codes with float32 scales per 64"
        # blocks of 128 over K = 64 straddle rows (qkv, o, gate_up): those layers dequantized;
        # blocks of 32 are under the kernel's 64 everywhere
        straddle = fmt == "bnb-fp4-32" or (fmt == "bnb-nf4-dq-128")
        assert all((lut in why) != straddle for why in paths["qkv_proj"]), paths
        assert all((lut in why) != (fmt == "bnb-fp4-32") for why in paths["down_proj"]), paths


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_kernels_each_layer_is_dequantized_once(written, monkeypatch, dtype):
    monkeypatch.setattr(cpu_lut4, "available", lambda: False)
    _, folder, deq = written("bnb-nf4-dq")
    model, paths = _load(folder, dtype)
    for name, layer, parts in _layers(model):
        want = torch.cat([deq[p] for p in parts]).to(getattr(torch, dtype))
        assert layer.lut4_levels is None and torch.equal(layer.weight.data, want), name
    assert all(f"dequantized at load into {dtype}" in why for why in paths["o_proj"]), paths


def _greedy(folder, dtype: str, quantization: str | None = None) -> list[list[int]]:
    from engine import LLM, SamplingParams

    llm = LLM(str(folder), dtype=dtype, seed=0, num_kv_blocks=64, max_model_len=256,
              quantization=quantization)  # fmt: skip
    try:
        assert llm.engine.executor.runner.quantization == "bitsandbytes"
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [
        ("bnb-nf4", "float32"),
        ("bnb-nf4-dq", "bfloat16"),
        ("bnb-fp4", "float32"),
        ("bnb-int8", "float32"),
        ("bnb-int8", "bfloat16"),
        ("bnb-nf4-dq-128", "float32"),
        ("bnb-nf4-bf16-storage", "bfloat16"),
    ],
)
def test_greedy_tokens_follow_the_dequantized_reference(written, fmt, dtype):
    """No flag: the checkpoint's quantization_config picks bitsandbytes."""
    src, folder, deq = written(fmt)
    ref = qw.reference_model(src, deq)
    for prompt, got in zip(PROMPTS, _greedy(folder, dtype), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(got, theirs, gaps, GAP_TOL[dtype])


def test_a_mixture_of_experts_keeps_its_experts_float(tiny_qwen3_moe_dir, tmp_path):
    """transformers 5 quantizes nn.Linear layers only: a Qwen3-MoE checkpoint's attention (and
    the dense MLP of its mlp_only layer) is NF4, its stacked experts and routers stay float
    (and load so, on the float experts' path); greedy tokens follow."""
    folder, deq = qw.write_bnb(tiny_qwen3_moe_dir, tmp_path / "moe", "bnb-nf4")
    assert any(".self_attn." in n for n in deq) and any(".mlp.down_proj" in n for n in deq)
    assert not any(".experts" in n or n.endswith(".mlp.gate") for n in deq), sorted(deq)
    model, paths = _load(folder, "float32")
    assert set(paths["experts"]) == {"float (not quantized in the checkpoint)"}, paths
    if cpu_lut4.available():
        assert all("LUT4" in why for why in paths["qkv_proj"]), paths
    ref = qw.reference_model(tiny_qwen3_moe_dir, deq)
    for prompt, got in zip(PROMPTS, _greedy(folder, "float32"), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(got, theirs, gaps, GAP_TOL["float32"])


def test_qwen2_moe_shared_expert_and_its_gate_are_served(tiny_qwen2_moe_dir, tmp_path):
    """transformers 5 quantizes Qwen2-MoE's shared expert and its gate (nn.Linear layers): the
    shared expert runs as a dense MLP on the 4-bit paths, the [1, H] gate is decoded to float at
    load (exactly the package's values); greedy tokens follow."""
    folder, deq = qw.write_bnb(tiny_qwen2_moe_dir, tmp_path / "moe", "bnb-nf4")
    gate = "model.layers.0.mlp.shared_expert_gate"
    assert gate in deq and "model.layers.0.mlp.shared_expert.down_proj" in deq
    model, paths = _load(folder, "float32")
    assert set(paths["experts"]) == {"float (not quantized in the checkpoint)"}, paths
    loaded = dict(model.named_modules())[gate].weight
    assert loaded.dtype == torch.float32 and torch.equal(loaded, deq[gate])
    ref = qw.reference_model(tiny_qwen2_moe_dir, deq)
    for prompt, got in zip(PROMPTS, _greedy(folder, "float32"), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(got, theirs, gaps, GAP_TOL["float32"])


@pytest.mark.parametrize(("arch", "fmt"), [("qwen3_moe", "bnb-nf4-dq"), ("mixtral", "bnb-int8")])
def test_experts_quantized_one_by_one_serve_hf_tokens(request, tmp_path, arch, fmt):
    """transformers 4 held a MoE's experts as nn.Linear layers and bitsandbytes quantized each:
    every expert's gate_up and down become small layers on the dense paths (4-bit: gate_up's
    K = 64 on LUT4, down's K = 32 dequantized; LLM.int8: int8 rows), holding the package's
    values; greedy tokens follow."""
    src = request.getfixturevalue(f"tiny_{arch}_dir")
    folder, deq = qw.write_bnb_experts(src, tmp_path / arch, fmt)
    model, paths = _load(folder, "float32")
    (path,) = paths["experts"]
    assert path.startswith("bitsandbytes experts one by one"), paths
    if fmt == "bnb-int8":
        assert "int8 rows" in path, path
    elif cpu_lut4.available():
        assert "LUT4" in path and "dequantized at load" in path, path
    moe = next(m for n, m in model.named_modules() if n.endswith(".experts") and
               hasattr(m, "expert_layers"))  # fmt: skip
    prefix = next(n for n, m in model.named_modules() if m is moe)
    proj = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
    ckpt = prefix.replace(".mlp.", ".block_sparse_moe.") if arch == "mixtral" else prefix
    gate, up, down = proj[arch]
    for e in (0, moe.num_experts - 1):
        want13 = torch.cat([deq[f"{ckpt}.{e}.{gate}"], deq[f"{ckpt}.{e}.{up}"]])
        tol = dict(rtol=1e-6, atol=0) if fmt == "bnb-int8" else dict(rtol=0, atol=0)
        assert torch.allclose(loaded_weight(moe.expert_layers[e]), want13, **tol), e
        assert torch.allclose(loaded_weight(moe.expert_layers[moe.num_experts + e]),
                              deq[f"{ckpt}.{e}.{down}"], **tol), e  # fmt: skip
    ref = qw.reference_model(src, deq)
    for prompt, got in zip(PROMPTS, _greedy(folder, "float32"), strict=True):
        theirs, gaps = _hf_greedy(ref, prompt)
        _assert_greedy_agrees(got, theirs, gaps, GAP_TOL["float32"])


def test_qlora_adapters_on_the_nf4_base(written, tiny_llama_dir, tmp_path):
    """QLoRA's serving case: adapters trained on a bitsandbytes 4-bit base, served on it, mixed
    with the base in one batch (the adapters' deltas on the LUT4 layers' outputs, the decode
    plan included); greedy tokens follow HF + peft merged into the dequantized reference."""
    from peft import PeftModel

    from engine import LLM, SamplingParams
    from engine.lora import LoRARequest
    from tests.engine.lora.lora_testing import make_adapter

    src, folder, deq = written("bnb-nf4-dq")
    adapter = make_adapter(tiny_llama_dir, tmp_path / "qlora", r=8, alpha=16, seed=4)
    llm = LLM(str(folder), dtype="float32", seed=0, num_kv_blocks=64, max_model_len=256,
              enable_lora=True, max_loras=1)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        lora = LoRARequest("qlora", 1, str(adapter))
        outs = llm.generate([*PROMPTS, *PROMPTS], params, use_tqdm=False,
                            lora_request=[None] * len(PROMPTS) + [lora] * len(PROMPTS))  # fmt: skip
    finally:
        llm.shutdown()
    got = [list(o.outputs[0].token_ids) for o in outs]
    base, tuned = got[: len(PROMPTS)], got[len(PROMPTS) :]
    assert base != tuned  # the adapter changes the output: else this proves nothing
    merged = PeftModel.from_pretrained(qw.reference_model(src, deq), str(adapter))
    for refs, ours in ((qw.reference_model(src, deq), base), (merged.merge_and_unload(), tuned)):
        for prompt, toks in zip(PROMPTS, ours, strict=True):
            theirs, gaps = _hf_greedy(refs.eval(), prompt)
            _assert_greedy_agrees(toks, theirs, gaps, GAP_TOL["float32"])


def test_nf4_at_load_rounds_as_bitsandbytes_does(tiny_llama_dir):
    """`--quantization bitsandbytes` on a float checkpoint: NF4 codes and absmax per 64 equal
    bitsandbytes' quantize_4bit of the same weight (its thresholds are the levels' midpoints),
    and the model serves them."""
    from bitsandbytes import functional as bnbf

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=gen)
    codes, absmax = bnb.quantize_nf4(w)
    q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    theirs = bnb.decode_4bit(
        {"weight": q, "absmax": state.absmax,
         "quant_state": state.as_dict(packed=True)["quant_state.bitsandbytes__nf4"]}
    )  # fmt: skip
    assert torch.equal(codes, theirs[0])
    assert torch.equal(absmax.reshape(-1), theirs[1])
    assert torch.equal(torch.tensor(bnb.NF4_LEVELS), state.code.float())

    config = build_config(*resolve_checkpoint("bitsandbytes", None)[:1], None)
    assert config.describe().startswith("NF4 quantized at load")
    model = load_model(tiny_llama_dir, dtype="float32",
                       prepare=functools.partial(apply_checkpoint_methods, config=config))  # fmt: skip
    float_model = load_model(tiny_llama_dir, dtype="float32")
    paths = finish_checkpoint_methods(model, config)
    for kind in KINDS:
        assert all("NF4 quantized at load" in why for why in paths[kind]), paths
    floats = dict(float_model.named_modules())
    for name, layer, _ in _layers(model):
        c, a = bnb.quantize_nf4(floats[name].weight.data)
        want = torch.tensor(bnb.NF4_LEVELS)[c.long()].view(*a.shape, 64) * a.unsqueeze(-1)
        assert torch.equal(loaded_weight(layer), want.view_as(c).float()), name
    ours = _greedy(tiny_llama_dir, "float32", quantization="bitsandbytes")
    assert len(ours) == len(PROMPTS) and all(len(t) == 8 for t in ours)


@pytest.mark.slow
def test_tp2_shards_give_the_logits_of_one_process(written, tmp_path):
    """Column shards split N (each merged shard's rows), row shards split K: o_proj's 32 inputs
    a rank are off the kernel's 64s (dequantized on each rank), down_proj's 64 on the kernel."""
    torch.set_num_threads(1)
    for fmt in ("bnb-nf4-dq", "bnb-int8"):
        folder = written(fmt)[1]
        want = _tp_logits(folder)
        (got,), paths0, paths1 = _tp2([folder], tmp_path, "float32")
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), fmt
        assert paths0 == paths1
        if fmt == "bnb-nf4-dq" and cpu_lut4.available():
            assert all("dequantized at load" in why for why in paths0[0]["o_proj"]), paths0
            assert all("LUT4" in why for why in paths0[0]["down_proj"]), paths0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["bnb-nf4-dq", "bnb-fp4"])
def test_the_triton_gemm_serves_the_loaded_layers(written, fmt, dtype):
    """The CUDA path (the FP4 Triton GEMM's LUT4 kind; under the interpreter without a GPU):
    each layer holds the codes and absmax, no float copy, and multiplies by the package's
    values rounded to the model dtype."""
    _, folder, deq = written(fmt)
    check_triton_layers(folder, deq, dtype, bnb.Bnb4bitLinearMethod, "lut4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_layers_take_the_triton_w8a16_gemm(written, dtype):
    """LLM.int8 on the CUDA path: the integer formats' Triton W8A16 GEMM (under the
    interpreter without a GPU), codes q + 128 with SCB / 127 per row."""
    pytest.importorskip("triton")
    from engine.layers.quantization.int_weight import TritonIntLinearMethod

    _, folder, deq = written("bnb-int8")
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = build_config("bitsandbytes", qcfg)
    model = load_model(folder, dtype=dtype, device=DEVICE,
                       prepare=functools.partial(apply_checkpoint_methods, config=config))  # fmt: skip
    for m in model.modules():
        if isinstance(getattr(m, "quant_method", None), bnb.BnbInt8LinearMethod):
            m.quant_method.triton = True
    paths = finish_checkpoint_methods(model, config)
    assert all("Triton W8A16 GEMM" in why for why in paths["down_proj"]), paths
    torch_dtype = getattr(torch, dtype)
    for name, layer, parts in _layers(model):
        assert isinstance(layer.quant_method, TritonIntLinearMethod) and layer.weight is None
        want_w = torch.cat([deq[p] for p in parts])
        x = torch.randn(3, want_w.shape[1], generator=torch.Generator().manual_seed(0))
        got = layer.quant_method.apply(layer, x.to(torch_dtype).to(DEVICE)).float().cpu()
        want = F.linear(x.to(torch_dtype).float(), want_w.to(torch_dtype).float())
        tol = 1e-5 if dtype == "float32" else 1.5e-2
        assert (got - want).abs().max() <= tol * want.abs().max(), name


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bnb-nf4-dq", "bnb-fp4"])
def test_cuda_greedy_tokens_follow_the_dequantized_reference(written, fmt):
    check_cuda_greedy(*written(fmt))


@pytest.mark.slow
def test_tp2_shards_experts_quantized_one_by_one(tiny_qwen3_moe_dir, tmp_path):
    """Each rank decodes its slice of every expert's I (gate / up rows, down columns: 16 of
    32, off the kernel's 64s, so dequantized) and gives the logits of one process."""
    torch.set_num_threads(1)
    folder, _ = qw.write_bnb_experts(tiny_qwen3_moe_dir, tmp_path / "moe", "bnb-nf4-dq")
    want = _tp_logits(folder)
    (got,), paths0, paths1 = _tp2([folder], tmp_path, "float32")
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert paths0 == paths1
    assert all(why.startswith("bitsandbytes experts one by one") for why in paths0[0]["experts"])


# -- start-up refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qcfg", "field"),
    [
        ({"load_in_4bit": True, "load_in_8bit": True}, "load_in_4bit / load_in_8bit"),
        ({"load_in_4bit": False}, "load_in_4bit / load_in_8bit"),
        ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type = 'int4'"),
        ({"load_in_4bit": True, "bnb_4bit_quant_storage": "int32"},
         "bnb_4bit_quant_storage = 'int32'.*supported: uint8, bfloat16"),
        ({"load_in_8bit": True, "llm_int8_has_fp16_weight": True}, "llm_int8_has_fp16_weight"),
    ],
)  # fmt: skip
def test_unsupported_configs_name_the_field(qcfg, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        build_config("bitsandbytes", {"quant_method": "bitsandbytes", **qcfg})


def test_a_missing_statistic_fails_naming_the_layer(written, tmp_path):
    """A double-quantized layer without its nested absmax: the error names the layer and the
    tensor (nothing is guessed)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = written("bnb-nf4-dq")[1]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    state = load_file(str(broken / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight.nested_absmax"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.qkv_proj \(shard 'k'\): the "
                       "checkpoint has no nested_absmax"):  # fmt: skip
        _load(broken, "float32")
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "bitsandbytes" and cfg["bnb_4bit_use_double_quant"]


def test_vllms_load_format_bitsandbytes_means_this_format():
    """vLLM's `--load-format bitsandbytes` (its older docs pair it with --quantization
    bitsandbytes): safetensors, read as bitsandbytes; with another method, an error naming both."""
    from engine.config import ModelConfig

    cfg = ModelConfig(model="m", load_format="bitsandbytes")
    assert (cfg.load_format, cfg.quantization) == ("safetensors", "bitsandbytes")
    cfg = ModelConfig(model="m", load_format="bitsandbytes", quantization="bitsandbytes")
    assert (cfg.load_format, cfg.quantization) == ("safetensors", "bitsandbytes")
    with pytest.raises(ValueError, match="load_format bitsandbytes .* got 'gptq'"):
        ModelConfig(model="m", load_format="bitsandbytes", quantization="gptq")


def test_llm_int8_skip_modules_keeps_whole_layers_float():
    """A skipped module stays float; a merged layer whose parts the list splits is an error
    naming the field (they run as one layer)."""
    cfg = build_config("bitsandbytes", {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                        "llm_int8_skip_modules": ["self_attn", "up_proj"]})  # fmt: skip
    attn = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert cfg.linear_method("model.layers.0.self_attn.qkv_proj", attn) is None
    down = ["model.layers.0.mlp.down_proj"]
    assert isinstance(cfg.linear_method(down[0], down), bnb.Bnb4bitLinearMethod)
    gate_up = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    with pytest.raises(ValueError, match="llm_int8_skip_modules keeps some of"):
        cfg.linear_method("model.layers.0.mlp.gate_up_proj", gate_up)
