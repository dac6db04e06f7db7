"""The quantized GEMMs moved to benchmarks/gpu/quant.py (the device check's section 6): this
keeps `python3 benchmarks/gpu_quant.py [flags]` working. Prefer `python3 -m benchmarks.gpu.quant`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu.quant import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
