"""Prefix affinity across replicas (`tessera bench affinity`): two `tessera serve` replicas on
one Postgres behind nginx, the shipped deploy/nginx/nginx.conf (consistent hashing by
tenant) against the same file with its `hash` line removed (nginx's round robin).

    tessera bench affinity [--model M] [--tenants 16] [--system-words 500] [--turns 4]
                           [--concurrency 4] [--num-kv-blocks 420] [--rounds 2]

Each of the tenants has its own API key and its own ~500-token system prompt; each request is
a streamed chat completion of that system prompt and a distinct user turn, tenants shuffled.
Both replicas' KV caches are sized to hold a bit more than half the tenants' prefixes (the
situation affinity is for: one replica cannot keep every tenant warm). Rounds alternate round
robin and affinity on the same replicas, each with a fresh set of system prompts (so a round
starts cold, and what the previous round cached is evicted as it goes). Printed per mode:
prefix-cache hit rate (cached prompt tokens over prompt tokens, from the responses' usage)
and TTFT p50 / p99 through nginx; then the affinity / round-robin ratios.

Needs the repository checkout (deploy/nginx/nginx.conf), Debian's nginx and a Postgres at
--pg-dsn (default 127.0.0.1:5432, database `test`, used only to create and drop a fresh one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from benchmarks.bench_auth import _free_port, database, server
from benchmarks.bench_serve import WORDS

REPO = Path(__file__).resolve().parents[1]
NGINX_CONF = REPO / "deploy" / "nginx" / "nginx.conf"
HASH_LINE = r"^\s*hash \$tessera_affinity consistent;\n"


def _sub(text: str, pattern: str, repl: str) -> str:
    out, n = re.subn(pattern, repl, text, flags=re.M)
    if n != 1:
        raise RuntimeError(f"{NGINX_CONF}: expected one match of {pattern!r}, found {n}")
    return out


def render_nginx_config(
    upstreams: dict[str, int], listen: int, tmp: Path, affinity: bool = True
) -> str:
    """deploy/nginx/nginx.conf for loopback: the upstream servers and the listen port on
    127.0.0.1, pid/temp/log paths in tmp; without `affinity`, the hash line removed (round
    robin). Each rewrite must match exactly once, so a change of the file's shape is loud."""
    text = NGINX_CONF.read_text()
    for host, port in upstreams.items():
        text = _sub(text, rf"^(\s*server ){re.escape(host)}:8000\b", rf"\g<1>127.0.0.1:{port}")
    text = _sub(text, r"^(\s*listen )8080;", rf"\g<1>127.0.0.1:{listen};")
    text = _sub(text, r"^pid /tmp/nginx\.pid;", f"pid {tmp}/nginx.pid;")
    text = _sub(text, r"access_log /dev/stdout tessera;", f"access_log {tmp}/access.log tessera;")
    text, n = re.subn(r"/tmp/nginx-", f"{tmp}/nginx-", text)
    if n != 5:
        raise RuntimeError(f"{NGINX_CONF}: expected 5 temp paths, found {n}")
    if not affinity:
        text = _sub(text, HASH_LINE, "")
    if os.geteuid() == 0:  # workers must read the temp dirs root creates
        text = "user root;\n" + text
    return text


def nginx_binary() -> str | None:
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )


@contextlib.contextmanager
def nginx(upstreams: dict[str, int], tmp: Path, affinity: bool) -> Iterator[str]:
    import httpx

    binary = nginx_binary()
    if binary is None:
        raise SystemExit("nginx is not installed (Debian: apt-get install -y nginx)")
    tmp.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(render_nginx_config(upstreams, port, tmp, affinity))
    with open(tmp / "error.log", "wb") as err:
        proc = subprocess.Popen(
            [binary, "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"],
            stdout=err,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.TransportError):
                    httpx.get(base + "/version", timeout=2)
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not start: {(tmp / 'error.log').read_text()}")
                time.sleep(0.1)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def system_prompt(rng: random.Random, words: int, tenant: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the assistant of tenant {tenant}. House rules follow. {body}"


async def one_request(client, base: str, key: str, model: str, system: str, user: str, out):
    """A streamed chat completion: TTFT at the first content chunk; usage at the end."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with client.stream(
        "POST",
        base + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    out.append((ttft, usage["prompt_tokens"], cached))


async def run_round(base: str, keys: list[str], args: argparse.Namespace, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    systems = [system_prompt(rng, args.system_words, t) for t in range(len(keys))]
    jobs = [
        (t, f"Question {j} of tenant {t}: {' '.join(rng.choice(WORDS) for _ in range(12))}?")
        for t in range(len(keys))
        for j in range(args.turns)
    ]
    rng.shuffle(jobs)
    results: list[tuple[float, int, int]] = []
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(limits=limits) as client:

        async def job(t: int, user: str) -> None:
            async with sem:
                await one_request(client, base, keys[t], args.model_name, systems[t], user, results)

        await asyncio.gather(*(job(t, u) for t, u in jobs))
    ttfts = sorted(r[0] for r in results)
    return {
        "hit_rate": sum(r[2] for r in results) / sum(r[1] for r in results),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))],
        "requests": len(results),
        "ttfts": ttfts,
    }


async def _create_keys(url: str, n: int) -> list[str]:
    from api.db.session import Database
    from api.keys.service import KeyService

    db = Database.from_url(url)
    try:
        return [(await KeyService(db).create(f"tenant-{i}"))[1] for i in range(n)]
    finally:
        await db.dispose()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench affinity", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument(
        "--system-words", type=int, default=500, help="words (~tokens) per system prompt"
    )
    p.add_argument("--turns", type=int, default=4, help="requests per tenant per round")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=420,
        help="KV blocks per replica (default: a bit more than half the tenants' prefixes)",
    )
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=int, default=2, help="round robin / affinity pairs")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--json", default=None, help="write the results to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.model_name = "bench"
    if not NGINX_CONF.is_file():
        raise SystemExit(f"{NGINX_CONF} is missing: run from a checkout of the repository")
    from api.cli.main import main as tessera

    with tempfile.TemporaryDirectory(prefix="tessera-bench-affinity-") as t:
        tmp = Path(t)
        with database("postgres", tmp, args.pg_dsn) as url:
            assert url is not None
            if tessera(["db", "upgrade", "--database-url", url]) != 0:
                return 1
            keys = asyncio.run(_create_keys(url, args.tenants))
            common = [
                args.model, "--served-model-name", args.model_name, "--database-url", url,
                "--admin-token", uuid.uuid4().hex, "--num-kv-blocks", str(args.num_kv_blocks),
                "--max-model-len", str(args.max_model_len), "--num-threads", str(args.threads), "--dtype", args.dtype,
            ]  # fmt: skip
            with contextlib.ExitStack() as stack:
                bases = [
                    stack.enter_context(
                        server([*common, "--data-dir", str(tmp / n)], tmp / f"{n}.log")
                    )
                    for n in ("a", "b")
                ]
                ports = {
                    "tessera-a": int(bases[0].rsplit(":", 1)[1]),
                    "tessera-b": int(bases[1].rsplit(":", 1)[1]),
                }
                by_mode: dict[str, list[dict]] = {"round_robin": [], "affinity": []}
                for r in range(args.rounds):
                    for mode in ("round_robin", "affinity"):
                        with nginx(ports, tmp / f"nginx-{mode}-{r}", mode == "affinity") as base:
                            res = asyncio.run(
                                run_round(base, keys, args, seed=1000 * r + len(mode))
                            )
                        by_mode[mode].append(res)
                        print(
                            f"round {r + 1} {mode:<12} hit rate {res['hit_rate']:.3f}  "
                            f"TTFT p50 {res['ttft_p50'] * 1000:7.1f} ms  "
                            f"p99 {res['ttft_p99'] * 1000:7.1f} ms  ({res['requests']} requests)",
                            flush=True,
                        )
    summary = {}
    for mode, rounds in by_mode.items():
        ttfts = sorted(x for r in rounds for x in r["ttfts"])
        summary[mode] = {
            "hit_rate": statistics.fmean(r["hit_rate"] for r in rounds),
            "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "ttft_p99_ms": ttfts[int(round(0.99 * (len(ttfts) - 1)))] * 1000,
        }
    rr, aff = summary["round_robin"], summary["affinity"]
    print(
        f"round robin: hit rate {rr['hit_rate']:.3f}, TTFT p50 {rr['ttft_p50_ms']:.1f} ms, "
        f"p99 {rr['ttft_p99_ms']:.1f} ms\n"
        f"affinity:    hit rate {aff['hit_rate']:.3f}, TTFT p50 {aff['ttft_p50_ms']:.1f} ms, "
        f"p99 {aff['ttft_p99_ms']:.1f} ms\n"
        f"affinity / round robin: hit rate {aff['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, "
        f"TTFT p50 {aff['ttft_p50_ms'] / rr['ttft_p50_ms']:.2f}x, "
        f"p99 {aff['ttft_p99_ms'] / rr['ttft_p99_ms']:.2f}x"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
