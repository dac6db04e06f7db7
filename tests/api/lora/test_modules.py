"""--lora-modules: vLLM's NAME=PATH and JSON spellings, several per flag; the start-up errors
Settings gives before any model loads; who sees an owned adapter."""

from __future__ import annotations

import pytest

from api.keys.auth import ADMIN, Principal
from api.lora.modules import LoRAModule, parse_lora_module, parse_lora_modules
from api.lora.registry import AdapterNotFound, AdapterRegistry
from api.server.settings import Settings


def test_both_spellings():
    assert parse_lora_module("sql=/a/sql") == LoRAModule("sql", "/a/sql")
    obj = '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}'
    assert parse_lora_module(obj) == LoRAModule("chat", "/a/chat", "m")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("/a/sql", "expected NAME=PATH"),
        ("=/a", "not a valid adapter name"),
        ("sql=", "path must be a non-empty string"),
        ('{"name": "x"}', "path must be a non-empty string"),
        ('{"name": "x", "path": "/p", "rank": 8}', "unknown field(s) rank"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_spellings_name_what_is_wrong(text, says):
    with pytest.raises(ValueError) as e:
        parse_lora_module(text)
    assert says in str(e.value)


def test_a_name_twice():
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_settings_take_several_per_flag_and_need_enable_lora():
    s = Settings.from_argv(
        ["m", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
         "--lora-modules", "c=/z"]
    )  # fmt: skip
    assert s.lora_modules == ["a=/x", '{"name": "b", "path": "/y"}', "c=/z"]
    with pytest.raises(ValueError, match=r"--lora-modules \(a\) needs --enable-lora"):
        Settings.from_argv(["m", "--lora-modules", "a=/x"])
    with pytest.raises(ValueError, match="the served model's name"):
        Settings.from_argv(
            ["m", "--enable-lora", "--served-model-name", "a", "--lora-modules", "a=/x"]
        )


def test_an_owned_adapter_is_its_tenants():
    registry = AdapterRegistry([])
    registry._add("pub", "/p", None, None, "flag")
    registry._add("own", "/o", "t1", None, "admin")
    mine, theirs = Principal("k1", "k1", tenant_id="t1"), Principal("k2", "k2", tenant_id="t2")
    assert registry.resolve("own", mine).lora_int_id == 2
    assert registry.resolve("pub", theirs).name == "pub"
    assert registry.resolve("base", theirs) is None  # the base model (or unknown): not ours
    with pytest.raises(AdapterNotFound):
        registry.resolve("own", theirs)
    assert [a.name for a in registry.visible(theirs)] == ["pub"]
    assert [a.name for a in registry.visible(ADMIN)] == ["pub", "own"]


def test_a_dora_folder_needs_float_base_weights(tiny_llama_dir, tmp_path):
    """The registry's folder check (load at run time, --lora-modules) asks the engine for its
    base weights' method: a DoRA adapter is refused naming use_dora over int8 weights and
    passes over float ones."""
    from api.lora.registry import check_folder
    from engine import LLM
    from tests.engine.lora.lora_testing import make_adapter

    dora = make_adapter(tiny_llama_dir, tmp_path / "dora", targets=["q_proj"], use_dora=True)
    for quantization in ("int8", None):
        llm = LLM(
            str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, enable_lora=True,
            quantization=quantization,
        )  # fmt: skip
        try:
            if quantization is None:
                check_folder(llm.engine, "dora", str(dora))
            else:
                with pytest.raises(ValueError, match="use_dora: DoRA over a quantized base"):
                    check_folder(llm.engine, "dora", str(dora))
        finally:
            llm.shutdown()
