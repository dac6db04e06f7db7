"""Kernels as source files, one folder per backend: cpu/ (C, compiled once per machine),
triton/ (the CUDA path's Triton kernels). fp8.py: FP8 linear layers (torch._scaled_mm where the
GPU has FP8 matmuls, a weight-only fallback elsewhere; importable without Triton)."""
