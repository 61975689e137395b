"""bench_moe_ep.py's models and workload sizes: the random-weight Qwen3-MoE, its int8 layer error on real hidden
states, and the skewed copy whose routers favour the experts the first placement puts on rank 0."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from common.log import log
from common.prompts import make_prompts

# Qwen3-30B-A3B's shape (hidden 2048, 48 layers, 128 experts, top-8, moe_intermediate 768, 32 heads / 4 KV heads
# of 128) scaled down to what 2 cores run in minutes: experts/top-k ratio and the GQA layout kept.
SHAPE = dict(vocab_size=32768, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, intermediate_size=1024, moe_intermediate_size=192, num_experts=64, num_experts_per_tok=8,
             max_position_embeddings=2048, norm_topk_prob=True, tie_word_embeddings=False)
DECODE_BATCH = 16  # sequences in the group (EP2: 8 per rank)
DECODE_PROMPT = 32  # tokens of each decode sequence's prompt
PREFILL_LEN = 256  # one prompt per rank
HOT_EXPERTS = (4, 6, 8, 10, 12, 14)  # the skewed model's favourites: all on rank 0 in EP2's first placement
SKEW_CHANNEL_VALUE = 0.5  # the skewed model's constant residual channel (the routers' bias rides on it)
MOE_KERNEL_ENV = "KVBATON_MOE_KERNEL"  # 0: PyTorch's expert loop instead of the C MoE kernel (compute_paths)


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SHAPE, eos_token_id=None, bos_token_id=None, pad_token_id=0)


def write_tokenizer(out: Path) -> None:
    """kvbaton wants a tokenizer.json; a word-level one over t0..t{V-1} (the benchmark feeds token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SHAPE["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(out))


def capture_moe_inputs(model, prompts: list[list[int]]) -> list[Any]:
    """Every MoE layer's input ([T, H], after the post-attention norm) for one forward over `prompts`."""
    import torch

    caps: list[Any] = [None] * len(model.model.layers)
    hooks = [layer.mlp.register_forward_pre_hook(lambda _m, a, i=i: caps.__setitem__(i, a[0].reshape(
        -1, a[0].shape[-1]).detach().clone())) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor(prompts))
    for h in hooks:
        h.remove()
    return caps


def skew_routers(model, prompts: list[list[int]], hot_share: float) -> list[float]:
    """Make each router send about `hot_share` of the top-k choices to HOT_EXPERTS. Channel 0 of the residual
    stream is made a constant: every embedding row holds SKEW_CHANNEL_VALUE there, no attention or expert output
    writes it and nothing but the routers reads it (so attention and the experts compute as in the unskewed
    model), so every token's normalized MoE input has a positive channel 0; the hot experts' gate rows
    get a boost on it, found per layer by bisection on the inputs of one forward over `prompts` (a pre-hook
    calibrates each layer before it runs). Returns the share each layer got there."""
    import torch

    shares: list[float] = []
    hot = torch.tensor(HOT_EXPERTS)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = SKEW_CHANNEL_VALUE
        model.lm_head.weight[:, 0] = 0
        for layer in model.model.layers:  # channel 0 reaches only the routers (and the norms' scale)
            attn = layer.self_attn
            attn.o_proj.weight[0, :] = 0
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.weight[:, 0] = 0
            layer.mlp.experts.down_proj[:, 0, :] = 0  # [E, H, I]: no expert writes channel 0
            layer.mlp.experts.gate_up_proj[:, :, 0] = 0  # [E, 2I, H]: nor reads it

    def calibrate(mlp, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        gate = mlp.gate.weight
        w0 = gate.detach().float()
        lo, hi = 0.0, 16.0
        for _ in range(30):
            mid = (lo + hi) / 2
            w = w0.clone()
            w[hot, 0] += mid
            lo, hi = (mid, hi) if hot_share_of(x, w) < hot_share else (lo, mid)
        with torch.no_grad():
            gate[hot, 0] += hi
        shares.append(hot_share_of(x, gate.detach().float()))

    hooks = [layer.mlp.register_forward_pre_hook(calibrate) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor(prompts))
    for h in hooks:
        h.remove()
    return shares


def hot_share_of(x, gate_weight) -> float:
    """The share of top-k choices of the rows `x` ([T, H]) that go to HOT_EXPERTS under `gate_weight`."""
    import torch

    top = (x.float() @ gate_weight.float().T).topk(SHAPE["num_experts_per_tok"], dim=-1).indices
    return torch.isin(top, torch.tensor(HOT_EXPERTS)).float().mean().item()


def layer_int8_error(model_dir: Path, inputs: list[Any]) -> list[dict]:
    """Per MoE layer: kvbaton's SparseMoeBlock (from the checkpoint, PyTorch expert loop) over real hidden states,
    experts fed the exact bf16 rows vs rows through dispatch.quantize_rows/dequantize_rows (what the int8 wire
    carries: routing is decided on the exact rows, the combine stays exact); and bf16's own error (the same block
    in fp32) as the scale to judge it by."""
    import torch

    from kvbaton.layers.moe.dispatch import dequantize_rows, quantize_rows
    from kvbaton.layers.moe.experts import ExpertGroups
    from kvbaton.models.loader import load_model

    model = load_model(model_dir, torch.bfloat16, SHAPE["max_position_embeddings"])
    out = []
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            block, x = layer.mlp, inputs[i].to(torch.bfloat16)
            weights, ids = block.gate(x)
            groups = ExpertGroups.of(ids, weights, SHAPE["num_experts"])
            exact = block.experts(x, groups).float()
            wire = dequantize_rows(quantize_rows(x), x.dtype)
            int8 = block.experts(wire, ExpertGroups.of(ids, weights, SHAPE["num_experts"])).float()
            experts32 = copy.deepcopy(block.experts).float()
            fp32 = experts32(x.float(), ExpertGroups.of(ids, weights, SHAPE["num_experts"]))
            err, noise = (int8 - exact).abs(), (exact - fp32).abs()
            out.append({"layer": i, "tokens": x.shape[0], "mean_abs_output": exact.abs().mean().item(),
                        "int8_max_abs_err": err.max().item(), "int8_mean_abs_err": err.mean().item(),
                        "int8_rel_rms_err": ((int8 - exact).norm() / exact.norm()).item(),
                        "bf16_vs_fp32_max_abs_err": noise.max().item(),
                        "bf16_vs_fp32_mean_abs_err": noise.mean().item(),
                        "input_max_abs_err": (wire.float() - x.float()).abs().max().item()})
    return out


def build_models(root: Path, seed: int, hot_share: float) -> dict:
    """The uniform model (random init), the int8 layer error on its hidden states, and the skewed copy."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(qwen3_moe_config(), dtype=torch.bfloat16).eval()
    uniform, skewed = root / "uniform", root / "skewed"
    model.save_pretrained(str(uniform))
    write_tokenizer(uniform)
    inputs = capture_moe_inputs(model, make_prompts(seed, "layer-error", 4, PREFILL_LEN, SHAPE["vocab_size"]))
    errors = layer_int8_error(uniform, inputs)
    shares = skew_routers(model, make_prompts(seed, "skew-calibration", 8, 128, SHAPE["vocab_size"]), hot_share)
    model.save_pretrained(str(skewed))
    write_tokenizer(skewed)
    held_out = capture_moe_inputs(model, make_prompts(seed, "skew-check", DECODE_BATCH, DECODE_PROMPT,
                                                      SHAPE["vocab_size"]))
    checked = [hot_share_of(x, layer.mlp.gate.weight) for x, layer in zip(held_out, model.model.layers)]
    del model, inputs, held_out
    log(f"models built in {time.perf_counter() - t0:.0f}s: hot-expert share per layer "
        f"{', '.join(f'{s:.2f}' for s in shares)} (calibration), {', '.join(f'{s:.2f}' for s in checked)} "
        "(held-out prompts)")
    return {"uniform": uniform, "skewed": skewed, "layer_error": errors, "hot_share_per_layer": shares,
            "hot_share_held_out": checked}
