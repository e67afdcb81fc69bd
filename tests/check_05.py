"""What this proves beyond 05's lesson, on the world and on a strided sub-group whose group rank is not the global
rank ({0, 2, ..} and {1, 3, ..}), from non-contiguous inputs, in float64 (integer values: exact) and bf16:
- the seven mappings: forward and backward == their closed forms, <op(x), dy> == <x, op_backward(dy)>, and each
  issues its collective on its group, handing in the tensor its docstring names; scatters hand back contiguous slices;
- ColumnParallelLinear and RowParallelLinear with every option (gather_output, input_is_parallel, sequence_parallel,
  check_slices; SP on [s, b, h] and on batch-first [b, s, h], sequence_dim=1) == nn.Linear, with the collectives each
  issues; the row bias is added once, after the all-reduce;
- the MLP (GELU and SwiGLU, with and without biases, [s, b, h] and [b, s, h]) and attention (nn.MultiheadAttention's,
  nanoGPT's, GQA at 1, 2 (no biases), 4 and 8 K/V heads against the repeat-interleaved reference, batch-first or not),
  TP and SP: == dense forward and backward, the bytes on the wire == the closed forms (replicated K/V heads: one
  all-reduce more, of their grads), parameter bytes per rank, every gradient contiguous; bf16 within 2**-6 of the
  dense bf16 modules; at 8 ranks the world only, and only the blocks whose K/V heads replicate there, with the MLP
  (both layouts);
- fused_shard's rows, index by index; [gate; up] split as it lies is wrong;
- bytes saved for backward (tests.tools.kept_for_backward): MLP TP V + 2A, SP V/p + 2A; attention V - V/p less;
  batch-first SP (sequence_dim=1) keeps the same bytes and makes exactly one layout copy of a slice more each way;
- the SP slice check: one 64-B all-gather a call (none with check_slices=False), unequal slices refused on every rank;
- (at 1, 2, 4 ranks) nanoGPT's own modules; bf16; dW in W.grad in a plain model (torch.optim.SGD moves the SP
  weight exactly as the dense one), and the main_grad handshake as a data-parallel wrapper drives it: fused, tied
  (zero_out_wgrad), declined, a bf16 weight with an fp32 main_grad, a replicated K/V layer (the layer declines,
  the wrapper adds W.grad); TP x DP groups from tp_dp_groups: members, sums, DP-averaged TP grads == dense;
- sequence_dim: 0 and 1 pass, 2, -1 and non-ints refused at construction; a 2-dim x with sequence_dim=1 refused at
  the call (column and row), as qkv and proj of different layouts in one attention;
- every refusal a block makes at its boundary: the last valid value passes, the first invalid one is refused in one
  line (before any message where the block can tell alone), on every rank.
"""
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import (finish, head, launched_world_size, log, log_all, pg_timeout, refuse, ring_bytes, setup,  # noqa
                    traffic)
from tests.tools import kept_for_backward, lesson, refused, strided_groups  # noqa: E402

m = lesson("05_tp_layers.py")
HIDDEN, HEADS, FFN, BATCH, SEQ = m.HIDDEN, m.HEADS, m.FFN, m.BATCH, m.SEQ
D = HIDDEN // HEADS  # head dim
SEQ_DIM = 0          # Megatron's [s, b, h]: SP splits dim 0
F64 = torch.float64
HEADER = 8 * 8       # the SP column layer's slice check: an all-gather of 8 int64 on every call
BF16_TOL = 2 ** -6   # rtol and atol in bf16: 2 units in the last place at 1 (bf16 keeps 8 significant bits)


def ints(seed, *shape, device, dtype=F64):
    """The same integer-valued tensor on every rank (exact sums in float64), as a non-contiguous view."""
    wide = torch.randint(-9, 10, (*shape[:-1], 2 * shape[-1]), generator=torch.Generator().manual_seed(seed))
    return wide.to(device, dtype)[..., ::2]


def leaf(t):
    """A tensor that requires grad, with t's values, stored non-contiguously (every second element)."""
    return t.new_zeros((*t.shape[:-1], 2 * t.shape[-1]))[..., ::2].copy_(t).requires_grad_()


def members(group):
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def part(t, dim, group, rank=None):
    """Global rank `rank`'s (default: this rank's) slice of t along dim among group's members: the check's own
    reference, independent of the blocks' helpers."""
    ranks = members(group)
    return t.chunk(len(ranks), dim)[ranks.index(dist.get_rank() if rank is None else rank)]


def fused_rows(rows, fused, group):
    """The dense rows this rank must hold of a fused projection of `rows` rows (piece i: fused[i] units), by the
    rule written out: units [r n/p, (r+1) n/p) of each piece, or unit r n // p where p > n (replicated)."""
    p, r, unit = len(members(group)), members(group).index(dist.get_rank()), rows // sum(fused)
    out, start = [], 0
    for n in fused:
        units = range(r * n // p, (r + 1) * n // p) if n >= p else [r * n // p]
        out += [start + u * unit + j for u in units for j in range(unit)]
        start += n * unit
    return out


def shard_of(layer, t, bias=False):
    """What `layer` should hold of a dense weight or bias (or gradient) t: the check's own reference."""
    if layer.fused:
        return t[fused_rows(t.shape[0], layer.fused, layer.group)]
    if isinstance(layer, m.RowParallelLinear):
        return t if bias else part(t, 1, layer.group)
    return part(t, 0, layer.group)


def wire(t, p):
    """Bytes this rank puts on the wire for what traffic() counted, p ranks per group: common.ring_bytes of each
    collective (an all-gather's V is its output, p x what this rank hands in)."""
    return sum(ring_bytes(name, p * b if name == "all_gather" else b, p) for name, _, b in t.calls)


def names(t):
    return [name for name, _, _ in t.calls]


# ---- the mappings --------------------------------------------------------------------------------------------
def check_op(op, group, x, dy, want_y, want_dx, replicated, comms):
    """The adjoint test <op(x), dy> == <x, op_backward(dy)> (a replicated tensor is ONE value, its inner product
    counted once; a sharded or partial-sum tensor's is summed over the group), op's forward and backward values,
    and the collectives it issued: [(name, bytes handed in)], all on `group`."""
    x = leaf(x)
    with traffic() as t:
        y = op(x, group)
        (dx,) = torch.autograd.grad(y, x, dy)
    inner = [(a * b).sum().detach() for a, b in ((x, dx), (y, dy))]  # replicated: (x's, y's)
    for s, rep in zip(inner, replicated):
        if not rep:
            dist.all_reduce(s, group=group)
    assert torch.equal(*inner), (op, inner)
    assert torch.equal(y, want_y) and torch.equal(dx, want_dx), op
    ranks = tuple(members(group))
    assert t.calls == [(name, ranks, nbytes) for name, nbytes in comms if len(ranks) > 1], (op, t.calls)


def mappings(groups, device):
    head("the seven mappings: closed forms, adjoints, traffic, on the world and the strided groups")
    world, rank = dist.get_world_size(), dist.get_rank()
    X = [ints(s, SEQ, BATCH, HIDDEN, device=device) for s in range(world)]         # rank s's own input
    # rank s's own output grad, contiguous: the caller's tensor, which f's backward must not all-reduce in place
    DY = [ints(100 + s, SEQ, BATCH, HIDDEN, device=device).contiguous() for s in range(world)]
    A, B = ints(1000, SEQ, BATCH, HIDDEN, device=device), ints(1001, SEQ, BATCH, HIDDEN, device=device)  # alike
    x, dy = X[rank], DY[rank]
    for group in groups:
        ranks = members(group)
        sum_x, sum_dy = sum(X[s] for s in ranks), sum(DY[s] for s in ranks)
        feat, seq = (lambda t: part(t, -1, group)), (lambda t: part(t, SEQ_DIM, group))
        every = lambda T, dim: torch.cat([part(T[s], dim, group, s) for s in ranks], dim)  # member s's slice s
        cases = (
            # f: A -> A;  backward: DY[r] -> the group's sum
            (m.copy_to_tensor_model_parallel_region, A, dy, A, sum_dy, (True, False), [("all_reduce", dy)]),
            # g: X[r] -> the group's sum;  backward: B -> B
            (m.reduce_from_tensor_model_parallel_region, x, B, sum_x, B, (False, True), [("all_reduce", x)]),
            # scatter: A -> A's slice r of the last dim;  backward: DY[r]'s slice r -> every member's, joined
            (m.scatter_to_tensor_model_parallel_region, A, feat(dy), feat(A), every(DY, -1), (True, False),
             [("all_gather", feat(dy))]),
            # gather: X[r]'s slice r -> every member's, joined;  backward: B -> B's slice r
            (m.gather_from_tensor_model_parallel_region, feat(x), B, every(X, -1), feat(B), (False, True),
             [("all_gather", feat(x))]),
            # SP gather: X[r]'s part r of s -> every member's, joined;  backward: DY[r] -> part r of the sum
            (m.gather_from_sequence_parallel_region, seq(x), dy, every(X, SEQ_DIM), seq(sum_dy), (False, False),
             [("all_gather", seq(x)), ("reduce_scatter", dy)]),
            # SP reduce-scatter: X[r] -> part r of the sum;  backward: DY[r]'s part r -> every member's, joined
            (m.reduce_scatter_to_sequence_parallel_region, x, seq(dy), seq(sum_x), every(DY, SEQ_DIM),
             (False, False), [("reduce_scatter", x), ("all_gather", seq(dy))]),
            # SP scatter: A -> A's part r of s;  backward: DY[r]'s part r -> every member's, joined
            (m.scatter_to_sequence_parallel_region, A, seq(dy), seq(A), every(DY, SEQ_DIM), (True, False),
             [("all_gather", seq(dy))]))
        for op, x_in, dy_in, want_y, want_dx, replicated, comms in cases:
            check_op(op, group, x_in, dy_in, want_y, want_dx, replicated, [(n, t.nbytes) for n, t in comms])
        assert all(op(A, group).is_contiguous() for op in (m.scatter_to_sequence_parallel_region,
                                                            m.scatter_to_tensor_model_parallel_region))  # A strided
    log("f, g, scatter, gather, SP's gather, reduce-scatter, scatter: closed forms, adjoints, one collective each on "
        "its group of the bytes named; scatters hand back contiguous slices")


# ---- layers and blocks against dense ------------------------------------------------------------------------
def check_against_dense(dense_fn, parallel, x, dy, group, pairs, x_dim=None, y_dim=None, tol=None):
    """Forward, then backward from dy: the output, the input grad, and each (parallel layer, dense weight, dense
    bias) in pairs(): its grads == the dense grads' shard_of (check's own reference); every grad contiguous (autograd's
    layout). x_dim / y_dim: the dim along which the parallel input / output is this rank's slice (None: whole).
    Returns traffic() of the parallel step."""
    cut = lambda t, dim: t if dim is None else part(t, dim, group)
    x_p, x = leaf(cut(x, x_dim)), leaf(x)
    with traffic() as t:
        y_p = parallel(x_p)
        y_p.backward(cut(dy, y_dim))
    m.allreduce_sequence_parallel_grads(parallel.parameters(), group)
    y = dense_fn(x)
    y.backward(dy)
    close = (lambda a, b: torch.testing.assert_close(a, b, rtol=tol, atol=tol)) if tol else torch.testing.assert_close
    close(y_p, cut(y, y_dim))
    close(x_p.grad, cut(x.grad, x_dim))
    for layer, weight, bias in pairs():
        close(layer.weight.grad, shard_of(layer, weight.grad))
        if bias is not None:
            close(layer.bias.grad, shard_of(layer, bias.grad, bias=True))
    assert all(p.grad.is_contiguous() for p in parallel.parameters()), "a grad not in autograd's layout"
    assert all(ranks == tuple(members(group)) for _, ranks, _ in t.calls), t.calls
    return t


def linear_layers(groups, device):
    head("ColumnParallelLinear and RowParallelLinear, every option, against nn.Linear")
    torch.manual_seed(1)
    dense = nn.Linear(HIDDEN, FFN, device=device, dtype=F64)
    x, dy = ints(2, SEQ, BATCH, HIDDEN, device=device), ints(3, SEQ, BATCH, FFN, device=device)
    S = "s"    # the sequence's dim: 0 of [s, b, h], 1 of batch-first [b, s, h] (sequence_dim=1)
    cases = (  # class, options, x_dim, y_dim, the collectives issued forward then backward
        (m.ColumnParallelLinear, {"gather_output": True}, None, None, ["all_gather", "all_reduce"]),
        (m.RowParallelLinear, {"input_is_parallel": False}, None, None, ["all_reduce", "all_gather"]),
        (m.ColumnParallelLinear, {}, None, -1, ["all_reduce"]),
        (m.RowParallelLinear, {}, -1, None, ["all_reduce"]),
        (m.ColumnParallelLinear, {"sequence_parallel": True}, S, -1,
         ["all_gather", "all_gather", "all_gather", "reduce_scatter"]),               # the slice check first
        (m.ColumnParallelLinear, {"sequence_parallel": True, "check_slices": False}, S, -1,
         ["all_gather", "all_gather", "reduce_scatter"]),
        (m.RowParallelLinear, {"sequence_parallel": True}, -1, S, ["reduce_scatter", "all_gather"]),
        (m.ColumnParallelLinear, {"sequence_parallel": True, "gather_output": True}, S, None,
         ["all_gather", "all_gather", "all_gather", "all_gather", "reduce_scatter"]),
        (m.RowParallelLinear, {"sequence_parallel": True, "input_is_parallel": False}, None, S,
         ["reduce_scatter", "all_gather", "all_gather"]))
    runs = 0
    for group in groups:
        for seq in (0, 1):                                        # [s, b, h], then batch-first [b, s, h]
            xs, dys = (x, dy) if seq == 0 else (x.transpose(0, 1), dy.transpose(0, 1))
            for cls, options, x_dim, y_dim, comms in cases:
                if seq and not options.get("sequence_parallel"):    # without SP the layout is the user's own
                    continue
                dense.zero_grad()
                layer = cls.from_dense(dense, group, **options, sequence_dim=seq)
                x_dim, y_dim = (seq if d == S else d for d in (x_dim, y_dim))
                t = check_against_dense(dense, layer, xs, dys, group, lambda: [(layer, dense.weight, dense.bias)],
                                        x_dim, y_dim)
                assert names(t) == (comms if dist.get_world_size(group) > 1 else []), (cls, options, t.calls)
                runs += 1
    world = dist.get_world_size()
    row = m.RowParallelLinear.from_dense(dense)
    bias_inside = m._reduce(F.linear(part(x, -1, None), row.weight, row.bias), None)  # the bias added before g
    torch.testing.assert_close(bias_inside - dense(x), (world - 1) * dense.bias.expand_as(bias_inside))
    log(f"{len(cases)} layer variants == nn.Linear on both groups, each its collectives, the SP ones on [s, b, h] and "
        f"on [b, s, h] (sequence_dim=1): {runs} runs; the row bias added once (before the all-reduce it would count "
        f"{world} times)")


def dense_mlp(seed, device, dtype=F64, gated=False, bias=True, batch_first=False):
    """A dense MLP as (forward, parallel maker, pairs, batch_first, K/V heads): GELU Sequential, or SwiGLU's three
    matrices (gate, up, down), whose parallel version is built from their fused copy [gate; up] (fn.fused).
    batch_first: the parallel MLP takes [b, s, h] (sequence_dim=1); the dense one is the same, position-wise."""
    seq = int(batch_first)
    torch.manual_seed(seed)
    lin = lambda i, o: nn.Linear(i, o, bias=bias, device=device, dtype=dtype)
    if not gated:
        mlp = nn.Sequential(lin(HIDDEN, FFN), nn.GELU(), lin(FFN, HIDDEN))
        return (mlp, lambda **kw: m.parallel_mlp(mlp, sequence_dim=seq, **kw),
                lambda par: [(par[0], mlp[0].weight, mlp[0].bias), (par[2], mlp[2].weight, mlp[2].bias)], batch_first,
                HEADS)
    gate, up, down, fused = lin(HIDDEN, FFN), lin(HIDDEN, FFN), lin(FFN, HIDDEN), lin(HIDDEN, 2 * FFN)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([gate.weight, up.weight]))
        if bias:
            fused.bias.copy_(torch.cat([gate.bias, up.bias]))
    cat = SimpleNamespace(weight=SimpleNamespace(grad=None), bias=SimpleNamespace(grad=None) if bias else None)

    def pairs(par):                               # the dense grads of gate and up, fused as [gate; up]
        cat.weight.grad = torch.cat([gate.weight.grad, up.weight.grad])
        if bias:
            cat.bias.grad = torch.cat([gate.bias.grad, up.bias.grad])
        return [(par[0], cat.weight, cat.bias), (par[2], down.weight, down.bias)]
    fn = lambda x: down(F.silu(gate(x)) * up(x))
    fn.zero_grad, fn.fused = lambda: [t.zero_grad() for t in (gate, up, down)], fused
    return (fn, lambda **kw: m.parallel_mlp((fused, nn.SiLU(), down), gated=True, sequence_dim=seq, **kw), pairs,
            batch_first, HEADS)


def mha_attention(seed, device, dtype=F64):
    """nn.MultiheadAttention (causal, [s, b, h]) as the dense reference, and a nanoGPT-style shell around its own
    parameters (c_attn's weight IS in_proj_weight) for ParallelSelfAttention.from_dense."""
    torch.manual_seed(seed)
    mha = nn.MultiheadAttention(HIDDEN, HEADS, device=device, dtype=dtype)
    c_attn = nn.Linear(HIDDEN, 3 * HIDDEN, device="meta")
    c_attn.weight, c_attn.bias = mha.in_proj_weight, mha.in_proj_bias
    shell = SimpleNamespace(c_attn=c_attn, c_proj=mha.out_proj, n_head=HEADS)
    causal = nn.Transformer.generate_square_subsequent_mask(SEQ, device=device, dtype=dtype)
    fn = lambda x: mha(x, x, x, need_weights=False, attn_mask=causal, is_causal=True)[0]
    fn.zero_grad = mha.zero_grad
    make = lambda **kw: m.ParallelSelfAttention.from_dense(shell, sequence_dim=0, **kw)
    pairs = lambda par: [(par.qkv, c_attn.weight, c_attn.bias), (par.proj, mha.out_proj.weight, mha.out_proj.bias)]
    return fn, make, pairs, False, HEADS


def gqa_attention(seed, n_kv, device, dtype=F64, batch_first=True, bias=True):
    """A nanoGPT-style GQA attention module (fused c_attn [q; k; v], c_proj) and its reference forward written with
    repeat_interleave (each K/V head copied to the H/n_kv query heads that read it), not SDPA's enable_gqa."""
    torch.manual_seed(seed)
    c_attn = nn.Linear(HIDDEN, (HEADS + 2 * n_kv) * D, bias=bias, device=device, dtype=dtype)
    c_proj = nn.Linear(HIDDEN, HIDDEN, bias=bias, device=device, dtype=dtype)
    user = SimpleNamespace(c_attn=c_attn, c_proj=c_proj, n_head=HEADS, n_kv_head=n_kv, dropout=0.0)

    def fn(x):                                            # [b, s, h] (batch_first) or [s, b, h]
        x = x if batch_first else x.transpose(0, 1)
        q, k, v = c_attn(x).split([HEADS * D, n_kv * D, n_kv * D], -1)
        q, k, v = (t.unflatten(-1, (-1, D)).transpose(1, 2) for t in (q, k, v))            # [b, heads, s, d]
        k, v = (t.repeat_interleave(HEADS // n_kv, dim=1) for t in (k, v))
        y = c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        return y if batch_first else y.transpose(0, 1)
    fn.zero_grad = lambda: (c_attn.zero_grad(), c_proj.zero_grad())
    make = lambda **kw: m.ParallelSelfAttention.from_dense(user, sequence_dim=int(batch_first), **kw)
    pairs = lambda par: [(par.qkv, c_attn.weight, c_attn.bias), (par.proj, c_proj.weight, c_proj.bias)]
    return fn, make, pairs, batch_first, n_kv


def cases(device, dtype=F64, only=None):
    """The lesson's blocks (those named, default all), each as dense_mlp returns it."""
    every = {"MLP": lambda: dense_mlp(2, device, dtype), "SwiGLU": lambda: dense_mlp(3, device, dtype, gated=True),
             "SwiGLU without biases": lambda: dense_mlp(3, device, dtype, gated=True, bias=False),
             "MLP, [b, s, h]": lambda: dense_mlp(2, device, dtype, batch_first=True),
             "SwiGLU without biases, [b, s, h]": lambda: dense_mlp(3, device, dtype, gated=True, bias=False,
                                                                   batch_first=True),
             "MHA": lambda: mha_attention(2, device, dtype)}
    every.update({f"GQA, {n} K/V heads{', [s, b, h]' * (n == 4)}{', no biases' * (n == 2)}":
                  (lambda n=n: gqa_attention(6 + n, n, device, dtype, n != 4, n != 2)) for n in (1, 2, 4, 8)})
    return [(name, make()) for name, make in every.items()
            if only is None or name in only or name.split(",")[0] in only]


def blocks(groups, device, only=None):
    head("the MLP and attention blocks, TP and SP, against dense (integer values in float64: exact)")
    run = cases(device, only=only)
    x, dy = ints(4, SEQ, BATCH, HIDDEN, device=device), ints(5, SEQ, BATCH, HIDDEN, device=device)
    V = x.numel() * x.element_size()
    for sp in (False, True):
        # TP: one all-reduce each way; SP: the slice check, all-gather, reduce-scatter forward, all-gather (row),
        # all-gather again and reduce-scatter (column) backward
        comms = ["all_gather"] * 2 + ["reduce_scatter", "all_gather", "all_gather", "reduce_scatter"] if sp else \
            ["all_reduce"] * 2
        for name, (fn, make, pairs, batch_first, n_kv) in run:
            xx, dd = (x.transpose(0, 1), dy.transpose(0, 1)) if batch_first else (x, dy)
            seq_dim = (1 if batch_first else SEQ_DIM) if sp else None
            for group in groups if name in ("MLP", "MLP, [b, s, h]", "MHA", "GQA, 1 K/V heads") else groups[:1]:
                p = dist.get_world_size(group)
                fn.zero_grad()
                par = make(group=group, sequence_parallel=sp)
                t = check_against_dense(fn, par, xx, dd, group, lambda: pairs(par), seq_dim, seq_dim)
                replicated = n_kv < p
                has_bias = pairs(par)[0][2] is not None
                kv_bytes = 2 * n_kv * D * (HIDDEN + has_bias) * F64.itemsize   # K and V rows: weight (and bias)
                assert names(t) == ((comms + ["all_reduce"] * replicated) if p > 1 else []), (name, sp, t.calls)
                if replicated:                                # one all-reduce more: the replicated K/V grads
                    assert t.calls[-1][2] == kv_bytes, (name, t.calls)
                assert t.calls[:sp] == [("all_gather", tuple(members(group)), HEADER)][:sp * (p > 1)], t.calls
                extra = ring_bytes("all_reduce", kv_bytes, p) if replicated else 0
                assert wire(t, p) == (4 + sp) * (p - 1) * V / p + sp * (p - 1) * HEADER + extra, (name, t.calls)
                per_rank = sum(q.nbytes for q in par.parameters())
                whole = sum(w.grad.nbytes + (0 if b is None else b.grad.nbytes) for _, w, b in pairs(par))
                row_bias = HIDDEN * F64.itemsize if pairs(par)[-1][2] is not None else 0   # whole on every rank
                assert p * per_rank == whole + (p - 1) * row_bias + replicated * (p - n_kv) * kv_bytes // n_kv, \
                    (name, per_rank, whole)                   # a replicated K/V head: held p/n_kv times
    p = dist.get_world_size()
    log(f"{'; '.join(name for name, _ in run)}: == dense, TP and SP (MLP, MHA, 1-K/V-head GQA on the sub-group "
        f"too); on the wire (4 + sp) ({p}-1)/{p} V (+ {p}-1 headers, + an all-reduce of replicated K/V grads); "
        f"parameter bytes per rank")


def nanogpt_modules(device):
    head("nanoGPT's own CausalSelfAttention and MLP (tests/nanogpt.py), batch-first, TP and SP")
    from tests.nanogpt import MLP, CausalSelfAttention, GPTConfig
    torch.manual_seed(11)
    cfg = GPTConfig(block_size=SEQ, n_head=HEADS, n_embd=HIDDEN)
    attn, mlp = CausalSelfAttention(cfg).to(device, F64), MLP(cfg).to(device, F64)
    x, dy = ints(12, BATCH, SEQ, HIDDEN, device=device), ints(13, BATCH, SEQ, HIDDEN, device=device)   # [b, s, h]
    for sp in (False, True):
        attn.zero_grad()
        par = m.ParallelSelfAttention.from_dense(attn, sequence_parallel=sp)
        check_against_dense(attn, par, x, dy, None, lambda: [(par.qkv, attn.c_attn.weight, attn.c_attn.bias),
                                                             (par.proj, attn.c_proj.weight, attn.c_proj.bias)],
                            1 if sp else None, 1 if sp else None)
        mlp.zero_grad()
        pm = m.parallel_mlp((mlp.c_fc, mlp.gelu, mlp.c_proj), sequence_parallel=sp, sequence_dim=1)
        check_against_dense(mlp, pm, x, dy, None,
                            lambda: [(pm[0], mlp.c_fc.weight, mlp.c_fc.bias), (pm[2], mlp.c_proj.weight,
                                                                                 mlp.c_proj.bias)],
                            1 if sp else None, 1 if sp else None)
    log("CausalSelfAttention (fused c_attn) via from_dense and MLP via parallel_mlp((c_fc, gelu, c_proj)) == the "
        "modules, TP and SP ([b, s/p, h]: sequence_dim=1, no transpose)")


def fused_layout(device):
    head("fused_shard: the rows each rank holds, index by index; a contiguous split of [gate; up] is wrong")
    world = dist.get_world_size()
    for group in (None, strided_groups()[dist.get_rank() % 2][0]):
        p = dist.get_world_size(group)
        for fused in [(HEADS, n, n) for n in (1, 2, 4, 8)] + [(FFN, FFN), (3 * p, p), (p,), (1, 2 * p)]:
            rows = sum(fused) * 3
            t = torch.arange(rows, device=device)
            want = torch.tensor(fused_rows(rows, fused, group), device=device)
            for shaped in (t, t[:, None].expand(rows, 5), t.double().requires_grad_()):   # bias, weight, a leaf
                got = m.fused_shard(shaped, fused, group)
                assert torch.equal(got if got.dim() == 1 else got[:, 0], want.to(got.dtype)), (fused, got)
                assert got.is_contiguous() and (got.dim() == 1 or torch.equal(got[:, 4], got[:, 0]))
    fn, make, *_ = dense_mlp(3, device, gated=True)
    x = ints(14, SEQ, BATCH, HIDDEN, device=device)
    swiglu = make()
    as_it_lies = nn.Sequential(m.ColumnParallelLinear.from_dense(fn.fused), swiglu[1], swiglu[2])
    torch.testing.assert_close(swiglu(x), fn(x))
    assert world == 1 or not torch.allclose(as_it_lies(x), fn(x))
    log("each rank holds exactly its units of every piece (heads, rows; replicated where p > n), contiguous; "
        f"[gate; up] split as it lies {'is wrong' if world > 1 else 'is right only at p = 1'}")


def activation_memory(device):
    """The MLP's saved activations, TP vs SP, in bytes: only fc1's input shrinks, to 1/p (fc1 keeps its slice
    and gathers it again in backward); fc1's and GeLU's outputs are [s, b, ffn/p] either way. (Not memory().live():
    gloo's worker threads let go of a finished collective's buffer a moment late, so it is not exact every run.)"""
    head("activation memory: what autograd saves, in bytes (tests.tools.kept_for_backward)")
    world = dist.get_world_size()
    fn, make, pairs, *_ = dense_mlp(2, device)
    x, dy = ints(4, SEQ, BATCH, HIDDEN, device=device), ints(5, SEQ, BATCH, HIDDEN, device=device)
    V, A = x.numel() * F64.itemsize, SEQ * BATCH * FFN // world * F64.itemsize   # [s, b, h], [s, b, ffn/p]
    got, att = {}, {}
    for sp in (False, True):
        par = make(sequence_parallel=sp)
        x_in = (part(x, SEQ_DIM, None) if sp else x).clone().requires_grad_()  # its own contiguous storage
        y, got[sp] = kept_for_backward(lambda: par(x_in), par.parameters(), [x_in])   # fc1 keeps x_in, no copy
        y.backward(part(dy, SEQ_DIM, None) if sp else dy)
        fn.zero_grad()
        fn(x).backward(dy)
        m.allreduce_sequence_parallel_grads(par.parameters())
        for layer, w, b in pairs(par):
            torch.testing.assert_close(layer.weight.grad, shard_of(layer, w.grad))
        layer = mha_attention(2, device)[1](sequence_parallel=sp)
        x_in = (part(x, SEQ_DIM, None) if sp else x).clone().requires_grad_()
        att[sp] = kept_for_backward(lambda: layer(x_in), layer.parameters(), [x_in])[1]
    assert got == {False: V + 2 * A, True: V // world + 2 * A}, got    # fc1's input, GeLU's, fc2's
    assert att[False] - att[True] == V - V // world, att    # QKV's input [s, b, h] -> [s/p, b, h]; the rest alike
    log(f"MLP: TP {got[False]} B = V + 2A, SP {got[True]} B = V/{world} + 2A (V = {V} B, A = {A} B); attention: "
        f"TP {att[False]} B, SP {att[True]} B, V - V/{world} less")


class LayoutCopies:
    """A dispatch mode that adds up the bytes of every layout copy (clone, copy_, _to_copy) made inside it."""
    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self

        class Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls):  # as common.traffic's: saves importing dynamo
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func._overloadpacket.__name__ in ("clone", "copy_", "_to_copy"):
                    counter.copies.append(out.nbytes)
                return out
        self.copies, self.mode = [], Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def batch_first_cost(device):
    """sequence_dim=1 next to Megatron's [s, b, h] (their values == dense: blocks, bfloat16): the layers compute in
    [s, b, ..] memory and hand [b, s, ..] views of it on, so a batch-first SP block (MLP, attention) makes ONE layout
    copy more each way, of one slice (its input into that memory forward, its output's grad backward), at every p:
    no transpose around each layer; and it keeps the same bytes for backward (that copy, not the caller's slice)."""
    head("sequence_dim=1: a batch-first SP block's layout copies and saved bytes, against [s, b, h]")
    world = dist.get_world_size()
    slice_bytes = SEQ // world * BATCH * HIDDEN * F64.itemsize
    copies, kept = {}, {}
    for seq in (0, 1):
        shape = (SEQ // world, BATCH, HIDDEN) if seq == 0 else (BATCH, SEQ // world, HIDDEN)
        for name, made in (("MLP", dense_mlp(2, device, batch_first=bool(seq))),
                           ("attention", gqa_attention(9, HEADS, device, batch_first=bool(seq)))):
            par = made[1](sequence_parallel=True)
            x_in, dy = (ints(s, *shape, device=device).contiguous() for s in (4, 5))     # the layout's own memory
            x_in.requires_grad_()
            with LayoutCopies() as fwd:                 # x_in * 1: an input that nothing but the block keeps
                y, kept[name, seq] = kept_for_backward(lambda: par(x_in * 1), par.parameters())
            with LayoutCopies() as bwd:
                torch.autograd.grad(y, x_in, dy)
            copies[name, seq] = (fwd.copies, bwd.copies)
    extra = (1, slice_bytes) if SEQ // world > 1 else (0, 0)     # one row a rank: [b, 1, h] is that memory already
    for name in ("MLP", "attention"):
        (f0, b0), (f1, b1) = copies[name, 0], copies[name, 1]
        assert (len(f1) - len(f0), sum(f1) - sum(f0)) == extra, (name, f0, f1)
        assert (len(b1) - len(b0), sum(b1) - sum(b0)) == extra, (name, b0, b1)
        assert kept[name, 1] == kept[name, 0], (name, kept)
    log(f"MLP and attention on [b, s/p, h]: {extra[0]} copy of {extra[1]} B (a slice) more forward and backward than "
        f"on [s/p, b, h] ({sum(copies['MLP', 0][0])} B there, the reduce-scatter's); bytes kept for backward equal "
        f"(MLP {kept['MLP', 1]} B, attention {kept['attention', 1]} B)")


def unequal_slices(sub, device):
    """The SP column layer's precondition, equal slices on every rank, checked on every call by one all-gather of
    a 64-B header: a rank whose length alone changes, or every rank's, raises one ValueError line on every rank
    instead of aborting gloo; check_slices=False issues nothing more than the layer's own all-gather."""
    head("the SP column layer's slice check: 64 B a call; unequal slices refused on every rank")
    world, rank = dist.get_world_size(), dist.get_rank()
    layer = m.ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=True, device=device, dtype=F64)
    x = torch.zeros(SEQ // world, BATCH, HIDDEN, device=device, dtype=F64)
    for check in (True, False):
        layer.check_slices = check
        with traffic() as t:
            layer(x)
            layer(x)
        want = ([("all_gather", HEADER)] * check + [("all_gather", x.nbytes)]) * 2 if world > 1 else []
        assert [(n, b) for n, _, b in t.calls] == want, (check, t.calls)
    layer.check_slices = True
    n, size = 2 + rank % 2, dist.get_world_size(sub)                      # each strided group its own length:
    layer_sub = m.ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=True, group=sub, device=device, dtype=F64)
    assert layer_sub(x.new_zeros(n, BATCH, HIDDEN)).shape == (size * n, BATCH, FFN // size)   # equal in each group
    n = SEQ // world
    for shapes in ([[n + (r == world - 1), BATCH, HIDDEN] for r in range(world)],    # the last rank's length alone
                   [[n + 1 + (r > 0), BATCH, HIDDEN] for r in range(world)],         # every rank's length
                   [[n * BATCH, 1, HIDDEN] if r == world - 1 else [n, BATCH, HIDDEN] for r in range(world)]):
        if world == 1:                                                    # the last: one numel, another shape
            break
        try:
            layer(torch.zeros(shapes[rank], device=device, dtype=F64))
            raise AssertionError(f"unequal slices {shapes} accepted")
        except ValueError as e:
            said = str(e)
            assert "\n" not in said and said.startswith(
                f"sequence-parallel slices differ across the group: shapes {shapes}; "), said
    y = layer(x)                                                          # equal again: the layer carries on
    assert y.shape == (SEQ, BATCH, FFN // world), y.shape
    log(f"a {HEADER}-B all-gather a call (check_slices=False: none); unequal slices (the last rank's length alone, "
        f"every rank's, one numel in another shape) refused in one line on every rank; equal in each sub-group passes")


def dw_and_main_grad(device):
    head("dW in W.grad (any torch optimizer); the main_grad handshake only where a wrapper asks for it")
    world = dist.get_world_size()
    x, dy = ints(4, SEQ, BATCH, HIDDEN, device=device), ints(5, SEQ, BATCH, HIDDEN, device=device)
    cut = lambda t: part(t, SEQ_DIM, None)

    # a plain model and torch.optim.SGD: W.grad set, no main_grad made, the step == the dense step
    mlp, make, pairs, *_ = dense_mlp(2, device)
    par = make(sequence_parallel=True)
    w0 = par[0].weight.detach().clone()
    par(cut(x)).backward(cut(dy))
    m.allreduce_sequence_parallel_grads(par.parameters())
    mlp(x).backward(dy)
    assert all(p.grad is not None and not hasattr(p, "main_grad") for p in par.parameters())
    for params in (par.parameters(), mlp.parameters()):
        torch.optim.SGD(params, lr=0.1, momentum=0.9).step()
    for layer, w, b in pairs(par):
        torch.testing.assert_close(layer.weight, shard_of(layer, w))
        torch.testing.assert_close(layer.bias, shard_of(layer, b, bias=True))
    assert not torch.equal(par[0].weight, w0)

    def wrapper(params, tied=None):
        """What a data-parallel wrapper does (09's, Megatron's): main_grad (fp32 or wider), the flag False, and
        Megatron's rule in the post-accumulate-grad hook. Returns the list of (is tied, flag) the hook saw."""
        fired = []

        def hook(p):
            fired.append((p is tied, p.grad_added_to_main_grad))
            if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False):
                p.main_grad.add_(p.grad)
            p.grad, p.grad_added_to_main_grad = None, False
        for p in params:
            p.main_grad = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
            p.grad_added_to_main_grad = False
            p.register_post_accumulate_grad_hook(hook)
        return fired

    # fused (the placeholder dropped), tied (zeros, the other use of W added), declined (W.grad added)
    mlp, make, pairs, *_ = dense_mlp(2, device)
    mlp(x).backward(dy)
    for tie, fusion in ((False, True), (True, True), (False, False)):
        par = make(sequence_parallel=True)
        par[0].gradient_accumulation_fusion, w = fusion, par[0].weight
        fired = wrapper(par.parameters(), w)
        other = ints(6, *w.shape, device=device)                       # the other use of W: <W, other>
        w.zero_out_wgrad = tie
        for _ in range(2):
            ((par(cut(x)) * cut(dy)).sum() + tie * (w * other).sum()).backward()
        m.allreduce_sequence_parallel_grads(par.parameters())          # reads the row bias's main_grad
        for layer, wd, bd in pairs(par):
            assert layer.weight.grad is None and layer.bias.grad is None
            tied = tie * other if layer is par[0] else 0                 # the other use's dW: other
            torch.testing.assert_close(layer.weight.main_grad, 2 * (shard_of(layer, wd.grad) + tied))
            torch.testing.assert_close(layer.bias.main_grad, 2 * shard_of(layer, bd.grad, bias=True))
        assert sorted(fired) == [(False, False)] * 6 + [(True, fusion)] * 2, fired     # each hook once a backward

    # bf16 W: a wrapper's fp32 main_grad takes the fused dW in fp32; without one, W.grad in bf16
    ones = torch.ones(SEQ // world, BATCH, HIDDEN, device=device, dtype=torch.bfloat16)
    for wrapped in (True, False):
        w16 = torch.zeros(FFN // world, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
        if wrapped:
            w16.main_grad, w16.grad_added_to_main_grad = torch.zeros_like(w16, dtype=torch.float32), False
        m.LinearWithSequenceParallel.apply(ones, w16).sum().backward()
        got = w16.main_grad if wrapped else w16.grad                  # dW = sum over s, b of 1 * 1: s * b
        assert got.dtype == (torch.float32 if wrapped else torch.bfloat16), got.dtype
        assert torch.equal(got, torch.full_like(got, SEQ * BATCH)), got
        assert w16.grad_added_to_main_grad if wrapped else not hasattr(w16, "main_grad")

    # a replicated K/V layer (GQA, 1 K/V head) under the wrapper: the layer declines, the hook adds W.grad
    fn, make, pairs, batch_first, n_kv = gqa_attention(20, 1, device)
    par = make(sequence_parallel=True)
    fired = wrapper(par.parameters(), par.qkv.weight)
    xb, dyb = x.transpose(0, 1), dy.transpose(0, 1)                   # [b, s, h]; SP splits s, dim 1
    par(part(xb, 1, None)).backward(part(dyb, 1, None))
    m.allreduce_sequence_parallel_grads(par.parameters())
    fn(xb).backward(dyb)
    for layer, wd, bd in pairs(par):
        torch.testing.assert_close(layer.weight.main_grad, shard_of(layer, wd.grad))
        torch.testing.assert_close(layer.bias.main_grad, shard_of(layer, bd.grad, bias=True))
    assert (True, world == 1) in fired, fired          # replicated (p > 1): declined, W.grad added by the hook
    log("plain model + SGD (momentum): every shard moves as the dense weight, no main_grad made; under a wrapper: "
        "fused, tied (zero_out_wgrad), declined, 2 micro-batches == dense; bf16 W: fp32 main_grad; "
        "replicated K/V: declined")


def bfloat16(device):
    head("bf16: every block, TP and SP, against the same dense modules in bf16")
    x, dy = (torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(s)).to(device, torch.bfloat16)
             for s in (6, 7))
    for name, (fn, make, pairs, batch_first, _) in cases(device, torch.bfloat16,
                                                         ("MLP", "MLP, [b, s, h]", "SwiGLU", "MHA",
                                                          "GQA, 2 K/V heads, no biases")):
        xx, dd = (x.transpose(0, 1), dy.transpose(0, 1)) if batch_first else (x, dy)
        for sp in (False, True):
            par = make(sequence_parallel=sp)
            seq = (1 if batch_first else SEQ_DIM) if sp else None
            cut = (lambda t: part(t, seq, None)) if sp else (lambda t: t)
            x_p, x_d = leaf(cut(xx)), leaf(xx)
            y_p = par(x_p)
            y_p.backward(cut(dd))
            y = fn(x_d)
            y.backward(dd)
            for got, want in [(y_p, y), (x_p.grad, x_d.grad)]:
                torch.testing.assert_close(got, cut(want), rtol=BF16_TOL, atol=BF16_TOL)
            assert all(p.grad.dtype == torch.bfloat16 for p in par.parameters()), name
    log("MLP ([s, b, h] and [b, s, h]), SwiGLU, MHA, GQA (2 K/V heads, no biases: replicated from p = 4), TP and SP, "
        "in bf16 (the collectives "
        "too): output and input grad == the dense bf16 modules' within rtol = atol = 2**-6; every grad bf16")


def tp_dp_grid(device):
    head("TP inside a 2-D grid: TP x DP process groups from tp_dp_groups")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = world // 2 if world >= 4 else world
    dp, dp_rank = world // tp, rank // tp
    tp_group, dp_group = m.tp_dp_groups(tp, timeout=pg_timeout())
    members_ = [members(g) for g in (tp_group, dp_group)]
    assert members_ == [[dp_rank * tp + t for t in range(tp)], [d * tp + rank % tp for d in range(dp)]], members_
    log_all(f"TP group {members_[0]}, DP group {members_[1]}")
    sums = [m._reduce(torch.tensor([2.0 ** rank], device=device, dtype=F64), g).item() for g in (tp_group, dp_group)]
    assert sums == [sum(2.0 ** r for r in ranks) for ranks in members_], sums
    # each DP replica feeds its own micro-batch to an MLP split over its own TP group
    mlp, make, pairs, *_ = dense_mlp(4, device)
    p_mlp = make(group=tp_group)
    xs = [ints(10 + d, SEQ, BATCH, HIDDEN, device=device) for d in range(dp)]
    dys = [ints(20 + d, SEQ, BATCH, HIDDEN, device=device) for d in range(dp)]
    t = check_against_dense(mlp, p_mlp, xs[dp_rank], dys[dp_rank], tp_group, lambda: pairs(p_mlp))
    assert names(t) == (["all_reduce"] * 2 if tp > 1 else []), t.calls  # g and f, on the TP group only
    for p in p_mlp.parameters():                                # DP: average each grad shard over the replicas
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dp
    mlp.zero_grad()
    (sum((mlp(x) * dy).sum() for x, dy in zip(xs, dys)) / dp).backward()  # dense: all micro-batches at once
    for layer, w, b in pairs(p_mlp):
        torch.testing.assert_close(layer.weight.grad, shard_of(layer, w.grad))
        torch.testing.assert_close(layer.bias.grad, shard_of(layer, b.grad, bias=True))
    log(f"TP {tp} x DP {dp}: groups as init_device_mesh's, sums over each; the TP MLP on its replica's micro-batch, "
        f"DP-averaged grad shards == dense over the {dp} micro-batches")


def refusals(device):
    head("every refusal at its boundary: the last valid value passes, the first invalid one is refused in one line")
    p = dist.get_world_size()
    said, alone = [], []

    def edge(valid, invalid, message, sized=False):
        """valid() passes; invalid() is refused in one line before any message, saying `message` (sized: a size the
        group must divide, so at p = 1, where every size divides, invalid() must pass too)."""
        valid()
        if sized and p == 1:
            invalid()
            return
        got = refused(invalid)
        assert got == message, (got, message)
        said.append(got)

    lin = lambda i, o, bias=True: nn.Linear(i, o, bias=bias, device=device, dtype=F64)
    edge(lambda: m.ColumnParallelLinear(HIDDEN, 2 * p), lambda: m.ColumnParallelLinear(HIDDEN, 2 * p + 1),
         f"out_features={2 * p + 1} is not divisible by the group size {p}", sized=True)
    edge(lambda: m.RowParallelLinear(2 * p, HIDDEN), lambda: m.RowParallelLinear(2 * p + 1, HIDDEN),
         f"in_features={2 * p + 1} is not divisible by the group size {p}", sized=True)
    edge(lambda: m.reduce_scatter_to_sequence_parallel_region(torch.zeros(p, 1, 1, device=device)),
         lambda: m.reduce_scatter_to_sequence_parallel_region(torch.zeros(p + 1, 1, 1, device=device)),
         f"x.shape[0]={p + 1} is not divisible by the group size {p}", sized=True)
    edge(lambda: m.scatter_to_sequence_parallel_region(torch.zeros(p, 1, device=device)),
         lambda: m.scatter_to_sequence_parallel_region(torch.zeros(p - 1 or 1, 1, device=device)),
         f"x.shape[0]={p - 1} is not divisible by the group size {p}" if p > 1 else None, sized=True)
    edge(lambda: m.scatter_to_tensor_model_parallel_region(torch.zeros(1, 3 * p, device=device)),
         lambda: m.scatter_to_tensor_model_parallel_region(torch.zeros(1, 3 * p + 1, device=device)),
         f"x.shape[-1]={3 * p + 1} is not divisible by the group size {p}", sized=True)
    # fused_shard: rows that split into equal units; each piece's heads a positive multiple or divisor of p
    t = torch.zeros(6 * p, 2, device=device)
    edge(lambda: m.fused_shard(t, (2 * p, p)), lambda: m.fused_shard(t[:-1], (2 * p, p)),
         f"{6 * p - 1} rows do not split into fused={(2 * p, p)} units of equal rows")
    assert refused(lambda: m.fused_shard(t, ())) == f"{6 * p} rows do not split into fused=() units of equal rows"
    assert refused(lambda: m.fused_shard(t, (6 * p, 0))) == \
        f"fused[1]=0 is not a positive multiple or divisor of the group size {p}"
    heads = lambda n: lambda: m.fused_shard(torch.zeros(3 * n, device=device), (n,))
    edge(heads(p), heads(p + 1), f"fused[0]={p + 1} is not a positive multiple or divisor of the group size {p}",
         sized=True)
    if p > 2:                                     # below p: p/2 heads (replicated twice) pass, p - 1 are refused
        edge(heads(p // 2), heads(p - 1), f"fused[0]={p - 1} is not a positive multiple or divisor of the group "
                                          f"size {p}")
    # from_dense(fused=): a column layer's rows, without gather_output
    qkv = lin(HIDDEN, 3 * HIDDEN)
    edge(lambda: m.ColumnParallelLinear.from_dense(qkv, fused=(HEADS,) * 3, gather_output=False),
         lambda: m.ColumnParallelLinear.from_dense(qkv, fused=(HEADS,) * 3, gather_output=True),
         "fused= splits a ColumnParallelLinear's rows by pieces, without gather_output")
    assert refused(lambda: m.RowParallelLinear.from_dense(lin(3 * HIDDEN, HIDDEN), fused=(HEADS,) * 3)) == \
        "fused= splits a ColumnParallelLinear's rows by pieces, without gather_output"
    # attention: query heads split (never replicated), K/V heads divide or are divided by p, n_head % n_kv_head,
    # and no dropout
    def attention(n_head, n_kv, dropout=0.0, d=2, **options):
        user = SimpleNamespace(c_attn=lin(HIDDEN, (n_head + 2 * n_kv) * d), c_proj=lin(n_head * d, HIDDEN),
                               n_head=n_head, n_kv_head=n_kv, dropout=dropout)
        return lambda: m.ParallelSelfAttention.from_dense(user, **options)
    edge(attention(4 * p, 2 * p), attention(3 * p, 2 * p), f"n_head={3 * p} is not divisible by n_kv_head={2 * p}")
    if p > 1:                                     # query heads are never replicated; K/V heads may be
        edge(attention(p, p), attention(p // 2, p // 2), f"n_head={p // 2} is not divisible by the group size {p}")
        edge(attention(2 * p, p), attention(2 * (p + 1) * p, p + 1),
             f"fused[1]={p + 1} is not a positive multiple or divisor of the group size {p}")
    edge(attention(HEADS, HEADS, 0.0), attention(HEADS, HEADS, 0.1),
         "from_dense takes attention without dropout (dropout=0.1)")
    from tests.nanogpt import CausalSelfAttention, GPTConfig     # nanoGPT's own module, configured with dropout
    nano = lambda dropout: lambda: m.ParallelSelfAttention.from_dense(CausalSelfAttention(
        GPTConfig(n_head=HEADS, n_embd=HIDDEN, dropout=dropout)))
    edge(nano(0.0), nano(0.2), "from_dense takes attention without dropout (dropout=0.2)")
    # parallel_mlp(gated=True): fc1's rows are [gate; up], two equal halves
    edge(lambda: m.parallel_mlp((lin(HIDDEN, 2 * FFN), nn.SiLU(), lin(FFN, HIDDEN)), gated=True),
         lambda: m.parallel_mlp((lin(HIDDEN, 2 * FFN + 2), nn.SiLU(), lin(FFN, HIDDEN)), gated=True),
         f"{2 * FFN + 2} rows do not split into fused={(FFN, FFN)} units of equal rows")
    # sequence_dim: 0 or 1 (the last valid), at construction; at the call, a dim of x before its features
    for make in (lambda d: m.ColumnParallelLinear(HIDDEN, 2 * p, sequence_dim=d),
                 lambda d: m.RowParallelLinear(2 * p, HIDDEN, sequence_dim=d),
                 lambda d: m.parallel_mlp((lin(HIDDEN, FFN), nn.GELU(), lin(FFN, HIDDEN)), sequence_dim=d),
                 lambda d: attention(HEADS, HEADS, sequence_dim=d)()):
        for good, bad in ((1, 2), (0, -1)):
            edge(lambda: make(good), lambda: make(bad), f"sequence_dim={bad} is not 0 (Megatron's [s, b, h]) or 1 "
                                                         "([b, s, h])")
        for bad in ("1", True, 1.0, None):        # not an int: refused as such, though True == 1 == 1.0
            alone.append(refused(lambda: make(bad)))
            assert alone[-1] == f"sequence_dim={bad!r} is not 0 (Megatron's [s, b, h]) or 1 ([b, s, h])", bad
    for check in (True, False):                   # x [s, h], no batch: sequence_dim=1 is its features' dim
        col = m.ColumnParallelLinear(HIDDEN, 2 * p, sequence_parallel=True, sequence_dim=1, check_slices=check,
                                     device=device, dtype=F64)
        edge(lambda: col(torch.zeros(1, 2, HIDDEN, device=device, dtype=F64)),
             lambda: col(torch.zeros(2, HIDDEN, device=device, dtype=F64)),
             f"sequence_dim=1 is not a dim of x (2, {HIDDEN}) before its features")
    row = m.RowParallelLinear(2 * p, HIDDEN, sequence_parallel=True, sequence_dim=1, device=device, dtype=F64)
    edge(lambda: row(torch.zeros(1, p, 2, device=device, dtype=F64)),
         lambda: row(torch.zeros(p, 2, device=device, dtype=F64)), f"sequence_dim=1 is not a dim of x ({p}, 2) before "
                                                                   "its features")
    qkv, proj = (m.ColumnParallelLinear(HIDDEN, 3 * HIDDEN, sequence_dim=1), m.RowParallelLinear(HIDDEN, HIDDEN))
    edge(lambda: m.ParallelSelfAttention(qkv, m.RowParallelLinear(HIDDEN, HIDDEN, sequence_dim=1), HEADS),
         lambda: m.ParallelSelfAttention(qkv, proj, HEADS), "qkv's sequence_dim=1 and proj's=0 differ")
    # tp_dp_groups: tp must divide the world size (refused before any group is made)
    assert refused(lambda: m.tp_dp_groups(p + 1)) == \
        f"world size {p} is not divisible by the tensor-parallel size {p + 1}"
    log(f"{len(said)} refusals at their edges (+ {4 + len(alone)} without one), one line on every rank, e.g. "
        f"{said[0]!r}")


def main():
    W = launched_world_size()
    if HEADS % W:
        refuse(f"{W} ranks: {HEADS} heads, hidden {HIDDEN}, ffn {FFN} and sequence {SEQ} split over 1, 2, 4 or 8 "
               f"ranks only")
    _, world, device = setup()
    groups = (None, strided_groups()[dist.get_rank() % 2][0])     # {0, 2, ..}, {1, 3, ..}: group rank != rank
    full = world <= 4      # at 8 ranks (on 2 cores the slowest launch) the world only, and what p = 8 adds
    mappings(groups, device)
    if full:
        linear_layers(groups, device)
    blocks(groups if full else groups[:1], device, None if full else ("MLP", "GQA, 1 K/V heads",
                                                                      "GQA, 4 K/V heads, [s, b, h]"))
    fused_layout(device)
    activation_memory(device)
    batch_first_cost(device)
    unequal_slices(groups[-1], device)
    if full:               # the same at every p: run where it is cheap
        tp_dp_grid(device)
        nanogpt_modules(device)
        dw_and_main_grad(device)
        bfloat16(device)
    refusals(device)
    finish(f"mappings, layers, MLP, SwiGLU, MHA and GQA attention (TP and SP, [s, b, h] and [b, s, h]) == dense at "
           f"p = {world} and on sub-groups; bytes, copies, main_grad, TP x DP, bf16, refusals at their edges")


if __name__ == "__main__":
    main()
