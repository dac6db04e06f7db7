"""Memory after load for each GGUF type, against the file's size (issue 22).

    tessera bench gguf_memory [--types Q4_0 Q4_1 Q8_0 Q4_K Q5_K Q6_K] [--untied Q6_K]
        [--tree PATH] [--json PATH]

One GGUF file per type: a random Llama whose dimensions are multiples of 256 (so every
linear layer can take every type, K-quants included; llama.cpp falls back to other types
where they are not), 12 layers of hidden 768 / intermediate 2048, with the bundled model's
tokenizer, its linear weights in that type and the embedding in Q8_0; plus the bundled
SmolLM2-135M Q4_1 file as it is. Each file loads in its own process with default flags
(`LLM(path)`, a tiny KV cache), generates a few tokens, and reports its resident memory
above the process's baseline (torch and the compiled kernels loaded) after load, the peak
during load, the anonymous part (RSS also counts the file's pages mapped while reading it,
which the kernel can drop), and the linear layers' bytes in memory against the file's.
--untied TYPE gives the random models their own output.weight in TYPE (as Q4_K_M files have
in Q6_K) instead of a head tied to the embedding; --tree loads them with another checkout's
engine (a baseline, e.g. a git worktree of an earlier commit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHECKOUT = Path(__file__).resolve().parents[1]
TYPES = (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "IQ4_NL",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_XS",
)
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 768, 2048, 12, 12, 4
_DIMS = {  # the bundled file's keys that describe its shape -> this model's
    "llama.embedding_length": HIDDEN,
    "llama.feed_forward_length": INTERMEDIATE,
    "llama.block_count": LAYERS,
    "llama.attention.head_count": HEADS,
    "llama.attention.head_count_kv": KV_HEADS,
    "llama.rope.dimension_count": HIDDEN // HEADS,
}


def _quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name.endswith("_K") or type_name.startswith("IQ4"):  # gguf-py reads, cannot write
        if str(CHECKOUT) not in sys.path:
            sys.path.insert(0, str(CHECKOUT))
        from tests.engine.kernels.kquant_blocks import quantize as quantize_k

        return quantize_k(w, type_name)
    return quantize(w, GGMLQuantizationType[type_name])


def write_random_llama(
    path: Path, type_name: str, source: Path, head_type: str | None = None
) -> None:
    """A random Llama of _DIMS with `source`'s metadata (tokenizer, template) as GGUF; with
    head_type, an output.weight of its own in that type (else the head is tied)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = _DIMS.get(field.name, field.contents())
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    rng = np.random.default_rng(0)
    vocab = int(next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight"))
    head_dim = HIDDEN // HEADS

    def add(name: str, rows: int, cols: int, qtype: str) -> None:
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        q = _quantize(w, qtype)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[qtype])

    add("token_embd.weight", vocab, HIDDEN, "Q8_0")
    if head_type is not None:
        add("output.weight", vocab, HIDDEN, head_type)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
        add(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, type_name)
        add(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, type_name)
        add(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, type_name)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, type_name)
        add(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN, type_name)
        add(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN, type_name)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE, type_name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Run in a fresh process per file: resident memory is per process.
_PROBE = r"""
import json, sys, torch
torch.set_num_threads(2)
from engine.kernels.cpu import ops
ops.library()
import engine.llm
def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
base, base_anon = kib("VmRSS:"), kib("RssAnon:")
from engine.llm import LLM
from engine.sampling_params import SamplingParams
try:  # EngineArgs' name; a baseline tree from before it says num_blocks
    import engine.args
    blocks = {"num_kv_blocks": 32}
except ImportError:
    blocks = {"num_blocks": 32}
llm = LLM(sys.argv[1], max_model_len=256, **blocks)
rss, peak, anon = kib("VmRSS:"), kib("VmHWM:"), kib("RssAnon:")
out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
model = llm.engine.executor.runner.model
def tensors(obj, depth=0):  # a layer's weights wherever its method keeps them
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors(o, depth + 1)
    elif depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        for o in vars(obj).values():
            yield from tensors(o, depth + 1)
seen, linear = set(), 0
for name, m in model.named_modules():
    if not hasattr(m, "quant_method") or "lm_head" in name or "embed" in name:
        continue
    found = [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]
    for t in tensors(found):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            linear += t.nbytes
weights = linear  # and every parameter and buffer besides (embedding, norms, rope tables)
for t in [*model.parameters(), *model.buffers()]:
    if t.data_ptr() not in seen:
        seen.add(t.data_ptr())
        weights += t.nbytes
print(json.dumps({"rss_mib": (rss - base) / 1024, "peak_mib": (peak - base) / 1024,
                  "anon_mib": (anon - base_anon) / 1024, "weights_mib": weights / 2**20,
                  "linear_mib": linear / 2**20, "tokens": len(out[0].outputs[0].token_ids)}))
"""


def probe(path: Path, tree: Path = CHECKOUT) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path)],
        capture_output=True,
        text=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{path.name}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def file_linear_mib(path: Path) -> tuple[float, float]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    linear = sum(
        int(t.n_bytes)
        for t in reader.tensors
        if t.name.startswith("blk.") and len(t.shape) == 2 and int(t.shape[1]) > 1
    )
    return path.stat().st_size / 2**20, linear / 2**20


def main(argv: list[str] | None = None) -> int:
    from engine.gguf.source import default_gguf_path

    parser = argparse.ArgumentParser(prog="tessera bench gguf_memory")
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--untied", metavar="TYPE", choices=TYPES, help="output.weight's type")
    parser.add_argument("--tree", type=Path, default=CHECKOUT, help="the engine to load with")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    bundled = Path(default_gguf_path())
    rows = []
    with tempfile.TemporaryDirectory(prefix="tessera-gguf-mem-") as tmp:
        files = [("SmolLM2-135M Q4_1 (bundled)", bundled)]
        for t in args.types:
            path = Path(tmp) / f"random-llama-{t}.gguf"
            print(f"writing {path.name} ...", file=sys.stderr, flush=True)
            write_random_llama(path, t, bundled, args.untied)
            head = f", head {args.untied}" if args.untied else ""
            files.append((f"random 12x768 {t}{head}", path))
        for label, path in files:
            print(f"loading {label} ...", file=sys.stderr, flush=True)
            size, linear_file = file_linear_mib(path)
            r = probe(path, args.tree.resolve())
            rows.append({"file": label, "file_mib": size, "linear_file_mib": linear_file, **r})
    print("| file | file MiB | linear MiB in file | linear MiB in memory | RSS after load MiB "
          "| of it anonymous MiB | peak during load MiB | RSS / file |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['file']} | {r['file_mib']:.1f} | {r['linear_file_mib']:.1f} | "
            f"{r['linear_mib']:.1f} | {r['rss_mib']:.1f} | {r['anon_mib']:.1f} | {r['peak_mib']:.1f} | "
            f"{r['rss_mib'] / r['file_mib']:.2f}× |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
