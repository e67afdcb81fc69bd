"""What this proves beyond 04's lesson, on the world and (from 4 ranks) on a sub-group whose group rank is not the
global rank ({0, 2, ..} and {1, 3, ..}), from non-contiguous inputs:
- all-to-all, equal and ragged blocks (some empty), float64 and bf16: the blocks land transposed, the gradient's go
  back transposed, one all-to-all each way on the group of the bytes handed; of V handed, (W-1)/W * V leave;
- the MoE layer == one process for k = 1, 2 and E (every expert), without capacity, at cf 0.5, at the smallest cf
  (C = 1) and at cf = E/k (C = N: nothing can drop), ragged and padded: output, d input, d router, d every expert;
  the kept assignments are the reference's and follow the rule (at most C per expert, only a full expert drops);
  three all-to-alls forward (+ the all-reduce MAX when the padded path finds C), two backward, all on the group,
  of the bytes the docstring's formulas give;
- identity experts with gates 1/k, float64 and bf16: combine(dispatch(x)) == x and dx == dy exactly, and each
  expert runs on exactly the rows routed to it, never a padding row;
- every refusal at its boundary, on the world and the sub-group: the last valid value passes, the first invalid one
  is refused in one line before any message, on every rank.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from common import finish, head, launched_world_size, log, refuse, ring_bytes, setup, traffic  # noqa: E402
from tests.tools import lesson, refused, strided_groups  # noqa: E402

m = lesson("04_all_to_all_moe.py")
E, H, FFN, N = m.E, m.H, m.FFN, m.N              # experts, hidden size, expert hidden size, tokens per rank
F64 = torch.float64


def members_of(group):
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    return members, len(members), dist.get_rank(group)


def strided(t):
    """t's values as a non-contiguous view: stored transposed (2-d and up), or every other element (1-d)."""
    return t.mT.contiguous().mT if t.dim() > 1 else torch.stack([t, torch.zeros_like(t)], -1)[..., 0]


class CountingIdentity(nn.Module):
    """An identity expert that counts the rows it is handed (padding rows must not reach it)."""
    rows = 0

    def forward(self, x):
        self.rows += x.shape[0]
        return x


def moe_against_one_process(k, cf, group, device):
    """One MoE in one process on the group's tokens, then its expert-parallel shards on both dispatch paths:
    the output and the gradients of the input, the router and every expert must agree, the drops must follow
    the capacity rule, and each path must hand the collectives the bytes the docstring's formula gives.
    Returns those bytes and the routing."""
    members, G, r = members_of(group)
    torch.manual_seed(k)                        # the same weights and tokens on every rank
    kw = dict(device=device, dtype=F64)
    router, experts = nn.Linear(H, E, bias=False, **kw), [m.make_expert(H, FFN, **kw) for _ in range(E)]
    X = torch.randn(dist.get_world_size(), N, H, **kw)[members].flatten(0, 1).requires_grad_()  # group rank r:
    dY = torch.randn(X.shape, **kw)                                         # rows r*N .. r*N+N-1; upstream grad
    cap = None if cf is None else math.ceil(cf * N * k / E)                 # the docstring's C
    ref, idx, keep = m.reference_moe(X, router, experts, k, cap, N)
    (ref * dY).sum().backward()

    L, mine = E // G, slice(r * N, (r + 1) * N)
    held = nn.ModuleList(experts[r * L:(r + 1) * L])                        # the experts this rank holds
    # the formula's rows, from the reference's routing: ragged moves the kept ones, padded E*C each way
    k_out, k_in = int(keep[mine].sum()), int((keep & (idx // L == r)).sum())
    C = cap if cap is not None else max(int(idx[s * N:(s + 1) * N].flatten().bincount(minlength=E).max())
                                        for s in range(G))                  # the largest count, over ranks
    rows = {"ragged": k_out + k_in, "padded": 2 * E * C}
    handed, d_router = {}, []
    for path in ("ragged", "padded"):
        moe = m.ExpertParallelMoE(H, FFN, E, k, cf, path == "padded", group=group, **kw)
        moe.router.load_state_dict(router.state_dict())
        moe.experts.load_state_dict(held.state_dict())
        x = X.detach()[mine].clone().requires_grad_()
        with traffic() as fwd:
            out = moe(strided(x))                                           # a non-contiguous input
        with traffic() as bwd:
            (out * dY[mine]).sum().backward()
        kept, chosen = moe.stats["keep"], idx[mine]
        if cap is not None:                     # the rule: at most C per expert, and only a full expert drops
            per_expert = chosen[kept].bincount(minlength=E)
            assert per_expert.max() <= cap and bool((per_expert[chosen[~kept]] == cap).all()), f"{path}: rule"
        assert torch.equal(kept, keep[mine]), f"{path}: dropped other assignments than the reference"
        assert moe.stats["dropped"] == int((~keep[mine]).sum())
        torch.testing.assert_close(out, ref[mine])
        torch.testing.assert_close(x.grad, X.grad[mine])
        for (name, p), p_ref in zip(moe.experts.named_parameters(), held.parameters()):  # no sum over ranks:
            torch.testing.assert_close(p.grad, p_ref.grad, msg=f"{path}: d expert param {name}")  # all came here
        d_router.append(moe.router.weight.grad)
        # forward: counts, dispatch, combine (+ the all-reduce MAX that finds C); backward: combine, dispatch
        find_C = 8 if path == "padded" and cf is None else 0
        a2a = 1 if G > 1 else 0                                             # one rank: no all-to-all runs
        want = {**({"all_to_all": 3} if a2a else {}), **({"all_reduce": 1} if find_C else {})}
        assert dict(fwd.counts) == want, f"{path}: forward {fwd.counts}"
        assert dict(bwd.counts) == ({"all_to_all": 2} if a2a else {}), f"{path}: backward {bwd.counts}"
        assert all(ranks == tuple(members) for _, ranks, _ in fwd.calls + bwd.calls), f"{path}: not on the group"
        assert fwd.bytes.total() == a2a * (8 * E + rows[path] * H * 8) + find_C, f"{path}: {fwd.bytes} forward"
        assert bwd.bytes.total() == a2a * rows[path] * H * 8, f"{path}: handed {bwd.bytes} backward"
        handed[path] = fwd.bytes.total()
    assert handed["ragged"] <= handed["padded"], handed
    d_router = torch.stack(d_router)
    dist.all_reduce(d_router, group=group)                                  # each rank saw only its own tokens
    torch.testing.assert_close(d_router, router.weight.grad.expand_as(d_router))
    return handed, dict(C=C, dropped=int((~keep).sum()))


def check_all_to_all(rank, W, device, groups):
    head("all-to-all: equal and ragged blocks, float64 and bf16, sub-groups, non-contiguous; one call each way")
    for dtype in (F64, torch.bfloat16):
        x = torch.tensor([10 * rank + j for j in range(W)], dtype=dtype, device=device)  # rank i: [10i, 10i+1..]
        with traffic() as t:
            y = m.all_to_all(strided(x))
        assert y.dtype == dtype and torch.equal(y, torch.tensor([10 * i + rank for i in range(W)], dtype=dtype,
                                                                device=device))
        assert t.calls == ([("all_to_all", tuple(range(W)), x.nbytes)] if W > 1 else []), t.calls
        assert ring_bytes("all_to_all", x.nbytes, W) == x.nbytes - x[rank].nbytes   # the W-1 blocks for others
        split = lambda i, j: (i + 2 * j) % 3                                 # rows rank i sends rank j (some 0)
        for group in groups:
            members, G, r = members_of(group)
            torch.manual_seed(2)
            ints = lambda rows: torch.randint(-9, 10, (rows, H), device=device).to(dtype)
            xs = [ints(sum(split(i, j) for j in range(G))) for i in range(G)]   # every rank's input, everywhere
            gs = [ints(sum(split(i, j) for i in range(G))) for j in range(G)]   # every rank's upstream gradient
            x = xs[r].clone().requires_grad_()
            with traffic() as t:
                y = m.all_to_all(strided(x), [split(i, r) for i in range(G)], [split(r, j) for j in range(G)], group)
                y.backward(gs[r])
            expected = torch.cat([xs[i].split([split(i, j) for j in range(G)])[r] for i in range(G)])
            assert torch.equal(y, expected), "a block landed in the wrong place"
            back = torch.cat([gs[j].split([split(i, j) for i in range(G)])[r] for j in range(G)])
            assert torch.equal(x.grad, back), "a gradient block went back to the wrong place"
            assert t.calls == ([("all_to_all", tuple(members), x.nbytes), ("all_to_all", tuple(members), y.nbytes)]
                               if G > 1 else []), t.calls
    log("float64 and bf16: equal blocks transposed; ragged (i+2j)%3 rows, world and sub-groups, non-contiguous:")
    log("blocks land transposed, gradients go back transposed, one all-to-all each way of the bytes handed")


def check_round_trip(device, groups):
    head("round trip: identity experts, gates 1/k: combine(dispatch(x)) == x; no padding row reaches an expert")
    k = 2
    for dtype, group in [(F64, g) for g in groups] + [(torch.bfloat16, groups[-1])]:
        members, G, r = members_of(group)
        torch.manual_seed(3)
        X = torch.randn(dist.get_world_size(), N, H, device=device).to(dtype)[members]
        idx = torch.rand(G, N, E, device=device).argsort(-1)[..., :k]  # k distinct experts per token
        x, g = X[r].clone().requires_grad_(), torch.randn_like(X[r])
        L = E // G
        for padded in (False, True):
            x.grad, experts = None, [CountingIdentity() for _ in range(L)]
            gates = torch.full(idx[r].shape, 1 / k, dtype=dtype, device=device)
            out, _ = m.moe_all_to_all(strided(x), idx[r], gates, experts, E, padded=padded, group=group)
            out.backward(g)
            assert out.dtype == dtype and torch.equal(out, x) and torch.equal(x.grad, g), (dtype, padded)
            routed = [int((idx == r * L + l).sum()) for l in range(L)]  # every rank's rows for my experts
            assert [ex.rows for ex in experts] == routed, f"padded={padded}: experts ran on padding rows"
    log(f"k={k}, float64 (world, sub-groups), bf16 (sub-groups): out == x, dx == upstream grad exactly, ragged and "
        f"padded; each expert ran on exactly the rows routed to it")


def check_moe(W, device, groups):
    head("MoE == one process: k = 1, 2, E; no capacity, cf 0.5 and at its limits; sub-groups; the capacity rule")
    sub = groups[-1]
    for k, group in dict.fromkeys(((1, None), (2, None), (2, sub))):   # (2, sub) is (2, None) at W <= 2
        moe_against_one_process(k, None, group, device)
    for k, group in dict.fromkeys(((1, None), (2, None), (2, sub))):
        _, route = moe_against_one_process(k, 0.5, group, device)
        assert route["C"] == math.ceil(0.5 * N * k / E)
    _, route = moe_against_one_process(2, 1e-9, None, device)     # the smallest factor: C = 1
    assert route["C"] == 1 and route["dropped"] >= W * (N * 2 - E), route   # at most E kept per rank
    _, route = moe_against_one_process(E, 1.0, None, device)      # k = E, cf = E/k: C = N, every expert takes
    assert route["C"] == N and route["dropped"] == 0, route      # every token, nothing can drop
    log(f"k=1, 2: equal for both paths, without capacity and at cf 0.5, world and sub-groups; cf 1e-9 -> C=1; "
        f"k={E} at cf 1 -> C={N}, none dropped; kept as the rule says; 3 + 2 all-to-alls, bytes == the formula")


def check_refusals(rank, W, device, groups):
    head("refusals at their boundary: the last valid value passes, the first invalid one is refused in one line")
    z = lambda *shape, dtype=F64: torch.zeros(shape, dtype=dtype, device=device)
    count = 0

    def no(call, said):
        nonlocal count
        got = refused(call)
        assert got == said, (got, said)
        count += 1

    for group in groups:
        members, G, r = members_of(group)
        a2a = lambda x, out=None, inp=None: m.all_to_all(x, out, inp, group)
        x = z(2 * G, H) + rank
        # split lists: G sizes pass, G+1 or G-1 refused; a size 0 passes, -1 refused; the sum == x's rows passes
        y = a2a(x, [2] * G, [2] * G)
        assert torch.equal(y, torch.cat([z(2, H) + s for s in members]))
        to_0 = [2 * G] + [0] * (G - 1)                                       # every row to group rank 0
        y = a2a(x, [2 * G] * G if r == 0 else [0] * G, to_0)
        assert torch.equal(y, torch.cat([z(2 * G, H) + s for s in members]) if r == 0 else z(0, H))
        for n in (G + 1, G - 1):
            no(lambda: a2a(x, [2] * G, [2] * n), f"input_split_sizes={[2] * n} needs one size >= 0 for each of "
                                                 f"the {G} ranks")
            no(lambda: a2a(x, [2] * n, [2] * G), f"output_split_sizes={[2] * n} needs one size >= 0 for each of "
                                                 f"the {G} ranks")
        neg = [-1] + [2] * (G - 1)
        no(lambda: a2a(x, neg, [2] * G), f"output_split_sizes={neg} needs one size >= 0 for each of the {G} ranks")
        for extra in (1, -1):
            s = [2] * (G - 1) + [2 + extra]
            no(lambda: a2a(x, [2] * G, s), f"input_split_sizes={s} sum to {2 * G + extra}, but x has {2 * G} rows")
        pass_both = "pass both input_split_sizes and output_split_sizes (ragged), or neither (equal blocks)"
        no(lambda: a2a(x, None, [2] * G), pass_both)
        no(lambda: a2a(x, [2] * G, None), pass_both)
        # equal blocks: 2G rows pass (above), 2G+1 and 2G-1 are refused (a group of one rank takes any)
        for rows in (2 * G + 1, 2 * G - 1):
            if G == 1:
                assert torch.equal(a2a(z(rows, H) + 1), z(rows, H) + 1)
                continue
            no(lambda: a2a(z(rows, H)), f"x has {rows} rows, which do not split evenly over the {G} ranks; pass "
                                        f"input_split_sizes and output_split_sizes")
        # moe_all_to_all: E/G local experts pass, one more or one fewer refused; E divisible by G
        idx, gates, ids = z(N, 2, dtype=torch.long), z(N, 2), [nn.Identity()]
        moe = lambda x_, idx_, gates_, experts, e: m.moe_all_to_all(x_, idx_, gates_, experts, e, group=group)
        out, _ = moe(z(N, H) + 1, idx, gates + 0.5, ids * (E // G), E)      # every token to expert 0, twice
        assert torch.equal(out, z(N, H) + 1)
        for n in (E // G + 1, E // G - 1):
            no(lambda: moe(z(N, H), idx, gates, ids * n, E), f"num_experts={E} over {G} ranks needs {E // G} "
                                                               f"local experts per rank; got {n}")
        if G > 1:                                                            # G experts pass, G+1 refused
            moe(z(N, H), idx, gates, ids, G)
            no(lambda: moe(z(N, H), idx, gates, ids, G + 1), f"num_experts={G + 1} over {G} ranks needs "
                                                             f"{(G + 1) / G:g} local experts per rank; got 1")
        shapes = lambda i, g: (f"expert_idx {list(i.shape)} and gates {list(g.shape)} must both be [N, k] with "
                               f"N = {N}, the rows of x")
        no(lambda: moe(z(N, H), idx, gates[:, :1], ids * (E // G), E), shapes(idx, gates[:, :1]))
        for i, g in ((idx[1:], gates[1:]), (z(N + 1, 2, dtype=torch.long), z(N + 1, 2))):
            no(lambda: moe(z(N, H), i, g, ids * (E // G), E), shapes(i, g))
        # the layer: k from 1 to E, capacity factor > 0 (or None), E divisible by the group
        layer = lambda *a, **kw: m.ExpertParallelMoE(H, FFN, *a, group=group, **kw)
        for k in (1, E):
            assert layer(E, k=k).k == k
        for k in (0, E + 1):
            no(lambda: layer(E, k=k), f"k={k} must be between 1 and num_experts={E}")
        for cf in (None, 1e-9):
            layer(E, capacity_factor=cf)
        for cf in (0, -1e-9):
            no(lambda: layer(E, capacity_factor=cf), f"capacity_factor={cf} must be > 0, or None for no dropping")
        assert len(layer(G).experts) == 1
        if G > 1:
            no(lambda: layer(G + 1), f"num_experts={G + 1} is not divisible by the expert-parallel size {G}")
    log(f"{count} refusals, each in one line before any message; beside each, the last valid value ran: split "
        f"lists of G sizes, a size 0, sums == rows, 2G rows, E/G experts, k = 1 and E, cf 1e-9 and None")


def main():
    W = launched_world_size()
    if E % W:
        refuse(f"{E} experts cannot be spread evenly over {W} ranks; use a world size dividing {E} (1, 2, 4, 8)")
    rank, W, device = setup()
    # the world, and {0, 2, ..} or {1, 3, ..} where group rank != rank (at W <= 2 a sub-group of one rank would
    # repeat the 1-rank run): bf16 runs on the last of them
    groups = [None] + ([strided_groups(2)[rank % 2][0]] if W > 2 else [])
    check_all_to_all(rank, W, device, groups)
    check_round_trip(device, groups)
    check_moe(W, device, groups)
    check_refusals(rank, W, device, groups)
    finish("all-to-all (equal, ragged, bf16, sub-groups), the round trip, the MoE == one process (k = 1, 2, E; "
           "capacity at its limits; the rule; traffic and bytes) and every refusal at its boundary")


if __name__ == "__main__":
    main()
