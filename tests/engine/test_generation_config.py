"""--generation-config (the model's sampling defaults) and --chat-template, offline (over HTTP:
tests/api/openai/test_generation_config_http.py)."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.models.hf_config import sampling_defaults
from engine.sampling_params import SamplingParams


def test_sampling_defaults_read_as_vllm_does(genconf_dir, tmp_path):
    want = {"temperature": 0.0, "top_k": 5, "max_tokens": 5}  # do_sample is not a default
    assert sampling_defaults(genconf_dir, "auto") == want
    assert sampling_defaults(genconf_dir, "vllm") == {}
    assert sampling_defaults(tmp_path, "auto") == {}  # a model without the file
    assert sampling_defaults(tmp_path, str(genconf_dir)) == want  # another folder's file
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(genconf_dir, str(tmp_path))


def test_offline_defaults_and_template(genconf_dir, tmp_path):
    llm = LLM(str(genconf_dir), dtype="float32", num_kv_blocks=64, max_model_len=128)
    try:
        default = llm.get_default_sampling_params()
        assert (default.temperature, default.top_k, default.max_tokens) == (0.0, 5, 5)
        got = llm.generate(["Paris is"], use_tqdm=False)[0].outputs[0]
        explicit = SamplingParams(temperature=0.0, top_k=5, max_tokens=5)
        assert (
            got.token_ids
            == llm.generate(["Paris is"], explicit, use_tqdm=False)[0].outputs[0].token_ids
        )
        assert len(got.token_ids) == 5
    finally:
        llm.shutdown()
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    for source in (str(template), template.read_text()):
        llm = LLM(str(genconf_dir), dtype="float32", num_kv_blocks=64, chat_template=source)
        try:
            out = llm.chat([{"role": "user", "content": "Paris"}], SamplingParams(max_tokens=1))
            assert out[0].prompt_token_ids == llm.tokenizer.encode(
                "[Paris]", add_special_tokens=False
            )
        finally:
            llm.shutdown()
    with pytest.raises(ValueError, match="no such file"):
        LLM(str(genconf_dir), dtype="float32", chat_template=str(tmp_path / "missing.jinja"))
