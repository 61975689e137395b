"""Process groups and what moves between their ranks: the expert-parallel group (rendezvous, lockstep,
all-to-all through `layers.moe.dispatch`) and runtime expert load balancing. Runs in the worker process of each
rank."""
