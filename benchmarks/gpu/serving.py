"""§10 serving: `tessera serve` on §4's model (dummy weights) against the bench-serve client
(`tessera bench serve`: streaming completions of random prompts, ignore_eos), at each
concurrency of the plan, a server for each of the plan's modes (the engine on a thread; in a
process of its own, --engine-process): output tok/s, TTFT and ITL p50 / p99; then the top
concurrency's requests through LLM's own loop in this process, and each server's share of
that offline figure (issue 46's goal: >= 90% at 256 streams). Where the one event loop (and
the engine thread beside it, one GIL) is the limit, the shares say so.

The device machine has no web stack: gpu_session.sh installs it from the wheels that
benchmarks/gpu_wheels.sh downloads here (carried as .whl); without them the section says what
is missing and measures nothing."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.gpu.check import Check
from benchmarks.gpu.measure import free_memory
from benchmarks.gpu.plan import SERVE_SHARE_GOAL
from benchmarks.gpu.report import SKIPPED, Budget, BudgetSpent, Report, goal_mark, progress

# what `tessera serve` imports beyond the engine's own stack
WEB_STACK = ("litestar", "msgspec", "uvicorn", "httptools", "sqlalchemy", "aiosqlite", "alembic")


# how the server holds its engine: on a thread of its own, or in a child process
SERVE_MODES = {
    "thread": "engine thread",
    "process": "engine process",
    "api2": "2 API servers",
    "api4": "4 API servers",
}


def mode_flags(mode: str) -> tuple[str, ...]:
    """A serve mode's `tessera serve` flags: the engine on a thread, in a process of its own,
    or N API server processes in front of one (apiN: --api-server-count N)."""
    if mode == "process":
        return ("--engine-process",)
    if mode.startswith("api"):
        return ("--api-server-count", mode[3:])
    return ()


def missing_web_stack() -> list[str]:
    def absent(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except ValueError:  # in sys.modules as None: blocked
            return True

    return [m for m in WEB_STACK if absent(m)]


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) a process and its descendants have used so far, read from
    /proc (Linux); None where there is no /proc. The server's cost per streamed token, apart
    from the client's: on a small host they share the cores, so tok/s alone mixes the two."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: the stat's 14th, 15th
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            if p == pid:
                return None  # a child that ended meanwhile is only a child less
    return total / tick


def split_cpus() -> tuple[set[int], set[int]] | None:
    """This process's CPUs in two: the server's (the first half) and the client's (the rest);
    None with fewer than two. Pinned apart, the server's figure and its offline baseline are
    both on the same cores, whatever the client costs (on a two-core host it takes about a
    core of its own, which unpinned it takes from the server)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def _pinning(
    pin: bool, server_args: tuple[str, ...]
) -> tuple[tuple[set[int], set[int]] | None, tuple[str, ...]]:
    """(split_cpus() where pinned, else None; the server's flags with as many torch threads
    as its CPUs)."""
    cpus = split_cpus() if pin else None
    if cpus is None:
        return None, server_args
    server, client = cpus
    progress(
        f"§10 pinned: the server and offline on CPUs {sorted(server)}, the client on {sorted(client)}"
    )
    return cpus, (*server_args, "--num-threads", str(len(server)))


def _client_run(proc: subprocess.Popen, args: argparse.Namespace, what: str) -> dict:
    """One bench-serve client run against `proc`'s server: its summary, with the server's CPU
    a token (`server_cpu_us_per_token`, where /proc tells); raises if a request failed."""
    from benchmarks.bench_serve import _run_loop, run

    cpu = tree_cpu_seconds(proc.pid)
    s = _run_loop(run(args))
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed {what}: {s['errors']}")
    if cpu is not None and (after := tree_cpu_seconds(proc.pid)) is not None:
        s["server_cpu_us_per_token"] = (after - cpu) / max(s["total_output_tokens"], 1) * 1e6
    return s


@contextlib.contextmanager
def _on_cpus(cpus: set[int] | None, threads: bool = False):
    """This process (and what it starts meanwhile) on `cpus`; `threads`: torch's intra-op
    threads as many. Both restored after."""
    if cpus is None:
        yield
        return
    import torch

    before, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    if threads:
        torch.set_num_threads(len(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(before_threads)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_options(chk: Check, attention_backend: str | None) -> dict:
    """The server's and the offline engine's options: §4's (dummy weights, bf16), the top
    concurrency as max_num_seqs."""
    p = chk.plan
    options = dict(
        load_format="dummy", dtype="bfloat16", seed=0, device=chk.device.type,
        max_num_seqs=max(p.serve_concurrency), max_num_batched_tokens=p.chunk,
    )  # fmt: skip
    if attention_backend is not None:
        options["attention_backend"] = attention_backend
    if p.kv_cache_memory is not None:
        options["kv_cache_memory"] = p.kv_cache_memory
    return options


def serve_command(folder: Path, port: int, options: dict) -> list[str]:
    """`tessera serve` with the engine's options, no auth, on loopback."""
    cmd = [sys.executable, "-m", "api.cli.main", "serve", str(folder), "--auth", "none"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    for name, value in options.items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd


def _wait_ready(proc: subprocess.Popen, url: str, budget: Budget, log: Path) -> float:
    t = time.perf_counter()
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:]
            raise RuntimeError(
                f"the server exited ({proc.returncode}) before it was ready:\n{tail}"
            )
        if budget.spent:
            raise BudgetSpent("the server did not start within the section's budget")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return time.perf_counter() - t
        except OSError:
            pass
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # a graceful shutdown: the engine's memory goes back
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def client_args(url: str, concurrency: int, chk: Check) -> argparse.Namespace:
    from benchmarks.bench_serve import build_parser

    p = chk.plan
    return build_parser().parse_args(
        [
            "--base-url", url, "--num-prompts", str(concurrency * p.serve_rounds),
            "--max-concurrency", str(concurrency), "--random-input-len", str(p.serve_input_words),
            "--random-output-len", str(p.serve_output_len), "--ignore-eos", "--seed", "0",
            *(() if p.serve_stream else ("--no-stream",)),
        ]
    )  # fmt: skip


def offline_tok_s(
    chk: Check, folder: Path, prompts: list[str], options: dict, budget: Budget
) -> tuple[float, float]:
    """The same prompts and lengths through LLM's own loop, with the server's options: output
    tok/s and this process's CPU µs an output token."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    p = chk.plan
    llm = LLM(str(folder), **options)
    try:
        if budget.spent:
            raise BudgetSpent("offline")
        params = SamplingParams(max_tokens=p.serve_output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
        t, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return tokens / elapsed, cpu / tokens * 1e6
    finally:
        llm.shutdown()
        free_memory()


def section_serving(chk: Check, out: Report, budget: Budget) -> None:
    # as §4: on the CPU the C kernels are another benchmark's business
    measure_serving(chk, out, budget, "torch" if chk.device.type == "cpu" else None)


def measure_serving(
    chk: Check,
    out: Report,
    budget: Budget,
    attention_backend: str | None = None,
    extra: dict | None = None,
    server_args: tuple[str, ...] = (),
    pin: bool = False,
) -> None:
    """§10's figures for chk's plan and device (attention_backend None: the engine's own;
    extra: more engine options, the server's and the offline engine's; server_args: the
    server's own flags; pin: the server and the offline engine on half the CPUs, the client
    on the other half, where there are two or more)."""
    missing = missing_web_stack()
    if missing:
        out.row(10, "serving", "not measured", note=f"no web stack here: {', '.join(missing)} "
                "(carry benchmarks/gpu_wheels.sh's .whl)")  # fmt: skip
        out.summary(10, "not measured: no web stack")
        return
    from benchmarks.bench_serve import make_prompts

    p = chk.plan
    folder = chk.folder(f"model-{p.name}", p.model)
    options = {**engine_options(chk, attention_backend), **(extra or {})}
    top = max(p.serve_concurrency)
    cpus, server_args = _pinning(pin, server_args)
    served: dict[str, float] = {}  # mode -> output tok/s at the top concurrency
    for mode in p.serve_modes:
        flags = (*server_args, *mode_flags(mode))
        figures = _serve(chk, out, budget, folder, options, flags, SERVE_MODES[mode], cpus)
        if top in figures:
            served[mode] = figures[top]
    if not served:
        out.summary(10, "no figure at the top concurrency")
        return
    if budget.left() < 10:
        out.row(10, "offline, the same requests", SKIPPED)
        return
    prompts = make_prompts(top * p.serve_rounds, p.serve_input_words, seed=0)
    with _on_cpus(cpus[0] if cpus else None, threads=True):
        offline, offline_cpu = offline_tok_s(chk, folder, prompts, options, budget)
    shares = {mode: tok_s / offline for mode, tok_s in served.items()}
    out.row(
        10,
        f"offline, the same {len(prompts)} requests",
        f"{offline:,.0f} output tok/s",
        "; ".join(f"{SERVE_MODES[m]} at {top} streams: {r:.0%} of it" for m, r in shares.items()),
        f"LLM.generate in this process, the server's engine options; CPU {offline_cpu:.0f} µs "
        "an output token",
    )
    for mode, ratio in shares.items():
        out.result(10, mode=mode, offline_tok_s=offline, served_tok_s=served[mode], share=ratio,
                   offline_cpu_us_per_token=offline_cpu)  # fmt: skip
    best = max(shares.values())
    goal = f">= {SERVE_SHARE_GOAL:.0%} of offline at {top} streams: {goal_mark(best >= SERVE_SHARE_GOAL)}"
    key = "; ".join(f"{SERVE_MODES[m]} {served[m]:,.0f} tok/s = {r:.0%}" for m, r in shares.items())
    out.summary(10, f"served at {top} streams / offline: {key}", goal)


def start_server(
    chk: Check,
    folder: Path,
    options: dict,
    flags: tuple[str, ...],
    cpus: tuple[set[int], set[int]] | None = None,
    tree: Path | None = None,
) -> tuple[subprocess.Popen, str, Path]:
    """`tessera serve` on a free loopback port (on cpus[0]), from this checkout or `tree`
    (another one, first on its path): (the process, its URL, its log)."""
    port = _free_port()
    log = chk.workdir / f"serve-{port}.log"
    path = [str(tree)] if tree is not None else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(Path.cwd()), *sys.path])}
    with log.open("wb") as sink, _on_cpus(cpus[0] if cpus else None):
        proc = subprocess.Popen(
            [*serve_command(folder, port, options), *flags], stdout=sink,
            stderr=subprocess.STDOUT, env=env, cwd=tree or chk.workdir,
        )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}", log


def measure_against_tree(
    chk: Check,
    out: Report,
    budget: Budget,
    tree: Path,
    bursts: int,
    extra: dict | None = None,
    server_args: tuple[str, ...] = (),
    pin: bool = False,
) -> dict[str, dict[str, list[float]]]:
    """A change's effect on the serving path, cancelling the host's drift: for each of the
    plan's modes, this checkout's server and `tree`'s (another checkout) both started, then the
    client's bursts (the top concurrency, one request a stream) alternating between them, each
    burst's output tok/s and server CPU a token; rows of their medians and the ratio.
    -> {mode: {"baseline" | "this": {"tok_s": [...], "cpu_us": [...]}}}."""
    import statistics

    p = chk.plan
    folder = chk.folder(f"model-{p.name}", p.model)
    options = {**engine_options(chk, None), **(extra or {})}
    top = max(p.serve_concurrency)
    cpus, server_args = _pinning(pin, server_args)
    by_mode: dict[str, dict[str, dict[str, list[float]]]] = {}
    ratios: dict[str, float] = {}
    for mode in p.serve_modes:
        flags = (*server_args, *mode_flags(mode))
        servers = {
            "baseline": start_server(chk, folder, options, flags, cpus, tree),
            "this": start_server(chk, folder, options, flags, cpus),
        }
        figures = by_mode[mode] = {side: {"tok_s": [], "cpu_us": []} for side in servers}
        try:
            with _on_cpus(cpus[1] if cpus else None):
                for proc, url, log in servers.values():
                    _wait_ready(proc, url, budget, log)
                for burst in range(bursts):
                    for side, (proc, url, _) in servers.items():
                        if budget.spent:
                            break
                        args = client_args(url, top, chk)
                        args.num_prompts, args.seed = top, burst  # each burst its own prompts
                        s = _client_run(proc, args, f"on the {side} server")
                        figures[side]["tok_s"].append(s["output_throughput"])
                        if "server_cpu_us_per_token" in s:
                            figures[side]["cpu_us"].append(s["server_cpu_us_per_token"])
        finally:
            for proc, _, log in servers.values():
                _stop(proc)
                progress(f"§10 server log: {log}")
        med = {
            side: {k: statistics.median(v) if v else float("nan") for k, v in f.items()}
            for side, f in figures.items()
        }
        label = SERVE_MODES[mode]
        for side in ("baseline", "this"):
            name = f"baseline tree {tree}" if side == "baseline" else "this tree"
            out.row(
                10, f"{label}, {name}", f"{med[side]['tok_s']:,.0f} output tok/s",
                f"server CPU {med[side]['cpu_us']:.0f} µs a token",
                f"medians of {len(figures[side]['tok_s'])} bursts of {top} streams, alternating",
            )  # fmt: skip
        ratio = ratios[mode] = med["this"]["tok_s"] / med["baseline"]["tok_s"]
        out.result(10, mode=mode, baseline=figures["baseline"], this=figures["this"], ratio=ratio)
    key = "; ".join(f"{SERVE_MODES[m]} {r:.2f}x" for m, r in ratios.items())
    out.summary(10, f"this tree / the baseline tree, output tok/s: {key}")
    return by_mode


def _serve(
    chk: Check,
    out: Report,
    budget: Budget,
    folder: Path,
    options: dict,
    flags: tuple[str, ...],
    label: str,
    cpus: tuple[set[int], set[int]] | None = None,
) -> dict[int, float]:
    """One server's run: started (on cpus[0]), each concurrency's client (on cpus[1]),
    stopped; -> output tok/s by concurrency."""

    p = chk.plan
    proc, url, log = start_server(chk, folder, options, flags, cpus)
    served: dict[int, float] = {}
    try:
        with _on_cpus(cpus[1] if cpus else None):
            start_s = _wait_ready(proc, url, budget, log)
            note = f"max_num_seqs {max(p.serve_concurrency)}"
            out.row(10, f"server start ({label})", f"{start_s:.1f} s", note=note)
            for c in p.serve_concurrency:
                if budget.spent:
                    out.row(10, f"serve ({label}), {c} streams", SKIPPED)
                    continue
                s = _client_run(proc, client_args(url, c, chk), f"at {c} streams")
                served[c] = s["output_throughput"]
                out.row(
                    10,
                    f"serve ({label}), {c} streams",
                    f"{s['output_throughput']:,.0f} output tok/s",
                    f"TTFT p50 / p99 {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} ms; "
                    f"ITL p50 / p99 {s['median_itl_ms']:.1f} / {s['p99_itl_ms']:.1f} ms",
                    f"{s['completed']} requests, {p.serve_input_words} words in, "
                    f"{p.serve_output_len} tokens out"
                    + (
                        f"; server CPU {cpu_us:.0f} µs a token"
                        if (cpu_us := s.get("server_cpu_us_per_token"))
                        else ""
                    ),
                )
                result = {k: v for k, v in s.items() if k != "errors"}
                out.result(10, server=label, concurrency=c, **result)
    finally:
        _stop(proc)
        progress(f"§10 server log: {log}")
    return served
