"""A vision-language checkpoint's image encoder, run where the images are encoded (the language worker itself
today; an encoder worker of E/P/D next): the checkpoint's own image processor, its vision tower and its projector
into the text model's embedding space. One image becomes `VisionSpec.tokens_per_image` embeddings, which stand
in for that many placeholder tokens of the prompt.

The tower and the projector are transformers' own modules, loaded from the checkpoint's weights: an encoder is
not what kvbaton makes faster (the text model's steps are), and transformers' modules are the parity oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from kvbaton.config import ConfigError, ModelConfig
from kvbaton.mm.images import DecodedImage


class ImageEncoder(Protocol):
    def encode(self, images: list[DecodedImage]) -> list[torch.Tensor]:
        """Each image's embeddings [tokens_per_image, text hidden size], in the text model's dtype."""
        ...


class LlavaEncoder:
    """LLaVA: a CLIP (or SigLIP) tower, the hidden states of `vision_feature_layer` (without the CLS position
    under the "default" strategy), a two-layer MLP projector."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from transformers import AutoImageProcessor, AutoModel, LlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        config = LlavaConfig.from_pretrained(str(model_dir))
        self.dtype = dtype
        self.feature_layer = config.vision_feature_layer
        self.keep_cls = config.vision_feature_select_strategy == "full"
        self.tower = AutoModel.from_config(config.vision_config)
        self.projector = LlavaMultiModalProjector(config)
        weights: dict[str, dict[str, torch.Tensor]] = {"vision_tower.": {}, "multi_modal_projector.": {}}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    name = hf_name.removeprefix("model.")
                    for prefix, into in weights.items():
                        if name.startswith(prefix):
                            into[name.removeprefix(prefix)] = f.get_tensor(hf_name)
        try:
            self.tower.load_state_dict(weights["vision_tower."], strict=True)
            self.projector.load_state_dict(weights["multi_modal_projector."], strict=True)
        except RuntimeError as exc:
            raise ConfigError(f"{model_dir}: the vision tower's or projector's weights do not fit its config: "
                              f"{str(exc)[:300]}") from None
        self.tower.to(dtype).eval().requires_grad_(False)
        self.projector.to(dtype).eval().requires_grad_(False)
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))

    @torch.inference_mode()
    def encode(self, images: list[DecodedImage]) -> list[torch.Tensor]:
        if not images:
            return []
        pixels = self.processor(images=[im.to_pil() for im in images], return_tensors="pt")["pixel_values"]
        hidden = self.tower(pixels.to(self.dtype), output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        features = torch.cat([hidden[i] if self.keep_cls else hidden[i][:, 1:] for i in layers], dim=-1)
        return list(self.projector(features))


def load_image_encoder(model_dir: Path, dtype: torch.dtype) -> ImageEncoder | None:
    """The encoder of a vision-language checkpoint, None for a text-only one."""
    vision = ModelConfig.from_dir(model_dir).vision
    if vision is None:
        return None
    if vision.encoder == "llava":
        return LlavaEncoder(model_dir, dtype)
    raise ConfigError(f"no image encoder for {vision.encoder!r}")
