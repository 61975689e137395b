"""The diagnostics a worker runs when the router asks (`POST /admin/diagnostics/*`, `kvbaton doctor`).

- KV transport: scratch transfers from a prefill worker's probe sender to a decode worker's probe receiver, over
  the deployment's own transport code and settings, between scratch pools: the engine's pools, blocks and
  connector are never touched, so a probe cannot corrupt or delay a request's KV.
- all-reduce: a gloo process group of its own (not torch.distributed's default group, which an expert-parallel
  worker uses) over a TCPStore that rank 0 hosts for the probe's few seconds, bound to the worker's host only
  (`parallel.rendezvous`). NOTE: like the expert-parallel rendezvous, that store is unauthenticated.
- step profile: torch.profiler over the worker's next engine steps, on its loop thread, with kvbaton's C kernels
  labelled for the capture (they are ctypes calls, which the profiler would not see).

One probe at a time per worker: another is answered at once with an error. The transport and all-reduce probes
run on a thread of their own, so the engine keeps stepping; their replies go out from the loop thread
(`replies`), which owns the event socket. Every probe ends within its deadline, which the worker caps again here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import torch

from kvbaton.engine.core import EngineCore
from kvbaton.kv.connectors import ConnectorConfig, TransferSpec, make_receiver, make_sender, pool_allocator
from kvbaton.kv.layout import KVLayout
from kvbaton.kv.pools import allocate_pools
from kvbaton.messages.router_worker import (
    OpTime,
    ProbeAllReduce,
    ProbeProfile,
    ProbeReady,
    ProbeReceive,
    ProbeReport,
    ProbeSend,
    StepProfile,
    Timing,
)
from kvbaton.messages.worker_spec import WorkerSpec
from kvbaton.sched.outputs import StepResult

logger = logging.getLogger(__name__)

# A worker's own caps, whatever the router asks (the server's are tighter): memory, time, work.
MAX_SCRATCH_BYTES = 512 * 2**20  # one scratch pool set (all layers), or one all-reduce buffer
MAX_TRANSFERS = 256
MAX_SIZES = 8
MAX_ITERS = 1000
MAX_STEPS = 1024
MAX_DEADLINE_S = 300.0
POLL_S = 0.0005  # a probe end's poll interval: short, so a transfer's time is not mostly our sleep
IDLE_END_S = 1.0  # a capture that has steps ends after this long without one (e.g. a prefill burst is over)
TOP_OPS = 15
# aten ops that are the matmuls and fused attention (oneDNN / MKL); kvbaton's C kernels are labelled "kvbaton::"
COMPUTE_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm",
                         "aten::_weight_int8pack_mm", "aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_attention_math", "aten::mkldnn_linear"})
KERNEL_LABEL = "kvbaton::"


class ProbeRefused(ValueError):
    """A probe this worker will not run (out of its caps, or not for its role)."""


@dataclasses.dataclass
class Capture:
    """A step profile in progress (loop thread only)."""

    probe_id: str
    num_steps: int
    deadline: float
    profiler: Any = None  # torch.profiler.profile once the first step starts
    restore: Callable[[], None] | None = None
    steps: int = 0
    step_s: float = 0.0
    last_step: float = 0.0


class WorkerProbes:
    def __init__(self, spec: WorkerSpec, core: EngineCore, connector: ConnectorConfig) -> None:
        """`connector`: the deployment's KV transport settings, which the transport probe uses between scratch
        pools."""
        self.spec, self.name, self.core = spec, spec.name, core
        self._connector = connector
        self._out: queue.SimpleQueue[msgspec.Struct] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: str | None = None  # the probe a thread runs
        self._capture: Capture | None = None

    def commands(self) -> dict[type, Callable[[Any], None]]:
        handlers: dict[type, Callable[[Any], None]] = {
            ProbeReceive: self._receive, ProbeSend: self._send, ProbeAllReduce: self._all_reduce,
            ProbeProfile: self._profile}
        return {kind: functools.partial(self._refusing, handler) for kind, handler in handlers.items()}

    def _refusing(self, handler: Callable[[Any], None], msg: Any) -> None:
        """Run a probe command; one refused is answered at once (the router waits for nothing)."""
        try:
            handler(msg)
        except ProbeRefused as exc:
            self._out.put(ProbeReport(name=self.name, probe_id=msg.probe_id, error=str(exc)))

    @property
    def active(self) -> bool:
        return self._running is not None or self._capture is not None

    def replies(self) -> list[msgspec.Struct]:
        """What to send the router now (loop thread); ends a capture past its deadline or idle."""
        cap = self._capture
        now = time.monotonic()
        if cap is not None and (now > cap.deadline or (cap.steps and now - cap.last_step > IDLE_END_S)):
            self._end_capture()
        out = []
        while not self._out.empty():
            out.append(self._out.get_nowait())
        return out

    def step(self, run: Callable[[], StepResult]) -> StepResult:
        """One engine step, profiled while a capture is on (loop thread)."""
        cap = self._capture
        if cap is None:
            return run()
        if cap.profiler is None:
            cap.restore = label_kernels()
            cap.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            cap.profiler.start()
        start = time.perf_counter()
        try:
            return run()
        finally:
            cap.step_s += time.perf_counter() - start
            cap.steps += 1
            cap.last_step = time.monotonic()
            if cap.steps >= cap.num_steps:
                self._end_capture()

    # ---- the probes --------------------------------------------------------------------------

    def _receive(self, msg: ProbeReceive) -> None:
        blocks = _check_transfers(msg.block_counts, self.core.kv_layout, msg.deadline_s)
        self._start(msg.probe_id, lambda: self._run_receiver(msg, blocks))

    def _send(self, msg: ProbeSend) -> None:
        blocks = _check_transfers(msg.block_counts, self.core.kv_layout, msg.deadline_s)
        self._start(msg.probe_id, lambda: self._run_sender(msg, blocks))

    def _all_reduce(self, msg: ProbeAllReduce) -> None:
        if not (0 <= msg.rank < msg.world_size <= 256 and 1 <= len(msg.sizes) <= MAX_SIZES
                and all(4 <= n <= MAX_SCRATCH_BYTES for n in msg.sizes) and 1 <= msg.iters <= MAX_ITERS):
            raise ProbeRefused("all-reduce probe out of this worker's limits")
        _check_deadline(msg.deadline_s)
        self._start(msg.probe_id, lambda: self._run_all_reduce(msg))

    def _profile(self, msg: ProbeProfile) -> None:
        if not 1 <= msg.num_steps <= MAX_STEPS:
            raise ProbeRefused(f"num_steps must be in [1, {MAX_STEPS}]")
        _check_deadline(msg.max_duration_s)
        with self._lock:
            self._claim(msg.probe_id)
            self._capture = Capture(msg.probe_id, msg.num_steps, time.monotonic() + msg.max_duration_s)

    def _claim(self, probe_id: str) -> None:
        """Under the lock: refuse a second probe while one runs."""
        busy = self._running or (self._capture.probe_id if self._capture is not None else None)
        if busy is not None:
            raise ProbeRefused(f"{self.name} is running probe {busy}; one at a time")

    def _start(self, probe_id: str, run: Callable[[], ProbeReport]) -> None:
        with self._lock:
            self._claim(probe_id)
            self._running = probe_id
        threading.Thread(target=self._run, args=(probe_id, run), name=f"probe-{probe_id}", daemon=True).start()

    def _run(self, probe_id: str, run: Callable[[], ProbeReport]) -> None:
        try:
            report = run()
        except Exception as exc:  # a probe's failure is its report, never the worker's
            logger.warning("%s: probe %s failed: %s", self.name, probe_id, exc)
            report = ProbeReport(name=self.name, probe_id=probe_id, error=f"{type(exc).__name__}: {exc}")
        with self._lock:
            self._running = None
        self._out.put(report)

    # ---- KV transport ------------------------------------------------------------------------

    def _probe_connector(self) -> ConnectorConfig:
        return dataclasses.replace(self._connector, worker_name=f"{self.name}-probe")

    def _run_receiver(self, msg: ProbeReceive, num_blocks: int) -> ProbeReport:
        pools = allocate_pools(self.core.kv_layout, num_blocks)
        receiver = make_receiver(self._probe_connector(), pools)
        try:
            ids = [f"{msg.probe_id}/{i}" for i in range(len(msg.block_counts))]
            for request_id, n in zip(ids, msg.block_counts):
                receiver.expect(request_id, list(range(n)), msg.deadline_s)
            self._out.put(ProbeReady(self.name, msg.probe_id, receiver.address))
            pending, errors = set(ids), []
            deadline = time.monotonic() + msg.deadline_s + 1.0
            while pending and time.monotonic() < deadline:
                result = receiver.poll()
                pending.difference_update(result.completed)
                for request_id, reason in result.failed:
                    pending.discard(request_id)
                    errors.append(reason)
                time.sleep(POLL_S)
            error = errors[0] if errors else (f"{len(pending)} transfers did not arrive" if pending else None)
            return ProbeReport(name=self.name, probe_id=msg.probe_id, error=error)
        finally:
            receiver.close()
            pools.close()

    def _run_sender(self, msg: ProbeSend, num_blocks: int) -> ProbeReport:
        config = self._probe_connector()
        layout = self.core.kv_layout
        pools = pool_allocator(config, sending=True)(layout, num_blocks)
        sender = make_sender(config, pools)
        timings: list[Timing] = []
        deadline = time.monotonic() + msg.deadline_s
        try:
            for i, n in enumerate(msg.block_counts):
                request_id = f"{msg.probe_id}/{i}"
                start = time.perf_counter()
                sender.begin(TransferSpec(request_id=request_id, src_block_ids=list(range(n)),
                                          dst_block_ids=list(range(n)), receiver=msg.receiver, layout=msg.layout,
                                          deadline_s=max(0.1, deadline - time.monotonic())))
                for layer in range(layout.num_layers):  # back to back: the transport's own speed, no compute
                    sender.save_layer(layer, [request_id])
                error = _wait_sent(sender, request_id, deadline)
                if error is not None:
                    return ProbeReport(name=self.name, probe_id=msg.probe_id, error=error, timings=timings)
                timings.append(Timing(n * layout.bytes_per_block, time.perf_counter() - start, n))
            return ProbeReport(name=self.name, probe_id=msg.probe_id, timings=timings)
        finally:
            sender.close()
            pools.close()

    # ---- all-reduce --------------------------------------------------------------------------

    def _run_all_reduce(self, msg: ProbeAllReduce) -> ProbeReport:
        from kvbaton.parallel.rendezvous import meet  # NOTE: torch.distributed, imported when a probe first runs

        timeout = timedelta(seconds=msg.deadline_s)
        host = self.spec.host
        if msg.rank == 0:
            meeting = meet(host, 0, msg.world_size, True, timeout)
            self._out.put(ProbeReady(self.name, msg.probe_id, f"{host}:{meeting.store.port}"))
        else:
            store_host, _, port = msg.store.rpartition(":")
            meeting = meet(store_host, int(port), msg.world_size, False, timeout)
        try:
            return self._all_reduce_on(meeting.store, msg, timeout)
        finally:
            meeting.close()

    def _all_reduce_on(self, store: Any, msg: ProbeAllReduce, timeout: timedelta) -> ProbeReport:
        import torch.distributed as dist

        host = self.spec.host
        gloo: Any = dist.ProcessGroupGloo  # NOTE: its options and allreduce are missing from torch's type stubs
        options = gloo._Options()
        options._devices = [gloo.create_device(hostname=host)]
        options._timeout = timeout
        group = gloo(dist.PrefixStore(msg.probe_id, store), msg.rank, msg.world_size, options)
        timings = []
        for size in msg.sizes:
            buffer = torch.ones(max(1, size // 4), dtype=torch.float32)  # [size / 4] fp32
            group.allreduce([buffer]).wait()  # warm-up: connections, and every rank at the start line
            for _ in range(msg.iters):
                start = time.perf_counter()
                group.allreduce([buffer]).wait()
                timings.append(Timing(buffer.numel() * 4, time.perf_counter() - start))
        group.allreduce([torch.zeros(1)]).wait()  # a barrier: rank 0's store must outlive every rank's use
        del group
        return ProbeReport(name=self.name, probe_id=msg.probe_id, timings=timings)

    # ---- step profile ------------------------------------------------------------------------

    def _end_capture(self) -> None:
        cap, self._capture = self._capture, None
        assert cap is not None
        if cap.profiler is None:
            self._out.put(ProbeReport(name=self.name, probe_id=cap.probe_id, error=(
                "no engine step ran during the capture: the worker had no requests (send it traffic)")))
            return
        try:
            cap.profiler.stop()
        finally:
            if cap.restore is not None:
                cap.restore()
        profile = summarize(cap.profiler.key_averages(), cap.steps, cap.step_s)
        self._out.put(ProbeReport(name=self.name, probe_id=cap.probe_id, profile=profile))


def summarize(averages: Any, num_steps: int, step_s: float) -> StepProfile:
    """The profiler's per-op averages as top ops by self time, and the time in compute kernels."""
    ops = [OpTime(e.key, e.self_cpu_time_total / 1e6, e.count) for e in averages]
    ops.sort(key=lambda op: op.self_s, reverse=True)
    compute = sum(op.self_s for op in ops if is_compute_op(op.name))
    return StepProfile(num_steps=num_steps, step_s=step_s, op_self_s=sum(op.self_s for op in ops),
                       compute_s=compute, top_ops=ops[:TOP_OPS])


def is_compute_op(name: str) -> bool:
    return name.startswith(KERNEL_LABEL) or name in COMPUTE_OPS or name.startswith("aten::mkldnn_")


def label_kernels() -> Callable[[], None]:
    """Wrap each of kvbaton's C kernel classes' calls in a profiler range named after it; returns the undo.
    NOTE: class-level, for one capture, on the loop thread (the only caller of the kernels): the kernels are
    ctypes calls, invisible to torch.profiler, and their time is what the compute step is asked about."""
    import kvbaton.kernels as kernels

    call = "__call__"
    saved: list[tuple[type, Any]] = []
    for name in kernels.__all__:
        cls = getattr(kernels, name)
        if isinstance(cls, type) and call in vars(cls):
            original = vars(cls)[call]
            setattr(cls, call, _labelled(KERNEL_LABEL + name, original))
            saved.append((cls, original))

    def restore() -> None:
        for cls, original in saved:
            setattr(cls, call, original)

    return restore


def _labelled(label: str, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def labelled(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return call(*args, **kwargs)

    return labelled


def _wait_sent(sender: Any, request_id: str, deadline: float) -> str | None:
    """Poll until the receiver confirmed `request_id` (None) or it failed (why)."""
    while time.monotonic() < deadline + 1.0:
        result = sender.poll()
        if request_id in result.completed:
            return None
        for failed_id, reason in result.failed:
            if failed_id == request_id:
                return reason
        time.sleep(POLL_S)
    sender.abort(request_id)
    return "the probe's deadline passed before the receiver confirmed the transfer"


def _check_transfers(block_counts: list[int], layout: KVLayout, deadline_s: float) -> int:
    """The scratch pools' size in blocks, if the transfers are within this worker's caps."""
    _check_deadline(deadline_s)
    if not 1 <= len(block_counts) <= MAX_TRANSFERS or min(block_counts) < 1:
        raise ProbeRefused(f"a transfer probe takes 1 to {MAX_TRANSFERS} transfers of at least one block")
    num_blocks = max(block_counts)
    if num_blocks * layout.bytes_per_block > MAX_SCRATCH_BYTES:
        raise ProbeRefused(f"{num_blocks} blocks exceed this worker's {MAX_SCRATCH_BYTES >> 20} MiB probe limit")
    return num_blocks


def _check_deadline(deadline_s: float) -> None:
    if not 0 < deadline_s <= MAX_DEADLINE_S:
        raise ProbeRefused(f"a probe's deadline must be in (0, {MAX_DEADLINE_S:g}] s")

