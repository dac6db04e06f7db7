"""engine.gguf.convert: the weights written in shards, one at a time, and read back;
Llama 3's rope scaling recovered from the rope_freqs tensor llama.cpp writes."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from safetensors.torch import load_file

from engine.gguf.convert import (
    LINK,
    _llama3_scaling,
    _read_config,
    _write_weights,
    left_in_file,
)
from engine.layers.rotary import RotaryEmbedding
from engine.models.hf_config import parse_hf_config
from engine.models.loader import load_hf_config, load_model
from tests.engine.gguf.gguf_files import HEADS, KV_HEADS, write_gguf

_HEADS = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}


def _state(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def test_shards_hold_what_one_file_holds_and_load(tiny_llama_dir, tmp_path):
    gguf = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama_dir, gguf, "Q8_0")
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    for folder in (one, sharded):
        folder.mkdir()
        shutil.copy(tiny_llama_dir / "config.json", folder)
    _write_weights(GGUFReader(str(gguf)), _HEADS, one)
    shard_bytes = 64 * 1024
    _write_weights(GGUFReader(str(gguf)), _HEADS, sharded, shard_bytes)

    assert [f.name for f in one.glob("*.safetensors")] == ["model.safetensors"]
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) >= 3 and not (sharded / "model.safetensors").exists()
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    a, b = _state(one), _state(sharded)
    assert sorted(index) == sorted(a) == sorted(b)
    for name, t in a.items():
        assert torch.equal(t, b[name]), name
    for file in files:  # each shard within the limit, or one tensor larger than it alone
        held = [n for n, f in index.items() if f == file.name]
        assert sum(b[n].numel() * 4 for n in held) <= shard_bytes or len(held) == 1
        assert set(load_file(str(file))) == set(held)

    m1, m2 = load_model(one, dtype="float32"), load_model(sharded, dtype="float32")
    for (n, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(p, q), n


def test_a_converted_folder_reads_its_linear_weights_from_the_file(tiny_llama_dir, tmp_path):
    """The conversion leaves all but the float32 tensors in the GGUF (linked, not copied): a
    float load dequantizes them from there (the C dequantizer for the blocks, gguf-py's for
    float16), to the values a full conversion writes; a link to a file that is gone or
    changed is refused by name."""
    gguf = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama_dir, gguf, "Q4_1", overrides={(1, "ffn_up"): "F16"})
    full, linked = tmp_path / "full", tmp_path / "linked"
    for folder in (full, linked):
        folder.mkdir()
        shutil.copy(tiny_llama_dir / "config.json", folder)
    _write_weights(GGUFReader(str(gguf)), _HEADS, full)
    _write_weights(GGUFReader(str(gguf)), _HEADS, linked, every=False)
    (linked / LINK).write_text(json.dumps({"path": str(gguf), "size": gguf.stat().st_size}))

    kept = set(_state(linked))
    left = {t.name for t in GGUFReader(str(gguf)).tensors if left_in_file(t)}
    assert len(left) == 3 * 7  # every linear weight, the F16 one too (the embedding is F32)
    assert "model.embed_tokens.weight" in kept and "lm_head.weight" in kept  # float32 here
    assert not any(n.endswith("_proj.weight") for n in kept)
    a, b = load_model(full, dtype="float32"), load_model(linked, dtype="float32")
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), n

    moved = tmp_path / "moved.gguf"
    gguf.rename(moved)
    with pytest.raises(ValueError, match="tiny.gguf, which is gone or changed"):
        load_model(linked, dtype="float32")


def _q8_blocks(rows: int, cols: int, rng) -> np.ndarray:
    """Q8_0 rows: per 32 values a float16 scale and 32 int8 (drawn directly: no quantizer)."""
    blocks = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    blocks[..., :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    blocks[..., 2:] = rng.integers(0, 256, (rows, cols // 32, 32), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def test_the_conversion_holds_one_shard_not_the_float_model(tmp_path):
    """40 Q8_0 tensors, 320 MiB in float32, written in 16 MiB shards: the process grows by
    about the file's pages (85 MiB) and a shard, never by the float model."""
    rng = np.random.default_rng(0)
    gguf = tmp_path / "big.gguf"
    w = GGUFWriter(str(gguf), "llama")
    rows, cols, layers = 2048, 1024, 20
    for i in range(layers):
        for part in ("ffn_up", "ffn_down"):
            q = _q8_blocks(rows, cols, rng)
            w.add_tensor(
                f"blk.{i}.{part}.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    float_mib = 2 * layers * rows * cols * 4 / 2**20
    script = textwrap.dedent(f"""
        import resource, sys
        from pathlib import Path
        from gguf import GGUFReader
        from engine.gguf.convert import _write_weights
        reader = GGUFReader({str(gguf)!r})
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        _write_weights(reader, {{}}, Path({str(tmp_path)!r}), 16 << 20)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) / 1024)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    grew_mib = float(out.stdout.split()[-1])
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 20  # two tensors a shard
    assert grew_mib < 0.5 * float_mib, (grew_mib, float_mib)


def _llama_cpp_rope_freqs(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs.weight for a Llama 3.1+ checkpoint (its
    formula, float32): per frequency the divisor of its inverse frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _llama3(factor, low, high, original) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


@pytest.mark.parametrize(
    ("theta", "head_dim", "scaling"),
    [
        (500000.0, 128, _llama3(8.0, 1.0, 4.0, 8192)),  # Llama 3.1
        (500000.0, 64, _llama3(32.0, 1.0, 4.0, 8192)),  # Llama 3.2 1B
        (500000.0, 16, _llama3(8.0, 1.0, 4.0, 32)),  # tests/conftest.py's: no blended one
        (500000.0, 16, _llama3(8.0, 1.0, 4.0, 64)),  # one blended
        (10000.0, 128, _llama3(4.0, 2.0, 6.0, 4096)),
    ],
)
def test_rope_freqs_become_the_llama3_scaling_that_rotates_alike(theta, head_dim, scaling):
    factors = _llama_cpp_rope_freqs(theta, head_dim, scaling)
    assert (factors > 1).any() and (factors < 1 + 1e-6).any()  # the case exercises all three
    solved = _llama3_scaling(factors, theta, head_dim)
    assert solved["rope_type"] == "llama3" and solved["factor"] == pytest.approx(scaling["factor"])
    want = RotaryEmbedding(head_dim, 4096, theta, scaling)
    got = RotaryEmbedding(head_dim, 4096, theta, solved)
    torch.testing.assert_close(got.cos_cache, want.cos_cache, rtol=0, atol=1e-4)
    torch.testing.assert_close(got.sin_cache, want.sin_cache, rtol=0, atol=1e-4)
    plain = RotaryEmbedding(head_dim, 4096, theta)
    assert (plain.cos_cache - want.cos_cache).abs().max() > 0.1  # scaling matters at these


def test_rope_freqs_of_another_form_are_refused():
    factors = _llama_cpp_rope_freqs(500000.0, 128, _llama3(8.0, 1.0, 4.0, 8192))
    uniform = _llama3_scaling(np.full_like(factors, 2.0), 500000.0, 128)  # linear scaling
    want = RotaryEmbedding(128, 64, 500000.0).cos_cache[32]  # position 32 is 64 / 2
    torch.testing.assert_close(RotaryEmbedding(128, 65, 500000.0, uniform).cos_cache[64], want)
    with pytest.raises(ValueError, match="not Llama 3's blend"):
        _llama3_scaling(np.where(np.arange(64) % 2, 1.0, 8.0), 500000.0, 128)  # not monotonic
    assert _llama3_scaling(np.ones_like(factors), 500000.0, 128) is None  # plain rope
    bent = factors.copy()
    blended = np.flatnonzero((factors > 1) & (factors < 8))
    bent[blended[len(blended) // 2]] *= 1.1
    with pytest.raises(ValueError, match="not Llama 3's blend"):
        _llama3_scaling(bent, 500000.0, 128)


def _header_only_gguf(
    path, rope_freqs=None, scaling_type=None, arch="llama", key_length=None
) -> GGUFReader:
    """The metadata _read_config reads, a Llama 3-shaped head, rope_freqs and the heads' width
    (key_length, as llama.cpp writes it for Qwen3) if given."""
    w = GGUFWriter(str(path), arch)
    if key_length is not None:
        w.add_key_length(key_length)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(500000.0)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    if scaling_type is not None:
        w.add_string(f"{arch}.rope.scaling.type", scaling_type)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFReader(str(path))


def test_a_llama3_gguf_gets_its_rope_scaling_in_config(tmp_path):
    scaling = _llama3(32.0, 1.0, 4.0, 8192)
    factors = _llama_cpp_rope_freqs(500000.0, 128, scaling)
    cfg = _read_config(_header_only_gguf(tmp_path / "l3.gguf", rope_freqs=factors))
    assert cfg["head_dim"] == 128 and cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["rope_scaling"]["factor"] == pytest.approx(32.0)
    assert _read_config(_header_only_gguf(tmp_path / "plain.gguf"))["rope_scaling"] is None
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        _read_config(_header_only_gguf(tmp_path / "yarn.gguf", scaling_type="yarn"))


def test_a_qwen2_gguf_is_a_qwen2_config(tmp_path):
    cfg = _read_config(_header_only_gguf(tmp_path / "q.gguf", arch="qwen2"))
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = load_hf_config(tmp_path)
    assert hf.attention_bias and not hf.o_proj_bias and hf.sliding_window is None
    assert (hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads) == (256, 2, 1)
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not supported"):
        _read_config(_header_only_gguf(tmp_path / "y.gguf", scaling_type="yarn", arch="qwen2"))
    with pytest.raises(ValueError, match="architecture 'gemma' is not supported"):
        _read_config(_header_only_gguf(tmp_path / "g.gguf", arch="gemma"))


def test_a_qwen3_gguf_is_a_qwen3_config_with_its_head_width(tmp_path):
    cfg = _read_config(_header_only_gguf(tmp_path / "q3.gguf", arch="qwen3", key_length=256))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = load_hf_config(tmp_path)
    assert hf.qk_norm and not hf.attention_bias and not hf.o_proj_bias
    assert hf.head_dim == 256 and hf.hidden_size // hf.num_attention_heads == 128
    assert not parse_hf_config(cfg | {"model_type": "qwen2"}).qk_norm
