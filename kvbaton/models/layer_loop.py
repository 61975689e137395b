"""Decode steps without per-layer Python: the Llama family's layers described once for the C layer loop
(kvbaton.kernels.layer_loop, decode_layers.c), which then runs every layer of a step in one call.

The runner builds it at start-up, after the compute plan gave each layer its kernels: each linear's C kernels
(the ones `Linear.forward` would pick, in its order), the C norms (per-head q/k norms included), the C SwiGLU
activation, a MoE layer's C gate and experts kernels, the C decode attention and the KV pools. A step takes it
when all its tokens attend as decode queries (a decode batch, or any step of deterministic mode's per-token
attention) and every linear (and MoE gate) has a C kernel for its row count; any other step, and any model it
does not describe (shared experts, sigmoid-scored gates, whole-q/k norms, clamped qkv, latent attention, fp32
weights, quantized KV pools, `KVBATON_LAYER_LOOP=0`), runs the Python loop. Expert-parallel MoE layers run in
it too, their all-to-all called back from the loop (`ExpertExchange`). Both call the same
kernels in the same order, so they give the same bits (tests/models/test_layer_loop.py).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from kvbaton.kernels import AMXLinear, DotLinear, PackedLinear, PagedDecodeKernel, SmallBatchLinear
from kvbaton.kernels.layer_loop import (
    KV_FORMATS,
    LIN_AMX,
    LIN_DOT,
    LIN_PACKED,
    LIN_PACKED_GATED,
    LIN_STREAM,
    MAX_HEAD_DIM,
    MOE_EXCHANGE,
    DecodeLayers,
    KernelChoice,
    LayerSpec,
    StackSpec,
    decode_layers,
    linear_spec,
)
from kvbaton.kernels.linear import MAX_LINEAR_ROWS, PANEL
from kvbaton.layers.attention import AttentionMetadata
from kvbaton.layers.linear import Linear
from kvbaton.layers.moe.block import SparseMoeBlock
from kvbaton.models.llama import DecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)

LAYER_LOOP_ENV = "KVBATON_LAYER_LOOP"  # 0: every step through the Python loop (benchmarks compare the two)


class ExpertExchange:
    """The C loop's MoE exchange (decode_layers.c's MoeExchange) for expert-parallel blocks: each MoE layer's rows go
    through the block's all-to-all dispatcher, as `SparseMoeBlock.forward` sends them, called back from the loop's
    thread between two of its parallel regions (so the local experts and torch keep every thread). The rest of the
    layer stays in C; every rank still makes the same exchanges in the same order.
    A failure is kept (`error`) for the caller to raise once the loop returned: an exception cannot cross C."""

    def __init__(self, blocks: dict[int, SparseMoeBlock], hidden: int) -> None:
        self.blocks = blocks  # by decoder layer index
        self.hidden = hidden
        self.error: BaseException | None = None
        self.callback = MOE_EXCHANGE(self._exchange)  # kept alive as long as the stack points at it

    def _exchange(self, layer: int, rows: int, h: int, ids: int, weights: int, out: int) -> int:
        try:
            block = self.blocks[layer]
            assert block.dispatcher is not None
            k = block.moe.top_k
            ids_t = _view(ids, (rows, k), torch.int64)
            block.expert_token_counts += torch.bincount(ids_t.flatten(), minlength=block.moe.num_experts)
            combined = block.dispatcher(_view(h, (rows, self.hidden), torch.bfloat16), ids_t,
                                        _view(weights, (rows, k), torch.float32))
            _view(out, (rows, self.hidden), torch.bfloat16).copy_(combined)
            return 0
        except BaseException as exc:  # noqa: BLE001 - handed to the caller: it cannot unwind through C
            self.error = exc
            return 1

    def take_error(self) -> BaseException | None:
        error, self.error = self.error, None
        return error


def _view(address: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over memory the C loop owns (its workspace), valid during the callback only: no copy."""
    nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype).view(shape)


class LayerLoop:
    """The C loop over one model's layers and KV pools; `runs` says whether it takes a step."""

    def __init__(self, layers: DecodeLayers, kv_caches: list[torch.Tensor], decode_kernel: PagedDecodeKernel,
                 embed: torch.Tensor, exchange: ExpertExchange | None = None) -> None:
        self.layers = layers
        self.kv_caches = kv_caches
        self.decode_kernel = decode_kernel
        self.embed = embed  # [V, E] bf16: a burst looks each step's tokens up in C
        self.exchange = exchange  # expert-parallel MoE layers' exchange, called back from the loop

    def runs(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor], rows: int) -> bool:
        # NOTE: after_layer (layer-wise KV sending) needs Python between layers; a prefill worker's steps have it
        return (not meta.prefills and meta.after_layer is None and meta.num_decodes == rows
                and meta.block_size == self.layers.stack.block_size
                and meta.decode_kernel is self.decode_kernel and kv_caches is self.kv_caches
                and self.layers.takes(rows))

    @property
    def has_head(self) -> bool:
        """Whether `logits` runs the final norm and the lm_head in the same call."""
        return self.layers.has_head

    def bursts(self, rows: int) -> bool:
        """Whether `burst` takes a decode burst of `rows` rows (a stack with a head, and a kernel for each linear)."""
        return self.layers.has_head and self.layers.takes(rows)

    def burst(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
              steps: int) -> torch.Tensor:
        """`steps` greedy decode steps in one C call: tokens, positions [T] of the first step, block_table [T, nb]
        covering the last -> [T, steps] each step's argmax (the bits of as many `logits` calls, each followed by
        the sampler's argmax)."""
        try:
            return self.layers.burst(self.embed, tokens, positions, block_table.contiguous(), steps)
        except RuntimeError as exc:
            self._raise_exchange_error(exc)
            raise

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the step's embeddings [T, E], overwritten by the last layer's output -> the residual stream."""
        return self._run(x, positions, meta, logits=False)

    def logits(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Every row's logits [T, V] fp32: the layers, the final norm and the lm_head in one call (`has_head`)."""
        return self._run(x, positions, meta, logits=True)

    def _run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits: bool) -> torch.Tensor:
        table, lens = meta.decode_block_table, meta.decode_context_lens
        assert table is not None and lens is not None, "a decode step carries its block table"
        # NOTE: positions and slots are bounds-checked in C (IndexError), before anything is written
        try:
            return self.layers(x, positions.contiguous(), meta.slot_mapping.contiguous(), table.contiguous(),
                               lens.contiguous(), logits=logits)
        except RuntimeError as exc:
            self._raise_exchange_error(exc)
            raise

    def _raise_exchange_error(self, failure: RuntimeError) -> None:
        """The exchange's own exception, where an exchange made the loop fail (EP's fault handling needs its type)."""
        error = self.exchange.take_error() if self.exchange is not None else None
        if error is not None:
            raise error from failure


def build_layer_loop(model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                     decode_kernel: PagedDecodeKernel | None) -> LayerLoop | None:
    """The C loop for this model and these pools, or None (with the reason logged) where it does not apply."""
    reason = _why_not(model, kv_caches, decode_kernel)
    if reason is not None:
        log.info("decode steps run the Python layer loop: %s", reason)
        return None
    assert isinstance(model, LlamaForCausalLM) and decode_kernel is not None
    cfg = model.config
    keep: list[torch.Tensor] = [model.rope.cos, model.rope.sin, *kv_caches]
    decoder_layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    layers = [_layer_spec(layer, cache, keep) for layer, cache in zip(decoder_layers, kv_caches)]
    if any(spec is None for spec in layers):
        log.info("decode steps run the Python layer loop: a linear has no C kernel for one row")
        return None
    first = decoder_layers[0]
    stack = StackSpec(num_layers=len(layers), hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                      num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                      intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps, scale=first.self_attn.attn.scale,
                      block_size=block_size, kv_format=KV_FORMATS[kv_caches[0].dtype],
                      num_threads=decode_kernel.num_threads, allow_split=int(decode_kernel.split_context),
                      cos=model.rope.cos.data_ptr(), sin=model.rope.sin.data_ptr(),
                      max_positions=model.rope.cos.shape[0], num_slots=kv_caches[0].shape[0])
    _add_head(stack, model, keep)
    blocks = {i: layer.mlp for i, layer in enumerate(decoder_layers) if isinstance(layer.mlp, SparseMoeBlock)}
    for i, block in blocks.items():
        spec = layers[i]
        assert spec is not None
        _moe_spec(stack, block, spec, keep)
    exchange = None
    if any(block.dispatcher is not None for block in blocks.values()):
        exchange = ExpertExchange(blocks, cfg.hidden_size)
        stack.exchange = exchange.callback
    loop = decode_layers(stack, [s for s in layers if s is not None], keep)
    if loop is None:
        return None
    log.info("decode steps run the C layer loop (%d layers%s)", len(layers),
             ", MoE exchanges called back" if exchange is not None else "")
    return LayerLoop(loop, kv_caches, decode_kernel, model.embed_tokens.weight, exchange)


def _add_head(stack: StackSpec, model: LlamaForCausalLM, keep: list[torch.Tensor]) -> None:
    """The final norm and the lm_head into the stack, where both have the C kernels the Python forward would
    run (else the stack has no head and the Python forward computes the logits)."""
    norm, lm_head = model.norm, model.lm_head
    head = _choices(lm_head)
    if norm.kernel is None or not head:
        log.info("the lm_head runs after the C layer loop, in Python")
        return
    keep.append(norm.weight)
    stack.final_norm = norm.weight.data_ptr()
    stack.lm_head = linear_spec(head, lm_head.out_features, lm_head.in_features, keep)


def _why_not(model: torch.nn.Module, kv_caches: list[torch.Tensor],
             decode_kernel: PagedDecodeKernel | None) -> str | None:
    if os.environ.get(LAYER_LOOP_ENV, "1") == "0":
        return f"{LAYER_LOOP_ENV}=0"
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family model"
    cfg = model.config
    if decode_kernel is None:
        return "the compute plan's decode attention is PyTorch's"
    if model.embed_tokens.weight.dtype != torch.bfloat16 or model.rope.cos.dtype != torch.bfloat16:
        return "the loop computes bf16 models (fp32 ones are the parity oracle's, in PyTorch)"
    if (cfg.qk_norm and not cfg.qk_norm_per_head) or cfg.clip_qkv is not None:
        return "whole-q/k norms and qkv clamps are not in the loop (per-head q/k norms are)"
    if any(not isinstance(layer, DecoderLayer) for layer in model.layers):
        return "a layer is not a decoder layer"
    moe = next((why for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)
                for why in [_why_not_moe(layer.mlp)] if why), None)
    if moe is not None:
        return moe
    if len(kv_caches) != len(model.layers) or any(c.dtype not in KV_FORMATS or not c.is_contiguous() or c.dim() != 4
                                                  for c in kv_caches):
        return "the loop writes bf16 or fp32 KV pools (a quantized pool is the Python loop's)"
    if cfg.head_dim > MAX_HEAD_DIM or cfg.head_dim % 2:
        return f"head_dim {cfg.head_dim}"
    return None


def _why_not_moe(block: SparseMoeBlock) -> str | None:
    """Why the loop does not take this MoE block (None: it does): it runs the gate's and the experts' C kernels,
    so the block must use both, and nothing the loop does not do yet."""
    if block.shared_experts is not None:
        return "shared experts are not in the loop"
    if block.gate.kernel is None or (block.dispatcher is None and block.experts.kernel is None):
        return "a MoE layer's gate or experts run in PyTorch (sigmoid scoring, shapes or the compute plan)"
    return None


def _moe_spec(stack: StackSpec, block: SparseMoeBlock, spec: LayerSpec, keep: list[torch.Tensor]) -> None:
    """The MoE block's gate and experts into the layer's spec, and their shapes and kernels into the stack's."""
    moe, gate, experts = block.moe, block.gate, block.experts
    assert gate.kernel is not None
    keep += [gate.weight, block.expert_token_counts]
    spec.router, spec.expert_counts = gate.weight.data_ptr(), block.expert_token_counts.data_ptr()
    stack.num_experts, stack.top_k, stack.route_max_rows = moe.num_experts, moe.top_k, gate.kernel.max_rows or 0
    stack.norm_topk, stack.route_isa = int(moe.norm_topk_prob), gate.kernel.isa
    if block.dispatcher is not None:  # the experts are spread over ranks: the stack's exchange reaches them
        return
    assert experts.kernel is not None
    keep += [experts.gate_up_proj, experts.down_proj]
    spec.experts_gate_up, spec.experts_down = experts.gate_up_proj.data_ptr(), experts.down_proj.data_ptr()
    stack.moe_intermediate = experts.intermediate_size
    stack.experts_isa, stack.amx_min_rows = experts.kernel.isa, experts.kernel.amx_min_rows


def _layer_spec(layer: DecoderLayer, kv_cache: torch.Tensor, keep: list[torch.Tensor]) -> LayerSpec | None:
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    mlp = layer.mlp
    if any(n.kernel is None for n in norms):
        return None
    attn = layer.self_attn
    norm_ptrs: dict[str, int] = {}  # per-head q/k norms (_why_not), through the C function both loops call
    if attn.q_norm is not None and attn.k_norm is not None:
        if attn.q_norm.heads is None or attn.k_norm.heads is None:
            return None
        keep += [attn.q_norm.weight, attn.k_norm.weight]
        norm_ptrs = {"q_norm": attn.q_norm.weight.data_ptr(), "k_norm": attn.k_norm.weight.data_ptr()}
    qkv, o = (linear_spec(_choices(p), p.out_features, p.in_features, keep) for p in (attn.qkv_proj, attn.o_proj))
    if qkv.options[0].kind == 0 or o.options[0].kind == 0:
        return None
    keep.extend(n.weight for n in norms)
    if isinstance(mlp, SparseMoeBlock):  # the MoE fields are the stack's to fill (_moe_spec)
        return LayerSpec(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), qkv, o, kv_cache=kv_cache.data_ptr(),
                         **norm_ptrs)
    if mlp.silu_mul is None:
        return None
    gate_up = _choices(mlp.gate_up_proj)
    fused = mlp.fused_gate_up
    if fused is not None:  # what MLP.forward runs where the rows kernel does not take the rows
        gate_up.append(KernelChoice(LIN_PACKED_GATED, fused.weight, None, packed_n=fused.weight.shape[0] * PANEL))
    specs = [linear_spec(gate_up, mlp.gate_up_proj.out_features, mlp.gate_up_proj.in_features, keep),
             linear_spec(_choices(mlp.down_proj), mlp.down_proj.out_features, mlp.down_proj.in_features, keep)]
    if any(s.options[0].kind == 0 for s in specs):
        return None
    return LayerSpec(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), qkv, o, *specs, kv_cache.data_ptr(),
                     **norm_ptrs)


def _choices(linear: Linear) -> list[KernelChoice]:
    """The C kernels `Linear.forward` tries, in its order (rows kernel, tile kernel, packed)."""
    out = []
    bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
    rows = linear.rows_kernel
    if isinstance(rows, DotLinear):
        out.append(KernelChoice(LIN_DOT, linear.weight.detach(), rows.max_rows, bias, isa=rows.isa))
    elif isinstance(rows, SmallBatchLinear):
        out.append(KernelChoice(LIN_STREAM, linear.weight.detach(), MAX_LINEAR_ROWS, bias))
    tiles = linear.tile_kernel
    if isinstance(tiles, AMXLinear):
        out.append(KernelChoice(LIN_AMX, tiles.weight, tiles.max_rows, tiles.bias))
    if isinstance(linear.packed, PackedLinear):
        out.append(KernelChoice(LIN_PACKED, linear.packed.weight, None, linear.packed.bias))
    return out
