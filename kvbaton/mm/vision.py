"""A vision-language checkpoint's image encoder, run where the images are encoded (the language worker itself
today; an encoder worker of E/P/D next): the checkpoint's own image processor, its vision tower and its projector
into the text model's embedding space. One image becomes the embeddings of its placeholder tokens in the prompt:
`VisionSpec.tokens_per_image` of them (LLaVA), or that many per tile of its grid (Idefics3 / SmolVLM).

The tower and the projector are transformers' own modules, loaded from the checkpoint's weights: an encoder is
not what kvbaton makes faster (the text model's steps are), and transformers' modules are the parity oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, cast

import torch
from safetensors import safe_open

from kvbaton.config import ConfigError, ModelConfig
from kvbaton.mm.images import DecodedImage


class ImageEncoder(Protocol):
    def encode(self, images: list[DecodedImage]) -> list[torch.Tensor]:
        """Each image's embeddings [tokens_per_image, text hidden size], in the text model's dtype."""
        ...


def _load_parts(model_dir: Path, parts: dict[str, torch.nn.Module], dtype: torch.dtype) -> None:
    """Each module of `parts` from the checkpoint's weights under its prefix (after an optional `model.`), all
    of them or a ConfigError; then in `dtype`, for inference only."""
    weights: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in parts}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                name = hf_name.removeprefix("model.")
                for prefix, into in weights.items():
                    if name.startswith(prefix):
                        into[name.removeprefix(prefix)] = f.get_tensor(hf_name)
    try:
        for prefix, module in parts.items():
            module.load_state_dict(weights[prefix], strict=True)
    except RuntimeError as exc:
        raise ConfigError(f"{model_dir}: the vision tower's or projector's weights do not fit its config: "
                          f"{str(exc)[:300]}") from None
    for module in parts.values():
        module.to(dtype).eval().requires_grad_(False)


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
        _load_parts(model_dir, {"vision_tower.": self.tower, "multi_modal_projector.": self.projector}, dtype)
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


class Idefics3Encoder:
    """Idefics3 / SmolVLM (and SmolVLM2): the processor cuts an image into a grid of tiles and adds the whole
    image (the global image, last), each padded to the tile's size; the SigLIP tower encodes every tile, its
    padding masked out patch by patch, and the connector folds each scale x scale patches into one token (pixel
    shuffle) and projects them. The image's embeddings are its tiles', in order: they fill its placeholder runs
    in the order the prompt holds them (`mm/tiles.py`)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from transformers import AutoConfig, AutoImageProcessor
        from transformers.models.idefics3 import modeling_idefics3
        from transformers.models.smolvlm import modeling_smolvlm

        config = AutoConfig.from_pretrained(str(model_dir))
        self.dtype = dtype
        self.patch = int(config.vision_config.patch_size)
        # SmolVLM2's classes are Idefics3's under another name (their weights and images alike)
        tower, connector = ((modeling_smolvlm.SmolVLMVisionTransformer, modeling_smolvlm.SmolVLMConnector)
                            if config.model_type == "smolvlm" else
                            (modeling_idefics3.Idefics3VisionTransformer, modeling_idefics3.Idefics3Connector))
        # (typed as a plain module: transformers' decorated `PreTrainedModel.to` confuses mypy)
        self.tower: torch.nn.Module = cast(torch.nn.Module, tower(config.vision_config))
        self.connector: torch.nn.Module = connector(config)
        _load_parts(model_dir, {"vision_model.": self.tower, "connector.": self.connector}, dtype)
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))

    @torch.inference_mode()
    def encode(self, images: list[DecodedImage]) -> list[torch.Tensor]:
        out = []
        for image in images:  # one at a time: the processor pads a batch's images to the largest grid
            inputs = self.processor(images=[[image.to_pil()]], return_tensors="pt")
            pixels = inputs["pixel_values"][0].to(self.dtype)  # [tiles, 3, tile, tile]
            mask = inputs["pixel_attention_mask"][0].bool() if "pixel_attention_mask" in inputs else torch.ones(
                pixels.shape[0], *pixels.shape[2:], dtype=torch.bool)  # [tiles, tile, tile]: False where padded
            patches = mask.unfold(1, self.patch, self.patch).unfold(2, self.patch, self.patch)
            hidden = self.tower(pixel_values=pixels, patch_attention_mask=patches.any(dim=(-1, -2))).last_hidden_state
            tokens = self.connector(hidden)  # [tiles, tokens per tile, text hidden size]
            out.append(tokens.reshape(-1, tokens.shape[-1]))
        return out


class Qwen2VLEncoder:
    """Qwen2-VL and Qwen2.5-VL (whose ViT attends within windows in most blocks): the processor resizes an image
    to whole patches within its pixel bounds (`mm/dynamic_resolution.py`) and flattens them; the ViT encodes them
    with 2-D rotary positions and the merger folds each 2 x 2 patches into one embedding of the text model's
    width: as many as the image's run of placeholders."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from transformers import AutoConfig, AutoImageProcessor
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        config = AutoConfig.from_pretrained(str(model_dir))
        self.dtype = dtype
        tower = (Qwen2_5_VisionTransformerPretrainedModel if config.model_type == "qwen2_5_vl"
                 else Qwen2VisionTransformerPretrainedModel)
        self.tower: torch.nn.Module = cast(torch.nn.Module, tower._from_config(config.vision_config))
        _load_parts(model_dir, {"visual.": self.tower}, dtype)
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))

    @torch.inference_mode()
    def encode(self, images: list[DecodedImage]) -> list[torch.Tensor]:
        out = []
        for image in images:
            inputs = self.processor(images=[image.to_pil()], return_tensors="pt")
            merged = self.tower(inputs["pixel_values"].to(self.dtype), grid_thw=inputs["image_grid_thw"]).pooler_output
            out.append(merged.reshape(-1, merged.shape[-1]))
        return out


def load_image_encoder(model_dir: Path, dtype: torch.dtype) -> ImageEncoder | None:
    """The encoder of a vision-language checkpoint, None for a text-only one."""
    vision = ModelConfig.from_dir(model_dir).vision
    if vision is None:
        return None
    if vision.encoder == "llava":
        return LlavaEncoder(model_dir, dtype)
    if vision.encoder == "idefics3":
        return Idefics3Encoder(model_dir, dtype)
    if vision.encoder == "qwen2_vl":
        return Qwen2VLEncoder(model_dir, dtype)
    raise ConfigError(f"no image encoder for {vision.encoder!r}")
