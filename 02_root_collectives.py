"""02 - root collectives: broadcast, scatter, gather, reduce.

One rank, the root, is the source or the destination of all the data:
  broadcast  the root's tensor to every rank: rank 0 loads the checkpoint, every rank starts from it (DDP
             broadcasts rank 0's weights when it wraps the model).
  scatter    the root's tensor cut in W slices, slice i to rank i: hand out data or parameter shards.
  gather     every rank's tensor to the root, concatenated along a dim: e.g. vocab-sharded logits collected on
             rank 0 for sampling or evaluation.
  reduce     the sum (or max) over ranks, on the root only: the loss collected for logging.

             before                      after
  broadcast  R0: a    R1: .    R2: .     R0: a      R1: a      R2: a
  scatter    R0: a|b|c                   R0: a      R1: b      R2: c
  gather     R0: a    R1: b    R2: c     R0: a|b|c  (R1, R2 unchanged)
  reduce     R0: a    R1: b    R2: c     R0: a+b+c  (R1, R2: scratch, never read them)

They come in transposed pairs, so each one's backward is its partner: broadcast <-> reduce-sum to the root,
scatter <-> gather (torch.distributed.nn.functional pairs them so).

Bytes for a V-byte tensor over W ranks. Section 6 counts them for broadcast and reduce built by hand from
send/recv; for scatter and gather, the rows are the slices that must leave or reach the root in any algorithm.
                    root sends         root receives     every other rank
  broadcast, flat   (W-1) V            0                 receives V
  broadcast, tree   ceil(log2 W) V     0                 receives V, sends V to each of its children
  reduce, flat      0                  (W-1) V           sends V
  reduce, tree      0                  ceil(log2 W) V    receives V from each of its children, sends V
  scatter           (W-1)/W V          0                 receives V/W
  gather            0                  (W-1)/W V         sends V/W
Flat, the root's link carries W-1 times what any other rank's does: the bottleneck. A binomial tree cuts the
root's load to one message per round, ceil(log2 W) rounds; the ring all-reduce of lesson 03 spreads the load
evenly, 2(W-1)/W V on every rank.

Run:  torchrun --nproc-per-node=4 02_root_collectives.py
"""
import contextlib
import math

import torch
import torch.distributed as dist


# ---- building blocks --------------------------------------------------------------------------------------
def _group_rank(group, global_rank):
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _global(group, group_rank):
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def broadcast_module(module, src=0, group=None):
    """Overwrite every parameter and buffer with the src rank's (global rank), as DDP does at construction."""
    with torch.no_grad():
        for t in module.state_dict().values():
            dist.broadcast(t, src, group=group)


def scatter_along_dim(full, out, dim, src=0, group=None):
    """Slice i (along dim) of src's `full` lands in rank i's `out`; `full` is read on src only. Returns out."""
    n = dist.get_world_size(group)
    if dist.get_rank() != src:
        dist.scatter(out, None, src, group=group)
        return out
    if full.shape[dim] % n:
        raise ValueError(f"scatter: size {full.shape[dim]} of dim {dim} is not divisible by the group size {n}")
    slices = [s.contiguous() for s in full.chunk(n, dim)]
    if slices[0].shape != out.shape:
        raise ValueError(f"scatter: a slice has shape {tuple(slices[0].shape)}, out has {tuple(out.shape)}")
    dist.scatter(out, slices, src, group=group)
    return out


def gather_along_dim(x, dim, dst=0, group=None):
    """Every rank's x concatenated along dim, in rank order, on dst (global rank); None elsewhere."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"gather: dim {dim} is out of range for a {x.dim()}-d tensor")
    x = x.contiguous()
    if dist.get_rank() != dst:
        dist.gather(x, None, dst, group=group)
        return None
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.gather(x, parts, dst, group=group)
    return torch.cat(parts, dim)


def reduce_to(x, dst=0, op=dist.ReduceOp.SUM, group=None):
    """op over every rank's x, as a new tensor on dst (global rank); None elsewhere; x itself is untouched.
    (dist.reduce works in place, and gloo leaves partial sums in the other ranks' buffers: measured.)"""
    out = x.clone(memory_format=torch.contiguous_format)  # NCCL takes contiguous tensors only (gloo: dense)
    dist.reduce(out, dst, op=op, group=group)
    return out if dist.get_rank() == dst else None


def broadcast_flat(x, src=0, group=None):
    """dist.broadcast by hand, the naive way: src sends x to every other rank in turn. In place; returns x."""
    me, n, root = dist.get_rank(group), dist.get_world_size(group), _group_rank(group, src)
    if me != root:
        dist.recv(x, src, group=group)
    else:
        for r in range(n):
            if r != root:
                dist.send(x, _global(group, r), group=group)
    return x


def reduce_flat(x, dst=0, group=None):
    """dist.reduce (SUM) by hand, the naive way: every other rank sends x to dst, which adds each one in.
    In place: x on dst becomes the sum, elsewhere it is left as it was; returns x."""
    me, n, root = dist.get_rank(group), dist.get_world_size(group), _group_rank(group, dst)
    if me != root:
        dist.send(x, dst, group=group)
    else:
        buf = torch.empty_like(x)
        for r in range(n):
            if r != root:
                dist.recv(buf, _global(group, r), group=group)
                x += buf
    return x


def binomial_tree(me, n, root=0):
    """Rank me's part of a binomial-tree broadcast over group ranks 0..n-1: its ("recv" | "send", peer) steps in
    order. In round k = 1, 2, 4, ... every rank that holds the data (relative rank rel < k) sends it to rel + k:
    the holders double each round, ceil(log2 n) rounds in all.

        n = 6, root = 0:  round 1: 0->1   round 2: 0->2, 1->3   round 4: 0->4, 1->5
    """
    rel, k, steps = (me - root) % n, 1, []
    while k < n:
        if rel < k and rel + k < n:                    # I hold the data: pass it k ranks on
            steps.append(("send", (root + rel + k) % n))
        elif k <= rel < 2 * k:                         # my turn to receive, from k ranks back
            steps.append(("recv", (root + rel - k) % n))
        k *= 2
    return steps


def broadcast_binomial(x, src=0, group=None):
    """dist.broadcast by hand along binomial_tree: the root sends ceil(log2 n) times, not n-1. In place; returns x."""
    me, n, root = dist.get_rank(group), dist.get_world_size(group), _group_rank(group, src)
    for kind, peer in binomial_tree(me, n, root):
        (dist.send if kind == "send" else dist.recv)(x, _global(group, peer), group=group)
    return x


def reduce_binomial(x, dst=0, group=None):
    """dist.reduce (SUM) by hand: binomial_tree played backwards, every arrow reversed. A rank adds its children's
    partial sums into x, then sends x to its parent. In place: x on dst becomes the sum (elsewhere, a partial
    sum); returns x."""
    me, n, root = dist.get_rank(group), dist.get_world_size(group), _group_rank(group, dst)
    buf = torch.empty_like(x)
    for kind, peer in reversed(binomial_tree(me, n, root)):
        if kind == "send":                             # a child: receive its partial sum and add it in
            dist.recv(buf, _global(group, peer), group=group)
            x += buf
        else:                                          # my parent: send it my partial sum
            dist.send(x, _global(group, peer), group=group)
    return x


# ---- demo ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def p2p_bytes():
    """Count the bytes dist.send and dist.recv move on this rank inside the block: {"send": B, "recv": B}.
    CommDebugMode counts collectives but not send/recv, so the demo wraps these two for the block's duration."""
    moved, originals = {"send": 0, "recv": 0}, {"send": dist.send, "recv": dist.recv}

    def counting(name):
        def call(tensor, *args, **kwargs):
            moved[name] += tensor.nbytes
            return originals[name](tensor, *args, **kwargs)
        return call

    dist.send, dist.recv = counting("send"), counting("recv")
    try:
        yield moved
    finally:
        dist.send, dist.recv = originals["send"], originals["recv"]


def main():
    from common import setup, finish, log, log_all, head
    rank, W, device = setup()
    f64 = dict(dtype=torch.float64, device=device)
    ints = lambda *shape, lo=-9, hi=10: torch.randint(lo, hi, shape, device=device).double()  # exact in float64
    ceil_log2 = lambda n: math.ceil(math.log2(n))

    def everywhere(value):                             # the sum over ranks of a number, on every rank
        t = torch.tensor([float(value)], **f64)
        dist.all_reduce(t)
        return t

    head("1. broadcast: rank 0's checkpoint to every rank")
    H = 8

    def model(seed):                                   # a tiny model whose weights and buffer depend on `seed`
        m, g = torch.nn.Linear(H, H, **f64), torch.Generator().manual_seed(seed)
        m.register_buffer("step", torch.full((1,), float(seed), **f64))
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        return m

    mine, ckpt = model(seed=100 + rank), model(seed=100)  # every rank starts different; ckpt = rank 0's state
    same = lambda: all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), ckpt.state_dict().values()))
    assert same() == (rank == 0)
    broadcast_module(mine, src=0)
    assert same()
    V = sum(t.nbytes for t in mine.state_dict().values())
    log(f"every rank holds rank 0's weights and buffer ({V} B), bit for bit; before, only rank 0 did")

    head("2. scatter: rank i gets slice i of the root's tensor")
    full = torch.arange(2 * W * 3, **f64).reshape(2 * W, 3)  # [2W, 3], on every rank; read on the root only
    part = scatter_along_dim(full if rank == 0 else None, torch.empty(2, 3, **f64), dim=0)  # [2, 3]
    assert torch.equal(part, full[2 * rank:2 * rank + 2])  # rank i => rows 2i, 2i+1
    log_all(f"rows {2 * rank}..{2 * rank + 1}: {part.flatten().tolist()}")
    root_sends = sum(s.nbytes for i, s in enumerate(full.chunk(W)) if i != 0)
    assert root_sends == (W - 1) * full.nbytes // W and part.nbytes == full.nbytes // W
    log(f"the root must send the W-1 other slices, (W-1)/W V = {root_sends} B of V = {full.nbytes} B; every other"
        f" rank receives V/W = {part.nbytes} B")

    head("3. gather along the last dim: vocab-sharded logits to rank 0")
    B, S, v = 2, 3, 4                                      # rank r holds logits[..., r*v:(r+1)*v]
    logits = torch.arange(B * S * v * W, **f64).reshape(B, S, v * W)  # [B, S, vocab], the reference
    shard = logits[..., rank * v:(rank + 1) * v]       # [B, S, v]
    got = gather_along_dim(shard, dim=-1)
    if rank == 0:
        assert got.shape == (B, S, v * W) and torch.equal(got, logits)
        assert got.nbytes - shard.nbytes == (W - 1) * logits.nbytes // W  # what arrived from the others
    else:
        assert got is None
    assert torch.equal(shard, logits[..., rank * v:(rank + 1) * v])  # the input is untouched
    log(f"rank 0 holds [{B}, {S}, {v * W}] == the full logits, the others None; the root must receive the W-1 "
        f"other shards, (W-1)/W V = {(W - 1) * logits.nbytes // W} B; every other rank sends V/W = {shard.nbytes} B")

    head("4. reduce with SUM and MAX to rank 0: collecting the loss")
    token_losses = [torch.rand(r + 1, **f64) * 4 for r in range(W)]  # rank r has r+1 tokens: counts differ
    my_losses = token_losses[rank]
    total = reduce_to(torch.stack([my_losses.sum(), torch.tensor(my_losses.numel(), **f64)]), dst=0)  # [sum, n]
    worst = reduce_to(my_losses.max(), dst=0, op=dist.ReduceOp.MAX)
    every = torch.cat(token_losses)                    # reference: all tokens in one process
    if rank == 0:
        torch.testing.assert_close(total[0] / total[1], every.mean())
        assert torch.equal(worst, every.max()) and total[1] == every.numel()
    else:
        assert total is None and worst is None
    mean_of_means = torch.stack([t.mean() for t in token_losses]).mean()
    assert W == 1 or not torch.isclose(mean_of_means, every.mean())
    log(f"rank 0: loss per token = sum/count = {every.mean():.4f} over {every.numel()} tokens, max {every.max():.4f};"
        f" the others None")
    log(f"reduce [sum, count], not the mean: the mean of per-rank means ({mean_of_means:.4f}) weights ranks, "
        f"not tokens")

    head("5. transposed pairs: broadcast^T = reduce-sum, scatter^T = gather (the backward of each)")
    x, y = ints(5), ints(5) + 10 * rank                # x is read on rank 0 only; y differs on every rank
    bx, ry = x.clone(), reduce_to(y, dst=0)
    dist.broadcast(bx, 0)
    lhs, rhs = everywhere(bx @ y), everywhere(x @ ry if rank == 0 else 0)
    assert torch.equal(lhs, rhs)                       # sum_r <broadcast(x), y_r> == <x, reduce(y)>
    xs, ys = ints(2 * W), ints(2) + 10 * rank
    sx, gy = scatter_along_dim(xs, torch.empty(2, **f64), dim=0), gather_along_dim(ys, dim=0)
    assert torch.equal(everywhere(sx @ ys), everywhere(xs @ gy if rank == 0 else 0))
    log("sum over ranks <broadcast(x), y> == <x, reduce(y)>, <scatter(x), y> == <x, gather(y)>: exact")
    log("so in autograd: the gradient of a broadcast is the reduce-sum of the ranks' gradients, on the root")

    head("6. broadcast and reduce by hand: flat vs binomial tree, bytes each rank sends and receives")
    for n in range(1, 10):                             # the tree's plan, played for every size and root
        for root in range(n):
            plans = [binomial_tree(me, n, root) for me in range(n)]
            sends = sorted((me, peer) for me in range(n) for kind, peer in plans[me] if kind == "send")
            recvs = sorted((peer, me) for me in range(n) for kind, peer in plans[me] if kind == "recv")
            assert sends == recvs and sorted(b for _, b in sends) == [r for r in range(n) if r != root]
            assert len(plans[root]) == ceil_log2(n)
            assert all(plans[me][0][0] == "recv" for me in range(n) if me != root)  # receive, then pass on
    log("tree played for 1..9 ranks, every root: each non-root receives once, before it sends; the root sends "
        "ceil(log2 n) times")
    sub = dist.new_group(list(range(W - 1))) if W >= 4 else None  # W-1 ranks: not a power of two
    cases = [(None, list(range(W)), 0)] + ([(None, list(range(W)), W - 1)] if W > 1 else [])
    cases += [(sub, list(range(W - 1)), W - 2)] if sub is not None else []
    hand_built = (("broadcast", "flat", broadcast_flat), ("broadcast", "tree", broadcast_binomial),
                  ("reduce", "flat", reduce_flat), ("reduce", "tree", reduce_binomial))
    for group, members, src in cases:
        x = ints(5) + 10 * rank                        # differs on every rank; drawn on all, so seeds stay in step
        if rank not in members:
            continue
        n, root, V = len(members), members.index(src), x.nbytes
        ref = {"broadcast": x.clone(), "reduce": x.clone()}
        dist.broadcast(ref["broadcast"], src, group=group)
        dist.reduce(ref["reduce"], src, group=group)
        moved = {}                                     # (op, algo) -> [V sent per rank, V received per rank]
        for op, algo, fn in hand_built:
            with p2p_bytes() as b:
                y = fn(x.clone(), src, group)
            if op == "broadcast" or rank == src:       # exact: integer-valued float64, any summation order
                assert torch.equal(y, ref[op]), (op, algo)
            counts = torch.empty(2 * n, dtype=torch.int64, device=device)
            dist.all_gather_single(counts, torch.tensor([b["send"], b["recv"]], device=device), group=group)
            moved[op, algo] = (counts.view(n, 2) // V).T.tolist()
        only_root = lambda k: [k * (i == root) for i in range(n)]
        not_root = [int(i != root) for i in range(n)]
        children = [sum(1 for j in range(rel.bit_length(), ceil_log2(n)) if rel + 2 ** j < n)
                    for rel in ((i - root) % n for i in range(n))]
        assert moved["broadcast", "flat"] == [only_root(n - 1), not_root]
        assert moved["broadcast", "tree"] == [children, not_root] and children[root] == ceil_log2(n)
        for algo in ("flat", "tree"):                  # reduce is broadcast transposed: every arrow reversed
            assert moved["reduce", algo] == moved["broadcast", algo][::-1]
        where = f"{'sub-group of ' if group is not None else ''}{n} rank{'s' * (n > 1)}, root {src}"
        log(f"{where}: == dist.broadcast, dist.reduce; in V = {V} B, broadcast sends per rank: "
            f"flat {moved['broadcast', 'flat'][0]}, tree {moved['broadcast', 'tree'][0]}")
        log(f"{' ' * len(where)}  reduce receives per rank: flat {moved['reduce', 'flat'][1]}, "
            f"tree {moved['reduce', 'tree'][1]}: the broadcast's sends, transposed")
    log("the root sends (broadcast) or receives (reduce) (W-1) V flat, ceil(log2 W) V as a tree; (W-1) V in all")

    finish("broadcast, scatter, gather along a dim, reduce SUM/MAX, their transposes, flat vs tree broadcast "
           "and reduce")


if __name__ == "__main__":
    main()
