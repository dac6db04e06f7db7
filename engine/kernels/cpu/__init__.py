"""The CPU kernels: C sources (*.c, include/*.h) built into one library on first use
(build.py) and bound with ctypes in one place (ops.py)."""
