// Paged attention over a mixed batch (decode tokens and prefill chunks).
//
// Work is cut into groups (sequence, KV head, up to kChunkRows query rows, or
// a whole-unit path's WholeUnit::kChunkRows, where a row is one (token, query
// head) pair of that KV head's GQA group).
// Keys are taken in partitions of kPartKeys at fixed positions (flash-
// decoding): each partition's softmax is online, in f32, from scratch; a row
// whose keys span several partitions merges their (max, sum, unnormalised
// output) in partition order at the end. Where the partitions sit depends on
// the key positions only, so a row gets the same bits whatever the batch, the
// rows beside it or the thread count (a prefill row equals that row decoded
// alone: the engine's greedy outputs under preemption rely on it). Which
// thread runs what is separate: a group's partitions are one unit, or spans
// of them run in parallel (their results through a shared buffer, merged by
// a second pass) when there are too few groups to keep every thread busy.
// Inside a unit every KV block is read once and used by all the unit's rows,
// kTileRows rows at a time with register accumulators.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "aligned.h"
#include "attention_tile.h"
#include "dispatch_dtype.h"
#include "kernels.h"
#include "parallel.h"
#include "vec.h"

namespace cpuinfer {
namespace {

constexpr int64_t kChunkRows = 64;      // query rows that share one pass over the keys
#ifndef CPUINFER_ATTN_PREFETCH
#define CPUINFER_ATTN_PREFETCH 1
#endif
constexpr bool kPrefetch = CPUINFER_ATTN_PREFETCH;
// Keys per partition (rounded up to whole blocks): long enough that the merge (D multiply-adds per row and
// partition) is noise against the partition's 2 x D per key, short enough that one long sequence's decode
// step has partitions for several threads.
constexpr int64_t kPartKeys = 512;
constexpr int64_t kPvKeys = 16;        // keys per PV pass: a few KB of V, read front to back
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Group {
    int32_t seq, kv_head;
    int64_t row0, rows;  // rows [row0, row0 + rows) of (token, head-in-group), token-major
    int64_t k_lo, k_hi;  // keys any row of the group sees
    int64_t first, parts;  // its partitions: [first, first + parts), partition p = keys [p * P, (p + 1) * P)
    int64_t units;         // units its partitions are spread over
    int64_t scratch;       // float offset of its partitions' results in `partials` when units > 1
};

// Where a partition's online softmax keeps its rows' running max, sum and unnormalised output.
struct Acc {
    float *m, *l, *acc;  // [rows], [rows], [rows][D]
};

struct Unit {
    int32_t group;
    int64_t p0, p1;  // partitions [p0, p1) of the group
    int64_t cost;
};

// Per-thread working memory, grown on demand and kept across calls.
struct Scratch {
    // Cache-line aligned (aligned.h): vectors and tiles read them whole.
    LineVector<float> q, acc, m, l, s, alpha, dm;  // alpha, dm: a tile's rows, padded to whole vectors
    LineVector<float> parts;  // a one-unit group's partition results (rows x (D + 2) each), merged at its end
    std::vector<int64_t> pos;
    LineVector<bf16_t> qb;    // raw bf16 query rows, for the bf16 x bf16 fast paths
    LineVector<uint32_t> kt;  // the current block's keys as QkBf16::pack lays them out
    LineVector<float> kf;     // or as ManyRows::pack lays them out
    void reserve(int64_t rows, int64_t D, int64_t bs) {
        if (int64_t(q.size()) < rows * D) q.resize(rows * D), acc.resize(rows * D);
        if (int64_t(m.size()) < rows) m.resize(rows), l.resize(rows), pos.resize(rows);
        if (int64_t(s.size()) < attn::kTileRows * bs) s.resize(attn::kTileRows * bs);
        const int64_t padded = (attn::kTileRows + vec::width() - 1) / vec::width() * vec::width();
        if (int64_t(alpha.size()) < padded) alpha.resize(padded), dm.resize(padded);
    }
};

Scratch &thread_scratch() {
    thread_local Scratch s;
    return s;
}

inline void prefetch(const void *p, int64_t bytes) {
    const char *c = static_cast<const char *>(p);
    for (int64_t i = 0; i < bytes; i += tuning::kCacheLine) __builtin_prefetch(c + i);
}

// dst[i] = exp(src[i] - m) for i in [a, b), vectorised.
inline float exp_sum(float *x, int64_t a, int64_t b, float m) {
    const int64_t W = vec::width();
    vec::vf vm = vec::splat(m), acc = vec::zero();
    int64_t i = a;
    for (; i + W <= b; i += W) {
        vec::vf e = vec::exp(vec::sub(vec::load(x + i), vm));
        vec::store(x + i, e);
        acc = vec::add(acc, e);
    }
    float sum = vec::reduce_add(acc);
    for (; i < b; ++i) {
        x[i] = std::exp(x[i] - m);
        sum += x[i];
    }
    return sum;
}

template <typename T, typename C>
struct Runner {
    // Query and cache both bf16: the ISA's bf16 dot-product paths apply.
    static constexpr bool kBf16 = std::is_same_v<T, bf16_t> && std::is_same_v<C, bf16_t>;
    // bf16 query rows, which a whole-unit path takes raw (on a bf16 or, for amx, an fp8 cache).
    static constexpr bool kRawQ = std::is_same_v<T, bf16_t>;
    // QK^T through the ISA's packed-key path (attention_tile.h's QkBf16 hook).
    static constexpr bool kPackedQk = kBf16 && attn::QkBf16<T, C>::kAvailable;
    // Units of at least kManyRows rows (a prefill chunk's) take the ISA's paths for many rows, where there is
    // one (attention_tile.h's ManyRows hook: the tiles' bits): its key packing is paid once per block for all
    // the unit's rows, which a decode unit's few rows would not repay.
    static constexpr int64_t kManyRows = 2 * attn::kTileRows;
    using Many = attn::ManyRows<C>;

    const PagedAttentionArgs &a;
    int64_t G, D, bs;
    float qscale;  // applied to q.k: scale, or scale / soft_cap under a soft-cap
    std::vector<Group> groups;
    std::vector<Unit> units;
    std::vector<float> partials;

    explicit Runner(const PagedAttentionArgs &args)
        : a(args), G(args.num_q_heads / args.num_kv_heads), D(args.head_size), bs(args.block_size) {
        qscale = a.soft_cap > 0.f ? a.scale / a.soft_cap : a.scale;
    }

    int64_t q_len(int64_t s) const { return a.query_start_loc[s + 1] - a.query_start_loc[s]; }

    int64_t part_keys() const { return (kPartKeys + bs - 1) / bs * bs; }

    // The keys [k0, k1) of group g's partitions [p0, p1).
    std::pair<int64_t, int64_t> keys_of(const Group &g, int64_t p0, int64_t p1) const {
        const int64_t P = part_keys();
        return {std::max(g.k_lo, p0 * P), std::min(g.k_hi, p1 * P)};
    }

    void plan() {
        const int64_t W = a.sliding_window, P = part_keys(), threads = max_threads();
        using Whole = attn::WholeUnit<T, C>;  // a whole-unit path sets its own group size
        // Its groups of at most Whole::kChunkRows rows, halved (down to 256) while the batch would make fewer
        // than 4 a thread. (Only the grouping: a row's result does not depend on the rows grouped with it.)
        int64_t whole_chunk = Whole::kChunkRows;
        auto whole_groups = [&](int64_t chunk) {
            int64_t n = 0;
            for (int64_t s = 0; s < a.num_seqs; ++s)
                if (Whole::applies(q_len(s) * G, D)) n += (q_len(s) * G + chunk - 1) / chunk * a.num_kv_heads;
            return n;
        };
        while (whole_chunk > 256 && whole_groups(whole_chunk) < 4 * threads) whole_chunk /= 2;
        int64_t total = 0;
        for (int64_t s = 0; s < a.num_seqs; ++s) {
            const int64_t L = q_len(s), ctx = a.seq_lens[s];
            const int64_t chunk = Whole::applies(L * G, D) ? whole_chunk : kChunkRows;
            for (int64_t r0 = 0; r0 < L * G; r0 += chunk) {
                const int64_t rows = std::min(chunk, L * G - r0);
                // Non-causal: every row's keys are the whole sequence's (its last position's).
                const int64_t first_pos = ctx - L + r0 / G;
                const int64_t last_pos = a.causal ? ctx - L + (r0 + rows - 1) / G : ctx - 1;
                const int64_t lo = W > 0 ? std::max<int64_t>(0, first_pos - W + 1) : 0;
                const int64_t first = lo / P, parts = last_pos / P + 1 - first;
                for (int64_t h = 0; h < a.num_kv_heads; ++h) {
                    groups.push_back({int32_t(s), int32_t(h), r0, rows, lo, last_pos + 1, first, parts, 1, -1});
                    total += (last_pos + 1 - lo) * (rows + 4);
                }
            }
        }
        // Spread long key ranges over several units so that there are about 8 units per thread: dynamic
        // hand-out then evens out ragged lengths and busy cores. (Only the schedule: a row's partitions and
        // their merge are the same either way.)
        const int64_t target = threads > 1 ? std::max<int64_t>(1, total / (threads * 8)) : 0;
        int64_t scratch = 0;
        for (size_t gi = 0; gi < groups.size(); ++gi) {
            Group &g = groups[gi];
            const int64_t cost = (g.k_hi - g.k_lo) * (g.rows + 4);
            g.units = std::min(g.parts, target > 0 ? std::max<int64_t>(1, cost / target) : 1);
            if (g.units > 1) {
                g.scratch = scratch;
                scratch += g.parts * g.rows * (D + 2);
            }
            for (int64_t i = 0; i < g.units; ++i) {
                const int64_t p0 = g.first + g.parts * i / g.units, p1 = g.first + g.parts * (i + 1) / g.units;
                const auto [k0, k1] = keys_of(g, p0, p1);
                units.push_back({int32_t(gi), p0, p1, (k1 - k0) * (g.rows + 4)});
            }
        }
        partials.resize(scratch);
        // Longest first, then dynamic hand-out: balanced even for ragged batches.
        std::stable_sort(units.begin(), units.end(), [](const Unit &x, const Unit &y) { return x.cost > y.cost; });
    }

    // The cache rows of unit u's keys, K and V, as ranges for a PrefetchRanges: a block's share of a unit's
    // keys is one run of rows in each cache.
    void ranges_of(const Unit &u, attn::PrefetchRanges &pf) const {
        const Group &g = groups[u.group];
        const auto [k0, k1] = keys_of(g, u.p0, u.p1);
        const int32_t *table = a.block_tables + g.seq * a.block_table_stride;
        const char *kc = static_cast<const char *>(a.key_cache), *vc = static_cast<const char *>(a.value_cache);
        for (int64_t b = k0 / bs; b * bs < k1; ++b) {
            const int64_t lo = std::max(k0, b * bs), hi = std::min(k1, (b + 1) * bs);
            const int64_t off = ((int64_t(table[b]) * a.num_kv_heads + g.kv_head) * bs + lo - b * bs) * D;
            pf.add(kc + off * int64_t(sizeof(C)), (hi - lo) * D * int64_t(sizeof(C)));
            pf.add(vc + off * int64_t(sizeof(C)), (hi - lo) * D * int64_t(sizeof(C)));
        }
    }

    // `next`: the unit this thread runs after u, if any. A decode unit on the whole-unit path (a single tile:
    // the AMX path's S^T = K Q^T) reads its keys and values once, from memory in a decode batch, and
    // computes little on each, so with nothing in flight it waits on the memory for every chunk. While it
    // runs, the next unit's rows are fetched into L2 a little per chunk (attn::PrefetchRanges through
    // FlashUnit::ahead), and the next unit finds them there. Measured on Sapphire Rapids, 2 threads, 32
    // sequences x 192 keys at SmolLM2's heads over 30 cold caches: 0.34-0.36 -> 0.29-0.30 ms a layer
    // (the same data warm: ~0.17); engine W2 (32 sequences decoding) +5-8%. Tried and no better: two units
    // ahead; the prefetches spread over PV too; every other line (see PrefetchRanges).
    // A unit of several partitions (a long sequence's share) fetches partition by partition: while one runs,
    // the next one of the unit (after its last, the next unit's first). Fetching the whole next unit over
    // this one's chunks, as before, left a long decode's partitions cold: a unit of 16k keys' share is
    // ~800 KB, 16 KB a step to prefetch on top of the step's own loads. Measured on this Sapphire Rapids,
    // 2 threads, the kernel alone, batch 1, 16384 keys streamed from memory (bench_long_context section 3,
    // alternating builds): 0.933-0.947 -> 0.818-0.824 ms; at 4096 keys 0.211-0.217 -> 0.207-0.209; the
    // same KV in L3 no different; every table entry on one block (the arithmetic alone, no misses) 0.26-0.27
    // -> 0.31-0.32 ms (the prefetches themselves). Engine, SmolLM2 bf16, batch-1 decode at 16384:
    // 22.4-22.8 -> 25.8-26.5 tok/s (55-56% -> 63-64% of the roofline); at 4096 unchanged. Every other line
    // lost the gain (0.94 ms at 16384).
    // What bounds it now (2026-11-28, a Sapphire Rapids KVM with a 480 MB L3, batch 1, 16384 keys at SmolLM2's
    // heads): the time is the sum of the arithmetic and the memory, not the larger of them. Per thread, one
    // thread 1.54 ms streamed, 0.54 with every table entry on one block (the arithmetic alone), 0.61 with the
    // KV in L2 and 0.87 in L3, against 0.87 for the bytes at the one-thread stream rate; two threads 0.80 /
    // 0.29 / 0.33 / 0.43, 0.43 the bytes. A C++ microbenchmark of the same pattern (128 KB runs read in a
    // random order, the next run prefetched into L2 a line at a time, ~8 cycles of vector work a line)
    // behaves the same: 7.5 GB/s a thread against 12 for the work alone and 14.5 for the stream, with no
    // prefetch 3 GB/s, two runs ahead 6.1, PREFETCHT2 6.8. The software prefetches hold a fill buffer each
    // for a memory latency (16 of them: ~10 GB/s at most), and the demand loads of the run being computed
    // wait behind them. Also tried here and no better (alternating builds, bench_long_context section 3):
    // the prefetches spread over the PV products and sixteen times as finely; PREFETCHT2; the next chunk's
    // rows prefetched into L1 as well (slower: 0.30 -> 0.35-0.38 ms of arithmetic). For fp8, a table widening of
    // e5m2 (VBMI byte permutes, 4 shuffles for 32 values) and the key rows copied a chunk ahead of their
    // tile loads changed nothing either. How fast the prefetches go out matters: next()'s loop written
    // tighter (its cursor in a register, 4 instructions a line instead of 9) took the arithmetic alone
    // 0.28-0.31 -> 0.26-0.29 ms but the streamed kernel 0.74-0.78 -> 0.80-0.82 (4096 keys 0.18 -> 0.20);
    // prefetching the keys only (the values left to the demand loads) 0.75 -> 0.77. The lead left is less
    // arithmetic a key (the tile stores and loads of S^T and K are most of it, perf annotate), with the
    // prefetches paced to the memory.
    void run_unit(const Unit &u, Scratch &sc, const Unit *next = nullptr) {
        const Group &g = groups[u.group];
        const int64_t s = g.seq, h = g.kv_head, L = q_len(s), ctx = a.seq_lens[s], qs = a.query_start_loc[s];
        const int64_t rows = g.rows;
        sc.reserve(rows, D, bs);
        float *qf = sc.q.data(), *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
        int64_t *pos = sc.pos.data();
        const T *query = static_cast<const T *>(a.query);
        // Raw bf16 query rows for the bf16 fast paths, in whole 16-row tiles (the AMX path reads them so).
        const bool whole = attn::WholeUnit<T, C>::applies(rows, D);
        const int64_t padded = (rows + 15) / 16 * 16;
        const bool raw = kRawQ && (whole || kPackedQk);
        if (raw && int64_t(sc.qb.size()) < padded * D) sc.qb.resize(size_t(padded * D));
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = (g.row0 + r) / G, qh = h * G + (g.row0 + r) % G;
            pos[r] = a.causal ? ctx - L + t : ctx - 1;  // the last key a row sees (every path masks by it)
            const T *src = query + (qs + t) * a.q_token_stride + qh * a.q_head_stride;
            if (!whole && !kPackedQk) load_row(qf + r * D, src);  // the bf16 paths read the raw rows only
            if (raw) std::memcpy(sc.qb.data() + r * D, src, sizeof(T) * D);
        }
        if (whole) std::memset(sc.qb.data() + rows * D, 0, sizeof(bf16_t) * size_t((padded - rows) * D));
        // Where the group's partition results go: this thread's scratch when this unit is the group's only one
        // (merged below), else the shared buffer (merged after every unit ran).
        const int64_t stride = rows * (D + 2);
        float *results = nullptr;
        if (g.parts > 1) {
            if (g.units == 1) {
                if (int64_t(sc.parts.size()) < g.parts * stride) sc.parts.resize(size_t(g.parts * stride));
                results = sc.parts.data();
            } else {
                results = partials.data() + g.scratch;
            }
        }
        attn::PrefetchRanges ahead;
        const bool fetch = whole && rows <= 16;  // a decode unit on the whole-unit path (see above)
        for (int64_t p = u.p0; p < u.p1; ++p) {
            if (fetch) {  // the next partition, of this unit or the next one, over this one's chunks
                ahead = attn::PrefetchRanges{};
                if (p + 1 < u.p1) ranges_of(Unit{u.group, p + 1, p + 2, 0}, ahead);
                else if (next && groups[next->group].rows <= 16)
                    ranges_of(Unit{next->group, next->p0, next->p0 + 1, 0}, ahead);
                // Two steps for each chunk of 32 keys (flash_unit_amx: V pack and QK).
                const auto [k0, k1] = keys_of(g, p, p + 1);
                const int64_t steps = 2 * std::max<int64_t>(1, (k1 - k0) / 32);
                ahead.per = (ahead.bytes() + steps - 1) / steps;
            }
            // A partition's m, l and acc: in its slot of the results when there are several (a 2048-token
            // prefill's copies from the scratch were ~2% of it), else in the scratch.
            float *dst = results ? results + (p - g.first) * stride : nullptr;
            const Acc o = dst ? Acc{dst, dst + rows, dst + 2 * rows} : Acc{m, l, acc};
            const auto [k0, k1] = keys_of(g, p, p + 1);
            attend(g, sc, o, k0, k1, whole, ahead.n ? &ahead : nullptr);
            if (!results) write_rows(g, m, l, acc);  // the group's one partition: its rows out
        }
        if (results && g.units == 1) merge(g, results, acc);  // acc is free again: the partitions are in results
    }

    // The online softmax of the unit's rows over keys [k0, k1) (within one partition) into o's m, l and acc,
    // from scratch (a whole-unit path sets them itself: its first products per row are the acc).
    void attend(const Group &g, Scratch &sc, const Acc &o, int64_t k0, int64_t k1, bool whole,
                attn::PrefetchRanges *ahead = nullptr) {
        const int64_t h = g.kv_head, s = g.seq, rows = g.rows, W = a.sliding_window;
        float *qf = sc.q.data(), *acc = o.acc, *sbuf = sc.s.data();
        const int64_t *pos = sc.pos.data();
        const C *kc = static_cast<const C *>(a.key_cache), *vc = static_cast<const C *>(a.value_cache);
        const int32_t *table = a.block_tables + s * a.block_table_stride;
        const int64_t row_bytes = D * int64_t(sizeof(C));
        // Element offset of this head's part of the unit's block nb in either cache.
        auto block = [&](int64_t nb) { return (int64_t(table[nb]) * a.num_kv_heads + h) * bs * D; };
        // A whole-unit fast path (attention_tile.h's WholeUnit hook: AMX
        // flash attention) writes natural order, which the layers that
        // have one keep for KvLanes.
        if (whole) {
            const C *kb = kc, *vb = vc;
            attn::WholeUnit<T, C>::run({.q = sc.qb.data(), .rows = rows, .D = D, .pos = pos, .k0 = k0, .k1 = k1,
                                        .window = W, .qscale = qscale, .soft_cap = a.soft_cap, .m = o.m,
                                        .l = o.l, .acc = acc, .ahead = ahead},
                                       [&](int64_t j) { return kb + block(j / bs) + (j % bs) * D; },
                                       [&](int64_t j) { return vb + block(j / bs) + (j % bs) * D; });
            return;
        }
        for (int64_t r = 0; r < rows; ++r) o.m[r] = kNegInf, o.l[r] = 0.f;
        std::memset(acc, 0, sizeof(float) * rows * D);
        // Where this unit's keys of block nb sit in a cache, and how many bytes (0 past the end).
        auto span = [&](const C *cache, int64_t nb, int64_t &bytes) {
            const int64_t lo = std::max(k0, nb * bs), hi = std::min(k1, (nb + 1) * bs);
            bytes = hi > lo ? (hi - lo) * row_bytes : 0;
            return hi > lo ? cache + block(nb) + (lo - nb * bs) * D : cache;
        };
        // Blocks sit at random places in the cache, which defeats the
        // hardware prefetcher at every block boundary, and PV walks V a
        // column strip at a time, which it does not follow either. So the
        // unit prefetches itself, spread over the arithmetic a few lines per
        // key (a whole block at once fills the miss queue and stalls):
        // while block b runs QK, its V; while it runs PV, the next block's
        // K. The first block's K is fetched when the unit starts. Measured
        // (32x1024 decode from DRAM, 2 threads): ~1.4x faster than
        // prefetching whole blocks (block size 128; 1.6x at 16). Looking
        // further ahead at small blocks measured no better.
        const bool tree = !kPackedQk && Many::kAvailable && rows >= kManyRows && Many::applies(D);
        const int64_t b0 = k0 / bs;
        if (kPrefetch) {
            int64_t n;
            const C *p = span(kc, b0, n);
            prefetch(p, n);
        }
        for (int64_t b = b0; b * bs < k1; ++b) {
            const int64_t base = b * bs, off = block(b);
            const C *kb = kc + off, *vb = vc + off;
            // Keys [j0, j1) of this block that some row of [r_first, r_last] sees (rows' positions ascend).
            auto seen = [&](int64_t r_first, int64_t r_last, int64_t &j0, int64_t &j1) {
                j0 = std::max({k0, base, W > 0 ? pos[r_first] - W + 1 : int64_t(0)}) - base;
                j1 = std::min({k1, base + bs, pos[r_last] + 1}) - base;
                return j0 < j1;
            };
            if constexpr (kPackedQk) {  // the keys any row of the unit sees, laid out once for all its tiles
                int64_t j0, j1;
                if (seen(0, rows - 1, j0, j1))
                    attn::QkBf16<T, C>::pack(reinterpret_cast<const bf16_t *>(kb), D, bs, j0, j1, sc.kt);
            } else if (tree) {
                int64_t j0, j1;
                if (seen(0, rows - 1, j0, j1)) Many::pack(kb, D, bs, j0, j1, sc.kf);
            }
            bool lead = kPrefetch;  // the first tile that computes on the block prefetches
            for (int64_t r0 = 0; r0 < rows; r0 += attn::kTileRows) {
                const int R = int(std::min<int64_t>(attn::kTileRows, rows - r0));
                int64_t j0, j1;
                if (!seen(r0, r0 + R - 1, j0, j1)) continue;
                attn::Prefetch v_pf, nk_pf;
                if (lead) {
                    int64_t n;
                    const C *p = span(vc, b, n);
                    v_pf = attn::Prefetch(p, n, row_bytes);  // a row per key of QK (the many-rows path paces it)
                    p = span(kc, b + 1, n);
                    // kPvKeys rows per PV pass, which takes D / width() steps
                    nk_pf = attn::Prefetch(p, n, kPvKeys * int64_t(sizeof(C)) * vec::width());
                    lead = false;
                }
                attn::with_rows(R, [&](auto rc) {
                    constexpr int RR = decltype(rc)::value;
                    qk<RR>(sc, r0, kb, j0, j1, sbuf, v_pf, tree);
                });
                v_pf.rest();
                softmax_tile(R, r0, base, j0, j1, sc, o);
                if (tree) {
                    attn::with_rows(R, [&](auto rc) {
                        Many::template pv<decltype(rc)::value>(acc + r0 * D, D, sc.alpha.data(), sbuf, bs, vb, j0, j1,
                                                               nk_pf);
                    });
                    nk_pf.rest();
                    continue;
                }
                attn::with_rows(R, [&](auto rc) {
                    constexpr int RR = decltype(rc)::value;
                    // V in passes of kPvKeys keys: each pass walks a few KB
                    // column strip by column strip, so the block as a whole
                    // is read front to back. The first pass rescales.
                    const float *alpha = sc.alpha.data();
                    for (int64_t js = j0; js < j1; js += kPvKeys, alpha = nullptr)
                        attn::pv_tile<RR>(acc + r0 * D, D, alpha, sbuf, bs, vb, js, std::min(j1, js + kPvKeys), nk_pf);
                });
                nk_pf.rest();
            }
        }
    }

    // A one-partition group's rows out: acc / l, rounded to T.
    void write_rows(const Group &g, const float *m, const float *l, float *acc) {
        const int64_t h = g.kv_head, qs = a.query_start_loc[g.seq];
        T *out = static_cast<T *>(a.out);
        for (int64_t r = 0; r < g.rows; ++r) {
            const int64_t t = (g.row0 + r) / G, qh = h * G + (g.row0 + r) % G;
            const float lr = l[r] + sink_weight(qh, m[r]);
            store_row(out + (qs + t) * a.out_token_stride + qh * a.out_head_stride, acc + r * D,
                      lr > 0.f ? 1.f / lr : 0.f);
        }
    }

    // A query head's attention sink as a term of its rows' softmax sum, relative to their running max mx
    // (the sum and the max are m's units: natural-log logits after the scale and any soft-cap).
    float sink_weight(int64_t qh, float mx) const {
        if (!a.sinks) return 0.f;
        return mx == kNegInf ? 1.f : std::exp(a.sinks[qh] - mx);
    }

    // Scores of the tile's rows (from r0) against keys [j0, j1) of block kb: from the raw bf16 rows and the
    // packed block on the ISA's path, else from the f32 rows (in pair order), through the many-rows path's
    // packed block (`tree`) or the portable tile.
    template <int R>
    void qk(const Scratch &sc, int64_t r0, const C *kb, int64_t j0, int64_t j1, float *sbuf, attn::Prefetch &pf,
            bool tree) {
        if constexpr (kPackedQk) {
            pf.rest();
            attn::QkBf16<T, C>::template run<R>(sc.qb.data() + r0 * D, D, sc.kt.data(), j0, j1, sbuf, bs);
            return;
        }
        if (tree) {
            Many::template qk<R>(sc.q.data() + r0 * D, D, sc.kf.data(), j0, j1, sbuf, bs, pf);
            return;
        }
        attn::qk_tile<R>(sc.q.data() + r0 * D, D, kb, j0, j1, sbuf, bs, pf);
    }

    // Scales, caps and masks the tile's scores (rows r0..r0+R, keys [j0, j1)
    // of the block starting at key `base`), updates each row's running max and
    // sum, and leaves softmax weights in s and the rescale factors in alpha.
    void softmax_tile(int R, int64_t r0, int64_t base, int64_t j0, int64_t j1, Scratch &sc, const Acc &o) {
        const int64_t W = a.sliding_window;
        const bool cap = a.soft_cap > 0.f;
        float *m = o.m + r0, *l = o.l + r0, *dm = sc.dm.data(), *alpha = sc.alpha.data();
        int64_t ra[attn::kTileRows], rb[attn::kTileRows];
        float mn[attn::kTileRows];
        for (int r = 0; r < R; ++r) {
            // Row r sees keys [ra, rb) of this block: causal and windowed.
            float *sr = sc.s.data() + r * bs;
            const int64_t p = sc.pos[r0 + r];
            ra[r] = std::max(j0, (W > 0 ? p - W + 1 : int64_t(0)) - base);
            rb[r] = std::min(j1, p + 1 - base);
            mn[r] = ra[r] < rb[r] ? std::max(m[r], scale_and_max(sr, ra[r], rb[r], cap)) : m[r];
            dm[r] = ra[r] < rb[r] ? m[r] - mn[r] : 0.f;
        }
        // The rows' rescale factors with whole-vector exps (dm is padded with
        // zeros): ~0 when m was -inf, 1 for a row that sees no key here.
        const int64_t VW = vec::width();
        std::fill(dm + R, dm + (R + VW - 1) / VW * VW, 0.f);
        for (int r = 0; r < R; r += int(VW)) vec::store(alpha + r, vec::exp(vec::load(dm + r)));
        for (int r = 0; r < R; ++r) {
            float *sr = sc.s.data() + r * bs;
            if (ra[r] >= rb[r]) {
                std::fill(sr + j0, sr + j1, 0.f);
                continue;
            }
            const float sum = exp_sum(sr, ra[r], rb[r], mn[r]);
            std::fill(sr + j0, sr + ra[r], 0.f);
            std::fill(sr + rb[r], sr + j1, 0.f);
            l[r] = l[r] * alpha[r] + sum;
            m[r] = mn[r];
        }
    }

    // x[j] = scaled (and soft-capped) score for j in [ra, rb); returns their max.
    float scale_and_max(float *x, int64_t ra, int64_t rb, bool cap) const {
        using namespace vec;
        const int64_t W = width();
        const vf vs = splat(qscale), vcap = splat(a.soft_cap);
        vf vmax = splat(kNegInf);
        int64_t j = ra;
        for (; j + W <= rb; j += W) {
            vf v = mul(load(x + j), vs);
            if (cap) v = mul(vcap, vec::tanh(v));
            store(x + j, v);
            vmax = max(vmax, v);
        }
        float mx = reduce_max(vmax);
        for (; j < rb; ++j) {
            float v = x[j] * qscale;
            if (cap) v = a.soft_cap * std::tanh(v);
            x[j] = v;
            mx = std::max(mx, v);
        }
        return mx;
    }

    // A query row as f32, in the lane order attention reads the cache in
    // (attn::KvLanes: the tiles' products meet keys and values in that order).
    void load_row(float *dst, const T *src) {
        const int64_t W = vec::width();
        int64_t i = 0;
        for (; i + W <= D; i += W) vec::store(dst + i, vec::load(src + i));
        for (; i < D; ++i) dst[i] = to_f32(src[i]);
        attn::KvLanes<C>::pair_order(dst, D);
    }

    // An output row from its accumulator (in attn::KvLanes' lane order; put
    // back in natural order here, in place).
    void store_row(T *dst, float *src, float mul) {
        attn::KvLanes<C>::natural_order(src, D);
        const int64_t W = vec::width();
        vec::vf vm = vec::splat(mul);
        int64_t i = 0;
        for (; i + W <= D; i += W) vec::store(dst + i, vec::mul(vec::load(src + i), vm));
        for (; i < D; ++i) dst[i] = from_f32<T>(src[i] * mul);
    }

    // A group's rows out from its partitions' results (base: parts x [m | l | acc], rows x (D + 2) each), in
    // partition order, each rescaled to the rows' common max. acc: D floats of the caller's scratch.
    void merge(const Group &g, const float *base, float *acc) {
        const int64_t rows = g.rows, h = g.kv_head, s = g.seq, qs = a.query_start_loc[s];
        const int64_t stride = rows * (D + 2);
        T *out = static_cast<T *>(a.out);
        for (int64_t r = 0; r < rows; ++r) {
            float mx = kNegInf;
            for (int64_t p = 0; p < g.parts; ++p) mx = std::max(mx, base[p * stride + r]);
            std::fill(acc, acc + D, 0.f);
            float l = 0.f;
            for (int64_t p = 0; p < g.parts; ++p) {
                const float *part = base + p * stride;
                if (part[r] == kNegInf) continue;  // this partition saw no key of row r
                const float w = std::exp(part[r] - mx);
                l += w * part[rows + r];
                const float *pa = part + 2 * rows + r * D;
                for (int64_t d = 0; d < D; ++d) acc[d] += w * pa[d];
            }
            const int64_t t = (g.row0 + r) / G, qh = h * G + (g.row0 + r) % G;
            l += sink_weight(qh, mx);
            store_row(out + (qs + t) * a.out_token_stride + qh * a.out_head_stride, acc, l > 0.f ? 1.f / l : 0.f);
        }
    }

    void run() {
        plan();
        std::atomic<int64_t> next{0};
        const int64_t n = int64_t(units.size());
        parallel_for(std::min<int64_t>(n, max_threads()), 1, [&](int64_t, int64_t) {
            Scratch &sc = thread_scratch();
            // Each thread takes its next unit before it runs this one, so that the next unit's keys and
            // values can come in while this one computes (see run_unit).
            int64_t i = next.fetch_add(1, std::memory_order_relaxed);
            while (i < n) {
                const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
                run_unit(units[i], sc, j < n ? &units[j] : nullptr);
                i = j;
            }
        });
        std::vector<int32_t> split;  // groups whose partitions ran as several units
        for (size_t gi = 0; gi < groups.size(); ++gi)
            if (groups[gi].units > 1) split.push_back(int32_t(gi));
        parallel_for(int64_t(split.size()), 1, [&](int64_t b, int64_t e) {
            Scratch &sc = thread_scratch();
            sc.reserve(1, D, bs);
            for (int64_t i = b; i < e; ++i) {
                const Group &g = groups[split[i]];
                merge(g, partials.data() + g.scratch, sc.acc.data());
            }
        });
    }
};

}  // namespace

void paged_attention(const PagedAttentionArgs &args) {
    if (args.num_seqs <= 0) return;
    with_float_type(args.dt, [&](auto ttag) {
        with_cache_type(args.cache_dt, [&](auto ctag) {
            Runner<decltype(ttag), decltype(ctag)>(args).run();
        });
    });
}

const char *attention_impl() { return attn::Impl<>::kName; }

}  // namespace cpuinfer
