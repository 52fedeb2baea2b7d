"""The paged attention kernels (decode and chunk) against the gather + torch attention paths
they replace; sliding windows and soft-capped scores (Gemma) against a plain reference, for
the kernels and the torch paths alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import attention
from pdserve.model.attention import Scores
from pdserve.model.kv_cache import KVCache, KVShape
from pdserve.model.llama import DecodeGroup
from pdserve.model.paged_attention import PagedAttention

BS = 16
PLAIN = Scores(64 ** -0.5)  # head_dim 64's
# Lengths under one block, exactly one, one past a block edge, and several blocks.
LENS = [1, 5, 16, 17, 130, 301]


def _case(layout: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(KVShape(3, kv_heads, dim, BS, layout), 64, dtype)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g))
    width = -(-max(LENS) // BS)
    perm = torch.randperm(64, generator=g)  # scattered blocks catch block-table mistakes
    tables = torch.zeros(len(LENS), width, dtype=torch.long)
    used = 0
    for row, n in enumerate(LENS):
        need = -(-n // BS)
        tables[row, :need] = perm[used:used + need] if row % 2 else perm[:need]  # some share
        used += need
    group = DecodeGroup.build(list(range(len(LENS))), tables, LENS)
    q = torch.randn(len(LENS), heads, dim, generator=g).to(dtype)
    return cache, group, q


def _decode(kernel: PagedAttention, q, cache, layer, tables, lens, s) -> torch.Tensor:
    """The kernel's decodes of q [seqs, heads, dim] (row i: table row i), as a new tensor."""
    out = torch.empty_like(q)
    kernel.decode(q, out, torch.arange(q.shape[0]), cache, layer, tables, lens, s)
    return out


def _context(group: DecodeGroup, keys: int) -> torch.Tensor:
    """[seqs, 1, 1, keys]: True on each decode's context."""
    return (torch.arange(keys) < group.lens.unsqueeze(1))[:, None, None, :]


def _reference(q, cache: KVCache, layer: int, group: DecodeGroup) -> torch.Tensor:
    kc, vc = cache.gather(layer, group.tables)
    qd = q.float().unflatten(1, (kc.shape[1], -1))
    o = F.scaled_dot_product_attention(qd, kc.float(), vc.float(),
                                       attn_mask=_context(group, kc.shape[2]))
    return o.flatten(1, 2)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 128), (16, 1, 64)])
def test_matches_attention_float32(layout, heads, kv_heads, dim):
    kernel = PagedAttention.for_model(heads, kv_heads, dim, torch.float32, "cpu")
    assert kernel is not None, "the kernel did not build (is g++ on PATH?)"
    cache, group, q = _case(layout, torch.float32, heads, kv_heads, dim)
    for layer in range(3):
        got = _decode(kernel, q, cache, layer, group.tables, group.lens, Scores(dim ** -0.5))
        torch.testing.assert_close(got, _reference(q, cache, layer, group), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_bfloat16_as_close_as_torchs_bfloat16_attention(layout):
    """bf16 in and out; with bf16 dot products the weights of V are rounded to bf16 (see the
    chunk kernel's test): off from float32 attention of the same inputs by at most the
    output's rounding plus the weights'. On average within 1.5x of torch's bf16 attention's
    error (torch keeps a lone query's weights in float32: 1.25x less error here)."""
    kernel = PagedAttention.for_model(9, 3, 64, torch.bfloat16, "cpu")
    cache, group, q = _case(layout, torch.bfloat16, 9, 3, 64)
    got = _decode(kernel, q, cache, 1, group.tables, group.lens, PLAIN).float()
    want = _reference(q, cache, 1, group)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(2 ** -126)
    err = (got - want).abs()
    assert (err <= 0.5 * ulp + 2 ** -9 * cache.tensor.abs().max() + 1e-6).all()
    kc, vc = cache.gather(1, group.tables)
    torch_bf16 = F.scaled_dot_product_attention(q.unflatten(1, (3, -1)), kc, vc,
                                                attn_mask=_context(group, kc.shape[2])
                                                ).flatten(1, 2)
    assert err.mean() <= 1.5 * (torch_bf16.float() - want).abs().mean()


def test_results_do_not_depend_on_threads_or_batch():
    """Each (sequence, KV head) is one thread's work in a fixed order: a sequence's output
    is bit-identical alone or batched, on one thread or two (monolithic = disaggregated)."""
    kernel = PagedAttention.for_model(9, 3, 64, torch.bfloat16, "cpu")
    cache, group, q = _case("NHD", torch.bfloat16, 9, 3, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        both = _decode(kernel, q, cache, 0, group.tables, group.lens, PLAIN)
        torch.set_num_threads(1)
        one = _decode(kernel, q, cache, 0, group.tables, group.lens, PLAIN)
    finally:
        torch.set_num_threads(threads)
    alone = _decode(kernel, q[4:5], cache, 0, group.tables[4:5], group.lens[4:5], PLAIN)
    assert torch.equal(both, one)
    assert torch.equal(alone, one[4:5])


def test_reads_and_writes_its_rows_in_place():
    """Decodes among a step's other tokens: query i is row rows[i] of a view into q, k and v
    together (as the forward's q is), its output that row of `out`; other rows untouched."""
    kernel = PagedAttention.for_model(9, 3, 64, torch.bfloat16, "cpu")
    cache, group, q = _case("NHD", torch.bfloat16, 9, 3, 64)
    want = _decode(kernel, q, cache, 0, group.tables, group.lens, PLAIN)
    rows = torch.tensor([7, 2, 9, 0, 4, 11])  # scattered, out of order
    qkv = torch.zeros(12, 9 + 2 * 3, 64, dtype=torch.bfloat16)
    qkv[rows, :9] = q
    out = torch.full((12, 9, 64), 5.0, dtype=torch.bfloat16)
    kernel.decode(qkv[:, :9], out, rows, cache, 0, group.tables, group.lens, PLAIN)
    assert torch.equal(out[rows], want)
    others = torch.ones(12, dtype=torch.bool)
    others[rows] = False
    assert (out[others] == 5.0).all()


def test_declines_what_it_has_no_variant_for():
    assert PagedAttention.for_model(9, 3, 80, torch.float32, "cpu") is None  # head_dim 80
    assert PagedAttention.for_model(9, 3, 64, torch.float16, "cpu") is None
    assert PagedAttention.for_model(32, 1, 64, torch.float32, "cpu") is None  # group of 32
    assert PagedAttention.for_model(9, 3, 64, torch.float32, "meta") is None



def _chunk_case(layout: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                keys: int = 301):
    g = torch.Generator().manual_seed(1)
    cache = KVCache(KVShape(2, kv_heads, dim, BS, layout), 32, dtype)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g))
    table = torch.randperm(32, generator=g)[:-(-keys // BS)].unsqueeze(0)
    q = torch.randn(keys, heads, dim, generator=g).to(dtype)
    return cache, table, q


def _chunk_reference(q, cache: KVCache, layer: int, table, pos: int) -> torch.Tensor:
    """Causal attention of q (the tokens at pos, pos + 1, ...) by torch, in float32."""
    n = q.shape[0]
    kc, vc = (x[:, :, :pos + n].float() for x in cache.gather(layer, table))
    keys = torch.arange(pos + n)
    mask = keys.unsqueeze(0) <= keys[pos:].unsqueeze(1)
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1).unsqueeze(0), kc, vc,
                                       attn_mask=mask, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


# A whole prompt; a chunk after cached tokens starting mid-block and mid-tile; one token.
CHUNKS = [(0, 301), (37, 264), (300, 1)]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 128), (16, 1, 64)])
def test_chunk_matches_causal_attention_float32(layout, heads, kv_heads, dim):
    kernel = PagedAttention.for_model(heads, kv_heads, dim, torch.float32, "cpu")
    cache, table, q = _chunk_case(layout, torch.float32, heads, kv_heads, dim)
    for pos, n in CHUNKS:
        out = torch.full_like(q[pos:pos + n], float("nan"))
        kernel.chunk(q[pos:pos + n], out, cache, 1, table, pos, Scores(dim ** -0.5))
        torch.testing.assert_close(out, _chunk_reference(q[pos:pos + n], cache, 1, table, pos),
                                   atol=2e-6, rtol=1e-5)


def test_chunk_bfloat16_as_close_as_torchs_bfloat16_attention():
    """bf16 in and out. Where the CPU has bf16 dot products the kernel multiplies in pairs
    and rounds the softmax weights to bf16 for the sum over V, as flash attention does: off
    from float32 attention of the same inputs by at most the output's rounding plus the
    weights' (2^-9 of the largest |v|), and on average no further than torch's own bf16
    attention."""
    kernel = PagedAttention.for_model(9, 3, 64, torch.bfloat16, "cpu")
    cache, table, q = _chunk_case("NHD", torch.bfloat16, 9, 3, 64)
    out = torch.empty_like(q)
    kernel.chunk(q, out, cache, 0, table, 0, PLAIN)
    want = _chunk_reference(q, cache, 0, table, 0)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(2 ** -126)
    err = (out.float() - want).abs()
    assert (err <= 0.5 * ulp + 2 ** -9 * cache.tensor.abs().max() + 1e-6).all()
    kc, vc = (x[:, :, :q.shape[0]] for x in cache.gather(0, table))
    torch_bf16 = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kc, vc,
                                                is_causal=True, enable_gqa=True)
    torch_err = (torch_bf16.squeeze(0).transpose(0, 1).float() - want).abs()
    assert err.mean() <= 1.1 * torch_err.mean(), (err.mean(), torch_err.mean())


@pytest.mark.parametrize("scores", [PLAIN, Scores(0.1, 2.0, 40)], ids=["plain", "window"])
def test_chunk_results_do_not_depend_on_chunking_or_threads(scores):
    """A prompt computed in one chunk, in several (chunked prefill, a prefix-cache hit), or
    on another thread count gives bit-identical outputs: monolithic = disaggregated. In a
    window too: a tile's first span depends on its position only."""
    kernel = PagedAttention.for_model(9, 3, 64, torch.bfloat16, "cpu")
    cache, table, q = _chunk_case("HND", torch.bfloat16, 9, 3, 64)
    whole, pieces = torch.empty_like(q), torch.empty_like(q)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        kernel.chunk(q, whole, cache, 0, table, 0, scores)
        torch.set_num_threads(1)
        for start, end in [(0, 5), (5, 16), (16, 150), (150, 151), (151, 301)]:
            kernel.chunk(q[start:end], pieces[start:end], cache, 0, table, start, scores)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, pieces)


def test_chunk_reads_queries_and_writes_outputs_as_row_slices():
    """The model passes q as a view into the fused qkv projection and out as rows of the
    whole batch's output: strided rows in, other rows untouched."""
    kernel = PagedAttention.for_model(9, 3, 64, torch.float32, "cpu")
    cache, table, q = _chunk_case("NHD", torch.float32, 9, 3, 64, keys=40)
    qkv = torch.cat([q, torch.randn(40, 6, 64)], 1)  # q heads first, as in the model
    out = torch.zeros(50, 9, 64)
    kernel.chunk(qkv[:, :9], out[10:], cache, 0, table, 0, PLAIN)
    assert torch.equal(out[:10], torch.zeros(10, 9, 64))
    torch.testing.assert_close(out[10:], _chunk_reference(q, cache, 0, table, 0),
                               atol=2e-6, rtol=1e-5)


def _plain_attention(q, k, v, visible, s: Scores) -> torch.Tensor:
    """q [n, heads, dim], k, v [kv_heads, m, dim], visible [n, m]: float64, by the formula."""
    group = q.shape[1] // k.shape[0]
    k, v = (x.double().repeat_interleave(group, 0) for x in (k, v))
    scores = torch.einsum("nhd,hmd->hnm", q.double(), k) * s.scale
    if s.cap:
        scores = torch.tanh(scores / s.cap) * s.cap
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hnm,hmd->nhd", weights, v)


WINDOWED = [Scores(0.125, None, 37), Scores(0.2, 1.5, 20), Scores(0.2, 3.0, None)]


@pytest.mark.parametrize("s", WINDOWED, ids=["window", "window+cap", "cap"])
def test_windows_and_caps_float32(s):
    """Each query sees only its last `window` keys (its own included) and capped scores:
    the kernels and the torch paths against the formula."""
    kernel = PagedAttention.for_model(9, 3, 64, torch.float32, "cpu")
    cache, table, q = _chunk_case("HND", torch.float32, 9, 3, 64)
    kc, vc = (x[0] for x in cache.gather(1, table))
    keys = torch.arange(q.shape[0])
    for pos, n in CHUNKS:
        want = _plain_attention(q[pos:pos + n], kc[:, :pos + n], vc[:, :pos + n],
                                s.visible(keys[:pos + n], keys[pos:pos + n]), s).float()
        out = torch.empty_like(q[pos:pos + n])
        kernel.chunk(q[pos:pos + n], out, cache, 1, table, pos, s)
        torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(attention.chunk(q[pos:pos + n], kc, vc, pos, s), want,
                                   atol=2e-6, rtol=1e-5)
    cache, group, q = _case("NHD", torch.float32, 9, 3, 64)
    kc, vc = cache.gather(1, group.tables)
    got = _decode(kernel, q, cache, 1, group.tables, group.lens, s)
    torch_path = attention.decode(q, kc, vc, group.lens, s)
    for i, n in enumerate(LENS):
        keys = torch.arange(n)
        want = _plain_attention(q[i:i + 1], kc[i, :, :n], vc[i, :, :n],
                                s.visible(keys, keys[-1:]), s).float()[0]
        torch.testing.assert_close(got[i], want, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(torch_path[i], want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_read_no_block_before_them(dtype):
    """Blocks wholly before every query's window are not read (a decode that pulled only
    the window's blocks leaves them unwritten): NaN there changes nothing."""
    kernel = PagedAttention.for_model(9, 3, 64, dtype, "cpu")
    s = Scores(0.125, None, 40)
    cache, table, q = _chunk_case("NHD", dtype, 9, 3, 64)
    pos = 200  # every query (200 .. 300) sees keys from 161 on: blocks 0 .. 9 are unread
    want = torch.empty_like(q[pos:])
    kernel.chunk(q[pos:], want, cache, 0, table, pos, s)
    lens, tables = torch.tensor([pos + 1, q.shape[0]]), table.repeat(2, 1)
    decoded = _decode(kernel, q[pos:pos + 2], cache, 0, tables, lens, s)
    cache.tensor[table[0, :(pos - s.window + 1) // BS]] = float("nan")
    got = torch.empty_like(q[pos:])
    kernel.chunk(q[pos:], got, cache, 0, table, pos, s)
    assert torch.equal(got, want)
    assert torch.equal(_decode(kernel, q[pos:pos + 2], cache, 0, tables, lens, s),
                       decoded)
