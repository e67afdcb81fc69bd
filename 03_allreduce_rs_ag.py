"""03 - all-reduce = reduce-scatter + all-gather.

The three collectives after which every rank holds a result:
  all-reduce      every rank gets the sum of all ranks' tensors: DDP's gradients, tensor parallelism's partial
                  outputs of a row-parallel linear (Megatron's g).
  reduce-scatter  rank r gets chunk r of that sum: ZeRO-2 / FSDP gradients (each rank keeps the 1/W it updates),
                  the exit of sequence parallelism's row-parallel linear.
  all-gather      every rank gets every rank's chunk, concatenated: ZeRO-3 / FSDP parameters before use, the
                  entry of sequence parallelism's column-parallel linear.

An all-reduce is a reduce-scatter followed by an all-gather, and the ring algorithm runs exactly that:

      before              reduce-scatter        all-gather (= all-reduce)
  R0: a0 b0 c0 d0         R0: A                 R0: A B C D
  R1: a1 b1 c1 d1   -->   R1:   B        -->    R1: A B C D        A = a0+a1+a2+a3, B = b0+b1+b2+b3, ...
  R2: a2 b2 c2 d2         R2:     C             R2: A B C D
  R3: a3 b3 c3 d3         R3:       D           R3: A B C D

Bytes each rank sends for a V-byte tensor over W ranks, ring algorithm (the "bus bandwidth" factors of
nccl-tests: busbw = algbw * factor):
  reduce-scatter (W-1)/W * V      all-gather (W-1)/W * V      all-reduce 2(W-1)/W * V
so data-parallel training pays about 2V per step whether it all-reduces (DDP) or reduce-scatters gradients and
all-gathers parameters (ZeRO): lesson 09.

The ring (ring_all_reduce below): V is cut into W chunks; rank r sends to r+1 and receives from r-1.
  reduce-scatter, W-1 steps: at step s rank r sends its partial sum of chunk r-1-s and adds the partial sum of
                             chunk r-2-s it receives into its own. It sends every chunk but r, and ends holding
                             the full sum of chunk r, as in the picture.
  all-gather,     W-1 steps: at step s rank r sends the finished chunk r-s and copies in chunk r-1-s. It sends
                             every chunk but r+1, the last one it receives.
  2(W-1) steps of one chunk (V/W) each = 2(W-1)/W * V. At W = 1 there is no step.

In autograd (forward / backward; Megatron mappings.py names for dim 0):
  all_gather(x, dim)      all-gather along dim / reduce-scatter along dim  (gather_from_sequence_parallel_region)
  reduce_scatter(x, dim)  reduce-scatter along dim / all-gather along dim  (reduce_scatter_to_sequence_parallel_region)
  all_reduce(x)           all-reduce / identity    (reduce_from_tensor_model_parallel_region, "g")
  all_reduce(x, backward="all_reduce")   all-reduce / all-reduce   (torch's own differentiable all_reduce)
Which all-reduce backward is right depends on how the loss counts the output: see all_reduce().

Run:  torchrun --nproc-per-node=4 03_allreduce_rs_ag.py
"""
import torch
import torch.distributed as dist


# ---- building blocks: plain collectives that return new tensors ----------------------------------------
def _all_reduce(x, group):
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _all_gather_along_dim(x, dim, group):
    """[x of rank 0, x of rank 1, ...] concatenated along dim."""
    W = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()              # along dim 0 each rank's block is contiguous
    out = front.new_empty((W * front.shape[0], *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_along_dim(x, dim, group):
    """Block `rank` (along dim) of the sum over ranks."""
    W = dist.get_world_size(group)
    if x.shape[dim] % W:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} is not divisible by the group size {W}")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // W, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


# ---- building blocks: the same collectives for autograd ------------------------------------------------
class _AllReduceIdentityBackward(torch.autograd.Function):
    """forward: all-reduce; backward: identity (Megatron's g). For an output whose loss is counted once."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceAllReduceBackward(_AllReduceIdentityBackward):
    """forward: all-reduce (inherited); backward: all-reduce. For a loss that sums one term per rank."""
    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    """forward: all-gather along dim; backward: reduce-scatter along dim."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    """forward: reduce-scatter along dim; backward: all-gather along dim."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


_ALL_REDUCE_BACKWARD = {"identity": _AllReduceIdentityBackward, "all_reduce": _AllReduceAllReduceBackward}


def all_reduce(x, group=None, backward="identity"):
    """Sum of x over the group, on every rank, as a new tensor. The backward depends on what the loss counts:

    backward="identity"    the output is ONE value held in W copies, and the loss is counted once: every rank
                           computes the same loss from its copy (tensor parallelism). dL/dx_r = dL/dout, which
                           every rank already holds.
    backward="all_reduce"  each rank's copy feeds its own loss term and the loss is the sum of the terms over
                           ranks. dL/dx_r = sum over s of dL_s/dout_s: all-reduce the gradients.
    Mixing them is wrong: "all_reduce" under a loss counted once gives W times the gradient; "identity" under a
    summed loss keeps only this rank's term.
    """
    if backward not in _ALL_REDUCE_BACKWARD:
        raise ValueError(f"all_reduce: backward={backward!r}; use 'identity' or 'all_reduce'")
    return _ALL_REDUCE_BACKWARD[backward].apply(x, group)


def all_gather(x, dim, group=None):
    """Every rank's x concatenated along dim, as a new tensor; backward: reduce-scatter along dim."""
    return _AllGather.apply(x, dim, group)


def reduce_scatter(x, dim, group=None):
    """Block `rank` along dim of the sum over ranks, as a new tensor; backward: all-gather along dim."""
    return _ReduceScatter.apply(x, dim, group)


# ---- building block: the ring all-reduce from point-to-point -------------------------------------------
def _ring_steps(chunks, first, add, group):
    """W-1 ring steps; at step s send chunks[first-s] to the next rank and receive chunks[first-s-1] from the
    previous one, adding it in (reduce-scatter) or copying it over (all-gather). Returns the bytes sent."""
    W, r = len(chunks), dist.get_rank(group)            # r is the rank in the group, as group_dst/group_src are
    inbox = torch.empty_like(chunks[0])                 # chunk 0 is a largest one
    sent = 0
    for s in range(W - 1):                              # W = 1: no step, nothing to wait for
        send, recv = chunks[(first - s) % W], chunks[(first - s - 1) % W]
        got = inbox[:recv.numel()]
        to_next = lambda: dist.isend(send, group=group, group_dst=(r + 1) % W)
        from_prev = lambda: dist.irecv(got, group=group, group_src=(r - 1) % W)
        # NCCL runs a rank's isend and irecv in the order posted and a send waits for its recv, so if every rank
        # posted its send first the ring would wait on itself: even ranks send first, odd ranks receive first.
        reqs = [to_next(), from_prev()] if r % 2 == 0 else [from_prev(), to_next()]
        for req in reqs:
            req.wait()
        (recv.add_ if add else recv.copy_)(got)
        sent += send.numel() * send.element_size()
    return sent


def ring_all_reduce(x, group=None):
    """Sum of x over the group by the ring algorithm, built from isend/irecv.

    Returns (sum as a new tensor, bytes this rank sent in the reduce-scatter phase, in the all-gather phase).
    The flat tensor is cut by tensor_split, so when W does not divide V the first V % W chunks hold one element
    more. Each phase sends every chunk but one: (W-1)/W * V to within one element.
    """
    W, r = dist.get_world_size(group), dist.get_rank(group)
    out = x.detach().clone(memory_format=torch.contiguous_format)
    chunks = out.view(-1).tensor_split(W)               # views into out, summed in place
    rs_bytes = _ring_steps(chunks, r - 1, add=True, group=group)    # then rank r holds the full sum of chunk r
    ag_bytes = _ring_steps(chunks, r, add=False, group=group)       # pass the finished chunks around
    return out, rs_bytes, ag_bytes


# ---- demo ----------------------------------------------------------------------------------------------
def torch_functional_collectives():
    """torch's own differentiable collectives to compare ours with, or None where this torch has none that fit.

    Not torch.distributed.nn.functional: torch 2.13 deprecates it (a FutureWarning on every call, and a warning
    fails this course's tests) and names this module as its replacement. Private by name, it is what DTensor is
    built on, and on 2.13 its all_reduce, all_gather_single and reduce_scatter_single carry autograd. Older torch
    lacks those names: the comparison is skipped there, and dense autograd still checks every op.
    """
    import torch.distributed._functional_collectives as funcol
    return funcol if hasattr(funcol, "all_gather_single") else None


def adjoint(out, y, x, grad):
    """(sum over ranks of <op(x), y>, sum over ranks of <x, op_backward(y)>): equal when backward = transpose."""
    dots = torch.stack([(out * y).sum(), (x * grad).sum()]).detach()
    dist.all_reduce(dots)
    return dots[0].item(), dots[1].item()


def check_collective(op, builtin, X, Y, dense):
    """Rank r runs op(X[r]) and backpropagates Y[r]. Reference: dense autograd on one process, where dense(X)
    stacks what every rank should hold and the loss is L = sum over r of <dense(X)[r], Y[r]>."""
    rank = dist.get_rank()
    Xd = X.clone().requires_grad_()
    outs = dense(Xd)
    (outs * Y).sum().backward()
    for fn in [op] + ([builtin] if builtin else []):
        x = X[rank].clone().requires_grad_()
        out = fn(x)
        out.backward(Y[rank])
        assert torch.equal(out, outs[rank]) and torch.equal(x.grad, Xd.grad[rank])
        assert torch.equal(x.detach(), X[rank])         # the input is left as it was
        if fn is op:
            assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # a new tensor
            lhs, rhs = adjoint(out, Y[rank], x, x.grad)
            assert lhs == rhs, (lhs, rhs)


def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError")


def main():
    from common import finish, head, log, log_all, overlap, setup, time_overlap
    rank, W, device = setup()
    f64 = dict(dtype=torch.float64, device=device)     # integer-valued float64: every sum below is exact
    world, funcol = dist.group.WORLD, torch_functional_collectives()
    same_as_torch = "; == torch's own (_functional_collectives)" if funcol else "; torch < 2.13: not vs torch's own"

    head("1. all-reduce, reduce-scatter, all-gather: AG(RS(x)) == AR(x)")
    n = 2                                               # elements per chunk; V = n * W
    X = torch.stack([torch.arange(n * W, **f64) + 100 * s for s in range(W)])
    x, total = X[rank], X.sum(0)                        # rank r => [100r, 100r+1, ..., 100r+2W-1]
    ar = x.clone()
    dist.all_reduce(ar)                                 # every rank => total
    rs = x.new_empty(n)
    dist.reduce_scatter_single(rs, x)                   # rank r => total[n*r : n*(r+1)]
    ag = x.new_empty(n * W)
    dist.all_gather_single(ag, rs)                      # every rank => [rs of R0, rs of R1, ...]
    assert torch.equal(ar, total) and torch.equal(rs, total.view(W, n)[rank])
    assert torch.equal(ag, ar)                          # AG(RS(x)) == AR(x)
    log_all(f"x = [{x[0]:.0f} .. {x[-1]:.0f}]  reduce-scatter -> {rs.long().tolist()}")
    log(f"all-gather of those = all-reduce = {ar.long().tolist()} on every rank")

    head("2. ring all-reduce from isend/irecv: W-1 reduce-scatter steps, then W-1 all-gather steps")
    # the world, then the even and the odd ranks as sub-groups (new_group is collective: every rank creates
    # both). In the odd group global rank 3 is group rank 1: the ring must name its peers by group rank.
    parity = [dist.new_group(list(range(p, W, 2))) for p in range(min(W, 2))][rank % 2]
    for group in (None, parity):
        members = dist.get_process_group_ranks(group or world)
        G, r = len(members), dist.get_rank(group)       # group size, rank in the group
        for shape in [(W, 3), (3 * W + 1,), (1,)]:      # world: V divisible by W; V not (W > 1); V < W
            X = torch.randint(-50, 50, (W, *shape), **f64)
            ring, rs_b, ag_b = ring_all_reduce(X[rank], group)
            ref = X[rank].clone()
            dist.all_reduce(ref, group=group)
            assert torch.equal(ring, X[members].sum(0)) and torch.equal(ring, ref)
            V, e = X[rank].numel(), X.element_size()
            chunk = [V // G + (c < V % G) for c in range(G)]   # tensor_split's chunk sizes
            # reduce-scatter sends every chunk but r (the one it ends with), all-gather every chunk but r+1 (the
            # last one it receives): each phase is (G-1)/G * V to within one element, the sum within two
            assert rs_b == (V - chunk[r]) * e and ag_b == (V - chunk[(r + 1) % G]) * e
            assert all(abs(b - (G - 1) / G * V * e) < e for b in (rs_b, ag_b))
            if group is None:
                log(f"V = {V} x {e} B: sent {rs_b} B reduce-scatter + {ag_b} B all-gather = {rs_b + ag_b} B; "
                    f"2(W-1)/W*V = {2 * (W - 1) / W * V * e:g} B; == dist.all_reduce")
    log("even ranks, odd ranks as sub-groups (group rank != global rank): == dist.all_reduce, 2(G-1)/G*V bytes")

    head("3. all_reduce in autograd: identity backward vs all-reduce backward")
    X = torch.randint(-9, 10, (W, 3, 4), **f64)         # rank s holds X[s]
    Y = torch.randint(-9, 10, (W, 3, 4), **f64)         # rank s's upstream gradient under a summed loss
    summed = lambda Xd: Xd.sum(0, keepdim=True).expand(W, 3, 4)
    # a loss summing one term per rank, L = sum_r <out_r, Y[r]>: the all-reduce backward is the transpose
    check_collective(lambda t: all_reduce(t, backward="all_reduce"),
                     (lambda t: funcol.all_reduce(t, "sum", world)) if funcol else None, X, Y, summed)
    y = Y[0]                                            # a loss counted once: every rank holds the same y
    Xd = X.clone().requires_grad_()
    (Xd.sum(0) * y).sum().backward()                    # L = <sum_s X[s], y>, dense
    once = Xd.grad[rank]                                # = y

    def grad_of(backward, upstream):
        x = X[rank].clone().requires_grad_()
        out = all_reduce(x, backward=backward)
        assert torch.equal(out, X.sum(0))
        out.backward(upstream)
        return x.grad

    g = grad_of("identity", y)
    assert torch.equal(g, once)
    lhs, rhs = adjoint(X.sum(0), y, X[rank], g)         # one output in W copies: its transpose counts it once
    assert lhs == W * rhs
    assert torch.equal(grad_of("all_reduce", y), W * once)         # mixing: W times the true gradient
    g = grad_of("identity", Y[rank])                                # mixing: only this rank's term ...
    assert torch.equal(g, Y[rank]) and (W == 1 or not torch.equal(g, Y.sum(0)))   # ... of the true sum_r Y[r]
    log(f"summed loss: backward=all_reduce == dense autograd (sum_r Y[r]), adjoint test holds{same_as_torch}")
    log(f"loss counted once: backward=identity == dense autograd (y); backward=all_reduce gives {W} x y")

    head("4. all_gather / reduce_scatter along any dim: each one's backward is the other")
    X = torch.randint(-9, 10, (W, 2, 3, 4), **f64)
    for dim in (0, 1, 2, -1):
        gathered = lambda Xd: torch.stack([torch.cat(list(Xd), dim)] * W)
        Y = torch.randint(-9, 10, gathered(X).shape, **f64)
        check_collective(lambda t: all_gather(t, dim),
                         (lambda t: funcol.all_gather_single(t, dim, world)) if funcol else None, X, Y, gathered)
        shape = [2, 3, 4]
        shape[dim] *= W                                  # reduce-scatter input: W blocks along dim
        scattered = lambda Xd: torch.stack(Xd.sum(0).chunk(W, dim))
        check_collective(lambda t: reduce_scatter(t, dim),
                         (lambda t: funcol.reduce_scatter_single(t, "sum", dim, world)) if funcol else None,
                         torch.randint(-9, 10, (W, *shape), **f64), torch.randint(-9, 10, X.shape, **f64), scattered)
    log(f"dims 0, 1, 2, -1: fwd and bwd == dense autograd, adjoint test holds, inputs untouched{same_as_torch}")
    msg = error_of(lambda: all_reduce(X[rank], backward="sum"))
    assert "backward='sum'" in msg
    if W > 1:
        msg = error_of(lambda: reduce_scatter(torch.zeros(3 * W + 1, device=device), 0))
        assert f"size {3 * W + 1} of dim 0" in msg and f"group size {W}" in msg
    log(f"ValueError: {msg}")

    head("5. async all-reduce overlapped with independent compute")
    idx = torch.arange(1 << 14, device=device)
    expect = (W * (idx % 7) + W * (W - 1) // 2).float()  # closed form of the sum over ranks of (idx % 7 + r)
    a = torch.randn(192, 192, device=device)
    compute = lambda: a @ a @ a                          # e.g. the next layer's backward, independent of the bucket
    alone = compute()
    bucket = (idx % 7 + rank).float()                   # this rank's gradient bucket
    result = overlap(lambda: dist.all_reduce(bucket, async_op=True), compute)
    assert torch.equal(bucket, expect)
    torch.testing.assert_close(result, alone)
    scratch = bucket.clone()
    t = time_overlap(lambda: dist.all_reduce(scratch, async_op=True), compute, device)
    log(f"all-reduce of {bucket.numel() * 4 // 1024} KiB alone {t['comm'] * 1e3:.2f} ms, compute alone "
        f"{t['compute'] * 1e3:.2f} ms, overlapped {t['overlapped'] * 1e3:.2f} ms; result == closed form")
    log("(not asserted: gloo reduces on CPU threads that compete with the matmul for cores; NCCL has its own stream)")

    finish("AG(RS(x)) == AR(x); ring all-reduce == dist.all_reduce sending 2(W-1)/W*V up to chunk rounding; "
           "differentiable AR/AG/RS pass dense-autograd and adjoint checks")


if __name__ == "__main__":
    main()
