"""KV-cache scales from FP8-KV checkpoints (engine.layers.quantization.kv_scales).

A tiny random Llama written as compressed-tensors FP8 (by the package) or the fp8 format,
with per-layer K/V scales under each name people's checkpoints use. Checked: every layer's
attention gets its file's scales; with the model dtype's cache (what the CPU serves) the
tokens are those of the same checkpoint without scales, and the start-up log says they are
unused; a kv_cache_scheme the fp8 cache cannot serve, or a scale per head, fails at start-up
naming the field. On a GPU the fp8 cache stores K / k_scale (the Triton kernels against the
torch reference with scales: tests/engine/kernels/test_triton_attention.py) and the engine
serves the checkpoint with it.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.quantization.checkpoint import build_config
from tests.engine.layers.quantization import quant_writers as qw
from tests.engine.test_llm_exactness import assert_agrees_but_near_ties

pytest.importorskip("compressed_tensors")

FP8_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
              "symmetric": True}  # fmt: skip
PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [100, 4, 4, 61]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
HAS_CUDA = torch.cuda.is_available()


def _scales(layer: int) -> tuple[float, float]:
    return 0.5 + 0.25 * layer, 0.125 * (layer + 1)  # distinct per layer and per K / V


def _with_kv_scales(folder, naming: str, kv_scheme: dict | None):
    """Add per-layer K/V scales to a written checkpoint, under one of the names in use."""
    state = load_file(str(folder / "model.safetensors"))
    layers = {int(n.split(".")[2]) for n in state if n.startswith("model.layers.")}
    for i in layers:
        attn = f"model.layers.{i}.self_attn"
        k, v = _scales(i)
        if naming == "kv_scale":  # AutoFP8: one scale for both
            state[f"{attn}.kv_scale"] = torch.tensor(k)
            continue
        names = {
            "k_scale": (f"{attn}.k_scale", f"{attn}.v_scale"),
            "output_scale": (f"{attn}.k_proj.output_scale", f"{attn}.v_proj.output_scale"),
        }[naming]
        state[names[0]], state[names[1]] = torch.tensor([k]), torch.tensor([v])
        state[f"{attn}.q_scale"] = torch.tensor([1.5])  # read, unused
    save_file(state, str(folder / "model.safetensors"))
    if kv_scheme is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"]["kv_cache_scheme"] = kv_scheme
        (folder / "config.json").write_text(json.dumps(cfg))
    return sorted(layers)


def _ct_fp8(tiny_llama_dir, dst):
    weights = dict(num_bits=8, type="float", strategy="channel", symmetric=True)
    acts = dict(num_bits=8, type="float", strategy="token", dynamic=True)
    return qw.write_compressed_tensors(tiny_llama_dir, dst, "float-quantized", weights, acts)[0]


def _greedy(folder, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), dtype="float32", seed=0, num_kv_blocks=64, max_model_len=128,
              **kwargs)  # fmt: skip
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        attns = llm.engine.executor.runner.model.attention_layers()
        scales = [(a.k_scale, a.v_scale, a.checkpoint_kv_scales) for a in attns]
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], scales


@pytest.mark.parametrize(
    "fmt,naming",
    [("ct", "k_scale"), ("ct", "output_scale"), ("fp8", "kv_scale")],
)
def test_every_layer_gets_its_scales_and_a_float_cache_keeps_its_tokens(
    tiny_llama_dir, tmp_path, caplog, fmt, naming
):
    if fmt == "ct":
        plain = _ct_fp8(tiny_llama_dir, tmp_path / "plain")
        scaled = _ct_fp8(tiny_llama_dir, tmp_path / "scaled")
    else:
        plain = qw.write_fp8(tiny_llama_dir, tmp_path / "plain")[0]
        scaled = qw.write_fp8(tiny_llama_dir, tmp_path / "scaled")[0]
    layers = _with_kv_scales(scaled, naming, FP8_SCHEME if fmt == "ct" else None)
    want, plain_scales = _greedy(plain)
    assert all(s == (1.0, 1.0, False) for s in plain_scales)
    with caplog.at_level(logging.INFO, logger="tessera.engine"):
        got, scales = _greedy(scaled)
    for i, (k, v, flagged) in zip(layers, scales, strict=True):
        ek, ev = _scales(i)
        assert flagged and k == ek and v == (ek if naming == "kv_scale" else ev)
    assert got == want  # the model dtype's cache: K/V exact, the scales unused
    assert f"KV-cache scales ({len(layers)} layers) are unused: the auto cache" in caplog.text


@pytest.mark.parametrize(
    "scheme,field",
    [
        ({**FP8_SCHEME, "type": "int"}, "kv_cache_scheme.type = 'int'"),
        ({**FP8_SCHEME, "dynamic": True}, "kv_cache_scheme.dynamic = True"),
        ({**FP8_SCHEME, "strategy": "channel"}, "kv_cache_scheme.strategy = 'channel'"),
        ({**FP8_SCHEME, "num_bits": 4}, "kv_cache_scheme.num_bits = 4"),
        ({**FP8_SCHEME, "symmetric": False}, "kv_cache_scheme.symmetric = False"),
    ],
)
def test_a_kv_cache_scheme_the_fp8_cache_cannot_serve_is_named(scheme, field):
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
             "strategy": "channel", "symmetric": True}}  # fmt: skip
    qcfg = {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"g": group}, "kv_cache_scheme": scheme}  # fmt: skip
    build_config("compressed-tensors", {**qcfg, "kv_cache_scheme": FP8_SCHEME})  # served
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        build_config("compressed-tensors", qcfg)


def test_a_scale_per_head_is_refused_at_start_up(tiny_llama_dir, tmp_path):
    folder = _ct_fp8(tiny_llama_dir, tmp_path / "q")
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.0.self_attn.k_scale"] = torch.ones(2)
    state["model.layers.0.self_attn.v_scale"] = torch.ones(1)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"k_scale: a KV-cache scale of shape \(2,\)"):
        LLM(str(folder), dtype="float32", num_kv_blocks=64, max_model_len=128)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (the fp8 cache is Triton's)")
def test_the_fp8_cache_serves_with_the_checkpoints_scales_cuda(tiny_llama_dir, tmp_path, caplog):
    """On a GPU: the fp8 cache with the file's scales serves the checkpoint, its greedy tokens
    HF's on the dequantized weights wherever HF's top-2 gap is clear (e4m3 K/V round by
    2^-4), and the log says the scales are in use."""
    folder, deq = qw.write_compressed_tensors(
        tiny_llama_dir, tmp_path / "q", "float-quantized",
        dict(num_bits=8, type="float", strategy="channel", symmetric=True),
        dict(num_bits=8, type="float", strategy="token", dynamic=True),
    )  # fmt: skip
    _with_kv_scales(folder, "k_scale", FP8_SCHEME)
    ref = qw.reference_model(tiny_llama_dir, deq)
    reference = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids, gaps = list(prompt), []
            for _ in range(PARAMS.max_tokens):
                top = ref(input_ids=torch.tensor([ids])).logits[0, -1].topk(2)
                gaps.append(float(top.values[0] - top.values[1]))
                ids.append(int(top.indices[0]))
            reference.append((ids[len(prompt) :], gaps))
    with caplog.at_level(logging.INFO, logger="tessera.engine"):
        got, scales = _greedy(folder, device="cuda", kv_cache_dtype="fp8")
    assert "fp8 KV cache with the checkpoint's K/V scales (3 of 3 layers" in caplog.text
    assert [s[:2] for s in scales] == [_scales(i) for i in range(3)]
    assert_agrees_but_near_ties(got, reference, 0.1)
