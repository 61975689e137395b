"""bench_engine.py's parts: the workload and its timing, the in-process workers, the peers over
HTTP, and the report."""
