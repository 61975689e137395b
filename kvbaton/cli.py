"""`kvbaton` command line: serve | generate | bench | chat | complete | workers | sim | plan | doctor | model.

Errors a user can cause (bad model path, bad sampling values, over-long prompt) are
printed as one line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvbaton.config import WRITE_POLICIES, CacheConfig, ConfigError, EngineConfig, KVStoreConfig, SchedulerConfig
from kvbaton.models.registry import DEFAULT_MODEL
from kvbaton.platform.compute import COMPUTE_PATHS
from kvbaton.router.errors import EngineDeadError
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    import httpx

    from kvbaton.cluster.autoscale_policy import AutoscaleConfig
    from kvbaton.cluster.deploy import DeploymentSpec

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
KV_CACHE_DTYPE_CHOICES = ["auto", "bf16", "float32", "fp8_e4m3", "int8"]


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF checkpoint dir, .gguf file, or the default model")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--encoder-cache-mb", type=float, default=256.0,
                   help="vision-language models: image embeddings no request holds, kept for the next request "
                        "with the same image (least recently used out first)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="how the KV pool (and the KV store, and the wire) holds K and V: auto is the model's dtype; "
                        "int8 and fp8_e4m3 keep a scale per token and head (about 53%% of bf16's bytes)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--decode-burst", type=int, default=SchedulerConfig.decode_burst, metavar="N",
                   help="greedy decodes with nothing else to sample by run up to N steps per scheduled step while "
                        "no request waits (tokens reach clients N at a time; 1: every step scheduled; default "
                        "%(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slower start, faster steps)")
    p.add_argument("--no-kernels", action="store_true", help="PyTorch ops only, without kvbaton's C CPU kernels")
    p.add_argument("--compute-path", default="auto", choices=COMPUTE_PATHS,
                   help="which code computes each layer (default: chosen from this CPU's features; printed at start)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: greedy output independent of batching, chunking, threads and "
                        "PD placement (slower prefill)")
    p.add_argument("--step-trace", default=None, metavar="DIR",
                   help="append each engine step's shape and seconds to DIR/steps-<pid>.jsonl (one file per "
                        "worker), for `kvbaton sim fit-steps`")
    _add_kv_store_args(p)


def _add_kv_store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV store (tiers beyond each worker's pool, shared across workers and restarts)")
    g.add_argument("--kv-store", default="", metavar="TIERS",
                   help="comma-separated tiers among shm (node shared memory), disk (block files), redis "
                        "(cluster), mooncake (a Mooncake Store: the other cluster tier); default: none")
    g.add_argument("--kv-store-shm-name", default=None,
                   help="the shm arena's name: workers (and servers) naming the same one share it (serve: one per "
                        "server, removed when it stops)")
    g.add_argument("--kv-store-shm-gb", type=float, default=1.0)
    g.add_argument("--kv-store-disk-dir", default=None, help="default: ~/.cache/kvbaton/kv-store (a subdirectory "
                                                             "per served worker)")
    g.add_argument("--kv-store-disk-gb", type=float, default=4.0)
    g.add_argument("--kv-store-redis-url", default=os.environ.get("KVBATON_KV_STORE_REDIS_URL"),
                   help="default: $KVBATON_KV_STORE_REDIS_URL; serve without one starts a private, LRU redis-server")
    g.add_argument("--kv-store-redis-gb", type=float, default=4.0, help="the private redis-server's maxmemory")
    g.add_argument("--kv-store-mooncake-master", default=None,
                   help="host:port of a Mooncake Store master; serve without one starts a private store")
    g.add_argument("--kv-store-mooncake-metadata", default=None, help="that store's HTTP metadata server URL")
    g.add_argument("--kv-store-mooncake-gb", type=float, default=4.0, help="the private Mooncake Store's memory")
    g.add_argument("--kv-store-ttl", type=float, default=3600.0, help="seconds a block may live in any tier")
    g.add_argument("--kv-store-write-policy", default="write-through", choices=list(WRITE_POLICIES),
                   help="write-through: full blocks as computed; write-back: cached blocks when evicted")


def kv_store_config_from_args(args: argparse.Namespace) -> KVStoreConfig:
    return KVStoreConfig(tiers=tuple(t.strip() for t in args.kv_store.split(",") if t.strip()),
                         shm_name=args.kv_store_shm_name, shm_gb=args.kv_store_shm_gb,
                         disk_dir=args.kv_store_disk_dir, disk_gb=args.kv_store_disk_gb,
                         redis_url=args.kv_store_redis_url, redis_gb=args.kv_store_redis_gb, ttl_s=args.kv_store_ttl,
                         mooncake_master=args.kv_store_mooncake_master,
                         mooncake_metadata_url=args.kv_store_mooncake_metadata, mooncake_gb=args.kv_store_mooncake_gb,
                         write_policy=args.kv_store_write_policy)


def step_trace_dir(path: str | None) -> str | None:
    """--step-trace's directory, made now: a bad one is the command line's error, not each worker's."""
    if path is None:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--step-trace {path}: cannot make that directory ({exc.strerror or exc})") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--step-trace {path}: the directory is not writable")
    return str(Path(path).resolve())  # workers may run elsewhere than this command's directory


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, num_threads=args.threads,
        compile=args.compile, kernels=not args.no_kernels, compute_path=args.compute_path,
        deterministic=args.deterministic,
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory_gb=args.kv_cache_memory_gb,
                          enable_prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                          encoder_cache_mb=args.encoder_cache_mb),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  decode_burst=args.decode_burst),
        kv_store=kv_store_config_from_args(args), step_trace_dir=step_trace_dir(args.step_trace),
    )


def _add_generation_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                   help="sampling defaults for what a request leaves unset: auto (default): the model dir's "
                        "generation_config.json; vllm: ignore it; PATH: a dir holding one, or the file")


# Subcommands whose parsers live here. `kvbaton serve` is on every worker replacement's and every test server's
# start path: building only what its own command needs keeps the other packages' imports off it.
OWN_COMMANDS = ("generate", "serve", "workers", "model")


def _add_package_parsers(sub: argparse._SubParsersAction) -> None:
    from kvbaton.bench.cli import add_bench_parser
    from kvbaton.client.cli import add_client_parsers
    from kvbaton.client.kv_sessions import add_kv_parser
    from kvbaton.doctor.cli import add_doctor_parser
    from kvbaton.plan.cli import add_plan_parser
    from kvbaton.sim.cli import add_sim_parser

    for add in (add_bench_parser, add_client_parsers, add_kv_parser, add_sim_parser, add_plan_parser,
                add_doctor_parser):
        add(sub)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; given the subcommand about to run, and it is one of OWN_COMMANDS, only the parsers defined in
    this module (the usage and errors of that command are the same either way)."""
    parser = argparse.ArgumentParser(prog="kvbaton", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    _add_engine_args(gen)
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--raw", action="store_true", help="send the prompt as-is, without the chat template")
    # NOTE: None: the model's generation config decides (as in vLLM), else the values in GENERATE_FALLBACKS.
    gen.add_argument("--max-tokens", type=int, default=None, help="default: the model's max_new_tokens, else 128")
    gen.add_argument("--temperature", type=float, default=None, help="default: the model's, else 0 (greedy)")
    gen.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1")
    gen.add_argument("--top-k", type=int, default=None, help="default: the model's, else 0 (disabled)")
    _add_generation_config_arg(gen)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=os.environ.get("KVBATON_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $KVBATON_API_KEY)")
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="admission control: refuse with 503 beyond this many waiting requests")
    serve.add_argument("--admin-api-key", default=os.environ.get("KVBATON_ADMIN_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /admin/* and /workers (default: "
                            "$KVBATON_ADMIN_API_KEY); without one they are open on loopback, disabled elsewhere")
    serve.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                       help="refuse request bodies larger than this with 413 (default: 4 MiB)")
    serve.add_argument("--max-priority-range", type=int, default=None,
                       help="clients may set a priority in [-N, N] (0: no client priorities; default: 0, or "
                            "1000000 with --api-key, where the clients are known)")
    serve.add_argument("--max-workers", type=int, default=16,
                       help="the most workers the pool may have; POST /admin/workers refuses beyond it")
    serve.add_argument("--max-kv-session-bytes", type=int, default=2**30,
                       help="the largest KV session file POST /admin/kv/restore accepts (default: 1 GiB)")
    serve.add_argument("--max-images-per-request", type=int, default=8,
                       help="vision-language models: the most images a request may carry")
    serve.add_argument("--max-image-bytes", type=int, default=8 * 2**20,
                       help="the largest image, encoded (a data: URL's decoded payload, a fetched body); more is a 413")
    serve.add_argument("--max-image-pixels", type=int, default=4096 * 3072,
                       help="the most pixels (width x height) of one image, read from its header before decoding")
    serve.add_argument("--allowed-image-hosts", default="",
                       help="comma-separated hosts whose http(s) image URLs are fetched (default: none, only data: "
                            "URLs: a server that fetches any URL a client names is an SSRF hole)")
    serve.add_argument("--max-n", type=int, default=16,
                       help="the most choices (n) a request may ask for; more is a 400 (default 16, at most 128)")
    serve.add_argument("--max-request-output-tokens", type=int, default=None,
                       help="the most output one request may ask for, as choices x max_tokens x (1 + top logprobs); "
                            "more is a 400 (default: max(--max-n, 21) x the context length)")
    _add_generation_config_arg(serve)
    pd = serve.add_argument_group("disaggregation (prefill/decode worker pools behind a router)")
    pd.add_argument("--prefill", type=int, default=0, help="prefill workers (0: decode workers prefill themselves)")
    pd.add_argument("--decode", type=int, default=0,
                    help="decode workers (with --prefill 0: colocated replicas; 0 and 0: one colocated worker)")
    pd.add_argument("--kv-transport", default="shm", choices=["shm", "tcp", "redis", "mooncake"])
    pd.add_argument("--prefill-kv-cache-dtype", default=None, choices=KV_CACHE_DTYPE_CHOICES,
                    help="the prefill workers' KV dtype, when it should differ from --kv-cache-dtype (the decode "
                         "workers'); they convert what they receive (shm, tcp, redis transports)")
    pd.add_argument("--expert-parallel-size", type=int, default=1, metavar="N",
                    help="MoE models: every decode (colocated) worker is a group of N processes, each holding 1/N "
                         "of every MoE layer's experts and its own requests; tokens cross them in each MoE layer")
    pd.add_argument("--prefill-expert-parallel-size", type=int, default=None, metavar="N",
                    help="the same for prefill workers (default: --expert-parallel-size)")
    pd.add_argument("--ep-int8-dispatch", action="store_true",
                    help="send MoE activations to other ranks as int8 with a per-token scale (about 1/2 the "
                         "bytes of bf16; results come back exact)")
    pd.add_argument("--num-redundant-experts", type=int, default=0, metavar="R",
                    help="EPLB: R extra expert slots per MoE layer in each expert-parallel group, for copies of hot "
                         "experts (experts + R must divide by the group size); with --expert-workers E: copies of "
                         "the next expert workers' experts (R a multiple of E, up to experts x (E-1)), which the "
                         "attention workers use while an expert worker is down")
    pd.add_argument("--eplb-interval", type=int, default=0, metavar="STEPS",
                    help="EPLB: re-place each group's experts from the measured load every STEPS busy steps "
                         "(weights copied in the background, swapped between steps; 0: never); with "
                         "--expert-workers, the expert pool's, planned by attention worker 0")
    pd.add_argument("--eplb-objective", default="tokens", choices=["tokens", "active_experts"],
                    help="EPLB balances tokens per rank, or the experts each rank must read per step (decode)")
    epd = serve.add_argument_group("encoder workers (E/P/D: vision-language models' images encoded in a pool)")
    epd.add_argument("--encode", type=int, default=0, metavar="N",
                     help="N encoder workers run requests' images through the vision tower and hand the embeddings "
                          "to the prefill (colocated) workers; text-only requests skip them (0: the language workers "
                          "encode the images themselves)")
    epd.add_argument("--encode-queue", type=int, default=32, metavar="IMAGES",
                     help="images each encoder worker may have waiting or encoding; a request whose images would "
                          "pass the pool's bound gets a 503 saying to retry (default 32)")
    afd = serve.add_argument_group("attention/FFN disaggregation (MoE models: experts in a pool of their own)")
    afd.add_argument("--expert-workers", type=int, default=0, metavar="E",
                     help="E expert workers hold every MoE layer's routed experts (1/E each); the decode (colocated) "
                          "workers become attention workers that send each MoE layer's tokens there (0: off)")
    afd.add_argument("--attention-workers", type=int, default=None, metavar="N",
                     help="with --expert-workers: the attention workers (the same as --decode N)")
    afd.add_argument("--afd-micro-batches", type=_micro_batches, default=1, metavar="auto|M",
                     help="with --expert-workers: each decode step runs as M micro-batches, the experts computing one "
                          "while attention computes the next; auto: each attention worker tries 1-4 per batch size "
                          "and keeps the fastest, trying the others again now and then (default 1)")
    pd.add_argument("--allow-insecure-kv-transport", action="store_true",
                    help="allow --kv-transport mooncake (it listens on every interface, whatever --host says) and "
                         "expert-parallel groups off loopback: they authenticate no peer (any host that reaches "
                         "them can read or write the KV pools, or join a group); private networks only")
    pd.add_argument("--encrypt-traffic", action="store_true",
                    help="encrypt router<->worker control traffic and the tcp/shm/mooncake KV transports' ZeroMQ "
                         "sockets with ZeroMQ CURVE (keys derived from the cluster secret); redis, shared-memory "
                         "and mooncake KV data stay in clear")
    pd.add_argument("--redis-url", default=None, help="for --kv-transport redis (default: start a local redis-server)")
    pd.add_argument("--routing", default="least_loaded", choices=["round_robin", "least_loaded", "prefix_aware"])
    pd.add_argument("--local-prefill-threshold", type=int, default=64,
                    help="prompts with fewer uncached tokens are prefilled on the decode worker")
    pd.add_argument("--transfer-timeout", type=float, default=30.0,
                    help="seconds before a KV transfer counts as failed")
    serve.add_argument("--request-timeout", type=float, default=600.0,
                       help="abort (with an error) a request that produced no output for this many seconds; 0: never")
    pd.add_argument("--backend", default="local", choices=["local", "ray"],
                    help="run workers as local processes or as Ray actors")
    pd.add_argument("--address", default=None, help="--backend ray: join this Ray cluster (default: start one)")
    pd.add_argument("--max-worker-restarts", type=int, default=5,
                    help="a dead worker is replaced at most this often per 10 minutes, then its slot stays down "
                         "(0: never replace)")
    pd.add_argument("--worker-dead-after", type=float, default=5.0,
                    help="seconds without a heartbeat before a worker is declared dead, fenced and replaced")
    _add_autoscale_args(serve)
    if command not in OWN_COMMANDS:  # the others' parsers import their packages (~0.3 s: numpy, the planner)
        _add_package_parsers(sub)
    workers = sub.add_parser("workers", help="list, add or drain the workers of a running `kvbaton serve`")
    workers.add_argument("action", choices=["list", "add", "drain"])
    workers.add_argument("target", nargs="?", help="add: prefill|decode|encode; drain: a worker name (see list)")
    workers.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    admin_key = os.environ.get("KVBATON_ADMIN_API_KEY", os.environ.get("KVBATON_API_KEY"))
    workers.add_argument("--api-key", default=admin_key,
                         help="the server's admin key (default: $KVBATON_ADMIN_API_KEY, else $KVBATON_API_KEY)")
    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    model_sub.add_parser("pull", help=f"fetch and convert the default model ({DEFAULT_MODEL})")
    return parser


GENERATE_FALLBACKS: dict[str, float | int] = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 128}


def generate_params(args: argparse.Namespace) -> SamplingParams:
    """The flags given, else the model's generation config, else GENERATE_FALLBACKS."""
    from kvbaton.models.registry import resolve_model
    from kvbaton.text.generation_config import load_generation_defaults

    defaults = load_generation_defaults(resolve_model(args.model), args.generation_config)
    given = {k: getattr(args, k) for k in GENERATE_FALLBACKS if getattr(args, k) is not None}
    values = {**GENERATE_FALLBACKS, **defaults.overrides(), **given}
    # NOTE: the engine stops on the model dir's own EOS ids; a --generation-config PATH may name others.
    return SamplingParams(**values, seed=args.seed, stop=args.stop, stop_token_ids=list(defaults.eos_token_ids))


def cmd_generate(args: argparse.Namespace) -> int:
    from kvbaton.engine.engine import LLMEngine

    params = generate_params(args)  # before loading the model, so a bad --generation-config fails at once
    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if not args.raw and engine.tokenizer.hf.chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    engine.add_request("cli-0", prompt, params)
    start, first, num_tokens = time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            first = first or time.perf_counter()
            num_tokens = len(completion.token_ids)
            sys.stdout.write(completion.delta_text)
            sys.stdout.flush()
    end = time.perf_counter()
    tpot = (end - first) / max(num_tokens - 1, 1) * 1000 if first else 0.0
    print(f"\n[{num_tokens} tokens, TTFT {(first or end) - start:.3f} s, {tpot:.1f} ms/token, "
          f"finish: {completion.finish_reason}]", file=sys.stderr)
    return 0


def deployment_from_args(args: argparse.Namespace) -> DeploymentSpec:
    from kvbaton.cluster.deploy import Backend, DeploymentSpec
    from kvbaton.router.router import RouterConfig
    from kvbaton.router.supervision import RestartPolicy
    from kvbaton.router.worker_pool import PoolConfig

    router = RouterConfig(prefill_policy=args.routing, decode_policy=args.routing,
                          local_prefill_threshold=args.local_prefill_threshold,
                          transfer_deadline_s=args.transfer_timeout, request_timeout_s=args.request_timeout)
    if args.attention_workers is not None:
        if not args.expert_workers:
            raise ConfigError("--attention-workers needs --expert-workers (without an expert pool, use --decode)")
        if args.decode and args.decode != args.attention_workers:
            raise ConfigError("--attention-workers and --decode name the same workers: give one of them")
        args.decode = args.attention_workers
    return DeploymentSpec(num_prefill=args.prefill, num_decode=max(args.decode, 1), kv_transport=args.kv_transport,
                          allow_insecure_kv_transport=args.allow_insecure_kv_transport,
                          encrypt_traffic=args.encrypt_traffic, prefill_kv_cache_dtype=args.prefill_kv_cache_dtype,
                          redis_url=args.redis_url, backend=Backend(args.backend), ray_address=args.address,
                          router=router, pool=PoolConfig(
                              dead_after_s=args.worker_dead_after,
                              restart=RestartPolicy(max_restarts=args.max_worker_restarts),
                              decode_ep_size=args.expert_parallel_size, ep_int8_dispatch=args.ep_int8_dispatch,
                              num_redundant_experts=args.num_redundant_experts, eplb_interval_steps=args.eplb_interval,
                              eplb_objective=args.eplb_objective, expert_workers=args.expert_workers,
                              afd_micro_batches=args.afd_micro_batches, encode_workers=args.encode,
                              encode_queue=args.encode_queue,
                              prefill_ep_size=args.prefill_expert_parallel_size or args.expert_parallel_size))


def _micro_batches(value: str) -> int:
    """--afd-micro-batches: `auto` (0) or a count >= 1."""
    if value == "auto":
        return 0
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a count >= 1, not {value!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a count >= 1, not {value!r}")
    return count


def _add_autoscale_args(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("autoscaling (resize the pools from measured TTFT, TPOT, queue depth, KV usage)")
    g.add_argument("--autoscale", action="store_true", help="run the SLA autoscaler (needs both --slo-* flags)")
    g.add_argument("--slo-ttft-ms", type=float, default=None, help="time-to-first-token target, p99")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="time-per-output-token target, p99")
    for pool in ("prefill", "decode", "encode"):
        g.add_argument(f"--min-{pool}", type=int, default=1, help=f"the fewest {pool} workers (default 1)")
        g.add_argument(f"--max-{pool}", type=int, default=None, help=f"the most {pool} workers (default: "
                                                                        "--max-workers bounds them)")
    g.add_argument("--autoscale-interval", type=float, default=10.0, metavar="S", help="seconds between decisions")
    g.add_argument("--autoscale-cooldown", type=float, default=30.0, metavar="S",
                   help="after a pool changed, it keeps its size this many seconds")
    g.add_argument("--autoscale-window", type=float, default=60.0, metavar="S",
                   help="TTFT/TPOT percentiles over the requests that finished this recently")
    g.add_argument("--adapt-threshold", action="store_true",
                   help="PD: halve --local-prefill-threshold when local prefills slow decoding near the TPOT SLO, "
                        "double it when the prefill pool misses TTFT and cannot grow")
    g.add_argument("--min-local-prefill-threshold", type=int, default=16, metavar="TOKENS",
                   help="with --adapt-threshold: the lowest threshold (default 16)")
    g.add_argument("--max-local-prefill-threshold", type=int, default=4096, metavar="TOKENS",
                   help="with --adapt-threshold: the highest threshold (default 4096)")


def autoscale_from_args(args: argparse.Namespace) -> AutoscaleConfig | None:
    from kvbaton.cluster.autoscale_policy import AutoscaleConfig

    if not args.autoscale:
        if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
            raise ConfigError("--slo-ttft-ms and --slo-tpot-ms are the autoscaler's targets: add --autoscale")
        if args.adapt_threshold:
            raise ConfigError("--adapt-threshold is the autoscaler's: add --autoscale")
        return None
    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise ConfigError("--autoscale needs --slo-ttft-ms and --slo-tpot-ms")
    if args.adapt_threshold and args.prefill == 0:
        raise ConfigError("--adapt-threshold moves PD routing: it needs a prefill pool (--prefill N)")
    return AutoscaleConfig(slo_ttft_s=args.slo_ttft_ms / 1000, slo_tpot_s=args.slo_tpot_ms / 1000,
                           min_prefill=args.min_prefill, max_prefill=args.max_prefill, min_decode=args.min_decode,
                           max_decode=args.max_decode, min_encode=args.min_encode, max_encode=args.max_encode,
                           interval_s=args.autoscale_interval,
                           cooldown_s=args.autoscale_cooldown, window_s=args.autoscale_window,
                           adapt_threshold=args.adapt_threshold, min_threshold=args.min_local_prefill_threshold,
                           max_threshold=args.max_local_prefill_threshold)


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from kvbaton.mm.images import ImageLimits
    from kvbaton.server.launch import ServeOptions, serve

    image_hosts = frozenset(h.strip().lower() for h in args.allowed_image_hosts.split(",") if h.strip())

    autoscale = autoscale_from_args(args)
    deployment = deployment_from_args(args)
    if autoscale is not None and args.decode == 0:  # NOTE: no --decode given: start at the smallest size
        deployment = dataclasses.replace(deployment, num_decode=autoscale.min_decode)
    options = ServeOptions(host=args.host, port=args.port, served_model_name=args.served_model_name,
                           api_key=args.api_key, admin_api_key=args.admin_api_key,
                           max_waiting_requests=args.max_waiting_requests, max_request_bytes=args.max_request_bytes,
                           max_priority_range=args.max_priority_range, max_workers=args.max_workers,
                           max_n=args.max_n, max_kv_session_bytes=args.max_kv_session_bytes,
                           max_request_output_tokens=args.max_request_output_tokens,
                           generation_config=args.generation_config,
                           images=ImageLimits(max_images=args.max_images_per_request, max_bytes=args.max_image_bytes,
                                              max_pixels=args.max_image_pixels, allowed_hosts=image_hosts),
                           deployment=deployment, autoscale=autoscale)
    return serve(engine_config_from_args(args), options)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvbaton.bench.cli import main as bench_main

    return bench_main(args)


def cmd_client(args: argparse.Namespace) -> int:
    from kvbaton.client.cli import main as client_main

    return client_main(args)


def cmd_workers(args: argparse.Namespace) -> int:
    import httpx

    if args.action != "list" and args.target is None:
        raise ConfigError(f"kvbaton workers {args.action}: say which {'role' if args.action == 'add' else 'worker'}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = _workers_request(args, headers)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot reach {args.url}: {exc}") from exc
    if resp.status_code != 200:
        raise ConfigError(resp.json().get("error", {}).get("message", resp.text))
    if args.action == "list":
        for w in resp.json()["workers"]:
            print(f"{w['name']:<20} pid {w.get('pid')!s:<8} {'healthy' if w.get('healthy') else 'DOWN':<8} "
                  f"running {w.get('num_running', 0):<4} waiting {w.get('num_waiting', 0):<4} "
                  f"kv {w.get('kv_cache_usage', 0.0):.0%}{'  draining' if w.get('draining') else ''}")
    else:
        print(resp.json())
    return 0


def _workers_request(args: argparse.Namespace, headers: dict[str, str]) -> httpx.Response:
    import httpx

    if args.action == "list":
        return httpx.get(f"{args.url}/workers", headers=headers, timeout=10)
    if args.action == "add":
        return httpx.post(f"{args.url}/admin/workers", json={"role": args.target}, headers=headers, timeout=660)
    return httpx.post(f"{args.url}/admin/workers/{args.target}/drain", headers=headers, timeout=30)


def cmd_kv(args: argparse.Namespace) -> int:
    from kvbaton.client.kv_sessions import cmd_kv as run

    return run(args)


def cmd_sim(args: argparse.Namespace) -> int:
    if args.sim_command == "profile":  # the one sim command that runs the model (so it needs torch)
        from kvbaton.engine.step_profile import main as profile_main

        return profile_main(args)
    from kvbaton.sim.cli import main as sim_main

    return sim_main(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from kvbaton.plan.cli import main as plan_main

    return plan_main(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from kvbaton.doctor.cli import main as doctor_main

    return doctor_main(args)


def cmd_model_pull(args: argparse.Namespace) -> int:
    from kvbaton.models.registry import pull_default_model

    print(pull_default_model())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"generate": cmd_generate, "serve": cmd_serve, "model": cmd_model_pull, "bench": cmd_bench,
                "workers": cmd_workers, "chat": cmd_client, "complete": cmd_client, "kv": cmd_kv,
                "sim": cmd_sim, "plan": cmd_plan, "doctor": cmd_doctor}
    try:
        return handlers[args.command](args)
    except (ConfigError, InvalidRequestError, FileNotFoundError, OSError) as exc:
        print(f"kvbaton: error: {exc}", file=sys.stderr)
        return 2
    except EngineDeadError as exc:  # e.g. a worker that could not load the model (its log says why)
        print(f"kvbaton: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
