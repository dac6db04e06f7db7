"""`tessera bench quant`: the GPTQ / AWQ checkpoints it builds (once, cached) from a model's
weights, and a whole run on a tiny Llama whose linear layers the w4 tiles take (K a multiple
of 64)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import bench_quant


@pytest.fixture(scope="module")
def tiny_w4_dir(make_tiny_model):
    return make_tiny_model(
        "tiny-llama-w4", hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, seed=11,
    )  # fmt: skip


def test_checkpoints_are_built_once_in_the_formats_layouts(tiny_w4_dir, tmp_path):
    from engine.layers.quantization.packed import unpack_cols, unpack_rows

    formats = ["gptq", "awq", "gptq3"]
    folders = bench_quant.build_checkpoints("tiny", tiny_w4_dir, tmp_path, formats)
    assert set(folders) == set(formats)
    float_state = load_file(str(tiny_w4_dir / "model.safetensors"))
    for fmt, folder in folders.items():
        cfg = json.loads((folder / "config.json").read_text())
        qcfg = cfg["quantization_config"]
        assert qcfg["quant_method"] == fmt.rstrip("3") and qcfg["group_size"] == 32
        assert qcfg["bits"] == bench_quant.BITS[fmt]
        assert (folder / "tokenizer.json").is_file()
        state = load_file(str(folder / "model.safetensors"))
        # float16 besides the quantized layers: embedding, norms, the untied head
        assert state["model.embed_tokens.weight"].dtype == torch.float16
        assert state["lm_head.weight"].dtype == torch.float16
        assert not any(k.endswith("_proj.weight") for k in state)
        # the codes stand for the float weight, round-to-nearest in groups of 32
        name = "model.layers.0.mlp.down_proj"
        w = float_state[f"{name}.weight"].float()  # [N, K]
        s = state[f"{name}.scales"].float()  # [G, N]
        if fmt.startswith("gptq"):
            bits = bench_quant.BITS[fmt]
            assert not qcfg["sym"] and qcfg["checkpoint_format"] == "gptq"
            q = unpack_rows(state[f"{name}.qweight"], bits).float()  # [K, N]
            z = unpack_cols(state[f"{name}.qzeros"], bits).float() + 1  # v1: zero - 1
        else:
            order = [0, 2, 4, 6, 1, 3, 5, 7]
            q = unpack_cols(state[f"{name}.qweight"], 4, order).float()
            z = unpack_cols(state[f"{name}.qzeros"], 4, order).float()
        g = torch.arange(w.shape[1]) // 32
        deq = ((q - z[g]) * s[g]).t()
        step = s[g].t()
        assert ((deq - w).abs() <= step * 0.5 + 1e-3).all()
        total, quantized = bench_quant.checkpoint_bytes(folder)
        assert 0 < quantized < total
    # cached: a second call writes nothing
    stamp = {f: (p / "model.safetensors").stat().st_mtime_ns for f, p in folders.items()}
    again = bench_quant.build_checkpoints("tiny", tiny_w4_dir, tmp_path, formats)
    assert again == folders
    assert stamp == {f: (p / "model.safetensors").stat().st_mtime_ns for f, p in again.items()}
    assert [p.name for p in tmp_path.iterdir()] == [folders["gptq"].parent.name]  # no leftovers


def test_the_bnb_checkpoint_is_bitsandbytes_own_nf4(tiny_w4_dir, tmp_path):
    """bnb-nf4: transformers + bitsandbytes' NF4 with double-quantized absmax, as they save it;
    its codes and statistics counted as the quantized bytes."""
    pytest.importorskip("bitsandbytes")
    folder = bench_quant.build_checkpoints("tiny", tiny_w4_dir, tmp_path, ["bnb-nf4"])["bnb-nf4"]
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "bitsandbytes" and qcfg["bnb_4bit_quant_type"] == "nf4"
    assert qcfg["bnb_4bit_use_double_quant"] and (folder / "tokenizer.json").is_file()
    state = load_file(str(folder / "model.safetensors"))
    floats = load_file(str(tiny_w4_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"  # two 4-bit codes a byte
    assert state[name].dtype == torch.uint8 and state[name].numel() == floats[name].numel() // 2
    assert state[f"{name}.absmax"].dtype == torch.uint8  # double quantization
    total, quantized = bench_quant.checkpoint_bytes(folder)
    linear_weights = sum(t.numel() for k, t in floats.items() if k.endswith("_proj.weight"))
    # half a byte a weight, a byte of absmax per 64, and each layer's fixed tables (quant_map,
    # nested_quant_map: 1 KiB a layer, the bulk of the rest at this tiny size)
    assert linear_weights / 2 + linear_weights / 64 < quantized < linear_weights / 2 * 1.2
    assert quantized < total


def test_fp8_checkpoints_hold_e4m3_codes_and_their_scales(tiny_w4_dir, tmp_path):
    """fp8: AutoFP8's layout (a scale a tensor); fp8-block: Qwen3-FP8's (a scale per block of
    128 x 128, weight_scale_inv); a byte a weight counted as the quantized bytes."""
    folders = bench_quant.build_checkpoints("tiny", tiny_w4_dir, tmp_path, ["fp8", "fp8-block"])
    floats = load_file(str(tiny_w4_dir / "model.safetensors"))
    linear_weights = sum(t.numel() for k, t in floats.items() if k.endswith("_proj.weight"))
    name = "model.layers.0.mlp.down_proj"  # [128, 256]: blocks of 128 x 128 -> 1 x 2 scales
    for fmt, scale, shape in (
        ("fp8", "weight_scale", ()),
        ("fp8-block", "weight_scale_inv", (1, 2)),
    ):
        qcfg = json.loads((folders[fmt] / "config.json").read_text())["quantization_config"]
        assert qcfg["quant_method"] == "fp8"
        assert qcfg.get("weight_block_size") == (None if fmt == "fp8" else [128, 128])
        state = load_file(str(folders[fmt] / "model.safetensors"))
        assert state[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert tuple(state[f"{name}.{scale}"].shape) == shape
        if fmt == "fp8":  # the codes stand for the float weight (e4m3 keeps 3 bits of mantissa)
            w = floats[f"{name}.weight"].float()
            deq = state[f"{name}.weight"].float() * state[f"{name}.{scale}"].float()
            assert ((deq - w).abs() <= w.abs() / 16 + 1e-3).all()
        total, quantized = bench_quant.checkpoint_bytes(folders[fmt])
        assert linear_weights <= quantized < linear_weights * 1.01 < total


def test_the_random_llama_has_the_shape_asked_and_is_built_once(tmp_path):
    folder = bench_quant.write_random_llama(tmp_path / "r", 128, 96, 2)
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (128, 96, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 1, 64)
    assert (folder / "tokenizer.json").is_file()
    state = load_file(str(folder / "model.safetensors"))
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (64, 128)
    assert state["model.layers.1.mlp.down_proj.weight"].shape == (128, 96)
    assert state["model.embed_tokens.weight"].shape == (cfg["vocab_size"], 128)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert bench_quant.write_random_llama(folder, 128, 96, 2) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["r"]  # no leftovers
    with pytest.raises(ValueError, match="HIDDEN a multiple of 64"):
        bench_quant.write_random_llama(tmp_path / "bad", 100, 96, 2)


def test_float_state_reads_a_converted_gguf_folders_linked_blocks(tiny_llama_dir, tmp_path):
    from gguf import GGUFReader

    from engine.gguf.convert import LINK, _write_weights
    from tests.engine.gguf.gguf_files import HEADS, KV_HEADS, write_gguf

    gguf = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama_dir, gguf, "Q4_1")
    linked, full = tmp_path / "linked", tmp_path / "full"
    heads = {"model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    for folder in (linked, full):
        folder.mkdir()
        shutil.copy(tiny_llama_dir / "config.json", folder)
    _write_weights(GGUFReader(str(gguf)), heads, full)
    _write_weights(GGUFReader(str(gguf)), heads, linked, every=False)
    (linked / LINK).write_text(json.dumps({"path": str(gguf), "size": gguf.stat().st_size}))
    a, b = bench_quant.float_state(linked), load_file(str(full / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name, t in b.items():
        assert torch.equal(a[name], t), name


@pytest.mark.parametrize("argv, message", [(["--context", "9", "8"], "--context"),
                                           (["--batch-sizes", "0"], "--batch-sizes")])  # fmt: skip
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_quant.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_on_a_tiny_model(tiny_w4_dir, tmp_path):
    out = tmp_path / "quant.json"
    result = bench_quant.main(
        ["--model", str(tiny_w4_dir), "--cache-dir", str(tmp_path / "cache"),
         "--batch-sizes", "1", "4", "--context", "8", "24", "--steps", "2", "--warmup", "1",
         "--threads", "1", "--json", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text())["paths"].keys() == {"reference", "gptq", "awq"}
    for path, res in result["paths"].items():
        assert "error" not in res, res
        assert res["quantization"] == (None if path == "reference" else path)
        assert [r["batch_size"] for r in res["rows"]] == [1, 4]
        for r in res["rows"]:
            assert 0 < r["best_ms"] <= r["median_ms"]
            assert r["time_vs_reference"] > 0 and r["best_vs_reference"] > 0
            if path != "reference":
                assert 0 <= r["same_tokens"] <= r["batch_size"]
    assert result["memory"].keys() == {"reference", "gptq", "awq"}
    for path, r in result["memory"].items():
        assert "error" not in r, r
        assert r["rss_mib"] > 0 and r["file_mib"] > 0 and r["tokens"] == 4
        assert r["weights_mib"] >= r["linear_mib"] > 0
        if path != "reference":
            assert 0 < r["quantized_mib"] < r["file_mib"]
            assert r["linear_mib"] > 0
