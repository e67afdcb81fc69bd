"""What this proves beyond 03's lesson, on the world and (from 3 ranks) on a sub-group whose group rank is not the
global rank ({0, 2, ..} and {1, 3, ..}), from non-contiguous inputs, in float64 and bf16 (integer values, every sum
exact):
- ring_all_reduce for V divisible by W, V % W != 0 and V < W: == the sum == dist.all_reduce, the input left as it
  was, outside autograd, every post on the group; each phase sends every chunk but one, to the byte, (W-1)/W * V
  within an element; its post order completes when replayed as blocking sends, every rank sending first (or
  receiving first) deadlocks;
- f, g and the sequence-parallel regions along dims 0, 1, 2, -1: forward and backward == dense autograd == torch's
  own differentiable collectives, one collective each way on the group of the bytes handed, the input untouched;
  mixed up, f(g(x)) under a loss counted once gives W times the gradient and g under a summed loss one term;
- the gather / reduce-scatter helpers with async_op=True; the refusals at their boundary (a length the group
  divides passes, one more or one less is refused in one line before any message);
- on gloo, the bytes each rank writes to its sockets (the kernel's count, headers included): 03's ring all-reduce,
  gloo's all-reduce and all-gather write the ring's closed forms within 1 %; gloo's reduce-scatter writes what its
  all-reduce writes, twice the ring's (W-1)/W * V (torch runs it as an all-reduce of the whole input, then keeps
  chunk r: ProcessGroupGloo::reduce_scatter_tensor_coalesced), so on gloo ZeRO's reduce-scatter costs DDP's bytes.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import finish, head, log, ring_bytes, setup, traffic  # noqa: E402
from tests.tools import lesson, refused, replays, strided_groups, written  # noqa: E402

m = lesson("03_allreduce_rs_ag.py")


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
        assert torch.equal(out, outs[r]) and torch.equal(leaf.grad, Xd.grad[r]), fn
        assert torch.equal(x.detach(), X[r])            # the input is left as it was
        if fn is op:                                    # one collective each way, on this group, of these bytes
            calls = lambda name, t: [(name, tuple(members), t.nbytes)] if name and G > 1 else []
            assert t_fwd.calls == calls(fwd, x) and t_bwd.calls == calls(bwd, out), (t_fwd.calls, t_bwd.calls)


def check_ring(rank, W, device, groups):
    head("ring all-reduce: V % W != 0, V < W, sub-groups, bf16; bytes per phase; post order as blocking sends")
    torch.manual_seed(2)
    runs = [(torch.float64, group, shape) for group in groups for shape in [(W, 3), (3 * W + 1,), (1,)]]
    for dtype, group, shape in runs + [(torch.bfloat16, groups[-1], (3 * W + 1,))]:
        # in the odd group global rank 3 is group rank 1; world: V divisible by W; V not (W > 1); V < W
        lo = 50 if dtype == torch.float64 else 8    # bf16: every partial sum an integer <= 8W, exact
        members, G, r = members_of(group)
        X = torch.randint(-lo, lo, (W, *shape), device=device).to(dtype)
        x = X[rank].clone().requires_grad_(shape == (1,))   # (1,): x itself, contiguous, requiring grad
        with traffic() as t:
            ring = m.ring_all_reduce(x if shape == (1,) else strided(x), group)
        assert not ring.requires_grad               # outside autograd: no silently wrong (identity) backward
        ref = X[rank].clone()
        dist.all_reduce(ref, group=group)
        assert ring.dtype == dtype and torch.equal(ring, X[members].sum(0)) and torch.equal(ring, ref)
        assert torch.equal(x, X[rank])              # a new tensor: the input is left as it was
        assert all(ranks == tuple(members) for _, ranks, _ in t.calls)     # every post on this group
        sent = [b for kind, _, b in t.calls if kind == "send"]
        V, e = X[rank].numel(), X.element_size()
        chunk = [V // G + (c < V % G) for c in range(G)]   # tensor_split's chunk sizes
        # reduce-scatter sends every chunk but r (the one it ends with), all-gather every chunk but r+1
        # (the last one it receives): each phase is (G-1)/G * V to within one element
        rs_b, ag_b = sum(sent[:G - 1]), sum(sent[G - 1:])
        assert len(sent) == 2 * (G - 1), sent
        assert rs_b == (V - chunk[r]) * e and ag_b == (V - chunk[(r + 1) % G]) * e, (rs_b, ag_b)
        assert abs(rs_b - ring_bytes("reduce_scatter", V * e, G)) < e
        assert abs(ag_b - ring_bytes("all_gather", V * e, G)) < e
        assert abs(rs_b + ag_b - ring_bytes("all_reduce", V * e, G)) < 2 * e
        if dtype != torch.float64:
            continue
        # the order this rank posted its sends (to r+1) and receives (from r-1), replayed as blocking ops
        posts = [None] * G
        dist.all_gather_object(posts, [kind for kind, _, _ in t.calls], group=group)
        peer = lambda g, k: (g + 1) % G if k == "send" else (g - 1) % G
        assert replays([[(k, peer(g, k)) for k in p] for g, p in enumerate(posts)]), posts
        for first in ("send", "recv"):              # every rank posting `first` first in each step deadlocks
            same = [[k for pair in zip(p[0::2], p[1::2]) for k in sorted(pair, key=lambda k: k != first)]
                    for p in posts]
            assert G == 1 or not replays([[(k, peer(g, k)) for k in p] for g, p in enumerate(same)]), same
    log("float64 and bf16, V = 3W, 3W+1, 1, world and sub-groups, non-contiguous: == the sum == dist.all_reduce;")
    log("each phase sends every chunk but one, (G-1)/G*V within an element; posts replay, all-send-first deadlocks")


def check_all_reduce(rank, W, device, groups, funcol):
    head("f and g: dense autograd, torch's own all_reduce, one all-reduce each way; mixed up, wrong gradients")
    torch.manual_seed(3)
    X = torch.randint(-9, 10, (W, 3, 4), dtype=torch.float64, device=device)
    Y = torch.randint(-9, 10, (W, 3, 4), dtype=torch.float64, device=device)
    summed = lambda Xd: Xd.sum(0, keepdim=True).expand_as(Xd)
    g = m.reduce_from_tensor_model_parallel_region
    fg = lambda t, group: m.copy_to_tensor_model_parallel_region(g(t, group), group)
    for dtype, group in [(torch.float64, g) for g in groups] + [(torch.bfloat16, groups[-1])]:
        members, G, r = members_of(group)
        Xt, Yt = X.to(dtype), Y.to(dtype)
        torch_ar = (lambda t: funcol.all_reduce(t, "sum", group or dist.group.WORLD)) if funcol else None
        check_collective(lambda t: g(t, group), Xt, Yt, summed, group, fwd="all_reduce", once=True)
        check_collective(lambda t: fg(t, group), Xt, Yt, summed, group, "all_reduce", "all_reduce", torch_ar)
        x = Xt[rank].clone().requires_grad_()       # mixing them gives the wrong gradient:
        fg(x, group).backward(Yt[members[0]])       # f(g(x)) under a loss counted once: G times it
        assert torch.equal(x.grad, G * Yt[members[0]])
        x.grad = None
        g(x, group).backward(Yt[rank])              # g under a summed loss: only this rank's term
        assert torch.equal(x.grad, Yt[rank])
    log("float64 (world, sub-groups) and bf16 (sub-groups): g (counted once), f(g(x)) (summed) == dense autograd"
        + (" == funcol.all_reduce" if funcol else "") + "; mixed up: G x the gradient, or this rank's term")


def check_gather_scatter(rank, W, device, groups, funcol):
    head("all-gather / reduce-scatter regions: dims 0, 1, 2, -1, sub-groups, bf16, torch's own, async_op")
    torch.manual_seed(4)
    for dtype, group in [(torch.float64, g) for g in groups] + [(torch.bfloat16, groups[-1])]:
        members, G, r = members_of(group)
        pg = group or dist.group.WORLD
        ints = lambda *shape: torch.randint(-9, 10, shape, device=device).to(dtype)
        for dim in (0, 1, 2, -1) if dtype == torch.float64 else (1,):
            X = ints(W, 2, 3, 4)
            gathered = lambda Xd: torch.stack([torch.cat(list(Xd), dim)] * len(Xd))
            Y = ints(W, *gathered(X[members]).shape[1:])
            torch_ag = (lambda t: funcol.all_gather_single(t, dim, pg)) if funcol else None
            check_collective(lambda t: m.gather_from_sequence_parallel_region(t, group, dim=dim), X, Y, gathered,
                             group, "all_gather", "reduce_scatter", torch_ag)
            shape = [2, 3, 4]
            shape[dim] *= G                             # reduce-scatter input: G blocks along dim
            scattered = lambda Xd: torch.stack(Xd.sum(0).chunk(len(Xd), dim))
            torch_rs = (lambda t: funcol.reduce_scatter_single(t, "sum", dim, pg)) if funcol else None
            check_collective(lambda t: m.reduce_scatter_to_sequence_parallel_region(t, group, dim=dim),
                             ints(W, *shape), ints(W, 2, 3, 4), scattered, group, "reduce_scatter", "all_gather",
                             torch_rs)
            if dim != 1 or dtype != torch.float64:
                continue
            # the helpers with async_op=True: (out, works), out == the dense result once the works are done
            Z = ints(W, *shape)
            for helper, t, want in ((m._gather_along_dim, X, gathered), (m._reduce_scatter_along_dim, Z, scattered)):
                out, works = helper(strided(t[rank]), dim, group, async_op=True)
                assert len(works) == (G > 1)
                for w in works:
                    w.wait()
                assert torch.equal(out, want(t[members])[r]), helper.__name__
    log("float64 (world, sub-groups; dims 0, 1, 2, -1) and bf16 (sub-groups, dim 1): fwd and bwd == dense autograd"
        + (" == funcol's" if funcol else "") + "; one collective each way; inputs untouched; async_op (dim 1) == dense")


def check_refusals(W, device, groups):
    head("refusals at their boundary: a length the group divides passes, one more or one less is refused")
    shown = None
    for group in groups:
        members, G, r = members_of(group)
        for dim in (0, 1, -1):
            shape = [2, 3, 5]
            for n in (G - 1, G, G + 1, 4 * G - 1, 4 * G, 4 * G + 1):   # around the smallest length and another
                shape[dim] = n
                x = torch.ones(shape, dtype=torch.float64, device=device)
                call = lambda: m.reduce_scatter_to_sequence_parallel_region(x, group, dim=dim)
                if n % G == 0 or G == 1:                # a group of one rank: x itself, whatever its length
                    assert call().shape[dim] == n // G
                    continue
                said = refused(call)
                assert said == f"x.shape[{dim}]={n} is not divisible by the group size {G}", said
                shown = shown or said
        assert m._divide("n", 4 * G, group) == 4
        if G > 1:
            assert refused(lambda: m._divide("n", 4 * G + 1, group)) == f"n={4 * G + 1} is not divisible by the " \
                                                                          f"group size {G}"
    log(f"dims 0, 1, -1, world and sub-groups: G and 4G pass, G-1, G+1, 4G-1, 4G+1 refused in one line, nothing sent"
        + (f" ({shown})" if shown else " (one rank: nothing to refuse)"))


def check_bytes_written(W, device):
    head("bytes each rank writes to its sockets (the kernel's count): the ring's closed forms; gloo's reduce-scatter")
    x = torch.ones(W << 14, dtype=torch.float64, device=device)   # V = W x 128 KiB, a ring's chunks well above
    V, out, full = x.nbytes, x.new_empty(1 << 14), torch.empty_like(x)   # a message's header (144 B on gloo)
    runs = {"03's ring all-reduce": lambda: m.ring_all_reduce(x), "all_reduce": lambda: dist.all_reduce(x),
            "all_gather": lambda: m.all_gather_single(full, out),
            "reduce_scatter": lambda: m.reduce_scatter_single(out, x)}
    wrote = {}
    for name, run in runs.items():
        dist.barrier()
        with written() as w:
            run()
        wrote[name] = w.bytes
    if None in wrote.values():                                   # not gloo, or not Linux
        log(f"skipped: on {dist.get_backend()} here the bytes written cannot be counted (tests/tools.written)")
        return "bytes written: not on this machine"
    ring = ring_bytes("all_reduce", V, W)
    for name, want in [("03's ring all-reduce", ring), ("all_reduce", ring),
                       ("all_gather", ring_bytes("all_gather", V, W))]:
        assert want <= wrote[name] <= 1.01 * want, (name, wrote[name], want)
    assert abs(wrote["reduce_scatter"] - wrote["all_reduce"]) <= 0.01 * ring, wrote   # an all-reduce inside
    log(f"V = {V} B: 03's ring, gloo's all-reduce and all-gather write the ring's 2(W-1)/W V, (W-1)/W V within 1 %; "
        + (f"gloo's reduce-scatter writes its all-reduce's {wrote['reduce_scatter']} B, not (W-1)/W V = "
           f"{ring_bytes('reduce_scatter', V, W):.0f}" if W > 1 else "one rank writes nothing"))
    return "bytes written == the ring's closed forms, gloo's reduce-scatter an all-reduce's"


def main():
    rank, W, device = setup()
    # the world, and {0, 2, ..} or {1, 3, ..} where group rank != rank (at W <= 2 a sub-group of one rank would
    # repeat the 1-rank run): bf16 runs on the last of them
    groups = [None] + ([strided_groups(2)[rank % 2][0]] if W > 2 else [])
    funcol = torch_functional_collectives()
    check_ring(rank, W, device, groups)
    check_all_reduce(rank, W, device, groups, funcol)
    check_gather_scatter(rank, W, device, groups, funcol)
    check_refusals(W, device, groups)
    wrote = check_bytes_written(W, device)
    finish("the ring (every V, sub-groups, bf16, bytes per phase, post order), f, g, AG, RS (every dim, bf16, "
           f"torch's own, async_op), the refusals at their boundary; {wrote}")


if __name__ == "__main__":
    main()
