"""Online serving benchmark against any OpenAI-compatible server (like `vllm bench serve`).

    tessera bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --max-concurrency 32 --random-input-len 128 --random-output-len 128 --ignore-eos

Each request is a streaming /v1/completions call (or /v1/chat/completions with --endpoint)
with a distinct prompt of random English words, so it works whatever tokenizer the server
uses; prompt and output token counts come from the server's usage (stream_options.
include_usage), falling back to the number of content chunks. Prints request throughput,
output tokens/s and TTFT, TPOT, ITL and end-to-end latency (mean, median, p99).

Datasets: `random` (distinct random prompts) and `prefix` (a shared prefix of
--prefix-len words before each random prompt: exercises prefix caching).

--no-stream sends whole-answer requests instead (TTFT is then each request's latency).

--json-schema FILE|JSON puts a JSON schema on every request (structured output: chat gets
OpenAI's response_format, completions vLLM's structured_outputs); `tessera bench structured`
runs with and without it, interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec

# Common English words: most are one token in any BPE vocabulary, so N words ~ N tokens.
_WORDS_TEXT = (
    "the of and to in is was that for on with as by at from his her they this have had not "
    "are but which one all were when there been would their can more has will into time "
    "only new some could these two may first then do any like other than now my over such "
    "our man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since "
    "against go came right used take three house water light small river city green music "
    "story garden paper window market summer winter morning evening table bridge mountain "
    "letter school friend family answer number question river forest ocean island valley "
    "teacher doctor village kitchen machine engine simple quiet bright early late open "
    "close travel follow learn build carry write speak listen watch remember believe"
)
WORDS = _WORDS_TEXT.split()


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first content chunk
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str = ""


def make_prompts(
    num: int, input_len: int, seed: int, dataset: str = "random", prefix_len: int = 0
) -> list[str]:
    rng = random.Random(seed)
    prefix = ""
    if dataset == "prefix":
        prefix = " ".join(rng.choice(WORDS) for _ in range(prefix_len)) + " "
    elif dataset != "random":
        raise ValueError(f"dataset must be random or prefix, got {dataset!r}")
    prompts = []
    for i in range(num):
        # The request number makes every prompt distinct even with a tiny input_len.
        words = [rng.choice(WORDS) for _ in range(max(0, input_len - 1))]
        prompts.append(f"{prefix}{i} " + " ".join(words))
    return prompts


def _payload(args: argparse.Namespace, prompt: str, chat: bool) -> dict:
    body: dict = {
        "model": args.model,
        "max_tokens": args.random_output_len,
        "temperature": args.temperature,
    }
    if getattr(args, "stream", True):
        body.update(stream=True, stream_options={"include_usage": True})
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    schema = getattr(args, "json_schema", None)
    if schema is not None:
        if chat:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": schema, "strict": True},
            }
        else:
            body["structured_outputs"] = {"json": schema}
    return body


def load_schema(value: str | None) -> dict | None:
    """--json-schema: inline JSON text, or the path of a file holding it."""
    if value is None:
        return None
    text = value if value.lstrip().startswith("{") else Path(value).read_text()
    schema = json.loads(text)
    if not isinstance(schema, dict):
        raise SystemExit("--json-schema must be a JSON object")
    return schema


async def send_request(
    session: aiohttp.ClientSession, url: str, body: dict, headers: dict, chat: bool
) -> RequestResult:
    result = RequestResult()
    chunks = 0
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                result.error = f"HTTP {resp.status}: {text[:300]}"
                return result
            if not body.get("stream"):  # a whole answer: its TTFT is its latency
                return _whole_answer(result, _decode(await resp.read()), start, chat)
            async for line in resp.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = _decode(data)
                if "error" in obj:
                    result.error = f"stream error: {obj['error']}"
                    return result
                usage = obj.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                for choice in obj.get("choices") or []:
                    text = (
                        (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    )
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    if not result.output_tokens:
        result.output_tokens = chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "the stream carried no content"
    return result


def _whole_answer(result: RequestResult, obj: dict, start: float, chat: bool) -> RequestResult:
    result.latency = result.ttft = time.perf_counter() - start
    usage = obj.get("usage") or {}
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.output_tokens = usage.get("completion_tokens", 0)
    texts = [(c.get("message") or {}).get("content") if chat else c.get("text")
             for c in obj.get("choices") or []]  # fmt: skip
    result.ok = any(texts) and result.output_tokens > 0
    if not result.ok:
        result.error = "the answer carried no content"
    return result


_decode = msgspec.json.Decoder().decode


def _run_loop(coro):
    """asyncio.run on uvloop where it is installed: the client's own CPU time competes with
    the server on the same machine, and uvloop's I/O costs less of it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft * 1000 for r in ok]
    # (a whole answer, --no-stream, has no time per output token: its latency is its TTFT)
    tpot = [
        (r.latency - r.ttft) / (r.output_tokens - 1) * 1000
        for r in ok
        if r.output_tokens > 1 and r.latency > r.ttft
    ]
    itl = [g * 1000 for r in ok for g in r.itl]
    e2e = [r.latency * 1000 for r in ok]
    summary: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        summary[f"mean_{name}_ms"] = statistics.fmean(values) if values else float("nan")
        summary[f"median_{name}_ms"] = _pct(values, 50)
        summary[f"p99_{name}_ms"] = _pct(values, 99)
    errors = [r.error for r in results if not r.ok]
    summary["errors"] = errors[:5]
    return summary


def print_summary(s: dict) -> None:
    line = "=" * 50
    print(f"{' Serving Benchmark Result ':=^50}")
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:>10}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        print(f"{title:-^50}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            key = f"{stat}_{name}_ms"
            print(f"{label + ' ' + name.upper() + ' (ms):':<40}{s[key]:>10.2f}")
    print(line)
    for err in s["errors"]:
        print(f"error: {err}", file=sys.stderr)


async def _resolve_model(session: aiohttp.ClientSession, base_url: str, headers: dict) -> str:
    async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        body = await resp.json()
    models = body.get("data") or body.get("models") or []
    if not models:
        raise SystemExit(f"{base_url}/v1/models lists no model; pass --model")
    return models[0].get("id") or models[0].get("name")


async def run(args: argparse.Namespace) -> dict:
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chat = "chat" in args.endpoint
    url = base_url + args.endpoint
    concurrency = args.max_concurrency or args.num_prompts
    # a connection per request: servers differ in when they drop an idle keep-alive one
    # (llama.cpp's does between streams), and a request sent on it would fail
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    timeout = aiohttp.ClientTimeout(total=args.timeout, connect=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        if args.model is None:
            args.model = await _resolve_model(client, base_url, headers)
        prompts = make_prompts(
            args.num_prompts, args.random_input_len, args.seed, args.dataset_name, args.prefix_len
        )
        # One request first: fail fast on a wrong URL, model or key (not counted).
        probe = await send_request(
            client, url, _payload(args, "warm up " + prompts[0], chat), headers, chat
        )
        if not probe.ok:
            raise SystemExit(f"the first test request failed: {probe.error}")

        semaphore = asyncio.Semaphore(concurrency)
        rng = random.Random(args.seed + 1)

        async def one(prompt: str) -> RequestResult:
            async with semaphore:
                return await send_request(client, url, _payload(args, prompt, chat), headers, chat)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if args.request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary.update(
        {
            "base_url": base_url,
            "model": args.model,
            "endpoint": args.endpoint,
            "num_prompts": args.num_prompts,
            "max_concurrency": args.max_concurrency,
            "request_rate": args.request_rate,
            "dataset_name": args.dataset_name,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "json_schema": getattr(args, "json_schema", None) is not None,
        }
    )
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=("/v1/completions", "/v1/chat/completions"),
    )
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: all)"
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in requests/s (default inf: all at once)",
    )
    p.add_argument("--dataset-name", choices=("random", "prefix"), default="random")
    p.add_argument("--random-input-len", type=int, default=128, help="prompt length in words")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--prefix-len", type=int, default=256, help="shared prefix words (prefix)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask for exactly max_tokens (sends ignore_eos, a vLLM/llama.cpp extra)",
    )
    p.add_argument(
        "--json-schema",
        default=None,
        help="a JSON schema (inline JSON or a file) every response must follow",
    )
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-stream: whole answers (TTFT is then each request's latency; no ITL)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-json", default=None, help="also write the results to this file")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be at least 1")
    if args.request_rate <= 0:
        raise SystemExit("--request-rate must be positive (inf for all at once)")
    args.json_schema = load_schema(args.json_schema)
    summary = _run_loop(run(args))
    print_summary(summary)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


if __name__ == "__main__":
    main()
