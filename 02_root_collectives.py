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

Roots (src, dst) are global ranks, as torch.distributed takes them, also when `group` is a sub-group.

Run:  torchrun --nproc-per-node=4 02_root_collectives.py
tests/check_02.py proves beyond it: sub-groups, other roots, strided and mixed layouts, bf16, tree plans, refusals.
"""
import torch
import torch.distributed as dist


# ---- building blocks: paste from here to the demo marker (they need only torch) ----------------------------
def _group_rank(group, global_rank):
    return global_rank if group is None else dist.get_group_rank(group, global_rank)


def _global(group, group_rank):
    """send/recv take global ranks; translate a rank within `group`."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def broadcast_module(module, src=0, group=None):
    """Overwrite every parameter and buffer with the src rank's, as DDP does at construction."""
    with torch.no_grad():
        for t in module.state_dict().values():
            buf = t.contiguous()
            dist.broadcast(buf, src, group=group)
            if buf is not t:                           # a strided parameter or buffer: write the result back
                t.copy_(buf)


def scatter_along_dim(full, out, dim, src=0, group=None):
    """Slice i (along dim) of src's `full` lands in group rank i's `out`; `full` is read on src only. Returns out."""
    n = dist.get_world_size(group)
    buf = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    if dist.get_rank() != src:
        dist.scatter(buf, None, src, group=group)
    else:
        if full.shape[dim] % n:
            raise ValueError(f"scatter: size {full.shape[dim]} of dim {dim} is not divisible by the group size {n}")
        slices = [s.contiguous() for s in full.chunk(n, dim)]
        if slices[0].shape != out.shape:
            raise ValueError(f"scatter: a slice has shape {tuple(slices[0].shape)}, out has {tuple(out.shape)}")
        dist.scatter(buf, slices, src, group=group)
    if buf is not out:
        out.copy_(buf)
    return out


def gather_along_dim(x, dim, dst=0, group=None):
    """Every rank's x concatenated along dim, in group rank order, on dst; None elsewhere."""
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
    """op over every rank's x, as a new tensor on dst; None elsewhere; x itself is untouched.
    (dist.reduce works in place, and gloo leaves partial sums in the other ranks' buffers.)"""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.reduce(out, dst, op=op, group=group)
    return out if dist.get_rank() == dst else None


def broadcast_flat(x, src=0, group=None):
    """dist.broadcast by hand, the naive way: src sends x to every other rank in turn. In place; returns x."""
    me, n, root = dist.get_rank(group), dist.get_world_size(group), _group_rank(group, src)
    buf = x.contiguous()
    if me != root:
        dist.recv(buf, src, group=group)
    else:
        for r in range(n):
            if r != root:
                dist.send(buf, _global(group, r), group=group)
    return x if buf is x else x.copy_(buf)


def reduce_flat(x, dst=0, group=None):
    """dist.reduce (SUM) by hand, the naive way: every other rank sends x to dst, which adds each one in.
    In place: x on dst becomes the sum, elsewhere it is left as it was; returns x."""
    me, n, root = dist.get_rank(group), dist.get_world_size(group), _group_rank(group, dst)
    buf = x.contiguous()
    if me != root:
        dist.send(buf, dst, group=group)
    else:
        incoming = torch.empty_like(buf)
        for r in range(n):
            if r != root:
                dist.recv(incoming, _global(group, r), group=group)
                buf += incoming
    return x if buf is x else x.copy_(buf)


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
    buf = x.contiguous()
    for kind, peer in binomial_tree(me, n, root):
        (dist.send if kind == "send" else dist.recv)(buf, _global(group, peer), group=group)
    return x if buf is x else x.copy_(buf)


def reduce_binomial(x, dst=0, group=None):
    """dist.reduce (SUM) by hand: binomial_tree played backwards, every arrow reversed. A rank adds its children's
    partial sums into x, then sends x to its parent. In place: x on dst becomes the sum (elsewhere, a partial
    sum); returns x."""
    me, n, root = dist.get_rank(group), dist.get_world_size(group), _group_rank(group, dst)
    buf = x.contiguous()
    incoming = torch.empty_like(buf)
    for kind, peer in reversed(binomial_tree(me, n, root)):
        if kind == "send":                             # a child: receive its partial sum and add it in
            dist.recv(incoming, _global(group, peer), group=group)
            buf += incoming
        else:                                          # my parent: send it my partial sum
            dist.send(buf, _global(group, peer), group=group)
    return x if buf is x else x.copy_(buf)


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
try:
    from common import finish, head, log, log_all, setup, traffic
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

F64 = torch.float64


def ints(seed, *shape, device):
    """Integer-valued float64 (sums are exact in any order), the same on every rank for the same seed."""
    return torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(seed)).to(device, F64)


def summed(v):
    """v summed over the ranks by PyTorch's own all-reduce: the reference for the transposes."""
    v = torch.as_tensor(v, dtype=F64).clone()
    dist.all_reduce(v)
    return v


def model(seed, device, H=8):
    """A tiny model whose weights and buffer depend on `seed`."""
    m, g = torch.nn.Linear(H, H, dtype=F64, device=device), torch.Generator().manual_seed(seed)
    m.register_buffer("step", torch.zeros(1, dtype=F64, device=device))
    with torch.no_grad():
        for t in m.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=g, dtype=F64))
    return m


def broadcast_section(rank, device):
    head("1. broadcast: rank 0's checkpoint to every rank")
    mine, ckpt = model(100 + rank, device), model(100, device)  # every rank's differs; ckpt: rank 0's, rebuilt
    same = lambda: all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), ckpt.state_dict().values()))
    assert same() == (rank == 0)
    with traffic() as t:
        broadcast_module(mine, src=0)
    assert same()
    V = sum(s.nbytes for s in mine.state_dict().values())
    assert t.bytes["broadcast"] == V                              # every rank hands in the V bytes, once
    log(f"every rank holds rank 0's weights and buffer ({V} B), bit for bit; before, only rank 0 did")


def scatter_section(rank, W, device):
    head("2. scatter: rank i gets slice i of the root's tensor")
    rows = torch.arange(2 * W * 3, dtype=F64, device=device).reshape(2 * W, 3)  # [2W, 3]: read on the root only
    out = torch.empty(2, 3, dtype=F64, device=device)
    with traffic() as t:
        scatter_along_dim(rows if rank == 0 else None, out, dim=0, src=0)
    assert torch.equal(out, rows[2 * rank:2 * rank + 2])          # slice i: rows 2i and 2i+1
    assert t.bytes["scatter"] == (rank == 0) * rows.nbytes        # the root hands in all W slices, V
    log_all(f"rows {2 * rank}..{2 * rank + 1}: {out.flatten().tolist()}")
    log(f"the root hands in V = {rows.nbytes} B, keeps its slice, sends (W-1)/W V = {rows.nbytes - out.nbytes} B; "
        f"every other rank receives V/W = {out.nbytes} B")


def gather_section(rank, W, device, B=2, S=3, v=4):
    head("3. gather along a dim: vocab-sharded logits (last dim), sequence-sharded hidden states (dim 1)")
    states = torch.arange(B * S * W * v, dtype=F64, device=device).reshape(B, S * W, v)  # [B, S*W, v]
    for dim, whole in ((-1, states.reshape(B, S, W * v)), (1, states)):  # logits [B, S, W*v]; states
        n = whole.shape[dim] // W
        shard = whole.narrow(dim, rank * n, n)                    # rank r's shard
        with traffic() as t:
            got = gather_along_dim(shard, dim, dst=0)
        assert torch.equal(got, whole) if rank == 0 else got is None
        assert t.bytes["gather"] == whole.nbytes // W             # every rank hands in V/W
    log(f"rank 0 holds the full [{B}, {S}, {v} * W] logits and [{B}, {S} * W, {v}] states, the others None; every "
        f"rank sends its V/W shard ({shard.nbytes} B), the root receives the W-1 others")


def reduce_section(rank, W, device):
    head("4. reduce with SUM and MAX to the root: collecting the loss")
    g = torch.Generator().manual_seed(4)
    token_losses = [torch.rand(r + 1, generator=g, dtype=F64).to(device) * 4 for r in range(W)]  # counts differ
    mine = token_losses[rank]
    stats = torch.tensor([mine.sum().item(), mine.numel()], dtype=F64, device=device)  # [sum, count], not the mean
    total = reduce_to(stats, dst=0)
    worst = reduce_to(mine.max(), dst=0, op=dist.ReduceOp.MAX)
    every = torch.cat(token_losses)                               # reference: every token in one process
    if rank == 0:
        torch.testing.assert_close(total[0] / total[1], every.mean())
        assert total[1] == every.numel() and torch.equal(worst, every.max())
    else:
        assert total is None and worst is None
    log("rank 0: loss per token = reduced sum / reduced count == the mean over every token, max == the max; the "
        "others None (reduce [sum, count], not each rank's mean: the counts differ)")


def transposes_section(rank, W, device):
    head("5. transposed pairs: broadcast^T = reduce-sum, scatter^T = gather (the backward of each)")
    x, y = ints(1, 2, 5, device=device), ints(2, 2, 5, device=device) + 10 * rank  # y differs on every rank
    bx, ry = x.clone(), reduce_to(y, dst=0)
    dist.broadcast(bx, 0)
    assert torch.equal(summed((bx * y).sum()), summed((x * ry).sum() if rank == 0 else 0))
    xs, ys = ints(3, 2 * W, 3, device=device), ints(4, 2, 3, device=device) + 10 * rank
    sx = scatter_along_dim(xs, torch.empty(2, 3, dtype=F64, device=device), 0, src=0)
    gy = gather_along_dim(ys, 0, dst=0)
    assert torch.equal(summed((sx * ys).sum()), summed((xs * gy).sum() if rank == 0 else 0))
    log("sum over ranks <broadcast(x), y> == <x, reduce(y)>, <scatter(x), y> == <x, gather(y)>: exact; so the "
        "gradient of a broadcast is the reduce-sum of the ranks' gradients, on the root")


def by_hand_section(rank, W, device):
    head("6. broadcast and reduce by hand: flat vs binomial tree, messages each rank sends and receives")
    x = ints(6, 5, device=device) + 10 * rank                     # differs on every rank
    ref = {"broadcast": x.clone(), "reduce": x.clone()}
    dist.broadcast(ref["broadcast"], 0)                           # PyTorch's own: the reference
    dist.reduce(ref["reduce"], 0)
    blocks = (("broadcast", "flat", broadcast_flat, W - 1), ("reduce", "flat", reduce_flat, W - 1),
              ("broadcast", "tree", broadcast_binomial, (W - 1).bit_length()),  # ceil(log2 W)
              ("reduce", "tree", reduce_binomial, (W - 1).bit_length()))
    mine = []                                                     # this rank's [messages of V bytes sent, received]
    for op, algo, fn, load in blocks:
        y = x.clone()
        with traffic() as t:
            fn(y, 0)
        if op == "broadcast" or rank == 0:                        # exact: integer-valued float64, any order
            assert torch.equal(y, ref[op]), (op, algo)
        mine.append([t.bytes["send"] // y.nbytes, t.bytes["recv"] // y.nbytes])
    per_rank = [torch.empty(4, 2, dtype=torch.int64, device=device) for _ in range(W)]
    dist.all_gather(per_rank, torch.tensor(mine, device=device))
    moved = {}
    for (op, algo, _, load), (sends, recvs) in zip(blocks, torch.stack(per_rank).transpose(0, 1).mT.tolist()):
        root_side, other_side = (sends, recvs) if op == "broadcast" else (recvs, sends)  # reduce: arrows reversed
        assert root_side[0] == load and other_side == [0] + [1] * (W - 1) and sum(sends) == sum(recvs) == W - 1
        moved[op, algo] = root_side
    assert all(moved["reduce", algo] == moved["broadcast", algo] for algo in ("flat", "tree"))  # the transpose
    log(f"== dist.broadcast and dist.reduce; broadcast sends per rank: flat {moved['broadcast', 'flat']}, tree "
        f"{moved['broadcast', 'tree']}; reduce receives the same; every other rank receives (sends) V once")


def main():
    rank, W, device = setup()
    broadcast_section(rank, device)
    scatter_section(rank, W, device)
    gather_section(rank, W, device)
    reduce_section(rank, W, device)
    transposes_section(rank, W, device)
    by_hand_section(rank, W, device)
    finish("broadcast, scatter, gather along a dim, reduce SUM/MAX == one process; their transposes; flat vs tree "
           "broadcast and reduce; bytes and messages == the closed forms")


if __name__ == "__main__":
    main()
