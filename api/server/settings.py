"""Server settings: EngineArgs plus the server's own options, filled from CLI flags, then
TESSERA_* variables, then defaults.

Every field (the engine's, engine.args.EngineArgs, and the server's below) is a flag
`--foo-bar` and a variable `TESSERA_FOO_BAR`, generated from the field and its help; a flag
given on the command line wins over the variable. `create_engine_config` (EngineArgs') is the
only place that maps them onto the engine's config.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.openai.tools import PARSER_CHOICES
from engine.args import EngineArgs
from engine.options import (
    option,
    optional_float,
    optional_int,
    parse_bool,
    parse_bytes,
    parse_value,
    redefault,
)

ENV_PREFIX = "TESSERA_"


@dataclass(slots=True, kw_only=True)
class Settings(EngineArgs):
    # --- the engine's options whose serving default differs from the offline API's ---
    frontend_threads: int | None = redefault(EngineArgs, "frontend_threads", None)
    max_num_queued_requests: int | None = redefault(EngineArgs, "max_num_queued_requests", 1024)
    # --- HTTP server ---
    host: str = option(
        "Address to listen on. Loopback by default; use 0.0.0.0 to accept remote clients.",
        "127.0.0.1",
    )
    port: int = option("Port to listen on.", 8000, int)
    engine_process: bool = option(
        "Run the engine core (scheduler, model, workers) in a process of its own, as vLLM "
        "does, so the HTTP event loop and the engine's step loop stop sharing one GIL: more "
        "streamed tokens a second at high concurrency, where the server's Python is the "
        "limit (tessera bench frontend), at the cost of a pipe hop per step. Off: a thread.",
        False,
        parse_bool,
        kind="bool",
    )
    api_server_count: int = option(
        "API server processes accepting on the one port, each with its own event loop, in "
        "front of one engine core process (vLLM's API-server scale-out; more than 1 implies "
        "--engine-process): for a GPU host whose one HTTP event loop cannot stream as fast as "
        "the engine makes tokens. Each costs a core and the tokenizer loaded again.",
        1,
        int,
    )
    max_body_size: int = option(
        "Largest accepted request body (e.g. 4MiB); larger bodies get 413.",
        4 * 1024**2,
        parse_bytes,
    )
    max_prompts_per_request: int = option(
        "Most prompts one /v1/completions request (inputs one /v1/embeddings request) may batch.",
        64,
        int,
    )
    shutdown_timeout: float = option(
        "Seconds in-flight requests may run after SIGTERM/SIGINT before they are aborted.",
        30.0,
        float,
    )
    # --- hardening (README "Limits"): timeouts, caps, off-loop work ---
    timeout_keep_alive: float = option(
        "Seconds an idle keep-alive connection is held open before it is closed.", 5.0, float
    )
    header_read_timeout: float = option(
        "Seconds a new connection may take to send its request line and headers (slowloris "
        "guard); a client that has not finished by then is disconnected.",
        10.0,
        float,
    )
    limit_concurrency: int = option(
        "Most open connections: one beyond it gets a 503 (OpenAI error envelope, Retry-After) "
        "at once and is closed. Keep it under the file-descriptor limit (ulimit -n). "
        "0: no cap.",
        1000,
        int,
    )
    cpu_workers: int = option(
        "Worker processes for CPU-heavy request steps (chat template and tokenization of "
        "large inputs, checking large JSON bodies), at a lower CPU priority than the engine; "
        "more such requests wait their turn instead of slowing the engine or the event loop.",
        2,
        int,
    )
    db_timeout: float = option(
        "Seconds an admin REST or console database call may take before it answers 503.",
        5.0,
        float,
    )
    log_level: str = option(
        "Log level.", "info", str, choices=("critical", "error", "warning", "info", "debug")
    )
    log_format: str = option(
        "Log lines as text, or as JSON objects (ts, level, logger, msg, request_id, tenant).",
        "text",
        str,
        choices=("text", "json"),
    )
    otlp_traces_endpoint: str | None = option(
        "Export OpenTelemetry traces over OTLP/HTTP to this URL (e.g. "
        "http://localhost:4318/v1/traces); needs the `otel` extra."
    )
    otlp_shutdown_timeout: float = option(
        "Seconds shutdown waits for the trace collector to take the spans still queued; the "
        "rest are dropped (logged as a warning, counted in tessera:trace_spans_dropped_total).",
        2.0,
        float,
    )
    num_threads: int | None = option(
        "torch intra-op threads (default: torch's choice, usually one per core).",
        None,
        optional_int,
    )
    # --- the OpenAI API ---
    tool_call_parser: str = option(
        "How tool calls are read from the output: auto = from the chat template (hermes for "
        "<tool_call> templates such as Qwen2's, llama3_json for Llama 3.1/3.2's, generic for a "
        "template that cannot render tools: the tools are described in the prompt and the "
        "reply is held to a JSON envelope); none = tool calling off (tools get 400).",
        "auto",
        choices=PARSER_CHOICES,
    )
    trust_request_chat_template: bool = option(
        "Accept a chat request's own `chat_template` (vLLM's field). Off by default: a "
        "template is code the server runs (sandboxed Jinja, but its loops are its own).",
        False,
        parse_bool,
        kind="bool",
    )
    lenient_request_fields: bool = option(
        "Ignore request fields outside OpenAI's and vLLM's documented sets (logged) instead "
        "of refusing them with 400.",
        False,
        parse_bool,
        kind="bool",
    )
    request_timeout: float | None = option(
        "Seconds a generation request may take from arrival to its last token (queueing "
        "included); past it the engine stops it, frees its blocks and the client gets 504 "
        "(code request_timeout), usage recorded. A key's own limit applies when tighter. "
        "Default: none.",
        None,
        optional_float,
    )
    lora_modules: list[str] = option(
        "LoRA adapters served from the start, public (vLLM's flag): NAME=PATH or a JSON "
        'object {"name": ..., "path": ..., "base_model_name": ...}; several per flag, and '
        "the flag repeatable (env: comma-separated NAME=PATH). A request's `model` naming one "
        "runs it. Needs --enable-lora; each folder is checked against the model at start.",
        parse=str,
        kind="list",
        factory=list,
    )
    # --- auth, storage (used by api/keys/auth.py and the services) ---
    auth: str | None = option(
        "keys: API keys from the database (plus any --api-key); static: only the --api-key "
        "keys, no database (vLLM-compatible); none: an open server, for local development. "
        "Default: static when --api-key is given, else keys.",
        None,
        choices=("keys", "static", "none"),
    )
    api_key: list[str] = option(
        "Static API key accepted as `Authorization: Bearer KEY` (repeatable; env: comma-separated).",
        parse=str,
        kind="list",
        factory=list,
    )
    database_url: str | None = option(
        "Database for keys, quotas and usage: sqlite+aiosqlite:///PATH or "
        "postgresql+asyncpg://USER:PASS@HOST/DB (replicas). Default: SQLite in the data dir."
    )
    admin_token: str | None = option(
        "Bearer token for the admin API and console (default: generated on first start and "
        "kept in <data dir>/admin_token)."
    )
    data_dir: str | None = option(
        "Folder for the SQLite database and the admin token file "
        "(default: $XDG_DATA_HOME/tessera, i.e. ~/.local/share/tessera)."
    )
    metrics_key_label: str = option(
        "Per-key series in /metrics (tessera:requests_total, tessera:tokens_total): none = one "
        "series for all keys; name = labelled key_name, the key's name; id = key_id, its id "
        "(names can be personal or change). Opt in: whoever reads /metrics sees the labels.",
        "none",
        choices=("none", "name", "id"),
    )
    metrics_tenant_label: str = option(
        "Per-tenant series in /metrics (tessera:*_by_tenant_total, labelled tenant = the "
        "tenant's id, or the key's id for a key without one): none = not exported; id = "
        "exported. Opt in, like --metrics-key-label.",
        "none",
        choices=("none", "id"),
    )
    metrics_require_admin: bool = option(
        "Serve /metrics only with the admin token.", False, parse_bool, kind="bool"
    )
    metrics_token: str | None = option(
        "Bearer token that opens /metrics (`Authorization: Bearer TOKEN`; Prometheus: "
        "`authorization: {credentials_file: ...}`); without it /metrics answers 401. "
        "Default: none, /metrics is open (unless --metrics-require-admin)."
    )
    login_max_failures: int = option(
        "Wrong secrets (console login, admin API token, /metrics token) one client address "
        "may send within --login-failure-window before it is locked out for that long: 429 "
        "with Retry-After, the secret not even checked. The address is the socket peer "
        "(uvicorn takes X-Forwarded-For only from FORWARDED_ALLOW_IPS: loopback by default); "
        "IPv6 per /64. The admin token sent as an API key has a lockout of its own (the API "
        "routes then do not accept it; API keys still work). 0: no limit.",
        5,
        int,
    )
    login_failure_window: float = option(
        "Seconds over which --login-max-failures are counted; also the lockout's length.",
        60.0,
        float,
    )

    def __post_init__(self) -> None:
        if self.auth is None:  # `--api-key K` alone means vLLM's static-key server
            self.auth = "static" if self.api_key else "keys"
        if self.scheduling_policy is None:  # fair where keys tell tenants apart
            self.scheduling_policy = "fcfs" if self.auth == "none" else "fair"

    def validate(self) -> None:
        if self.auth not in ("keys", "static", "none"):
            raise ValueError(f"auth must be one of keys, static, none; got {self.auth!r}")
        if self.auth == "static" and not self.api_key:
            raise ValueError("--auth static needs at least one --api-key KEY (or TESSERA_API_KEY)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if not self.otlp_shutdown_timeout >= 0:
            raise ValueError(
                f"otlp_shutdown_timeout must be >= 0 seconds, got {self.otlp_shutdown_timeout}"
            )
        if self.max_body_size < 1024:
            raise ValueError(f"max_body_size must be at least 1KiB, got {self.max_body_size}")
        if self.max_prompts_per_request < 1:
            raise ValueError(
                f"max_prompts_per_request must be at least 1, got {self.max_prompts_per_request}"
            )
        for name in ("timeout_keep_alive", "header_read_timeout", "db_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.limit_concurrency < 0:
            raise ValueError(f"limit_concurrency must be >= 0, got {self.limit_concurrency}")
        if self.login_max_failures < 0:
            raise ValueError(f"login_max_failures must be >= 0, got {self.login_max_failures}")
        if not self.login_failure_window > 0:
            raise ValueError(
                f"login_failure_window must be > 0 seconds, got {self.login_failure_window}"
            )
        if self.cpu_workers < 1:
            raise ValueError(f"cpu_workers must be at least 1, got {self.cpu_workers}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be at least 1, got {self.api_server_count}")
        if self.lora_modules:
            from api.lora.modules import parse_lora_modules

            modules = parse_lora_modules(self.lora_modules)
            if not self.enable_lora:
                raise ValueError(
                    f"--lora-modules ({', '.join(m.name for m in modules)}) needs --enable-lora"
                )
            clash = next((m.name for m in modules if m.name == self.model_name), None)
            if clash is not None:
                raise ValueError(
                    f"--lora-modules: the adapter name {clash!r} is the served model's name"
                )
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(
                f"request_timeout must be positive seconds, got {self.request_timeout}"
            )

    @property
    def model_name(self) -> str:
        """The name clients put in the `model` field."""
        return self.served_model_name or self.model

    @property
    def uses_database(self) -> bool:
        """Keys mode needs the database; the other modes use one only when given a URL."""
        return self.auth == "keys" or self.database_url is not None

    def resolved_data_dir(self) -> Path:
        """--data-dir, else the folder `tessera keys` / `tessera db` use too."""
        from api.db.session import default_data_dir

        return Path(self.data_dir).expanduser() if self.data_dir else default_data_dir()

    def resolved_database_url(self) -> str:
        from api.db.session import default_database_url

        return self.database_url or default_database_url(self.resolved_data_dir())

    @classmethod
    def from_args(
        cls, ns: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """Flags given on the command line, else TESSERA_* variables, else the defaults."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        positional = getattr(ns, "model_pos", None)
        if positional:
            if ns.model and ns.model != positional:
                raise ValueError(
                    f"the model is given twice ({positional!r} and --model {ns.model!r}); give one"
                )
            ns.model = positional
        for f in dataclasses.fields(cls):
            given = getattr(ns, f.name, None)
            if given is not None and given != []:
                values[f.name] = given
                continue
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            try:
                values[f.name] = parse_value(f, raw)
            except ValueError as e:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}: {e}") from None
        settings = cls(**values)
        settings.validate()
        return settings

    @classmethod
    def from_argv(cls, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
        parser = argparse.ArgumentParser(prog="tessera serve")
        add_serve_arguments(parser)
        return cls.from_args(parser.parse_args(list(argv)), environ)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """All `tessera serve` flags. Defaults are None so that from_args can tell 'not given'."""
    parser.add_argument(
        "model_pos", nargs="?", metavar="MODEL", help="Model (same as --model)", default=None
    )
    for f in dataclasses.fields(Settings):
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        help_text = f"{meta['help']} [env {env}; default {default}]"
        if meta["kind"] == "bool":
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif meta["kind"] == "list" and f.name == "lora_modules":  # vLLM's: several per flag
            parser.add_argument(flag, nargs="+", action="extend", default=None, help=help_text)
        elif meta["kind"] == "list":
            parser.add_argument(flag, action="append", default=None, help=help_text)
        else:
            parser.add_argument(
                flag,
                type=_argparse_type(meta["parse"]),
                choices=meta["choices"],
                default=None,
                help=help_text,
            )


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert
