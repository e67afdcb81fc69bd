"""05 - tensor parallelism, Megatron-style: split a layer's weight across the ranks of a TP group.

Each transformer block runs its MLP and its attention on p ranks (Megatron-LM, Shoeybi et al. 2019).
The first linear is split by output columns (ColumnParallelLinear), the second by input rows
(RowParallelLinear), so the only communication is one all-reduce per block forward and one backward:

                A = [A_0 | A_1]  (columns of fc1)         B = [B_0 ; B_1]  (rows of fc2)
    rank 0:  X --f--> X A_0 --GeLU--> Z_0 --> Z_0 B_0 --+
                                                        g --> Y = Z_0 B_0 + Z_1 B_1 + b   (every rank)
    rank 1:  X --f--> X A_1 --GeLU--> Z_1 --> Z_1 B_1 --+
    (every rank holds X)  (rank r holds its columns)  (partial sums)

    f = copy_to_tensor_model_parallel_region       forward: identity        backward: all-reduce
    g = reduce_from_tensor_model_parallel_region   forward: all-reduce      backward: identity
    scatter_to_tensor_model_parallel_region        forward: split last dim  backward: all-gather
    gather_from_tensor_model_parallel_region       forward: all-gather      backward: split last dim
Attention is split the same way by heads: QKV column-parallel, output projection row-parallel.

Bytes each rank sends per block, for activations of V = batch * seq * hidden * bytes: a ring all-reduce of
2 (p-1)/p * V forward (g) and the same backward (f); 4 all-reduces per transformer layer (MLP + attention).
scatter sends nothing; gather (all-gather) sends (p-1)/p of the gathered tensor.
Parameters: each rank holds 1/p of every weight and column bias; the row layer's bias is whole on every rank.
In training, TP groups are ranks on one node (the heaviest traffic), nested in a data-parallel grid:
    4 ranks as TP 2 x DP 2:  TP groups [0, 1] [2, 3] (inside a node),  DP groups [0, 2] [1, 3] (across nodes)

    torchrun --nproc-per-node=4 05_tp_layers.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- private helpers (Megatron's mappings.py) --------------------------------------------------------
def _divide(what: str, value: int, group) -> int:
    size = dist.get_world_size(group)
    if value % size:
        raise ValueError(f"{what}={value} is not divisible by the tensor-parallel size {size}")
    return value // size


def _reduce(x, group):
    """Sum of x over the group; the caller's tensor is left alone."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _split(x, dim, group):
    """This rank's contiguous slice of x along `dim`; no communication."""
    _divide(f"x.shape[{dim}]", x.shape[dim], group)
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


def _gather_along_last_dim(x, group):
    """Every rank's x, concatenated along the last dim in rank order."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x.contiguous(), group=group)  # [p*d0, ..., n/p]: rank blocks along dim 0
    return torch.cat(out.chunk(size, dim=0), dim=-1)          # [d0, ..., n]


class _CopyToModelParallelRegion(torch.autograd.Function):
    """forward: identity; backward: all-reduce (the f operator)."""
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """forward: all-reduce; backward: identity (the g operator, conjugate of f)."""
    @staticmethod
    def forward(ctx, x, group=None):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """forward: split the last dim, keep this rank's slice; backward: all-gather along the last dim."""
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_last_dim(grad, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """forward: all-gather along the last dim; backward: split the last dim, keep this rank's slice."""
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


# Megatron's public names, each called as name(x, group=None)
copy_to_tensor_model_parallel_region = _CopyToModelParallelRegion.apply
reduce_from_tensor_model_parallel_region = _ReduceFromModelParallelRegion.apply
scatter_to_tensor_model_parallel_region = _ScatterToModelParallelRegion.apply
gather_from_tensor_model_parallel_region = _GatherFromModelParallelRegion.apply


# ---- layers ------------------------------------------------------------------------------------------
class _ParallelLinear(nn.Module):
    """What both layers share: this rank's shard of an nn.Linear weight [out, in], split along weight_dim."""
    weight_dim = 0

    def __init__(self, in_features, out_features, bias, group, device, dtype):
        super().__init__()
        self.group = group
        shape = [out_features, in_features]
        name = ("out_features", "in_features")[self.weight_dim]
        shape[self.weight_dim] = _divide(name, shape[self.weight_dim], group)
        # nn.Linear's bound. Ranks seeded alike draw equal shards: seed TP ranks apart, or use from_dense.
        # Biases start at 0, as in Megatron: the row layer's bias must be equal on every rank.
        bound = in_features ** -0.5
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(shape[0], device=device, dtype=dtype)) if bias else None

    def shard(self, weight, bias=None):
        """This rank's part of a dense layer's (weight, bias), or of their gradients."""
        if bias is not None and self.weight_dim == 0:
            bias = _split(bias, 0, self.group)
        return _split(weight, self.weight_dim, self.group), bias

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, **options):
        """The layer holding this rank's shard of `linear`, on its device and dtype."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **options)
        with torch.no_grad():
            for param, shard in zip(layer.parameters(), layer.shard(linear.weight, linear.bias)):  # weight, bias
                param.copy_(shard)
        return layer


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A + b with A = [A_0 | A_1 | ..] split by columns (output features): rank r makes Y_r = X A_r + b_r.

        X [.., in] (every rank) --f--> Y_r [.., out/p] --(gather_output: all-gather)--> Y [.., out]
    nn.Linear stores A^T as weight [out, in]: rank r keeps rows r of the weight, and b_r.
    """
    weight_dim = 0

    def __init__(self, in_features, out_features, bias=True, gather_output=False, group=None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, group, device, dtype)
        self.gather_output = gather_output

    def forward(self, x):                                       # x: [.., in], the same on every rank
        y = F.linear(copy_to_tensor_model_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """Y = X A + b with A = [A_0; A_1; ..] split by rows (input features): rank r makes a partial sum X_r A_r.

        X_r [.., in/p] --> X_r A_r [.., out] --g--> sum_r X_r A_r + b = Y [.., out] (every rank)
    nn.Linear stores A^T as weight [out, in]: rank r keeps columns r of the weight. The bias is whole on
    every rank and added once, after the reduction (added before it, it would count p times).
    """
    weight_dim = 1

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, group=None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, group, device, dtype)
        self.input_is_parallel = input_is_parallel

    def forward(self, x):
        if not self.input_is_parallel:                          # x: [.., in] -> this rank's [.., in/p]
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        y = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def parallel_mlp(mlp: nn.Sequential, group=None) -> nn.Sequential:
    """The parallel MLP holding this rank's shards of mlp = Sequential(Linear, activation, Linear):
    fc1 column-parallel (its output stays split), the activation on this rank's columns, fc2 row-parallel.
        x [b, s, h] --fc1--> [b, s, ffn/p] --act--> [b, s, ffn/p] --fc2--> [b, s, h]"""
    fc1, act, fc2 = mlp
    return nn.Sequential(ColumnParallelLinear.from_dense(fc1, group), act, RowParallelLinear.from_dense(fc2, group))


def head_major(t, heads):
    """nn.MultiheadAttention packs its q|k|v rows as (3, heads, d); reorder to (heads, 3, d), Megatron's
    layout, so that a contiguous split of the rows gives each rank whole heads with their q, k and v."""
    return t.unflatten(0, (3, heads, -1)).transpose(0, 1).flatten(0, 2)


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with the heads split: rank r holds heads [r H/p, (r+1) H/p).

        x --f--> QKV_r (column) --> attention on own heads --> O_r [b, s, h/p] --> proj (row) --g--> y
    """
    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, local_heads: int):
        super().__init__()
        self.qkv, self.proj, self.local_heads = qkv, proj, local_heads

    @classmethod
    def from_dense(cls, mha: nn.MultiheadAttention, group=None):
        if not mha.batch_first or mha.in_proj_weight is None or mha.bias_k is not None or mha.add_zero_attn \
                or mha.dropout:
            raise ValueError("from_dense takes nn.MultiheadAttention(batch_first=True), without kdim, vdim, "
                             f"add_bias_kv, add_zero_attn or dropout (dropout={mha.dropout})")
        local_heads = _divide("num_heads", mha.num_heads, group)
        w = mha.in_proj_weight
        qkv = nn.Linear(w.shape[1], w.shape[0], bias=mha.in_proj_bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            qkv.weight.copy_(head_major(w, mha.num_heads))
            if qkv.bias is not None:
                qkv.bias.copy_(head_major(mha.in_proj_bias, mha.num_heads))
        return cls(ColumnParallelLinear.from_dense(qkv, group), RowParallelLinear.from_dense(mha.out_proj, group),
                   local_heads)

    def forward(self, x):                                       # x: [b, s, h], the same on every rank
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, self.local_heads, 3, -1).permute(3, 0, 2, 1, 4)  # [b, H/p, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)                        # [b, H/p, s, d]
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))                              # [b, s, h]


def tp_dp_groups(tp: int):
    """This rank's (tp_group, dp_group) in a DP x TP grid, TP fastest: rank = dp_rank * tp + tp_rank (the groups
    torch's init_device_mesh(device_type, (dp, tp)) builds). Every rank creates every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by the tensor-parallel size {tp}")
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(world // tp)]
    dp_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
    return tp_groups[rank // tp], dp_groups[rank % tp]


# ---- demo --------------------------------------------------------------------------------------------
HIDDEN, HEADS, FFN, BATCH, SEQ = 32, 8, 64, 2, 4  # every size divides by p in {1, 2, 4, 8}
# what CommDebugMode counts for dist.all_reduce and dist.all_gather_single (the c10d ops they call)
ALLREDUCE, ALLGATHER = torch.ops.c10d.allreduce_, torch.ops.c10d._allgather_base_


def check_grads(*layers_and_dense_grads):
    """Each parallel layer's weight and bias grads equal its shard of the dense layer's grads."""
    for layer, weight_grad, bias_grad in layers_and_dense_grads:
        for param, want in zip(layer.parameters(), layer.shard(weight_grad, bias_grad)):
            torch.testing.assert_close(param.grad, want)


def check_against_dense(dense_fn, parallel, x, dy, comms, dense_grads):
    """Forward, then backward from dy: outputs, input grads and grad shards (dense_grads() lists them after the
    backward) equal; the collectives counted in the parallel forward and backward == comms."""
    from torch.distributed.tensor.debug import CommDebugMode  # a slow import, so only when the demo runs
    x_p, x = x.clone().requires_grad_(), x.clone().requires_grad_()
    with CommDebugMode() as fwd:
        y_p = parallel(x_p)
    with CommDebugMode() as bwd:
        y_p.backward(dy)
    y = dense_fn(x)
    y.backward(dy)
    torch.testing.assert_close(y_p, y)
    torch.testing.assert_close(x_p.grad, x.grad)
    check_grads(*dense_grads())
    counts = dict(fwd.get_comm_counts()), dict(bwd.get_comm_counts())
    assert counts == comms, counts


def check_op(op, x, dy, want_y, want_dx, x_replicated, y_replicated):
    """op's forward and backward values, then the adjoint test <op(x), dy> == <x, op_backward(dy)>: a replicated
    tensor is ONE value, its inner product counted once; a sharded or partial-sum tensor's sums over the ranks."""
    x = x.clone().requires_grad_()
    y = op(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(y, want_y) and torch.equal(dx, want_dx), op
    inner = [(a * b).sum().detach() for a, b in ((y, dy), (x, dx))]
    for s, replicated in zip(inner, (y_replicated, x_replicated)):
        if not replicated:
            dist.all_reduce(s)
    assert torch.equal(*inner), (op, inner)


def main():
    from common import finish, head, launched_world_size, log, log_all, refuse, setup
    W = launched_world_size()
    if HEADS % W:
        refuse(f"{W} ranks: {HEADS} heads, hidden {HIDDEN} and ffn {FFN} split over 1, 2, 4 or 8 ranks only")
    rank, world, device = setup()
    f64 = dict(device=device, dtype=torch.float64)
    randint = lambda seed, *shape: torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(seed),
                                                 dtype=torch.float64).to(device)  # the same on every rank
    mine = lambda t, r=rank: t.chunk(world, -1)[r]                       # rank r's slice of the last dim
    once = lambda op, p=world: {op: 1} if p > 1 else {}                 # a group of one rank sends nothing
    mlp_grads = lambda p_mlp, mlp: [(p, d.weight.grad, d.bias.grad) for p, d in zip(p_mlp[::2], mlp[::2])]

    head(f"the four mappings, p = {world}: values and the adjoint test, exact in float64")
    X = [randint(s, BATCH, SEQ, HIDDEN) for s in range(world)]            # rank s's own input
    DY = [randint(100 + s, BATCH, SEQ, HIDDEN) for s in range(world)]     # rank s's own output gradient
    A, B = randint(1000, BATCH, SEQ, HIDDEN), randint(1001, BATCH, SEQ, HIDDEN)  # replicated
    # f:       rank r holds A               -> A                backward: DY[r] -> sum_s DY[s]
    check_op(copy_to_tensor_model_parallel_region, A, DY[rank], A, sum(DY), True, False)
    # g:       rank r holds X[r]            -> sum_s X[s]       backward: B -> B
    check_op(reduce_from_tensor_model_parallel_region, X[rank], B, sum(X), B, False, True)
    # scatter: rank r holds A               -> A's slice r      backward: DY[r]'s slice r -> every rank's, joined
    check_op(scatter_to_tensor_model_parallel_region, A, mine(DY[rank]), mine(A),
             torch.cat([mine(DY[s], s) for s in range(world)], -1), True, False)
    # gather:  rank r holds X[r]'s slice r  -> every rank's, joined      backward: B -> B's slice r
    check_op(gather_from_tensor_model_parallel_region, mine(X[rank]), B,
             torch.cat([mine(X[s], s) for s in range(world)], -1), mine(B), False, True)
    log("f, g, scatter, gather: forward and backward equal their closed forms on rank-dependent inputs")
    log("each passes <op(x), dy> == <x, op_backward(dy)>, a replicated tensor's inner product counted once")

    head("ColumnParallelLinear and RowParallelLinear against nn.Linear")
    torch.manual_seed(1)
    dense, x, dy = nn.Linear(HIDDEN, FFN, **f64), randint(2, BATCH, SEQ, HIDDEN), randint(3, BATCH, SEQ, FFN)
    for cls, options, comms in ((ColumnParallelLinear, {"gather_output": True}, (ALLGATHER, ALLREDUCE)),
                                (RowParallelLinear, {"input_is_parallel": False}, (ALLREDUCE, ALLGATHER))):
        dense.zero_grad()
        layer = cls.from_dense(dense, **options)
        check_against_dense(dense, layer, x, dy, tuple(map(once, comms)),
                            lambda: [(layer, dense.weight.grad, dense.bias.grad)])
    log("column (gather_output=True): output, input grad, grad shards == dense; all-gather fwd, all-reduce bwd")
    log("row (input_is_parallel=False): output, input grad, grad shards == dense; all-reduce fwd, all-gather bwd")
    row = RowParallelLinear.from_dense(dense)
    bias_inside = _reduce(F.linear(mine(x), row.weight, row.bias), None)  # the bias added before g instead
    torch.testing.assert_close(bias_inside - dense(x), (world - 1) * dense.bias.expand_as(bias_inside))
    log(f"the row layer adds its bias once, after the all-reduce; before it, the bias would count {world} times")
    for cls, sizes, name in ((ColumnParallelLinear, (HIDDEN, world + 1), "out_features"),
                             (RowParallelLinear, (world + 1, HIDDEN), "in_features")):
        try:
            cls(*sizes)
            assert world == 1, f"{name}={world + 1} was accepted"  # on one rank every size divides
        except ValueError as e:
            assert str(e) == f"{name}={world + 1} is not divisible by the tensor-parallel size {world}", e
            log(f"refused: ValueError('{e}')")

    def check_block(name, dense_fn, dense, parallel, dense_grads):
        """Output and every grad == dense; one all-reduce each way; each weight split p ways."""
        x, dy = randint(4, BATCH, SEQ, HIDDEN), randint(5, BATCH, SEQ, HIDDEN)
        check_against_dense(dense_fn, parallel, x, dy, (once(ALLREDUCE), once(ALLREDUCE)), dense_grads)
        log(f"{name}: output, input grad and every weight and bias grad shard == dense")
        log(f"{name}: CommDebugMode counts {world > 1:d} all-reduce forward (g), {world > 1:d} backward (f)")
        per_rank, whole = (sum(t.nbytes for t in m.parameters()) for m in (parallel, dense))
        bias = HIDDEN * torch.float64.itemsize  # the row layer's bias: the one parameter kept whole, not split
        assert world * per_rank == whole + (world - 1) * bias, (per_rank, whole, bias)
        log(f"{name}: {per_rank} parameter bytes per rank = ({whole} - {bias}) / {world} + {bias}: "
            f"all split but the row bias, whole on every rank")

    head(f"parallel MLP, p = {world}: column -> GeLU -> row, against nn.Sequential")
    torch.manual_seed(2)
    mlp = nn.Sequential(nn.Linear(HIDDEN, FFN, **f64), nn.GELU(), nn.Linear(FFN, HIDDEN, **f64))
    p_mlp = parallel_mlp(mlp)
    check_block("MLP", mlp, mlp, p_mlp, lambda: mlp_grads(p_mlp, mlp))

    head(f"parallel self-attention: {HEADS} heads, {HEADS // world} per rank, against nn.MultiheadAttention")
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True, **f64)
    causal = nn.Transformer.generate_square_subsequent_mask(SEQ, **f64)
    p_attn = ParallelSelfAttention.from_dense(mha)
    check_block("attention", lambda x: mha(x, x, x, need_weights=False, attn_mask=causal, is_causal=True)[0],
                mha, p_attn, lambda: [(p_attn.qkv, head_major(mha.in_proj_weight.grad, HEADS),
                                       head_major(mha.in_proj_bias.grad, HEADS)),
                                      (p_attn.proj, mha.out_proj.weight.grad, mha.out_proj.bias.grad)])

    head("TP inside a 2-D grid: TP x DP process groups from dist.new_group")
    tp = world // 2 if world >= 4 else world
    dp, dp_rank = world // tp, rank // tp
    tp_group, dp_group = tp_dp_groups(tp)
    log(f"{world} ranks -> TP {tp} x DP {dp}: a TP group is consecutive ranks (one node), a DP group strided")
    members = [dist.get_process_group_ranks(g) for g in (tp_group, dp_group)]
    assert members == [[dp_rank * tp + t for t in range(tp)], [d * tp + rank % tp for d in range(dp)]], members
    log_all(f"TP group {members[0]}, DP group {members[1]}")
    sums = [_reduce(torch.tensor([2.0 ** rank], **f64), g).item() for g in (tp_group, dp_group)]  # same tensor
    assert sums == [sum(2.0 ** r for r in ranks) for ranks in members], sums
    assert (sums[0] != sums[1]) == (world > 1), sums
    log(f"2**rank all-reduced on rank 0: {sums[0]:g} over its TP group, {sums[1]:g} over its DP group")
    # each DP replica feeds its own micro-batch to an MLP split over its own TP group
    torch.manual_seed(4)
    mlp = nn.Sequential(nn.Linear(HIDDEN, FFN, **f64), nn.GELU(), nn.Linear(FFN, HIDDEN, **f64))
    p_mlp = parallel_mlp(mlp, group=tp_group)
    xs = [randint(10 + d, BATCH, SEQ, HIDDEN) for d in range(dp)]
    dys = [randint(20 + d, BATCH, SEQ, HIDDEN) for d in range(dp)]
    check_against_dense(mlp, p_mlp, xs[dp_rank], dys[dp_rank], (once(ALLREDUCE, tp),) * 2,
                        lambda: mlp_grads(p_mlp, mlp))  # so g summed inside this TP group only
    for p in p_mlp.parameters():                                # DP: average each grad shard over the replicas
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dp
    mlp.zero_grad()
    (sum((mlp(x) * dy).sum() for x, dy in zip(xs, dys)) / dp).backward()  # dense: all micro-batches at once
    check_grads(*mlp_grads(p_mlp, mlp))
    log(f"TP MLP == dense on its replica's micro-batch; DP-averaged grad shards == dense over the {dp} micro-batches")
    finish(f"f/g/scatter/gather, column/row layers, MLP, attention == dense at TP={world}; TP {tp} x DP {dp}")


if __name__ == "__main__":
    main()
