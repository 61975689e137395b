"""`python -m kvbaton ...`: the same command line as the `kvbaton` script."""

import sys

from kvbaton.cli import main

sys.exit(main())
