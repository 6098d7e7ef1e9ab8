// Paged KV cache write (vLLM's reshape_and_cache): each token's key and value
// rows go to the cache block and offset named by its slot.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "dispatch_dtype.h"
#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

template <typename T, typename C>
void copy_row(C *dst, const T *src, int64_t n) {
    if constexpr (std::is_same_v<T, C>) {
        std::memcpy(dst, src, size_t(n) * sizeof(T));
    } else if constexpr (std::is_same_v<C, fp8_e5m2_t>) {
        // Scalar on purpose: the exact torch rounding, and a cache write is a
        // tiny part of a step next to the attention that reads it back.
        for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<C>(to_f32(src[i]));
    } else {
        const int W = vec::width();
        int64_t i = 0;
        for (; i + W <= n; i += W) vec::store(dst + i, vec::load(src + i));
        for (; i < n; ++i) dst[i] = from_f32<C>(to_f32(src[i]));
    }
}

}  // namespace

void reshape_and_cache(DType dt, DType cache_dt, const void *key, int64_t key_token_stride, int64_t key_head_stride,
                       const void *value, int64_t value_token_stride, int64_t value_head_stride, void *key_cache,
                       void *value_cache, const int64_t *slot_mapping, int64_t tokens, int64_t kv_heads,
                       int64_t head_size, int64_t block_size) {
    with_float_type(dt, [&](auto ttag) {
        using T = decltype(ttag);
        with_cache_type(cache_dt, [&](auto ctag) {
            using C = decltype(ctag);
            const T *k = static_cast<const T *>(key);
            const T *v = static_cast<const T *>(value);
            C *kc = static_cast<C *>(key_cache);
            C *vc = static_cast<C *>(value_cache);
            const int64_t rows = tokens * kv_heads;
            // Row r's offset in either cache, or -1 for a padding token.
            auto dst_of = [&](int64_t r) {
                const int64_t t = r / kv_heads, h = r % kv_heads, slot = slot_mapping[t];
                if (slot < 0) return int64_t(-1);
                const int64_t blk = slot / block_size, off = slot % block_size;
                return ((blk * kv_heads + h) * block_size + off) * head_size;
            };
            // The slots' lines are rarely in cache (a decode step's rows land in blocks all over the pool), and
            // each store waits for its line to be read for ownership: one row after another, that was ~20 us
            // a layer for a 32-sequence decode step (192 rows, on one thread). Asking for the lines kAhead
            // rows early keeps that many rows' reads in flight, and the rows are split over the threads at
            // 32 or more a thread (the other threads would only wait for this one).
            constexpr int64_t kAhead = 16;
            const int64_t row_bytes = head_size * int64_t(sizeof(C));
            auto claim = [&](int64_t r) {
                const int64_t dst = dst_of(r);
                if (dst < 0) return;
                const char *pk = reinterpret_cast<const char *>(kc + dst), *pv = reinterpret_cast<const char *>(vc + dst);
                for (int64_t i = 0; i < row_bytes; i += tuning::kCacheLine) {
                    __builtin_prefetch(pk + i, 1);
                    __builtin_prefetch(pv + i, 1);
                }
            };
            parallel_for(rows, 32, [&](int64_t b, int64_t e) {
                for (int64_t r = b; r < std::min(e, b + kAhead); ++r) claim(r);
                for (int64_t r = b; r < e; ++r) {
                    if (r + kAhead < e) claim(r + kAhead);
                    const int64_t dst = dst_of(r);
                    if (dst < 0) continue;  // padding token
                    const int64_t t = r / kv_heads, h = r % kv_heads;
                    copy_row(kc + dst, k + t * key_token_stride + h * key_head_stride, head_size);
                    copy_row(vc + dst, v + t * value_token_stride + h * value_head_stride, head_size);
                }
            });
        });
    });
}

}  // namespace cpuinfer
