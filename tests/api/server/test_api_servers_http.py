"""`tessera serve --api-server-count 2`: two API server processes accepting on one port in
front of one engine core (api/server/api_servers.py), on loopback, with keys and a SQLite
ledger. Both servers serve completions (whole and streamed) with the same greedy text; a
tenant's prefix-cache hits do not depend on the server a request reaches (one salt secret);
every scrape of /metrics, whichever server answers it, counts every request; the ledger has
a row for each; SIGTERM drains a stream in flight and stops every process with exit 0; an
API server that dies, or an engine that fails to load, stops the whole server with exit 1,
leaving no process behind. LoRA
adapters: a tenant's adapter loaded or unloaded through one server's admin API is served (the
offline LLM's greedy text with it) or refused by every server within the sync bound."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.api.conftest import ServerProcess, stream_in_thread
from tests.api.keys_http import ADMIN_TOKEN, MODEL, Admin, bearer
from tests.api.lora.test_lora_http import _complete as complete_with
from tests.api.lora.test_lora_http import _post as admin_post
from tests.api.lora.test_lora_http import adapters, offline  # noqa: F401 - the fixtures

pytestmark = pytest.mark.slow

# How long a server may serve the table's old state after a change (the sync every 2 s; a
# loaded CI host delays a loop by seconds): a bound for correctness, not a speed.
SYNC_BOUND_S = 30.0

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several full KV blocks


def _start(start_server, tiny_llama_dir, tmp_path_factory, *extra: str):
    tmp = tmp_path_factory.mktemp("api-servers")
    return start_server(
        tiny_llama_dir,
        "--served-model-name", MODEL, "--data-dir", str(tmp), "--admin-token", ADMIN_TOKEN,
        "--api-server-count", "2", "--log-format", "json", "--max-num-seqs", "16", *extra,
    )  # fmt: skip


def _processes(server) -> dict[str, psutil.Process]:
    """The server's processes by name: tessera-api-1 and tessera-core (and request pools)."""
    return {p.name(): p for p in psutil.Process(server.proc.pid).children()}


def _served_by(server) -> dict[str, str]:
    """request id -> the API server ("api-0", "api-1") whose access log line answered it."""
    served = {}
    for line in server.log(None).splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("logger") == "uvicorn.access" and record.get("request_id"):
            served[record["request_id"]] = record.get("server")
    return served


def _complete(server, key: str, stream: bool) -> tuple[str, str, int]:
    """(request id, text, cached prompt tokens) of one completion on a new connection."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    body |= {"ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    url = server.base_url + "/v1/completions"
    with httpx.Client(timeout=60) as client:  # its own connection: either server may take it
        r = client.post(url, json=body, headers=bearer(key))
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    if not stream:
        payload = r.json()
        return rid, payload["choices"][0]["text"], _cached(payload["usage"])
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    (usage,) = [e["usage"] for e in events if e.get("usage")]
    return rid, text, _cached(usage)


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _success_total(metrics: str) -> float:
    pattern = r'^vllm:request_success_total\{[^}]*model_name="' + MODEL + r'"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, metrics, re.M))


def test_two_api_servers_share_one_engine(
    start_server,
    tiny_llama_dir,
    tmp_path_factory,
    adapters,  # noqa: F811 - the fixture
    offline,  # noqa: F811 - the fixture
):
    lora = ("--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"a={adapters['a']}")
    server = _start(start_server, tiny_llama_dir, tmp_path_factory, *lora)
    procs = _processes(server)
    assert {"tessera-api-1", "tessera-core"} <= set(procs), procs
    everyone = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(True)]
    key_id, key = Admin(server).create_key("scale-out")

    first = _complete(server, key, stream=False)  # fills the prefix cache, alone
    results = []
    with ThreadPoolExecutor(4) as pool:
        for round_ in range(12):  # until both servers answered (the kernel picks, per connection)
            results += pool.map(lambda i: _complete(server, key, stream=i % 2 == 0), range(8))
            if round_ >= 1 and len(set(_served_by(server).values())) == 2:
                break
    served = _served_by(server)
    assert {served[rid] for rid, _, _ in results} == {"api-0", "api-1"}, served
    # one engine, one greedy answer, whole or streamed, whichever server answered
    assert {text for _, text, _ in [first, *results]} == {first[1]} and first[1]
    # one prefix-cache salt: every request after the first hits its prefix on either server
    assert first[2] == 0 and all(cached > 0 for _, _, cached in results), results
    total = 1 + len(results)

    # any server's /metrics counts every server's requests (new connections: either answers)
    server.wait_idle()
    for _ in range(6):
        with httpx.Client(timeout=10) as client:
            assert _success_total(client.get(server.base_url + "/metrics").text) == total
    # the ledger has every request, written by both servers into the one SQLite file
    assert Admin(server).usage(key_id)["requests"] == total

    _adapters_reach_every_server(server, adapters, offline)

    # SIGTERM drains: a stream in flight finishes, then every process exits
    events: list[str] = []
    started = threading.Event()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 200, "stream": True, "ignore_eos": True}
    reader = stream_in_thread(server, body, events, started, headers=bearer(key))
    assert started.wait(60)
    server.signal(signal.SIGTERM)
    reader.join(90)
    assert not reader.is_alive() and events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=90) == 0, server.log()
    psutil.wait_procs(everyone, timeout=30)
    assert not [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_dead_api_server_stops_the_server(start_server, tiny_llama_dir, tmp_path_factory):
    server = _start(start_server, tiny_llama_dir, tmp_path_factory)
    everyone = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(True)]
    _processes(server)["tessera-api-1"].kill()
    t0 = time.monotonic()
    assert server.proc.wait(timeout=90) == 1, server.log()
    assert time.monotonic() - t0 < 90
    assert "API server tessera-api-1 exited" in server.log()
    psutil.wait_procs(everyone, timeout=30)
    assert not [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _adapters_reach_every_server(server, folders: dict, texts: dict) -> None:
    """A tenant's adapter loaded through one server is served with the offline LLM's greedy
    text by both within the sync bound (another tenant: 404; the flag's adapter and the base
    on either), and refused by both once unloaded."""
    admin = Admin(server)
    tenant = admin.request("POST", "/tenants", content=json.dumps({"name": "owner"})).json()["id"]
    _, owner = admin.create_key("owner", tenant_id=tenant)
    _, other = admin.create_key("other")

    def ask(key: str, model: str) -> tuple[int, str, str]:
        """(status, text, the server that answered) on a new connection."""
        r = complete_with(server, key, model)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else ""
        return r.status_code, text, _served_by(server)[r.headers["x-request-id"]]

    body = {"lora_name": "b", "lora_path": str(folders["b"]), "tenant_id": tenant}
    r = admin_post(server, "/v1/load_lora_adapter", body)  # vLLM's route, on either server
    assert r.status_code == 200, r.text
    loaded = time.monotonic()
    # every server serves it within the sync bound: the owner's key gets the adapter's text
    answered: dict[str, set[int]] = {"api-0": set(), "api-1": set()}
    while not all(200 in codes for codes in answered.values()):
        assert time.monotonic() - loaded < 2 * SYNC_BOUND_S, answered
        status, text, by = ask(owner, "b")
        if status == 200:
            assert text == texts["b"]
        else:  # not synced yet: an unknown model there, and only for the sync's bound
            assert status == 404 and time.monotonic() - loaded < SYNC_BOUND_S
        answered[by].add(status)
        # the flag's adapter and the base on either server; another tenant never sees "b"
        assert ask(other, "a")[:2] == (200, texts["a"])
        assert ask(other, "b")[0] == 404
    assert ask(owner, MODEL)[:2] == (200, texts[None])

    r = admin_post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200, r.text
    unloaded = time.monotonic()
    refused: set[str] = set()
    while refused != {"api-0", "api-1"}:
        assert time.monotonic() - unloaded < 2 * SYNC_BOUND_S, refused
        status, _, by = ask(owner, "b")
        if status == 200:  # a server that has not read the table since: only for the bound
            assert time.monotonic() - unloaded < SYNC_BOUND_S
        else:
            assert status == 404
            refused.add(by)


def test_an_engine_that_fails_to_load_stops_every_server(tmp_path):
    server = ServerProcess(
        [str(tmp_path / "no-such-model"), "--auth", "none", "--api-server-count", "2"],
        tmp_path / "server.log",
    )
    try:
        everyone = [psutil.Process(server.proc.pid)]
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):  # the children, as they appear
                everyone += [p for p in everyone[0].children(True) if p not in everyone]
            time.sleep(0.2)
        assert server.proc.wait(timeout=30) == 1, server.log()
        assert "no-such-model' not found" in server.log()
        assert "exited (exit code" not in server.log()  # the servers stopped, none failed
        psutil.wait_procs(everyone, timeout=30)
        assert not [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        server.stop()
