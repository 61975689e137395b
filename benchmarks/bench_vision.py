"""Images through a served vision-language model, encoded inside the language worker (`--encode 0`) and by an
encoder worker (E/P/D): what an image costs a request, what the encoder cache saves, and what encoding costs the
text requests decoding beside it.

    .venv/bin/python benchmarks/bench_vision.py            # ~2 min on 2 cores

The model: a random-weight LLaVA with a CLIP ViT-B/16 tower at 224 x 224 (86 M parameters, 196 image tokens;
SigLIP-base's size and cost) in front of a random-weight text model of the default model's shape (SmolLM2-135M),
bf16, built here; the default model's tokenizer with an `<image>` token added. Three deployments, one after the
other, on the same cores (`DEPLOYMENTS`): one colocated worker of 2 threads that encodes its images; an encoder
worker and a colocated worker of 1 thread each; an encoder, a prefill and a decode worker of 1 thread each (image
prompts, long, prefilled by the prefill worker; the short text chats by the decode worker). Fresh random images and
fresh text per run. Measured per deployment, through the OpenAI chat API (streamed):
- image-request TTFT with a cold encoder cache (a new image each time) and a warm one (an image seen before, the
  text before it new each time, so the prefix cache holds nothing of it): the encoder cache's saving;
- text chats' TPOT (4 streaming at once) alone, and while image requests arrive: the stall encoding inside the
  language worker puts on decoding;
- the peer: transformers' `LlavaForConditionalGeneration` (same checkpoint, bf16, 2 threads) time to the first
  token of the same image request, in this process;
- the encoder workers' images/s while encoding (`GET /workers`).
Output: `benchmarks/results/vision-<stamp>.json` and `benchmarks/results/vision.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import io
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from common.log import log
from common.machine import environment
from common.procs import thread_env
from common.prompts import fresh_seed
from common.records import to_json
from common.report import RESULTS_DIR, ResultFiles, command_line, fmt, ratio, stamp
from common.servers import Server, free_port, kvbaton_server

RESULT_PREFIX = "vision"
# name -> `kvbaton serve` arguments: each deployment gets the machine's 2 cores
DEPLOYMENTS = {
    "colocated, --encode 0": ["--threads", "2"],
    "E + colocated": ["--encode", "1", "--threads", "1"],
    "E + P + D": ["--encode", "1", "--prefill", "1", "--decode", "1", "--threads", "1"],
}
IMAGE_TOKEN = "<image>"
IMAGE_SIDE = 224
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_model(root: Path) -> Path:
    """The random-weight LLaVA described above, saved as llava-hf's checkpoints are."""
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from kvbaton.models.registry import pull_default_model

    out = root / "llava-bench"
    tokenizer = AutoTokenizer.from_pretrained(str(pull_default_model()))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = TEMPLATE
    text = json.loads((pull_default_model() / "config.json").read_text())
    text.update(vocab_size=len(tokenizer), tie_word_embeddings=False)
    text_config = LlamaConfig(**{k: v for k, v in text.items() if k not in ("architectures", "model_type")})
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=IMAGE_SIDE, patch_size=16)
    config = LlavaConfig(vision_config=vision, text_config=text_config,
                         image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         image_seq_length=(IMAGE_SIDE // 16) ** 2)
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIDE},
                       crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}).save_pretrained(str(out))
    return out


def image_url(rng: random.Random) -> str:
    """A fresh 224 x 224 picture (smooth gradients and noise: a PNG of realistic size) as a data: URL."""
    from PIL import Image

    a, b = rng.randrange(256), rng.randrange(256)
    pixels = bytes(((x * a + y * b + rng.randrange(32)) % 256) for y in range(IMAGE_SIDE) for x in range(IMAGE_SIDE)
                   for _ in range(3))
    out = io.BytesIO()
    Image.frombytes("RGB", (IMAGE_SIDE, IMAGE_SIDE), pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["red", "blue", "cat", "river", "stone", "quick", "seven", "under", "light", "map"])
                    for _ in range(n))


async def stream_chat(client: httpx.AsyncClient, content, max_tokens: int) -> dict:
    """One streamed chat: TTFT and the gaps between later tokens (seconds)."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[len("data: "):]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):  # a token's text (the first chunk names the role only)
                times.append(time.perf_counter())
    return {"ttft_s": times[0] - start, "gaps_s": [b - a for a, b in zip(times, times[1:])]}


def image_request(rng: random.Random, url: str) -> list[dict]:
    return [{"type": "text", "text": words(rng, 12)}, {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in the picture?"}]


async def measure(base: str, args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=300, trust_env=False) as client:
        await stream_chat(client, image_request(rng, image_url(rng)), 2)  # warm-up: the first request's one-offs
        cold = [await stream_chat(client, image_request(rng, image_url(rng)), 2) for _ in range(args.requests)]
        seen = image_url(rng)
        await stream_chat(client, image_request(rng, seen), 2)
        warm = [await stream_chat(client, image_request(rng, seen), 2) for _ in range(args.requests)]

        async def text_chats() -> list[dict]:
            return await asyncio.gather(*(stream_chat(client, words(rng, 20), args.text_tokens)
                                          for _ in range(args.text_streams)))

        alone = await text_chats()
        images_done: list[dict] = []

        async def arrivals(stop: asyncio.Event) -> None:
            while not stop.is_set():
                images_done.append(await stream_chat(client, image_request(rng, image_url(rng)), 2))
                await asyncio.sleep(args.image_gap_s)

        stop = asyncio.Event()
        arriving = asyncio.create_task(arrivals(stop))
        await asyncio.sleep(0.2)  # the first image request is in before the text chats start
        beside = await text_chats()
        stop.set()
        await arriving
        encoders = [w["encode"] for w in (await client.get("/workers")).json()["workers"] if w.get("encode")]
    return {"cold": cold, "warm": warm, "text_alone": alone, "text_beside_images": beside,
            "images_during_text": len(images_done), "encoders": encoders}


def hf_ttft(model_dir: Path, seed: int, reps: int) -> list[float]:
    """transformers' time to the first token of an image request like the served ones (bf16, 2 threads)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaForConditionalGeneration

    torch.set_num_threads(2)
    rng = random.Random(seed)
    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    tokens = (IMAGE_SIDE // 16) ** 2
    out = []
    for _ in range(reps + 1):
        url = image_url(rng)
        picture = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
        text = tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": "text", "text": words(rng, 12)}, {"type": "image"}, {"type": "text", "text": "What is in it?"}]}],
            tokenize=False, add_generation_prompt=True)
        ids = [t for i in tokenizer.encode(text) for t in ([i] * tokens if i == image_id else [i])]
        start = time.perf_counter()
        pixels = processor(images=[picture], return_tensors="pt")["pixel_values"].to(torch.bfloat16)
        with torch.no_grad():
            model.generate(torch.tensor([ids]), pixel_values=pixels, max_new_tokens=1, do_sample=False)
        out.append(time.perf_counter() - start)
    return out[1:]  # the first is a warm-up


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(m: dict) -> dict[str, float]:
    """One deployment's figures (ms)."""
    cold = [r["ttft_s"] * 1e3 for r in m["cold"]]
    warm = [r["ttft_s"] * 1e3 for r in m["warm"]]
    alone = [g * 1e3 for r in m["text_alone"] for g in r["gaps_s"]]
    beside = [g * 1e3 for r in m["text_beside_images"] for g in r["gaps_s"]]
    return {"cold_p50": statistics.median(cold), "cold_p99": pct(cold, 0.99), "warm_p50": statistics.median(warm),
            "warm_p99": pct(warm, 0.99), "alone_p50": statistics.median(alone), "alone_p99": pct(alone, 0.99),
            "beside_p50": statistics.median(beside), "beside_p99": pct(beside, 0.99),
            "text_ttft_beside_p50": statistics.median(r["ttft_s"] * 1e3 for r in m["text_beside_images"]),
            "text_ttft_beside_p99": pct([r["ttft_s"] * 1e3 for r in m["text_beside_images"]], 0.99)}


def render(run: dict) -> str:
    env = run["environment"]
    hf = [t * 1e3 for t in run["hf_ttft_s"]]
    figures = {name: summary(m) for name, m in run["measured"].items()}
    base = figures[next(iter(figures))]
    lines = [
        "# Images through a served vision-language model: encoded in the language worker, and by encoder workers", "",
        "```bash", run["command"], "```", "",
        f"Run {run['started']} on {env['cpu']} ({env['cpu_features']}), torch {env['torch']}, "
        f"transformers {env['transformers']}, kvbaton {env['kvbaton_commit']}; "
        f"seed {run['seed']}; {run['wall_s'] / 60:.1f} min. Model: random-weight LLaVA, CLIP ViT-B/16 tower at "
        f"{IMAGE_SIDE} px ({(IMAGE_SIDE // 16) ** 2} image tokens) and a text model of SmolLM2-135M's shape, bf16. "
        "Each deployment on the same 2 cores: " + "; ".join(f"**{name}**: `{' '.join(a)}`"
                                                             for name, a in DEPLOYMENTS.items()) + ".", "",
        "## Text chats decoding while image requests arrive", "",
        f"{len(run['measured'][next(iter(figures))]['text_alone'])} text chats streaming at once, alone and while "
        "image requests (a new image each) arrive one after another.", "",
        "| deployment | text TPOT alone p50 / p99 ms | beside images p50 / p99 ms | p99 vs colocated | "
        "text TTFT beside images p50 / p99 ms | image requests during |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        m = run["measured"][name]
        lines.append(f"| {name} | {fmt(f['alone_p50'])} / {fmt(f['alone_p99'])} | {fmt(f['beside_p50'])} / "
                     f"{fmt(f['beside_p99'])} | {fmt(ratio(f['beside_p99'], base['beside_p99']), '.2f')}x | "
                     f"{fmt(f['text_ttft_beside_p50'])} / {fmt(f['text_ttft_beside_p99'])} | "
                     f"{m['images_during_text']} |")
    lines += ["", "## Image requests", "",
              "| deployment | TTFT cold encoder cache p50 / p99 ms | vs transformers | warm (new text) p50 / p99 ms | "
              "cold / warm | encoder images/s |", "|---|---|---|---|---|---|"]
    for name, f in figures.items():
        encoders = run["measured"][name]["encoders"]
        rate = ", ".join(fmt(e["images_per_s"], ".1f") for e in encoders if e.get("images_per_s")) or "-"
        lines.append(f"| {name} | {fmt(f['cold_p50'])} / {fmt(f['cold_p99'])} | "
                     f"{fmt(ratio(f['cold_p50'], statistics.median(hf)), '.2f')}x | {fmt(f['warm_p50'])} / "
                     f"{fmt(f['warm_p99'])} | {fmt(ratio(f['cold_p50'], f['warm_p50']), '.2f')}x | {rate} |")
    lines += [f"| transformers (the peer), same kind of request | {fmt(statistics.median(hf))} / {fmt(pct(hf, 0.99))} "
              "| | | | |", "",
              "Against the target (text TPOT p99 beside images <= 0.6x colocated): " + "; ".join(
                  f"{name} {fmt(ratio(f['beside_p99'], base['beside_p99']), '.2f')}x"
                  for name, f in list(figures.items())[1:]) + ". With one colocated worker behind the encoder, "
              "the image's placeholders are still prefilled between the text streams' steps, on one thread "
              "instead of two: only a prefill worker takes that stall away too.", "", *READING]
    return "\n".join(lines) + "\n"


READING = [
    "Reading it: encoded inside the language worker, an image stalls every decoding stream beside it for as long as "
    "its tower runs (the colocated p99). An encoder worker takes the tower off the language worker's steps; with a "
    "prefill worker too, the image's placeholders are prefilled off them as well. On 2 cores the workers share the "
    "cores, so the text streams still slow while a tower or a prefill runs beside them, by the share of the cores "
    "it takes, rather than stopping for it. A warm encoder cache takes the tower off an image request's first "
    "token (the prefix cache holds none of it: the text before the image is new each time); the rest of it is the "
    "prefill of the image's placeholders, which no encoder cache saves, so cold / warm is bounded by "
    "(tower + prefill) / prefill.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="image requests per cache state")
    ap.add_argument("--text-streams", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=96)
    ap.add_argument("--image-gap-s", type=float, default=0.2, help="pause between arriving image requests")
    ap.add_argument("--hf-reps", type=int, default=3)
    ap.add_argument("--render", type=Path, help="rewrite vision.md from this run's JSON, measuring nothing")
    args = ap.parse_args()
    if args.render:
        (RESULTS_DIR / f"{RESULT_PREFIX}.md").write_text(render(json.loads(args.render.read_text())))
        return
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    seed = fresh_seed()
    work = Path(tempfile.mkdtemp(prefix="kvbaton-bench-vision-"))
    try:
        log("building the random-weight LLaVA")
        model = build_model(work)
        measured = {}
        for i, (name, serve_args) in enumerate(DEPLOYMENTS.items()):
            log(f"deployment: {name}")
            spec = kvbaton_server(name="kvbaton", port=free_port(), log_path=work / f"serve-{i}.log",
                                  env=thread_env(2), timeout_s=300,
                                  serve_args=["--model", str(model), "--max-request-bytes", str(16 * 2**20),
                                              *serve_args])
            with Server(spec) as server:
                measured[name] = asyncio.run(measure(server.base_url, args, seed + 100 * i))
        log("transformers peer")
        hf = hf_ttft(model, seed + 1, args.hf_reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    env = environment(with_transformers=True)
    run = {"command": command_line("bench_vision.py", []), "started": started.isoformat(timespec="minutes"),
           "seed": seed, "environment": to_json(env), "args": vars(args),
           "measured": measured, "hf_ttft_s": hf, "wall_s": time.perf_counter() - t0}
    files = ResultFiles.of(RESULTS_DIR, RESULT_PREFIX, stamp(started))
    files.write(run, render(run), run["wall_s"])


if __name__ == "__main__":
    main()
