"""Optional `torch.compile` of the model's pure-tensor parts (`EngineConfig.compile`).

Only the MLPs are compiled: they take one [T, E] tensor and nothing else, so one dynamic-shape
graph serves every batch size. Attention depends on per-step metadata (block tables, spans)
that would make the compiler guard and recompile, so it stays eager.
"""

from __future__ import annotations

import torch

from kvbaton.engine.model_runner import ModelRunner
from kvbaton.layers.mlp import MLP


def compile_model(runner: ModelRunner) -> None:
    runner.model.layer_loop = None  # the compiled MLPs run in the Python loop only
    for mlp in runner.model.modules():
        if isinstance(mlp, MLP):
            _compile_mlp(mlp)


def _compile_mlp(mlp: MLP) -> None:
    # NOTE: a compiled graph cannot call the ctypes kernels; inside it, inductor's own code runs.
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.rows_kernel = linear.packed = linear.onednn = None
    mlp.fused_gate_up = None
    # NOTE: only this instance's forward is replaced (Module.compile would wrap __call__, hook dispatch and all);
    # mypy rejects assigning to a method, hence the ignore.
    mlp.forward = torch.compile(mlp.forward, dynamic=True, fullgraph=True)  # type: ignore[method-assign]
