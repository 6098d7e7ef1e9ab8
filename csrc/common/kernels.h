// The kernel core: plain C++ entry points on raw pointers, with no Python.
// The binding layer (csrc/bindings/) validates shapes, dtypes and strides and
// then calls these; the C++ test program (tests/cpp/) calls them directly.
// Strides are in elements; the innermost dimension is always contiguous.
#pragma once
#include <cstdint>
#include "dtype.h"

namespace cpuinfer {

// out[r] = the first index of row r's maximum, or of its first NaN (torch.argmax's answer).
void argmax_rows(DType dt, int64_t *out, const void *x, int64_t x_stride, int64_t rows, int64_t cols);

// out[r] = in[r] / sqrt(mean(in[r]^2) + eps) * weight, computed in f32.
void rms_norm(DType dt, void *out, int64_t out_stride, const void *in, int64_t in_stride, const void *weight,
              int64_t rows, int64_t hidden, float eps);

// residual[r] += x[r] (rounded to dt); x[r] = rms_norm(residual[r]). In place.
void fused_add_rms_norm(DType dt, void *x, int64_t x_stride, void *residual, int64_t res_stride,
                        const void *weight, int64_t rows, int64_t hidden, float eps);

// out[r] = LayerNorm(v) with v = x[r] + residual[r] rounded to dt (as an unfused add in dt; v = x[r] without
// residual): mean and variance of v in f32, then (v - mean) / sqrt(var + eps) * weight + bias with f32 weight
// and bias, rounded once. residual may be null; out may be x or residual (row by row, element by element).
void add_layer_norm(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *residual,
                    int64_t res_stride, const float *weight, const float *bias, int64_t rows, int64_t hidden, float eps);

// Rotates the first rot_dim features of every head of q and k (k may be null)
// in place. cos_sin has rows [cos(rot_dim/2) | sin(rot_dim/2)] per position, of
// type cache_dt (f32 or dt). neox: pairs (i, i + rot_dim/2); else (2i, 2i+1).
void rotary_embedding(DType dt, const int64_t *positions, int64_t tokens, void *q, int64_t q_stride,
                      int64_t q_heads, void *k, int64_t k_stride, int64_t k_heads, int64_t head_size,
                      const void *cos_sin, DType cache_dt, int64_t rot_dim, bool neox);

// swiglu_oai: gpt-oss's clamped SwiGLU (activation.h: gated), whose up half enters as clamp(up) + 1.
enum class Activation : int { silu = 0, gelu = 1, gelu_tanh = 2, swiglu_oai = 3 };

// out[r, i] = act(in[r, i]) * in[r, d + i] for i < d (swiglu_oai: activation.h's gated()).
void act_and_mul(DType dt, Activation act, void *out, int64_t out_stride, const void *in, int64_t in_stride,
                 int64_t rows, int64_t d);
// out[r, i] = act(in[r, i]) for i < d (silu, gelu, gelu_tanh: an encoder's MLP); out may be in.
void act(DType dt, Activation act, void *out, int64_t out_stride, const void *in, int64_t in_stride, int64_t rows,
         int64_t d);

// Paged KV cache write. key/value are [tokens, kv_heads, head_size] of type
// dt with the given token and head strides; the caches are contiguous
// [num_blocks, kv_heads, block_size, head_size] of type cache_dt (any DType;
// fp8_e5m2 rounds like torch). Token i goes to slot slot_mapping[i] =
// block * block_size + offset; a negative slot skips the token. Slots must
// be < num_blocks * block_size (the binding checks).
void reshape_and_cache(DType dt, DType cache_dt, const void *key, int64_t key_token_stride, int64_t key_head_stride,
                       const void *value, int64_t value_token_stride, int64_t value_head_stride, void *key_cache,
                       void *value_cache, const int64_t *slot_mapping, int64_t tokens, int64_t kv_heads,
                       int64_t head_size, int64_t block_size);

// Attention of a flat batch of query tokens over a paged KV cache. Sequence
// s owns query tokens [query_start_loc[s], query_start_loc[s+1]) and has
// seq_lens[s] keys in total (the last q_len of them are its own tokens), found
// through block_tables[s * block_table_stride + k / block_size]. Causal, with
// grouped-query attention (num_q_heads a multiple of num_kv_heads), optional
// sliding window (> 0) and logit soft-cap (> 0). Everything is validated by
// the caller: block ids in range, q_len <= seq_len, head_size and block_size
// multiples of 16 (the avx512bf16 tile reads and writes whole 16-key groups).
struct PagedAttentionArgs {  // filled field by field, never by position
    DType dt;        // query and out
    DType cache_dt;  // key_cache and value_cache
    void *out;
    int64_t out_token_stride, out_head_stride;
    const void *query;
    int64_t q_token_stride, q_head_stride;
    const void *key_cache, *value_cache;  // contiguous [num_blocks, num_kv_heads, block_size, head_size]
    int64_t num_q_heads, num_kv_heads, head_size, block_size;
    const int32_t *query_start_loc;  // [num_seqs + 1]
    const int32_t *seq_lens;         // [num_seqs]
    const int32_t *block_tables;     // [num_seqs, block_table_stride]
    int64_t num_seqs, block_table_stride;
    float scale;
    int64_t sliding_window;  // 0 = off
    float soft_cap;          // 0 = off
    // Attention sinks (gpt-oss): one logit per query head that joins every row's softmax denominator and
    // contributes no value; null = none.
    const float *sinks = nullptr;
    // false: every query row of a sequence sees all of its seq_lens keys (an encoder's bidirectional attention
    // over whole prompts); sliding_window must then be 0.
    bool causal = true;
};
void paged_attention(const PagedAttentionArgs &args);

// out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for m < M, n < N, in f32,
// rounded once to dt. weight is contiguous [N, K], row-major or packed by
// linear_pack_weight; bias is [N] or null; x and out are row-strided (any
// alignment). Row-major: a GEMV tuned for small M. Packed: one kernel that is
// the GEMV for a few rows and a blocked GEMM (the variant's matrix
// instructions) for many. Either way each row's result does not depend on M
// (see the dispatch comment in linear.cpp). out_f32: out is float32 whatever
// dt, the f32 sums (+ bias) unrounded (every linear entry point takes it: a
// tensor-parallel rank's share of a row-parallel projection is summed over
// the ranks in f32 and rounded once, as one rank's product is). rounded
// (with out_f32): out holds the sums rounded to dt, widened back: dt's output
// as float32, without writing dt's and converting it (the logits).
void linear(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const void *weight,
            const void *bias, int64_t M, int64_t N, int64_t K, bool packed = false, bool out_f32 = false,
            bool rounded = false);

// The packed weight layout: output features in panels of
// C = linear_pack_cols() (2 vectors of this build), each panel K x C elements,
// k-major, with each column's P = linear_pack_pair(dt) consecutive k adjacent
// (P = 2 where the tile multiplies pairs of k: bf16 on VDPBF16PS, AMX and
// BFDOT, f16 on AMX-FP16; else 1; chosen at run time on amx): element (n, k) of
// panel p = n / C is at p*C*K + (k/P)*C*P + (n%C)*P + k%P. Rows past the last
// full panel stay row-major. Needs K % P == 0. A panel streams from memory as
// one sequence (the GEMV) and is the GEMM tile's B operand as it lies. The
// layout depends on the vector width: pack with the variant that runs.
int64_t linear_pack_cols();
int64_t linear_pack_pair(DType dt);
void linear_pack_weight(DType dt, void *dst, const void *src, int64_t N, int64_t K);
// A gated MLP's gate and up projections and its activation in one pass:
// out[m, i] = act(gate[m, i]) * up[m, i] for i < I, where [gate | up] =
// x @ weight.T (+ bias) and weight [2I, K] is in linear_pack_weight's layout
// with I % linear_pack_cols() == 0 (each gate panel's up panel I / C panels
// on). The bits are those of linear() into [M, 2I] and then act_and_mul.
void linear_glu(DType dt, Activation act, void *out, int64_t out_stride, const void *x, int64_t x_stride,
                const void *weight, const void *bias, int64_t M, int64_t I, int64_t K);
// out row i (out_stride elements apart) = row ids[i] of the [N, K] weight
// that linear_pack_weight packed into `packed` (an embedding table kept
// packed for its tied lm_head). Every id must be in [0, N).
void linear_packed_rows(DType dt, void *out, int64_t out_stride, const void *packed, const int64_t *ids, int64_t n,
                        int64_t N, int64_t K);
// Which tile the packed kernel uses for dt ("amx", "amx-fp16", "avx512bf16", "bfdot", "fmlal", "fma").
const char *linear_tile_impl(DType dt);

// A quantized weight [N, K] in the panel layout quant_pack writes
// (quant_tile.h describes it): 16 output features per panel (N padded with
// zero rows to a multiple of 16), unsigned values u of `bits` bits, and per
// group of `group` k and feature a scale d with either a zero point z
// (w = d * (u - z)) or a minimum m (w = d * u + m). K is a multiple of 32;
// group is 16 (zero points only) or a multiple of 32 dividing K.
struct QuantMatrix {
    int bits = 4;        // 4, 5, 6 or 8 (quant_form_supported)
    int64_t group = 32;
    int64_t N = 0, K = 0;
    const uint8_t *qs = nullptr;  // [panels][K / 32][16 * 32 * bits / 8]
    const f16_t *d = nullptr;     // [panels][K / group][16] (null with fp4)
    const uint8_t *z = nullptr;   // [panels][K / group][16], or null with m; fp4: the E8M0 exponents
    const f16_t *m = nullptr;     // [panels][K / group][16], or null with z
    // The k order the values are packed in, or null for 0..K-1: packed k j
    // multiplies input feature perm[j]. GPTQ's act-order sorts k by group so
    // that groups are contiguous; x is gathered through it when quantized.
    const int32_t *perm = nullptr;  // [K], a permutation of 0..K-1
    // Weight-only formats (GPTQ, AWQ, compressed-tensors W4A16 / W8A16): x
    // stays in its 16-bit type (or f32) and meets the widened weight values
    // (quant_wide.h), as those formats' accuracy is measured. Otherwise x is
    // quantized to int8 per block of 32 (GGUF, as llama.cpp; W8A8; W4A8 opt-in).
    bool act16 = false;
    // MXFP4 (quant_tile.h): 4-bit E2M1 codes in groups of 32, each group's
    // E8M0 exponent byte in z (d = 2^(e - 128), zero point 12 on the codes'
    // u), no d: 4.25 bits a weight. int8 activations, as llama.cpp runs it.
    bool fp4 = false;
};
inline int64_t quant_panels(int64_t N) { return (N + 15) / 16; }
// Whether the kernels are built for this value width and form: 4 and 8 bits
// in every form, 5 bits with zero points or minimums in groups of 32 or more,
// 6 bits with zero points in groups of 16 (the forms GGUF's types take).
// With 16-bit activations (act16): 4 and 8 bits in groups of 32 or more.
// MXFP4 (fp4): 4 bits in groups of 32 with zero points (the exponents), int8 activations.
bool quant_form_supported(int bits, int64_t group, bool has_min, bool act16 = false, bool fp4 = false);

// Writes the panel layout from one value per byte u [N, K] and per-row group
// parameters d, z or m [N, K / group] (exactly one of z, m non-null; the
// output's likewise; d and d_out null with shape.fp4, u the codes, z the exponents).
void quant_pack(const QuantMatrix &shape, const uint8_t *u, const f16_t *d, const uint8_t *z, const f16_t *m,
                uint8_t *qs_out, f16_t *d_out, uint8_t *z_out, f16_t *m_out);

// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with x quantized per row
// and block of 32 k to int8 (quant_tile.h), integer dot products and f32
// accumulation, rounded once to dt. Each row's result depends on that row
// only (batch invariant), and is the same on every variant. With w.act16, x
// as it is against the widened weight (quant_wide.h): batch invariant too.
void quant_linear(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const QuantMatrix &w,
                  const void *bias, int64_t M, bool out_f32 = false);

// out[i] = row ids[i] of the dequantized weight, in dt, in input-feature order
// (perm undone; ids checked by the caller).
void quant_rows(DType dt, void *out, int64_t out_stride, const QuantMatrix &w, const int64_t *ids, int64_t n);

// A projection weight as the fused decoder layer takes it: dense (row-major
// or packed for linear()) or quantized, in up to 3 parts stacked along N (a
// fused QKV whose q, k and v came in different formats, as GGUF Q4_K_M
// files have them), each part writing its own columns of the output.
struct LinearWeight {
    const void *dense = nullptr;
    bool packed = false;  // dense is in linear_pack_weight's layout
    int parts = 0;        // quantized parts (dense is null then)
    QuantMatrix part[3];
};

// out[m, :N] = x[m, :K] @ w.T (+ bias[N]): linear() or quant_linear() per part.
void linear_weight(DType dt, void *out, int64_t out_stride, const void *x, int64_t x_stride, const LinearWeight &w,
                   const void *bias, int64_t M, int64_t N, int64_t K, bool out_f32 = false);

// Mixture of experts. How a row's router logits choose its experts and weigh them:
enum class MoeScoring : int {
    softmax = 0,       // softmax over every expert, then the top k (renormalized to sum 1 if asked): Qwen3-MoE, Mixtral
    topk_softmax = 1,  // the top k logits, then a softmax over those k: gpt-oss
};

struct MoeWeights {  // filled field by field (the binding names each)
    int64_t num_experts = 0, top_k = 0;
    int64_t intermediate = 0;             // each expert's
    LinearWeight router;                  // [num_experts, hidden]
    const void *router_b = nullptr;       // [num_experts] (run dtype) or null
    const LinearWeight *gate_up = nullptr;  // num_experts weights, each [2 intermediate, hidden]
    const LinearWeight *down = nullptr;     // num_experts weights, each [hidden, intermediate]
    const void *const *gate_up_b = nullptr;  // num_experts biases [2 intermediate] (run dtype), or null (none)
    const void *const *down_b = nullptr;     // num_experts biases [hidden], or null
    MoeScoring scoring = MoeScoring::softmax;
    bool renormalize = true;              // softmax scoring: the k weights divided by their sum
    Activation act = Activation::silu;
};

// Each row's experts (ids[r * top_k + j], largest weight first, ties to the lower index) and their
// f32 weights, from f32 router logits [rows, num_experts].
void moe_route(const MoeWeights &m, const float *logits, int64_t rows, int32_t *ids, float *weights);

// out[r] = sum over row r's experts e, in expert-index order, of weight_e * down_e(act(gate_e(x)) * up_e(x)),
// summed in f32 and rounded once to dt (out_f32: the f32 sums, a tensor-parallel share); out may be x. Rows are grouped by
// expert and each expert is one linear call over its rows, so a row's result depends on that row alone.
void moe_mlp(DType dt, const MoeWeights &m, void *out, int64_t out_stride, const void *x, int64_t x_stride,
             int64_t rows, int64_t hidden, bool out_f32 = false);

// Which tile quant_linear runs on this build ("avx512vnni", "avx2", "neon_i8mm",
// "neon_dotprod", "sve_dotprod", "vxe", "portable").
const char *quant_tile_impl();
// Which tile quant_linear runs for act16 weights in a run of dt ("avx512bf16", "portable-f32").
const char *quant_wide_impl(DType dt);

// Peak multiply-add rate of one core on this variant's tile instruction
// (VDPBF16PS for bf16 where the packed kernel uses it, else f32 FMA), from an
// in-register loop of independent chains: flops per second (2 per
// multiply-add) over `seconds`. For benchmarks: share of peak.
double linear_peak_flops(DType dt, double seconds);

// One pre-norm decoder layer (Llama family, Qwen2/3, Gemma 3) as a single
// call: the same kernels, in the same order, as the Python composition in
// cpuinfer/models/layers.py, so results are identical bit for bit; what the
// fusion removes is ~100 us of Python and ~10 allocations per layer and step.
// Shapes and pointers are validated by the binding (DecoderLayer).
struct DecoderLayerWeights {  // filled field by field (the binding names each)
    DType dt = DType::bf16;
    int64_t hidden = 0, num_heads = 0, num_kv_heads = 0, head_size = 0, intermediate = 0;
    const void *in_norm = nullptr;         // [hidden]
    const void *post_attn_norm = nullptr;  // [hidden]: the pre-MLP norm, or Gemma's norm of the attention output
    const void *pre_ff_norm = nullptr;     // [hidden] or null: Gemma's pre-MLP norm (then post_ff_norm is set too)
    const void *post_ff_norm = nullptr;    // [hidden] or null
    LinearWeight qkv;                      // [q + 2 kv, hidden]
    LinearWeight o;                        // [hidden, q]
    LinearWeight gate_up;                  // [2 intermediate, hidden] (a dense MLP)
    LinearWeight down;                     // [hidden, intermediate] (a dense MLP)
    const MoeWeights *moe = nullptr;       // a mixture-of-experts MLP instead of gate_up/down, or null
    const void *qkv_b = nullptr, *o_b = nullptr;          // [q + 2 kv], [hidden] or null
    const void *gate_up_b = nullptr, *down_b = nullptr;   // [2 intermediate], [hidden] or null
    const void *q_norm = nullptr, *k_norm = nullptr;      // [head_size] or null (per-head RMS norm before rotary)
    const void *cos_sin = nullptr;  // [max_positions, rot_dim] of cos_sin_dt, or null (no rotary)
    DType cos_sin_dt = DType::f32;
    int64_t rot_dim = 0;
    bool neox = true;
    Activation act = Activation::silu;
    float eps = 0.0f, scale = 1.0f, soft_cap = 0.0f;
    int64_t sliding_window = 0;
    const float *sinks = nullptr;  // [num_heads] f32 attention sinks (gpt-oss), or null
    // Tensor parallelism: o_proj's and down_proj's outputs are partial sums over the ranks: each rank's share
    // stays f32, this call (a ShmComm's all-reduce) sums them in place, and the sum is rounded once to dt
    // before the residual adds it (so a run dtype's rounding is the one rank's); null on a single rank.
    void (*all_reduce)(void *ctx, void *data, int64_t numel, DType dt) = nullptr;
    void *all_reduce_ctx = nullptr;
};

// One step's flat batch, shared by every layer (validated by the binding).
struct DecoderBatch {  // filled field by field, never by position
    int64_t tokens;
    const int64_t *positions, *slot_mapping;
    const int32_t *query_start_loc, *seq_lens, *block_tables;
    int64_t num_seqs, block_table_stride;
    DType cache_dt;
    void *key_cache, *value_cache;  // [num_blocks, num_kv_heads, block_size, head_size]
    int64_t block_size;
    // The rows whose outputs are read (nullptr: all): `kept` rows, each the last query row of its sequence,
    // in order. Every row's keys and values still go into the cache; past that, only these rows go on.
    const int64_t *keep = nullptr;
    int64_t kept = 0;
};

// Bytes of scratch decoder_layer needs for `tokens` tokens.
int64_t decoder_layer_scratch_bytes(const DecoderLayerWeights &w, int64_t tokens);

// h and residual are contiguous [tokens, hidden]. first: h holds the
// embeddings (residual is set from it); otherwise h holds the previous layer's
// output and residual the stream so far. On return h holds this layer's
// output and residual the stream before it (the next layer adds them); with
// b.keep, those of the kept rows, in their first b.kept rows.
void decoder_layer(const DecoderLayerWeights &w, const DecoderBatch &b, void *h, void *residual, bool first,
                   void *scratch);

// Which attention inner loops this build uses (e.g. "amx", "avx512bf16", "vec").
const char *attention_impl();

// Name of the vector layer compiled in (e.g. "avx2"), and its f32 lanes.
const char *vector_layer();
int vector_width();

}  // namespace cpuinfer
