"""Optional `torch.compile` of the model's pure-tensor parts (`EngineConfig.compile`).

Only the MLPs are compiled: they take one [T, E] tensor and nothing else, so one dynamic-shape
graph serves every batch size. Attention depends on per-step metadata (block tables, spans)
that would make the compiler guard and recompile, so it stays eager.
"""

from __future__ import annotations

import torch

from kvbaton.engine.model_runner import ModelRunner


def compile_model(runner: ModelRunner) -> None:
    for layer in runner.model.layers:
        # NOTE: a compiled graph cannot call the ctypes kernels; inside it, inductor's own code runs.
        for linear in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.small_batch_kernel = linear.packed = None
        layer.mlp.fused_gate_up = None
        layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=True, fullgraph=True)
