"""`python -m eltctl_runtime.daemon --config daemon.json [--detach]` (see main.py)."""

import sys

from .main import main

sys.exit(main())
