"""The C++ CPU ops (specserve/csrc/cpu_ops.cpp): attention (bfloat16 rows through the float32 kernel where
it is built, and through the float64 one) against SDPA in float64, each row's bits whatever shares the
call, the fused residual add + RMSNorm against ``RMSNorm``, and the PyTorch fallback under
SPECSERVE_NO_EXT=1. The extension is built on first use (once, into the specserve cache)."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from specserve.layers import cpu_ops
from specserve.layers.norm import RMSNorm

ops = cpu_ops.get()
needs_ext = pytest.mark.skipif(ops is None, reason="the C++ extension did not build here (the fallback runs)")
H, HKV, D = 9, 3, 64
SCALE = D**-0.5


def _reference(q, cache, slot, L, mask, causal):
    """Attention.forward's float64 branch."""
    B, Q = q.shape[:2]
    k, v = cache[slot : slot + B, :, :, :L].double().unbind(1)
    am = None if mask is None else torch.zeros(mask.shape, dtype=torch.float64).masked_fill_(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k, v, attn_mask=am, is_causal=causal,
                                         scale=SCALE, enable_gqa=True)
    return out.transpose(1, 2).to(q.dtype).reshape(B, Q, -1)


def _paged(cache, slot, B, bs=16):
    """Rows ``slot .. slot + B`` of a contiguous cache [rows, 2, Hkv, cap, D] as the KV pool the op reads
    (blocks of ``bs`` positions in a shuffled order, block 0 the scratch block) and their block tables."""
    _, _, hkv, cap, d = cache.shape
    nb = cap // bs
    blocks = cache[slot : slot + B].reshape(B, 2, hkv, nb, bs, d).permute(0, 3, 1, 2, 4, 5)
    blocks = blocks.reshape(B * nb, 2, hkv, bs, d)
    ids = torch.randperm(B * nb, generator=torch.Generator().manual_seed(slot)) + 1
    pool = torch.zeros(B * nb + 1, 2, hkv, bs, d, dtype=cache.dtype)
    pool[ids] = blocks
    return pool, ids.view(B, nb)


@pytest.fixture(params=["float32", "float64"])
def kernel(request):
    """The attention kernel bfloat16 rows take (float32 rows always take the float64 one)."""
    if ops is None:
        pytest.skip("the C++ extension did not build here")
    ops.set_float64_attention(request.param == "float64")
    yield request.param
    ops.set_float64_attention(False)


def _attn(q, cache, slot, L, mask=None, causal=False, parallel_work=cpu_ops.PARALLEL_WORK):
    pool, tables = _paged(cache, slot, q.shape[0])
    return ops.attention(q, pool, tables, L, mask, causal, SCALE, parallel_work)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_matches_float64_sdpa(dtype, kernel):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 2, HKV, 1024, D, generator=g).to(dtype)
    same = total = 0
    for B, Q, L, masked, causal in [(1, 1, 60, False, False), (1, 16, 500, False, False), (3, 5, 200, True, False),
                                    (1, 40, 40, False, True), (2, 7, 1000, True, False)]:
        q = torch.randn(B, Q, H, D, generator=g).to(dtype)
        mask = None
        if masked:
            mask = torch.rand(B, 1, Q, L, generator=g) < 0.6
            mask[..., 0] = True
        got, want = _attn(q, cache, 1, L, mask, causal), _reference(q, cache, 1, L, mask, causal)
        assert (got.float() - want.float()).abs().max().item() <= 1e-2
        same += (got == want).sum().item()
        total += got.numel()
    assert same / total > 0.999


@pytest.mark.parametrize("d", [32, 48, 128])
def test_attention_other_head_sizes_and_a_hidden_row(d, kernel):
    """Head sizes beside 64 (128: the float32 kernel's other instance; 32, 48: the float64 kernel) against
    float64 SDPA; a row that sees no key gives zeros, and a hidden key's values are never read."""
    g = torch.Generator().manual_seed(d)
    B, Q, L, hkv, heads = 2, 6, 300, 2, 6  # 3 query heads a kv head: rows of two queries share a task's pairs
    cache = torch.randn(B, 2, hkv, 304, d, generator=g).to(torch.bfloat16)
    pool = cache.view(B, 2, hkv, 19, 16, d).permute(0, 3, 1, 2, 4, 5).reshape(B * 19, 2, hkv, 16, d)
    q = torch.randn(B, Q, heads, d, generator=g).to(torch.bfloat16)
    mask = torch.rand(B, 1, Q, L, generator=g) < 0.5
    mask[..., 0] = True
    mask[1, 0, 3] = False
    mask[0, 0, 0, 7], mask[0, 0, 1, 7] = False, True  # query 0 of sequence 0 does not see key 7, query 1 does
    pool, tables = pool.contiguous(), torch.arange(B * 19).view(B, 19)
    got = ops.attention(q, pool, tables, L, mask, False, d**-0.5, 0)
    poisoned = pool.clone()
    poisoned[0, :, :, 7] = float("nan")  # sequence 0's block 0, offset 7: a hidden key is never read
    assert torch.equal(ops.attention(q, poisoned, tables, L, mask, False, d**-0.5, 0)[0, 0], got[0, 0])
    k, v = cache[:, :, :, :L].double().unbind(1)
    am = torch.zeros(mask.shape, dtype=torch.float64).masked_fill_(~mask, float("-inf"))
    want = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k, v, attn_mask=am, scale=d**-0.5,
                                          enable_gqa=True).transpose(1, 2).to(torch.bfloat16).reshape(B, Q, -1)
    assert torch.equal(got[1, 3], torch.zeros_like(got[1, 3]))
    seen = torch.ones(B, Q, dtype=torch.bool)
    seen[1, 3] = False
    assert (got[seen].float() - want[seen].float()).abs().max().item() <= 1e-2
    assert (got[seen] == want[seen]).float().mean().item() > 0.999


@needs_ext
def test_attention_row_has_the_same_bits_whatever_shares_the_call(kernel):
    g = torch.Generator().manual_seed(1)
    # rows of 201-264 keys: the float32 kernel's parts of 128 visible keys end at 128 and 256, the second
    # inside the tree below (where a row's keys are not at the positions a chain's are); 64 rows, as a
    # part boundary moved changes a row's float32 sums in the last bits only, rarely its bfloat16 output
    P, K = 200, 64
    cache = torch.zeros(4, 2, HKV, 336, D, dtype=torch.bfloat16)
    ctx = torch.randn(2, HKV, P + K, D, generator=g).to(torch.bfloat16)
    q = torch.randn(1, K, H, D, generator=g).to(torch.bfloat16)
    for slot in range(3):
        cache[slot, :, :, : P + K] = ctx
    # one token at a time (no mask: keys [0, P + i])
    singles = torch.cat([_attn(q[:, i : i + 1], cache, 0, P + i + 1) for i in range(K)], 1)
    # a chain of K with its causal mask, on the calling thread and on the intra-op threads
    chain_mask = torch.ones(1, 1, K, P + K, dtype=torch.bool).tril(P)
    for work in (cpu_ops.PARALLEL_WORK, 0):
        assert torch.equal(_attn(q, cache, 0, P + K, chain_mask, parallel_work=work), singles)
    # short chains (a verification) on 2 threads: 2-3 tokens run a task per part of keys, 4 a task per half of the rows
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for k in (2, 3, 4):
            short = _attn(q[:, :k], cache, 0, P + k, chain_mask[..., :k, : P + k], parallel_work=0)
            assert torch.equal(short, singles[:, :k])
    finally:
        torch.set_num_threads(threads)
    # a prefill (causal, no mask) of the whole context: its last K rows
    qp = torch.cat([torch.randn(1, P, H, D, generator=g).to(torch.bfloat16), q], 1)
    assert torch.equal(_attn(qp, cache, 0, P + K, causal=True)[:, P:], singles)
    # a batch of 3 sequences (slots 1..3) with masks: row i of sequence 1 sees keys [0, P + i]
    other = torch.randn(3, K, H, D, generator=g).to(torch.bfloat16)
    other[1] = q[0]
    mask3 = torch.rand(3, 1, K, P + K, generator=g) < 0.5
    mask3[1] = chain_mask[0]
    assert torch.equal(_attn(other, cache, 0, P + K, mask3)[1:2], singles)
    # a tree: node i sees the context and its ancestors, stored at other cache offsets than in a chain
    # (nodes 0, 2, 4, ... form one path; the others are siblings in between)
    tree_q = torch.zeros(1, 2 * K, H, D, dtype=torch.bfloat16)
    tree_cache = cache.clone()
    tree_mask = torch.zeros(1, 1, 2 * K, P + 2 * K, dtype=torch.bool)
    tree_mask[..., :P] = True
    sib = torch.randn(2, HKV, K, D, generator=g).to(torch.bfloat16)
    for i in range(K):
        tree_q[0, 2 * i] = q[0, i]
        tree_q[0, 2 * i + 1] = torch.randn(H, D, generator=g).to(torch.bfloat16)
        tree_cache[0, :, :, P + 2 * i] = ctx[:, :, P + i]
        tree_cache[0, :, :, P + 2 * i + 1] = sib[:, :, i]
        tree_mask[0, 0, 2 * i, P : P + 2 * i + 1 : 2] = True
        tree_mask[0, 0, 2 * i + 1, P + 2 * i + 1] = True
    out = _attn(tree_q, tree_cache, 0, P + 2 * K, tree_mask)
    assert torch.equal(out[:, 0::2], singles)


@needs_ext
@pytest.mark.parametrize("V, W, bias_dtype", [(1000, 4, torch.bfloat16), (16384, 1, torch.float32), (50, 3, None)])
def test_softmax_topk_is_softmax_then_topk(V, W, bias_dtype):
    """The drafting op: the k most probable entries of softmax((base + bias) / t) per row, best first,
    as PyTorch computes them (rows of base strided, one temperature per batch row)."""
    g = torch.Generator().manual_seed(V)
    B, k = 3, 5
    base = (torch.randn(B, 2, V, generator=g) * 4)[:, 1]
    bias = None if bias_dtype is None else (torch.randn(B, W, V, generator=g) * 3).to(bias_dtype)
    t = torch.tensor([1.0, 0.7, 1.6])
    for temps in (None, t):
        q, i = ops.softmax_topk(base, bias, temps, k)
        logits = base.unsqueeze(1) if bias is None else base.unsqueeze(1) + bias.float()
        want_q, want_i = torch.softmax(logits if temps is None else logits / temps.view(B, 1, 1), -1).topk(k, -1)
        assert q.shape == i.shape == (B, 1 if bias is None else W, k)
        assert torch.equal(i, want_i)
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-7)
    # ties go to the lower index
    flat = torch.zeros(1, 64)
    flat[0, [9, 3, 40]] = 1.0
    assert ops.softmax_topk(flat, None, None, 2)[1].tolist() == [[[3, 9]]]


@needs_ext
@pytest.mark.parametrize("n", [64, 100, 576, 1536, 2048])
def test_norm_ops_equal_rms_norm_bit_for_bit(n):
    g = torch.Generator().manual_seed(n)
    vec = cpu_ops.norm_vec_width()
    norm = RMSNorm(n, 1e-5, torch.bfloat16)
    norm.weight.data = torch.randn(n, generator=g).to(torch.bfloat16)
    def formula(t):  # RMSNorm's PyTorch path
        return norm.weight * F.rms_norm(t, (n,), None, norm.eps)

    for rows in (1, 3, 16, 300):
        res = (torch.randn(1, rows, n, generator=g) * 3).to(torch.bfloat16)
        x = (torch.randn(1, rows, n, generator=g) * torch.rand(1, rows, 1, generator=g) * 5).to(torch.bfloat16)
        new_res, normed = ops.add_rms_norm(res, x, norm.weight, norm.eps, vec)
        assert torch.equal(new_res, res + x)
        assert torch.equal(normed, formula(res + x))
        assert torch.equal(ops.rms_norm(x, norm.weight, norm.eps, vec), formula(x))
        assert torch.equal(norm(x), formula(x))  # RMSNorm itself (through the op where it runs)
        # each row alone gives its bits in the batch
        whole = ops.rms_norm(x, norm.weight, norm.eps, vec)
        assert torch.equal(ops.rms_norm(x[:, :1], norm.weight, norm.eps, vec), whole[:, :1])


@needs_ext
def test_rms_norm_heads_through_the_op_keeps_the_bits():
    """``rms_norm_heads`` (the DSpark drafter's q/k norms: a weight row per head) through the C++ norm
    op against its PyTorch formula, bit for bit, on a slice of a wider tensor (as the fused q/k/v
    projection gives it) and with one weight row for all heads."""
    from specserve.layers.norm import rms_norm_heads

    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(2, 7, 15, 64, generator=g) * torch.rand(2, 7, 15, 1, generator=g) * 4).to(torch.bfloat16)
    w = torch.randn(12, 64, generator=g).to(torch.bfloat16)
    x = qkv[:, :, :12]
    want = w * F.rms_norm(x, (64,), None, 1e-6)
    assert torch.equal(rms_norm_heads(x, w, 1e-6), want)
    assert torch.equal(ops.rms_norm(x, w[:1].expand(12, 64), 1e-6, cpu_ops.norm_vec_width()),
                       w[0] * F.rms_norm(x, (64,), None, 1e-6))
    with pytest.raises(RuntimeError, match="weight size"):
        ops.rms_norm(x, w[:5], 1e-6, cpu_ops.norm_vec_width())


@needs_ext
def test_silu_mul_equals_torch_for_every_bfloat16_gate():
    """The decoder layer's silu(gate) * up against torch's ``F.silu`` then ``mul`` for all 65,536 bfloat16
    bit patterns of the gate (NaNs, infinities and denormals included), alone and among other rows."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(64, 1024)
    up = (torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    up[::7] = every[::7].flip(1)
    got = ops.silu_mul(torch.cat([every, up], 1), 1024)
    want = torch.mul(F.silu(every), up)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.view(torch.int16)[~got.isnan()], want.view(torch.int16)[~want.isnan()])
    assert torch.equal(ops.silu_mul(torch.cat([every[5:6], up[5:6]], 1), 1024), got[5:6])


@needs_ext
@pytest.mark.parametrize("n", [1, 15, 16, 63, 64, 65, 130, 49152])
def test_argmax_equals_torch_argmax(n):
    """``cpu_ops.argmax`` (the greedy token of every verification) against ``torch.argmax``: the first of
    equal maxima wherever they fall (a lane, a block of 64, the tail), the first NaN, rows of -inf, -0.0
    beside 0.0, rows read through a stride (a slice of longer rows)."""
    g = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=g), torch.randint(0, 3, (n,), generator=g).float(),
            torch.full((n,), float("-inf")), torch.zeros(n)]
    for at in sorted({0, n // 3, n // 2, n - 1}):
        r = torch.randn(n, generator=g)
        r[at] = float("nan")
        rows.append(r)
        r = torch.randn(n, generator=g)
        r[at] = r.max() + 1
        r[(at * 7 + 5) % n :] = r[at]  # equal maxima after the first
        rows.append(r)
        r = torch.zeros(n)
        r[at] = -0.0
        rows.append(r)
    x = torch.stack(rows)
    assert torch.equal(cpu_ops.argmax(x), x.argmax(-1))
    assert torch.equal(cpu_ops.argmax(x[3]), x[3].argmax(-1))
    wide = torch.cat([x, torch.full((len(rows), 5), 1e30)], 1).view(1, len(rows), n + 5)[..., :n]  # strided
    assert torch.equal(cpu_ops.argmax(wide), x.argmax(-1).view(1, -1))


@needs_ext
@pytest.mark.parametrize("calibrated", [False, True])
def test_ranked_scores_op_equals_its_pytorch_path(monkeypatch, calibrated):
    """``cost_model.ranked_scores`` (the ranking of a step's draft nodes: Medusa's paths, DSpark's tree)
    through the C++ op and through PyTorch: the same scores bit for bit in the same order. Scores above
    1 after scaling, excluded nodes (< 0), nodes deeper than a row's limit, equal scores (index order),
    a NaN; the calibration started once a step either way."""
    from specserve.spec_decode.cost_model import AcceptanceCalibration, ranked_scores, sampling_key

    g = torch.Generator().manual_seed(7)
    B, N, D = 3, 64, 4
    depth = torch.randint(1, D + 1, (N,), generator=g).sort().values
    scores = torch.rand(B, N, generator=g) ** 3
    scores[0, 5:12] = scores[0, 4]  # equal scores
    scores[1, 3] = -1.0  # an excluded node
    scores[1, 9] = float("nan")
    scores[2, :] = torch.tensor([0.5, 0.25]).repeat(N // 2)
    seqs = [SimpleNamespace(seq_id=i, params=SimpleNamespace(greedy=i != 1, temperature=0.7, top_k=0, top_p=1.0,
                                                             min_p=0.0)) for i in range(B)]
    limits = [D, 2, 3]

    def calibration():
        if not calibrated:
            return None
        cal = AcceptanceCalibration(D)
        for s in seqs[:2]:  # a greedy and a sampled setting, each predicted off by a factor per depth
            for _ in range(6):
                cal.begin_step([sampling_key(s.params)])
                cal.expect(s.seq_id, sampling_key(s.params), [0.9, 0.3, 0.2, 0.1] if s.params.greedy else [0.2] * 4)
                cal.observe(s.seq_id, 3)
        return cal

    fast_cal, slow_cal = calibration(), calibration()
    fast = ranked_scores(fast_cal, seqs, scores, depth, limits)
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    slow = ranked_scores(slow_cal, seqs, scores, depth, limits)
    assert torch.equal(fast[1], slow[1])
    assert torch.equal(fast[0].isnan(), slow[0].isnan())
    assert torch.equal(fast[0].nan_to_num(), slow[0].nan_to_num())
    assert fast[1][1, 0] == 9  # NaN first, as torch sorts it
    assert (fast[0][1][depth[fast[1][1]] > 2] == -1).all()
    assert (fast[0].nan_to_num() <= 1).all()
    if calibrated:
        assert fast_cal._stats == slow_cal._stats  # each path started the step once
        assert not torch.equal(fast[0][0], scores[0].sort(descending=True, stable=True).values)  # it scaled


@needs_ext
def test_rms_norm_module_differentiates_through_its_pytorch_path(monkeypatch):
    """A bfloat16 RMSNorm computes through the C++ op only where nothing is differentiated (the op has no
    backward): under autograd it takes its PyTorch path and the gradient flows."""
    calls = []
    real = ops.rms_norm
    monkeypatch.setattr(cpu_ops, "active", lambda: SimpleNamespace(rms_norm=lambda *a: calls.append(1) or real(*a)))
    norm = RMSNorm(64, 1e-5, torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = norm(x)
    assert calls == [1]
    xg = x.clone().requires_grad_(True)
    got = norm(xg)
    assert calls == [1] and torch.equal(got.detach(), want)
    got.float().sum().backward()
    assert xg.grad is not None and bool(xg.grad.abs().sum() > 0)


def test_fallback_is_taken_under_SPECSERVE_NO_EXT():
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from specserve.layers import cpu_ops\n"
        "from specserve.layers.attention import Attention\n"
        "assert cpu_ops.get() is None and cpu_ops.active() is None\n"
        "a = Attention(0, 4, 2, 16)\n"
        "assert a._ops(torch.zeros(1, 1, 4, 16), None) is None\n"
        "print('fallback ok')\n"
    )
    env = dict(os.environ, SPECSERVE_NO_EXT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fallback ok" in out.stdout and "SPECSERVE_NO_EXT" in out.stderr


def test_build_lock_outlives_a_killed_build(tmp_path, caplog):
    """A build killed mid-way (Ctrl-C in its ~40 s) leaves torch's ``lock`` file, on which every later load
    would wait forever: ``cpu_ops.build_lock`` (held around every build or load) removes it, and its own lock
    is the kernel's, so a holder killed with SIGKILL frees it at once."""
    import fcntl
    import time

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, pathlib\nfrom specserve.layers import cpu_ops\n"
         f"with cpu_ops.build_lock(pathlib.Path({str(tmp_path)!r})):\n"
         "    (pathlib.Path(sys.argv[1]) / 'lock').touch(); print('in', flush=True); time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "in"
        with open(tmp_path / "specserve.lock", "a") as f:  # held: another process cannot take it
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "lock").exists()  # what torch's loader would wait on
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"), cpu_ops.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.perf_counter() - t0 < 5 and "did not finish" in caplog.text
