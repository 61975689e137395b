"""`kvbaton plan`: capacity planning (KV memory, TP/PP, P:D ratio, GPU count) on top of the simulator.

One module per idea: `workload` (the load and its SLOs), `memory` (what fits on a GPU), `deployment` (one
configuration to try, built into a simulated cluster), `evaluate` (simulate it; its goodput), `search` (which
configuration serves the load best), `disaggregation` (colocated, PD or conditional PD), `diagnose` (why a
running deployment misses its SLO, and three ranked fixes), `examples` (the article's case and two more),
`report` / `plots` (how it is shown), `cli` (flags). Nothing here imports torch.
"""
