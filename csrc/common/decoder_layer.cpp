// One decoder layer as a sequence of the kernels in this library (see
// kernels.h: DecoderLayerWeights). The order and the arguments mirror the
// Python composition in cpuinfer/models/layers.py exactly, so the fused and
// the composed paths give identical results.
#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch_dtype.h"
#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

// The MLP runs this many tokens at a time: its intermediates (3 x intermediate
// values a token) are the largest scratch of a long prefill (45 MB of a 4096-token
// SmolLM2 step; 9 MB now, 3 MB under linear_glu), and every kernel gives a row the
// same result in any batch, so the bits do not change. Measured, SmolLM2 bf16 on
// Sapphire Rapids, a 2048-token prefill alternating in one process: 1024 rows 3%
// faster than 512 (the weights streamed half as often), 2048 no faster, 256 4-8% slower.
constexpr int64_t kMlpRows = 1024;

// Scratch regions, in elements of the run dtype, each 64-byte aligned.
// A packed gate_up whose halves split at a panel boundary takes linear_glu: the activation in its GEMM's
// epilogue (the same bits as GEMM + act_and_mul), so the [n, 2I] output is never written and read back.
// Measured on Sapphire Rapids, 2 threads, SmolLM2 bf16: a 32 x 128-token prefill step ~785 -> ~760 ms.
bool fused_gate_up(const DecoderLayerWeights &w) {
    return !w.moe && w.gate_up.parts == 0 && w.gate_up.packed && w.intermediate % linear_pack_cols() == 0;
}

struct Layout {
    int64_t qkv, attn_or_gate_up, act, partial, total;
};

Layout layout(const DecoderLayerWeights &w, int64_t tokens) {
    const int64_t es = dtype_size(w.dt), align = 64 / es;
    auto up = [&](int64_t n) { return (n + align - 1) / align * align; };
    const int64_t q = w.num_heads * w.head_size, kv = w.num_kv_heads * w.head_size;
    const int64_t mlp = std::min(tokens, kMlpRows);
    Layout l;
    l.qkv = 0;
    // The attention output is dead once o_proj has read it: gate_up's output (none under linear_glu) reuses it.
    l.attn_or_gate_up = up(tokens * (q + 2 * kv));
    l.act = l.attn_or_gate_up + up(std::max(tokens * q, fused_gate_up(w) ? 0 : mlp * 2 * w.intermediate));
    l.partial = l.act + up(mlp * w.intermediate);
    // Tensor parallel: a row-parallel projection's f32 share of the sum (o_proj's, then down_proj's per chunk).
    l.total = l.partial + (w.all_reduce ? up(tokens * w.hidden * int64_t(sizeof(float)) / es) : 0);
    return l;
}

// dst[i] = src[i] rounded to T, for n elements.
void round_to(DType dt, void *dst, const float *src, int64_t n) {
    with_float_type(dt, [&](auto tag) {
        using T = decltype(tag);
        T *d = static_cast<T *>(dst);
        parallel_for(n, 1 << 14, [&](int64_t b, int64_t e) {
            const int W = vec::width();
            int64_t i = b;
            for (; i + W <= e; i += W) vec::store(d + i, vec::load(src + i));
            for (; i < e; ++i) d[i] = from_f32<T>(src[i]);
        });
    });
}

// out[rows, H] = a row-parallel projection of x, summed over the tensor-parallel ranks: each rank's share in
// f32, summed in f32 and rounded once to dt (as one rank's product is); alone, the projection itself.
void row_parallel(const DecoderLayerWeights &w, void *out, const void *x, int64_t xs, const LinearWeight &lw,
                  const void *bias, int64_t rows, int64_t K, float *partial) {
    const int64_t H = w.hidden;
    if (!w.all_reduce) {
        linear_weight(w.dt, out, H, x, xs, lw, bias, rows, H, K);
        return;
    }
    linear_weight(w.dt, partial, H, x, xs, lw, bias, rows, H, K, /*out_f32=*/true);
    w.all_reduce(w.all_reduce_ctx, partial, rows * H, DType::f32);
    round_to(w.dt, out, partial, rows * H);
}

}  // namespace

int64_t decoder_layer_scratch_bytes(const DecoderLayerWeights &w, int64_t tokens) {
    return layout(w, tokens).total * dtype_size(w.dt);
}

void decoder_layer(const DecoderLayerWeights &w, const DecoderBatch &b, void *h, void *residual, bool first,
                   void *scratch) {
    const DType dt = w.dt;
    int64_t T = b.tokens;
    const int64_t H = w.hidden, hs = w.head_size, es = dtype_size(dt);
    const int64_t q_size = w.num_heads * hs, kv_size = w.num_kv_heads * hs, qkv_n = q_size + 2 * kv_size;
    const int64_t I = w.intermediate;
    if (T <= 0) return;
    const Layout l = layout(w, T);
    char *base = static_cast<char *>(scratch);
    char *qkv = base + l.qkv * es, *attn = base + l.attn_or_gate_up * es, *gate_up = attn, *act = base + l.act * es;
    float *partial = reinterpret_cast<float *>(base + l.partial * es);
    char *hb = static_cast<char *>(h);

    // Input norm: the first layer starts the residual stream with h.
    if (first) {
        std::memcpy(residual, h, size_t(T * H * es));
        rms_norm(dt, h, H, residual, H, w.in_norm, T, H, w.eps);
    } else {
        fused_add_rms_norm(dt, h, H, residual, H, w.in_norm, T, H, w.eps);
    }

    // Attention: fused QKV, optional per-head q/k norm, rotary, cache write, paged attention, o_proj.
    linear_weight(dt, qkv, qkv_n, h, H, w.qkv, w.qkv_b, T, qkv_n, H);
    char *qp = qkv, *kp = qkv + q_size * es, *vp = qkv + (q_size + kv_size) * es;
    if (w.q_norm) {
        for (int64_t t = 0; t < T; ++t) {
            char *qt = qp + t * qkv_n * es, *kt = kp + t * qkv_n * es;
            rms_norm(dt, qt, hs, qt, hs, w.q_norm, w.num_heads, hs, w.eps);
            rms_norm(dt, kt, hs, kt, hs, w.k_norm, w.num_kv_heads, hs, w.eps);
        }
    }
    if (w.cos_sin)
        rotary_embedding(dt, b.positions, T, qp, qkv_n, w.num_heads, kp, qkv_n, w.num_kv_heads, hs, w.cos_sin,
                         w.cos_sin_dt, w.rot_dim, w.neox);
    reshape_and_cache(dt, b.cache_dt, kp, qkv_n, hs, vp, qkv_n, hs, b.key_cache, b.value_cache, b.slot_mapping, T,
                      w.num_kv_heads, hs, b.block_size);

    // Only the kept rows go on (a step's last layer, where only the sampled rows' outputs are read, as
    // llama.cpp's inp_out_ids but from before attention): their queries and residuals move to the front, in
    // order (each to an index no higher than its own, so in place), and each sequence keeps its last query
    // row or none. The bits of a kept
    // row are those of the whole batch's: attention gives a row the same result in any batch, and every
    // other kernel here works row by row. Measured, SmolLM2 bf16 (30 layers) on Sapphire Rapids, a
    // 2048-token prefill alternating with and without in one process: 1-2.5% faster (the last layer's
    // attention, o_proj and MLP for one row instead of 2048).
    std::vector<int32_t> kept_qsl;
    const int32_t *qsl = b.query_start_loc;
    if (b.keep) {
        char *res = static_cast<char *>(residual);
        for (int64_t i = 0; i < b.kept; ++i) {
            const int64_t r = b.keep[i];
            if (r == i) continue;
            std::memcpy(qp + i * qkv_n * es, qp + r * qkv_n * es, size_t(q_size * es));
            std::memcpy(res + i * H * es, res + r * H * es, size_t(H * es));
        }
        // A sequence's kept rows start after those of the sequences before it (kept rows are in order).
        kept_qsl.assign(size_t(b.num_seqs + 1), 0);
        for (int64_t s = 0, i = 0; s < b.num_seqs; ++s) {
            while (i < b.kept && b.keep[i] < qsl[s + 1]) ++i;
            kept_qsl[size_t(s + 1)] = int32_t(i);
        }
        qsl = kept_qsl.data();
        T = b.kept;
        if (T == 0) return;
    }
    PagedAttentionArgs a{};
    a.dt = dt;
    a.cache_dt = b.cache_dt;
    a.out = attn;
    a.out_token_stride = q_size;
    a.out_head_stride = hs;
    a.query = qp;
    a.q_token_stride = qkv_n;
    a.q_head_stride = hs;
    a.key_cache = b.key_cache;
    a.value_cache = b.value_cache;
    a.num_q_heads = w.num_heads;
    a.num_kv_heads = w.num_kv_heads;
    a.head_size = hs;
    a.block_size = b.block_size;
    a.query_start_loc = qsl;
    a.seq_lens = b.seq_lens;
    a.block_tables = b.block_tables;
    a.num_seqs = b.num_seqs;
    a.block_table_stride = b.block_table_stride;
    a.scale = w.scale;
    a.sliding_window = w.sliding_window;
    a.soft_cap = w.soft_cap;
    a.sinks = w.sinks;
    paged_attention(a);
    row_parallel(w, h, attn, q_size, w.o, w.o_b, T, q_size, partial);

    // MLP, with Gemma's sandwich norms when present.
    if (w.pre_ff_norm) {
        rms_norm(dt, h, H, h, H, w.post_attn_norm, T, H, w.eps);
        fused_add_rms_norm(dt, h, H, residual, H, w.pre_ff_norm, T, H, w.eps);
    } else {
        fused_add_rms_norm(dt, h, H, residual, H, w.post_attn_norm, T, H, w.eps);
    }
    const bool glu = fused_gate_up(w);
    for (int64_t t0 = 0; t0 < T; t0 += kMlpRows) {
        const int64_t n = std::min(kMlpRows, T - t0);
        char *ht = hb + t0 * H * es;
        if (w.moe) {  // in place: moe_mlp has read every row before it writes one
            if (w.all_reduce) {
                moe_mlp(dt, *w.moe, partial, H, ht, H, n, H, /*out_f32=*/true);
                w.all_reduce(w.all_reduce_ctx, partial, n * H, DType::f32);
                round_to(dt, ht, partial, n * H);
            } else {
                moe_mlp(dt, *w.moe, ht, H, ht, H, n, H);
            }
        } else if (glu) {
            linear_glu(dt, w.act, act, I, ht, H, w.gate_up.dense, w.gate_up_b, n, I, H);
        } else {
            linear_weight(dt, gate_up, 2 * I, ht, H, w.gate_up, w.gate_up_b, n, 2 * I, H);
            act_and_mul(dt, w.act, act, I, gate_up, 2 * I, n, I);
        }
        if (!w.moe) row_parallel(w, ht, act, I, w.down, w.down_b, n, I, partial);  // row by row: chunks give the same bits
        if (w.post_ff_norm) rms_norm(dt, ht, H, ht, H, w.post_ff_norm, n, H, w.eps);
    }
}

}  // namespace cpuinfer
