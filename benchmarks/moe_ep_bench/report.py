"""bench_moe_ep.py's report: the Markdown summary of a run, and what its figures say."""

from __future__ import annotations

from common.report import fmt, notes_section
from moe_ep_bench.models import (
    DECODE_BATCH,
    DECODE_PROMPT,
    HOT_EXPERTS,
    MOE_KERNEL_ENV,
    PREFILL_LEN,
    SKEW_CHANNEL_VALUE,
)


def kb(x: float | None) -> str:
    return "—" if x is None else f"{x / 1024:,.1f} KiB"


def a2a_cell(d: dict) -> str:
    return f"{fmt(d['a2a_ms'])} ({d['a2a_share']:.0%})"


def reading_ep(doc: dict) -> list[str]:
    """What EP1 vs EP2 says, in the direction this run measured."""
    r = doc["summary"]["ratios"]
    dec, pre = r.get("ep1_over_ep2_decode"), r.get("ep1_over_ep2_prefill")
    why = ("the two ranks share the same 2 cores (and memory bandwidth) that EP1 has alone, and every MoE layer "
           "adds 4 all-to-alls (counts, slot ids, rows, combine) plus a per-step all-reduce, each a loopback TCP "
           "round trip through gloo and a synchronization point where the faster rank waits for the slower one")
    point = ("EP's point is memory per rank (each rank holds half of the routed experts here) and scale across "
             "nodes, where each rank has its own cores and memory bandwidth; on one machine the exchanges are pure "
             "overhead.")
    if dec is None or pre is None:
        return [f"- EP1 vs EP2 was not measured in this run. {point}"]
    if dec < 1 and pre < 1:
        return [f"- On this one 2-core machine EP2 is slower than EP1 (EP2 takes {1 / dec:.2f}x EP1's decode step "
                f"and {1 / pre:.2f}x its prefill step), as expected: {why}. {point}"]
    slower = [name for name, x in (("decode", dec), ("prefill", pre)) if x < 1]
    return [f"- EP2 was not slower than EP1 everywhere here (EP1 / EP2: decode {dec:.2f}, prefill {pre:.2f}), "
            "which is not EP's doing: EP1 runs one process with 2 OpenMP threads, which stall together whenever "
            "another process takes one of the 2 cores (see the other load in the notes), while each EP2 rank runs "
            "1 thread; and EP2 does not read all experts per rank. On a quiet machine expect EP2 to be slower: "
            f"{why}. {point}" + (f" EP2 was slower in {' and '.join(slower)}." if slower else "")]


def reading_exchanges(doc: dict) -> list[str]:
    s, layers = doc["summary"], doc["shape"]["num_hidden_layers"]
    d, dq, p, pq = (s.get(k) for k in ("ep2_decode", "ep2_int8_decode", "ep2_prefill", "ep2_int8_prefill"))
    out = ["- The all-to-all time includes waiting: a rank that finishes its attention or experts first waits inside "
           "the next exchange, so the share is an upper bound on the cost of the transfers themselves."]
    if d:
        out[0] += (f" A decode step makes {4 * layers} `all_to_all_single` calls per rank (4 per MoE layer: counts, "
                   f"slot ids, rows, combine), {d['a2a_ms'] / (4 * layers):.2f} ms each on average here, so it is "
                   "latency, not bytes, that costs at decode: sending the slot ids inside the row payload (as the "
                   "int8 rows carry their scale) would save a quarter of the calls.")
    if d and dq and p and pq:
        r = s["ratios"]
        verdict = "slower" if (r["int8_over_exact_time_decode"] or 0) > 1 else "not slower"
        out.append(
            "- int8 dispatch quantizes only the dispatched rows (the combine stays bf16), so it saves at most ~25% of "
            f"the bytes (here {1 - r['int8_over_exact_bytes_decode']:.0%}); its codec (`quantize_rows` + "
            "`dequantize_rows`, about a dozen PyTorch passes over the rows on the rank's one thread) costs "
            f"{dq['codec_ms']:.1f} ms per decode step and {pq['codec_ms']:.1f} ms per prefill step, more than the "
            f"loopback transfer it saves, so int8 is {verdict} here (int8 / exact: decode "
            f"{r['int8_over_exact_time_decode']:.2f}, prefill {r['int8_over_exact_time_prefill']:.2f}). It is for "
            "links where the bytes are the bottleneck (between nodes); a fused one-pass codec would cut its cost.")
    return out


def render(doc: dict) -> str:
    """The Markdown summary of a run (the report file)."""
    lines = [*header(doc), *ep_table(doc), *ratio_list(doc), *quality_section(doc), *eplb_section(doc)]
    lines += [
        "", "## Reading it", "",
        *reading_ep(doc),
        *reading_exchanges(doc),
    ]
    lines += notes_section(doc["notes"])
    lines += ["", f"Raw figures (every step of every rank): `{doc['json_name']}`.", ""]
    return "\n".join(lines)


def header(doc: dict) -> list[str]:
    """The run: its command, machine and load, the model, and the set-ups."""
    env, shape = doc["environment"], doc["shape"]
    return [
        "# Expert parallelism (EP over gloo): EP1 vs EP2, int8 dispatch, EPLB", "",
        "```bash", doc["command"], "```", "",
        f"Run {doc['started']} on {env['cpu']} ({env['cpus']} cores; {env.get('cpu_features', '')}), torch "
        f"{env['torch']}, transformers {env.get('transformers')}, kvbaton {env['kvbaton_commit']}; seed "
        f"{doc['seed']}; {doc['wall_s'] / 60:.1f} min. Load average (1 min) seen: "
        f"{doc['loadavg_start'][0]:.2f} at the start, {doc['loadavg_end'][0]:.2f} at the end, "
        f"{min(doc['loadavg_groups']):.2f}-{max(doc['loadavg_groups']):.2f} before the groups; other processes used "
        f"{doc['other_load_cores_max']:.2f} cores at most during a group (shared machine: see the notes).", "",
        f"Model: random-weight Qwen3-MoE (transformers `Qwen3MoeConfig`, bf16): hidden {shape['hidden_size']}, "
        f"{shape['num_hidden_layers']} layers (all MoE), {shape['num_experts']} experts, top-"
        f"{shape['num_experts_per_tok']} (normalized), moe_intermediate {shape['moe_intermediate_size']}, "
        f"{shape['num_attention_heads']} heads / {shape['num_key_value_heads']} KV heads of {shape['head_dim']}, "
        f"vocab {shape['vocab_size']}; {doc['params_m']:.0f}M parameters ({doc['expert_mb']:.0f} MiB of routed "
        f"experts per layer, {doc['expert_mb'] * shape['num_hidden_layers'] / 2:.0f} MiB of them per EP2 rank). "
        f"MoE layers run on {doc['moe_path']}.", "",
        "Set-ups: **EP1** = one process, 2 threads; **EP2** = two rank processes (gloo over 127.0.0.1), 1 thread "
        "each, each with its own requests and half of every layer's experts; **EP1 (1 rank's share)** = one "
        "process, 1 thread, one EP2 rank's batch: the same per-rank work without any exchange (but all 64 experts). "
        f"Decode: {DECODE_BATCH} sequences in the group ({DECODE_PROMPT}-token prompts, {doc['decode_tokens']} "
        f"tokens each, ignore_eos, greedy), the median of every step with the whole batch decoding; prefill: one "
        f"{PREFILL_LEN}-token prompt per rank (EP1: 2 in one step). {doc['rounds']} rounds (the set-ups "
        f"interleaved, each round its own prompts), {doc['repeats']} decode and {doc['repeats']} prefill phases "
        "per round, after an unmeasured warm-up; medians over all of them. all-to-all = time inside "
        "`all_to_all_single` (the dispatch's count, slot-id, row and combine exchanges of every MoE layer), which "
        "includes waiting for the other rank; lockstep = the per-step all-reduce of `join_step`.", "",
    ]


def ep_table(doc: dict) -> list[str]:
    """EP1 vs EP2, exact and int8 dispatch: a row per set-up."""
    s = doc["summary"]
    lines = [
        "## EP1 vs EP2, exact vs int8 dispatch", "",
        "| set-up | decode ms/step | all-to-all ms (share) | lockstep ms | experts ms | prefill ms/step "
        "| all-to-all ms (share) | a2a bytes/step decode (bytes_sent, group) | prefill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {"ep1": "EP1 (2 threads, batch 16 / 2 x 256)", "ep1_half": "EP1 (1 thread, 1 rank's share: 8 / 1 x 256)",
              "ep2": "EP2 exact (bf16 wire)", "ep2_int8": "EP2 int8 dispatch"}
    for key, label in labels.items():
        d, p = s.get(f"{key}_decode"), s.get(f"{key}_prefill")
        if d is None or p is None:
            lines.append(f"| {label} | {doc['errors'].get(key, 'not measured')} | | | | | | | |")
            continue
        ep = key.startswith("ep2")
        lines.append(
            f"| {label} | {fmt(d['step_ms'])} | {a2a_cell(d) if ep else '—'} "
            f"| {fmt(d['allreduce_ms'], '.2f') if ep else '—'} | {fmt(d['experts_ms']) if ep else '—'} "
            f"| {fmt(p['step_ms'])} | {a2a_cell(p) if ep else '—'} "
            f"| {kb(d['bytes_per_step']) if ep else '—'} | {kb(p['bytes_per_step']) if ep else '—'} |")
    return lines


def ratio_list(doc: dict) -> list[str]:
    """The set-ups against each other, in the same run."""
    s, shape = doc["summary"], doc["shape"]
    r = s["ratios"]
    return [
        "", "Ratios (same run):", "",
        f"- EP1 / EP2 step time (> 1: EP2 faster): decode **{fmt(r.get('ep1_over_ep2_decode'), '.2f')}**, prefill "
        f"**{fmt(r.get('ep1_over_ep2_prefill'), '.2f')}**; per round, decode "
        f"{', '.join(fmt(x, '.2f') for x in r.get('ep1_over_ep2_decode_rounds', []))}.",
        f"- EP2 step minus EP1 at one rank's share (the subtraction estimate of what EP adds per step): decode "
        f"{fmt(r.get('ep2_minus_half_decode_ms'))} ms, prefill {fmt(r.get('ep2_minus_half_prefill_ms'))} ms "
        f"(instrumented all-to-all: {fmt((s.get('ep2_decode') or {}).get('a2a_ms'))} / "
        f"{fmt((s.get('ep2_prefill') or {}).get('a2a_ms'))} ms).",
        f"- int8 / exact all-to-all bytes: decode **{fmt(r.get('int8_over_exact_bytes_decode'), '.3f')}**, prefill "
        f"**{fmt(r.get('int8_over_exact_bytes_prefill'), '.3f')}** (the dispatch half shrinks to (H + 4) / 2H = "
        f"{(shape['hidden_size'] + 4) / (2 * shape['hidden_size']):.3f}; the combine half stays bf16); step time "
        f"int8 / exact: decode **{fmt(r.get('int8_over_exact_time_decode'), '.2f')}**, prefill "
        f"**{fmt(r.get('int8_over_exact_time_prefill'), '.2f')}** (int8 codec "
        f"{fmt((s.get('ep2_int8_decode') or {}).get('codec_ms'), '.2f')} ms per decode step).",
        f"- Wire bytes counted by the wrapper (rows + int64 slot ids + counts) over `bytes_sent` (rows only): "
        f"exact decode {fmt(r.get('wire_over_counter_exact_decode'), '.3f')}, int8 decode "
        f"{fmt(r.get('wire_over_counter_int8_decode'), '.3f')}: the slot ids and counts are not in `bytes_sent`.",
        f"- Expert work per rank in the EP2 runs of this (unskewed) model: balancedness "
        f"{fmt((s.get('ep2_decode') or {}).get('balancedness'), '.3f')} (decode).",
    ]


def quality_section(doc: dict) -> list[str]:
    """int8 dispatch against exact: greedy agreement, and one MoE layer's output error."""
    s = doc["summary"]
    q, le = s["quality"], s["layer_error"]
    return [
        "", "## int8 dispatch quality", "",
        f"Greedy agreement with exact EP2 over every decoded token of the measured decode phases: "
        f"**{q['int8_vs_ep2']['equal']}/{q['int8_vs_ep2']['tokens']} = {fmt(q['int8_vs_ep2']['agreement'], '.3f')}**"
        f" (identical prefix {fmt(q['int8_vs_ep2']['identical_prefix'], '.3f')}; first token "
        f"{q['int8_vs_ep2']['first_token_equal']}/{q['int8_vs_ep2']['sequences']}). For scale, exact EP2 against "
        f"EP1 on the same prompts: {q['ep2_vs_ep1']['equal']}/{q['ep2_vs_ep1']['tokens']} = "
        f"{fmt(q['ep2_vs_ep1']['agreement'], '.3f')}; int8 EP2 against EP1 {fmt(q['int8_vs_ep1']['agreement'], '.3f')}"
        ". (A random-weight model's next-token distribution is flat, so one flipped token changes the rest of the "
        "sequence: this is a harsh, pessimistic measure.)", "",
        f"One MoE layer's output (layer {le['layer']}, {le['tokens']} real hidden states: 4 x {PREFILL_LEN}-token "
        "prompts through the model, captured at the layer's input), kvbaton's `SparseMoeBlock` experts over the bf16 "
        "rows vs over `dequantize_rows(quantize_rows(rows))`:", "",
        "| | max abs error | mean abs error | relative RMS error | mean abs output |",
        "|---|---|---|---|---|",
        f"| int8 wire vs bf16 | {le['int8_max_abs_err']:.2e} | {le['int8_mean_abs_err']:.2e} "
        f"| {le['int8_rel_rms_err']:.2e} | {le['mean_abs_output']:.2e} |",
        f"| bf16 vs fp32 (bf16's own error, same inputs) | {le['bf16_vs_fp32_max_abs_err']:.2e} "
        f"| {le['bf16_vs_fp32_mean_abs_err']:.2e} | | |", "",
        f"Over all {len(s['layer_error_all'])} layers: int8 relative RMS error "
        f"{min(x['int8_rel_rms_err'] for x in s['layer_error_all']):.2e}-"
        f"{max(x['int8_rel_rms_err'] for x in s['layer_error_all']):.2e}, max abs error up to "
        f"{max(x['int8_max_abs_err'] for x in s['layer_error_all']):.2e}.",
    ]


def eplb_section(doc: dict) -> list[str]:
    """EPLB on the skewed model, before and after `rebalance_now()` (or why it was not measured)."""
    e = doc["summary"].get("eplb")
    head = ["", "## EPLB on a skewed workload (EP2, 64 experts + 4 redundant slots)", ""]
    if e is None:
        return [*head, f"Not measured: {doc['errors'].get('eplb', '?')}"]
    return [*head, *eplb_table(doc, e), *eplb_reading(doc, e)]


def eplb_table(doc: dict, e: dict) -> list[str]:
    """How the skewed model was made, and a row per phase before and after the rebalance."""
    lines = [
        f"The routers of a copy of the model favour experts {', '.join(map(str, HOT_EXPERTS))}: channel 0 of "
        f"its residual stream is a constant ({SKEW_CHANNEL_VALUE} in every embedding row, written by no "
        "attention or expert output, read by nothing but the routers) and their gate rows get a logit boost on "
        "it, calibrated per layer so that "
        f"about {doc['hot_share']:.0%} of the top-k choices go to them (on held-out prompts of the workload's "
        f"shape: {', '.join(f'{x:.2f}' for x in doc['hot_share_held_out'])} per layer). "
        "EP2's first placement (before any load is known: experts alternate between the ranks, the "
        "4 redundant slots copy experts 0-3) puts all six on rank 0. Each phase has fresh prompts, the shapes "
        f"above (decode: 8 sequences per rank; prefill: one {PREFILL_LEN}-token prompt per rank); "
        f"{doc['repeats']} decode and {doc['repeats']} prefill phases before and as many after "
        "`rebalance_now()` (plan from the load so far, copy the moved experts' weights: "
        f"{fmt(e['rebalance_s'], '.2f')} s).", "",
        "| phase | balancedness (mean / max rows_computed per rank) | rows per rank (all its steps) "
        "| expert slots hit per step, per rank (all layers) | experts ms per rank | ms/step "
        "| all-to-all ms (share) |", "|---|---|---|---|---|---|---|",
    ]
    for key, label in (("before", "decode, before EPLB"), ("after", "decode, after `rebalance_now()`"),
                       ("before_prefill", f"prefill ({PREFILL_LEN} tokens per rank), before"),
                       ("after_prefill", "prefill, after")):
        d = e[key]
        if d is None:
            continue
        rows = " / ".join(f"{p['rows_total']:,}" for p in d["per_rank"])
        slots = " / ".join(f"{p['slots_hit']:.0f}" for p in d["per_rank"])
        experts = " / ".join(f"{1e3 * p['experts']:.1f}" for p in d["per_rank"])
        lines.append(f"| {label} | {fmt(d['balancedness'], '.3f')} | {rows} | {slots} | {experts} "
                     f"| {fmt(d['step_ms'])} | {a2a_cell(d)} |")
    return lines


def eplb_reading(doc: dict, e: dict) -> list[str]:
    """What the rebalance changed, and why expert time follows slots at decode and rows at prefill."""
    lines = [
        "", f"After / before: balancedness **{fmt(e['balancedness_ratio'], '.2f')}x**, decode step time "
        f"**{fmt(e['time_ratio'], '.2f')}** (< 1: faster after); prefill: balancedness "
        f"**{fmt(e['prefill_balancedness_ratio'], '.2f')}x**, step time **{fmt(e['prefill_time_ratio'], '.2f')}**. "
        "Rank 0's slots of layer 0 after: "
        f"{e['layer0_slots_rank0']}. Greedy outputs against EP1 on the same prompts: before "
        f"{fmt(e['agree_before'], '.3f')}, after {fmt(e['agree_after'], '.3f')} of the tokens; MoE layers on the "
        f"C kernel per rank at the start -> end: {e['kernel_layers']}.",
    ]
    per_slot = lambda d: max(p["rows"] / p["slots_hit"] for p in d["per_rank"] if p["slots_hit"])  # noqa: E731
    top = lambda d: max(p["slots_hit"] for p in d["per_rank"])  # noqa: E731
    if e["before"] and e["after"] and e["before_prefill"]:
        lines += ["", f"A decode step gives each expert slot it hits {per_slot(e['before']):.1f} rows on "
                  "average (the busier rank, median step), so a rank's expert time follows the slots it has to "
                  "read (the "
                  f"busiest rank: {top(e['before']):.0f} before, {top(e['after']):.0f} after), not its rows; "
                  f"prefill ({per_slot(e['before_prefill']):.0f} rows per slot) follows the rows. EPLB's default "
                  "objective balances tokens (`balance_objective=\"active_experts\"` is the other)."]
    if doc["eplb_moe_kernel"] == "off":
        lines += ["", f"These two groups (EP2 and its EP1 reference) ran with `{MOE_KERNEL_ENV}=0` "
                  "(`--eplb-moe-kernel off`, the default): PyTorch's expert loop before and after, so that both "
                  "phases run the same code. On the C MoE kernel (`--eplb-moe-kernel on`) the swap loses it: "
                  "the kernel packs each layer's expert weights in place, and the rebalanced experts are built "
                  "by `stacked_experts` without the kernel, over kept slots copied in packed layout and moved "
                  "ones read unpacked from the checkpoint, so after `rebalance_now()` the layers run PyTorch's "
                  "loop over partly packed weights (slower, and the outputs change). The other sections run on "
                  "the default compute path."]
    return lines
