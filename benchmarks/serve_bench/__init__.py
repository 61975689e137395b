"""bench_serve.py's parts: the plan (sizes, workloads, seeds), when a stage may run, the two
load generators, kvbaton offline for (d), and the report."""
