"""Tessera's server against llama.cpp's server on the same model file, side by side.

    tessera bench compare [--concurrency 1 8 32 128] [--random-output-len 128] [--threads 2]

At each concurrency C: bench_serve's workload (distinct random prompts of --random-input-len
words, ignore_eos so every request produces exactly --random-output-len tokens, at most C
requests in flight), the same prompts for both servers. Tessera: one `tessera serve --auth
none` on loopback for all levels, with --num-threads THREADS. llama.cpp (xllamacpp): one
server per level with C parallel slots and THREADS threads (slots = concurrency). Prints a
markdown table: output tokens/s of both and their ratio, TTFT, TPOT and ITL medians.
--tessera-args may be given several times: each is one Tessera configuration (its own
server, one after another), all measured against the same llama.cpp run, one table each.
--baseline-tree PATH runs every configuration a second time from another checkout (e.g. a
`git worktree` of an older commit), before the current tree's: a before/after of two commits
against one llama.cpp run.
Both servers run on 127.0.0.1 only and are always stopped, also on errors and Ctrl-C.
Run it on a quiet machine: both servers and the client share the CPUs with everything else.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks import bench_serve
from benchmarks.llamacpp_server import LlamaCppServer, default_gguf, free_port

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("tessera", "llamacpp")


def default_num_prompts(concurrency: int) -> int:
    """Enough requests that the level runs at its concurrency for a while, bounded."""
    return min(256, max(16, 2 * concurrency))


# -- the Tessera server ----------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the benchmark dies (Linux), so none is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class TesseraServer:
    """`python -m api.cli serve` as a child process; `with TesseraServer(...) as url:`."""

    def __init__(
        self,
        model: str,
        threads: int,
        max_num_seqs: int,
        extra_args: list[str] | None = None,
        startup_timeout: float = 600.0,
        root: Path = ROOT,
    ) -> None:
        self.root = root  # the source tree the server runs from
        self.model = model
        self.threads = threads
        self.max_num_seqs = max_num_seqs
        self.extra_args = extra_args or []
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self._tmp is not None
        return Path(self._tmp.name) / "server.log"

    def start(self) -> str:
        self._tmp = tempfile.TemporaryDirectory(prefix="tessera-bench-")
        cmd = [
            sys.executable, "-m", "api.cli", "serve",
            "--auth", "none",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--model", self.model,
            "--num-threads", str(self.threads),
            "--max-num-seqs", str(self.max_num_seqs),
            "--data-dir", self._tmp.name,  # nothing of the benchmark's outlives it
            "--shutdown-timeout", "5",
            "--log-level", "warning",
            *self.extra_args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": str(self.root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        env.pop("TESSERA_DATABASE_URL", None)  # --auth none: no database at all
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our Ctrl-C reaches it through stop(), in order
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        try:
            wait_healthy(self.base_url, self.proc, self.startup_timeout, "Tessera server")
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except (OSError, AssertionError):
            return ""

    def stop(self) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()  # SIGTERM: drain, then exit
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not healthy after {timeout:.0f} s")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so the finally blocks that stop servers run."""

    def handler(*_: object) -> None:
        raise KeyboardInterrupt("SIGTERM")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- one level -------------------------------------------------------------------------------


def run_level(base_url: str, args: argparse.Namespace, concurrency: int, seed: int) -> dict:
    num = args.num_prompts or default_num_prompts(concurrency)
    argv = [
        "--base-url", base_url,
        "--num-prompts", str(num),
        "--max-concurrency", str(concurrency),
        "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len),
        "--ignore-eos",
        "--seed", str(seed),
        "--timeout", str(args.request_timeout),
    ]  # fmt: skip
    try:
        summary = bench_serve.main(argv)
    except SystemExit as e:  # bench_serve's fail-fast probe
        return {"error": str(e.code), "num_prompts": num}
    except Exception as e:  # one level failing must not lose the others
        return {"error": f"{type(e).__name__}: {e}", "num_prompts": num}
    expected = summary["completed"] * args.random_output_len
    summary["exact_output_len"] = summary["total_output_tokens"] == expected
    return summary


def _banner(text: str) -> None:
    print(f"\n### {text}", flush=True)


def config_label(config: dict) -> str:
    label = f"Tessera {config['tessera_args']}".strip()
    return label if config["tree"] is None else f"{label} (baseline tree {config['tree']})"


def run_tessera(args: argparse.Namespace, model: str, config: dict, errors: dict) -> None:
    """One Tessera configuration (`tessera serve` + its args, from its tree) at every level
    into config["levels"]."""
    levels = config["levels"]
    server = TesseraServer(
        model,
        threads=args.threads,
        max_num_seqs=max(args.concurrency),
        extra_args=shlex.split(config["tessera_args"]),
        startup_timeout=args.startup_timeout,
        root=ROOT if config["tree"] is None else Path(config["tree"]),
    )
    label = config_label(config)
    try:
        url = server.start()
    except RuntimeError as e:
        errors[label] = f"{e}\n{server.log_tail()}"
        print(f"bench compare: {e}\n{server.log_tail()}", file=sys.stderr)
        return
    try:
        for i, c in enumerate(args.concurrency):
            _banner(f"{label}, concurrency {c}")
            levels[c] = run_level(url, args, c, args.seed + i)
            if server.proc is not None and server.proc.poll() is not None:
                print(f"bench compare: Tessera exited:\n{server.log_tail()}", file=sys.stderr)
                break
    finally:
        server.stop()


def run_llamacpp(args: argparse.Namespace, gguf: str, results: dict) -> None:
    # Each slot holds one request: prompt (words may be a few tokens) + output, with margin.
    need = 2 * args.random_input_len + args.random_output_len + 64
    ctx_per_slot = -(-need // 256) * 256
    for i, c in enumerate(args.concurrency):
        _banner(f"llama.cpp, {c} slots, concurrency {c}")
        try:
            server = LlamaCppServer(
                parallel=c,
                threads=args.threads,
                model=gguf,
                ctx_per_slot=ctx_per_slot,
                startup_timeout=args.startup_timeout,
            )
            with server as url:
                results["llamacpp"][c] = run_level(url, args, c, args.seed + i)
        except RuntimeError as e:
            results["llamacpp"][c] = {"error": str(e)}
            print(f"bench compare: {e}", file=sys.stderr)


# -- the report ------------------------------------------------------------------------------


def _num(s: dict | None, key: str, fmt: str = "{:.1f}") -> str:
    if not s or "error" in s or key not in s:
        return "error" if s and "error" in s else "-"
    value = s[key]
    return "nan" if value != value else fmt.format(value)


def table_rows(results: dict, concurrency: list[int], tessera: dict | None = None) -> list[dict]:
    """One row per level: Tessera (results["tessera"], or the given levels of another
    configuration) against llama.cpp."""
    tessera = results["tessera"] if tessera is None else tessera
    rows = []
    for c in concurrency:
        t, ll = tessera.get(c), results["llamacpp"].get(c)
        row = {"concurrency": c, "tessera": t, "llamacpp": ll, "ratio": None}
        ok = all(s and "error" not in s and s.get("output_throughput") for s in (t, ll))
        if ok:
            row["ratio"] = t["output_throughput"] / ll["output_throughput"]
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        "| concurrency | prompts | Tessera tok/s | llama.cpp tok/s | Tessera / llama.cpp "
        "| TTFT p50 ms (T / L) | TPOT p50 ms (T / L) | ITL p50 ms (T / L) | failed (T / L) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, ll = r["tessera"], r["llamacpp"]
        prompts = next((s["num_prompts"] for s in (t, ll) if s and "num_prompts" in s), "-")
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        pair = " / ".join
        lines.append(
            f"| {r['concurrency']} | {prompts} "
            f"| {_num(t, 'output_throughput')} | {_num(ll, 'output_throughput')} | {ratio} "
            f"| {pair([_num(t, 'median_ttft_ms'), _num(ll, 'median_ttft_ms')])} "
            f"| {pair([_num(t, 'median_tpot_ms'), _num(ll, 'median_tpot_ms')])} "
            f"| {pair([_num(t, 'median_itl_ms'), _num(ll, 'median_itl_ms')])} "
            f"| {pair([_num(t, 'failed', '{}'), _num(ll, 'failed', '{}')])} |"
        )
    return "\n".join(lines)


def table_json(rows: list[dict]) -> list[dict]:
    """The table's figures, flat, for the JSON report."""
    keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms", "failed")
    return [
        {
            "concurrency": r["concurrency"],
            "ratio": r["ratio"],
            **{f"{name}_{key}": (r[name] or {}).get(key) for name in SERVERS for key in keys},
        }
        for r in rows
    ]


def machine_info(threads: int) -> dict:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "server_threads": threads,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench compare", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file served by both (default: the bundled SmolLM2-135M-Instruct Q4_1)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per level (default: max(16, 2 x concurrency), at most 256)",
    )
    p.add_argument("--random-input-len", type=int, default=128, help="prompt length in words")
    p.add_argument("--random-output-len", type=int, default=128, help="tokens per request")
    p.add_argument("--threads", type=int, default=2, help="threads of each server")
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument(
        "--tessera-args",
        action="append",
        default=None,
        help='extra `tessera serve` flags, e.g. "--dtype float32"; give it several times to '
        "compare several configurations against one llama.cpp run",
    )
    p.add_argument(
        "--baseline-tree",
        default=None,
        help="another checkout (e.g. a git worktree of an older commit): each configuration "
        "also runs from it, first, against the same llama.cpp run",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per server")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def tessera_configs(tessera_args: list[str] | None, baseline_tree: str | None) -> list[dict]:
    """One entry per --tessera-args (its defaults: ""), each from the baseline tree first
    where one is given, then from this tree (tree None); levels: filled by the run."""
    trees = ([baseline_tree] if baseline_tree else []) + [None]
    return [
        {"tessera_args": extra, "tree": tree, "levels": {}}
        for extra in (tessera_args or [""])
        for tree in trees
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.concurrency):
        parser.error("--concurrency values must be at least 1")
    for name in ("random_input_len", "random_output_len", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if args.model is None:
        from engine.config import DEFAULT_MODEL

        tessera_model, gguf = DEFAULT_MODEL, default_gguf()  # the same file underneath
    else:
        if not (Path(args.model).is_file() and args.model.endswith(".gguf")):
            parser.error(f"--model must be a .gguf file both servers can load, got {args.model}")
        tessera_model = gguf = str(Path(args.model).resolve())
    if args.baseline_tree is not None:
        tree = Path(args.baseline_tree).resolve()
        # `python -m api.cli` serves from either layout: api/cli.py, or api/cli/ (from 2026-12-06)
        if not any((tree / "api" / f).is_file() for f in ("cli.py", "cli/__main__.py")):
            parser.error(f"--baseline-tree must be a Tessera checkout, got {args.baseline_tree}")
        args.baseline_tree = str(tree)
    if "llamacpp" in args.servers:
        try:
            import xllamacpp  # noqa: F401
        except ImportError:
            parser.error("llama.cpp's server needs `pip install xllamacpp` (or --servers tessera)")

    machine = machine_info(args.threads)
    results: dict = {
        "benchmark": "compare",
        "model": gguf,
        "concurrency": args.concurrency,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "machine": machine,
        # One entry per --tessera-args (and per tree, baseline first): its levels,
        # concurrency -> bench_serve's summary (or {"error": ...}); "tessera" and "table" are
        # the current tree's first configuration's.
        "tessera_configs": tessera_configs(args.tessera_args, args.baseline_tree),
        "llamacpp": {},
        "server_errors": {},
    }
    current = [c for c in results["tessera_configs"] if c["tree"] is None]
    results["tessera"] = current[0]["levels"]
    print("bench compare: run it on a quiet machine; other load skews both servers.")
    load, cpus = machine["load_avg_1m"], machine["usable_cpus"]
    if load and cpus and load > 0.25 * cpus:
        print(
            f"bench compare: WARNING: load average {load} on {cpus} CPUs: the machine is not quiet",
            file=sys.stderr,
        )
    try:
        with sigterm_as_interrupt():
            if "tessera" in args.servers:
                for config in results["tessera_configs"]:
                    run_tessera(args, tessera_model, config, results["server_errors"])
            if "llamacpp" in args.servers:
                run_llamacpp(args, gguf, results)
    except KeyboardInterrupt:
        print("\nbench compare: interrupted; the servers are stopped", file=sys.stderr)
        raise SystemExit(130) from None

    for config in results["tessera_configs"]:
        config["table"] = table_json(table_rows(results, args.concurrency, config["levels"]))
    results["table"] = current[0]["table"]
    m = machine
    print(
        f"\n## Tessera vs llama.cpp: {Path(gguf).name}, {args.random_input_len} words in, "
        f"{args.random_output_len} tokens out (ignore_eos), {args.threads} threads each"
    )
    print(
        f"{m['date']}, {m['platform']}, {m['usable_cpus']}/{m['cpu_count']} CPUs, "
        f"load {m['load_avg_1m']} at start; llama.cpp slots = concurrency\n"
    )
    several = len(results["tessera_configs"]) > 1
    for config in results["tessera_configs"]:
        if several:
            label = config_label(config) if config["tessera_args"] else "Tessera (its defaults)"
            if config["tree"] is not None and not config["tessera_args"]:
                label += f" (baseline tree {config['tree']})"
            print(f"\n### {label}\n")
        print(format_table(table_rows(results, args.concurrency, config["levels"])))
    runs = [(config_label(c), c["levels"]) for c in results["tessera_configs"]]
    inexact = [
        f"{name} at {c}"
        for name, levels in (*runs, ("llama.cpp", results["llamacpp"]))
        for c, s in levels.items()
        if s.get("exact_output_len") is False
    ]
    if inexact:
        print(f"\nWARNING: not every request produced exactly the requested tokens: {inexact}")
    print("\n(Run on a quiet machine: both servers and the client share the CPUs.)")
    print(json.dumps(results, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
