"""Every threshold `kvbaton doctor` judges by, in one place, each with why.

They are rules of thumb for this system on CPU hosts (figures in benchmarks/results/), not laws: a finding says
what was measured and which flag moves it, so an operator can weigh it against their own SLOs.
"""

from __future__ import annotations

# ---- step 1: interconnect ----------------------------------------------------------------------------------
# Loopback TCP moves a few GB/s on any recent host (benchmarks/results/kv-transfer.md); below 1 GB/s between two
# workers of one host, a 1024-token prompt's KV (~23 MB for SmolLM2-135M in bf16) takes longer to move than
# to prefill, and shared memory (no socket, no copy) is the better transport.
TCP_SLOW_GBPS = 1.0
# shm copies rows straight between pools: it runs at memory-copy speed (> 5 GB/s); under 2 GB/s the copies are
# starved (the cores are busy computing, or memory bandwidth is contended).
SHM_SLOW_GBPS = 2.0
# Any transport's fixed cost per transfer: above 20 ms it dominates the TTFT of short disaggregated prompts.
TRANSFER_LATENCY_HIGH_MS = 20.0
# A gloo all-reduce of a few KB between processes of one host takes ~100-300 us; tensor or expert parallelism
# pays it (or an all-to-all like it) per layer per step, so above 1 ms a 30-layer step spends > 30 ms in it.
ALLREDUCE_LATENCY_HIGH_US = 1000.0

# ---- step 2: KV watermark ----------------------------------------------------------------------------------
# vLLM's preemption warnings start where free blocks run out; at 95% used, one long prompt or a few more decodes
# preempt (recompute) someone. 85%: the headroom is nearly gone under bursty load.
KV_USAGE_CRITICAL = 0.95
KV_USAGE_HIGH = 0.85
# A preemption recomputes a request's whole context; more than 1 per 100 finished requests is throughput lost.
PREEMPTIONS_PER_100_HIGH = 1.0
# Requests waiting while KV is mostly free: the batch is capped by the scheduler's limits, not by memory.
WAITING_HIGH = 8
KV_USAGE_LOW = 0.5
# Allocated-but-unfilled slots over allocated ones: above half, blocks are too big for the requests' tails.
KV_WASTE_HIGH = 0.5
# With several decode workers and near-zero prefix hits, load-balanced routing scatters shared prefixes.
PREFIX_HIT_LOW = 0.05

# ---- step 3: compute ---------------------------------------------------------------------------------------
# Decode on CPU is weight-read bound: the kernels (GEMM / dot / attention) should hold most of a step. Above
# half of step time outside them, the step is framework overhead (Python, small ops, the sampler).
OUTSIDE_COMPUTE_HIGH = 0.5

# ---- step 4: routing ---------------------------------------------------------------------------------------
# A prompt this long costs a decode worker ~a second of prefill on a 2-core host, stalling every decode batched
# with it: it belongs in the prefill pool. Half of it is the threshold we suggest.
LONG_PROMPT_TOKENS = 1024
# More than 10% of prompts long but kept local: the prefill pool exists for them.
LONG_LOCAL_SHARE_HIGH = 0.10
# With a prefill pool, under 5% of prompts reaching it: the pool is idle capacity.
PREFILL_SHARE_LOW = 0.05
# Without a prefill pool, over 20% long prompts: decode TPOT suffers; a prefill pool would take them.
LONG_SHARE_NO_POOL = 0.20
# Under 64 tokens, a transfer's fixed latency outweighs the prefill it saves (the router's default threshold).
SHORT_PROMPT_TOKENS = 64
SHORT_SHARE_HIGH = 0.20
# Fewer finished requests than this: shares are too thin to act on.
MIN_REQUESTS = 20
