"""Settings: flags, TESSERA_* fallbacks, their precedence, and the mapping to EngineConfig."""

from __future__ import annotations

import pytest

from api.cli.main import build_parser, main
from api.server.settings import Settings
from engine.args import default_max_num_batched_tokens
from engine.config import DEFAULT_MODEL
from engine.options import parse_bytes


def settings(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    return Settings.from_argv(argv, env or {})


def test_defaults():
    s = settings([])
    assert s.model == DEFAULT_MODEL and s.model_name == DEFAULT_MODEL
    assert (s.host, s.port) == ("127.0.0.1", 8000)
    assert s.enable_prefix_caching is True
    assert s.api_key == [] and s.auth == "keys"
    assert s.max_body_size == 4 * 1024**2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("2GB", 2 * 10**9),
        ("1.5gib", int(1.5 * 1024**3)),
        ("1024", 1024),
        (" 3 KiB ", 3 * 1024),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["4XB", "GiB", "-1GiB", ""])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="expected a size"):
        parse_bytes(text)


def test_flags_parse_into_fields():
    s = settings(
        [
            "some/model",
            "--served-model-name",
            "m",
            "--port",
            "9000",
            "--kv-cache-memory",
            "1GiB",
            "--no-enable-prefix-caching",
            "--api-key",
            "a",
            "--api-key",
            "b",
            "--max-model-len",
            "1024",
            "--max-num-queued-requests",
            "7",
            "--shutdown-timeout",
            "2.5",
        ]
    )
    assert s.model == "some/model" and s.model_name == "m"
    assert s.port == 9000
    assert s.kv_cache_memory == 1024**3
    assert s.enable_prefix_caching is False
    assert s.api_key == ["a", "b"]
    assert s.max_model_len == 1024
    assert s.max_num_queued_requests == 7
    assert s.shutdown_timeout == 2.5


def test_env_fallback_and_flag_precedence():
    env = {
        "TESSERA_PORT": "7000",
        "TESSERA_API_KEY": "k1, k2",
        "TESSERA_ENABLE_PREFIX_CACHING": "false",
        "TESSERA_KV_CACHE_MEMORY": "64MiB",
        "TESSERA_MODEL": "env/model",
        "TESSERA_MAX_NUM_SEQS": "3",
    }
    s = settings(["--port", "7001"], env)
    assert s.port == 7001  # the flag wins
    assert s.api_key == ["k1", "k2"]
    assert s.enable_prefix_caching is False
    assert s.kv_cache_memory == 64 * 1024**2
    assert s.model == "env/model"
    assert s.max_num_seqs == 3
    # A bool flag given explicitly beats the variable, both ways.
    assert settings(["--enable-prefix-caching"], env).enable_prefix_caching is True


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TESSERA_PORT": "abc"}, "TESSERA_PORT"),
        ({"TESSERA_ENABLE_PREFIX_CACHING": "maybe"}, "TESSERA_ENABLE_PREFIX_CACHING"),
        ({"TESSERA_AUTH": "open"}, "must be one of keys, static, none"),
        ({"TESSERA_SHUTDOWN_TIMEOUT": "-1"}, "shutdown_timeout"),
        ({"TESSERA_OTLP_SHUTDOWN_TIMEOUT": "-1"}, "otlp_shutdown_timeout"),
    ],
)
def test_bad_env_values_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        settings([], env)


def test_model_given_twice_is_refused():
    with pytest.raises(ValueError, match="given twice"):
        settings(["a", "--model", "b"])


def test_create_engine_config():
    s = settings(
        [
            "m",
            "--served-model-name",
            "served",
            "--max-model-len",
            "1024",
            "--block-size",
            "32",
            "--num-kv-blocks",
            "100",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "256",
            "--tensor-parallel-size",
            "2",
            "--max-num-queued-requests",
            "5",
            "--dtype",
            "float32",
            "--load-format",
            "dummy",
            "--seed",
            "3",
            "--kv-cache-dtype",
            "int8",
        ]
    )
    c = s.create_engine_config()
    assert c.model.model == "m" and c.model.dtype == "float32" and c.model.seed == 3
    assert c.model.load_format == "dummy" and c.model.max_model_len == 1024
    assert c.cache.block_size == 32 and c.cache.num_blocks == 100
    assert c.cache.kv_cache_dtype == "int8"
    assert settings(["m"]).create_engine_config().cache.kv_cache_dtype == "auto"
    assert (
        settings([], {"TESSERA_KV_CACHE_DTYPE": "int8"}).create_engine_config().cache.kv_cache_dtype
        == "int8"
    )
    assert c.scheduler.block_size == 32 and c.scheduler.max_model_len == 1024
    assert c.scheduler.max_num_seqs == 8 and c.scheduler.max_num_batched_tokens == 256
    assert c.parallel.tensor_parallel_size == 2
    assert c.served_model_name == "served" and c.max_num_queued_requests == 5


def test_engine_config_errors_reach_the_user(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--block-size", "12"])
    assert exc.value.code == 2
    assert "block_size must be a power of two" in capsys.readouterr().err


def test_cli_version_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("tessera ")
    help_text = build_parser().format_help()
    assert "serve" in help_text and "bench" in help_text


def test_cli_bench_unknown_name(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "nope"])
    assert "choose one of" in capsys.readouterr().err


def test_step_token_budget_defaults_by_device():
    """--max-num-batched-tokens: 1024 on CPU (measured best on 2 cores), 2048 on a GPU; a
    given value wins."""
    cpu = settings(["m", "--device", "cpu"]).create_engine_config()
    assert cpu.scheduler.max_num_batched_tokens == 1024
    gpu_settings = settings(["m", "--device", "cuda"])
    assert gpu_settings.max_num_batched_tokens is None
    assert default_max_num_batched_tokens("cuda") == 2048
    given = settings(
        ["m", "--device", "cpu", "--max-num-batched-tokens", "64"]
    ).create_engine_config()
    assert given.scheduler.max_num_batched_tokens == 64
    env = settings(["m"], {"TESSERA_MAX_NUM_BATCHED_TOKENS": "4096"})
    assert env.max_num_batched_tokens == 4096


def test_attention_backend_flag_reaches_the_engine_config():
    assert settings(["m"]).create_engine_config().model.attention_backend == "auto"
    c = settings(["m", "--attention-backend", "torch"]).create_engine_config()
    assert c.model.attention_backend == "torch"
    env = {"TESSERA_ATTENTION_BACKEND": "cpu"}
    assert settings([], env).create_engine_config().model.attention_backend == "cpu"
    c = settings(
        ["m", "--attention-backend", "triton", "--kv-cache-dtype", "fp8"]
    ).create_engine_config()
    assert (c.model.attention_backend, c.cache.kv_cache_dtype) == ("triton", "fp8")
    with pytest.raises(SystemExit):  # argparse refuses a name that is not a backend
        settings(["--attention-backend", "flash"])


def test_async_scheduling_flag_reaches_the_engine_config():
    assert settings(["m"]).create_engine_config().scheduler.async_scheduling is None  # auto
    on = settings(["m", "--async-scheduling"]).create_engine_config()
    assert on.scheduler.async_scheduling is True
    off = settings(["m", "--no-async-scheduling"]).create_engine_config()
    assert off.scheduler.async_scheduling is False
    env = {"TESSERA_ASYNC_SCHEDULING": "0"}
    assert settings([], env).create_engine_config().scheduler.async_scheduling is False


def test_enforce_eager_flag_reaches_the_engine_config():
    assert settings(["m"]).create_engine_config().model.enforce_eager is False
    assert settings(["m", "--enforce-eager"]).create_engine_config().model.enforce_eager is True
    assert settings(["m", "--no-enforce-eager"]).create_engine_config().model.enforce_eager is False
    env = {"TESSERA_ENFORCE_EAGER": "1"}
    assert settings([], env).create_engine_config().model.enforce_eager is True


def test_metrics_privacy_and_login_lockout_settings():
    s = settings([])
    assert (s.metrics_key_label, s.metrics_tenant_label, s.metrics_token) == ("none", "none", None)
    assert (s.login_max_failures, s.login_failure_window) == (5, 60.0)
    s = settings(
        ["--metrics-key-label", "id", "--login-failure-window", "1.5"],
        {"TESSERA_METRICS_TOKEN": "tok", "TESSERA_LOGIN_MAX_FAILURES": "0"},
    )
    assert (s.metrics_key_label, s.metrics_token) == ("id", "tok")
    assert (s.login_max_failures, s.login_failure_window) == (0, 1.5)
    with pytest.raises(ValueError, match="TESSERA_METRICS_TENANT_LABEL"):
        settings([], {"TESSERA_METRICS_TENANT_LABEL": "name"})
    with pytest.raises(ValueError, match="login_failure_window"):
        settings(["--login-failure-window", "0"])
    with pytest.raises(ValueError, match="login_max_failures"):
        settings(["--login-max-failures", "-1"])


def test_api_server_count_is_checked():
    with pytest.raises(ValueError, match="api_server_count must be at least 1"):
        settings(["--api-server-count", "0"]).validate()
    assert settings(["--api-server-count", "3"]).api_server_count == 3
