"""The device check: what Tessera's CUDA path reaches on this GPU, against the chip's own
ceilings, one module a section.

    PYTHONPATH=. python3 -m benchmarks.gpu [--sections 1 2 moe lora ...] [--quick]
        [--device cuda|cpu] [--json PATH] [--time-limit SECONDS]

It runs with whatever torch and Triton the machine has (nothing is installed, no web stack is
imported: the sections import engine/, torch and triton only). Each section has a time
budget and skips what is left of it once the budget is spent (saying so); the whole run stops
at a global limit (the sections not reached say so too). A section that fails prints its
error and the next one runs. stdout gets a summary table first (a line a section: status,
key figure, goal met or not), then every detail row; progress goes to stderr; every figure
as JSON to $OUT/gpu_check.json when $OUT is set (and to --json PATH). run.py is the runner.

1. ceilings (ceilings.py): device, versions; device-to-device copy bandwidth (a large copy_,
   bytes read + written, best of several, CUDA events) and bf16 matmul TFLOP/s.
2. kernel correctness (correctness.py, rig.py): each attention backend found by name in the
   registry (torch, triton), bf16 and fp8 KV cache, against an fp64 reference: B in {1, 7,
   64} x context in {1, 17, 1000, 4097}, decode steps and a prefill chunk on a cached prefix,
   random non-contiguous block tables, stale values in the unused slots.
3. attention microbenchmark (attention.py): one layer's decode forward, triton vs torch, B =
   1/64/256 x context 1k/4k/8k: microseconds, KV bytes read per second, % of the copy ceiling.
4. end to end (end_to_end.py) on the Llama-3-8B shape with dummy weights: decode tok/s at B =
   1/64/256 on a 1k context, eager and with step graphs; prefill tok/s of a 2,048-token
   prompt and of an 8k one; achieved bandwidth = (weights + KV read) / step time.
5. offline throughput (throughput.py): 1,000 ShareGPT-like requests through LLM's own loop.
6. quantized GEMMs (quant.py; also `python3 -m benchmarks.gpu.quant` with its own flags):
   bf16, FP8 and W4A16 at the Llama-3-8B linears, after a correctness pass over the layouts.
7. fused MoE (moe.py): engine.kernels.triton.fused_moe at Qwen3-30B-A3B's shape (128 experts,
   top-8, hidden 2048, 768) and Mixtral's (8, top-2, 4096, 14336), decode B = 1..256: time,
   and the expert bytes a call touches per second as a share of the copy bandwidth.
8. batched LoRA (lora.py): the Llama-3-8B linears with rank-16 adapters, 64 rows over 8
   adapters vs none: a decode step's GEMM cost and what the LoRA kernels add to it.
9. speculative verification (spec.py): a verification step (k drafts a request) against a
   plain decode step of the same engine, B = 1..64.
10. serving (serving.py): `tessera serve` on §4's model, the engine on a thread and in a
   process of its own (--engine-process), against the bench-serve client at 64 and 256
   streams (output tok/s, TTFT, ITL), and each one's share of the same requests offline
   (goal >= 90% at 256). Needs the web stack: carry benchmarks/gpu_wheels.sh's .whl; a call
   of its own (three engine starts).

Goals (issue 18, H200): decode at B=256 reads at >= 70% of the measured copy bandwidth (§4;
§3 shows the attention kernel's share alone); offline output >= 16,215 tok/s (§5).

--quick: tiny shapes and a tiny model, a smoke run (`--quick --device cpu` is what the tests
run: the torch attention backend; the Triton kernels of §6-§8 under TRITON_INTERPRET=1).
"""
