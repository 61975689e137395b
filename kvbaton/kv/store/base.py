"""The contract of a KV tier, and what the scheduler sees of the whole store (no torch here).

A tier maps a key (`keys.StoreKeys.key`) to one block's payload (every layer's rows of the
block, layer after layer). Every call may fail inside the tier (a dead server, a full disk, a
corrupt file): a failure is a miss or a skipped write, counted in `TierStats`, never an exception
out of the tier, so a broken tier costs recomputation, not requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvbaton.kv.hashing import BlockHash

# A sink reads a payload while the tier keeps it valid (e.g. under the shm arena's lock); a filler
# writes one into the buffer the tier hands it. Both copy rows straight between the tier's memory
# and the pool, so a block crosses no private staging buffer in shared memory.
PayloadSink = Callable[[memoryview], None]
PayloadFiller = Callable[[memoryview], None]


@dataclass
class TierStats:
    """One tier's counters since it opened (monotonic, except occupancy)."""

    name: str
    capacity_bytes: int
    shared: bool = False  # one store every worker uses (shm, redis): occupancy is counted once across workers
    used_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    evictions: int = 0
    expirations: int = 0
    corrupt: int = 0  # MAC or header mismatches (`records`), each counted as a miss too
    errors: int = 0  # I/O failures (server gone, disk full); each degraded to a miss or a skipped write
    dropped_writes: int = 0  # writes skipped because the writer was behind

    @property
    def read_bandwidth(self) -> float:
        """Bytes per second of the reads so far (0.0 before the first)."""
        return self.bytes_read / self.read_seconds if self.read_seconds > 0 else 0.0


class LoadPlan(NamedTuple):
    """What the store offers for a request's blocks past its local hit."""

    num_blocks: int  # how many to load rather than recompute
    waits_on_io: bool = False  # some of them come from a tier that waits on a device or the network (disk, redis)


class KVTier(ABC):
    """One tier. Thread-safe: `put` may return before the bytes land (a tier with a writer thread),
    and everything else may be called from the engine thread while that thread writes."""

    name: str
    in_memory: bool = False  # a load is a copy from memory (shm); else it waits on a device or the network

    def __init__(self, payload_bytes: int) -> None:
        self.payload_bytes = payload_bytes  # every block's payload has exactly this many bytes

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the tier holds (unexpired)."""

    @abstractmethod
    def get(self, key: bytes, sink: PayloadSink) -> bool:
        """Call `sink` with the block's payload and return True; False (sink not called) on a miss,
        an expired block, a MAC mismatch or an I/O failure."""

    @abstractmethod
    def put(self, key: bytes, fill: PayloadFiller) -> bool:
        """Store a block: `fill` writes its payload into the buffer given (called before put returns,
        so the caller's rows may change afterwards). False when the tier skipped it (error, writer
        behind); a key already present is refreshed, not written again."""

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the counters."""

    def check_integrity(self) -> None:
        """Raise AssertionError if the tier's bookkeeping is inconsistent (capacity, index vs data)."""
        return None

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until writes put so far have landed (or failed)."""
        return None

    def close(self) -> None:
        """Stop background threads and release handles (the stored blocks stay, as each tier's
        lifetime rules say)."""
        return None


class PrefixStore(Protocol):
    """What the scheduler asks of the store at admission (torch-free: only hashes and block ids)."""

    def plan(self, block_hashes: Sequence[BlockHash]) -> LoadPlan:
        """How many of these blocks (a request's full blocks after its local prefix-cache hit, in
        order) to load rather than recompute: a prefix the tiers hold, cut where loading would be
        slower than computing; and whether that load waits on I/O."""
        ...

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """Load block `block_hashes[i]` into pool block `block_ids[i]`, in order, stopping at the first
        that fails; returns how many loaded. Blocks after that hold garbage: the caller recomputes them."""
        ...

    def start_load(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> int:
        """`load` in the background; a ticket that `finished_loads` reports with the count loaded."""
        ...

    def finished_loads(self) -> list[tuple[int, int]]:
        """(ticket, blocks loaded) of the background loads that ended since the last call."""
        ...

    def wait_for_load(self, timeout_s: float) -> None:
        """Block until a background load ends, or `timeout_s` passes."""
        ...
