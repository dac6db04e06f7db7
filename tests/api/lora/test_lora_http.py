"""LoRA adapters over HTTP on a real server (keys mode, SQLite), two adapters written by peft
for the tiny model: `model` naming an adapter gives the offline LLM's greedy output with that
adapter (the base name the base's), /v1/models lists the adapters with `parent`, an adapter
owned by a tenant is a 404 to other tenants' keys, allowed_models applies to adapter names,
usage rows name the adapter; loading and unloading at run time through the admin API (401
without the admin token, a bad folder 400 with nothing loaded, 409 while requests run it);
a bad --lora-modules folder or --lora-modules without --enable-lora stop the start."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.api.conftest import ServerProcess
from tests.api.keys_http import (
    ADMIN_TOKEN,
    BACKENDS,
    MODEL,
    Admin,
    bearer,
    fresh_database,
    start_keys_server,
)
from tests.api.usage.test_usage_http import ledger
from tests.engine.lora.lora_testing import make_adapter

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("http-adapters")
    return {
        "a": make_adapter(tiny_llama_dir, root / "a", r=8, alpha=16, seed=1),
        "b": make_adapter(
            tiny_llama_dir, root / "b", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=2
        ),
        "big": make_adapter(tiny_llama_dir, root / "big", r=32, alpha=32, seed=3),
        "head-to-save": _with_modules_to_save(
            make_adapter(tiny_llama_dir, root / "head", targets=["lm_head"], seed=4)
        ),
    }


def _with_modules_to_save(path):
    """An LM-head adapter that also saves whole modules: refused (modules_to_save)."""
    import json

    config = path / "adapter_config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "modules_to_save": ["lm_head"]})
    )
    return path


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, adapters) -> dict[str | None, str]:
    """The offline LLM's greedy text for PROMPT: the base (None), adapter a and adapter b."""
    from engine import LLM, LoRARequest, SamplingParams

    llm = LLM(
        str(tiny_llama_dir), dtype="float32", seed=0, enable_lora=True, max_lora_rank=16,
        num_kv_blocks=128,
    )  # fmt: skip
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    loras = [None, LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))]
    outs = llm.generate([PROMPT] * 3, params, lora_request=loras, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    del llm
    return dict(zip([None, "a", "b"], texts, strict=True))


def _complete(server, key: str, model: str, **body) -> httpx.Response:
    payload = {"model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, **body}
    payload.setdefault("ignore_eos", True)
    return httpx.post(
        server.base_url + "/v1/completions", json=payload, headers=bearer(key), timeout=60
    )


def _models(server, key: str) -> dict[str, dict]:
    r = httpx.get(server.base_url + "/v1/models", headers=bearer(key), timeout=30)
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def _post(server, path: str, body: dict, token: str | None = ADMIN_TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def test_adapters_over_http(start_server, tiny_llama_dir, tmp_path, adapters, offline):
    assert len(set(offline.values())) == 3  # the adapters change the greedy text
    url = f"sqlite+aiosqlite:///{tmp_path / 'tessera.db'}"
    server = start_keys_server(
        start_server, tiny_llama_dir, tmp_path, url,
        "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
        "--lora-modules", f"pub={adapters['a']}",
    )  # fmt: skip
    admin = Admin(server)
    tenants = {}
    for name in ("t1", "t2"):
        r = admin.request("POST", "/tenants", content=json.dumps({"name": name}))
        assert r.status_code == 201, r.text
        tenants[name] = r.json()["id"]
    _, k1 = admin.create_key("k1", tenant_id=tenants["t1"])
    _, k2 = admin.create_key("k2", tenant_id=tenants["t2"])
    _, k1_base_only = admin.create_key("k1-base", tenant_id=tenants["t1"], allowed_models=[MODEL])

    # Loading at run time: the admin token only (vLLM's route and body, plus the owner).
    body = {"lora_name": "own", "lora_path": str(adapters["b"]), "tenant_id": tenants["t1"]}
    assert _post(server, "/v1/load_lora_adapter", body, token=None).status_code == 401
    assert _post(server, "/v1/load_lora_adapter", body, token=k1).status_code == 401
    r = _post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200, r.text
    assert r.json()["tenant_id"] == tenants["t1"] and r.json()["source"] == "admin"
    again = _post(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"

    # /v1/models: vLLM's shape; another tenant's adapter is not listed; allowed_models apply.
    models = _models(server, k1)
    assert set(models) == {MODEL, "pub", "own"}
    assert models["pub"]["parent"] == MODEL and models["pub"]["root"] == str(adapters["a"])
    assert models["own"]["parent"] == MODEL and models[MODEL]["parent"] is None
    assert set(_models(server, k2)) == {MODEL, "pub"}
    assert set(_models(server, k1_base_only)) == {MODEL}

    # The adapter's output is the offline LLM's with that adapter; the base name the base's.
    for model, expected in ((MODEL, offline[None]), ("pub", offline["a"]), ("own", offline["b"])):
        r = _complete(server, k1, model)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected, model
        assert r.json()["model"] == model
    chat = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": "own", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=bearer(k1),
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["model"] == "own", chat.text
    messages = httpx.post(
        server.base_url + "/v1/messages",
        json={"model": "pub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=bearer(k2),
        timeout=60,
    )
    assert messages.status_code == 200 and messages.json()["model"] == "pub", messages.text

    # Another tenant's adapter answers as an unknown model does; allowed_models: 403.
    unknown = _complete(server, k2, "no-such-model")
    owned = _complete(server, k2, "own")
    assert owned.status_code == unknown.status_code == 404
    assert owned.json()["error"]["code"] == unknown.json()["error"]["code"] == "model_not_found"
    assert _complete(server, k2, "pub").status_code == 200
    assert _complete(server, k1_base_only, "pub").status_code == 403
    assert _complete(server, k1_base_only, MODEL).status_code == 200

    # A bad folder: 400 naming the field, nothing loaded.
    bad = {"lora_name": "big", "lora_path": str(adapters["big"])}
    r = _post(server, "/admin/v1/lora_adapters", bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert "r: rank 32 is above max_lora_rank (16)" in r.json()["error"]["message"]
    r = _post(server, "/admin/v1/lora_adapters", {**bad, "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"], r.text
    r = _post(server, "/admin/v1/lora_adapters", {**bad, "lora_path": str(adapters["a"]),
                                                  "tenant_id": "nope"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant_id", r.text
    r = _post(server, "/admin/v1/lora_adapters", {**bad, "lora_path": str(adapters["head-to-save"])})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert "modules_to_save: ['lm_head'] is not supported" in r.json()["error"]["message"]
    listed = admin.request("GET", "/lora_adapters").json()["data"]
    assert {a["name"] for a in listed} == {"pub", "own"}
    assert _complete(server, k1, "big").status_code == 404

    # Unloading an adapter in use: 409 while the request runs, then it goes.
    events: list[str] = []
    started = threading.Event()
    stream_body = {"model": "own", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True,
                   "stream": True}  # fmt: skip

    def stream() -> None:
        with httpx.stream(
            "POST", server.base_url + "/v1/completions", json=stream_body, headers=bearer(k1),
            timeout=120,
        ) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    busy = _post(server, "/v1/unload_lora_adapter", {"lora_name": "own"})
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    thread.join(120)
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"]["code"] == "adapter_in_use"
    assert 'running_lora_adapters="own"' in metrics and "vllm:lora_requests_info{" in metrics
    assert events[-1] == "data: [DONE]"
    assert (
        _post(server, "/v1/unload_lora_adapter", {"lora_name": "own"}, token=None).status_code
        == 401
    )
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "own"})
    assert r.status_code == 200, r.text
    assert _complete(server, k1, "own").status_code == 404
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "own"}).status_code == 404
    r = httpx.delete(server.base_url + "/admin/v1/lora_adapters/pub", headers=bearer(ADMIN_TOKEN))
    assert r.status_code == 200 and set(_models(server, k1)) == {MODEL}

    # The usage rows name the adapter (model: what the client asked for).
    deadline = time.monotonic() + 10
    while True:
        rows = [r for r in ledger(url).values() if r.status_code == 200]
        named = {(r.model, r.lora_adapter) for r in rows}
        if {("pub", "pub"), ("own", "own"), (MODEL, None)} <= named or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {("pub", "pub"), ("own", "own"), (MODEL, None)} <= named
    assert all(r.lora_adapter == (None if r.model == MODEL else r.model) for r in rows)
    # Charged to the key's tenant as for the base model (quotas, fair share, the ledger).
    assert {r.tenant_id for r in rows if r.lora_adapter == "own"} == {tenants["t1"]}
    assert tenants["t2"] in {r.tenant_id for r in rows if r.lora_adapter == "pub"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loaded_adapter_and_its_owner_survive_a_restart(
    start_server, tiny_llama_dir, tmp_path, adapters, backend
):
    with fresh_database(backend, tmp_path) as url:
        _restart(start_server, tiny_llama_dir, tmp_path, adapters, url)


def _restart(start_server, tiny_llama_dir, tmp_path, adapters, url: str) -> None:
    args = ("--enable-lora", "--max-lora-rank", "16")
    server = start_keys_server(start_server, tiny_llama_dir, tmp_path, url, *args)
    admin = Admin(server)
    r = admin.request("POST", "/tenants", content=json.dumps({"name": "owner"}))
    tenant = r.json()["id"]
    _, owner = admin.create_key("owner", tenant_id=tenant)
    _, other = admin.create_key("other")
    body = {"lora_name": "kept", "lora_path": str(adapters["a"]), "tenant_id": tenant}
    assert _post(server, "/admin/v1/lora_adapters", body).status_code == 201
    server.stop()
    server = start_keys_server(start_server, tiny_llama_dir, tmp_path, url, *args)
    assert _complete(server, owner, "kept").status_code == 200
    assert _complete(server, other, "kept").status_code == 404
    server.stop()  # before the database goes


def _start_fails(tiny_llama_dir, tmp_path, *args: str) -> str:
    server = ServerProcess(
        [str(tiny_llama_dir), "--dtype", "float32", "--auth", "none", *args],
        tmp_path / f"server-{len(list(tmp_path.iterdir()))}.log",
    )
    try:
        assert server.proc.wait(timeout=180) != 0
        return server.log()
    finally:
        server.stop()


def test_start_up_errors(tiny_llama_dir, tmp_path, adapters):
    log = _start_fails(tiny_llama_dir, tmp_path, "--lora-modules", f"a={adapters['a']}")
    assert "--lora-modules (a) needs --enable-lora" in log
    log = _start_fails(
        tiny_llama_dir, tmp_path, "--enable-lora", "--max-lora-rank", "16",
        "--lora-modules", json.dumps({"name": "big", "path": str(adapters["big"])}),
    )  # fmt: skip
    assert "--lora-modules big:" in log and "r: rank 32 is above max_lora_rank (16)" in log
