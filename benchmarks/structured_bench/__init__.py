"""bench_structured.py's parts: the workload (schemas, prompts, the requests of runs A, B, C and the checks of
their replies), and the report."""
