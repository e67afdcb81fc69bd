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
    from common import finish, head, log, log_all, pg_timeout, refused, replays, setup, strided_groups, traffic
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

F64 = torch.float64


# checking helpers (a reader may skip to the sections below): groups and roots, inputs, traffic asserts
def cases(W):
    """(group, its global ranks, root) to run every block on, the same list on every rank: the world rooted at 0
    and at W-1; the strided groups {0, 2, ..} and {1, 3, ..} rooted at their last rank (group rank != global
    rank); from W = 4 the first W-1 ranks (not a power of two) rooted at W-2. Every rank makes every group."""
    world = list(range(W))
    out = [(None, world, 0)] + ([(None, world, W - 1)] if W > 1 else [])
    out += [(group, r, r[-1]) for group, r in strided_groups(2)]
    out += [(dist.new_group(world[:-1], timeout=pg_timeout()), world[:-1], W - 2)] if W >= 4 else []
    return out


def ints(seed, *shape, device):
    """Integer-valued float64 (sums are exact in any order), the same on every rank for the same seed."""
    return torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(seed)).to(device, F64)


def on(t, members, **counts):
    """The traffic `t` was exactly these calls, each on the group of `members`."""
    assert dict(t.counts) == {k: v for k, v in counts.items() if v}, (dict(t.counts), counts)
    assert all(ranks == tuple(members) for _, ranks, _ in t.calls), t.calls


def _all_reduce(t, group):
    dist.all_reduce(t, group=group)                    # PyTorch's own sum over the group: the reference
    return t


def model(seed, device, H=8):
    """A tiny model whose weights and buffers depend on `seed`; one buffer is stored transposed (not contiguous)."""
    m, g = torch.nn.Linear(H, H, dtype=F64, device=device), torch.Generator().manual_seed(seed)
    m.register_buffer("step", torch.zeros(1, dtype=F64, device=device))
    m.register_buffer("proj", torch.zeros(H, 3, dtype=F64, device=device).T)  # [3, H], column-major
    with torch.no_grad():
        for t in m.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=g, dtype=F64))
    return m


def broadcast_section(rank, device, todo):
    head("1. broadcast: the root's checkpoint to every rank")
    for _, group, members, root in todo:
        mine, ckpt = model(100 + rank, device), model(100 + root, device)  # every rank different; ckpt = root's
        same = lambda: all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), ckpt.state_dict().values()))
        assert same() == (rank == root)
        with traffic() as t:
            broadcast_module(mine, src=root, group=group)
        assert same() and not mine.proj.is_contiguous()   # written back into the strided buffer, in place
        V = sum(s.nbytes for s in mine.state_dict().values())
        on(t, members, broadcast=len(mine.state_dict()))
        assert t.bytes["broadcast"] == V
    log(f"every rank holds the root's weights and buffers ({V} B), bit for bit; before, only the root did; "
        f"roots 0 and W-1 of the world, the last rank of each sub-group")


def scatter_section(rank, device, todo):
    head("2. scatter: rank i gets slice i of the root's tensor, along dim 0 and along dim 1")
    for _, group, members, root in todo:
        n, i = len(members), members.index(rank)
        rows = torch.arange(2 * n * 3, dtype=F64, device=device).reshape(2 * n, 3) + 1000 * root  # [2n, 3]
        for dim, full, out in ((0, rows, torch.empty(2, 3, dtype=F64, device=device)),
                               (1, rows.T, torch.empty(2, 3, dtype=F64, device=device).T)):  # [3, 2n], [3, 2]: views
            with traffic() as t:
                part = scatter_along_dim(full if rank == root else None, out, dim, src=root, group=group)
            assert part is out and torch.equal(out, full.narrow(dim, 2 * i, 2))   # slice i: elements 2i, 2i+1
            on(t, members, scatter=1)
            assert t.bytes["scatter"] == (rank == root) * full.nbytes  # the root hands in all n slices, V
        if group is None and root == 0:
            log_all(f"rows {2 * i}..{2 * i + 1}: {rows[2 * i:2 * i + 2].flatten().tolist()}")
            V, sent = rows.nbytes, rows.nbytes - out.nbytes   # the root keeps its own slice
    log(f"the root hands in V = {V} B, keeps its slice, sends (W-1)/W V = {sent} B; every other rank receives "
        f"V/W = {V - sent} B; also the transposed (non-contiguous) tensor along dim 1")
    if rank == 0:   # misuse is refused on the root before any message leaves (so no other rank calls here)
        W, out = dist.get_world_size(), torch.empty(2, 3, dtype=F64, device=device)
        for rows, cols in ((2 * W - 1, 3), (2 * W, 4)):              # not divisible by W; slices of [2, 4]
            refused(lambda: scatter_along_dim(torch.zeros(rows, cols, dtype=F64, device=device), out, 0))
        log(f"refused on the root, nothing sent: {2 * W - 1} rows over {W} ranks, a slice that does not fit `out`")


def gather_section(rank, device, todo, B=2, S=3, v=4):
    head("3. gather along a dim: vocab-sharded logits (last dim), sequence-sharded hidden states (dim 1)")
    for _, group, members, root in todo:
        n, i = len(members), members.index(rank)
        full = torch.arange(B * S * n * v, dtype=F64, device=device).reshape(B, S * n, v) + 1000 * root
        for dim, whole in ((-1, full.reshape(B, S, n * v)), (1, full)):  # rank i's shard: a strided slice
            shard = whole.narrow(dim, i * whole.shape[dim] // n, whole.shape[dim] // n)
            with traffic() as t:
                got = gather_along_dim(shard, dim, dst=root, group=group)
            assert torch.equal(got, whole) if rank == root else got is None
            on(t, members, gather=1)
            assert t.bytes["gather"] == shard.nbytes == whole.nbytes // n    # every rank hands in V/W
    x = torch.full((1, 2), float(rank), dtype=F64, device=device)            # dim -2 = -x.dim(), i.e. dim 0
    got, W = gather_along_dim(x, -2), dist.get_world_size()
    ref = torch.arange(W, dtype=F64, device=device)[:, None].expand(W, 2)    # row r: rank r's x
    assert torch.equal(got, ref) if rank == 0 else got is None
    refused(lambda: gather_along_dim(x, 2))                                  # every rank refuses, none sends
    log("gather along dim -2 of a 2-d tensor == along dim 0; along dim 2 refused on every rank, nothing sent")
    log(f"the root holds the full [{B}, {S}, {v} * W] logits and [{B}, {S} * W, {v}] states, the others None; every "
        f"rank sends its V/W shard ({shard.nbytes} B), the root receives the W-1 others")


def reduce_section(rank, device, todo):
    head("4. reduce with SUM and MAX to the root: collecting the loss")
    for k, group, members, root in todo:
        g = torch.Generator().manual_seed(k)
        token_losses = [torch.rand(r + 1, generator=g, dtype=F64).to(device) * 4 for r in members]  # counts differ
        mine = token_losses[members.index(rank)]
        stats_of = lambda: torch.tensor([mine.sum().item(), mine.numel()], dtype=F64, device=device)
        stats = stats_of()                                                  # [sum, count], not the mean
        with traffic() as t:
            total = reduce_to(stats, root, group=group)
            worst = reduce_to(mine.max(), root, op=dist.ReduceOp.MAX, group=group)
        assert torch.equal(stats, stats_of())                               # the input is untouched
        every = torch.cat(token_losses)                                     # reference: all tokens in one process
        if rank == root:
            torch.testing.assert_close(total[0] / total[1], every.mean())
            assert torch.equal(worst, every.max()) and total[1] == every.numel()
        else:
            assert total is None and worst is None
        on(t, members, reduce=2)
        assert t.bytes["reduce"] == 2 * 8 + 8
    log("the root: loss per token = reduced sum / reduced count == the mean over every token, max == the max; "
        "the others None")
    log("reduce [sum, count], not each rank's mean: ranks hold different token counts")


def transposes_section(rank, device, todo):
    head("5. transposed pairs: broadcast^T = reduce-sum, scatter^T = gather (the backward of each)")
    for k, group, members, root in todo:
        n = len(members)
        everywhere = lambda v: _all_reduce(torch.tensor([float(v)], dtype=F64, device=device), group)
        odd = members.index(rank) % 2                    # odd group ranks hold transposed views, even ones do not
        y_of = lambda: (ints(k, 5, 2, device=device) + 10 * rank).T  # [2, 5], a transposed view; differs per rank
        x, y = ints(k, 2, 5, device=device), y_of() if odd else y_of().contiguous()
        bx, ry = x.clone(), reduce_to(y, dst=root, group=group)
        dist.broadcast(bx, root, group=group)
        lhs, rhs = everywhere((bx * y).sum()), everywhere((x * ry).sum() if rank == root else 0)
        assert torch.equal(lhs, rhs) and torch.equal(y, y_of())  # sum_r <broadcast(x), y_r> == <x, reduce(y)>
        xs, ys = ints(k, 2 * n, 3, device=device), (ints(k, 3, 2, device=device) + 10 * rank).T  # [2n, 3], [2, 3]
        ys = ys if odd else ys.contiguous()
        sx = scatter_along_dim(xs, torch.empty(2, 3, dtype=F64, device=device), 0, src=root, group=group)
        gy = gather_along_dim(ys, 0, dst=root, group=group)
        lhs, rhs = everywhere((sx * ys).sum()), everywhere((xs * gy).sum() if rank == root else 0)
        assert torch.equal(lhs, rhs)                      # sum_r <scatter(x)_r, y_r> == <x, gather(y)>
    log("sum over ranks <broadcast(x), y> == <x, reduce(y)>, <scatter(x), y> == <x, gather(y)>: exact")
    log("so in autograd: the gradient of a broadcast is the reduce-sum of the ranks' gradients, on the root")


def tree_plans():
    for n in range(1, 10):                             # the tree's plan, played for every size and root
        for root in range(n):
            plans = [binomial_tree(me, n, root) for me in range(n)]
            sends = sorted((me, peer) for me in range(n) for kind, peer in plans[me] if kind == "send")
            recvs = sorted((peer, me) for me in range(n) for kind, peer in plans[me] if kind == "recv")
            assert sends == recvs and sorted(b for _, b in sends) == [r for r in range(n) if r != root]
            assert len(plans[root]) == (n - 1).bit_length()  # ceil(log2 n)
            assert all(plans[me][0][0] == "recv" for me in range(n) if me != root)  # receive, then pass on
            flip = {"send": "recv", "recv": "send"}            # reduce: each plan backwards, each arrow reversed
            assert replays(plans) and replays([[(flip[k], p) for k, p in reversed(pl)] for pl in plans])
    log("tree played for 1..9 ranks, every root: each non-root receives once, before it sends; the root sends "
        "ceil(log2 n) times; broadcast's and reduce's orders replay to the end as blocking sends")


def by_hand_section(rank, device, todo):
    head("6. broadcast and reduce by hand: flat vs binomial tree, bytes each rank sends and receives")
    tree_plans()
    hand_built = (("broadcast", "flat", broadcast_flat), ("broadcast", "tree", broadcast_binomial),
                  ("reduce", "flat", reduce_flat), ("reduce", "tree", reduce_binomial))
    for k, group, members, src in todo:
        n, root = len(members), members.index(src)
        x = ints(k, 5, device=device) + 10 * rank        # differs on every rank
        ref = {"broadcast": x.clone(), "reduce": x.clone()}
        dist.broadcast(ref["broadcast"], src, group=group)
        dist.reduce(ref["reduce"], src, group=group)
        moved = {}                                       # (op, algo) -> [V sent per rank, V received per rank]
        for op, algo, fn in hand_built:
            y = torch.zeros(10, dtype=F64, device=device)[::2].copy_(x)  # x in a strided view: written back into it
            with traffic() as t:
                assert fn(y, src, group) is y
            if op == "broadcast" or rank == src:         # exact: integer-valued float64, any summation order
                assert torch.equal(y, ref[op]), (op, algo)
            assert all(ranks == tuple(members) for _, ranks, _ in t.calls), t.calls
            per_rank = [None] * n
            dist.all_gather_object(per_rank, (t.bytes["send"] // y.nbytes, t.bytes["recv"] // y.nbytes), group=group)
            moved[op, algo] = [list(c) for c in zip(*per_rank)]
        only_root = [(n - 1) * (i == root) for i in range(n)]
        not_root = [int(i != root) for i in range(n)]
        children = [sum(1 for j in range(rel.bit_length(), (n - 1).bit_length()) if rel + 2 ** j < n)
                    for rel in ((i - root) % n for i in range(n))]
        assert moved["broadcast", "flat"] == [only_root, not_root]
        assert moved["broadcast", "tree"] == [children, not_root] and children[root] == (n - 1).bit_length()
        for algo in ("flat", "tree"):                    # reduce is broadcast transposed: every arrow reversed
            assert moved["reduce", algo] == moved["broadcast", algo][::-1]
        if group is None:
            log(f"{n} rank{'s' * (n > 1)}, root {src}: == dist.broadcast, dist.reduce; in V = {y.nbytes} B, "
                f"broadcast sends per rank: flat {moved['broadcast', 'flat'][0]}, tree {moved['broadcast', 'tree'][0]}")
    log("reduce receives per rank what broadcast sends, transposed; the same on every sub-group and root")
    log("the root sends (broadcast) or receives (reduce) (W-1) V flat, ceil(log2 W) V as a tree; (W-1) V in all")


def main():
    rank, W, device = setup()
    todo = [(k, *case) for k, case in enumerate(cases(W)) if rank in case[1]]  # this rank's; run side by side
    broadcast_section(rank, device, todo)
    scatter_section(rank, device, todo)
    gather_section(rank, device, todo)
    reduce_section(rank, device, todo)
    transposes_section(rank, device, todo)
    by_hand_section(rank, device, todo)
    finish("broadcast, scatter and gather along dims 0/1/-1, reduce SUM/MAX, their transposes, flat vs tree "
           "broadcast and reduce; on the world and on sub-groups, roots other than 0, strided inputs")


if __name__ == "__main__":
    main()
