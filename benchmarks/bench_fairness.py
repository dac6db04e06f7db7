"""Two tenants on one server, FCFS against fair scheduling (`tessera bench fairness`).

    tessera bench fairness [--model M] [--max-num-seqs 16] [--heavy-concurrency 64]
                           [--light-concurrency 2] [--duration 40] [--rounds 1]

Two `tessera serve` processes in keys mode, one per policy (--scheduling-policy fcfs and
fair), each with two API keys (each key is its own tenant). A heavy tenant keeps
--heavy-concurrency long streaming requests in flight (closed loop, --heavy-input words in,
--heavy-output tokens out); a light tenant keeps --light-concurrency short ones in flight.
Per server: the light tenant alone first (its solo TTFT and tokens/s), then both together
for --duration seconds after --warmup. Printed per policy: the light tenant's TTFT p50/p99
(from send to first content chunk; a request still waiting when the window closes counts
with its wait so far, a lower bound, and is reported as `censored`), its tokens/s and share
of the generated tokens, and the total generated tokens/s. Token counts come from the
server's tessera:generation_tokens_by_tenant counters scraped at the window's edges.
Rounds alternate the order of the two servers so that drifting machine load biases neither.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from benchmarks.bench_auth import server
from benchmarks.bench_serve import _pct, make_prompts, send_request

ADMIN = "tsa-bench-fairness"
MODEL = "bench"
POLICIES = ("fcfs", "fair")


@dataclass(slots=True)
class Phase:
    ttft_ms: list[float] = field(default_factory=list)
    censored: int = 0  # light requests still without a first token at the window's end
    light_tokens: float = 0.0
    heavy_tokens: float = 0.0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def light_tps(self) -> float:
        return self.light_tokens / self.seconds if self.seconds else 0.0

    @property
    def total_tps(self) -> float:
        return (self.light_tokens + self.heavy_tokens) / self.seconds if self.seconds else 0.0

    @property
    def light_share(self) -> float:
        total = self.light_tokens + self.heavy_tokens
        return self.light_tokens / total if total else 0.0


@dataclass(slots=True)
class Target:
    policy: str
    base: str
    keys: dict[str, tuple[str, str]]  # tenant -> (key id, key)
    solo: list[Phase] = field(default_factory=list)
    mixed: list[Phase] = field(default_factory=list)


def _create_key(base: str, name: str) -> tuple[str, str]:
    r = httpx.post(
        f"{base}/admin/v1/keys",
        json={"name": name},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["id"], r.json()["key"]


def _generated(base: str, key_id: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    m = re.search(
        rf'^tessera:generation_tokens_by_tenant_total\{{[^}}]*tenant="{key_id}"[^}}]*\}} (\S+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def _wait_idle(base: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = httpx.get(
            f"{base}/admin/v1/engine", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
        ).json()
        if s.get("num_running") == 0 and s.get("num_waiting") == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{base}: the engine did not go idle")


async def _closed_loop(
    session: aiohttp.ClientSession,
    base: str,
    key: str,
    prompts: list[str],
    max_tokens: int,
    worker: int,
    concurrency: int,
    on_send=None,
    on_result=None,
) -> None:
    """Send requests back to back (prompts worker, worker + concurrency, ...) until cancelled."""
    headers = {"Authorization": f"Bearer {key}"}
    i = worker
    while True:
        body = {
            "model": MODEL,
            "prompt": prompts[i % len(prompts)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        token = on_send() if on_send else None
        if on_send and token is None:  # the window closed
            return
        result = await send_request(session, f"{base}/v1/completions", body, headers, False)
        if on_result:
            on_result(token, result)
        i += concurrency


async def _phase(t: Target, args: argparse.Namespace, with_heavy: bool, seconds: float) -> Phase:
    phase = Phase()
    light_prompts = make_prompts(256, args.light_input, seed=1)
    heavy_prompts = make_prompts(512, args.heavy_input, seed=2)
    light_id, light_key = t.keys["light"]
    heavy_id, heavy_key = t.keys["heavy"]
    pending: dict[int, float] = {}  # light requests in flight without a first token: start
    counter = iter(range(10**9))
    window: list[float] = []  # [start] once the measured window opened
    closed: list[bool] = []  # [True] once it closed: light workers stop sending

    def on_send() -> int | None:
        if closed:
            return None
        n = next(counter)
        pending[n] = time.perf_counter()
        return n

    def on_result(n: int | None, result) -> None:
        if n is None:
            return
        started = pending.pop(n)
        if not window or started < window[0]:
            return  # sent before the window: warm-up
        if result.ok:
            phase.ttft_ms.append(result.ttft * 1000)
        else:
            phase.errors.append(result.error)

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        tasks = []
        if with_heavy:
            for w in range(args.heavy_concurrency):
                tasks.append(
                    asyncio.ensure_future(
                        _closed_loop(
                            session,
                            t.base,
                            heavy_key,
                            heavy_prompts,
                            args.heavy_output,
                            w,
                            args.heavy_concurrency,
                        )
                    )
                )
            await asyncio.sleep(args.warmup)  # the heavy tenant's queue builds up
        light0 = await asyncio.to_thread(_generated, t.base, light_id)
        heavy0 = await asyncio.to_thread(_generated, t.base, heavy_id)
        window.append(time.perf_counter())
        for w in range(args.light_concurrency):
            tasks.append(
                asyncio.ensure_future(
                    _closed_loop(
                        session,
                        t.base,
                        light_key,
                        light_prompts,
                        args.light_output,
                        w,
                        args.light_concurrency,
                        on_send,
                        on_result,
                    )
                )
            )
        await asyncio.sleep(seconds)
        end = time.perf_counter()
        light1 = await asyncio.to_thread(_generated, t.base, light_id)
        heavy1 = await asyncio.to_thread(_generated, t.base, heavy_id)
        # Light requests sent in the window and still running: wait (the heavy load goes on)
        # for their TTFTs, up to another window; those still waiting count as a lower bound.
        closed.append(True)
        cap = time.perf_counter() + seconds
        while any(s >= window[0] for s in pending.values()) and time.perf_counter() < cap:
            await asyncio.sleep(0.05)
        now = time.perf_counter()
        for started in pending.values():
            if started >= window[0]:
                phase.ttft_ms.append((now - started) * 1000)
                phase.censored += 1
        pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    phase.seconds = end - window[0]
    phase.light_tokens = light1 - light0
    phase.heavy_tokens = heavy1 - heavy0
    return phase


def _run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _pooled(phases: list[Phase]) -> Phase:
    out = Phase()
    for p in phases:
        out.ttft_ms += p.ttft_ms
        out.censored += p.censored
        out.light_tokens += p.light_tokens
        out.heavy_tokens += p.heavy_tokens
        out.seconds += p.seconds
        out.errors += p.errors
    return out


def report(targets: list[Target], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    print(
        f"\nheavy: {args.heavy_concurrency} x ({args.heavy_input} words in, "
        f"{args.heavy_output} tokens out); light: {args.light_concurrency} x "
        f"({args.light_input} words in, {args.light_output} out); --max-num-seqs "
        f"{args.max_num_seqs}; {args.rounds} round(s) of {args.duration:.0f} s"
    )
    header = (
        f"{'policy':<6} {'phase':<6} {'light TTFT p50':>15} {'p99':>9} {'light tok/s':>12} "
        f"{'light share':>12} {'total tok/s':>12}  notes"
    )
    print(header)
    figures: dict[str, dict[str, float]] = {}
    for t in targets:
        solo, mixed = _pooled(t.solo), _pooled(t.mixed)
        for name, p in (("alone", solo), ("mixed", mixed)):
            notes = []
            if p.censored:
                notes.append(f"{p.censored} censored (still waiting)")
            if p.errors:
                notes.append(f"{len(p.errors)} errors: {p.errors[0][:80]}")
            share = f"{p.light_share:12.1%}" if name == "mixed" else f"{'':>12}"
            print(
                f"{t.policy:<6} {name:<6} {_pct(p.ttft_ms, 50):12.0f} ms {_pct(p.ttft_ms, 99):6.0f} "
                f"ms {p.light_tps:12.1f} {share} {p.total_tps:12.1f}  {'; '.join(notes)}"
            )
        figures[t.policy] = {
            "solo_p50": _pct(solo.ttft_ms, 50),
            "solo_p99": _pct(solo.ttft_ms, 99),
            "p50": _pct(mixed.ttft_ms, 50),
            "p99": _pct(mixed.ttft_ms, 99),
            "light_tps": mixed.light_tps,
            "solo_tps": solo.light_tps,
            "share": mixed.light_share,
            "total_tps": mixed.total_tps,
            "light_requests": len(mixed.ttft_ms),
        }
    if "fcfs" in figures and "fair" in figures:
        fcfs, fair = figures["fcfs"], figures["fair"]
        solo_p99 = statistics.fmean([fcfs["solo_p99"], fair["solo_p99"]])
        solo_tps = statistics.fmean([fcfs["solo_tps"], fair["solo_tps"]])
        print(
            f"fair vs fcfs: light TTFT p99 {fair['p99'] / solo_p99:.1f}x solo (fcfs "
            f"{fcfs['p99'] / solo_p99:.1f}x); light tok/s {fair['light_tps'] / solo_tps:.0%} of "
            f"solo (fcfs {fcfs['light_tps'] / solo_tps:.0%}); total tok/s "
            f"{fair['total_tps'] / fcfs['total_tps']:.1%} of fcfs"
        )
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tessera bench fairness", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--heavy-concurrency", type=int, default=64)
    p.add_argument("--heavy-input", type=int, default=128, help="words per heavy prompt")
    p.add_argument("--heavy-output", type=int, default=64, help="tokens per heavy request")
    p.add_argument("--light-concurrency", type=int, default=2)
    p.add_argument("--light-input", type=int, default=32, help="words per light prompt")
    p.add_argument("--light-output", type=int, default=8, help="tokens per light request")
    p.add_argument("--duration", type=float, default=40.0, help="seconds measured, per phase")
    p.add_argument("--solo-duration", type=float, default=10.0, help="light alone, seconds")
    p.add_argument("--warmup", type=float, default=5.0, help="heavy alone before the window")
    p.add_argument("--rounds", type=int, default=1, help="alternating fcfs/fair rounds")
    p.add_argument("--policies", default="fcfs,fair", help="comma-separated")
    p.add_argument("--server-arg", action="append", default=[], help="extra `tessera serve` flag")
    args = p.parse_args(argv)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not set(policies) <= set(POLICIES) or not policies:
        p.error(f"--policies: choose from {', '.join(POLICIES)}")

    common = [args.model, "--served-model-name", MODEL, "--max-num-seqs", str(args.max_num_seqs)]
    common += ["--log-level", "warning", "--admin-token", ADMIN, *args.server_arg]
    common += ["--metrics-tenant-label", "id"]  # the *_by_tenant series it scrapes (opt-in)
    with tempfile.TemporaryDirectory(prefix="tessera-bench-fair-") as tmpdir:
        tmp = Path(tmpdir)
        with contextlib.ExitStack() as stack:
            targets = []
            for policy in policies:
                extra = ["--scheduling-policy", policy, "--data-dir", str(tmp / policy)]
                base = stack.enter_context(server(common + extra, tmp / f"{policy}.log"))
                keys = {name: _create_key(base, name) for name in ("heavy", "light")}
                targets.append(Target(policy, base, keys))
            for r in range(args.rounds):
                for t in targets if r % 2 == 0 else targets[::-1]:
                    print(f"round {r + 1}: {t.policy} ...", flush=True)
                    t.solo.append(_run(_phase(t, args, False, args.solo_duration)))
                    _wait_idle(t.base)
                    t.mixed.append(_run(_phase(t, args, True, args.duration)))
                    _wait_idle(t.base)
            report(targets, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
