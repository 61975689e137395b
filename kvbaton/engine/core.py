"""The engine core: scheduler + model runner over one paged KV pool, and (in a disaggregated
worker) the KV hand-off to or from other workers. It knows token ids, never text, so the same
core runs in-process (`LLMEngine`) or inside a worker process (`kvbaton.worker.main`).

Process-wide settings (thread count, GC freezing) are not made here but by the process entry
points (`kvbaton.platform.process`): a core is one object, not the process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbaton.config import KV_CACHE_DTYPES, ConfigError, EngineConfig, ModelConfig
from kvbaton.engine.micro_batches import MicroBatchChooser
from kvbaton.engine.model_runner import ModelRunner
from kvbaton.engine.structured.admission import GrammarAdmission
from kvbaton.engine.structured.grammar import GrammarCompiler
from kvbaton.engine.structured.matchers import GrammarMatchers
from kvbaton.engine.transfers import KVHandoff, Reservation
from kvbaton.kernels.build import sources_digest
from kvbaton.kernels.pack_cache import PACK_CACHE_ENV, PackCache, pack_key
from kvbaton.kv.connectors import ConnectorConfig, make_receiver, make_sender, pool_allocator
from kvbaton.kv.hashing import BlockHash
from kvbaton.kv.layout import QUANTIZED, KVLayout
from kvbaton.kv.pools import KVPools, allocate_pools
from kvbaton.kv.store.factory import build_store
from kvbaton.layers.compute_paths import apply_compute_plan, plan_compute
from kvbaton.mm.cached_encoder import CachedEncoder
from kvbaton.mm.images import DecodedImage
from kvbaton.mm.mrope import mrope_positions
from kvbaton.mm.placeholders import image_spans
from kvbaton.models.families import CausalLM
from kvbaton.models.loader import load_model
from kvbaton.parallel.afd.client import ExpertPoolClient
from kvbaton.parallel.expert_parallel import ExpertParallelGroup
from kvbaton.parallel.expert_stats import ExpertStats
from kvbaton.platform.cpu import FEATURES, detect_cpu
from kvbaton.platform.startup import StartupClock
from kvbaton.sched.info import AfdStats, DecodeStepTimes, EngineInfo, EngineStats, ExpertLoad, validate_request
from kvbaton.sched.kv_cache_manager import KVCacheManager
from kvbaton.sched.outputs import (
    FinishReason,
    RemoteDecode,
    RequestFailure,
    SchedulerOutput,
    StepResult,
    TransferFailure,
)
from kvbaton.sched.request import Request, RequestStatus
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.sched.scheduler import Scheduler
from kvbaton.sched.step_shape import StepShape
from kvbaton.sched.step_trace import StepTrace
from kvbaton.wire import SECRET_ENV

logger = logging.getLogger(__name__)

# A batch that raises fails its requests; this many in a row and the engine, not a request, is at fault.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# A step of this many tokens is mostly prefill: its time per token prices recomputing against loading KV.
PREFILL_SAMPLE_TOKENS = 64
# With only background loads in flight, a step waits this long for one to land instead of spinning.
LOAD_WAIT_S = 0.05


@dataclass(frozen=True)
class KVTransferConfig:
    """How a disaggregated worker's engine moves KV: over `connector`, sending (prefill role) and/or
    receiving (decode role)."""

    connector: ConnectorConfig
    send: bool = False
    receive: bool = False


def trace_role(kv_transfer: KVTransferConfig | None) -> str:
    """What a step trace calls this engine's part in a deployment: its served steps differ by it (a prefill worker
    runs long prompts while its decode peer computes beside it)."""
    if kv_transfer is None or kv_transfer.send == kv_transfer.receive:
        return "both"
    return "prefill" if kv_transfer.send else "decode"


def _grammar_compiler(model_dir: Path, info: EngineInfo, runner: ModelRunner) -> GrammarCompiler:
    """The grammar compiler for this model's tokenizer, and the runner's matchers over it (built with the
    first structured request, or at a served worker's start)."""
    from kvbaton.text.tokenizer import tokenizer_json

    compiler = GrammarCompiler.for_tokenizer(functools.partial(tokenizer_json, model_dir), info.vocab_size,
                                             info.eos_token_ids)
    runner.grammars = GrammarMatchers(compiler, info.vocab_size, info.eos_token_ids,
                                      num_threads=max(1, torch.get_num_threads()))
    return compiler


def resolve_dtype(name: str) -> torch.dtype:
    return {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def model_kv_layout(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVLayout:
    """What the model caches per layer, in `kv_cache_dtype` (auto: the model's): the Llama family K and V of
    every KV head; multi-head latent attention (DeepSeek-V3) one latent row and rope key per token."""
    kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or str(dtype).removeprefix("torch.")
    if cfg.mla is not None:
        if kv_dtype in QUANTIZED:
            raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: KV quantization is per head of K and V, and "
                              f"{cfg.architecture}'s multi-head latent attention caches one shared latent row per "
                              "token instead; use auto, bfloat16 or float32")
        return KVLayout.mla(num_layers=cfg.num_hidden_layers, block_size=block_size,
                            kv_lora_rank=cfg.mla.kv_lora_rank, rope_dim=cfg.mla.qk_rope_head_dim, dtype=kv_dtype)
    return KVLayout.standard(num_layers=cfg.num_hidden_layers, block_size=block_size,
                             num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=kv_dtype)


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: Path, eos_token_ids: tuple[int, ...],
                 kv_transfer: KVTransferConfig | None = None, startup: StartupClock | None = None) -> None:
        clock = startup or StartupClock()  # where the start goes (a worker's is logged and sent with its hello)
        self.config = config
        self.model_config = ModelConfig.from_dir(model_dir)
        self.dtype = resolve_dtype(config.dtype)
        limit = self.model_config.max_position_embeddings
        max_model_len = min(config.max_model_len or limit, limit)
        block_size = config.cache.block_size
        # NOTE: before the weights load, so a layout the model cannot have is refused at once
        self.kv_layout = model_kv_layout(self.model_config, block_size, self.dtype, config.cache.kv_cache_dtype)
        if config.deterministic and self.kv_layout.is_mla:
            raise ConfigError(f"--deterministic runs attention through kvbaton's batch-invariant C kernel, which reads "
                              f"per-head K and V; {self.model_config.architecture}'s multi-head latent attention "
                              "has none (its attention is PyTorch's): leave --deterministic off")
        self.compute_plan = plan_compute(self.dtype, config.compute_path, config.deterministic, config.kernels)
        clock.lap("config")
        model = load_model(model_dir, self.dtype, max_model_len)
        clock.lap("weights")
        # a vision-language model's images are encoded here (`--encode 0`): its tower and projector
        self.vision_encoder = (CachedEncoder.load(model_dir, self.dtype, config.cache.encoder_cache_mb,
                                                  config.kv_store) if self.model_config.vision else None)
        self.encoder_cache = self.vision_encoder.cache if self.vision_encoder is not None else None
        self.expert_stats = ExpertStats.of(model, config.expert_load_window_steps)  # None: a dense model
        # before packing: only local experts get packed
        self.expert_parallel = self._join_expert_parallel(model_dir)
        if self.expert_parallel is not None:
            clock.lap("expert parallel")  # its rendezvous and shard
        afd = config.attention_ffn
        self.micro_batch_chooser = MicroBatchChooser() if afd is not None and afd.micro_batches == 0 else None
        self.expert_pool = self._join_expert_pool(model)
        if self.expert_pool is not None:
            clock.lap("expert pool")
        apply_compute_plan(model, self.compute_plan, self._pack_cache(model_dir))
        clock.lap("compute plan")
        num_blocks = config.cache.num_blocks or max(
            1, int(config.cache.kv_cache_memory_gb * 2**30 // self.kv_layout.bytes_per_block))
        self.info = EngineInfo(max_model_len=max_model_len, vocab_size=self.model_config.vocab_size,
                               num_blocks=num_blocks, block_size=block_size,
                               max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                               enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
                               eos_token_ids=eos_token_ids, compute_path=self.compute_plan.summary(),
                               vision=self.model_config.vision, embedding_row_bytes=(
                                   self.model_config.hidden_size * self.dtype.itemsize if self.model_config.vision
                                   else 0))
        pools = self._allocate_pools(num_blocks, kv_transfer)
        self.store = build_store(config.kv_store, model_dir, pools)
        clock.lap("kv pools")
        write_back = self.store is not None and config.kv_store.write_policy == "write-back"
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                                       on_evict=self.store.save_evicted if write_back and self.store else None)
        self._write_through = self.store is not None and not write_back
        scheduler_config = config.scheduler
        if self.expert_parallel is not None:  # every rank runs each step's MoE exchange: steps stay in lockstep
            scheduler_config = dataclasses.replace(scheduler_config, decode_burst=1)
        if config.attention_ffn is not None and config.attention_ffn.micro_batches != 1:
            # NOTE: a burst runs in the C layer loop, whose exchanges take the whole batch: no ping-pong there yet
            scheduler_config = dataclasses.replace(scheduler_config, decode_burst=1)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache, max_model_len, self.store,
                                   background_loads=config.kv_store.background_loads)
        self.handoff, self.runner = self._build_runner(model, pools, kv_transfer)
        self._consecutive_step_failures = 0
        self._unsaved: list[tuple[BlockHash, int]] = []  # computed blocks the tiers do not have yet
        self.model_dir = model_dir
        # NOTE: the factory must not hold `self`: a cycle through the core would outlive it (the process entry
        # points freeze the GC's generations, so a cycle is never collected).
        self.grammars = GrammarAdmission(functools.partial(_grammar_compiler, model_dir, self.info, self.runner))
        if config.compile:
            from kvbaton.engine.compile import compile_model

            compile_model(self.runner)
        self.step_trace = self._open_step_trace(kv_transfer) if config.step_trace_dir else None
        self._decode_steps = DecodeStepTimes()  # what local prefills cost decoding (stats())
        clock.lap("engine")
        self.startup = clock

    def cost_description(self) -> dict[str, object]:
        """What a step's cost depends on besides its shape: the head of a step profile and of a step trace."""
        cpu = detect_cpu()
        return {"model": self.model_dir.name, "model_path": str(self.model_dir),
                "dtype": str(self.dtype).removeprefix("torch."), "kv_cache_dtype": self.kv_layout.dtype,
                "threads": torch.get_num_threads(), "kernels": self.config.kernels,
                "compute_path": self.compute_plan.summary(),
                "cpu": {"model_name": cpu.model_name, "arch": cpu.arch, "num_cores": cpu.num_cores,
                        "features": [name for flag, name in FEATURES.items() if cpu.has(flag)],
                        "summary": cpu.summary()},
                "torch": torch.__version__, "block_size": self.info.block_size, "num_blocks": self.info.num_blocks,
                "max_model_len": self.info.max_model_len,
                "kv_bytes_per_token": self.kv_layout.bytes_per_block // self.info.block_size}

    def _open_step_trace(self, kv_transfer: KVTransferConfig | None) -> StepTrace:
        assert self.config.step_trace_dir is not None
        header = {**self.cost_description(), "role": trace_role(kv_transfer),
                  "max_num_batched_tokens": self.info.max_num_batched_tokens}
        return StepTrace.in_dir(self.config.step_trace_dir, header)

    def _join_expert_parallel(self, model_dir: Path) -> ExpertParallelGroup | None:
        ep = self.config.expert_parallel
        if ep is None:
            return None
        if self.expert_stats is None:
            raise ConfigError("expert parallelism needs a model with sparse-expert (MoE) layers")
        group = ExpertParallelGroup(ep)
        group.shard(self.expert_stats, model_dir, self.model_config.hidden_size)
        return group

    def _join_expert_pool(self, model: torch.nn.Module) -> ExpertPoolClient | None:
        """An attention worker's expert pool (attention/FFN disaggregation): connect to its expert workers, learn
        their placement, and send every MoE layer's routed experts there (their weights here are freed)."""
        afd = self.config.attention_ffn
        if afd is None:
            return None
        if self.expert_stats is None:
            raise ConfigError("attention/FFN disaggregation needs a model with sparse-expert (MoE) layers")
        secret = os.environ.get(SECRET_ENV)
        if not secret:
            raise ConfigError(f"an attention worker signs its exchanges with the cluster secret: set {SECRET_ENV} "
                              "(the expert workers' too)")
        layers = self.expert_stats.layers
        moe = layers[0].block.moe
        pool = ExpertPoolClient(afd, secret.encode(), f"attention-{afd.index}", self.model_config.hidden_size,
                                self.dtype, moe.num_experts, [layer.index for layer in layers],
                                max_rows=self.config.scheduler.max_num_batched_tokens * moe.top_k,
                                num_groups=moe.num_groups)
        for layer in layers:
            layer.block.use_remote_experts(pool.dispatcher(layer.index))
        model.micro_batches = afd.micro_batches or 1  # type: ignore[assignment]
        return pool

    def prefault_kv_pools(self) -> None:
        """Back the KV pools with memory now (`KVPools.prefault`): a served worker's, once it serves."""
        if not self.runner.pools.prefault():
            logger.debug("the KV pools' pages are taken on first use (no MADV_POPULATE_WRITE here)")

    def _pack_cache(self, model_dir: Path) -> PackCache | None:
        """Packed layouts kept on disk from an earlier start of this model under this plan (`kernels.pack_cache`);
        None with KVBATON_PACK_CACHE=0 (each start packs: what the cold-start benchmark compares against)."""
        if os.environ.get(PACK_CACHE_ENV, "1") == "0":
            return None
        extra = {"dtype": str(self.dtype), "expert_parallel": repr(self.config.expert_parallel)}
        return PackCache.for_model(model_dir, pack_key(model_dir, self.compute_plan.summary(), sources_digest(), extra))

    def _allocate_pools(self, num_blocks: int, transfer: KVTransferConfig | None) -> KVPools:
        """A sending transport may want the pools in shared memory."""
        allocate = allocate_pools if transfer is None else pool_allocator(transfer.connector, sending=transfer.send)
        return allocate(self.kv_layout, num_blocks)

    def _build_runner(self, model: CausalLM, pools: KVPools,
                      transfer: KVTransferConfig | None) -> tuple[KVHandoff, ModelRunner]:
        """The connector halves over the pools, then the runner that computes into them and sends from them."""
        sender = make_sender(transfer.connector, pools) if transfer is not None and transfer.send else None
        receiver = make_receiver(transfer.connector, pools) if transfer is not None and transfer.receive else None
        runner = ModelRunner(model, pools, self.config.seed, self.info.eos_token_ids,
                             attention=self.compute_plan.attention, kv_sender=sender)
        return KVHandoff(self.scheduler, sender, receiver), runner

    # ---- requests ------------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                    remote_decode: RemoteDecode | None = None, image_digests: Sequence[str] = (),
                    image_sizes: Sequence[tuple[int, int]] = ()) -> Request:
        """A request for this engine (its EOS ids), as a worker receives one from the router; with images, their
        placeholders found in the prompt (InvalidRequestError unless they fit; `image_sizes`, each image's width
        and height, where its size decides them)."""
        spans = image_spans(self.model_config.vision, prompt_token_ids, image_digests, image_sizes)
        return Request(request_id, prompt_token_ids, params, eos_token_ids=self.info.eos_token_ids, priority=priority,
                       remote_decode=remote_decode, image_spans=spans)

    def validate(self, req: Request) -> None:
        validate_request(self.info, req.prompt_token_ids, req.sampling_params, req.priority)

    def validate_grammar(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError if `params`' grammar does not compile; blocks until compiled (the offline
        API's check before it queues anything; a worker never blocks its loop on it)."""
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output).result()

    def add_request(self, req: Request, images: Sequence[DecodedImage] = (),
                    embeddings: Sequence[tuple[str, torch.Tensor]] = ()) -> None:
        """Queue `req`. The images of its `image_spans`, in order, come as `images` (pixels: encoded now, or found
        in the encoder cache) or as `embeddings` (digest and embeddings: an encoder worker's, E/P/D); the runner
        puts them in place of their placeholders."""
        self.validate(req)
        took = self._take_images(req, images, embeddings)
        try:
            self._queue(req)
        except Exception:
            if took:  # (not another request's: a duplicate id is refused before any image is taken)
                self._drop_images(req.request_id)
            raise

    def _take_images(self, req: Request, images: Sequence[DecodedImage],
                     embeddings: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Hold `req`'s images' embeddings for the runner while it lives (a preempted request computes its prompt
        again): InvalidRequestError unless there is one per placeholder run, each fitting its run. Whether it
        took any."""
        if images and embeddings:
            raise InvalidRequestError("a request's images come as pixels or as embeddings, not both")
        if (images or embeddings) and self._live(req.request_id):
            raise ValueError(f"duplicate request id {req.request_id!r}")  # before its images replace another's
        digests = [im.digest for im in images] or [digest for digest, _ in embeddings]
        if [bytes.fromhex(d) for d in digests] != [span.digest for span in req.image_spans]:
            raise InvalidRequestError(f"{len(req.image_spans)} image placeholder runs, {len(digests)} images")
        if not digests:
            return False
        if images:
            found = self._encode(req.request_id, list(images))
        else:
            found = self._received(req, embeddings)
        if any(e.shape[0] != span.rows for e, span in zip(found, req.image_spans)):
            self._drop_images(req.request_id)
            raise InvalidRequestError("an image's embeddings do not fit its placeholders")
        self.runner.image_embeddings[req.request_id] = [
            (start, e[row:row + n]) for span, e in zip(req.image_spans, found) for start, row, n in span.placements()]
        if self.model_config.vision is not None and self.model_config.vision.mrope_section:
            try:
                self.runner.mrope[req.request_id] = mrope_positions(len(req.prompt_token_ids), req.image_spans)
            except ValueError as exc:
                self._drop_images(req.request_id)
                raise InvalidRequestError(str(exc)) from None
        return True

    def _received(self, req: Request, embeddings: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """An encoder worker's embeddings, checked against this model and the placeholders first (a cached entry
        that does not fit would refuse every later request of its image), kept in the encoder cache like this
        worker's own (so the pixels, sent again once the encoder pool is gone, hit) and held for the request."""
        if self.encoder_cache is None:
            raise InvalidRequestError("this model does not take images")
        hidden = self.model_config.hidden_size
        for (_, e), span in zip(embeddings, req.image_spans):
            if e.dim() != 2 or e.dtype != self.dtype or e.shape[1] != hidden:
                raise InvalidRequestError(f"image embeddings of {e.dtype} {tuple(e.shape)} do not fit this model "
                                          f"({self.dtype}, hidden size {hidden})")
            if e.shape[0] != span.rows:
                raise InvalidRequestError("an image's embeddings do not fit its placeholders")
        cache = self.encoder_cache
        return [cache.keep(req.request_id, digest, e, e.nbytes) for digest, e in embeddings]

    def _live(self, request_id: str) -> bool:
        """Anywhere in this core: scheduled, waiting for its grammar, or receiving its KV."""
        return (request_id in self.scheduler.requests or request_id in self.grammars
                or self.scheduler.is_receiving(request_id))

    def _encode(self, request_id: str, images: list[DecodedImage]) -> list[torch.Tensor]:
        """Each image's embeddings, from the encoder caches or encoded now; all held for `request_id` until it
        ends (`CachedEncoder.encode`)."""
        if self.vision_encoder is None:
            raise InvalidRequestError("this model does not take images")
        return self.vision_encoder.encode(request_id, images)

    def _drop_images(self, request_id: str) -> None:
        """A request ended (or never started): its embeddings go, and its hold on the encoder cache."""
        self.runner.image_embeddings.pop(request_id, None)
        self.runner.mrope.pop(request_id, None)
        if self.encoder_cache is not None:
            self.encoder_cache.release(request_id)

    def _queue(self, req: Request) -> None:
        spec = req.sampling_params.structured_output
        if spec is not None:
            if req.request_id in self.grammars or req.request_id in self.scheduler.requests:
                raise ValueError(f"duplicate request id {req.request_id!r}")
            if self.grammars.hold(req, spec):
                return  # it joins the scheduler once its grammar is compiled
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        """End requests from outside a step (client gone, stop string seen); frees their blocks at
        once, hand-offs in flight included."""
        self.handoff.abort(request_ids)
        self.grammars.abort(request_ids)
        if self.encoder_cache is not None:
            for request_id in request_ids:
                self._drop_images(request_id)
        # NOTE: only a stop string (STOP) or an abort ends a request from outside; anything else aborts
        status = RequestStatus.FINISHED_STOPPED if reason == FinishReason.STOP else RequestStatus.FINISHED_ABORTED
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        """Anything left to step for; an expert-parallel rank also steps while another rank is busy."""
        return self.has_own_requests() or (self.expert_parallel is not None and self.expert_parallel.group_busy)

    def has_own_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.grammars)

    def step(self) -> StepResult:
        """One scheduled batch through the model. A batch that raises fails its own requests (their
        blocks freed) and the engine goes on; `MAX_CONSECUTIVE_STEP_FAILURES` in a row mean the engine
        itself is broken, and the error propagates (the worker exits and its supervisor replaces it)."""
        self.save_to_store()
        ready, refused = self.grammars.ready(idle=not self.scheduler.has_unfinished())
        for req in ready:
            self.scheduler.add_request(req)
        scheduled_at = time.perf_counter()
        sched = self.scheduler.schedule()
        if self.encoder_cache is not None:  # whatever ended them (a failed batch too), and grammars refused
            for request_id in [*sched.finished_request_ids, *(f.request_id for f in refused)]:
                self._drop_images(request_id)
        if self.expert_parallel is not None:
            self.expert_parallel.join_step(has_tokens=not sched.is_empty)
        if sched.is_empty and self.scheduler.loading and self.store is not None:
            self.store.wait_for_load(LOAD_WAIT_S)  # nothing else to run: no busy loop while a prefix loads
        chosen = self._choose_micro_batches(sched)
        afd_step: dict[str, Any] | None = None
        try:
            start = time.perf_counter()
            waited_before = 0.0
            if self.expert_pool is not None:
                self.expert_pool.between_steps(busy=not sched.is_empty)  # placements: switch, tell, plan (EPLB)
                waited_before = self.expert_pool.stats.wait_s
            model_output = self.runner.execute(sched)
            if self.expert_pool is not None:
                executed_s = time.perf_counter() - start
                self.expert_pool.stats.step_s += executed_s
                if chosen is not None and self.micro_batch_chooser is not None:
                    self.micro_batch_chooser.record(len(sched.scheduled), chosen, executed_s)
                if self.step_trace is not None:
                    afd_step = self._afd_step(sched, executed_s, self.expert_pool.stats.wait_s - waited_before)
            if self.expert_stats is not None and not sched.is_empty:
                self.expert_stats.record_step(sched.decode_steps)
            outputs = self.scheduler.update_from_output(sched, model_output)
        except Exception as exc:
            self.kv_cache.forget_new_blocks()  # never computed: neither the prefix cache nor the store may keep them
            self._consecutive_step_failures += 1
            if self.expert_parallel is not None:
                self.expert_parallel.finish_failed_step()  # the other ranks' step must complete too
            if self.expert_pool is not None:
                self.expert_pool.abandon()  # the step's other micro-batches' exchanges: their replies are dropped
            if self._consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            return StepResult([], failed_requests=refused + self._fail_batch(sched, exc))
        self._consecutive_step_failures = 0
        if self.encoder_cache is not None:  # a finished request's images go with it, not a step later
            for out in outputs:
                if out.finish_reason is not None:
                    self._drop_images(out.request_id)
        new_blocks = self.kv_cache.drain_new_blocks()
        if self.store is not None:
            self._store_step(sched, time.perf_counter() - start, new_blocks)
        # NOTE: a decode burst ran `decode_steps` steps of this shape: the cost models and stats price one
        shape, seconds = StepShape.of(sched.scheduled), (time.perf_counter() - scheduled_at) / sched.decode_steps
        if shape.decode_seqs:
            for _ in range(sched.decode_steps):
                self._decode_steps = self._decode_steps.add(mixed=shape.prefill_tokens > 0, seconds=seconds)
        if self.step_trace is not None:  # timed as `sim profile` times a step: from scheduling on
            for _ in range(sched.decode_steps):
                self.step_trace.record(shape, seconds, afd_step)
        return StepResult(outputs, model_output.failed_transfers, refused)

    def _store_step(self, sched: SchedulerOutput, seconds: float, new_blocks: list[tuple[BlockHash, int]]) -> None:
        """Queue this step's new full blocks for the tiers (write-through); a prefill-heavy step prices
        recomputation."""
        assert self.store is not None
        if self._write_through:
            self._unsaved.extend(new_blocks)
        if sched.num_scheduled_tokens >= PREFILL_SAMPLE_TOKENS:
            self.store.note_prefill(sched.num_scheduled_tokens, seconds)

    def save_to_store(self) -> bool:
        """Write the blocks of the last step through to the tiers.

        NOTE: deferred to the next call that may hand a block out (the next step, a reservation, closing), so
        a step's outputs (a first token: TTFT) reach the caller without waiting for the copies; until then no
        block can have been reused, since blocks are only taken inside those calls."""
        if self.store is None or not self._unsaved:
            return False
        unsaved, self._unsaved = self._unsaved, []
        self.store.save(unsaved)
        return True

    def _fail_batch(self, sched: SchedulerOutput, exc: Exception) -> list[RequestFailure]:
        ids = [s.request_id for s in sched.scheduled]
        logger.exception("engine step failed on %d request(s) (%s); failing them and going on", len(ids),
                         ", ".join(ids[:8]), exc_info=exc)
        self.abort_requests(ids)
        reason = f"the engine failed while computing this request: {type(exc).__name__}: {exc}"
        return [RequestFailure(request_id, reason) for request_id in ids]

    # ---- KV hand-off (disaggregated workers) ----------------------------------------------------

    def reserve_for_transfer(self, req: Request, deadline_s: float,
                             embeddings: Sequence[tuple[str, torch.Tensor]] = ()) -> Reservation | None:
        """Decode role: validate `req`, reserve blocks for its prompt's KV and expect it (None: no room now).
        `embeddings`: its images' (E/P/D), held while it lives, as `add_request` holds them."""
        self.validate(req)
        self.save_to_store()  # the reservation may evict a block still to be saved
        if req.sampling_params.structured_output is not None:
            self.grammars.compile(req.sampling_params.structured_output)  # ready, most likely, by the first decode
        took = self._take_images(req, (), embeddings)
        try:
            reserved = self.handoff.reserve(req, deadline_s)
        except Exception:
            if took:
                self._drop_images(req.request_id)
            raise
        if reserved is None and took:
            self._drop_images(req.request_id)
        return reserved

    def cancel_receive(self, request_id: str) -> None:
        """Decode role: the router cancelled a reservation (the prompt is prefilled elsewhere, or not at all)."""
        self.handoff.cancel_receive(request_id)
        self._drop_images(request_id)

    def poll_handoffs(self) -> list[TransferFailure]:
        """Move the KV hand-offs along (`KVHandoff.poll`); a receive that failed takes its request's images."""
        failures = self.handoff.poll()
        for failure in failures:
            if not self._live(failure.request_id):
                self._drop_images(failure.request_id)
        return failures

    # ---- state -----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        allocated, filled = self.kv_cache.slot_waste(self.scheduler.running)
        prefix = self.kv_cache.prefix_cache_stats()
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           kv_cache_usage=self.kv_cache.usage(), kv_slots_allocated=allocated, kv_slots_filled=filled,
                           prefix_cache_queried_tokens=prefix.queried_tokens, prefix_cache_hit_tokens=prefix.hit_tokens,
                           num_preemptions=self.scheduler.num_preemptions,
                           kv_store_hit_tokens=self.scheduler.num_store_hit_tokens,
                           kv_store=tuple(self.store.stats()) if self.store is not None else (),
                           expert_load=self._expert_load(), decode_steps=self._decode_steps, afd=self._afd_stats(),
                           encoder_cache=self.vision_encoder.stats() if self.vision_encoder is not None else None)

    def _choose_micro_batches(self, sched: SchedulerOutput) -> int | None:
        """--afd-micro-batches auto: set this decode step's micro-batch count (None: not a step it chooses for)."""
        if self.micro_batch_chooser is None or sched.is_empty or sched.decode_steps != 1:
            return None
        if sched.num_scheduled_tokens != len(sched.scheduled):  # a prompt chunk in it: it runs whole
            return None
        chosen = self.micro_batch_chooser.pick(len(sched.scheduled))
        self.runner.model.micro_batches = chosen
        return chosen

    def _afd_step(self, sched: SchedulerOutput, executed_s: float, waited_s: float) -> dict[str, Any]:
        """An AFD step as the step trace shows it: its micro-batches (a step with a prompt chunk, or a burst, runs
        whole), its wait for the expert pool, and that wait's share of the step (the attention side's bubble)."""
        decode_only = sched.decode_steps == 1 and sched.num_scheduled_tokens == len(sched.scheduled)
        m = min(self.runner.model.micro_batches, len(sched.scheduled)) if decode_only else 1
        return {"micro_batches": m, "wait_s": round(waited_s, 6),
                "attention_bubble": round(waited_s / executed_s, 4) if executed_s > 0 else 0.0}

    def _afd_stats(self) -> AfdStats | None:
        if self.expert_pool is None:
            return None
        s = self.expert_pool.stats
        return AfdStats(exchanges=s.exchanges, attention_wait_s=s.wait_s, attention_step_s=s.step_s,
                        bytes_sent=s.bytes_sent, bytes_received=s.bytes_received)

    def _expert_load(self) -> ExpertLoad | None:
        if self.expert_stats is None:
            return None
        ep = self.expert_parallel
        return self.expert_stats.snapshot(**ep.load_fields()) if ep is not None else self.expert_stats.snapshot()

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache.usage()

    @property
    def num_requests(self) -> int:
        """Requests holding blocks: running, waiting, held for sending, receiving."""
        s = self.scheduler
        return len(s.running) + len(s.waiting) + s.num_held + s.num_receiving + len(self.grammars)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.save_to_store()
        if self.store is not None:
            self.store.flush()
            self.store.check_integrity()

    def close(self) -> None:
        """Stop the connector's threads and give back a shared pool's name."""
        self.handoff.close()
        if self.store is not None:
            self.save_to_store()
            self.store.close()
        self.runner.pools.close()
        self.grammars.close()
        if self.step_trace is not None:
            self.step_trace.close()
        if self.expert_pool is not None:
            self.expert_pool.close()
        if self.vision_encoder is not None:
            self.vision_encoder.close()
