"""paged_attention against a gather-then-softmax float32 torch reference, per variant."""

import dataclasses
import itertools
import random

import pytest
import torch

from cpuinfer import ops

from .paged_reference import CACHE_DTYPES, PagedBatch, gather, make_batch, ref_paged_attention

# The kernel computes in f32 and rounds once to the output dtype.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
MODEL_DTYPES = list(TOL)
HEAD_SIZES = [64, 80, 96, 128, 256]


def run_kernel(kernels, b, **kw):
    out = torch.full_like(b.query, float("nan"))
    kernels.paged_attention(out, *b.args(), **kw)
    return out


def random_seqs(rng: random.Random, n: int, max_ctx: int) -> list[tuple[int, int]]:
    """Mixed decode (q_len 1) and prefill chunks (q_len > 1, with or without a cached prefix)."""
    seqs = []
    for _ in range(n):
        ctx = rng.randint(1, max_ctx)
        kind = rng.random()
        q = 1 if kind < 0.5 else (ctx if kind < 0.7 else rng.randint(1, ctx))
        seqs.append((q, ctx))
    return seqs


# Every head size x cache dtype, with model dtype, GQA shape, block size,
# window and soft-cap varying across the cases.
CASES = list(itertools.product(HEAD_SIZES, CACHE_DTYPES))


@pytest.mark.parametrize("head_size,cache_dtype", CASES, ids=[f"D{d}-{str(c)[6:]}" for d, c in CASES])
def test_mixed_batch_matrix(kernels, head_size, cache_dtype):
    rng = random.Random(head_size * 7 + CACHE_DTYPES.index(cache_dtype))
    for i, (window, cap) in enumerate([(0, 0.0), (0, 30.0), (37, 0.0), (21, 5.0)]):
        dtype = MODEL_DTYPES[(i + head_size) % 3]
        kv_heads, group = rng.choice([(1, 1), (2, 2), (2, 4), (1, 8), (1, 12)])
        block_size = rng.choice([16, 32, 48])
        b = make_batch(random_seqs(rng, 5, 90), kv_heads * group, kv_heads, head_size, block_size, dtype, cache_dtype)
        out = run_kernel(kernels, b, sliding_window=window, soft_cap=cap)
        torch.testing.assert_close(
            out.float(),
            ref_paged_attention(b, window, cap),
            **TOL[dtype],
            msg=lambda m, w=window, c=cap, t=dtype: f"window={w} cap={c} {t}: {m}",
        )


@pytest.mark.parametrize("spread", [1.0, 4.0])
def test_bf16_output_is_the_exact_result_rounded(kernels, spread):
    """Precision beyond the tolerance above: a bf16 causal prefill (512 tokens, SmolLM2's heads) against
    float64 attention, rounded to bf16. The f32 FMA paths miss the rounded result in ~0.03% of the outputs,
    amx's tiles (P as two bf16 terms, hi + lo to 2^-16; exp2 by a polynomial to 1.9e-7) in ~0.4%. Weights
    to 2^-13 (a cruder exp) would miss ~3%, P as one bf16 term (as flash-attention kernels on GPUs take
    it) 20-40%: the 1% bound tells them apart. Two spreads of the scores (the query scaled by 1 and 4:
    flat and peaked weights)."""
    torch.manual_seed(int(spread))
    b = make_batch([(512, 512)], 9, 3, 64, 16, torch.bfloat16, torch.bfloat16)
    b = dataclasses.replace(b, query=(b.query.float() * spread).bfloat16())
    out = run_kernel(kernels, b)
    missed = (out != ref_paged_attention(b, dtype=torch.float64).bfloat16()).double().mean().item()
    assert missed < 0.01, f"{missed:.2%} of the outputs are not the exact result rounded"


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
def test_large_batches(kernels, dtype):
    """Shapes where work is split across threads: long single sequences (flash-decoding) and a prefill."""
    for seqs, hq, hkv in [([(1, 3000)], 8, 1), ([(1, 1500), (1, 700)], 4, 2), ([(200, 600), (1, 900)], 8, 2)]:
        b = make_batch(seqs, hq, hkv, 128, 16, dtype, torch.bfloat16)
        torch.testing.assert_close(run_kernel(kernels, b).float(), ref_paged_attention(b), **TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2], ids=["bf16", "fp8"])
def test_engine_block_size(kernels, cache_dtype):
    """Block size 128 (the engine's default): V is walked in several passes per block, ragged last blocks,
    a partition boundary inside a block (flash-decoding), decodes next to a prefill chunk, GQA 4."""
    b = make_batch([(1, 1000), (1, 129), (37, 300), (1, 2047)], 32, 8, 128, 128, torch.bfloat16, cache_dtype)
    torch.testing.assert_close(run_kernel(kernels, b).float(), ref_paged_attention(b), **TOL[torch.bfloat16])
    torch.testing.assert_close(
        run_kernel(kernels, b, sliding_window=200).float(), ref_paged_attention(b, 200), **TOL[torch.bfloat16]
    )


def test_partitions_over_several_flash_blocks(kernels):
    """Block size 1040: partitions of 1040 keys, so one unit's keys cross two or three of the AMX path's
    512-key blocks (its packed blocks rotate over three sets; a single-tile decode unit has one item per
    block, so a block is packed while the previous block's PV is still to run) and a tile's later items add
    to what its first one wrote. A 2100-token prefill, a prefill chunk after a cached prefix and a decode,
    with and without a window."""
    b = make_batch([(2100, 2100), (1, 2500), (300, 1700)], 6, 2, 64, 1040, torch.bfloat16, torch.bfloat16)
    for window in (0, 700):
        torch.testing.assert_close(
            run_kernel(kernels, b, sliding_window=window).float(),
            ref_paged_attention(b, window),
            **TOL[torch.bfloat16],
            msg=lambda m, w=window: f"window={w}: {m}",
        )


def test_single_thread_matches_threaded(kernels):
    """The same bits on one thread as on several (a long decode's partitions are spread over the threads or
    run by one; where they sit does not depend on that)."""
    b = make_batch([(1, 2000), (3, 300)], 4, 1, 64, 16, torch.float32, torch.float32)
    threaded = run_kernel(kernels, b)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = run_kernel(kernels, b)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(threaded, single)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2], ids=["bf16", "fp8"])
def test_long_context_against_float64_on_any_thread_count(kernels, cache_dtype):
    """Decodes at 16k and 9k context and a 3-token verification chunk at 12k (SmolLM2's heads, the engine's
    block size): within the bf16 tolerance of float64 attention over the same (dequantized) cache, and the
    same bits on 1, 2 and 3 threads (the flash-decoding partitions sit where the keys are, whatever thread
    runs them; 3 threads split the units differently from 2)."""
    torch.manual_seed(37)
    b = make_batch([(1, 16384), (1, 9000), (3, 12000)], 9, 3, 64, 128, torch.bfloat16, cache_dtype)
    ref = ref_paged_attention(b, dtype=torch.float64)
    prev = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(run_kernel(kernels, b))
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(outs[0].double(), ref, **TOL[torch.bfloat16])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_fp8_cache_is_its_values_in_bf16(kernels):
    """Every e5m2 value is a bf16 value (e5m2 is the top byte of an f16: 2 mantissa bits, and a 5-bit exponent
    whose subnormals, 2^-16 to 3 * 2^-16, are normal bf16), so amx widens fp8 rows to bf16 as it packs its
    tiles and gets the bits of a bf16 cache holding the same values; other variants stay within the bf16
    tolerance of it. Caches of random normal values with one element in eight a random finite byte of
    magnitude below 8 (subnormals and both zeros among them); a 700-token prefill and a chunk after a cached
    prefix (packed K^T and V tiles), decodes (single-tile units, K widened as it is copied for the A tiles),
    block sizes 16, 48 (chunks straddle blocks) and 128, a window. Then a value cache of subnormal-sized
    values alone, against float64 attention."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2)
    torch.testing.assert_close(every.to(torch.bfloat16).double(), every.double(), rtol=0, atol=0, equal_nan=True)
    gen = torch.Generator().manual_seed(5)
    for block_size, window in ((16, 0), (48, 100), (128, 0)):
        b = make_batch(
            [(700, 700), (1, 1300), (40, 600), (1, 90)], 9, 3, 64, block_size, torch.bfloat16, torch.float8_e5m2
        )
        small = torch.tensor([x for x in range(256) if x & 0x7F < 0x48], dtype=torch.uint8)  # |x| < 8: E <= 17
        for cache in (b.key_cache, b.value_cache):
            raw = cache.view(torch.uint8)
            pick = torch.rand(raw.shape, generator=gen) < 0.125
            raw[pick] = small[torch.randint(len(small), (int(pick.sum()),), generator=gen)]
        widened = dataclasses.replace(b, key_cache=b.key_cache.bfloat16(), value_cache=b.value_cache.bfloat16())
        fp8, bf16 = run_kernel(kernels, b, sliding_window=window), run_kernel(kernels, widened, sliding_window=window)
        if kernels.ATTENTION_IMPL == "amx":
            assert torch.equal(fp8, bf16), f"block size {block_size}: an fp8 cache is not its bf16 values"
        torch.testing.assert_close(fp8.float(), bf16.float(), **TOL[torch.bfloat16])
        torch.testing.assert_close(fp8.float(), ref_paged_attention(b, window), **TOL[torch.bfloat16])
    # Values of e5m2's two lowest exponents alone (subnormals half of them): outputs ~1e-5, which a flushed
    # or rounded value would move by far more than their bf16 rounding.
    tiny = torch.tensor([x for x in range(256) if x & 0x7F < 0x08], dtype=torch.uint8)
    raw = b.value_cache.view(torch.uint8)
    raw.copy_(tiny[torch.randint(len(tiny), raw.shape, generator=gen)])
    torch.testing.assert_close(run_kernel(kernels, b).float(), ref_paged_attention(b), atol=1e-8, rtol=1.6e-2)


def test_strided_query_and_out(kernels):
    """query as a slice of a fused qkv tensor, out as a slice of a wider buffer."""
    b = make_batch([(3, 40), (1, 17)], 4, 2, 64, 16, torch.bfloat16, torch.bfloat16)
    qkv = torch.randn(4, 8 * 64).bfloat16()
    b.query = qkv[:, : 4 * 64].view(4, 4, 64)
    wide = torch.zeros(4, 6, 64, dtype=torch.bfloat16)
    kernels.paged_attention(wide[:, 1:5], *b.args())
    torch.testing.assert_close(wide[:, 1:5].float(), ref_paged_attention(b), **TOL[torch.bfloat16])
    assert torch.all(wide[:, 0] == 0) and torch.all(wide[:, 5] == 0)


def test_ops_wrapper_takes_float8_cache():
    b = make_batch([(2, 33), (1, 5)], 2, 1, 64, 16, torch.float16, torch.float8_e5m2)
    out = torch.empty_like(b.query)
    ops.paged_attention(
        out,
        b.query,
        b.key_cache,
        b.value_cache,
        b.query_start_loc,
        b.seq_lens,
        b.block_tables,
        b.scale,
        sliding_window=8,
        soft_cap=10.0,
    )
    torch.testing.assert_close(out.float(), ref_paged_attention(b, 8, 10.0), **TOL[torch.float16])


def test_variant_reports_its_inner_loops(kernels):
    """Each variant compiled the attention inner loops meant for it (vector layer, VDPBF16PS or AMX)."""
    assert {"amx": "amx", "avx512bf16": "avx512bf16"}.get(kernels.VARIANT, "vec") == kernels.ATTENTION_IMPL


def test_bad_input(kernels):
    b = make_batch([(2, 40), (1, 20)], 4, 2, 64, 16, torch.float32, torch.bfloat16)
    out = torch.empty_like(b.query)
    q, kc, vc, qsl, lens, tables, scale = b.args()

    def call(**over):
        a = dict(
            out=out,
            query=q,
            key_cache=kc,
            value_cache=vc,
            query_start_loc=qsl,
            seq_lens=lens,
            block_tables=tables,
            scale=scale,
        )
        a.update(over)
        kernels.paged_attention(**a)

    bad_tables = tables.clone()
    bad_tables[1, 1] = kc.shape[0]
    with pytest.raises(IndexError, match=r"block_tables\[1, 1\] = 8 is not a block of the cache"):
        call(block_tables=bad_tables)
    bad_tables[1, 1] = -1
    with pytest.raises(IndexError, match="not a block of the cache"):
        call(block_tables=bad_tables)
    with pytest.raises(ValueError, match="beyond its block table"):
        call(seq_lens=torch.tensor([40, 20 + 16 * tables.shape[1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="less than the sequence's 2 query tokens"):
        call(seq_lens=torch.tensor([1, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match="query has 3 heads, not a multiple"):
        call(query=q[:, :3], out=out[:, :3])
    with pytest.raises(ValueError, match="head_size 32 is not supported"):
        call(query=q[..., :32].contiguous(), out=out[..., :32].contiguous())
    with pytest.raises(ValueError, match="KV cache has head_size 64"):
        q2 = torch.randn(3, 4, 128)
        call(query=q2, out=torch.empty_like(q2))
    with pytest.raises(TypeError, match="out has dtype bfloat16 but query is float32"):
        call(out=out.bfloat16())
    with pytest.raises(TypeError, match="KV-cache dtypes"):
        call(key_cache=kc.to(torch.int16), value_cache=vc.to(torch.int16))
    with pytest.raises(TypeError, match="value_cache has dtype float16 but key_cache is bfloat16"):
        call(value_cache=vc.half())
    with pytest.raises(TypeError, match="seq_lens must be an int32 tensor"):
        call(seq_lens=lens.long())
    with pytest.raises(ValueError, match=r"query_start_loc\[-1\] = 3 but query has 2 tokens"):
        call(query=q[:2], out=out[:2])
    with pytest.raises(ValueError, match="block_size 8 is not supported"):
        call(key_cache=kc[:, :, :8].contiguous(), value_cache=vc[:, :, :8].contiguous())
    with pytest.raises(ValueError, match="out and query overlap"):
        call(out=q)
    with pytest.raises(ValueError, match="sliding_window"):
        call(sliding_window=-1)
    with pytest.raises(ValueError, match="soft_cap"):
        call(soft_cap=float("nan"))
    with pytest.raises(TypeError, match="not uint8"):
        ops.paged_attention(out, q, kc.view(torch.uint8), vc.view(torch.uint8), qsl, lens, tables, scale)


def row_decoded(b: PagedBatch, i: int, q_len: int, ctx: int) -> PagedBatch:
    """Row i of b's one sequence (a chunk of q_len tokens ending at ctx) as a decode step of its own."""
    return PagedBatch(
        b.query[i : i + 1].clone(),
        b.key_cache,
        b.value_cache,
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([ctx - q_len + i + 1], dtype=torch.int32),
        b.block_tables,
        b.scale,
    )


@pytest.mark.parametrize("dtype", MODEL_DTYPES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=lambda c: str(c)[6:])
@pytest.mark.parametrize("window", [0, 200], ids=["full", "window"])
def test_a_row_does_not_depend_on_its_batch(kernels, dtype, cache_dtype, window):
    """Bit for bit: every row of a prefill chunk (after a cached prefix) equals that row decoded alone, and a
    decode row alone equals it in a batch of other sequences. (Preemption recomputes a sequence as one prefill,
    and the engine's greedy outputs must not change with what else runs.) SmolLM2's heads (9 query, 3 KV);
    short contexts and ones over several 512-key flash-decoding partitions, which a lone sequence's decode
    spreads over the threads and a batch's does not; with a sliding window too, whose start moves with the row
    (a prefill chunk's rows see different first keys than any one of them alone)."""
    rng = random.Random(hash((str(dtype), str(cache_dtype))) % 1000)
    for long in (False, False, False, True, True):
        ctx = rng.randint(600, 1600) if long else rng.randint(2, 300)
        q = rng.randint(1, 24 if long else ctx)
        b = make_batch([(q, ctx)], 9, 3, 64, 16, dtype, cache_dtype)
        out = run_kernel(kernels, b, sliding_window=window)
        for i in range(q):
            one = row_decoded(b, i, q, ctx)
            assert torch.equal(run_kernel(kernels, one, sliding_window=window), out[i : i + 1]), (
                f"q={q} ctx={ctx}: row {i} differs"
            )
    seqs = [(1, rng.randint(2, 1600)) for _ in range(8)]
    b = make_batch(seqs, 9, 3, 64, 16, dtype, cache_dtype)
    out = run_kernel(kernels, b, sliding_window=window)
    for s in range(8):
        one = PagedBatch(
            b.query[s : s + 1].clone(),
            b.key_cache,
            b.value_cache,
            torch.tensor([0, 1], dtype=torch.int32),
            b.seq_lens[s : s + 1],
            b.block_tables[s : s + 1],
            b.scale,
        )
        assert torch.equal(run_kernel(kernels, one, sliding_window=window), out[s : s + 1]), (
            f"sequence {s} of the batch differs alone"
        )


@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=lambda c: str(c)[6:])
def test_many_row_units_equal_their_rows_decoded(kernels, head_size, cache_dtype):
    """A prefill chunk's units of 32 rows or more take the vector layer's many-rows path where it has one
    (avx512: keys across the lanes for QK^T, PV with the accumulators in registers); its bits must be the
    tiles', which every decode row takes: each row of the chunk equals that row decoded alone, bit for bit,
    and the chunk is the float64 reference within the f32 tolerance. Unit sizes 45 (tiles of 16, 16 and 13
    rows: the row pairs' and eights' remainders) and 64, block sizes 16 and 128 (odd and even counts of
    16-key groups), a cached prefix, a sliding window and a soft-cap."""
    rng = random.Random(head_size + CACHE_DTYPES.index(cache_dtype))
    for group, tokens, block_size, window, cap in [
        (5, 9, 16, 0, 0.0),  # 45 rows a KV head: one unit
        (4, 40, 128, 0, 0.0),  # 160 rows: units of 64, 64 and 32
        (5, 9, 128, 77, 0.0),
        (4, 24, 16, 0, 20.0),
    ]:
        ctx = tokens + rng.randint(0, 300)
        b = make_batch([(tokens, ctx)], 2 * group, 2, head_size, block_size, torch.float32, cache_dtype)
        out = run_kernel(kernels, b, sliding_window=window, soft_cap=cap)
        torch.testing.assert_close(out, ref_paged_attention(b, window, cap), **TOL[torch.float32])
        for i in range(tokens):
            alone = run_kernel(kernels, row_decoded(b, i, tokens, ctx), sliding_window=window, soft_cap=cap)
            assert torch.equal(alone, out[i : i + 1]), f"{tokens} tokens after {ctx - tokens}: row {i} differs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_sinks(kernels, dtype):
    """gpt-oss's sinks: a logit per query head in every row's softmax sum. Decodes over long contexts (their
    partitions merged), a prefill long enough for the matrix-tile path and chunks over a cached prefix, with a
    sliding window and GQA; the torch fallback (torch_paged) against the same reference."""
    from cpuinfer.attention import torch_paged
    from cpuinfer.attention.metadata import AttentionMetadata

    seqs = [(1, 3000), (1, 700), (600, 600), (37, 900), (1, 1)]
    b = make_batch(seqs, 8, 2, 64, 16, dtype, dtype)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 3
    for window in (0, 128):
        out = run_kernel(kernels, b, sliding_window=window, sinks=sinks)
        ref = ref_paged_attention(b, window, sinks=sinks)
        torch.testing.assert_close(out.float(), ref, **TOL[dtype])
        assert not torch.allclose(ref, ref_paged_attention(b, window), **TOL[dtype])  # the sinks matter here
    with pytest.raises(ValueError, match="one logit per query head"):
        run_kernel(kernels, b, sinks=sinks[:4])
    with pytest.raises(TypeError, match="float32"):
        run_kernel(kernels, b, sinks=sinks.bfloat16())
    if dtype == torch.float32 and kernels.VARIANT == "generic":  # the torch fallback, once
        qsl, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.int64),
            query_start_loc=b.query_start_loc,
            seq_lens=b.seq_lens,
            block_tables=b.block_tables,
            block_size=16,
            query_lens=[qsl[i + 1] - qsl[i] for i in range(len(lens))],
            context_lens=lens,
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(lens))),
        )
        out = torch.empty_like(b.query)
        torch_paged.paged_attention(out, b.query, b.key_cache, b.value_cache, meta, b.scale, 0, 0.0, sinks)
        torch.testing.assert_close(out, ref_paged_attention(b, 0, sinks=sinks), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 128])
def test_non_causal_whole_prompts(kernels, dtype, head_size):
    """causal=False (an encoder's attention over whole prompts): every row of a sequence attends to all its keys,
    against torch's SDPA without a mask per sequence (float32, over the cache's values). Lengths from 1 to past
    a partition and the AMX path's 16-row tiles; MHA (encoders) and GQA; a sliding window is refused."""
    torch.manual_seed(head_size)
    for kv_heads, group in ((4, 1), (2, 3)):
        lens = [1, 7, 16, 33, 300, 1100]
        b = make_batch([(n, n) for n in lens], kv_heads * group, kv_heads, head_size, 16, dtype, dtype)
        out = run_kernel(kernels, b, causal=False)
        for s, n in enumerate(lens):
            q0 = int(b.query_start_loc[s])
            q = b.query[q0 : q0 + n].float().transpose(0, 1)  # [Hq, n, D]
            k, v = (
                gather(c, b.block_tables[s], n).repeat_interleave(group, 1).transpose(0, 1)
                for c in (b.key_cache, b.value_cache)
            )
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=b.scale).transpose(0, 1)
            torch.testing.assert_close(out[q0 : q0 + n].float(), ref, **TOL[dtype], msg=lambda m, n=n: f"len {n}: {m}")
    with pytest.raises(ValueError, match="sliding window"):
        run_kernel(kernels, b, causal=False, sliding_window=8)
