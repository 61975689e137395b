"""The in-process engine: tokenizer + engine core + output processing, stepped by the caller."""

from __future__ import annotations

import time

from kvbaton.config import EngineConfig, ModelConfig
from kvbaton.engine.core import EngineCore
from kvbaton.mm.images import DecodedImage
from kvbaton.mm.placeholders import image_spans
from kvbaton.models.registry import resolve_model
from kvbaton.platform.process import freeze_long_lived_objects, set_compute_threads
from kvbaton.sched.info import EngineStats, validate_request
from kvbaton.sched.outputs import FinishReason
from kvbaton.sched.request import Request
from kvbaton.sched.sampling_params import InvalidRequestError, SamplingParams
from kvbaton.text.inputs import PromptType, tokenize_prompt
from kvbaton.text.output_processor import OutputProcessor
from kvbaton.text.request_output import RequestOutput
from kvbaton.text.tokenizer import Tokenizer, eos_token_ids


def prompt_images(prompt: PromptType) -> list[DecodedImage]:
    """A prompt dict's images, vLLM's way: `{"prompt_token_ids": [...], "multi_modal_data": {"image": [...]}}`
    (PIL images or `DecodedImage`s; one image alone is a list of one)."""
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return []
    data = prompt["multi_modal_data"]
    images = data.get("image", []) if isinstance(data, dict) else None
    if images is None or set(data) - {"image"}:
        raise InvalidRequestError("multi_modal_data takes images only: {'image': [...]}")
    images = images if isinstance(images, list) else [images]
    try:
        return [im if isinstance(im, DecodedImage) else DecodedImage.of_pil(im) for im in images]
    except AttributeError:
        raise InvalidRequestError("multi_modal_data's images must be PIL images") from None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model)
        model_config = ModelConfig.from_dir(self.model_dir)  # fails first, with the clearest error
        self.tokenizer = Tokenizer(self.model_dir)
        self.eos_token_ids = eos_token_ids(model_config, self.model_dir)
        set_compute_threads(config.num_threads)
        self.core = EngineCore(config, self.model_dir, self.eos_token_ids)
        freeze_long_lived_objects()
        self.model_config = self.core.model_config
        self.info = self.core.info
        self.kv_cache = self.core.kv_cache
        self.outputs = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError and changes nothing if bad."""
        params = params or SamplingParams()
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        self.validate(token_ids, params, priority)
        self.core.validate_grammar(params)
        images = prompt_images(prompt)
        spans = image_spans(self.core.model_config.vision, token_ids, [im.digest for im in images],
                            [(im.width, im.height) for im in images])
        req = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids, priority=priority,
                      arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
                      image_spans=spans)
        self.core.add_request(req, images)
        self.outputs.add_request(request_id, text, token_ids, params, req.arrival_time)

    def validate(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        validate_request(self.info, token_ids, params, priority)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests(ids)
        return [out for out in map(self.outputs.abort, ids) if out is not None]

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        results = []
        step = self.core.step()
        # A batch that raised: its requests end as aborted (the core logged why), the rest go on.
        results += [out for out in (self.outputs.abort(f.request_id) for f in step.failed_requests) if out is not None]
        for core_output in step.outputs:
            out, stop_string = self.outputs.process(core_output)
            if stop_string is not None and core_output.finish_reason is None:
                self.core.abort_requests([core_output.request_id], FinishReason.STOP)
            results.append(out)
        self.core.save_to_store()  # the step's new blocks into the KV store tiers, its outputs processed first
        return results

    def stats(self) -> EngineStats:
        return self.core.stats()

    def check_integrity(self) -> None:
        self.core.check_integrity()
