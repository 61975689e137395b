/* The layer loop of a step whose every token attends as a decode query, in C: no Python between layers.
 *
 * Why by hand: a batch-1 decode step of a 135M model streams ~270 MB of weights, ~5 ms at a 2-core
 * machine's read bandwidth, and the same step driven from Python cost ~10 ms: ~10 module calls per layer,
 * each a few microseconds of dispatch, tensor allocation and ctypes marshalling around a kernel of tens of
 * microseconds. Here one call runs every layer over weights and a paged KV pool described once
 * (`LayerSpec`, built at start-up by kvbaton.models.layer_loop), calling the very kernels the Python loop
 * calls (same functions, same arguments, same roundings), so the two give the same bits: a step may take
 * either and a token's output does not change (deterministic serving relies on it). The whole step is one
 * OpenMP parallel region whose threads call each kernel's team form: ~300 fork/joins a step became barriers,
 * and the weight stream no longer restarts cold at each linear (the same 269 MB of linears read at 51 GB/s
 * in one region against 43 GB/s as a call each, Zen 4, 2 cores).
 *
 * Per layer (Llama family: Llama, Qwen2/3, Mixtral, Qwen3-MoE), T rows:
 *   h, residual = add_rms_norm(x, residual)          norm_bf16.c
 *   qkv = h Wqkv^T (+ b)                              the linear's kernel for T rows (below)
 *   per-head q and k norms (Qwen3), in place          norm_bf16.c
 *   rotate q and k heads (RoPE, rotate-half)          rope_bf16.c
 *   K/V rows -> the pool at their slots               here
 *   attention over each row's context                 paged_attention.c (fp32 q, fp32 out)
 *   x = attn Wo^T; h, residual = add_rms_norm(x, residual)
 *   x = down(silu(gate(h)) * up(h))                   the gated GEMM, or a linear + silu_mul_bf16.c
 *   or a MoE layer's x = sum of w_k expert_k(h)       moe_experts.c: the softmax gate, the experts, the combine
 *
 * Where what comes next plugs in: a tensor-parallel all-reduce after o_proj and down (a callback slot in
 * the stack spec, like `exchange`); attention/FFN disaggregation is a MoE layer's `exchange` (today expert
 * parallelism's all-to-all, called back after the gate) sending the rows to expert workers instead; several
 * draft tokens per sequence are rows with their own context lengths (the per-row block table and lengths
 * already allow it).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

/* The kernels this loop calls, in their team form: every thread of the loop's one parallel region calls
 * them with the same arguments and each takes its share (team.h); their sources document them. */
int kvbaton_linear_dot_team(const void *x, const void *w, int w_elem_bytes, const float *bias, void *y,
                            int out_mode, int64_t m, int64_t n, int64_t k, int isa, int num_threads);
int kvbaton_linear_bf16_team(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m, int64_t n,
                             int64_t k);
int kvbaton_gemm_amx_team(const uint16_t *x, const uint16_t *packed, const float *bias, void *y, int out_mode,
                          int64_t m, int64_t n, int64_t k, int num_threads);
int kvbaton_gemm_packed_team(const float *x, const void *packed, int weight_bytes, const float *bias, void *y,
                             int mode, int64_t m, int64_t n, int64_t k);
void kvbaton_add_rms_norm_bf16_team(const uint16_t *x, const uint16_t *delta, uint16_t *residual, uint16_t *out,
                                    const uint16_t *weight, int64_t rows, int64_t dim, float eps);
void kvbaton_silu_mul_bf16_team(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter);
void kvbaton_rms_norm_heads_bf16_team(uint16_t *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t dim,
                                      const uint16_t *weight, float eps);
void kvbaton_rope_bf16_team(uint16_t *x, int64_t row_stride, const uint16_t *cos, const uint16_t *sin,
                            const int64_t *positions, int64_t rows, int64_t heads, int64_t head_dim);
int64_t kvbaton_paged_decode_attention_scratch(int64_t batch, int64_t max_blocks, int block_size, int num_heads,
                                               int head_dim, int num_threads, int allow_split);
int kvbaton_paged_decode_attention_team(const void *kv_cache, int kv_format, const float *q, float *out,
                                        const int64_t *block_tables, const int64_t *context_lens, int64_t batch,
                                        int64_t max_blocks, int block_size, int num_kv_heads, int group,
                                        int head_dim, float scale, int num_threads, int allow_split,
                                        float *scratch);

int kvbaton_moe_route_team(const uint16_t *x, const uint16_t *w, int64_t t, int64_t h, int64_t e, int k,
                           int norm_topk, int isa, int64_t *ids, float *weights);
int64_t kvbaton_moe_experts_scratch(int64_t t, int k, int64_t num_experts, int64_t h, int64_t inter, int isa);
int kvbaton_moe_experts_team(const uint16_t *x, const int64_t *ids, const float *route_w, const uint16_t *gate_up,
                             const uint16_t *down, uint16_t *out, int64_t t, int k, int64_t num_experts, int64_t h,
                             int64_t inter, int isa, int amx_min_rows, int num_threads, void *scratch,
                             int64_t *counts);

void kvbaton_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int num_threads);

enum { ISA_GENERIC = 0 };                              /* linear_dot.c's */
enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_SILU_MUL = 2 };  /* linear_dot.c's and gemm_packed.c's */

/* A MoE layer's exchange with the owners of its experts (expert parallelism today; attention/FFN disaggregation's
 * expert workers next): called by the loop's own thread between two parallel regions (so whatever it runs has the
 * machine's threads: an exchange computes the experts that live here too) with the layer's index, its rows' normed
 * hidden states h [rows, hidden] bf16, their top-k expert ids [rows, k] int64 and routing weights [rows, k] fp32;
 * it writes out [rows, hidden] bf16, the rows' combined expert outputs, and returns 0 (nonzero fails the step). */
typedef int (*MoeExchange)(int64_t layer, int64_t rows, const uint16_t *h, const int64_t *ids, const float *weights,
                           uint16_t *out);

/* Which kernel computes a linear for a row count: kvbaton.layers.linear's paths, in its order of preference. */
enum { LIN_NONE = 0, LIN_DOT = 1, LIN_STREAM = 2, LIN_AMX = 3, LIN_PACKED = 4, LIN_PACKED_GATED = 5 };
#define LINEAR_OPTIONS 3

typedef struct {
    int32_t kind;
    int32_t isa;               /* LIN_DOT: linear_dot.c's instruction set */
    int64_t max_rows;          /* the most rows it takes; 0: every count */
    const void *weight;        /* DOT / STREAM: the [N, K] weight; AMX / PACKED: its packed copy */
    int64_t weight_bytes;      /* bytes per weight element */
    const float *bias;         /* fp32 (AMX / PACKED: zero-padded to whole panels), or NULL */
    int64_t packed_n;          /* PACKED_GATED: the packed weight's columns (gate and up interleaved) */
} LinearOption;

typedef struct {
    LinearOption options[LINEAR_OPTIONS];  /* the first that takes the step's rows computes it */
    int64_t n, k;                          /* outputs (PACKED_GATED: after the gating) and inputs */
} LinearSpec;

typedef struct {
    const uint16_t *input_norm, *post_norm;  /* bf16 [hidden] */
    LinearSpec qkv, o, gate_up, down;        /* gate_up and down: a dense MLP's (unused by a MoE layer) */
    void *kv_cache;                          /* [slots, 2, Hkv, D] in kv_format */
    const uint16_t *q_norm, *k_norm;         /* per-head q/k norms' bf16 [head_dim] weights (Qwen3), or NULL */
    /* A MoE layer in place of the dense MLP (router != NULL): the softmax gate's [E, hidden] bf16 weight, the
     * routed experts' stacked weights packed for moe_experts.c, and the block's [E] int64 token counts (the load
     * EPLB plans from), to which each step's assignments are added. */
    const uint16_t *router;
    const uint16_t *experts_gate_up, *experts_down;
    int64_t *expert_counts;
} LayerSpec;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale;
    int32_t block_size, kv_format, num_threads, allow_split;
    const uint16_t *cos, *sin;  /* bf16 [max_positions, head_dim]: RoPE's table, sin signed ([-sin, sin]) */
    int64_t max_positions, num_slots;  /* RoPE's table rows and the KV pools' slots: a step's bounds */
    /* The head: the final norm and the lm_head (lm_head.n, the vocabulary; 0: no head, the loop stops at
     * the last layer). */
    const uint16_t *final_norm;
    LinearSpec lm_head;
    /* The MoE layers' shapes (all alike; num_experts 0: none) and kernels: moe_experts.c's instruction sets for
     * the gate and the experts, and the most rows the gate's kernel takes (0: every count; more rows, and the
     * Python loop's PyTorch gate would run instead, with other roundings: the loop does not take the step). */
    int64_t num_experts, top_k, moe_intermediate, route_max_rows;
    int32_t norm_topk, route_isa, experts_isa, amx_min_rows;
    MoeExchange exchange;  /* NULL: every MoE layer's experts are local (the layer's packed stacks) */
} StackSpec;

static const LinearOption *pick(const LinearSpec *l, int64_t rows) {
    for (int i = 0; i < LINEAR_OPTIONS; i++) {
        const LinearOption *o = &l->options[i];
        if (o->kind != LIN_NONE && (o->max_rows == 0 || rows <= o->max_rows)) return o;
    }
    return NULL;
}

/* ---- workspace: every intermediate of a layer, carved out of one caller-owned buffer ---- */

typedef struct {
    uint16_t *h, *qkv, *attn, *gate_up, *act, *logits16;
    float *q32, *attn32, *f32_in, *f32_out, *attn_scratch;
    int64_t *moe_ids;
    float *moe_weights;
    char *moe_scratch;
} Workspace;

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

static int64_t carve(const StackSpec *s, int64_t rows, int64_t max_blocks, char *base, Workspace *w) {
    const int64_t q = s->num_heads * s->head_dim, qkv = q + 2 * s->num_kv_heads * s->head_dim;
    const int64_t inter = s->intermediate, widest_in = max3(s->hidden, q, inter);
    const int64_t widest_out = max3(qkv, s->hidden, 2 * inter) > s->lm_head.n ? max3(qkv, s->hidden, 2 * inter)
                                                                               : s->lm_head.n;
    int64_t off = 0;
#define SLICE(field, type, count)                                   \
    if (base) w->field = (type *)(base + off);                      \
    off += ((int64_t)sizeof(type) * rows * (count) + 63) / 64 * 64;
    SLICE(h, uint16_t, s->hidden)
    SLICE(qkv, uint16_t, qkv)
    SLICE(attn, uint16_t, q)
    SLICE(gate_up, uint16_t, 2 * inter)
    SLICE(act, uint16_t, inter)
    SLICE(logits16, uint16_t, s->lm_head.n)
    SLICE(q32, float, q)
    SLICE(attn32, float, q)
    SLICE(f32_in, float, widest_in)
    SLICE(f32_out, float, widest_out)
    /* the attention's partial sums: a few partitions a row (without allow_split up to 8, as many as the widest
     * context the block table holds may need) */
    const int64_t scratch = kvbaton_paged_decode_attention_scratch(rows, max_blocks, s->block_size, (int)s->num_heads,
                                                                   (int)s->head_dim, s->num_threads, s->allow_split);
    SLICE(attn_scratch, float, (scratch + rows - 1) / rows)
    SLICE(moe_ids, int64_t, s->top_k)
    SLICE(moe_weights, float, s->top_k)
    const int64_t moe = s->num_experts ? kvbaton_moe_experts_scratch(rows, (int)s->top_k, s->num_experts, s->hidden,
                                                                     s->moe_intermediate, s->experts_isa) : 0;
    SLICE(moe_scratch, char, (moe + rows - 1) / rows)
#undef SLICE
    return off;
}

/* Bytes of workspace a step of `rows` rows over a block table `max_blocks` wide needs. */
int64_t kvbaton_decode_layers_workspace(const StackSpec *s, int64_t rows, int64_t max_blocks) {
    return carve(s, rows, max_blocks, NULL, NULL);
}

/* ---- the pieces between the kernels ----
 * Every function from here on runs on the whole team of the step's one parallel region (every thread calls
 * it with the same arguments): work is shared with `omp for`, whose closing barrier orders each piece before
 * the next, and every thread returns the same code at the same point (a thread leaving early would leave
 * the others at a barrier). */

static void widen(const uint16_t *x, float *out, int64_t rows, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[r * n + i] = bf16_to_f32(x[r * n + i]);
    }
}

static void narrow(const float *x, uint16_t *out, int64_t rows, int64_t n) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) out[r * n + i] = f32_to_bf16(x[r * n + i]);
    }
}

/* y[rows, n] = x[rows, k] W^T (+ b) in bf16 with the option's kernel (PACKED_GATED: silu(gate) * up).
 * The conversions are those of the Python wrappers (kvbaton.kernels.linear), so the bits match theirs. */
static int linear(const StackSpec *s, const LinearOption *o, const LinearSpec *l, const uint16_t *x, uint16_t *y,
                  int64_t rows, const Workspace *w) {
    const int threads = s->num_threads;
    switch (o->kind) {
    case LIN_DOT:
        if (o->isa != ISA_GENERIC)
            return kvbaton_linear_dot_team(x, o->weight, (int)o->weight_bytes, o->bias, y, OUT_BF16, rows, l->n,
                                           l->k, o->isa, threads);
        widen(x, w->f32_in, rows, l->k);
        return kvbaton_linear_dot_team(w->f32_in, o->weight, (int)o->weight_bytes, o->bias, y, OUT_BF16, rows,
                                       l->n, l->k, o->isa, threads);
    case LIN_STREAM: {
        widen(x, w->f32_in, rows, l->k);
        const int rc = kvbaton_linear_bf16_team(w->f32_in, o->weight, o->bias, w->f32_out, rows, l->n, l->k);
        narrow(w->f32_out, y, rows, l->n);
        return rc;
    }
    case LIN_AMX:
        return kvbaton_gemm_amx_team(x, o->weight, o->bias, y, OUT_BF16, rows, l->n, l->k, threads);
    case LIN_PACKED:
    case LIN_PACKED_GATED: {
        widen(x, w->f32_in, rows, l->k);
        const int gated = o->kind == LIN_PACKED_GATED;
        return kvbaton_gemm_packed_team(w->f32_in, o->weight, (int)o->weight_bytes, o->bias, y,
                                        gated ? OUT_SILU_MUL : OUT_BF16, rows, gated ? o->packed_n : l->n, l->k);
    }
    }
    return -1;
}

/* Each row's K and V heads (adjacent in qkv, as the pool stores a slot: [2, Hkv, D]) into its slot, and its
 * q heads widened to fp32 for the attention. */
static void write_kv_widen_q(const StackSpec *s, void *kv_cache, const uint16_t *qkv, int64_t row_width,
                             int64_t q_width, const int64_t *slots, int64_t rows, float *q32) {
    const int64_t n = 2 * s->num_kv_heads * s->head_dim;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = qkv + r * row_width, *src = row + q_width;
        if (s->kv_format == KV_BF16) {
            memcpy((uint16_t *)kv_cache + slots[r] * n, src, (size_t)n * sizeof(uint16_t));
        } else {
            float *dst = (float *)kv_cache + slots[r] * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
        }
#pragma omp simd
        for (int64_t i = 0; i < q_width; i++) q32[r * q_width + i] = bf16_to_f32(row[i]);
    }
}

/* run_layer's code for a MoE layer whose exchange is due: the team's region ends there, the caller exchanges. */
#define EXCHANGE_PENDING 1

/* A MoE layer's FFN on h: x = the routing-weighted sum of each row's top-k experts (the calls SparseMoeBlock makes
 * on the same kernels: the gate, then the experts with the combine). Where expert parallelism (and next,
 * attention/FFN disaggregation) plugs in: after the gate, the rows, ids and weights go to the experts' owners
 * through the stack's exchange, which kvbaton_decode_layers calls between two parallel regions, and their
 * combined rows come back into x. */
static int run_moe(const StackSpec *s, const LayerSpec *l, uint16_t *x, int64_t rows, const Workspace *w) {
    const int k = (int)s->top_k;
    int rc = kvbaton_moe_route_team(w->h, l->router, rows, s->hidden, s->num_experts, k, s->norm_topk, s->route_isa,
                                    w->moe_ids, w->moe_weights);
    if (rc) return rc;
    if (s->exchange) return EXCHANGE_PENDING;  /* the route's closing barrier made ids and weights whole */
    return kvbaton_moe_experts_team(w->h, w->moe_ids, w->moe_weights, l->experts_gate_up, l->experts_down, x, rows, k,
                                    s->num_experts, s->hidden, s->moe_intermediate, s->experts_isa, s->amx_min_rows,
                                    s->num_threads, w->moe_scratch, l->expert_counts);
}

static int run_layer(const StackSpec *s, const LayerSpec *l, int64_t index, uint16_t *x, uint16_t *residual,
                     const int64_t *positions, const int64_t *slots, const int64_t *block_table, int64_t max_blocks,
                     const int64_t *context_lens, int64_t rows, const Workspace *w) {
    const int threads = s->num_threads;
    const int64_t e = s->hidden, q_width = s->num_heads * s->head_dim, row_width = l->qkv.n;
    if (index == 0) {  /* no residual yet: it starts as the embeddings (the norm reads x, not residual) */
#pragma omp single nowait
        memcpy(residual, x, (size_t)(rows * e) * sizeof(uint16_t));
        kvbaton_add_rms_norm_bf16_team(x, NULL, residual, w->h, l->input_norm, rows, e, s->eps);
    } else {
        kvbaton_add_rms_norm_bf16_team(x, residual, residual, w->h, l->input_norm, rows, e, s->eps);
    }
    int rc = linear(s, pick(&l->qkv, rows), &l->qkv, w->h, w->qkv, rows, w);
    if (rc) return rc;
    if (l->q_norm) {  /* before RoPE, in place, as the Python loop's Attention does */
        kvbaton_rms_norm_heads_bf16_team(w->qkv, row_width, rows, s->num_heads, s->head_dim, l->q_norm, s->eps);
        kvbaton_rms_norm_heads_bf16_team(w->qkv + q_width, row_width, rows, s->num_kv_heads, s->head_dim, l->k_norm,
                                         s->eps);
    }
    kvbaton_rope_bf16_team(w->qkv, row_width, s->cos, s->sin, positions, rows, s->num_heads + s->num_kv_heads,
                           s->head_dim);
    write_kv_widen_q(s, l->kv_cache, w->qkv, row_width, q_width, slots, rows, w->q32);
    rc = kvbaton_paged_decode_attention_team(l->kv_cache, s->kv_format, w->q32, w->attn32, block_table,
                                             context_lens, rows, max_blocks, s->block_size, (int)s->num_kv_heads,
                                             (int)(s->num_heads / s->num_kv_heads), (int)s->head_dim, s->scale,
                                             threads, s->allow_split, w->attn_scratch);
    if (rc) return rc;
    narrow(w->attn32, w->attn, rows, q_width);
    if ((rc = linear(s, pick(&l->o, rows), &l->o, w->attn, x, rows, w))) return rc;
    kvbaton_add_rms_norm_bf16_team(x, residual, residual, w->h, l->post_norm, rows, e, s->eps);
    if (l->router) return run_moe(s, l, x, rows, w);
    const LinearOption *gate_up = pick(&l->gate_up, rows);
    if (gate_up->kind == LIN_PACKED_GATED) {
        rc = linear(s, gate_up, &l->gate_up, w->h, w->act, rows, w);
    } else {
        rc = linear(s, gate_up, &l->gate_up, w->h, w->gate_up, rows, w);
        kvbaton_silu_mul_bf16_team(w->gate_up, w->act, rows, s->intermediate);
    }
    if (rc) return rc;
    return linear(s, pick(&l->down, rows), &l->down, w->act, x, rows, w);
}

/* The head on the last layer's output: logits [rows, vocab] fp32, each rounded to bf16 first (the lm_head's
 * bf16 output widened, as the Python forward's `lm_head(x).float()`). */
static int run_head(const StackSpec *s, const uint16_t *x, uint16_t *residual, float *logits, int64_t rows,
                    const Workspace *w) {
    const int64_t vocab = s->lm_head.n;
    kvbaton_add_rms_norm_bf16_team(x, residual, residual, w->h, s->final_norm, rows, s->hidden, s->eps);
    const int rc = linear(s, pick(&s->lm_head, rows), &s->lm_head, w->h, w->logits16, rows, w);
    if (rc) return rc;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * vocab; i += 4096) {
        const int64_t end = i + 4096 < rows * vocab ? i + 4096 : rows * vocab;
#pragma omp simd
        for (int64_t j = i; j < end; j++) logits[j] = bf16_to_f32(w->logits16[j]);
    }
    return 0;
}

/* Whether every layer (and the head, where there is one) has a kernel for `rows` rows (nothing else this loop
 * needs can be missing: the builder checked the rest once). */
int kvbaton_decode_layers_take(const StackSpec *s, const LayerSpec *layers, int64_t rows) {
    if (rows < 1 || (s->lm_head.n && !pick(&s->lm_head, rows))) return 0;
    for (int64_t i = 0; i < s->num_layers; i++) {
        const LayerSpec *l = &layers[i];
        if (!pick(&l->qkv, rows) || !pick(&l->o, rows)) return 0;
        const int ffn = l->router ? !s->route_max_rows || rows <= s->route_max_rows
                                  : pick(&l->gate_up, rows) && pick(&l->down, rows);
        if (!ffn) return 0;
    }
    return 1;
}

/* x: [rows, hidden] bf16, the embeddings in, the last layer's output (before its residual add) out;
 * residual: [rows, hidden] bf16, written; positions, slots, context_lens: [rows] int64; block_table: [rows,
 * max_blocks] int64; workspace: kvbaton_decode_layers_workspace(rows, max_blocks) bytes, 64-byte aligned;
 * logits: NULL (the loop stops at the last layer), or [rows, vocab] fp32 for every row's logits (a stack with a
 * head).
 * Returns 0; -1 for a step it does not take (checked before anything is written); -2 for a short workspace;
 * -3 when a kernel refused midway (the pool may hold this step's K/V of some layers: the caller fails the step),
 * -7 when a MoE exchange failed midway (likewise);
 * -4 for a position past RoPE's table, -5 for a slot past the pools (checked before anything is written). */
int kvbaton_decode_layers(const StackSpec *s, const LayerSpec *layers, uint16_t *x, uint16_t *residual,
                          const int64_t *positions, const int64_t *slots, const int64_t *block_table,
                          int64_t max_blocks, const int64_t *context_lens, int64_t rows, void *workspace,
                          int64_t workspace_bytes, float *logits) {
    if (s->head_dim > 256 || s->head_dim % 2 || (s->kv_format != KV_BF16 && s->kv_format != KV_F32)
        || !kvbaton_decode_layers_take(s, layers, rows) || (logits && !s->lm_head.n))
        return -1;
    if (workspace_bytes < kvbaton_decode_layers_workspace(s, rows, max_blocks)) return -2;
    for (int64_t r = 0; r < rows; r++) {  /* the kernels index the table and the pools unchecked */
        if (positions[r] < 0 || positions[r] >= s->max_positions) return -4;
        if (slots[r] < 0 || slots[r] >= s->num_slots) return -5;
    }
    Workspace w;
    carve(s, rows, max_blocks, (char *)workspace, &w);
    int status = 0;
    /* One parallel region for the whole step (no fork and join per kernel, team.h), except that a MoE layer's
     * exchange ends it: the exchange runs on this thread alone, outside any region, and the next region goes on
     * from the following layer. */
    for (int64_t first = 0; first < s->num_layers && !status;) {
        int64_t pending = -1;  /* the layer whose exchange ended the region */
#pragma omp parallel num_threads(s->num_threads)
        {
            int rc = 0;
            int64_t i = first;
            for (; i < s->num_layers && !rc; i++)
                rc = run_layer(s, &layers[i], i, x, residual, positions, slots, block_table, max_blocks,
                               context_lens, rows, &w);
            if (!rc && logits) rc = run_head(s, x, residual, logits, rows, &w);
            /* every thread got the same code at the same point */
#pragma omp master
            {
                if (rc == EXCHANGE_PENDING) pending = i - 1;
                else status = rc ? -3 : 0;
            }
        }
        if (pending < 0) break;
        if (s->exchange(pending, rows, w.h, w.moe_ids, w.moe_weights, x)) status = -7;
        first = pending + 1;
        if (first == s->num_layers && !status && logits) {  /* the last layer exchanged: the head alone */
#pragma omp parallel num_threads(s->num_threads)
            {
                const int rc = run_head(s, x, residual, logits, rows, &w);
#pragma omp master
                status = rc ? -3 : 0;
            }
        }
    }
    return status;
}

/* A decode burst (kvbaton.sched.burst): `steps` decode steps of the same rows back to back, step j computing
 * each row's token at position positions[r] + j, whose argmax (as kvbaton_argmax_rows picks it: torch.argmax's
 * choice) is the token of step j + 1. Each step is kvbaton_decode_layers with the head, on the inputs the
 * Python runner would build for it, so a burst gives the bits of as many single steps.
 * embed: [embed_rows, hidden] bf16, the embedding table; tokens: [rows] int64, the first step's tokens;
 * positions: [rows] int64, the first step's; block_table: [rows, max_blocks] int64, covering every step's
 * position; out: [rows, steps] int64, each step's argmax; x, residual: [rows, hidden] bf16 and logits: [rows,
 * vocab] fp32, scratch (the last step's logits are left in `logits`); workspace as kvbaton_decode_layers'.
 * Returns kvbaton_decode_layers' codes; -4 / -5 also for any step's position past RoPE's table, the block table
 * (or a negative block id) or the pools, -6 for a first token past the embedding table: all checked before
 * anything is written; -6 also for a sampled token past it (a head wider than the embedding table: that step's
 * earlier tokens are in `out`); -2 when out of memory. */
int kvbaton_decode_burst(const StackSpec *s, const LayerSpec *layers, const uint16_t *embed, int64_t embed_rows,
                         const int64_t *tokens, const int64_t *positions, const int64_t *block_table,
                         int64_t max_blocks, int64_t rows, int64_t steps, int64_t *out, uint16_t *x,
                         uint16_t *residual, float *logits, void *workspace, int64_t workspace_bytes) {
    if (rows < 1 || steps < 1 || !s->lm_head.n) return -1;
    int64_t *step_tokens = malloc(sizeof(int64_t) * 4 * (size_t)rows);
    if (!step_tokens) return -2;
    int64_t *step_positions = step_tokens + rows, *slots = step_positions + rows, *lens = slots + rows;
    const int64_t bs = s->block_size, e = s->hidden, vocab = s->lm_head.n;
    memcpy(step_tokens, tokens, sizeof(int64_t) * (size_t)rows);
    int rc = 0;
    for (int64_t r = 0; r < rows && !rc; r++) {  /* every step's bounds, before any step writes the pools */
        if (tokens[r] < 0 || tokens[r] >= embed_rows) rc = -6;
        for (int64_t p = positions[r]; p < positions[r] + steps && !rc; p++) {
            if (p < 0 || p >= s->max_positions) rc = -4;
            else if (p / bs >= max_blocks || block_table[r * max_blocks + p / bs] < 0
                     || block_table[r * max_blocks + p / bs] * bs + p % bs >= s->num_slots)
                rc = -5;
        }
    }
    for (int64_t j = 0; j < steps && !rc; j++) {
        for (int64_t r = 0; r < rows && !rc; r++) {
            const int64_t p = positions[r] + j, token = step_tokens[r];
            if (token < 0 || token >= embed_rows) { rc = -6; break; }
            step_positions[r] = p;
            slots[r] = block_table[r * max_blocks + p / bs] * bs + p % bs;
            lens[r] = p + 1;
            memcpy(x + r * e, embed + token * e, sizeof(uint16_t) * (size_t)e);
        }
        if (rc) break;
        rc = kvbaton_decode_layers(s, layers, x, residual, step_positions, slots, block_table, max_blocks, lens,
                                   rows, workspace, workspace_bytes, logits);
        if (rc) break;
        kvbaton_argmax_rows(logits, rows, vocab, step_tokens, s->num_threads);
        for (int64_t r = 0; r < rows; r++) out[r * steps + j] = step_tokens[r];
    }
    free(step_tokens);
    return rc;
}
