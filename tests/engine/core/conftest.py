from __future__ import annotations

import sys
from pathlib import Path

# The tests here share core_testing.py (fake runner, invariant checks); make it importable
# whatever pytest's import mode is.
sys.path.insert(0, str(Path(__file__).parent))
