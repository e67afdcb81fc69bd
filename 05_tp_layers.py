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

Sequence parallelism (sequence_parallel=True; Korthikanti et al. 2022): between blocks each rank keeps only its
part of the sequence, in Megatron's [s, b, h] (s is dim 0). g's all-reduce becomes its first half, a
reduce-scatter, and f the second, an all-gather before the next block (LinearWithSequenceParallel, as in 06):

    rank 0:  X_0 --+                      +--> X A_0 .. Z_0 B_0 --+                          +--> Y_0 (+ b)
                   all-gather along s                             reduce-scatter along s
    rank 1:  X_1 --+                      +--> X A_1 .. Z_1 B_1 --+                          +--> Y_1 (+ b)
    (rank r holds X_r [s/p, b, h])   (every rank holds X [s, b, h])            (rank r holds Y_r [s/p, b, h])
The column layer keeps only X_r for backward and all-gathers it again there: its saved input is 1/p of TP's.
Bytes each rank sends per block, for activations of V = batch * seq * hidden * bytes: a ring all-reduce of
2 (p-1)/p * V forward (g) and the same backward (f); 4 all-reduces per transformer layer (MLP + attention).
With SP, an all-gather (p-1)/p * V and a reduce-scatter (p-1)/p * V each way (the same 2 (p-1)/p * V), and in
backward one all-gather more, (p-1)/p * V, the price of keeping X_r only; the column layer also all-gathers
a 64-B header a call: every rank's X_r must have one shape (check_slices=False skips it). scatter sends nothing.
Parameters: each rank holds 1/p of every weight and column bias; the row layer's bias is whole on every rank
(with SP its gradient is a partial sum over the ranks' parts of s: allreduce_sequence_parallel_grads sums it).
In training, TP groups are ranks on one node (the heaviest traffic), nested in a data-parallel grid:
    4 ranks as TP 2 x DP 2:  TP groups [0, 1] [2, 3] (inside a node),  DP groups [0, 2] [1, 3] (across nodes)

    torchrun --nproc-per-node=4 05_tp_layers.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- building blocks: paste from here to the demo marker (they need only torch) -------------------------
# torch 2.13 renamed these two collectives (the old names warn there); older torch has only the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# private helpers (Megatron's mappings.py, the same text as 06's), each a no-op on a group of one rank
def _divide(what: str, value: int, group) -> int:
    size = dist.get_world_size(group)
    if value % size:
        raise ValueError(f"{what}={value} is not divisible by the group size {size}")
    return value // size


def _wait(works):
    for work in works:
        work.wait()


def _reduce(x, group):
    """Sum of x over the group; the caller's tensor is left alone."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _split_along_dim(x, dim, group):
    """This rank's contiguous slice of x along `dim`; no communication."""
    _divide(f"x.shape[{dim}]", x.shape[dim], group)
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


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


# regions: one autograd.Function per operator, each pairing a forward collective with its transpose
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


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """forward: keep this rank's slice along dim (no comm); backward: all-gather along dim."""
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_dim(grad, ctx.dim, ctx.group), None, None


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


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """forward: all-gather along the last dim; backward: keep this rank's slice of the last dim (no comm)."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_dim(grad, -1, ctx.group), None


# Megatron's public names. The sequence-parallel regions cut dim 0, the sequence of Megatron's [s, b, h]; a
# batch-first [b, s, h] caller passes dim=1. f and g act on the whole tensor.
def copy_to_tensor_model_parallel_region(x, group=None):
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group=None, *, dim=0):
    return _ScatterToSequenceParallelRegion.apply(x, dim, group)


def gather_from_sequence_parallel_region(x, group=None, *, dim=0):
    return _GatherFromSequenceParallelRegion.apply(x, dim, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None, *, dim=0):
    return _ReduceScatterToSequenceParallelRegion.apply(x, dim, group)


def scatter_to_tensor_model_parallel_region(x, group=None):
    """This rank's slice of the last dim; backward: all-gather it (the sequence scatter's operator, on features)."""
    return _ScatterToSequenceParallelRegion.apply(x, -1, group)


def gather_from_tensor_model_parallel_region(x, group=None):
    return _GatherFromModelParallelRegion.apply(x, group)


# Megatron SP's linear layer (the same text as 06's): ColumnParallelLinear(sequence_parallel=True) runs it
class LinearWithSequenceParallel(torch.autograd.Function):
    """forward: all-gather x along the sequence (dim 0), then x @ W.T + b; backward: grad_x = grad @ W,
    reduce-scattered async while dW is computed (Megatron's LinearWithGradAccumulationAndAsyncCommunication).

        x: [s/tp, b, h] this rank's slice     W: [f/tp, h] this rank's rows     out: [s, b, f/tp]
    Only the [s/tp, b, h] slice is kept for backward, which all-gathers it again (overlapping grad @ W).
    gradient_accumulation_fusion=False: dW arrives in W.grad, as for nn.Linear. True (Megatron's fusion): dW is
    added straight into W.main_grad (fp32, or W's dtype if wider) and W.grad stays None; the layer creates
    main_grad on first use. A data-parallel wrapper that owns W.main_grad (a view of its bucket) sets
    W.grad_added_to_main_grad = False: the layer then sets it True and returns a placeholder dW, so autograd still
    fires W's post-accumulate-grad hook, where the wrapper drops W.grad instead of adding it (Megatron's handshake).
    A weight also used by another op in the same backward (tied) carries W.zero_out_wgrad = True, set by whoever
    ties it: the placeholder is then zeros, autograd adds the other op's dW to it, and the wrapper adds W.grad into
    main_grad when `not W.grad_added_to_main_grad or W.zero_out_wgrad` (Megatron's rule; an empty placeholder
    would lose that other dW, or add garbage).
    """
    @staticmethod
    def forward(ctx, x, weight, bias=None, group=None, gradient_accumulation_fusion=True):
        # the Parameter itself rides on ctx: main_grad and the flag live on it, and a saved tensor can come back
        # as another Python object (saved-tensor hooks)
        ctx.group, ctx.param, ctx.fusion, ctx.has_bias = group, weight, gradient_accumulation_fusion, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_along_dim(x, 0, group), weight, bias)              # [s, b, h] @ [h, f/tp]

    @staticmethod
    def backward(ctx, grad):                                                       # grad: [s, b, f/tp]
        x, weight = ctx.saved_tensors
        total, gathering = _gather_along_dim(x, 0, ctx.group, async_op=True)       # [s, b, h], in flight
        grad_input = grad.matmul(weight)                                           # [s, b, h], partial over ranks
        _wait(gathering)
        grad_x, scattering = _reduce_scatter_along_dim(grad_input, 0, ctx.group, async_op=True)  # [s/tp, b, h]
        grad, total = grad.flatten(0, -2), total.flatten(0, -2)  # [s*b, f/tp], [s*b, h]; while the reduce-scatter
        param, grad_weight = ctx.param, None                     # travels: dW = grad.T @ total  [f/tp, h]
        if not ctx.fusion:
            grad_weight = grad.t().matmul(total)
        else:
            main = getattr(param, "main_grad", None)            # a wrapper's view of its bucket: read once
            if main is None:
                main = param.main_grad = torch.zeros_like(param, dtype=torch.promote_types(param.dtype, torch.float32))
            main.addmm_(grad.t().to(main.dtype), total.to(main.dtype))
            if hasattr(param, "grad_added_to_main_grad"):   # a data-parallel wrapper waits for W's grad hook
                param.grad_added_to_main_grad = True        # the placeholder it drops, or adds where W is tied:
                zero_out = getattr(param, "zero_out_wgrad", False)   # zeros, to which autograd adds the other dW
                grad_weight = torch.zeros_like(param) if zero_out else torch.empty_like(param)
        grad_bias = grad.sum(0) if ctx.has_bias else None
        _wait(scattering)
        return grad_x, grad_weight, grad_bias, None, None


# layers
class _ParallelLinear(nn.Module):
    """What both layers share: this rank's shard of an nn.Linear weight [out, in], split along weight_dim."""
    weight_dim = 0

    def __init__(self, in_features, out_features, bias, group, device, dtype, sequence_parallel):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
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
            bias = _split_along_dim(bias, 0, self.group)
        return _split_along_dim(weight, self.weight_dim, self.group), bias

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
        sequence_parallel:  X_r [s/p, b, in] --all-gather along s--> X [s, b, in] --> Y_r [s, b, out/p]
    nn.Linear stores A^T as weight [out, in]: rank r keeps rows r of the weight, and b_r. With sequence_parallel
    it runs LinearWithSequenceParallel: backward keeps only X_r and all-gathers it again; every rank's X_r must
    have one shape, checked on every call (check_slices, see _check_equal_slices). gradient_accumulation_fusion
    (SP only): dW goes to weight.main_grad, not weight.grad.
    """
    weight_dim = 0

    def __init__(self, in_features, out_features, bias=True, gather_output=False, group=None,
                 device=None, dtype=None, sequence_parallel=False, gradient_accumulation_fusion=False,
                 check_slices=True):
        super().__init__(in_features, out_features, bias, group, device, dtype, sequence_parallel)
        self.gather_output, self.gradient_accumulation_fusion = gather_output, gradient_accumulation_fusion
        self.check_slices = check_slices

    def _check_equal_slices(self, x):
        """Unequal slices would abort gloo's all-gather (SIGABRT on one rank, the others carry on with a wrong
        shape) and hang NCCL's. So every call all-gathers a header of 8 int64 (64 B, one size whatever x is):
        x.dim(), x.numel() and the first 6 sizes; then waits for the answer (a host sync on a GPU). A caller
        whose slices are equal by construction (they come from a reduce-scatter) turns it off: check_slices=False."""
        if not self.check_slices or dist.get_world_size(self.group) == 1:
            return
        sizes = list(x.shape[:6])
        header = torch.tensor([x.dim(), x.numel(), *sizes, *[0] * (6 - len(sizes))], device=x.device)
        every = _gather_along_dim(header.unsqueeze(0), 0, self.group)             # [p, 8]
        if not bool((every == header).all()):
            shapes = [row[2:2 + min(row[0], 6)] for row in every.tolist()]
            raise ValueError(f"sequence-parallel slices differ across the group: shapes {shapes}; every "
                             f"rank must hand in [s/p, b, in] of one shape (scatter_to_sequence_parallel_region)")

    def forward(self, x):                       # x: [.., in] the same on every rank, or with SP [s/p, b, in]
        if self.sequence_parallel:
            self._check_equal_slices(x)
            y = LinearWithSequenceParallel.apply(x, self.weight, self.bias, self.group,
                                                 self.gradient_accumulation_fusion)
        else:
            y = F.linear(copy_to_tensor_model_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """Y = X A + b with A = [A_0; A_1; ..] split by rows (input features): rank r makes a partial sum X_r A_r.

        X_r [.., in/p] --> X_r A_r [.., out] --g--> sum_r X_r A_r + b = Y [.., out] (every rank)
        sequence_parallel:  X_r A_r [s, b, out] --reduce-scatter along s--> Y_r [s/p, b, out], + b
    nn.Linear stores A^T as weight [out, in]: rank r keeps columns r of the weight. The bias is whole on
    every rank and added once, after the reduction (added before it, it would count p times). With
    sequence_parallel each rank adds it to its part of the sequence only, so its gradient is a partial sum:
    the bias is marked `sequence_parallel` (as in Megatron) for allreduce_sequence_parallel_grads.
    """
    weight_dim = 1

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, group=None,
                 device=None, dtype=None, sequence_parallel=False):
        super().__init__(in_features, out_features, bias, group, device, dtype, sequence_parallel)
        self.input_is_parallel = input_is_parallel
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x):
        if not self.input_is_parallel:                          # x: [.., in] -> this rank's [.., in/p]
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(y, self.group)
        return y if self.bias is None else y + self.bias


def allreduce_sequence_parallel_grads(params, group=None):
    """Sum in one all-reduce the grads of parameters marked `sequence_parallel` (LN weight and bias, fc2's bias):
    under SP each rank applied them to its own slice of the sequence (NVIDIA/Megatron-LM#443). A gradient is read
    from `p.main_grad` where a data-parallel wrapper accumulates it there (Megatron's, and 09's), else `p.grad`."""
    grads = []
    for p in (p for p in params if getattr(p, "sequence_parallel", False)):
        g = getattr(p, "main_grad", None)           # read once: a wrapper's main_grad may be a property
        g = p.grad if g is None else g
        if g is not None:
            grads.append(g)
    if not grads:
        return
    flat = _reduce(torch.cat([g.flatten() for g in grads]), group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def parallel_mlp(mlp: nn.Sequential, group=None, sequence_parallel=False) -> nn.Sequential:
    """The parallel MLP holding this rank's shards of mlp = Sequential(Linear, activation, Linear):
    fc1 column-parallel (its output stays split), the activation on this rank's columns, fc2 row-parallel.
        x [s, b, h] --fc1--> [s, b, ffn/p] --act--> [s, b, ffn/p] --fc2--> [s, b, h]   (SP: x, out [s/p, b, h])"""
    fc1, act, fc2 = mlp
    options = dict(group=group, sequence_parallel=sequence_parallel)
    return nn.Sequential(ColumnParallelLinear.from_dense(fc1, **options), act,
                         RowParallelLinear.from_dense(fc2, **options))


def head_major(t, heads):
    """nn.MultiheadAttention packs its q|k|v rows as (3, heads, d); reorder to (heads, 3, d), Megatron's
    layout, so that a contiguous split of the rows gives each rank whole heads with their q, k and v."""
    return t.unflatten(0, (3, heads, -1)).transpose(0, 1).flatten(0, 2)


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with the heads split: rank r holds heads [r H/p, (r+1) H/p).

        x --f--> QKV_r (column) --> attention on own heads --> O_r [s, b, h/p] --> proj (row) --g--> y
        sequence_parallel: x and y are [s/p, b, h]; QKV all-gathers the sequence, proj reduce-scatters it
    x is sequence-first [s, b, h] (Megatron's), whichever batch_first the dense module had: the weights are alike.
    """
    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, local_heads: int):
        super().__init__()
        self.qkv, self.proj, self.local_heads = qkv, proj, local_heads

    @classmethod
    def from_dense(cls, mha: nn.MultiheadAttention, group=None, sequence_parallel=False):
        if mha.in_proj_weight is None or mha.bias_k is not None or mha.add_zero_attn or mha.dropout:
            raise ValueError("from_dense takes nn.MultiheadAttention without kdim, vdim, add_bias_kv, "
                             f"add_zero_attn or dropout (dropout={mha.dropout})")
        local_heads = _divide("num_heads", mha.num_heads, group)
        w = mha.in_proj_weight
        qkv = nn.Linear(w.shape[1], w.shape[0], bias=mha.in_proj_bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            qkv.weight.copy_(head_major(w, mha.num_heads))
            if qkv.bias is not None:
                qkv.bias.copy_(head_major(mha.in_proj_bias, mha.num_heads))
        options = dict(group=group, sequence_parallel=sequence_parallel)
        return cls(ColumnParallelLinear.from_dense(qkv, **options),
                   RowParallelLinear.from_dense(mha.out_proj, **options), local_heads)

    def forward(self, x):                                   # x: [s, b, h] on every rank (SP: [s/p, b, h])
        qkv = self.qkv(x)                                   # [s, b, 3 h/p]: the whole sequence, own heads
        s, b, _ = qkv.shape
        q, k, v = qkv.unflatten(-1, (self.local_heads, 3, -1)).permute(3, 1, 2, 0, 4)   # [b, H/p, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)                       # [b, H/p, s, d]
        return self.proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))                         # [s, b, h]


def tp_dp_groups(tp: int, timeout=None):
    """This rank's (tp_group, dp_group) in a DP x TP grid, TP fastest: rank = dp_rank * tp + tp_rank (the groups
    torch's init_device_mesh(device_type, (dp, tp)) builds). Every rank creates every group, in the same order.
    timeout: the groups' (None: torch's default, 30 min on gloo; pass the world's, as Megatron does)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by the tensor-parallel size {tp}")
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp)), timeout=timeout) for d in range(world // tp)]
    dp_groups = [dist.new_group(list(range(t, world, tp)), timeout=timeout) for t in range(tp)]
    return tp_groups[rank // tp], dp_groups[rank % tp]


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
try:
    from common import (finish, head, kept_for_backward, launched_world_size, log, log_all, pg_timeout, refuse,
                        refused, ring_bytes, setup, strided_groups, traffic)
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

HIDDEN, HEADS, FFN, BATCH, SEQ = 32, 8, 64, 2, 8  # every size divides by p in {1, 2, 4, 8}
SEQ_DIM = 0  # activations are Megatron's [s, b, h]: sequence parallelism splits dim 0
F64 = torch.float64
HEADER = 8 * 8  # the SP column layer's slice check: an all-gather of 8 int64 on every call
BF16_TOL = 2 ** -6  # rtol and atol in bf16: 2 units in the last place at 1 (bf16 keeps 8 significant bits)


def ints(seed, *shape, device, dtype=F64):
    """The same integer-valued tensor on every rank (exact sums in float64), as a non-contiguous view."""
    wide = torch.randint(-9, 10, (*shape[:-1], 2 * shape[-1]), generator=torch.Generator().manual_seed(seed))
    return wide.to(device, dtype)[..., ::2]


def leaf(t):
    """A tensor that requires grad, with t's values, stored non-contiguously (every second element)."""
    return t.new_zeros((*t.shape[:-1], 2 * t.shape[-1]))[..., ::2].copy_(t).requires_grad_()


def members(group):
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def part(t, dim, group, rank=None):
    """Global rank `rank`'s (default: this rank's) slice of t along dim among group's members: the demo's own
    reference, independent of the blocks' helpers."""
    ranks = members(group)
    return t.chunk(len(ranks), dim)[ranks.index(dist.get_rank() if rank is None else rank)]


def wire(t, p):
    """Bytes this rank puts on the wire for what traffic() counted, p ranks per group: common.ring_bytes of each
    collective (an all-gather's V is its output, p x what this rank hands in)."""
    return sum(ring_bytes(name, p * b if name == "all_gather" else b, p) for name, _, b in t.calls)


def check_op(op, group, x, dy, want_y, want_dx, replicated, comms):
    """The adjoint test <op(x), dy> == <x, op_backward(dy)> (a replicated tensor is ONE value, its inner product
    counted once; a sharded or partial-sum tensor's is summed over the group), op's forward and backward values,
    and the collectives it issued: [(name, bytes handed in)], all on `group`."""
    x = leaf(x)
    with traffic() as t:
        y = op(x, group)
        (dx,) = torch.autograd.grad(y, x, dy)
    inner = [(a * b).sum().detach() for a, b in ((x, dx), (y, dy))]  # replicated: (x's, y's)
    for s, rep in zip(inner, replicated):
        if not rep:
            dist.all_reduce(s, group=group)
    assert torch.equal(*inner), (op, inner)
    assert torch.equal(y, want_y) and torch.equal(dx, want_dx), op
    ranks = tuple(members(group))
    assert t.calls == [(name, ranks, nbytes) for name, nbytes in comms if len(ranks) > 1], (op, t.calls)


def mappings(groups, device):
    world, rank = dist.get_world_size(), dist.get_rank()
    X = [ints(s, SEQ, BATCH, HIDDEN, device=device) for s in range(world)]         # rank s's own input
    # rank s's own output grad, contiguous: the caller's tensor, which f's backward must not all-reduce in place
    DY = [ints(100 + s, SEQ, BATCH, HIDDEN, device=device).contiguous() for s in range(world)]
    A, B = ints(1000, SEQ, BATCH, HIDDEN, device=device), ints(1001, SEQ, BATCH, HIDDEN, device=device)  # alike
    x, dy = X[rank], DY[rank]
    for group in groups:
        ranks = members(group)
        sum_x, sum_dy = sum(X[s] for s in ranks), sum(DY[s] for s in ranks)
        feat, seq = (lambda t: part(t, -1, group)), (lambda t: part(t, SEQ_DIM, group))
        every = lambda T, dim: torch.cat([part(T[s], dim, group, s) for s in ranks], dim)  # member s's slice s
        cases = (
            # f: A -> A;  backward: DY[r] -> the group's sum
            (copy_to_tensor_model_parallel_region, A, dy, A, sum_dy, (True, False), [("all_reduce", dy)]),
            # g: X[r] -> the group's sum;  backward: B -> B
            (reduce_from_tensor_model_parallel_region, x, B, sum_x, B, (False, True), [("all_reduce", x)]),
            # scatter: A -> A's slice r of the last dim;  backward: DY[r]'s slice r -> every member's, joined
            (scatter_to_tensor_model_parallel_region, A, feat(dy), feat(A), every(DY, -1), (True, False),
             [("all_gather", feat(dy))]),
            # gather: X[r]'s slice r -> every member's, joined;  backward: B -> B's slice r
            (gather_from_tensor_model_parallel_region, feat(x), B, every(X, -1), feat(B), (False, True),
             [("all_gather", feat(x))]),
            # SP gather: X[r]'s part r of the sequence -> every member's, joined;  backward: DY[r] -> part r
            # of the group's sum
            (gather_from_sequence_parallel_region, seq(x), dy, every(X, SEQ_DIM), seq(sum_dy), (False, False),
             [("all_gather", seq(x)), ("reduce_scatter", dy)]),
            # SP reduce-scatter: X[r] -> part r of the group's sum;  backward: DY[r]'s part r -> every
            # member's, joined
            (reduce_scatter_to_sequence_parallel_region, x, seq(dy), seq(sum_x), every(DY, SEQ_DIM),
             (False, False), [("reduce_scatter", x), ("all_gather", seq(dy))]),
            # SP scatter: A -> A's part r of the sequence;  backward: DY[r]'s part r -> every member's, joined
            (scatter_to_sequence_parallel_region, A, seq(dy), seq(A), every(DY, SEQ_DIM), (True, False),
             [("all_gather", seq(dy))]))
        for op, x_in, dy_in, want_y, want_dx, replicated, comms in cases:
            check_op(op, group, x_in, dy_in, want_y, want_dx, replicated, [(n, t.nbytes) for n, t in comms])
        assert all(op(A, group).is_contiguous() for op in (scatter_to_sequence_parallel_region,
                                                            scatter_to_tensor_model_parallel_region))  # A strided
    log("f, g, scatter, gather, and SP's gather, reduce-scatter and scatter along s: forward and backward == "
        "closed forms; scatters hand back a contiguous slice")
    log("each passes <op(x), dy> == <x, op_backward(dy)>, a replicated tensor's inner product counted once")
    log("each issues its collective(s) on its group, handing in the tensor its docstring names (traffic())")


def check_grads(layers_and_dense_grads, group):
    """Each layer's weight and bias grads == its slice of the dense layer's (the row bias: whole)."""
    for layer, weight_grad, bias_grad in layers_and_dense_grads:
        torch.testing.assert_close(layer.weight.grad, part(weight_grad, layer.weight_dim, group))
        torch.testing.assert_close(layer.bias.grad, part(bias_grad, 0, group) if layer.weight_dim == 0 else bias_grad)


def check_against_dense(dense_fn, parallel, x, dy, group, dense_grads, x_dim=None, y_dim=None):
    """Forward, then backward from dy: the output, the input grad and every (layer, dense weight grad, dense bias
    grad) in dense_grads() == dense, sharded as the layer holds it. x_dim / y_dim: the dim along which the
    parallel input / output is this rank's slice (None: whole). Returns traffic() of the parallel step."""
    cut = lambda t, dim: t if dim is None else part(t, dim, group)
    x_p, x = leaf(cut(x, x_dim)), leaf(x)
    with traffic() as t:
        y_p = parallel(x_p)
        y_p.backward(cut(dy, y_dim))
    allreduce_sequence_parallel_grads(parallel.parameters(), group)
    y = dense_fn(x)
    y.backward(dy)
    torch.testing.assert_close(y_p, cut(y, y_dim))
    torch.testing.assert_close(x_p.grad, cut(x.grad, x_dim))
    check_grads(dense_grads(), group)
    assert all(ranks == tuple(members(group)) for _, ranks, _ in t.calls), t.calls
    return t


def names(t):
    return [name for name, _, _ in t.calls]


def check_layers(groups, device, cases):
    """cases: (class, options, x_dim, y_dim, the collectives issued forward then backward), each from_dense of one
    nn.Linear, checked against it on the world and on the strided groups."""
    torch.manual_seed(1)
    dense = nn.Linear(HIDDEN, FFN, device=device, dtype=F64)
    x, dy = ints(2, SEQ, BATCH, HIDDEN, device=device), ints(3, SEQ, BATCH, FFN, device=device)
    for group in groups:
        for cls, options, x_dim, y_dim, comms in cases:
            dense.zero_grad()
            layer = cls.from_dense(dense, group, **options)
            t = check_against_dense(dense, layer, x, dy, group, lambda: [(layer, dense.weight.grad, dense.bias.grad)],
                                    x_dim, y_dim)
            assert names(t) == (comms if dist.get_world_size(group) > 1 else []), (cls, options, t.calls)
    return dense, x


def linear_layers(groups, device):
    dense, x = check_layers(groups, device, (
        (ColumnParallelLinear, {"gather_output": True}, None, None, ["all_gather", "all_reduce"]),
        (RowParallelLinear, {"input_is_parallel": False}, None, None, ["all_reduce", "all_gather"])))
    log("column (gather_output=True): output, input grad, grad shards == dense; all-gather fwd, all-reduce bwd")
    log("row (input_is_parallel=False): output, input grad, grad shards == dense; all-reduce fwd, all-gather bwd")
    world = dist.get_world_size()
    row = RowParallelLinear.from_dense(dense)
    bias_inside = _reduce(F.linear(part(x, -1, None), row.weight, row.bias), None)  # the bias added before g
    torch.testing.assert_close(bias_inside - dense(x), (world - 1) * dense.bias.expand_as(bias_inside))
    log(f"the row layer adds its bias once, after the all-reduce; before it, the bias would count {world} times")
    refusals(groups[0])


def refusals(group):
    """Sizes that do not divide by the group size: one clear ValueError line."""
    world = dist.get_world_size(group)
    for make, name in ((lambda: ColumnParallelLinear(HIDDEN, world + 1), f"out_features={world + 1}"),
                       (lambda: RowParallelLinear(world + 1, HIDDEN), f"in_features={world + 1}"),
                       (lambda: reduce_scatter_to_sequence_parallel_region(torch.zeros(world + 1, 1, 1)),
                        f"x.shape[{SEQ_DIM}]={world + 1}")):
        if world == 1:
            make()                                     # on one rank every size divides
            continue
        said = refused(make)
        assert said == f"{name} is not divisible by the group size {world}", said
        log(f"refused: ValueError('{said}')")


def dense_blocks(seed, device, dtype=F64):
    """An MLP and a causal nn.MultiheadAttention, each as (module, its forward, grads: parallel -> [(layer,
    dense weight grad, dense bias grad)]), and their parallel versions as make(module, group, sp)."""
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)).to(device, dtype)
    mha = nn.MultiheadAttention(HIDDEN, HEADS, device=device, dtype=dtype)          # [s, b, h] in and out
    causal = nn.Transformer.generate_square_subsequent_mask(SEQ, device=device, dtype=dtype)
    mlp_grads = lambda par: [(par[i], mlp[i].weight.grad, mlp[i].bias.grad) for i in (0, 2)]  # fc1, fc2
    attn_grads = lambda par: [(par.qkv, head_major(mha.in_proj_weight.grad, HEADS),
                               head_major(mha.in_proj_bias.grad, HEADS)),
                              (par.proj, mha.out_proj.weight.grad, mha.out_proj.bias.grad)]
    return {"MLP": (mlp, mlp, mlp_grads, parallel_mlp),
            "attention": (mha, lambda x: mha(x, x, x, need_weights=False, attn_mask=causal, is_causal=True)[0],
                          attn_grads, ParallelSelfAttention.from_dense)}


def mlp_and_attention(groups, device, sp=False):
    """Each block == dense on the world and on the strided groups, its collectives counted: one all-reduce each
    way (SP: an all-gather and a reduce-scatter each way, after the column layer's 64-B slice check), the same
    bytes on the wire: 2 (p-1)/p V each way."""
    x, dy = ints(4, SEQ, BATCH, HIDDEN, device=device), ints(5, SEQ, BATCH, HIDDEN, device=device)
    V = x.numel() * x.element_size()
    seq_dim = SEQ_DIM if sp else None
    # SP: forward the slice check, all-gather, reduce-scatter; backward all-gather (row), all-gather again and
    # reduce-scatter (column)
    comms = (["all_gather"] * 2 + ["reduce_scatter", "all_gather", "all_gather", "reduce_scatter"] if sp else
             ["all_reduce"] * 2)
    for name, (dense, dense_fn, grads, make) in dense_blocks(2, device).items():
        for group in groups:
            p = dist.get_world_size(group)
            dense.zero_grad()
            par = make(dense, group, sequence_parallel=sp)
            t = check_against_dense(dense_fn, par, x, dy, group, lambda: grads(par), seq_dim, seq_dim)
            assert names(t) == (comms if p > 1 else []), (name, t.calls)
            assert t.calls[:sp] == [("all_gather", tuple(members(group)), HEADER)][:sp * (p > 1)], t.calls
            assert wire(t, p) == (4 + sp) * (p - 1) * V / p + sp * (p - 1) * HEADER, (name, t.calls)
            if group is not None:
                continue
            if sp:
                log(f"{name}: == dense; all-gather + reduce-scatter forward, and backward one all-gather more: "
                    f"{wire(t, p):g} bytes on the wire = (2 + 3) ({p}-1)/{p} * {V} + ({p}-1) * {HEADER} (the check)")
            else:
                log(f"{name}: output, input grad, every grad shard == dense; one all-reduce each way: "
                    f"{wire(t, p):g} bytes on the wire = (2 + 2) ({p}-1)/{p} * {V}")
            per_rank, whole = (sum(q.nbytes for q in m.parameters()) for m in (par, dense))
            bias = HIDDEN * F64.itemsize  # the row layer's bias: the one parameter kept whole, not split
            assert p * per_rank == whole + (p - 1) * bias, (per_rank, whole, bias)
            if not sp:
                log(f"{name}: {per_rank} parameter bytes per rank = ({whole} - {bias}) / {p} + {bias}: "
                    f"all split but the row bias, whole on every rank")


def sequence_parallel(groups, device):
    check_layers(groups, device, (
        (ColumnParallelLinear, {"sequence_parallel": True}, SEQ_DIM, -1,
         ["all_gather", "all_gather", "all_gather", "reduce_scatter"]),               # the slice check first
        (ColumnParallelLinear, {"sequence_parallel": True, "check_slices": False}, SEQ_DIM, -1,
         ["all_gather", "all_gather", "reduce_scatter"]),
        (RowParallelLinear, {"sequence_parallel": True}, -1, SEQ_DIM, ["reduce_scatter", "all_gather"]),
        (ColumnParallelLinear, {"sequence_parallel": True, "gather_output": True}, SEQ_DIM, None,
         ["all_gather", "all_gather", "all_gather", "all_gather", "reduce_scatter"]),
        (RowParallelLinear, {"sequence_parallel": True, "input_is_parallel": False}, None, SEQ_DIM,
         ["reduce_scatter", "all_gather", "all_gather"])))
    log("column [s/p, b, in] -> [s, b, out/p]: all-gathers s forward; backward all-gathers it again (for dW) and "
        "reduce-scatters the input grad; == dense")
    log("row [s, b, in/p] -> [s/p, b, out]: reduce-scatters s forward, all-gathers backward; == dense")
    log("both also with gather_output=True / input_is_parallel=False; the row bias grad (this rank's part of s)")
    log("summed over the group by allreduce_sequence_parallel_grads == dense")
    mlp_and_attention(groups, device, sp=True)
    unequal_slices(groups[-1], device)
    in_a_wrapper(device)


def unequal_slices(sub, device):
    """The SP column layer's precondition, equal slices on every rank, checked on every call by one all-gather of
    a 64-B header: a rank whose length alone changes, or every rank's, raises one ValueError line on every rank
    instead of aborting gloo; check_slices=False issues nothing more than the layer's own all-gather."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layer = ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=True, device=device, dtype=F64)
    x = torch.zeros(SEQ // world, BATCH, HIDDEN, device=device, dtype=F64)
    for check in (True, False):
        layer.check_slices = check
        with traffic() as t:
            layer(x)
            layer(x)
        want = ([("all_gather", HEADER)] * check + [("all_gather", x.nbytes)]) * 2 if world > 1 else []
        assert [(n, b) for n, _, b in t.calls] == want, (check, t.calls)
    layer.check_slices = True
    n, size = 2 + rank % 2, dist.get_world_size(sub)                      # each strided group its own length:
    layer_sub = ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=True, group=sub, device=device, dtype=F64)
    assert layer_sub(x.new_zeros(n, BATCH, HIDDEN)).shape == (size * n, BATCH, FFN // size)   # equal in each group
    if world == 1:
        return
    for lengths in ([SEQ // world + (r == world - 1) for r in range(world)],     # the last rank's alone changes
                    [SEQ // world + 1 + (r > 0) for r in range(world)]):      # every rank's changes
        try:
            layer(torch.zeros(lengths[rank], BATCH, HIDDEN, device=device, dtype=F64))
            raise AssertionError(f"unequal slices {lengths} accepted")
        except ValueError as e:
            shapes = [[n, BATCH, HIDDEN] for n in lengths]
            said = str(e)
            assert said.startswith(f"sequence-parallel slices differ across the group: shapes {shapes}; "), said
    y = layer(x)                                                          # equal again: the layer carries on
    assert y.shape == (SEQ, BATCH, FFN // world), y.shape
    log(f"unequal slices refused by a ValueError on every rank: the last rank's length alone changed "
        f"({SEQ // world} -> {SEQ // world + 1}), or every rank's")
    log(f"equal slices checked on every call by one all-gather of a {HEADER}-B header (check_slices=False: none)")


def in_a_wrapper(device):
    """The SP MLP with gradient_accumulation_fusion in a data-parallel wrapper's handshake (as 09's): every grad
    into the wrapper's main_grad, fc1's W also used by an ordinary op (W.zero_out_wgrad: a zero placeholder that the
    hook adds), the row bias's read from main_grad by allreduce_sequence_parallel_grads; 2 micro-batches == dense."""
    world = dist.get_world_size()
    mlp = dense_blocks(2, device)["MLP"][0]
    par = parallel_mlp(mlp, sequence_parallel=True)
    par[0].gradient_accumulation_fusion, w, fired = True, par[0].weight, []
    x, dy = ints(4, SEQ, BATCH, HIDDEN, device=device), ints(5, SEQ, BATCH, HIDDEN, device=device)
    tie = ints(6, *w.shape, device=device)                              # the other use of W: <W, tie>

    def hook(p):                                                        # Megatron's rule, as 09's wrapper obeys it
        fired.append((p is w, p.grad_added_to_main_grad))
        if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False):
            p.main_grad.add_(p.grad)
        p.grad, p.grad_added_to_main_grad = None, False
    for p in par.parameters():
        p.main_grad, p.grad_added_to_main_grad = torch.zeros_like(p), False
        p.register_post_accumulate_grad_hook(hook)
    w.zero_out_wgrad = True
    for _ in range(2):
        ((par(part(x, SEQ_DIM, None)) * part(dy, SEQ_DIM, None)).sum() + (w * tie).sum()).backward()
    allreduce_sequence_parallel_grads(par.parameters())
    mlp.zero_grad()
    mlp(x).backward(dy)
    wants = [part(mlp[0].weight.grad, 0, None) + tie, part(mlp[0].bias.grad, 0, None),
             part(mlp[2].weight.grad, 1, None), mlp[2].bias.grad]
    for p, want in zip(par.parameters(), wants):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, 2 * want)
    assert sorted(fired) == [(False, False)] * 6 + [(True, True)] * 2, fired     # each hook once a backward
    w16 = torch.zeros(FFN // world, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    LinearWithSequenceParallel.apply(torch.ones(SEQ // world, BATCH, HIDDEN, device=device).bfloat16(), w16).sum() \
        .backward()
    assert w16.grad is None and w16.main_grad.dtype == torch.float32    # the layer's own main_grad: fp32
    log("in a data-parallel wrapper's handshake (fused dW into main_grad; W tied, zero_out_wgrad; the row bias read "
        "from main_grad): 2 micro-batches == dense; bf16 W: main_grad fp32")


def activation_memory(device):
    """The MLP's saved activations, TP vs SP, in bytes: only fc1's input shrinks, to 1/p (fc1 keeps its slice
    and gathers it again in backward); fc1's and GeLU's outputs are [s, b, ffn/p] either way. (Not memory().live():
    gloo's worker threads let go of a finished collective's buffer a moment late, so it is not exact every run.)"""
    world = dist.get_world_size()
    mlp = dense_blocks(2, device)["MLP"][0]
    x, dy = ints(4, SEQ, BATCH, HIDDEN, device=device), ints(5, SEQ, BATCH, HIDDEN, device=device)
    V, A = x.numel() * F64.itemsize, SEQ * BATCH * FFN // world * F64.itemsize   # [s, b, h], [s, b, ffn/p]
    got = {}
    for sp, fusion in ((False, False), (True, False), (True, True)):
        par = parallel_mlp(mlp, sequence_parallel=sp)
        par[0].gradient_accumulation_fusion = fusion
        x_in = (part(x, SEQ_DIM, None) if sp else x).clone().requires_grad_()  # its own contiguous storage
        y, got[sp] = kept_for_backward(lambda: par(x_in), par.parameters(), [x_in])   # fc1 keeps x_in, no copy
        y.backward(part(dy, SEQ_DIM, None) if sp else dy)
        if fusion:  # Megatron's gradient-accumulation fusion: dW in fp32 main_grad, weight.grad left None
            assert par[0].weight.grad is None and par[0].weight.main_grad.dtype == F64
            torch.testing.assert_close(par[0].weight.main_grad, par[0].shard(mlp[0].weight.grad)[0])
        else:
            mlp.zero_grad()
            mlp(x).backward(dy)
            torch.testing.assert_close(par[0].weight.grad, par[0].shard(mlp[0].weight.grad)[0])
    assert got == {False: V + 2 * A, True: V // world + 2 * A}, got    # fc1's input, GeLU's, fc2's
    log(f"MLP saved for backward: TP {got[False]} B = V + 2A, SP {got[True]} B = V/{world} + 2A; V = {V} B "
        f"(fc1's input), A = {A} B ([s, b, ffn/p])")
    log("gradient_accumulation_fusion=True: dW in weight.main_grad (fp32 or wider) == dense, weight.grad None")
    mha, att = dense_blocks(2, device)["attention"][0], {}
    for sp in (False, True):
        layer = ParallelSelfAttention.from_dense(mha, sequence_parallel=sp)
        x_in = (part(x, SEQ_DIM, None) if sp else x).clone().requires_grad_()
        att[sp] = kept_for_backward(lambda: layer(x_in), layer.parameters(), [x_in])[1]
    assert att[False] - att[True] == V - V // world, att    # QKV's input [s, b, h] -> [s/p, b, h]; the rest alike
    log(f"attention saved for backward: TP {att[False]} B, SP {att[True]} B: QKV's input, V - V/{world} B less")


def bfloat16(device):
    """The blocks in bf16 against the same dense modules in bf16."""
    x, dy = (torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(s)).to(device, torch.bfloat16)
             for s in (6, 7))
    for dense, dense_fn, _, make in dense_blocks(3, device, torch.bfloat16).values():
        for sp in (False, True):
            par = make(dense, sequence_parallel=sp)
            cut = (lambda t: part(t, SEQ_DIM, None)) if sp else (lambda t: t)
            x_p, x_d = leaf(cut(x)), leaf(x)
            y_p = par(x_p)
            y_p.backward(cut(dy))
            y = dense_fn(x_d)
            y.backward(dy)
            for got, want in [(y_p, y), (x_p.grad, x_d.grad)]:
                torch.testing.assert_close(got, cut(want), rtol=BF16_TOL, atol=BF16_TOL)
    log(f"MLP and attention, TP and SP, in bf16 (the collectives too): output and input grad == the dense bf16 "
        f"modules' within rtol = atol = 2**-6")


def tp_dp_grid(device):
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = world // 2 if world >= 4 else world
    dp, dp_rank = world // tp, rank // tp
    tp_group, dp_group = tp_dp_groups(tp, timeout=pg_timeout())
    log(f"{world} ranks -> TP {tp} x DP {dp}: a TP group is consecutive ranks (one node), a DP group strided")
    members_ = [members(g) for g in (tp_group, dp_group)]
    assert members_ == [[dp_rank * tp + t for t in range(tp)], [d * tp + rank % tp for d in range(dp)]], members_
    log_all(f"TP group {members_[0]}, DP group {members_[1]}")
    sums = [_reduce(torch.tensor([2.0 ** rank], device=device, dtype=F64), g).item() for g in (tp_group, dp_group)]
    assert sums == [sum(2.0 ** r for r in ranks) for ranks in members_], sums
    log(f"2**rank all-reduced on rank 0: {sums[0]:g} over its TP group, {sums[1]:g} over its DP group")
    # each DP replica feeds its own micro-batch to an MLP split over its own TP group
    mlp, _, grads, _ = dense_blocks(4, device)["MLP"]
    p_mlp = parallel_mlp(mlp, group=tp_group)
    xs = [ints(10 + d, SEQ, BATCH, HIDDEN, device=device) for d in range(dp)]
    dys = [ints(20 + d, SEQ, BATCH, HIDDEN, device=device) for d in range(dp)]
    t = check_against_dense(mlp, p_mlp, xs[dp_rank], dys[dp_rank], tp_group, lambda: grads(p_mlp))
    assert names(t) == (["all_reduce"] * 2 if tp > 1 else []), t.calls  # g and f, on the TP group only
    for p in p_mlp.parameters():                                # DP: average each grad shard over the replicas
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= dp
    mlp.zero_grad()
    (sum((mlp(x) * dy).sum() for x, dy in zip(xs, dys)) / dp).backward()  # dense: all micro-batches at once
    check_grads(grads(p_mlp), tp_group)
    log(f"TP MLP == dense on its replica's micro-batch; DP-averaged grad shards == dense over the {dp} micro-batches")
    return tp, dp


def main():
    W = launched_world_size()
    if HEADS % W:
        refuse(f"{W} ranks: {HEADS} heads, hidden {HIDDEN}, ffn {FFN} and sequence {SEQ} split over 1, 2, 4 or 8 "
               f"ranks only")
    _, world, device = setup()
    pairs = strided_groups()           # {0, 2, ..} and {1, 3, ..}: group rank != global rank
    groups, strided = (None, pairs[dist.get_rank() % 2][0]), " ".join(str(ranks) for _, ranks in pairs)
    head(f"the six mappings on the world (p = {world}) and on the strided groups {strided}: exact in float64")
    mappings(groups, device)
    head("ColumnParallelLinear and RowParallelLinear against nn.Linear, on the world and the strided groups")
    linear_layers(groups, device)
    head(f"parallel MLP (column -> GeLU -> row) and self-attention ({HEADS} heads, {HEADS // world} per rank)")
    mlp_and_attention(groups, device)
    head(f"sequence parallelism: activations split along s (dim {SEQ_DIM}) between blocks")
    sequence_parallel(groups, device)
    head("activation memory under SP, in bytes (common.held_bytes of what autograd saves)")
    activation_memory(device)
    head("bf16: the blocks against the same dense modules in bf16")
    bfloat16(device)
    head("TP inside a 2-D grid: TP x DP process groups from dist.new_group")
    tp, dp = tp_dp_grid(device)
    finish(f"f/g/scatter/gather and the SP pair, column/row layers, MLP, attention (TP and SP) == dense at "
           f"TP={world} and on sub-groups; bf16; TP {tp} x DP {dp}")


if __name__ == "__main__":
    main()
