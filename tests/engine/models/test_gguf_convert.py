"""engine.models.gguf_convert's weights: written in shards, one at a time, and read back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from safetensors.torch import load_file

from engine.models.gguf_convert import _write_weights
from engine.models.loader import load_model
from tests.engine.models.gguf_files import HEADS, KV_HEADS, write_gguf

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
        from engine.models.gguf_convert import _write_weights
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
