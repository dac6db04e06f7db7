"""Structured output's cost: serving with a JSON schema on every request vs without, and
grammar compile times.

    tessera bench structured --concurrency 1 32 --rounds 2

Starts one Tessera server (the bundled default model unless --model), then runs
`bench serve` at each concurrency with and without --json-schema, alternating (plain,
schema, plain, schema, ...) so that the machine's drift hits both alike; reports output
tokens/s of each and their ratio (median over rounds). Then compiles the test schemas
in-process with the engine's StructuredOutputManager: cold (a distinct spec each time) and
cached (the same spec again), p50/p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks import bench_serve
from benchmarks.bench_compare import TesseraServer, sigterm_as_interrupt
from engine.config import DEFAULT_MODEL

# Long enough that most requests run to max_tokens either way: the ratio then compares
# per-token cost, not output length.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 6,
            "maxItems": 12,
        },
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "items", "rating"],
    "additionalProperties": False,
}

COMPILE_SCHEMAS = {
    "bench": BENCH_SCHEMA,
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name"],
            },
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        },
        "required": ["user"],
    },
    "refs": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/pt"},
            "path": {"type": "array", "items": {"$ref": "#/$defs/pt"}},
        },
        "required": ["a"],
    },
    "enum_pattern": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue", "cyan", "magenta"]},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "score": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["color", "code"],
    },
}


def _pct(values: list[float], q: float) -> float:
    return bench_serve._pct(values, q)


def compile_times(model: str, repeats: int) -> dict:
    """Cold and cached compile+first-mask times (ms) of COMPILE_SCHEMAS on the model's
    tokenizer, through the engine's manager (its thread pool, its cache)."""
    from engine.models.hf_config import load_hf_config
    from engine.models.loader import resolve_model
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured_output import StructuredOutputManager
    from engine.tokenizer import Tokenizer

    folder = resolve_model(model)
    tok = Tokenizer.from_pretrained(folder)
    manager = StructuredOutputManager(tok.hf, load_hf_config(folder).vocab_size, [tok.eos_token_id])
    manager.warm_up().result()  # the tokenizer tables: once per engine, not per schema
    cold: list[float] = []
    cached: list[float] = []
    try:
        for i in range(repeats):
            for name, schema in COMPILE_SCHEMAS.items():
                # a distinct title: a new cache key, the same grammar work
                so = StructuredOutputsParams(json={**schema, "title": f"{name}-{i}"})
                t = time.perf_counter()
                manager.compile(so).result()
                cold.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                manager.compile(StructuredOutputsParams(json={**schema, "title": f"{name}-{i}"}))
                cached.append((time.perf_counter() - t) * 1000)
    finally:
        manager.shutdown()
    return {
        "cold_p50_ms": _pct(cold, 50),
        "cold_p99_ms": _pct(cold, 99),
        "cached_p50_ms": _pct(cached, 50),
        "cached_p99_ms": _pct(cached, 99),
        "samples": len(cold),
    }


def compare_engines(model: str, repeats: int = 5, steps: int = 60) -> dict:
    """llguidance vs xgrammar (when installed; it is not a dependency) on COMPILE_SCHEMAS:
    compile + first mask (ms, median of distinct specs) and the per-token mask (us, median
    and max along a random walk through the grammar). How the engine was picked."""
    import random

    import torch

    from engine.models.hf_config import load_hf_config
    from engine.models.loader import resolve_model
    from engine.structured_output.bitmask import unpack_bitmask
    from engine.tokenizer import Tokenizer

    folder = resolve_model(model)
    tok = Tokenizer.from_pretrained(folder)
    vocab = load_hf_config(folder).vocab_size
    engines = {}
    import llguidance
    import llguidance.hf

    llt = llguidance.hf.from_tokenizer(tok.hf, n_vocab=vocab, eos_token=tok.eos_token_id)

    def llg(schema):
        g = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        m = llguidance.LLMatcher(llt, g, log_level=0)
        return (
            lambda bm: m.unsafe_compute_mask_ptr(bm.data_ptr(), bm.numel() * 4),
            m.consume_token,
            m.is_stopped,
        )

    engines["llguidance"] = llg
    try:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tok.hf, vocab_size=vocab, stop_token_ids=[tok.eos_token_id]
        )
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

        def xg(schema):
            m = xgr.GrammarMatcher(
                compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            )
            return (lambda bm: m.fill_next_token_bitmask(bm, 0), m.accept_token, m.is_terminated)

        engines["xgrammar"] = xg
    except ImportError:
        pass
    out: dict = {}
    rng = random.Random(0)
    for name, make in engines.items():
        for kind, schema in COMPILE_SCHEMAS.items():
            compile_ms, mask_us = [], []
            for i in range(repeats):
                bm = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
                t = time.perf_counter()
                fill, accept, done = make({**schema, "title": f"{kind}-{i}"})
                fill(bm)
                compile_ms.append((time.perf_counter() - t) * 1000)
            for _ in range(steps):
                if done():
                    break
                t = time.perf_counter()
                fill(bm)
                mask_us.append((time.perf_counter() - t) * 1e6)
                allowed = unpack_bitmask(bm, vocab)[0].nonzero().view(-1).tolist()
                if not allowed or not accept(rng.choice(allowed)):
                    break
            out[f"{name}/{kind}"] = {
                "compile_ms_p50": statistics.median(compile_ms),
                "mask_us_p50": statistics.median(mask_us) if mask_us else float("nan"),
                "mask_us_max": max(mask_us, default=float("nan")),
                "steps": len(mask_us),
            }
    return out


def serve_level(base_url: str, args: argparse.Namespace, concurrency: int, schema: bool, seed: int):
    argv = [
        "--base-url", base_url,
        "--endpoint", "/v1/chat/completions",
        "--num-prompts", str(args.num_prompts or max(4, 2 * concurrency)),
        "--max-concurrency", str(concurrency),
        "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len),
        "--temperature", "0.7",
        "--ignore-eos",
        "--seed", str(seed),
    ]  # fmt: skip
    if schema:
        argv += ["--json-schema", json.dumps(BENCH_SCHEMA)]
    return bench_serve.main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tessera bench structured", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=2, help="plain/schema pairs per concurrency")
    p.add_argument("--num-prompts", type=int, default=None, help="default: 2 x concurrency")
    p.add_argument("--random-input-len", type=int, default=32)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile-repeats", type=int, default=25)
    p.add_argument("--skip-serve", action="store_true", help="only the compile times")
    p.add_argument(
        "--compare-engines",
        action="store_true",
        help="also time llguidance against xgrammar (if installed) on the compile schemas",
    )
    p.add_argument("--result-json", default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    result: dict = {"levels": {}, "compile": compile_times(args.model, args.compile_repeats)}
    if args.compare_engines:
        result["engines"] = compare_engines(args.model)
    if not args.skip_serve:
        with (
            sigterm_as_interrupt(),
            TesseraServer(args.model, args.threads, max(args.concurrency)) as url,
        ):
            for c in args.concurrency:
                runs: dict[bool, list[dict]] = {False: [], True: []}
                for r in range(args.rounds):
                    for schema in (False, True):
                        # A seed of its own per run: distinct prompts, no prefix-cache hits
                        # on the run before (which would flatter the second of a pair).
                        seed = 1000 * c + 2 * r + schema
                        runs[schema].append(serve_level(url, args, c, schema, seed))
                plain = [s["output_throughput"] for s in runs[False]]
                constrained = [s["output_throughput"] for s in runs[True]]
                result["levels"][c] = {
                    "plain_tok_s": plain,
                    "schema_tok_s": constrained,
                    "ratio": statistics.median(constrained) / statistics.median(plain),
                    "tokens_per_request": [
                        sum(s["total_output_tokens"] for s in runs[k])
                        / sum(s["completed"] for s in runs[k])
                        for k in (False, True)
                    ],
                }
    print(f"{' Structured output ':=^60}")
    for c, level in result["levels"].items():
        print(
            f"concurrency {c:>3}: plain {statistics.median(level['plain_tok_s']):8.1f} tok/s  "
            f"json_schema {statistics.median(level['schema_tok_s']):8.1f} tok/s  "
            f"ratio {level['ratio']:.3f}  (tokens/request {level['tokens_per_request'][0]:.1f}"
            f" / {level['tokens_per_request'][1]:.1f})"
        )
    comp = result["compile"]
    print(
        f"compile ({comp['samples']} per kind): cold p50 {comp['cold_p50_ms']:.2f} ms "
        f"p99 {comp['cold_p99_ms']:.2f} ms; cached p50 {comp['cached_p50_ms']:.4f} ms "
        f"p99 {comp['cached_p99_ms']:.4f} ms"
    )
    for key, e in result.get("engines", {}).items():
        print(
            f"{key:<26} compile+first mask {e['compile_ms_p50']:7.2f} ms  mask p50 "
            f"{e['mask_us_p50']:8.1f} us  max {e['mask_us_max']:8.1f} us ({e['steps']} steps)"
        )
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
