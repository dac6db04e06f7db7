"""`python3 -m benchmarks.gpu`: the device check's runner (benchmarks/gpu/run.py)."""

import sys

from benchmarks.gpu.run import main

sys.exit(main())
