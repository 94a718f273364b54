import sys

from eltctl.cli import main

sys.exit(main())
