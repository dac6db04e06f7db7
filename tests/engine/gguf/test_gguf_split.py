"""Split GGUF models (llama.cpp's gguf-split: NAME-00001-of-0000n.gguf and the rest beside it,
the first holding the metadata): served from the first file like the unsplit model. The
bundled file is rewritten as three parts by gguf-py's writer for these tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from engine.gguf.convert import LINK
from engine.gguf.source import default_gguf_path
from engine.gguf.tensors import read_tensors, shard_paths, tensor_table
from engine.models.loader import resolve_model
from tests.conftest import private_cache_dir


@pytest.fixture(scope="module")
def split_model(tmp_path_factory) -> list[Path]:
    """The bundled SmolLM2 file, every field and tensor as they are, in three files."""
    source = default_gguf_path()
    reader = GGUFReader(str(source))
    folder = tmp_path_factory.mktemp("split")
    per_file = -(-len(reader.tensors) // 3)
    writer = GGUFWriter(str(folder / "smol.gguf"), "llama", split_max_tensors=per_file)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(folder.glob("smol-*-of-*.gguf"))


def test_the_first_file_names_every_part_and_their_tensors_are_the_models(split_model):
    assert [p.name for p in split_model] == [f"smol-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert shard_paths(split_model[0]) == split_model
    whole, split = tensor_table(default_gguf_path()), tensor_table(split_model[0])
    assert split.keys() == whole.keys()
    for name, t in whole.items():
        s = split[name]
        assert (s.type_id, s.shape) == (t.type_id, t.shape)
        assert np.array_equal(s.data, t.data), name
    shares = [len(read_tensors(p)) for p in split_model]  # each file alone: its share
    assert sum(shares) == len(whole) and all(shares)


def test_a_later_part_or_a_missing_one_is_a_clear_error(split_model, tmp_path):
    with pytest.raises(
        ValueError, match="part 2 of a split model: give its first file, smol-00001"
    ):
        resolve_model(split_model[1], cache_dir=tmp_path)
    alone = tmp_path / "alone"
    alone.mkdir()
    first = alone / split_model[0].name
    os.link(split_model[0], first)
    os.link(split_model[2], alone / split_model[2].name)
    with pytest.raises(ValueError, match=r"missing smol-00002-of-00003\.gguf beside it"):
        resolve_model(first, cache_dir=tmp_path)


def test_a_split_model_serves_like_the_whole_file(split_model, tmp_path, monkeypatch):
    """Converted from its first file (the link names all three), loaded with its blocks in
    their own quantization, the same greedy answer as the bundled file."""
    from engine import LLM, SamplingParams

    private_cache_dir(tmp_path, monkeypatch)  # models to tmp_path; kernels shared
    folder = resolve_model(split_model[0], cache_dir=tmp_path)
    link = json.loads((folder / LINK).read_text())
    assert [Path(f["path"]).name for f in link["files"]] == [p.name for p in split_model]
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = "The capital of France is"
    outs = []
    for model in (str(default_gguf_path()), str(split_model[0])):
        llm = LLM(model, max_model_len=256, num_kv_blocks=64)
        assert llm.engine.executor.runner.quantization == "gguf"
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0])
        llm.shutdown()
    assert outs[1].token_ids == outs[0].token_ids and "Paris" in outs[1].text
