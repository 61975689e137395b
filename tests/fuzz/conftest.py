from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))  # server_harness, served
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))  # common.soak: the load, shared with the benchmark
