"""Attention/FFN disaggregation (AFD): the routed experts of every MoE layer in a pool of expert workers, the
attention workers sending each layer's rows there and taking their outputs back.

    attention worker a ── DispatchRows(layer, rows, slots) ──▶ expert worker w (the slots it owns)
                       ◀── CombinedRows(rows' expert outputs) ─┘
    a combines each token's outputs by its routing weights (`layers.moe.dispatch.combine`)

`frames.py`: what crosses; `shard.py`: an expert worker's experts; `server.py`: its exchange socket and the
thread that serves it; `client.py`: an attention worker's end, the MoE blocks' dispatcher. Both ends run in
worker processes (an attention worker is an engine's; an expert worker has no engine core)."""
