"""Bad adapters are refused with a ValueError that names the field at fault, before anything
is queued or loaded; the engine goes on serving."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.adapter import read_adapter
from engine.models.hf_config import load_hf_config
from tests.engine.lora.lora_testing import make_adapter

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def good(tiny_llama_dir, tmp_path_factory):
    return make_adapter(
        tiny_llama_dir, tmp_path_factory.mktemp("good") / "qv", targets=["q_proj", "v_proj"]
    )


@pytest.fixture(scope="module")
def good_vocab(tiny_llama_dir, tmp_path_factory):
    """An adapter on the embedding and the LM head (peft saves the base layers beside them)."""
    return make_adapter(
        tiny_llama_dir,
        tmp_path_factory.mktemp("good-vocab") / "eh",
        targets=["embed_tokens", "lm_head"],
    )


def _variant(good, tmp_path, name, config=None, tensors=None):
    """A copy of the good adapter with its config and/or tensors edited."""
    out = tmp_path / name
    shutil.copytree(good, out)
    if config is not None:
        path = out / "adapter_config.json"
        data = json.loads(path.read_text())
        config(data)
        path.write_text(json.dumps(data))
    if tensors is not None:
        path = out / "adapter_model.safetensors"
        data = load_file(str(path))
        tensors(data)
        save_file(data, str(path))
    return out


def _set(key, value):
    return lambda data: data.__setitem__(key, value)


def _added_tokens(suffix):
    """The tensor ending in suffix with 8 more vocabulary rows or columns (added tokens)."""

    def edit(data):
        key = next(k for k in data if k.endswith(suffix))
        t = data[key]
        dim = 1 if suffix.endswith("lora_embedding_A") else 0
        data[key] = torch.cat([t, torch.zeros_like(t.narrow(dim, 0, 8))], dim=dim)

    return edit


def _cases(good, good_vocab, tmp_path):
    def drop_b(data):
        del data[next(k for k in data if k.endswith("v_proj.lora_B.weight"))]

    def wrong_shape(data):
        key = next(k for k in data if k.endswith("q_proj.lora_A.weight"))
        data[key] = torch.zeros(data[key].shape[0], data[key].shape[1] + 8)

    return [
        (_variant(good, tmp_path, "big-rank", _set("r", 64), None), r"\br: rank 64 is above max_lora_rank \(16\)"),
        (_variant(good, tmp_path, "lm-head", _set("target_modules", ["q_proj", "v_proj", "lm_head"])), "target_modules: lm_head listed but not in"),
        (_variant(good, tmp_path, "rotary", _set("target_modules", ["q_proj", "rotary_emb"])), "target_modules: rotary_emb not supported"),
        (_variant(good_vocab, tmp_path, "to-save", _set("modules_to_save", ["lm_head"])), "modules_to_save: .* is not supported"),
        (_variant(good_vocab, tmp_path, "tokens", _set("trainable_token_indices", [5, 6])), "trainable_token_indices"),
        (_variant(good_vocab, tmp_path, "added-a", None, _added_tokens("lora_embedding_A")), r"embed_tokens\.lora_embedding_A: shape \(8, 392\) .*added tokens are not supported"),
        (_variant(good_vocab, tmp_path, "added-head", None, _added_tokens("lm_head.lora_B.weight")), r"lm_head\.lora_B\.weight: shape \(392, 8\) .*added tokens"),
        (_variant(good_vocab, tmp_path, "added-base", None, _added_tokens("embed_tokens.base_layer.weight")), r"embed_tokens\.base_layer\.weight: shape \(392, 64\): the adapter's vocabulary differs"),
        (_variant(good, tmp_path, "missing", _set("target_modules", ["q_proj", "v_proj", "o_proj"])), "target_modules: o_proj listed but not in"),
        (_variant(good, tmp_path, "no-b", None, drop_b), r"v_proj\.lora_B: missing"),
        (_variant(good, tmp_path, "shape", None, wrong_shape), r"q_proj\.lora_A\.weight: shape \(8, 72\) does not fit"),
        (_variant(good, tmp_path, "dora", _set("use_dora", True)), r"lora_magnitude_vector: missing \(use_dora is set\)"),
        (tmp_path / "nowhere", "lora_path: not a folder"),
    ]  # fmt: skip


def test_read_adapter_names_the_field(tiny_llama_dir, good, good_vocab, tmp_path):
    cfg = load_hf_config(tiny_llama_dir)
    assert cfg.vocab_size == 384  # the shapes the messages name
    for path, message in _cases(good, good_vocab, tmp_path):
        for check in (True, False):
            with pytest.raises(ValueError, match=message):
                read_adapter(path, cfg, 16, check=check)
    adapter = read_adapter(good, cfg, 16)
    assert adapter.target_modules == ("q_proj", "v_proj") and adapter.scaling == 2.0
    vocab = read_adapter(good_vocab, cfg, 16)
    assert vocab.target_modules == ("embed_tokens", "lm_head")


def test_the_engine_refuses_bad_adapters_and_goes_on(tiny_llama_dir, good, good_vocab, tmp_path):
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=2
    )
    for i, (path, message) in enumerate(_cases(good, good_vocab, tmp_path), start=10):
        with pytest.raises(ValueError, match=message):
            # a good request beside it is not queued either
            llm.generate(
                [[5, 6, 7], [8, 9]], PARAMS, lora_request=[None, LoRARequest("bad", i, str(path))]
            )
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine._adapters
    manager = engine.executor.runner.lora_manager
    assert manager.num_loads == 0 and manager.slots == [None, None]
    ok = LoRARequest("good", 1, str(good))
    assert len(llm.generate([[5, 6, 7]], PARAMS, lora_request=ok)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'good'"):
        llm.generate([[5, 6, 7]], PARAMS, lora_request=LoRARequest("other", 1, str(good)))
    llm.shutdown()


def test_adapters_need_enable_lora(tiny_llama_dir, good):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([[5, 6, 7]], PARAMS, lora_request=LoRARequest("good", 1, str(good)))
    llm.shutdown()


def test_a_failed_load_leaves_the_slots_as_they_were(tiny_llama_dir, good, tmp_path):
    """A folder that breaks between the front's check and the step: the step fails, and the
    runner keeps nothing of it."""
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=1
    )
    manager = llm.engine.executor.runner.lora_manager
    llm.generate([[5, 6, 7]], PARAMS, lora_request=LoRARequest("good", 1, str(good)))
    assert manager.slots == [1]
    broken = _variant(good, tmp_path, "broken", _set("r", 64))
    with pytest.raises(ValueError, match="max_lora_rank"):
        manager.prepare([(LoRARequest("broken", 2, str(broken)), 0, 3)])
    assert manager.slots == [1] and list(manager._cpu) == [1]
    llm.shutdown()


def test_lora_request_fields():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")
