"""Kernels as source files, one folder per backend: cpu/ (C, compiled once per machine)."""
