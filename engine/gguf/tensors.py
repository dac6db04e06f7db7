"""A GGUF file's tensor table, read without its metadata values.

gguf-py's GGUFReader builds a numpy view for every metadata item, the tokenizer's ~100,000
strings included: on the bundled SmolLM2 file that took 5.5 s and 160 MiB at every start
(the blocks themselves are 63 MiB). Loading a model's blocks needs only the tensor table:
this reads the header, steps over the metadata (the lengths of its strings and arrays, and
`general.alignment`), and views each tensor's bytes in one read-only mapping of the file
(nothing is copied until used). Little-endian GGUF version 2 or 3 (what llama.cpp writes
since 2023); anything else raises Unsupported, and tensor_table uses GGUFReader for it.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

MAGIC = b"GGUF"
# the fixed-size metadata value types (GGUFValueType) and their byte sizes; 8 is a string,
# 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class Unsupported(ValueError):
    """A file this reader does not take (another version, big-endian): use GGUFReader."""


@dataclass(frozen=True)
class Tensor:
    name: str
    type_name: str  # ggml's: "Q4_1"
    type_id: int
    shape: tuple[int, ...]  # as the file stores it: the innermost (in_features) first
    data: np.ndarray  # uint8 [rows, bytes per row], mapped from the file


class _Cursor:
    """Reads the header of the file's mapping in place (nothing is copied but the names)."""

    def __init__(self, buf: memoryview, pos: int = 0):
        self.buf, self.pos = buf, pos

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> None:
        if vtype in _SIZES:
            self.pos += _SIZES[vtype]
        elif vtype == _STRING:
            n = self.take("<Q")  # (not `self.pos += self.take(...)`: take moves pos first)
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.take("<IQ")
            if etype in _SIZES:
                self.pos += _SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise Unsupported(f"unknown metadata value type {vtype}")


def read_tensors(path: str | Path) -> dict[str, Tensor]:
    """{name: Tensor} for every tensor of a GGUF file."""
    path = Path(path)
    whole = np.memmap(path, np.uint8, "r")  # one mapping: the header is read, the tensors viewed
    buf = memoryview(whole)
    if bytes(buf[:4]) != MAGIC:
        raise Unsupported(f"{path.name} is not a GGUF file")
    c = _Cursor(buf, 4)
    version, n_tensors, n_kv = c.take("<IQQ")
    if version not in (2, 3):
        raise Unsupported(f"GGUF version {version}")
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, vtype = c.string(), c.take("<I")
        if key == "general.alignment" and vtype == _UINT32:
            alignment = c.take("<I")
        else:
            c.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("<I")
        shape = struct.unpack_from(f"<{n_dims}Q", buf, c.pos)
        c.pos += 8 * n_dims
        type_id, offset = c.take("<IQ")
        infos.append((name, shape, type_id, offset))
    start = -(-c.pos // alignment) * alignment
    out: dict[str, Tensor] = {}
    for name, shape, type_id, offset in infos:
        qtype = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[1:], dtype=np.int64))
        row_bytes = shape[0] // block * block_bytes
        first = start + offset
        data = whole[first : first + rows * row_bytes].reshape(rows, row_bytes)
        out[name] = Tensor(name, qtype.name, type_id, tuple(int(d) for d in shape), data)
    return out


# llama.cpp's gguf-split (and gguf-py's writer) name a split model's files this way; the
# first holds the metadata, every one a share of the tensors.
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_paths(path: str | Path) -> list[Path]:
    """The files of the model a .gguf path names: [path], or for the first file of a split
    model (NAME-00001-of-00003.gguf) all of them, in order. Another shard than the first, or
    a missing one, is an error that names the file to give or the files missing."""
    path = Path(path)
    m = _SHARD.match(path.name)
    if m is None:
        return [path]
    no, count = int(m["no"]), int(m["count"])
    first = f"{m['stem']}-00001-of-{count:05d}.gguf"
    if no != 1:
        raise ValueError(f"{path.name} is part {no} of a split model: give its first file, {first}")
    paths = [
        path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)
    ]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"split model {first}: missing {', '.join(missing)} beside it")
    return paths


def tensor_table(path: str | Path) -> dict[str, Tensor]:
    """{name: Tensor} for every tensor of the model a .gguf path names (all the files of a
    split one): read_tensors, or GGUFReader's tables in the same form for a file it refuses."""
    out: dict[str, Tensor] = {}
    for shard in shard_paths(path):
        out.update(_file_table(shard))
    return out


def _file_table(path: Path) -> dict[str, Tensor]:
    try:
        return read_tensors(path)
    except Unsupported:
        from gguf import GGUFReader

        out = {}
        for t in GGUFReader(str(path)).tensors:
            shape = tuple(int(d) for d in t.shape)
            rows = int(np.prod(shape[1:], dtype=np.int64))
            data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
            out[t.name] = Tensor(t.name, t.tensor_type.name, int(t.tensor_type), shape, data)
        return out
