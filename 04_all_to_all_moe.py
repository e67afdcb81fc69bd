"""04 - all-to-all, and the expert-parallel MoE layer built on it.

Expert parallelism (GShard, Switch, Mixtral, DeepSeek-V3) spreads E experts over W ranks, E/W on each. A
replicated router picks k experts per token; the token travels to its experts' ranks (dispatch) and their
outputs travel back (combine), one all-to-all each: rank i sends block j of its buffer to rank j, a transpose:

    before                          all_to_all                       after
    rank 0: [a0 a1 a2 a3]                                            rank 0: [a0 b0 c0 d0]
    rank 1: [b0 b1 b2 b3]     block j of rank i        -->           rank 1: [a1 b1 c1 d1]
    rank 2: [c0 c1 c2 c3]     becomes block i of rank j              rank 2: [a2 b2 c2 d2]
    rank 3: [d0 d1 d2 d3]                                            rank 3: [a3 b3 c3 d3]

Its backward is an all-to-all with the split sizes swapped (the gradient of block i of rank j goes back to
block j of rank i). One forward of the MoE layer, N tokens of hidden size h per rank, L = E/W local experts:

    route     router (same weights on every rank): top-k experts and their gates per token    [N, k]
    drop      at most C assignments per expert per source rank (the rule below)
    counts    all-to-all of E int64 counts: what each rank will receive, per local expert       [W, L]
    dispatch  all-to-all of the kept token rows, grouped by destination rank, then by expert
    experts   each local expert runs on the rows that arrived for it
    combine   the reverse all-to-all; out[t] = sum over t's kept choices of gate * expert output

Two dispatch paths, one flag:
    padded  each expert's block padded to C rows, equal splits: static shapes (the path XLA/GShard take)
    ragged  all_to_all_single with input_split_sizes / output_split_sizes: exactly the kept rows, no padding
            (the split sizes must be on the host: `.tolist()`, a sync on GPUs, as in Megatron's dispatcher)

Capacity rule: C = ceil(cf * N * k / E) for capacity factor cf. Each rank fills each expert's C slots with every
token's 1st choice in token order, then every 2nd choice, ...; an assignment finding its expert full is dropped
(the residual connection carries the token on). Without cf nothing is dropped; the padded path pads to the
largest count any rank sends any expert (one all-reduce MAX of one int64). The replicated router's gradient is
summed over ranks; an expert's gradient already covers every rank's tokens, through the all-to-all backward.

Bytes each rank hands the collectives per forward (b bytes per element; the backward hands the same token
rows again, not the counts; at W = 1 no all-to-all runs):
    bare all-to-all of V bytes     V, of which (W-1)/W * V leave the rank (block i of rank i stays)
    padded MoE                     8E + 2 * E*C*h*b        (+ 8 for the all-reduce MAX when C is not fixed)
    ragged MoE                     8E + (K_out + K_in)*h*b
K_out, K_in: the kept assignments this rank routes, its experts serve; both <= E*C: ragged hands <= padded.

    torchrun --nproc-per-node=4 04_all_to_all_moe.py

tests/check_04.py: sub-groups, bf16, k = E, capacity at its limits, the rule, no padding row, traffic, refusals.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- building blocks (torch only: this section pastes alone) ----------------------------------------------
class _AllToAll(torch.autograd.Function):
    """forward: all-to-all with (output, input) split sizes; backward: all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        if dist.get_world_size(group) == 1:             # one rank: x itself (the rule of lessons 03 and 05)
            return x
        rows = x.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        return _AllToAll.apply(grad, input_split_sizes, output_split_sizes, ctx.group), None, None, None


def all_to_all(x, output_split_sizes=None, input_split_sizes=None, group=None):
    """Differentiable all-to-all along dim 0. x's rows are cut into W blocks (input_split_sizes, or equal);
    block j goes to rank j; the result stacks the blocks from ranks 0..W-1 (output_split_sizes, or equal).
    Pass both split lists or neither; every rank's input_split_sizes[j] must equal rank j's
    output_split_sizes[this rank]. Ranks are group ranks; a group of one rank returns x itself."""
    W = dist.get_world_size(group)
    for name, s in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
        if s is not None and (len(s) != W or min(s) < 0):
            raise ValueError(f"{name}={list(s)} needs one size >= 0 for each of the {W} ranks")
    if input_split_sizes is not None and sum(input_split_sizes) != x.shape[0]:
        raise ValueError(f"input_split_sizes={list(input_split_sizes)} sum to {sum(input_split_sizes)}, "
                         f"but x has {x.shape[0]} rows")
    if (input_split_sizes is None) != (output_split_sizes is None):
        raise ValueError("pass both input_split_sizes and output_split_sizes (ragged), or neither (equal blocks)")
    if input_split_sizes is None and x.shape[0] % W:
        raise ValueError(f"x has {x.shape[0]} rows, which do not split evenly over the {W} ranks; "
                         f"pass input_split_sizes and output_split_sizes")
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)


def capacity_keep(expert_idx, num_experts, capacity):
    """expert_idx [N, k] -> keep [N, k] by the docstring's capacity rule (vectorised, one rank), and each
    assignment's place in its expert's queue [N, k]."""
    N, k = expert_idx.shape
    flat = expert_idx.t().reshape(-1)                           # [k*N] 1st choices in token order, then 2nd
    hot = F.one_hot(flat, num_experts)                          # [k*N, E]
    queue = ((hot.cumsum(0) - 1) * hot).sum(1)                  # earlier assignments to the same expert
    keep = queue < capacity if capacity is not None else torch.ones_like(queue, dtype=torch.bool)
    return keep.view(k, N).t(), queue.view(k, N).t()


def moe_all_to_all(x, expert_idx, gates, local_experts, num_experts, capacity=None, padded=False, group=None):
    """Expert-parallel MoE core. x [N, h] this rank's tokens; expert_idx, gates [N, k] its routing;
    local_experts: the L = E/W experts this rank r of `group` holds (global ids r*L .. r*L+L-1).
    Returns out [N, h] and stats: keep [N, k] (False = a dropped assignment) and dropped (how many)."""
    W = dist.get_world_size(group)
    if num_experts % W or len(local_experts) != num_experts // W:
        raise ValueError(f"num_experts={num_experts} over {W} ranks needs {num_experts / W:g} local experts "
                         f"per rank; got {len(local_experts)}")
    if expert_idx.shape != gates.shape or expert_idx.shape[0] != x.shape[0]:
        raise ValueError(f"expert_idx {list(expert_idx.shape)} and gates {list(gates.shape)} must both be "
                         f"[N, k] with N = {x.shape[0]}, the rows of x")
    L, (N, k), dev = num_experts // W, expert_idx.shape, x.device
    keep, queue = capacity_keep(expert_idx, num_experts, capacity)
    tok = torch.arange(N, device=dev)[:, None].expand(N, k)[keep]            # [K] token of each kept assignment
    e, q, g = expert_idx[keep], queue[keep], gates[keep]                    # [K] expert, place in its queue, gate

    # counts: expert e lives on rank e // L, so these E counts are already grouped by destination rank
    counts = torch.bincount(e, minlength=num_experts)                        # [E]
    recv_counts = all_to_all(counts, group=group).view(W, L)                 # [W, L] from rank s, for expert l
    C = capacity
    if padded:
        if C is None:                                                        # the global max count
            top = counts.max().view(1)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            C = int(top)
        slot, n_send = e * C + q, num_experts * C                            # row in the [E*C, h] buffer
        in_splits = out_splits = None
        filled = torch.arange(C, device=dev) < recv_counts[..., None]        # [W, L, C] False = padding
        recv_ids = torch.where(filled, torch.arange(L, device=dev)[:, None], -1).flatten()
    else:
        slot, n_send = (counts.cumsum(0) - counts)[e] + q, len(e)            # row in the [K, h] buffer
        in_splits = counts.view(W, L).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv_ids = torch.arange(L, device=dev).repeat(W).repeat_interleave(recv_counts.flatten(),
                                                                           output_size=sum(out_splits))

    label = torch.profiler.record_function                                  # the three phases, named in a trace
    with label("moe dispatch"):
        send = x.new_zeros(n_send, x.shape[1]).index_copy(0, slot, x[tok])
        recv = all_to_all(send, out_splits, in_splits, group)               # rows by (source rank, expert)
    with label("moe experts"):
        y = torch.zeros_like(recv)
        for l, expert in enumerate(local_experts):
            rows = (recv_ids == l).nonzero().squeeze(1)
            y = y.index_copy(0, rows, expert(recv[rows]))
    with label("moe combine"):                                               # the reverse trip, then the
        back = all_to_all(y, in_splits, out_splits, group)                  # gate-weighted sum in token order
        out = torch.zeros_like(x).index_add(0, tok, g[:, None] * back[slot])
    return out, dict(keep=keep, dropped=int((~keep).sum()))


def make_expert(hidden, ffn, **kw):
    """One expert: a small MLP, hidden -> ffn -> hidden."""
    return nn.Sequential(nn.Linear(hidden, ffn, **kw), nn.GELU(), nn.Linear(ffn, hidden, **kw))


class ExpertParallelMoE(nn.Module):
    """Top-k MoE with E experts over the W ranks of `group`, E/W per rank; the router is replicated.

        rank r holds: router [E, h] (a copy)   experts r*L .. r*L+L-1   its own N tokens
    Gates are the top-k softmax probabilities, not renormalised (so the router learns also at k = 1).
    The caller sums router.weight.grad over the ranks after backward (as data parallelism does), and gives
    each rank's experts their own initial weights (a seed per rank, or a checkpoint)."""

    def __init__(self, hidden, ffn, num_experts, k=1, capacity_factor=None, padded=False, group=None, **kw):
        super().__init__()
        W = dist.get_world_size(group)
        if num_experts % W:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {W}")
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0, or None for no dropping")
        self.num_experts, self.k, self.cf, self.padded, self.group = num_experts, k, capacity_factor, padded, group
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        self.experts = nn.ModuleList(make_expert(hidden, ffn, **kw) for _ in range(num_experts // W))

    def forward(self, x):                                                    # x [N, h]
        gates, idx = self.router(x).softmax(-1).topk(self.k, dim=-1)         # [N, k] each
        cap = None if self.cf is None else math.ceil(self.cf * x.shape[0] * self.k / self.num_experts)
        out, self.stats = moe_all_to_all(x, idx, gates, self.experts, self.num_experts, cap, self.padded,
                                         self.group)
        return out


# ---- demo: each claim above against one process (needs common.py; the blocks need only torch) -------------
E, H, FFN, N = 8, 4, 8, 8        # experts, hidden size, expert hidden size, tokens per rank


def reference_moe(X, router, experts, k, capacity, n_per_rank):
    """One process, all experts local, in GShard's dense form: every expert runs on every token, and a
    [tokens, E] combine matrix weights the results (zero where a token did not pick, or lost, the expert).
    The capacity rule is written out as the plain loop the docstring states."""
    gates, idx = router(X).softmax(-1).topk(k, dim=-1)                       # [T, k]
    choices = idx.tolist()
    keep = [[False] * k for _ in choices]
    for start in range(0, len(choices), n_per_rank):                         # capacity is per source rank
        used = [0] * len(experts)
        for c in range(k):                                                   # 1st choices, then 2nd ...
            for t in range(start, start + n_per_rank):                       # ... each in token order
                if capacity is None or used[choices[t][c]] < capacity:
                    used[choices[t][c]] += 1
                    keep[t][c] = True
    keep = torch.tensor(keep, device=X.device)                               # [T, k]
    combine = (F.one_hot(idx, len(experts)) * (gates * keep)[..., None]).sum(1)  # [T, E]
    every = torch.stack([ex(X) for ex in experts], dim=1)                       # [T, E, H]
    return (combine[..., None] * every).sum(1), idx, keep


def moe_against_one_process(k, cf, device):
    """reference_moe on every rank's tokens, then the expert-parallel layer on this rank's, ragged and padded: the
    output and the gradients of the input, the router and every expert must agree, and the bytes each path hands
    the collectives in the forward must be the docstring's. Returns those bytes and the routing's numbers."""
    from common import traffic
    W, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(k)                                # the same weights and tokens on every rank
    kw = dict(device=device, dtype=torch.float64)
    router, experts = nn.Linear(H, E, bias=False, **kw), [make_expert(H, FFN, **kw) for _ in range(E)]
    X = torch.randn(W * N, H, **kw).requires_grad_()    # rank r's tokens: rows r*N .. r*N+N-1
    dY = torch.randn(X.shape, **kw)                     # their upstream gradient
    cap = None if cf is None else math.ceil(cf * N * k / E)                 # the docstring's C
    ref, idx, keep = reference_moe(X, router, experts, k, cap, N)
    (ref * dY).sum().backward()
    L, mine = E // W, slice(r * N, (r + 1) * N)
    held = nn.ModuleList(experts[r * L:(r + 1) * L])    # the experts this rank holds
    # the formula's rows: ragged moves the kept assignments (K_out routed from here, K_in served here); padded
    # E*C each way, C the capacity or the largest count any rank sends any expert (found by an all-reduce MAX)
    k_out, k_in = int(keep[mine].sum()), int((keep & (idx // L == r)).sum())
    C = cap if cap is not None else max(int(idx[s * N:(s + 1) * N].flatten().bincount(minlength=E).max())
                                        for s in range(W))
    a2a = W > 1                                         # one rank: no all-to-all runs
    want = {"ragged": a2a * (8 * E + (k_out + k_in) * H * 8),
            "padded": a2a * (8 * E + 2 * E * C * H * 8) + (8 if cap is None else 0)}   # + the all-reduce MAX
    handed = {}
    for path in ("ragged", "padded"):
        moe = ExpertParallelMoE(H, FFN, E, k, cf, padded=path == "padded", **kw)
        moe.router.load_state_dict(router.state_dict())
        moe.experts.load_state_dict(held.state_dict())
        x = X.detach()[mine].clone().requires_grad_()
        with traffic() as t:
            out = moe(x)
        (out * dY[mine]).sum().backward()
        d_router = moe.router.weight.grad.clone()
        dist.all_reduce(d_router)                       # each rank saw only its own tokens
        torch.testing.assert_close(out, ref[mine])
        torch.testing.assert_close(x.grad, X.grad[mine])
        torch.testing.assert_close(d_router, router.weight.grad)
        for p, p_ref in zip(moe.experts.parameters(), held.parameters()):  # no sum over ranks: every rank's
            torch.testing.assert_close(p.grad, p_ref.grad)                  # tokens came here
        assert moe.stats["dropped"] == int((~keep[mine]).sum()), path
        handed[path] = t.bytes.total()
        assert handed[path] == want[path], (path, dict(t.bytes), want)
    assert handed["ragged"] <= handed["padded"], handed
    return handed, dict(C=C, k_out=k_out, k_in=k_in, dropped=int((~keep).sum()))


def main():
    from common import finish, head, launched_world_size, log, log_all, refuse, setup, traffic
    W = launched_world_size()
    if E % W:
        refuse(f"{E} experts cannot be spread evenly over {W} ranks; use a world size dividing {E} (1, 2, 4, 8)")
    rank, W, device = setup()
    f64 = dict(dtype=torch.float64, device=device)

    head("1. all-to-all is a transpose: block j of rank i becomes block i of rank j")
    x = torch.tensor([10 * rank + j for j in range(W)], **f64)             # rank i => [10i, 10i+1, ..]
    with traffic() as t:
        y = all_to_all(x)
    assert torch.equal(y, torch.tensor([10 * i + rank for i in range(W)], **f64))
    assert t.bytes["all_to_all"] == (W > 1) * x.nbytes  # handed in: V; on the wire: the W-1 blocks for others
    log_all(f"holds {x.long().tolist()} -> after all-to-all {y.long().tolist()}")  # rank j => [j, 10+j, ..]

    head("2. ragged all-to-all and its backward: the gradient's blocks travel back transposed")
    split = lambda i, j: (i + 2 * j) % 3                # rows rank i sends rank j (some 0)
    torch.manual_seed(2)
    ints = lambda rows: torch.randint(-9, 10, (rows, H), **f64)
    xs = [ints(sum(split(i, j) for j in range(W))) for i in range(W)]       # every rank's input, on every rank
    gs = [ints(sum(split(i, j) for i in range(W))) for j in range(W)]       # every rank's upstream gradient
    x = xs[rank].clone().requires_grad_()
    y = all_to_all(x, [split(i, rank) for i in range(W)], [split(rank, j) for j in range(W)])
    y.backward(gs[rank])
    assert torch.equal(y, torch.cat([xs[i].split([split(i, j) for j in range(W)])[rank] for i in range(W)]))
    assert torch.equal(x.grad, torch.cat([gs[j].split([split(i, j) for i in range(W)])[rank] for j in range(W)]))
    log("rank i sends rank j (i+2j)%3 rows: the blocks land transposed, the gradient's blocks go back transposed")

    head("3. MoE layer, expert parallel == one process (output, d input, d router, d every expert)")
    handed, route = moe_against_one_process(2, None, device)
    log(f"k=2, {E} experts, {E // W} per rank, {W * N} tokens: equal for the ragged and the padded path")
    if W > 1:
        log_all(f"forward hands: padded {handed['padded']:5d} B = 8E + 2*E*C*h*8 + 8 (C={route['C']}) | ragged "
                f"{handed['ragged']:5d} B = 8E + (K_out+K_in)*h*8 ({route['k_out']} rows out, {route['k_in']} in)")

    head("4. capacity: assignments beyond C per expert per rank are dropped")
    _, route = moe_against_one_process(2, 0.5, device)
    log(f"k=2, capacity factor 0.5 -> C={route['C']}: {route['dropped']} of {W * N * 2} assignments dropped, by "
        f"the rule, as the reference; both paths equal")
    finish("all-to-all transposes, its backward swaps the splits; the expert-parallel MoE equals one process "
           "(k=2, padded and ragged, with and without drops); the bytes handed == the docstring's formulas")


if __name__ == "__main__":
    main()
