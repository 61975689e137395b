"""`python -m kvbaton.bench serve ...`"""

import sys

from kvbaton.bench.cli import run

sys.exit(run())
