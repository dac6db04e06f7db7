"""The device check moved to benchmarks/gpu/ (one module a section): this keeps
`python3 benchmarks/gpu_check.py [flags]` working. Prefer `python3 -m benchmarks.gpu`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
