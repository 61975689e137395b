"""bench_moe_ep.py's parts: the models and workload sizes, the rank processes, the summaries, and the report."""
