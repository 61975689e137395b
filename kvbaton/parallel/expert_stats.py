"""Expert load statistics: what a MoE model's routers chose, per layer and expert, over the last steps; what
EPLB plans from, and what `GET /experts` and the `kvbaton:expert_tokens` gauges show."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from kvbaton.layers.moe.block import SparseMoeBlock
from kvbaton.layers.moe.load_stats import ExpertLoadWindow
from kvbaton.sched.info import ExpertLoad


@dataclass(frozen=True)
class MoELayer:
    index: int  # the decoder layer it is in (how the checkpoint names its weights)
    block: SparseMoeBlock


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [MoELayer(i, layer.mlp) for i, layer in enumerate(getattr(model, "layers", []))
            if isinstance(layer.mlp, SparseMoeBlock)]


class ExpertStats:
    def __init__(self, layers: list[MoELayer], window_steps: int) -> None:
        self.layers = layers
        self.window = ExpertLoadWindow(len(layers), layers[0].block.moe.num_experts, window_steps)

    @classmethod
    def of(cls, model: nn.Module, window_steps: int) -> ExpertStats | None:
        """None for a dense model."""
        layers = moe_layers(model)
        return cls(layers, window_steps) if layers else None

    def record_step(self, steps: int = 1) -> None:
        """The tokens the last `steps` forwards routed (this engine's own requests; a decode burst runs several):
        counted in the first of them, each a step of the window."""
        for i, layer in enumerate(self.layers):
            self.window.record(i, layer.block.take_token_counts().tolist())
        for _ in range(steps):
            self.window.end_step()

    def snapshot(self, **expert_parallel: object) -> ExpertLoad:
        """The window as a frontend sees it; `expert_parallel`: an EP rank's fields of `ExpertLoad`."""
        return ExpertLoad(layers=tuple(layer.index for layer in self.layers),
                          counts=tuple(tuple(row) for row in self.window.totals()),
                          window_steps=self.window.window_steps, steps=self.window.steps_recorded,
                          **expert_parallel)  # type: ignore[arg-type]
