"""03 - all-reduce = reduce-scatter + all-gather.

The three collectives after which every rank holds a result:
  all-reduce      every rank gets the sum of all ranks' tensors: DDP's gradients, the partial outputs of a
                  tensor-parallel row-parallel linear (Megatron's g).
  reduce-scatter  rank r gets chunk r of that sum: ZeRO-2 / FSDP gradients, sequence parallelism's exit.
  all-gather      every rank gets every rank's chunk: ZeRO-3 / FSDP parameters, sequence parallelism's entry.

An all-reduce is a reduce-scatter followed by an all-gather, and the ring algorithm runs exactly that:

      before              reduce-scatter        all-gather (= all-reduce)
  R0: a0 b0 c0 d0         R0: A                 R0: A B C D
  R1: a1 b1 c1 d1   -->   R1:   B        -->    R1: A B C D        A = a0+a1+a2+a3, B = b0+b1+b2+b3, ...
  R2: a2 b2 c2 d2         R2:     C             R2: A B C D
  R3: a3 b3 c3 d3         R3:       D           R3: A B C D

Bytes each rank sends for a V-byte tensor over W ranks, ring algorithm (nccl-tests' bus bandwidth factors):
  reduce-scatter (W-1)/W * V      all-gather (W-1)/W * V      all-reduce 2(W-1)/W * V
so data parallelism pays about 2V a step, by all-reduce (DDP) or reduce-scatter + all-gather (ZeRO): lesson 09.

The ring (ring_all_reduce): V in W chunks; rank r sends to r+1 and receives from r-1, W-1 steps a phase.
  reduce-scatter  at step s rank r sends its partial sum of chunk r-1-s and adds in chunk r-2-s it receives:
                  it sends every chunk but r, and ends holding the full sum of chunk r.
  all-gather      at step s rank r sends the finished chunk r-s and copies in chunk r-1-s: every chunk but r+1.
  2(W-1) steps of V/W = 2(W-1)/W * V. Even ranks post the send first, odd ranks the receive: played as
  blocking sends, a ring where every rank sends first waits on itself.

In autograd, Megatron's mappings (forward / backward), in 06's text:
  copy_to_tensor_model_parallel_region (f)               identity / all-reduce
  reduce_from_tensor_model_parallel_region (g)           all-reduce / identity
  gather_from_sequence_parallel_region(x, dim=d)         all-gather along d / reduce-scatter along d
  reduce_scatter_to_sequence_parallel_region(x, dim=d)   reduce-scatter along d / all-gather along d
Which all-reduce backward is right depends on how the loss counts the output:
  counted once  every rank computes the same loss from the same output (tensor parallelism): g.
  summed        L = the sum of each rank's loss on its copy, so dL/dx_r sums every rank's gradient: f(g(x)), an
                all-reduce both ways (torch's differentiable all-reduce). Mixed up: W times the gradient, or one term.

Run:  torchrun --nproc-per-node=4 03_allreduce_rs_ag.py     (BENCH=1: nccl-tests' algbw/busbw table instead)
"""
import torch
import torch.distributed as dist


# ---- building blocks (torch only: this section pastes alone) ----------------------------------------------
# torch 2.13 renamed these two collectives (the old names warn there); older torch has only the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- building blocks: the mappings, 06's canonical text (Megatron's mappings.py vocabulary) -------------
def _divide(what: str, value: int, group) -> int:
    size = dist.get_world_size(group)
    if value % size:
        raise ValueError(f"{what}={value} is not divisible by the group size {size}")
    return value // size


def _reduce(x, group):
    """Sum of x over the group; the caller's tensor is left alone."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _gather_along_dim(x, dim, group, async_op=False):
    """Every rank's x, concatenated along `dim` in rank order. async_op: (out, works), out valid after the wait."""
    size = dist.get_world_size(group)
    if size == 1:
        return (x, []) if async_op else x
    front = x.movedim(dim, 0).contiguous()                     # along dim 0 each rank's block is contiguous
    out = front.new_empty((size * front.shape[0], *front.shape[1:]))
    work = all_gather_single(out, front, group=group, async_op=async_op)
    out = out.movedim(0, dim)
    return (out, [work]) if async_op else out


def _reduce_scatter_along_dim(x, dim, group, async_op=False):
    """Chunk r along `dim` of the sum over the group, on rank r. async_op: (out, works)."""
    size = dist.get_world_size(group)
    if size == 1:
        return (x, []) if async_op else x
    _divide(f"x.shape[{dim}]", x.shape[dim], group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
    work = reduce_scatter_single(out, front, group=group, async_op=async_op)
    out = out.movedim(0, dim)
    return (out, [work]) if async_op else out


class _CopyToModelParallelRegion(torch.autograd.Function):
    """forward: identity; backward: all-reduce (the f operator)."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """forward: all-reduce; backward: identity (the g operator, f's conjugate)."""
    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """forward: all-gather along dim; backward: reduce-scatter along dim."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: reduce-scatter along dim; backward: all-gather along dim."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_dim(grad, ctx.dim, ctx.group), None, None



# Megatron's public names. The sequence-parallel regions cut dim 0, the sequence of Megatron's [s, b, h]; a
# batch-first [b, s, h] caller passes dim=1. f and g act on the whole tensor.
def copy_to_tensor_model_parallel_region(x, group=None):
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    return _ReduceFromModelParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group=None, *, dim=0):
    return _GatherFromSequenceParallelRegion.apply(x, dim, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None, *, dim=0):
    return _ReduceScatterToSequenceParallelRegion.apply(x, dim, group)



# ---- building blocks: the ring all-reduce from point-to-point ---------------------------------------------
def _ring_steps(chunks, first, add, group):
    """W-1 ring steps; at step s send chunks[first-s] to the next rank and receive chunks[first-s-1] from the
    previous one, adding it in (reduce-scatter) or copying it over (all-gather)."""
    W, r = len(chunks), dist.get_rank(group)            # r is the rank in the group, as group_dst/group_src are
    inbox = torch.empty_like(chunks[0])                 # chunk 0 is a largest one
    for s in range(W - 1):                              # W = 1: no step, nothing to wait for
        send, recv = chunks[(first - s) % W], chunks[(first - s - 1) % W]
        got = inbox[:recv.numel()]                      # chunks are slices of one flat tensor: contiguous
        to_next = lambda: dist.isend(send, group=group, group_dst=(r + 1) % W)
        from_prev = lambda: dist.irecv(got, group=group, group_src=(r - 1) % W)
        # Even ranks post the send first, odd ranks the receive. Played as blocking sends (gloo's dist.send;
        # NCCL's above its eager size), a ring where every rank sends first waits on itself. With isend/irecv on
        # NCCL, ops to different peers run on separate streams (pytorch#132852), so at W > 2 the order is free
        # there; at W = 2 next and prev are one peer, whose send and receive share one stream and run in the
        # order posted: if both ranks sent first, each one's send would wait for the peer's receive, queued
        # behind the peer's own send. The order of posts matters the same way inside one grouped launch.
        reqs = [to_next(), from_prev()] if r % 2 == 0 else [from_prev(), to_next()]
        for req in reqs:
            req.wait()
        (recv.add_ if add else recv.copy_)(got)


def ring_all_reduce(x, group=None):
    """Sum of x over the group by the ring algorithm, built from isend/irecv; a new tensor.

    The flat tensor is cut by tensor_split, so when W does not divide V the first V % W chunks hold one element
    more. Each phase sends every chunk but one: (W-1)/W * V to within one element.
    """
    W, r = dist.get_world_size(group), dist.get_rank(group)
    out = x.detach().clone(memory_format=torch.contiguous_format)
    chunks = out.view(-1).tensor_split(W)               # views into out, summed in place
    with torch.profiler.record_function("ring reduce-scatter"):   # the two phases, labelled in a trace
        _ring_steps(chunks, r - 1, add=True, group=group)   # then rank r holds the full sum of chunk r
    with torch.profiler.record_function("ring all-gather"):
        _ring_steps(chunks, r, add=False, group=group)      # pass the finished chunks around
    return out


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
import os
import time

try:
    from common import (finish, head, log, log_all, overlap, refuse, refused, replays, ring_bytes, setup,
                        strided_groups, sync, time_overlap, traffic)
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass


# checking helpers (a reader may skip to the sections below): torch's own collectives, views, the checker
def torch_functional_collectives():
    """torch's own differentiable collectives to compare ours with, or None where this torch has none that fit."""
    import torch.distributed._functional_collectives as funcol
    return funcol if hasattr(funcol, "all_gather_single") else None


def members_of(group):
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    return members, len(members), dist.get_rank(group)


def strided(t):
    """t's values as a non-contiguous view: stored transposed (2-d and up), or every other element (1-d)."""
    return t.mT.contiguous().mT if t.dim() > 1 else torch.stack([t, torch.zeros_like(t)], -1)[..., 0]


def check_collective(op, X, Y, dense, group, fwd=None, bwd=None, builtin=None, once=False):
    """Group rank r runs op(X[r]), handed a non-contiguous view, and backpropagates Y[r] (Y[0] on every rank for
    a loss counted once). Reference: dense autograd in one process on the group's inputs, dense(X) stacking
    what every rank should hold, the loss sum_r <dense(X)[r], Y[r]> (or <dense(X)[0], Y[0]>, counted once).
    fwd / bwd: the collective each pass must issue on the group (none when the group has one rank)."""
    members, G, r = members_of(group)
    X, Y = X[members], Y[members]
    Xd = X.clone().requires_grad_()
    outs = dense(Xd)
    (outs[:1] * Y[:1] if once else outs * Y).sum().backward()
    for fn in [op] + ([builtin] if builtin else []):
        leaf = X[r].clone().requires_grad_()
        x = strided(leaf) if fn is op else leaf
        with traffic() as t_fwd:
            out = fn(x)
        with traffic() as t_bwd:
            out.backward(Y[0] if once else Y[r])
        assert torch.equal(out, outs[r]) and torch.equal(leaf.grad, Xd.grad[r])
        assert torch.equal(x.detach(), X[r])            # the input is left as it was
        if fn is op:                                    # one collective each way, on this group, of these bytes
            calls = lambda name, t: [(name, tuple(members), t.nbytes)] if name and G > 1 else []
            assert t_fwd.calls == calls(fwd, x) and t_bwd.calls == calls(bwd, out), (t_fwd.calls, t_bwd.calls)


def section_collectives(rank, W, f64):
    head("1. all-reduce, reduce-scatter, all-gather: AG(RS(x)) == AR(x)")
    n = 2                                               # elements per chunk; V = n * W
    X = torch.stack([torch.arange(n * W, **f64) + 100 * s for s in range(W)])
    x, total = X[rank], X.sum(0)                        # rank r => [100r, 100r+1, ..., 100r+2W-1]
    ar = x.clone()
    dist.all_reduce(ar)                                 # every rank => total
    rs = x.new_empty(n)
    reduce_scatter_single(rs, x)                        # rank r => total[n*r : n*(r+1)]
    ag = x.new_empty(n * W)
    all_gather_single(ag, rs)                           # every rank => [rs of R0, rs of R1, ...]
    assert torch.equal(ar, total) and torch.equal(rs, total.view(W, n)[rank])
    assert torch.equal(ag, ar)                          # AG(RS(x)) == AR(x)
    log_all(f"x = [{x[0]:.0f} .. {x[-1]:.0f}]  reduce-scatter -> {rs.long().tolist()}")
    log(f"all-gather of those = all-reduce = {ar.long().tolist()} on every rank")


def section_ring(rank, W, f64, groups):
    head("2. ring all-reduce from isend/irecv: W-1 reduce-scatter steps, then W-1 all-gather steps")
    torch.manual_seed(2)
    for group in groups:                                # in the odd group global rank 3 is group rank 1
        members, G, r = members_of(group)
        for shape in [(W, 3), (3 * W + 1,), (1,)]:      # world: V divisible by W; V not (W > 1); V < W
            X = torch.randint(-50, 50, (W, *shape), **f64)
            x = X[rank].clone().requires_grad_(shape == (1,))   # (1,): x itself, contiguous and requiring grad
            with traffic() as t:
                ring = ring_all_reduce(x if shape == (1,) else strided(x), group)
            assert not ring.requires_grad               # outside autograd: no silently wrong (identity) backward
            ref = X[rank].clone()
            dist.all_reduce(ref, group=group)
            assert torch.equal(ring, X[members].sum(0)) and torch.equal(ring, ref)
            assert torch.equal(x, X[rank])              # a new tensor: the input is left as it was
            assert all(ranks == tuple(members) for _, ranks, _ in t.calls)     # every post on this group
            sent = [b for kind, _, b in t.calls if kind == "send"]
            V, e = X[rank].numel(), X.element_size()
            chunk = [V // G + (c < V % G) for c in range(G)]   # tensor_split's chunk sizes
            # reduce-scatter sends every chunk but r (the one it ends with), all-gather every chunk but r+1 (the
            # last one it receives): each phase is (G-1)/G * V to within one element
            rs_b, ag_b = sum(sent[:G - 1]), sum(sent[G - 1:])
            assert len(sent) == 2 * (G - 1) and rs_b == (V - chunk[r]) * e and ag_b == (V - chunk[(r + 1) % G]) * e
            assert abs(rs_b - ring_bytes("reduce_scatter", V * e, G)) < e
            assert abs(ag_b - ring_bytes("all_gather", V * e, G)) < e
            assert abs(rs_b + ag_b - ring_bytes("all_reduce", V * e, G)) < 2 * e
            # the order this rank posted its sends (to r+1) and receives (from r-1), replayed as blocking ops
            posts = [None] * G
            dist.all_gather_object(posts, [kind for kind, _, _ in t.calls], group=group)
            assert replays([[(k, (g + 1) % G if k == "send" else (g - 1) % G) for k in p]
                            for g, p in enumerate(posts)]), f"the ring's post order deadlocks: {posts}"
            for first in ("send", "recv"):  # every rank posting its send first (or its receive first) deadlocks
                same = [[k for pair in zip(p[0::2], p[1::2]) for k in sorted(pair, key=lambda k: k != first)]
                        for p in posts]                                  # each step's pair, `first` first
                assert G == 1 or not replays([[(k, (g + 1) % G if k == "send" else (g - 1) % G) for k in p]
                                              for g, p in enumerate(same)]), (first, same)
            if group is None and shape == (W, 3):
                log(f"V = {V} x {e} B: sent {rs_b} B reduce-scatter + {ag_b} B all-gather = {rs_b + ag_b} B; "
                    f"2(W-1)/W*V = {ring_bytes('all_reduce', V * e, W):g} B; == dist.all_reduce")
    log("also V % W != 0, V < W, and the even / odd ranks as sub-groups: == dist.all_reduce, 2(G-1)/G*V B")
    log("each rank's posts (even: send first, odd: receive first), replayed as blocking sends: no deadlock; "
        "every rank sending first, or receiving first, deadlocks")


def section_all_reduce(rank, W, f64, groups, funcol):
    head("3. all-reduce in autograd: g for a loss counted once, f(g(x)) for a summed loss")
    torch.manual_seed(3)
    X = torch.randint(-9, 10, (W, 3, 4), **f64)         # rank s holds X[s]
    Y = torch.randint(-9, 10, (W, 3, 4), **f64)         # rank s's upstream gradient
    summed = lambda Xd: Xd.sum(0, keepdim=True).expand_as(Xd)
    g = reduce_from_tensor_model_parallel_region
    fg = lambda t, group: copy_to_tensor_model_parallel_region(g(t, group), group)
    for group in groups:
        members, G, r = members_of(group)
        torch_ar = (lambda t: funcol.all_reduce(t, "sum", group or dist.group.WORLD)) if funcol else None
        check_collective(lambda t: g(t, group), X, Y, summed, group, fwd="all_reduce", once=True)
        check_collective(lambda t: fg(t, group), X, Y, summed, group, "all_reduce", "all_reduce", torch_ar)
        x = X[rank].clone().requires_grad_()            # mixing them gives the wrong gradient:
        fg(x, group).backward(Y[members[0]])            # f(g(x)) under a loss counted once: G times it
        assert torch.equal(x.grad, G * Y[members[0]])
        x.grad = None
        g(x, group).backward(Y[rank])                   # g under a summed loss: only this rank's term
        assert torch.equal(x.grad, Y[rank])
    log("world and even / odd sub-groups: loss counted once, g == dense autograd; summed loss, f(g(x)) == "
        "dense autograd" + (" == torch's own all_reduce" if funcol else ""))
    log(f"mixed up: f(g(x)) under a loss counted once gives {W} x the gradient, g under a summed one this rank's")


def section_gather_scatter(rank, W, f64, groups, funcol):
    head("4. all-gather / reduce-scatter regions along any dim: each one's backward is the other")
    torch.manual_seed(4)
    for group in groups:
        members, G, r = members_of(group)
        pg = group or dist.group.WORLD
        for dim in (0, 1, 2, -1):
            X = torch.randint(-9, 10, (W, 2, 3, 4), **f64)
            gathered = lambda Xd: torch.stack([torch.cat(list(Xd), dim)] * len(Xd))
            Y = torch.randint(-9, 10, (W, *gathered(X[members]).shape[1:]), **f64)
            torch_ag = (lambda t: funcol.all_gather_single(t, dim, pg)) if funcol else None
            check_collective(lambda t: gather_from_sequence_parallel_region(t, group, dim=dim), X, Y, gathered, group,
                             "all_gather", "reduce_scatter", torch_ag)
            shape = [2, 3, 4]
            shape[dim] *= G                             # reduce-scatter input: G blocks along dim
            scattered = lambda Xd: torch.stack(Xd.sum(0).chunk(len(Xd), dim))
            torch_rs = (lambda t: funcol.reduce_scatter_single(t, "sum", dim, pg)) if funcol else None
            check_collective(lambda t: reduce_scatter_to_sequence_parallel_region(t, group, dim=dim),
                             torch.randint(-9, 10, (W, *shape), **f64),
                             torch.randint(-9, 10, (W, 2, 3, 4), **f64), scattered, group, "reduce_scatter",
                             "all_gather", torch_rs)
    log("dims 0, 1, 2, -1, world and sub-groups: fwd and bwd == dense autograd" + (" == torch's own" if funcol
        else "") + "; one collective each way; inputs untouched")
    if W > 1:
        said = refused(lambda: reduce_scatter_to_sequence_parallel_region(torch.zeros(3 * W + 1, device=f64["device"])))
        assert f"x.shape[0]={3 * W + 1}" in said and f"group size {W}" in said, said
        log(f"ValueError: {said}")


def section_overlap(rank, W, device):
    head("5. async all-reduce overlapped with independent compute")
    idx = torch.arange(1 << 14, device=device)
    expect = (W * (idx % 7) + W * (W - 1) // 2).float()  # closed form of the sum over ranks of (idx % 7 + r)
    a = torch.randn(192, 192, device=device)
    compute = lambda: a @ a @ a                          # e.g. the next layer's backward, independent of the bucket
    bucket = (idx % 7 + rank).float()                   # this rank's gradient bucket
    overlap(lambda: dist.all_reduce(bucket, async_op=True), compute)
    assert torch.equal(bucket, expect)
    scratch = bucket.clone()
    t = time_overlap(lambda: dist.all_reduce(scratch, async_op=True), compute, device)
    log(f"all-reduce of {bucket.numel() * 4 // 1024} KiB alone {t['comm'] * 1e3:.2f} ms, compute alone "
        f"{t['compute'] * 1e3:.2f} ms, overlapped {t['overlapped'] * 1e3:.2f} ms; result == closed form")
    saved = t["comm"] + t["compute"] - t["overlapped"]  # timings: printed, not asserted
    if device.type == "cuda":
        log(f"overlap saved {saved * 1e3:.2f} ms: NCCL reduces in a kernel on its own stream, beside the matmul")
    else:
        log(f"overlap saved {saved * 1e3:.2f} ms: gloo adds on CPU threads, which share this machine's "
            f"{os.cpu_count()} cores with the matmuls of {W} ranks")


# ---- BENCH=1: an nccl-tests-style table (not run by the suite; each op's result is still checked) -----------
def bench_ops(rank, W, device):
    """name -> make(n) -> (call, check), for n float32 elements (a multiple of W). nccl-tests' doc/PERFORMANCE.md:
    algbw = S / t, S the bytes of the op's largest buffer (the all-gather's output, the reduce-scatter's input);
    busbw = algbw * ring_bytes(name, 1, W), the bytes the busiest link carries per second in a ring."""
    f32 = dict(dtype=torch.float32, device=device)
    W_sum = W * (W + 1) / 2                              # rank r contributes r + 1

    def all_reduce(n):
        x = torch.full((n,), rank + 1.0, **f32)
        return lambda: dist.all_reduce(x), lambda: bool((x == W_sum).all())

    def all_gather(n):
        inp, out = torch.full((n // W,), float(rank), **f32), torch.empty(n, **f32)
        want = torch.arange(W, **f32)[:, None]
        return lambda: all_gather_single(out, inp), lambda: bool((out.view(W, -1) == want).all())

    def reduce_scatter_(n):
        inp, out = torch.full((n,), rank + 1.0, **f32), torch.empty(n // W, **f32)
        return lambda: reduce_scatter_single(out, inp), lambda: bool((out == W_sum).all())

    def all_to_all(n):                                   # block j of rank r's input, r*W + j, goes to rank j
        inp = (rank * W + torch.arange(W, **f32)).repeat_interleave(n // W)
        out, want = torch.empty(n, **f32), (torch.arange(W, **f32) * W + rank)[:, None]
        return lambda: dist.all_to_all_single(out, inp), lambda: bool((out.view(W, -1) == want).all())

    def broadcast(n):
        x = torch.full((n,), float(rank), **f32)
        return lambda: dist.broadcast(x, src=0), lambda: bool((x == 0).all())

    return {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter_,
            "all_to_all": all_to_all, "broadcast": broadcast}


def slowest(seconds, device):
    """The slowest rank's seconds (what nccl-tests' time means to a training step: every rank waits for it)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(call, device, budget=0.05):
    """Mean seconds of one call: one call sizes the count, then as many as fit `budget` (all ranks alike)."""
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    call()
    sync(device)
    iters = max(1, min(50, int(budget / max(slowest(time.perf_counter() - t0, device), 1e-9))))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    sync(device)
    return slowest((time.perf_counter() - t0) / iters, device)


def bench(rank, W, device, sizes=tuple(8 << 2 * k for k in range(13)) + (256 << 20,)):
    """algbw and busbw as nccl-tests defines them (its doc/PERFORMANCE.md). algbw = S / t depends on W for one
    link speed (a ring all-reduce moves 2(W-1)/W * S per rank); busbw removes that factor, so it reads against
    the hardware's link bandwidth at any W: busbw is what to compare across sizes, ranks and machines."""
    head(f"BENCH: {dist.get_backend()} at {W} ranks, float32, 8 B .. 256 MiB; GB/s = 1e9 bytes/s; "
         f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    src = torch.ones(sizes[-1] // 4, device=device)      # touched: its pages exist before the clock starts
    dst = torch.zeros_like(src)
    copy = timed(lambda: dst.copy_(src), device, 0.5)
    del src, dst
    limit = "the most loopback gloo can approach" if device.type == "cpu" else "GPU memory, far above any link"
    log(f"memory copy (copy_ of {sizes[-1] >> 20} MiB on every rank at once): {sizes[-1] / copy / 1e9:.1f} GB/s "
        f"per rank, {limit}")
    ops = bench_ops(rank, W, device)
    log("algbw = S/t; busbw = algbw x 2(W-1)/W (all_reduce), (W-1)/W (all_gather, reduce_scatter, all_to_all), "
        "1 (broadcast)")
    log(f"{'S (bytes)':>10} {'AR time':>9} " + " ".join(f"{name:^13}" for name in ops) + "  algbw/busbw GB/s")
    for size in sizes:
        n = max(W, size // 4 // W * W)                  # elements: a multiple of W, as nccl-tests rounds
        row = []
        for name, make in ops.items():
            call, check = make(n)
            call()
            assert check(), f"{name} of {n * 4} B: wrong result"
            t = timed(call, device)
            row.append(f"{n * 4 / t / 1e9:6.2f}/{n * 4 / t / 1e9 * ring_bytes(name, 1, W):<6.2f}")
            ar_us = t * 1e6 if name == "all_reduce" else ar_us
            del call, check
        log(f"{n * 4:>10} {ar_us:>7.0f}us " + " ".join(row))


def main():
    if os.environ.get("BENCH", "").strip() not in ("", "0", "1"):
        refuse(f"BENCH={os.environ['BENCH']!r}: BENCH=1 prints the bandwidth table, BENCH=0 (or unset) runs the lesson")
    rank, W, device = setup()
    if os.environ.get("BENCH", "").strip() == "1":
        bench(rank, W, device)
        finish(f"BENCH at {W} ranks: every op's result checked at every size (the speeds are measurements)")
        return
    f64 = dict(dtype=torch.float64, device=device)     # integer-valued float64: every sum below is exact
    groups = [None, strided_groups(2)[rank % 2][0]]    # the world; {0, 2, ..} or {1, 3, ..}: group rank != rank
    funcol = torch_functional_collectives()
    section_collectives(rank, W, f64)
    section_ring(rank, W, f64, groups)
    section_all_reduce(rank, W, f64, groups, funcol)
    section_gather_scatter(rank, W, f64, groups, funcol)
    section_overlap(rank, W, device)
    finish("AG(RS(x)) == AR(x); ring all-reduce == dist.all_reduce sending 2(W-1)/W*V up to chunk rounding, its "
           "post order deadlock-free as blocking sends; f, g, AG, RS == dense autograd on the world and sub-groups")


if __name__ == "__main__":
    main()
