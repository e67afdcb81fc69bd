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
NCCL runs these rings. gloo runs a reduce-scatter as an all-reduce of the whole input and keeps chunk r, so there
it sends 2(W-1)/W * V, as much as an all-reduce (tests/check_03.py counts the bytes each rank writes).

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

Run:  torchrun --nproc-per-node=4 03_allreduce_rs_ag.py     (the bandwidth table: bench/03_bandwidth.py)

tests/check_03.py: sub-groups, V % W != 0, V < W, bf16, every dim, bytes per phase and as written, post order,
torch's own, refusals.
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


# ---- demo: each claim above against one process (needs common.py; the blocks need only torch) -------------
def main():
    import os
    from common import finish, head, log, log_all, overlap, setup, time_overlap, traffic
    rank, W, device = setup()
    f64 = dict(dtype=torch.float64, device=device)     # integer-valued float64: every sum below is exact

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

    head("2. ring all-reduce from isend/irecv: W-1 reduce-scatter steps, then W-1 all-gather steps")
    torch.manual_seed(2)
    X = torch.randint(-50, 50, (W, W, 3), **f64)        # rank r holds X[r]: V = 3W elements
    with traffic() as t:
        ring = ring_all_reduce(X[rank])
    V = X[rank].nbytes
    sent = sum(b for kind, _, b in t.calls if kind == "send")
    assert torch.equal(ring, X.sum(0))                  # == the sum in one process
    assert sent * W == 2 * (W - 1) * V                  # the closed form 2(W-1)/W * V, exactly: W divides V
    log(f"V = {V} B over {W} ranks: == the sum in one process; sent {sent} B = 2(W-1)/W * V")

    head("3. all-reduce in autograd: g for a loss counted once, f(g(x)) for a summed loss")
    torch.manual_seed(3)
    X = torch.randint(-9, 10, (W, 3, 4), **f64)         # rank s holds X[s]
    Y = torch.randint(-9, 10, (W, 3, 4), **f64)         # rank s's upstream gradient
    once, summed = X.clone().requires_grad_(), X.clone().requires_grad_()
    (once.sum(0) * Y[0]).sum().backward()               # one loss, from the one output every rank holds
    (summed.sum(0) * Y).sum().backward()                # L = sum over ranks r of <output, Y[r]>
    g = reduce_from_tensor_model_parallel_region
    fg = lambda t: copy_to_tensor_model_parallel_region(g(t))
    for op, dy, want in ((g, Y[0], once.grad), (fg, Y[rank], summed.grad)):
        x = X[rank].clone().requires_grad_()
        out = op(x)
        out.backward(dy)
        assert torch.equal(out, X.sum(0)) and torch.equal(x.grad, want[rank])
    log("g under a loss counted once, f(g(x)) under a summed loss: forward and backward == dense autograd")

    head("4. all-gather / reduce-scatter regions, batch-first (dim=1): each one's backward is the other")
    torch.manual_seed(4)
    X = torch.randint(-9, 10, (W, 2, 3, 4), **f64)      # rank r holds tokens 3r .. 3r+2 of [b=2, s=3W, h=4]
    Y = torch.randint(-9, 10, (W, 2, 3 * W, 4), **f64)  # rank r's upstream gradient of the gathered sequence
    Xd = X.clone().requires_grad_()
    full = torch.cat(list(Xd), dim=1)                   # [2, 3W, 4]: every rank's tokens in rank order
    (full * Y).sum().backward()                         # each rank's loss from its copy, summed
    x = X[rank].clone().requires_grad_()
    out = gather_from_sequence_parallel_region(x, dim=1)
    out.backward(Y[rank])
    assert torch.equal(out, full.detach()) and torch.equal(x.grad, Xd.grad[rank])
    Zd = Y.clone().requires_grad_()                     # the reverse: rank r holds partial sums Y[r] [2, 3W, 4]
    parts = Zd.sum(0).chunk(W, dim=1)                   # rank r gets tokens 3r .. 3r+2 of the sum
    sum((p * X[r]).sum() for r, p in enumerate(parts)).backward()   # X[r]: rank r's upstream gradient
    z = Y[rank].clone().requires_grad_()
    out = reduce_scatter_to_sequence_parallel_region(z, dim=1)
    out.backward(X[rank])
    assert torch.equal(out, parts[rank]) and torch.equal(z.grad, Zd.grad[rank])
    log(f"gather: [2, 3, 4] -> [2, {3 * W}, 4], its backward reduce-scatters; reduce-scatter: the reverse; "
        f"both == dense autograd")

    head("5. async all-reduce overlapped with independent compute")
    idx = torch.arange(1 << 14, device=device)
    expect = (W * (idx % 7) + W * (W - 1) // 2).float()  # closed form of the sum over ranks of (idx % 7 + r)
    a = torch.randn(192, 192, device=device)
    compute = lambda: a @ a @ a                          # e.g. the next layer's backward, independent of the bucket
    bucket = (idx % 7 + rank).float()                   # this rank's gradient bucket
    overlap(lambda: dist.all_reduce(bucket, async_op=True), compute)
    assert torch.equal(bucket, expect)
    scratch = bucket.clone()
    t = time_overlap(lambda: dist.all_reduce(scratch, async_op=True), compute, device, iters=3)
    saved = t["comm"] + t["compute"] - t["overlapped"]  # timings: printed, not asserted
    why = ("NCCL reduces in a kernel on its own stream, beside the matmul" if device.type == "cuda" else
           f"gloo adds on CPU threads, which share this machine's {os.cpu_count()} cores with {W} ranks' matmuls")
    log(f"all-reduce of {bucket.numel() * 4 // 1024} KiB alone {t['comm'] * 1e3:.2f} ms, compute alone "
        f"{t['compute'] * 1e3:.2f} ms, overlapped {t['overlapped'] * 1e3:.2f} ms; result == closed form")
    log(f"overlap saved {saved * 1e3:.2f} ms: {why}")
    finish("AG(RS(x)) == AR(x); the ring all-reduce == the sum, sending 2(W-1)/W*V; f, g and the sequence-parallel "
           "regions == dense autograd")


if __name__ == "__main__":
    main()
