"""The CPU kernels: C sources (*.c, include/*.h) built into one library on first use
(build.py) and bound with ctypes in one place (ops.py), with the thin tensor wrappers beside
the sources they call: gemm.py, w4.py (w4*.c), w8a8.py, amx_bf16.py, gguf.py (gguf*.c),
fused_ops.py, and isa.py (the row thresholds between them, per instruction set). They import
nothing above engine/kernels/ (no layer, model or worker)."""
