"""`kvbaton sim`: a discrete-event cluster simulator that runs the real scheduler.

Each simulated worker is a real `Scheduler` over a real `KVCacheManager`; only the model
runner is replaced, by a step-latency model (`latency.py`) that says how long a step of a given
shape takes. Requests reach workers through the router's real policies, and KV moves between
prefill and decode workers over a link model (`links.py`). Nothing here imports torch.
"""
