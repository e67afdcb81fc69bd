"""What this proves beyond 02's lesson, on every case below (the world rooted at 0 and at W-1; the strided groups
{0, 2, ..} and {1, 3, ..} rooted at their last rank, so group rank != global rank; from W = 4 the first W-1 ranks,
not a power of two, rooted at W-2), each run side by side on its ranks:
- broadcast_module writes back into a strided (column-major) buffer in place; scatter along dim 0 and along dim 1
  of a transposed tensor into a non-contiguous `out`; gather of strided shards along dims -1 and 1; reduce_to
  leaves its input untouched; each block's traffic is exactly its one call kind, on the group, to the byte;
- the transposes with mixed layouts (odd group ranks hand in transposed views, even ones contiguous tensors);
- the hand-built flat and tree broadcast and reduce on strided views == dist.broadcast / dist.reduce, every call
  on the group, messages per rank == the closed form (a rank's children in the tree); reduce_flat leaves the
  other ranks' x as it was; the tree's plan for 1..9 ranks and every root replayed as blocking sends;
- every block in bf16 on the strided groups (integer values: exact);
- the refusals at their boundary, on every rank that calls them: scatter of 2n rows over n ranks passes, 2n - 1
  and 2n + 1 are refused (every rank its own root), a slice one column wider than `out` is refused; gather along
  dims -d..d-1 of a d-dim tensor passes, d and -d-1 are refused; nothing sent.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import finish, head, log, pg_timeout, setup, traffic  # noqa: E402
from tests.tools import lesson, refused, replays, strided_groups  # noqa: E402

m = lesson("02_root_collectives.py")
F64, BF16 = torch.float64, torch.bfloat16


def cases(W):
    """(group, its global ranks, root, dtypes), the same list on every rank; every rank makes every group.
    bf16 runs on the strided groups (where it meets group rank != global rank), float64 everywhere."""
    world, both = list(range(W)), (F64, BF16)
    out = [(None, world, 0, (F64,))] + ([(None, world, W - 1, (F64,))] if W > 1 else [])
    out += [(group, r, r[-1], both) for group, r in strided_groups(2)]
    out += [(dist.new_group(world[:-1], timeout=pg_timeout()), world[:-1], W - 2, (F64,))] if W >= 4 else []
    return out


def ints(seed, *shape, device, dtype=F64):
    """Integer values (sums are exact in any order), the same on every rank for the same seed."""
    return torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def variants(todo):
    """(case, dtype) for each of a case's dtypes."""
    return [(case[:4], dtype) for case in todo for dtype in case[4]]


def on(t, members, **counts):
    """The traffic `t` was exactly these calls, each on the group of `members`."""
    assert dict(t.counts) == {k: v for k, v in counts.items() if v}, (dict(t.counts), counts)
    assert all(ranks == tuple(members) for _, ranks, _ in t.calls), t.calls


def _all_reduce(t, group):
    dist.all_reduce(t, group=group)                    # PyTorch's own sum over the group: the reference
    return t


def model(seed, device, H=8, dtype=F64):
    """A tiny model whose weights and buffers depend on `seed`; one buffer is stored transposed (not contiguous)."""
    mod, g = torch.nn.Linear(H, H, dtype=dtype, device=device), torch.Generator().manual_seed(seed)
    mod.register_buffer("step", torch.zeros(1, dtype=dtype, device=device))
    mod.register_buffer("proj", torch.zeros(H, 3, dtype=dtype, device=device).T)  # [3, H], column-major
    with torch.no_grad():
        for t in mod.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=g, dtype=F64))
    return mod


def broadcast_cases(rank, device, todo):
    for (_, group, members, root), dtype in variants(todo):
        mine, ckpt = model(100 + rank, device, dtype=dtype), model(100 + root, device, dtype=dtype)
        same = lambda: all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), ckpt.state_dict().values()))
        assert same() == (rank == root)
        with traffic() as t:
            m.broadcast_module(mine, src=root, group=group)
        assert same() and not mine.proj.is_contiguous()   # written back into the strided buffer, in place
        on(t, members, broadcast=len(mine.state_dict()))
        assert t.bytes["broadcast"] == sum(s.nbytes for s in mine.state_dict().values())


def scatter_cases(rank, device, todo):
    for (_, group, members, root), dtype in variants(todo):
        n, i = len(members), members.index(rank)
        rows = (torch.arange(2 * n * 3, device=device).reshape(2 * n, 3) + 10 * root).to(dtype)  # [2n, 3]
        for dim, full, out in ((0, rows, torch.empty(2, 3, dtype=dtype, device=device)),
                               (1, rows.T, torch.empty(2, 3, dtype=dtype, device=device).T)):  # [3, 2n], [3, 2]
            with traffic() as t:
                part = m.scatter_along_dim(full if rank == root else None, out, dim, src=root, group=group)
            assert part is out and torch.equal(out, full.narrow(dim, 2 * i, 2))   # slice i: elements 2i, 2i+1
            on(t, members, scatter=1)
            assert t.bytes["scatter"] == (rank == root) * full.nbytes


def gather_cases(rank, device, todo, B=2, S=3, v=4):
    for (_, group, members, root), dtype in variants(todo):
        n, i = len(members), members.index(rank)
        full = (torch.arange(B * S * n * v, device=device).remainder(250).reshape(B, S * n, v)).to(dtype)
        for dim, whole in ((-1, full.reshape(B, S, n * v)), (1, full)):  # rank i's shard: a strided slice
            shard = whole.narrow(dim, i * whole.shape[dim] // n, whole.shape[dim] // n)
            with traffic() as t:
                got = m.gather_along_dim(shard, dim, dst=root, group=group)
            assert torch.equal(got, whole) if rank == root else got is None
            on(t, members, gather=1)
            assert t.bytes["gather"] == shard.nbytes == whole.nbytes // n


def reduce_cases(rank, device, todo):
    for k, group, members, root, _ in todo:
        g = torch.Generator().manual_seed(k)
        token_losses = [torch.rand(r + 1, generator=g, dtype=F64).to(device) * 4 for r in members]
        mine = token_losses[members.index(rank)]
        stats_of = lambda: torch.tensor([mine.sum().item(), mine.numel()], dtype=F64, device=device)
        stats = stats_of()
        with traffic() as t:
            total = m.reduce_to(stats, root, group=group)
            worst = m.reduce_to(mine.max(), root, op=dist.ReduceOp.MAX, group=group)
        assert torch.equal(stats, stats_of())                               # the input is untouched
        every = torch.cat(token_losses)
        if rank == root:
            torch.testing.assert_close(total[0] / total[1], every.mean())
            assert torch.equal(worst, every.max()) and total[1] == every.numel()
        else:
            assert total is None and worst is None
        on(t, members, reduce=2)
        assert t.bytes["reduce"] == 2 * 8 + 8
        y = (ints(k, 3, 2, device=device, dtype=BF16) + rank).T            # bf16, a transposed view
        got, y0 = m.reduce_to(y, root, group=group), y.clone()
        ref = _all_reduce(y.contiguous(), group)
        assert torch.equal(y, y0) and (torch.equal(got, ref) if rank == root else got is None)


def transposes(rank, device, todo):
    for k, group, members, root, _ in todo:
        n = len(members)
        everywhere = lambda v: _all_reduce(torch.tensor([float(v)], dtype=F64, device=device), group)
        odd = members.index(rank) % 2                    # odd group ranks hold transposed views, even ones do not
        y_of = lambda: (ints(k, 5, 2, device=device) + 10 * rank).T  # [2, 5], a transposed view; differs per rank
        x, y = ints(k, 2, 5, device=device), y_of() if odd else y_of().contiguous()
        bx, ry = x.clone(), m.reduce_to(y, dst=root, group=group)
        dist.broadcast(bx, root, group=group)
        lhs, rhs = everywhere((bx * y).sum()), everywhere((x * ry).sum() if rank == root else 0)
        assert torch.equal(lhs, rhs) and torch.equal(y, y_of())  # sum_r <broadcast(x), y_r> == <x, reduce(y)>
        xs, ys = ints(k, 2 * n, 3, device=device), (ints(k, 3, 2, device=device) + 10 * rank).T  # [2n, 3], [2, 3]
        ys = ys if odd else ys.contiguous()
        sx = m.scatter_along_dim(xs, torch.empty(2, 3, dtype=F64, device=device), 0, src=root, group=group)
        gy = m.gather_along_dim(ys, 0, dst=root, group=group)
        lhs, rhs = everywhere((sx * ys).sum()), everywhere((xs * gy).sum() if rank == root else 0)
        assert torch.equal(lhs, rhs)                      # sum_r <scatter(x)_r, y_r> == <x, gather(y)>


def tree_plans():
    for n in range(1, 10):                             # the tree's plan, played for every size and root
        for root in range(n):
            plans = [m.binomial_tree(me, n, root) for me in range(n)]
            sends = sorted((me, peer) for me in range(n) for kind, peer in plans[me] if kind == "send")
            recvs = sorted((peer, me) for me in range(n) for kind, peer in plans[me] if kind == "recv")
            assert sends == recvs and sorted(b for _, b in sends) == [r for r in range(n) if r != root]
            assert len(plans[root]) == (n - 1).bit_length()  # ceil(log2 n)
            assert all(plans[me][0][0] == "recv" for me in range(n) if me != root)  # receive, then pass on
            flip = {"send": "recv", "recv": "send"}            # reduce: each plan backwards, each arrow reversed
            assert replays(plans) and replays([[(flip[k], p) for k, p in reversed(pl)] for pl in plans])


def by_hand(rank, device, todo):
    hand_built = (("broadcast", "flat", m.broadcast_flat), ("broadcast", "tree", m.broadcast_binomial),
                  ("reduce", "flat", m.reduce_flat), ("reduce", "tree", m.reduce_binomial))
    for (k, group, members, src), dtype in variants(todo):
        n, root = len(members), members.index(src)
        x = ints(k, 5, device=device, dtype=dtype) + (10 if dtype == F64 else 1) * rank  # bf16: every sum exact
        ref = {"broadcast": x.clone(), "reduce": x.clone()}
        dist.broadcast(ref["broadcast"], src, group=group)
        dist.reduce(ref["reduce"], src, group=group)
        mine = []                                        # this rank's [V sent, V received] for each block
        for op, algo, fn in hand_built:
            y = torch.zeros(10, dtype=dtype, device=device)[::2].copy_(x)  # x in a strided view: written back into it
            with traffic() as t:
                assert fn(y, src, group) is y
            if op == "broadcast" or rank == src:
                assert torch.equal(y, ref[op]), (op, algo)
            elif algo == "flat":                         # reduce_flat leaves the other ranks' x as it was
                assert torch.equal(y, x), (op, algo)
            assert all(ranks == tuple(members) for _, ranks, _ in t.calls), t.calls
            mine.append([t.bytes["send"] // y.nbytes, t.bytes["recv"] // y.nbytes])
        per_rank = [torch.empty(4, 2, dtype=torch.int64, device=device) for _ in range(n)]
        dist.all_gather(per_rank, torch.tensor(mine, device=device), group=group)
        moved = {(op, algo): torch.stack(per_rank)[:, j].T.tolist()   # (op, algo) -> [sent per rank, received]
                 for j, (op, algo, _) in enumerate(hand_built)}
        only_root = [(n - 1) * (i == root) for i in range(n)]
        not_root = [int(i != root) for i in range(n)]
        children = [sum(1 for j in range(rel.bit_length(), (n - 1).bit_length()) if rel + 2 ** j < n)
                    for rel in ((i - root) % n for i in range(n))]
        assert moved["broadcast", "flat"] == [only_root, not_root]
        assert moved["broadcast", "tree"] == [children, not_root] and children[root] == (n - 1).bit_length()
        for algo in ("flat", "tree"):                    # reduce is broadcast transposed: every arrow reversed
            assert moved["reduce", algo] == moved["broadcast", algo][::-1]


def refusals(rank, W, device):
    """At each boundary: the last valid value runs for real on every rank, the first invalid one is refused on
    every rank that calls it (for scatter, every rank its own root), before any message."""
    out = torch.empty(2, 3, dtype=F64, device=device)
    m.scatter_along_dim(torch.zeros(2 * W, 3, dtype=F64, device=device) if rank == 0 else None, out, 0)  # 2W rows
    assert torch.equal(out, torch.zeros(2, 3, dtype=F64, device=device))
    for rows in (2 * W - 1, 2 * W + 1) if W > 1 else ():      # a group of 1 divides every size
        said = refused(lambda: m.scatter_along_dim(torch.zeros(rows, 3, dtype=F64, device=device), out, 0, src=rank))
        assert f"size {rows} of dim 0 is not divisible by the group size {W}" in said, said
    said = refused(lambda: m.scatter_along_dim(torch.zeros(2 * W, 4, dtype=F64, device=device), out, 0, src=rank))
    assert "slice has shape (2, 4), out has (2, 3)" in said, said
    said = refused(lambda: m.scatter_along_dim(torch.zeros(2 * W, 3, dtype=F64, device=device),  # same numel,
                                               torch.empty(3, 2, dtype=F64, device=device), 0, src=rank))  # transposed
    assert "slice has shape (2, 3), out has (3, 2)" in said, said
    x = torch.full((1, 2), float(rank), dtype=F64, device=device)
    rows = torch.arange(dist.get_world_size(), dtype=F64, device=device)[:, None]
    for dim, ref in ((-2, rows.expand(W, 2)), (1, rows.expand(W, 1).repeat(1, 2).view(1, 2 * W))):
        got = m.gather_along_dim(x, dim)                       # -x.dim() and x.dim() - 1: the ends of the range
        assert torch.equal(got, ref) if rank == 0 else got is None, (dim, got)
    for dim in (2, -3):                                        # one past each end
        said = refused(lambda: m.gather_along_dim(x, dim))
        assert f"dim {dim} is out of range for a 2-d tensor" in said, said


def main():
    rank, W, device = setup()
    todo = [(k, *case) for k, case in enumerate(cases(W)) if rank in case[1]]  # this rank's; run side by side
    head("broadcast, scatter, gather on every group and root, strided layouts, float64 and bf16")
    broadcast_cases(rank, device, todo)
    scatter_cases(rank, device, todo)
    gather_cases(rank, device, todo)
    log("broadcast_module into a strided buffer, scatter along dims 0 and 1, gather along -1 and 1: == reference; "
        "one call kind each, on the group, to the byte")

    head("reduce_to and the transposes, with mixed layouts across ranks")
    reduce_cases(rank, device, todo)
    transposes(rank, device, todo)
    log("reduce SUM/MAX == one process, input untouched, bf16 from a view; both adjoint identities exact with odd "
        "ranks transposed")

    head("flat and tree broadcast and reduce by hand; the tree's plan replayed")
    tree_plans()
    by_hand(rank, device, todo)
    log("== dist.broadcast / dist.reduce on strided views, float64 and bf16; messages per rank == flat and tree "
        "closed forms; plans for 1..9 ranks replay")

    head("refusals at their boundary, on every rank")
    refusals(rank, W, device)
    log((f"scatter of {2 * W} rows passes, {2 * W - 1} and {2 * W + 1} are refused; " if W > 1 else "")
        + "a slice wider than out is refused; gather along dims -2..1 of a 2-d tensor passes, 2 and -3 are refused")
    finish("02's blocks on sub-groups and roots other than 0, strided and mixed layouts, bf16; traffic to the "
           "call; tree plans replayed; refusals at their boundary")


if __name__ == "__main__":
    main()
