"""The engine's bookkeeping, torch-free: requests, the block pool and KV cache manager, the scheduler, the
records a step consumes and produces, sampling parameters, and what a frontend knows about an engine. Runs in a
worker (under its engine core), in the offline engine, and in the simulator, which schedules with these very
classes."""
