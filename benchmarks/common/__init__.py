"""What the benchmark scripts share, one idea per module.

The scripts run as `python benchmarks/<script>.py`, which puts `benchmarks/` first on
`sys.path`, so this package imports as `common` (and the per-script packages as `engine_bench`,
`serve_bench`, `moe_ep_bench`, `grammar_bench` and `structured_bench`) with no path set-up of their own.
"""
