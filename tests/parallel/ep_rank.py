"""One rank of an expert-parallel group, as its own process: `python ep_rank.py JOB_JSON` runs the job's prompt
sets one after another (between them, with "rebalance", every rank re-places its experts from the load so far)
and prints, as JSON, each set's greedy outputs and the token-expert pairs this rank's experts computed."""

from __future__ import annotations

import json
import os
import sys

from kvbaton import LLM, SamplingParams
from kvbaton.config import ExpertParallelConfig


def main() -> None:
    job = json.loads(sys.argv[1])
    os.environ.update(job.get("env", {}))
    ep = ExpertParallelConfig(size=job["size"], rank=job["rank"], init_method=f"tcp://127.0.0.1:{job['port']}",
                              int8_dispatch=job.get("int8", False), num_redundant_experts=job.get("redundant", 0),
                              timeout_s=30)
    llm = LLM(job["model"], dtype=job.get("dtype", "float32"), num_threads=1, block_size=4, expert_parallel=ep)
    group = llm.engine.core.expert_parallel
    assert group is not None
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    if job.get("fault_token") is not None:
        _inject_fault(llm, job["fault_token"])
    loop_steps = _count_loop_steps(llm)
    results = []
    for prompts in job["prompt_sets"]:
        before = group.rows_computed
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results.append({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
                        "rows_computed": group.rows_computed - before})
        if job.get("rebalance"):
            group.rebalance_now()
    llm.engine.check_integrity()
    on_kernel = sum(layer.block.experts.kernel is not None for layer in group.rebalancer.layers)
    print(json.dumps({"sets": results, "bytes_sent": group.bytes_sent, "rebalances": group.rebalancer.rebalances,
                      "layers_on_kernel": on_kernel, "c_loop_steps": loop_steps[0]}))
    group.close()


def _count_loop_steps(llm: LLM) -> list[int]:
    """[steps whose logits the C layer loop computed], counted as they run (0 without the loop)."""
    loop, count = llm.engine.core.runner.model.layer_loop, [0]
    if loop is not None:
        logits = loop.logits

        def counted(*args):
            count[0] += 1
            return logits(*args)

        loop.logits = counted
    return count


def _inject_fault(llm: LLM, token: int) -> None:
    """A kernel fault in this rank's second decoder layer (after the first MoE layer's exchange), in every step
    whose batch holds `token`: mid-forward, as a real fault would strike."""
    model = llm.engine.core.runner.model
    batch: dict[str, bool] = {}

    def note_batch(module, args):
        batch["faulty"] = bool((args[0] == token).any())

    def fail(module, args):
        if batch.get("faulty"):
            raise RuntimeError("injected kernel fault")

    model.register_forward_pre_hook(note_batch)
    model.layers[1].register_forward_pre_hook(fail)


if __name__ == "__main__":
    main()
