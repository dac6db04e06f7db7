"""--load-format dummy from a folder that holds config.json and nothing else."""

from __future__ import annotations

import shutil

import pytest

from engine.dummy_tokenizer import byte_level_tokenizer


def test_byte_level_stand_in_round_trips_text() -> None:
    tok = byte_level_tokenizer(1000, eos_token_id=999)
    text = "Hello, wörld! 😀 tabs\tand\nnewlines"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.vocab_size == 1000 and tok.eos_token_id == 999
    assert tok.decode([500]) == "<|dummy_500|>"
    assert not tok.has_chat_template


def test_dummy_serves_from_config_json_alone(tiny_llama_dir, tmp_path) -> None:
    from engine import LLM, SamplingParams
    from engine.models.loader import resolve_model

    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="no \\*.safetensors") as exc:
        resolve_model(str(tmp_path))
    assert "load_format 'dummy'" in str(exc.value)
    llm = LLM(
        str(tmp_path), load_format="dummy", dtype="float32", num_kv_blocks=64, max_model_len=128
    )
    try:
        out = llm.generate("Hi", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
        assert llm.tokenizer.vocab_size == llm.engine.vocab_size
    finally:
        llm.shutdown()
