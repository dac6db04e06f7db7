"""`python -m api.cli ...`: the `tessera` command from a checkout."""

import os
import sys

from api.cli.main import main

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.exit(main())
