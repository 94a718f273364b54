"""`python -m eltctl_runtime.restart [--stop-grace S] [--script-dir D] -- <command>`."""

import sys

from .supervisor import main

if __name__ == "__main__":
    status = main()  # before sys.exit is looked up: main() arms exiting, which wraps it to keep the status
    sys.exit(status)
