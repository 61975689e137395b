"""Typed messages between the router (in the frontend) and its workers; signed by `kvbaton.wire`.

    router -> worker:  AddRequest, PrepareReceive, StartDecode, CancelReceive, AbortRequests, Drain, Shutdown,
                       CheckIntegrity, EncodeImages (encoder workers); the diagnostics' ProbeReceive, ProbeSend,
                       ProbeAllReduce, ProbeProfile
    worker -> router:  WorkerHello, Heartbeat, WorkerOutputs, RequestFailed, ReceiveReady, ReceiveRefused,
                       TransferFailed, Drained, IntegrityReport, ImagesEncoded (encoder workers); the diagnostics'
                       ProbeReady, ProbeReport

Request ids on this channel are the router's *attempt* ids (`<client id>#<attempt>`), so when
a request is re-dispatched after a failure, late messages about an earlier attempt are told
apart and dropped. Each message's kind is its msgspec tag; records of more than four fields are
built with keywords.
"""

from __future__ import annotations

import msgspec

from kvbaton.kv.layout import KVLayout
from kvbaton.messages.worker_spec import WorkerRole
from kvbaton.sched.info import AfdStats, EngineInfo, EngineStats
from kvbaton.sched.outputs import EngineCoreOutput, FinishReason, RemoteDecode
from kvbaton.sched.sampling_params import SamplingParams

# ---- router -> worker ----------------------------------------------------------------------


class ImagePixels(msgspec.Struct, frozen=True):
    """A decoded image (`mm/images.py:DecodedImage`): the frontend decoded and hashed it, the worker encodes it."""

    digest: str
    width: int
    height: int
    rgb: bytes


class ImageEmbedding(msgspec.Struct, frozen=True, kw_only=True):
    """An image's embeddings, as an encoder worker computed them (`mm/embeddings.py`): `rows` placeholder
    positions of `cols` (the text model's hidden size) values of `dtype`, row-major in `data`."""

    digest: str  # the decoded pixels' (`ImagePixels.digest`): the prefix cache's hash chain and the encoder caches
    dtype: str
    rows: int
    cols: int
    data: bytes
    width: int = 0  # the image's size (Qwen2-VL: its placeholders' grid, their multimodal RoPE positions)
    height: int = 0


class AddRequest(msgspec.Struct, tag="add", kw_only=True):
    """Compute this request here. With `remote_decode`, only its prompt (prefill role). The images whose
    placeholders the prompt holds, in order, come as `images` (pixels: encoded where the prompt is computed,
    `--encode 0`) or as `embeddings` (an encoder worker's), never both."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    remote_decode: RemoteDecode | None = None
    images: list[ImagePixels] = []
    embeddings: list[ImageEmbedding] = []


class PrepareReceive(msgspec.Struct, tag="prepare", kw_only=True):
    """Decode role: reserve blocks for this prompt's KV; answer ReceiveReady or ReceiveRefused."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    deadline_s: float = 30.0
    # its images' embeddings (E/P/D): the received KV was computed from them, and a preempted request computes its
    # prompt again here
    embeddings: list[ImageEmbedding] = []


class StartDecode(msgspec.Struct, tag="start"):
    """The prefill worker sampled the first token; decode on once the KV is in."""

    request_id: str
    first_token_id: int


class CancelReceive(msgspec.Struct, tag="cancel"):
    request_ids: list[str]


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    reason: FinishReason = FinishReason.ABORT  # ABORT (client gone) | STOP (the frontend saw a stop string)


class Drain(msgspec.Struct, tag="drain"):
    """Take no new requests; report Drained once nothing is in flight."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class CheckIntegrity(msgspec.Struct, tag="check"):
    """Run the KV pool's integrity check now; answer IntegrityReport."""


class ProbeReceive(msgspec.Struct, tag="probe_receive", kw_only=True):
    """Take scratch KV transfers of these block counts over this worker's transport, into scratch pools (never
    the engine's); answer ProbeReady (the probe receiver's address), then ProbeReport."""

    probe_id: str
    block_counts: list[int]
    deadline_s: float


class ProbeSend(msgspec.Struct, tag="probe_send", kw_only=True):
    """Send scratch KV transfers of these block counts, one after another, to the probe receiver at `receiver`
    (whose pools are laid out as `layout`); answer ProbeReport with each one's time."""

    probe_id: str
    receiver: str
    layout: KVLayout
    block_counts: list[int]
    deadline_s: float


class ProbeAllReduce(msgspec.Struct, tag="probe_all_reduce", kw_only=True):
    """Join a gloo group of `world_size` and time all-reduces of these sizes (bytes). Rank 0 gets `store` ""
    and hosts the group's store, answering ProbeReady with its host:port; the others are sent that."""

    probe_id: str
    rank: int
    world_size: int
    store: str
    sizes: list[int]
    iters: int
    deadline_s: float


class ProbeProfile(msgspec.Struct, tag="probe_profile", kw_only=True):
    """Profile this worker's next `num_steps` engine steps (torch.profiler), for at most `max_duration_s`;
    answer ProbeReport."""

    probe_id: str
    num_steps: int
    max_duration_s: float


class EncodeImages(msgspec.Struct, tag="encode_images", kw_only=True):
    """Encoder worker: encode these images of a request (its attempt id); answer ImagesEncoded, or RequestFailed
    for an image the processor or tower refuses. AbortRequests drops what is still queued."""

    request_id: str
    images: list[ImagePixels]


ToWorker = (AddRequest | PrepareReceive | StartDecode | CancelReceive | AbortRequests | Drain | Shutdown
            | CheckIntegrity | EncodeImages | ProbeReceive | ProbeSend | ProbeAllReduce | ProbeProfile)

# ---- worker -> router ----------------------------------------------------------------------


class ExchangeLoad(msgspec.Struct, frozen=True, kw_only=True):
    """An expert worker's exchanges since it started: what it computed for the attention workers, and for how long
    (the rest of `alive_s` it waited for rows: the expert side's bubble)."""

    exchanges: int
    rows: int  # token-expert pairs computed
    bytes_in: int
    bytes_out: int
    busy_s: float
    alive_s: float
    refused_frames: int
    shared: int = 0  # exchanges whose rows came through same-host shared memory
    epoch: int = 0  # the newest expert placement it holds (EPLB moves experts: each placement is an epoch)
    owns: dict[int, list[int]] = msgspec.field(default_factory=dict)  # per MoE layer, its slots' experts at `epoch`

    @property
    def idle_fraction(self) -> float:
        return AfdStats(expert_busy_s=self.busy_s, expert_alive_s=self.alive_s).expert_bubble


class EncodeLoad(msgspec.Struct, frozen=True, kw_only=True):
    """An encoder worker's queue and what it encoded since it started (its images/s: `encoded / busy_s`)."""

    queued_images: int
    encoded: int  # images run through the tower (cache hits not counted)
    busy_s: float
    alive_s: float


class WorkerLoad(msgspec.Struct):
    stats: EngineStats
    num_receiving: int  # decode role: transfers being received
    num_sending: int  # prefill role: transfers being sent
    # NOTE: heartbeats (their own thread and socket) and outputs can arrive out of order: the router
    # keeps the load with the highest `seq`, so a late heartbeat never rolls its view back.
    seq: int = 0
    exchange: ExchangeLoad | None = None  # an expert worker's (it has no engine: `stats` stays empty)
    encode: EncodeLoad | None = None  # an encoder worker's (`stats` holds only its encoder cache's counters)


class ExpertsServed(msgspec.Struct, frozen=True, kw_only=True):
    """What an expert worker serves the attention workers: where, as which rank of the expert pool, which experts."""

    address: str  # its exchange socket (tcp://host:port)
    rank: int
    size: int
    experts: list[int]  # the routed experts it owns, in every MoE layer


class WorkerHello(msgspec.Struct, tag="hello", kw_only=True):
    name: str
    role: WorkerRole
    index: int
    pid: int
    address: str  # the worker's command socket
    info: EngineInfo | None  # None: a worker without an engine core (an expert worker)
    layout: KVLayout | None  # the same
    receiver: str | None  # its KV receiver's address (decode / both roles)
    load: WorkerLoad
    experts: ExpertsServed | None = None  # an expert worker's
    startup: dict[str, float] = {}  # where its start went: seconds per phase, in order (`platform.startup`)


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    name: str
    load: WorkerLoad


class WorkerOutputs(msgspec.Struct, tag="outputs"):
    name: str
    outputs: list[EngineCoreOutput]
    load: WorkerLoad


class RequestFailed(msgspec.Struct, tag="failed"):
    """The worker refused a request (invalid input: the client gets a 400), or a step failed while
    computing it (`in_step`: the router may try it once more elsewhere before giving up)."""

    name: str
    request_id: str
    message: str
    in_step: bool = False


class ReceiveReady(msgspec.Struct, tag="ready"):
    name: str
    request_id: str
    num_cached_tokens: int  # prompt tokens already in this worker's prefix cache
    dst_block_ids: list[int]  # where the rest goes


class ReceiveRefused(msgspec.Struct, tag="refused"):
    name: str
    request_id: str
    reason: str


class TransferFailed(msgspec.Struct, tag="transfer_failed"):
    """A KV transfer ended without the data (timeout, peer gone, layout mismatch)."""

    name: str
    request_id: str
    reason: str


class ImagesEncoded(msgspec.Struct, tag="images_encoded", kw_only=True):
    """An encoder worker's answer to EncodeImages: each image's embeddings, in the order asked."""

    name: str
    request_id: str
    embeddings: list[ImageEmbedding]


class Drained(msgspec.Struct, tag="drained"):
    name: str


class IntegrityReport(msgspec.Struct, tag="integrity"):
    name: str
    error: str | None  # None: the check passed
    kv_cache_usage: float  # fraction of blocks referenced (0 when nothing is in flight)
    num_requests: int  # requests holding blocks: running, waiting, held for sending, receiving


class ProbeReady(msgspec.Struct, tag="probe_ready"):
    """A probe's listening end is up: a probe receiver's address, an all-reduce store's host:port."""

    name: str
    probe_id: str
    address: str


class Timing(msgspec.Struct):
    """One measured operation: a KV transfer of `num_blocks` (0: an all-reduce) moving `num_bytes`."""

    num_bytes: int
    seconds: float
    num_blocks: int = 0


class OpTime(msgspec.Struct):
    name: str
    self_s: float  # time in the op itself, not in ops it called
    count: int


class StepProfile(msgspec.Struct, kw_only=True):
    num_steps: int
    step_s: float  # wall time of the profiled steps
    op_self_s: float  # time in any op the profiler saw
    compute_s: float  # of which in compute kernels: kvbaton's C kernels, GEMMs, fused attention
    top_ops: list[OpTime]  # by self time, the largest first


class ProbeReport(msgspec.Struct, tag="probe_report", kw_only=True):
    """A probe's result on one worker (`error`: why it has none, or only some)."""

    name: str
    probe_id: str
    error: str | None = None
    timings: list[Timing] = []
    profile: StepProfile | None = None


FromWorker = (WorkerHello | Heartbeat | WorkerOutputs | RequestFailed | ReceiveReady | ReceiveRefused
              | TransferFailed | ImagesEncoded | Drained | IntegrityReport | ProbeReady | ProbeReport)
PROBE_REPLIES = (ProbeReady, ProbeReport)
