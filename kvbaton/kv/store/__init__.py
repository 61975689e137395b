"""KV tiers beyond a worker's own pool, behind one contract (`base.KVTier`):

    L1  the worker's pool (kvbaton.sched.block_pool: the prefix cache)
    L2  shm     node-local shared memory: every worker on the host maps one arena (`shm_tier`)
    L3  disk    signed block files in a bounded directory, kept across restarts (`disk_tier`, `records`)
    L4  redis   a cluster-wide Redis, every block under a TTL (`redis_tier`)

A block is stored under its content address (`keys.StoreKeys`: the prefix cache's chained hash,
prefixed by the model, layout and dtype it was computed for), as one payload: its rows of every
layer, in layer order. `tiered.TieredStore` stacks the tiers (fastest first) over one worker's
pools; the scheduler sees it only as the torch-free `base.PrefixStore`.
Importing this package needs no torch.
"""
