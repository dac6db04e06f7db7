"""engine.gguf.tensors: the tensor table read past the metadata, against gguf-py's
GGUFReader on files its writer made (string and number arrays, a custom alignment, block
and float types), and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter
from gguf.quants import quantize

from engine.gguf.tensors import Unsupported, read_tensors, tensor_table


def _write(path, alignment: int | None = None, endianess=GGUFEndian.LITTLE) -> None:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_string("general.name", "tiny ünïcode")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)] + ["é", ""])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(50)])
    w.add_array("some.nested", [[1, 2], [3]])
    w.add_bool("some.flag", True)
    w.add_uint64("some.big", 2**40)
    for name, qtype in [("a", "Q4_1"), ("b", "Q8_0"), ("c", "Q4_0")]:
        q = quantize(rng.standard_normal((6, 64)).astype(np.float32), GGMLQuantizationType[qtype])
        w.add_tensor(
            f"blk.0.{name}.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[qtype]
        )
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("f16.weight", rng.standard_normal((3, 5, 32)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_table_is_gguf_pys(tmp_path, alignment):
    path = tmp_path / "t.gguf"
    _write(path, alignment)
    ours = read_tensors(path)
    theirs = GGUFReader(str(path)).tensors
    assert sorted(ours) == sorted(t.name for t in theirs)
    for t in theirs:
        mine = ours[t.name]
        assert (mine.type_name, mine.type_id) == (t.tensor_type.name, int(t.tensor_type))
        assert mine.shape == tuple(int(d) for d in t.shape)
        rows = int(np.prod(mine.shape[1:]))
        assert mine.data.dtype == np.uint8 and mine.data.shape[0] == rows
        assert np.array_equal(mine.data.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    q = ours["blk.0.a.weight"]  # 6 rows of two Q4_1 blocks (20 bytes each)
    assert q.shape == (64, 6) and q.data.shape == (6, 40)


def test_what_it_refuses_and_tensor_tables_fallback(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(Unsupported, match="not a GGUF file"):
        read_tensors(bad)
    big = tmp_path / "big-endian.gguf"
    _write(big, endianess=GGUFEndian.BIG)
    with pytest.raises(Unsupported, match="version"):  # its version reads byte-swapped
        read_tensors(big)
    table = tensor_table(big)  # GGUFReader reads it instead, into the same form
    assert table["blk.0.b.weight"].type_name == "Q8_0"
    assert table["blk.0.b.weight"].data.shape == (6, 68)
