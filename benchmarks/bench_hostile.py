"""What hostile request bodies cost other clients (`tessera bench hostile`).

    tessera bench hostile [--model M] [--clients 4] [--requests 40] [--max-tokens 16]
                          [--baseline-tree PATH] [--tessera-args "..."]

One `tessera serve --auth none` on loopback. Clean load: --clients closed-loop clients, each
sending --requests short chat completions (--max-tokens tokens, ignore_eos), one after the
other. Measured twice on the same server: the clean load alone, then the clean load while a
probe client sends issue 38's worst bodies in turn, each as soon as the last was answered:

    messages   120,000 one-word messages (~4 MB)                 cannot fit any context
    tools      200 tools with 15,000-character descriptions     cannot fit any context
    fits       as many one-word messages as fit the context     templated, then too long
    tokenize   /tokenize of a 3 MB prompt                        tokenized (no context)

Printed: the clean requests' latency p50 / p99 / max in both phases and their ratio, and the
probe's bodies answered and their mean time. --baseline-tree PATH runs the same first from
another checkout (e.g. a `git worktree` of an older commit): before and after in one run.
Servers listen on 127.0.0.1 only and are always stopped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import httpx

from benchmarks.bench_compare import ROOT, TesseraServer, sigterm_as_interrupt
from benchmarks.bench_serve import _pct

PROBES = ("messages", "tools", "fits", "tokenize")


def probe_bodies(model: str, max_model_len: int) -> list[tuple[str, str, bytes]]:
    """(name, path, body) of each probe body."""
    one = b'{"role":"user","content":"hi"},'

    def chat(n: int) -> bytes:
        return (
            b'{"model":"%s","max_tokens":1,"messages":[' % model.encode()
            + one * (n - 1)
            + b'{"role":"user","content":"hi"}]}'
        )

    tools = [
        {
            "type": "function",
            "function": {"name": f"f{i}", "description": "word " * 3_000, "parameters": {}},
        }
        for i in range(200)
    ]
    tools_body = {
        "model": model,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
    }
    tokenize = {"model": model, "prompt": "word " * 600_000}
    return [
        ("messages", "/v1/chat/completions", chat(120_000)),
        ("tools", "/v1/chat/completions", json.dumps(tools_body).encode()),
        ("fits", "/v1/chat/completions", chat(max_model_len - 8)),
        ("tokenize", "/tokenize", json.dumps(tokenize).encode()),
    ]


def clean_client(base: str, model: str, n: int, max_tokens: int, out: list[float]) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=base, timeout=300) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            out.append(time.perf_counter() - t0)


def clean_phase(base: str, model: str, args: argparse.Namespace) -> list[float]:
    latencies: list[float] = []
    threads = [
        threading.Thread(
            target=clean_client, args=(base, model, args.requests, args.max_tokens, latencies)
        )
        for _ in range(args.clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def probe_client(base: str, bodies: list, stop: threading.Event, seen: dict) -> None:
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=base, timeout=600) as c:
        i = 0
        while not stop.is_set():
            name, path, body = bodies[i % len(bodies)]
            t0 = time.perf_counter()
            r = c.post(path, content=body, headers=headers)
            seen.setdefault(name, []).append((r.status_code, time.perf_counter() - t0))
            i += 1


def measure(base: str, args: argparse.Namespace) -> dict:
    info = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]
    model, max_model_len = info["id"], info.get("max_model_len") or 2048
    bodies = [b for b in probe_bodies(model, max_model_len) if b[0] in args.probes]
    clean_phase(base, model, argparse.Namespace(**{**vars(args), "requests": 2}))  # warm
    alone = clean_phase(base, model, args)
    stop, seen = threading.Event(), {}
    probe = threading.Thread(target=probe_client, args=(base, bodies, stop, seen))
    probe.start()
    try:
        during = clean_phase(base, model, args)
    finally:
        stop.set()
        probe.join()
    return {"alone": alone, "during": during, "probe": seen}


def summary(lat: list[float]) -> dict:
    ms = [x * 1000 for x in lat]
    return {"p50": _pct(ms, 50), "p99": _pct(ms, 99), "max": max(ms), "n": len(ms)}


def print_result(label: str, result: dict) -> None:
    alone, during = summary(result["alone"]), summary(result["during"])
    print(f"\n## {label}")
    print("| clean requests | p50 ms | p99 ms | max ms | n |")
    print("|---|---:|---:|---:|---:|")
    for name, s in (("alone", alone), ("with the probe", during)):
        print(f"| {name} | {s['p50']:.0f} | {s['p99']:.0f} | {s['max']:.0f} | {s['n']} |")
    print(
        f"| ratio | {during['p50'] / alone['p50']:.2f}x | {during['p99'] / alone['p99']:.2f}x | | |"
    )
    print("\n| probe body | answered | statuses | mean s |")
    print("|---|---:|---|---:|")
    for name, seen in result["probe"].items():
        statuses = ",".join(str(s) for s in sorted({s for s, _ in seen}))
        mean = statistics.mean(t for _, t in seen)
        print(f"| {name} | {len(seen)} | {statuses} | {mean:.2f} |")


def run_server(root: Path, args: argparse.Namespace, extra: list[str]) -> dict:
    with TesseraServer(args.model, args.threads, 64, extra, root=root) as base:
        return measure(base, args)


def build_parser() -> argparse.ArgumentParser:
    from engine.config import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="tessera bench hostile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=40, help="clean requests per client")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="the server's --num-threads")
    p.add_argument("--probes", nargs="+", default=list(PROBES), choices=PROBES)
    p.add_argument("--baseline-tree", type=Path, help="another checkout, measured first")
    p.add_argument("--tessera-args", default="", help="extra `tessera serve` arguments")
    p.add_argument("--json", type=Path, help="write the raw results here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    extra = args.tessera_args.split()
    print(
        f"# tessera bench hostile, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"{platform.processor() or platform.machine()}, model {args.model}, "
        f"{args.clients} clients x {args.requests} requests of {args.max_tokens} tokens"
    )
    results = {}
    with sigterm_as_interrupt():
        if args.baseline_tree is not None:
            results["baseline"] = run_server(args.baseline_tree.resolve(), args, extra)
            print_result(f"baseline ({args.baseline_tree})", results["baseline"])
        results["current"] = run_server(ROOT, args, extra)
        print_result("this tree", results["current"])
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
