"""The frontend's request path, in the `kvbaton serve` process for every deployment (colocated too): the
router (the server's `EngineClient`), the worker pool, flights, routing policies, supervision and the pool's
side of the diagnostics. Torch-free: it never runs the model."""
