"""05 - tensor parallelism, Megatron-style: split a layer's weight across the ranks of a TP group.

Each transformer block runs its MLP and its attention on p ranks (Megatron-LM, Shoeybi et al. 2019). The first
linear is split by output columns (ColumnParallelLinear), the second by input rows (RowParallelLinear), so the only
communication is one all-reduce per block forward and one backward:
                A = [A_0 | A_1]  (columns of fc1)         B = [B_0 ; B_1]  (rows of fc2)
    rank 0:  X --f--> X A_0 --act--> Z_0 --> Z_0 B_0 --+
                                                       g --> Y = Z_0 B_0 + Z_1 B_1 + b   (every rank)
    rank 1:  X --f--> X A_1 --act--> Z_1 --> Z_1 B_1 --+
    f = copy_to_tensor_model_parallel_region       forward: identity        backward: all-reduce
    g = reduce_from_tensor_model_parallel_region   forward: all-reduce      backward: identity
Attention is split by heads: q|k|v column-parallel, the output projection row-parallel. A fused projection is
split by pieces, not as it lies (that would give rank 0 all of q, or gates without their up rows): fused_shard,
    nanoGPT's c_attn [q; k; v] -> rank r: [q_r; k_r; v_r]        SwiGLU's [gate; up] -> rank r: [gate_r; up_r]
GQA: rank r holds n_head/p query heads and the K/V heads they read, n_kv_head/p; where p > n_kv_head, each K/V
head sits on the p/n_kv_head ranks that read it (replicated), its gradient summed over them.

Sequence parallelism (sequence_parallel=True; Korthikanti et al. 2022): between blocks each rank keeps only its
part of s (dim 0 of Megatron's [s, b, h], or sequence_dim=1 of [b, s, h]); g becomes a reduce-scatter, f an all-gather:
    rank 0:  X_0 --+                      +--> X A_0 .. Z_0 B_0 --+                          +--> Y_0 (+ b)
                   all-gather along s                             reduce-scatter along s
    rank 1:  X_1 --+                      +--> X A_1 .. Z_1 B_1 --+                          +--> Y_1 (+ b)
The column layer keeps only X_r for backward and all-gathers it again there: its saved input is 1/p of TP's.
Bytes a rank sends per block, V = batch * seq * hidden * bytes: TP a ring all-reduce, 2 (p-1)/p * V, forward (g)
and backward (f); SP an all-gather and a reduce-scatter, (p-1)/p * V each, each way, an all-gather more backward,
and a 64-B header a column call (every X_r one shape; check_slices=False skips it). Replicated K/V heads add, in
backward, an all-reduce of their weight and bias grads: 2 (p-1)/p * 2 n_kv_head d (h + 1) * bytes. A rank holds
1/p of each weight and column bias, the row bias whole (its SP grad partial: allreduce_sequence_parallel_grads).
dW lands in W.grad, for any torch optimizer. TP groups sit inside a node, in a data-parallel grid (tp_dp_groups).

    torchrun --nproc-per-node=4 05_tp_layers.py
tests/check_05.py proves the rest: SwiGLU, options, sub-groups, TP x DP, bf16, bytes, main_grad, GQA counts, refusals.
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


# Megatron's public names: the SP regions cut dim 0, s of [s, b, h] (batch-first callers pass dim=1)
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
    """forward: all-gather x along the sequence, then x @ W.T + b; backward: grad_x = grad @ W, reduce-scattered
    async while dW is computed (Megatron's LinearWithGradAccumulationAndAsyncCommunication).

        x: [s/tp, b, h] this rank's slice     W: [f/tp, h] this rank's rows     out: [s, b, f/tp]
    sequence_dim=1 (torch's SequenceParallel(sequence_dim=1)): x [b, s/tp, h], out [b, s, f/tp] ([s, b, ..] memory).
    Only the [s/tp, b, h] slice is kept for backward, which all-gathers it again (overlapping grad @ W).
    dW arrives in W.grad, as for nn.Linear, in any model and with any torch optimizer. Megatron's fusion happens
    only where a data-parallel wrapper asks for it, by giving W a `main_grad` (its view of a bucket, fp32 or
    wider) and `W.grad_added_to_main_grad = False` (gradient_accumulation_fusion=False declines): the layer then
    adds dW into W.main_grad itself, sets the flag True and returns a placeholder dW, so autograd still fires W's
    post-accumulate-grad hook, where the wrapper drops it. A weight also used by another op in the same backward
    (tied) carries W.zero_out_wgrad = True, set by whoever ties it: the placeholder is then zeros, autograd adds
    the other op's dW to it, and the wrapper adds W.grad into main_grad (Megatron's rule).
    """
    @staticmethod
    def forward(ctx, x, weight, bias=None, group=None, gradient_accumulation_fusion=True, sequence_dim=0):
        if type(sequence_dim) is not int or not 0 <= sequence_dim < x.dim() - 1:
            raise ValueError(f"sequence_dim={sequence_dim!r} is not a dim of x {tuple(x.shape)} before its features")
        # ctx holds the Parameter itself: main_grad and its flag live on it (saved-tensor hooks may hand back another)
        ctx.group, ctx.param, ctx.fusion, ctx.has_bias = group, weight, gradient_accumulation_fusion, bias is not None
        ctx.dim, x = sequence_dim, x.movedim(sequence_dim, 0).contiguous()        # [s/tp, b, h]
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_along_dim(x, 0, group), weight, bias).movedim(0, sequence_dim)  # [s, b, h] @ [h, f/tp]

    @staticmethod
    def backward(ctx, grad):                                                       # grad: [s, b, f/tp]
        x, weight = ctx.saved_tensors
        total, gathering = _gather_along_dim(x, 0, ctx.group, async_op=True)       # [s, b, h], in flight
        grad = grad.movedim(ctx.dim, 0).contiguous()                               # [s, b, f/tp]
        grad_input = grad.matmul(weight)                                           # [s, b, h], partial over ranks
        _wait(gathering)
        grad_x, scattering = _reduce_scatter_along_dim(grad_input, 0, ctx.group, async_op=True)  # [s/tp, b, h]
        grad, total = grad.flatten(0, -2), total.flatten(0, -2)  # [s*b, f/tp], [s*b, h]; while the reduce-scatter
        param, grad_weight = ctx.param, None                     # travels: dW = grad.T @ total  [f/tp, h]
        if ctx.fusion and getattr(param, "grad_added_to_main_grad", None) is False:   # a wrapper asked for it
            param.main_grad.addmm_(grad.t().to(param.main_grad.dtype), total.to(param.main_grad.dtype))
            param.grad_added_to_main_grad = True            # the placeholder it drops, or adds where W is tied:
            zero_out = getattr(param, "zero_out_wgrad", False)   # zeros, to which autograd adds the other dW
            grad_weight = torch.zeros_like(param) if zero_out else torch.empty_like(param)
        else:
            grad_weight = grad.t().matmul(total)                 # [f/tp, h], contiguous: autograd's layout
        grad_bias = grad.sum(0) if ctx.has_bias else None
        _wait(scattering)
        return grad_x.movedim(0, ctx.dim), grad_weight, grad_bias, None, None, None


# layers: this rank's shard of a dense nn.Linear; dW lands in weight.grad, as nn.Linear's does
def _heads_of(what, n, group):
    """(first, count) of the n heads this rank holds: n/p; where p > n, head r // (p/n) alone (replicated)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if n < 1 or (n % size and size % n):
        raise ValueError(f"{what}={n} is not a positive multiple or divisor of the group size {size}")
    return (rank * n // size, n // size) if n % size == 0 else (rank // (size // n), 1)


def fused_shard(t, fused, group=None):
    """This rank's rows of a fused projection's weight, bias or gradient t = [piece_0; piece_1; ..], piece i being
    fused[i] units (heads) of equal rows; rank r gets its units of every piece, in order:
        nanoGPT's c_attn [q; k; v]: fused=(n_head, n_kv_head, n_kv_head)  ->  rank r: [q_r; k_r; v_r]
        SwiGLU's [gate; up]: fused=(ffn, ffn), units of one row          ->  rank r: [gate_r; up_r]
    Separate projections (Llama's wq, wk, wv; w1, w3): torch.cat their weights first."""
    if not fused or t.shape[0] % sum(fused):
        raise ValueError(f"{t.shape[0]} rows do not split into fused={tuple(fused)} units of equal rows")
    unit, heads = t.shape[0] // sum(fused), [_heads_of(f"fused[{i}]", n, group) for i, n in enumerate(fused)]
    return torch.cat([piece[first * unit:(first + count) * unit]                # this rank's heads of each piece
                      for piece, (first, count) in zip(t.split([n * unit for n in fused]), heads)])


class _SumReplicatedGrads(torch.autograd.Function):
    """forward: identity on a fused column layer's (weight, bias); backward: the grads of each replicated head summed
    over the ranks holding it, by one all-reduce of those pieces laid out whole (zeros but this rank's head)."""
    @staticmethod
    def forward(ctx, fused, group, weight, bias):
        ctx.fused, ctx.group = fused, group
        return weight, bias

    @staticmethod
    def backward(ctx, grad_w, grad_b):
        g = grad_w if grad_b is None else torch.cat([grad_w, grad_b.unsqueeze(1)], 1)     # [rows, in (+1)]
        size, heads = dist.get_world_size(ctx.group), [_heads_of(f"fused[{i}]", n, ctx.group)
                                                       for i, n in enumerate(ctx.fused)]
        pieces = g.split([count * g.shape[0] // sum(c for _, c in heads) for _, count in heads])
        mine = [(piece, n, first) for piece, n, (first, _) in zip(pieces, ctx.fused, heads)]     # per piece
        whole = [torch.stack([p if h == first else torch.zeros_like(p) for h in range(n)]) for p, n, first in mine
                 if n < size]                                                   # [n, unit rows, in (+1)]
        summed = iter(_reduce(torch.cat([w.flatten() for w in whole]), ctx.group).split([w.numel() for w in whole]))
        g = torch.cat([next(summed).view(n, *p.shape)[first] if n < size else p for p, n, first in mine])
        return None, None, g[:, :grad_w.shape[1]].contiguous(), None if grad_b is None else g[:, -1].contiguous()


class _ParallelLinear(nn.Module):
    """What both layers share: this rank's shard of an nn.Linear weight [out, in], split along weight_dim."""
    weight_dim, fused = 0, None

    def __init__(self, in_features, out_features, bias, group, device, dtype, sequence_parallel, sequence_dim):
        super().__init__()
        if type(sequence_dim) is not int or sequence_dim not in (0, 1):    # torch's SequenceParallel(sequence_dim=1)
            raise ValueError(f"sequence_dim={sequence_dim!r} is not 0 (Megatron's [s, b, h]) or 1 ([b, s, h])")
        self.group, self.sequence_parallel, self.sequence_dim = group, sequence_parallel, sequence_dim
        shape = [out_features, in_features]
        shape[self.weight_dim] = _divide(("out", "in")[self.weight_dim] + "_features", shape[self.weight_dim], group)
        bound = in_features ** -0.5     # nn.Linear's (ranks seeded alike draw equal shards: use from_dense); biases 0
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(shape[0], device=device, dtype=dtype)) if bias else None

    def shard(self, weight, bias=None):
        """This rank's part of a dense layer's (weight, bias), or of their gradients (the row bias: whole)."""
        split = ((lambda t: fused_shard(t, self.fused, self.group)) if self.fused else
                 (lambda t: _split_along_dim(t, self.weight_dim, self.group)))
        return split(weight), (bias if bias is None or self.weight_dim else split(bias))

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, fused=None, **options):
        """The layer holding this rank's shard of `linear`, on its device and dtype; fused: see fused_shard."""
        if fused is not None and (cls.weight_dim or options.get("gather_output")):
            raise ValueError("fused= splits a ColumnParallelLinear's rows by pieces, without gather_output")
        out = linear.out_features if fused is None else (    # p x this rank's rows, replicated heads included
            dist.get_world_size(group) * len(fused_shard(linear.weight[:, :1], fused, group)))
        layer = cls(linear.in_features, out, bias=linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **options)
        layer.fused = fused
        with torch.no_grad():
            for param, shard in zip(layer.parameters(), layer.shard(linear.weight, linear.bias)):  # weight, bias
                param.copy_(shard)
        return layer


class ColumnParallelLinear(_ParallelLinear):
    """Y = X A + b with A = [A_0 | A_1 | ..] split by columns (output features): rank r makes Y_r = X A_r + b_r.

        X [.., in] (every rank) --f--> Y_r [.., out/p] --(gather_output: all-gather)--> Y [.., out]
        sequence_parallel:  X_r [s/p, b, in] --all-gather along s--> X [s, b, in] --> Y_r [s, b, out/p]
    nn.Linear stores A^T as weight [out, in]: rank r keeps rows r of it, and b_r (fused: fused_shard's rows). SP runs
    LinearWithSequenceParallel along sequence_dim (X_r kept, gathered again in backward); every X_r must have one
    shape, checked each call (check_slices). gradient_accumulation_fusion=False declines dW in a wrapper's main_grad.
    """
    def __init__(self, in_features, out_features, bias=True, gather_output=False, group=None, device=None, dtype=None,
                 sequence_parallel=False, gradient_accumulation_fusion=True, check_slices=True, sequence_dim=0):
        super().__init__(in_features, out_features, bias, group, device, dtype, sequence_parallel, sequence_dim)
        self.gather_output, self.gradient_accumulation_fusion = gather_output, gradient_accumulation_fusion
        self.check_slices = check_slices

    def _check_equal_slices(self, x):
        """Unequal slices abort gloo's all-gather, hang NCCL's: all-gather 8 int64 (dim, numel, 6 sizes), compare."""
        if not self.check_slices or dist.get_world_size(self.group) == 1 or self.sequence_dim >= x.dim() - 1:
            return                                  # (a bad sequence_dim: LinearWithSequenceParallel refuses it)
        header = torch.tensor([x.dim(), x.numel(), *x.shape[:6], *[0] * (6 - min(x.dim(), 6))], device=x.device)
        every = _gather_along_dim(header.unsqueeze(0), 0, self.group)             # [p, 8]
        if not bool((every == header).all()):
            shapes = [row[2:2 + min(row[0], 6)] for row in every.tolist()]
            raise ValueError(f"sequence-parallel slices differ across the group: shapes {shapes}; every "
                             f"rank must hand in its slice of s of one shape (scatter_to_sequence_parallel_region)")

    def forward(self, x):                       # x: [.., in] the same on every rank, or with SP [s/p, b, in]
        weight, bias = self.weight, self.bias
        if self.fused and min(self.fused) < dist.get_world_size(self.group):          # replicated heads
            weight, bias = _SumReplicatedGrads.apply(self.fused, self.group, weight, bias)
        if self.sequence_parallel:
            self._check_equal_slices(x)
            y = LinearWithSequenceParallel.apply(x, weight, bias, self.group, self.gradient_accumulation_fusion,
                                                 self.sequence_dim)
        else:
            y = F.linear(copy_to_tensor_model_parallel_region(x, self.group), weight, bias)
        return gather_from_tensor_model_parallel_region(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """Y = X A + b with A = [A_0; A_1; ..] split by rows (input features): rank r makes a partial sum X_r A_r.

        X_r [.., in/p] --> X_r A_r [.., out] --g--> sum_r X_r A_r + b = Y [.., out] (every rank)
        sequence_parallel:  X_r A_r [s, b, out] --reduce-scatter along s--> Y_r [s/p, b, out], + b  (or [b, s, ..])
    nn.Linear stores A^T as weight [out, in]: rank r keeps columns r of it. The bias is whole on every rank, added
    once, after the reduction; under SP to this rank's part of s: marked `sequence_parallel`, its partial grad is
    summed by allreduce_sequence_parallel_grads."""
    weight_dim = 1

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, group=None,
                 device=None, dtype=None, sequence_parallel=False, sequence_dim=0):
        super().__init__(in_features, out_features, bias, group, device, dtype, sequence_parallel, sequence_dim)
        self.input_is_parallel = input_is_parallel
        if self.bias is not None:
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x):
        if not self.input_is_parallel:                          # x: [.., in] -> this rank's [.., in/p]
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        if self.sequence_parallel:                  # X_r A_r in [s, .., out] memory: reduce-scattered without a copy
            dim = self.sequence_dim
            if dim >= x.dim() - 1:                  # (as LinearWithSequenceParallel refuses it)
                raise ValueError(f"sequence_dim={dim!r} is not a dim of x {tuple(x.shape)} before its features")
            y = reduce_scatter_to_sequence_parallel_region(F.linear(x.movedim(dim, 0), self.weight), self.group)
            y = y.movedim(0, dim)
        else:
            y = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), self.group)
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


class _GatedActivation(nn.Sequential):
    """_GatedActivation(act): act(gate) * up on this rank's [gate_r | up_r] features (SwiGLU: act = nn.SiLU())."""
    def forward(self, h):
        gate, up = h.chunk(2, -1)
        return self[0](gate) * up


def parallel_mlp(mlp, group=None, sequence_parallel=False, gated=False, sequence_dim=0) -> nn.Sequential:
    """The parallel MLP holding this rank's shards of mlp = (fc1, act, fc2), an nn.Sequential or nanoGPT's
    (c_fc, gelu, c_proj): fc1 column-parallel, act on this rank's features, fc2 row-parallel. gated (SwiGLU):
    fc1's rows are [gate; up] (fused_shard gives rank r gate_r and the up_r it multiplies), y = fc2(act(gate) * up).
        x [s, b, h] --fc1--> [s, b, ffn/p] --act--> [s, b, ffn/p] --fc2--> [s, b, h]   (SP: x, y [s/p, b, h])"""
    fc1, act, fc2 = mlp
    options = dict(group=group, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
    down = RowParallelLinear.from_dense(fc2, **options)
    up = ColumnParallelLinear.from_dense(fc1, fused=(fc2.in_features,) * 2 if gated else None, **options)
    return nn.Sequential(up, _GatedActivation(act) if gated else act, down)


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with the heads split: rank r holds query heads [r H/p, (r+1) H/p) and the K/V heads
    they read (GQA: H_kv heads, each read by H/H_kv query heads; where p > H_kv, one, replicated).
        x --f--> [q_r; k_r; v_r] (qkv, column) --> SDPA on own heads --> [s, b, H/p d] --> proj (row) --g--> y
        sequence_parallel: x and y are this rank's part of s; qkv all-gathers the sequence, proj reduce-scatters it
    Layout: its layers' sequence_dim, 0: [s, b, h] in and out (Megatron's; SP [s/p, b, h]); 1: [b, s, h] (nanoGPT's;
    SP [b, s/p, h]), no transpose. Equal to SDPA(q, k, v, is_causal=True, enable_gqa=True) of the dense projections."""
    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, n_head, n_kv_head=None):
        super().__init__()
        if n_head % (n_kv_head or n_head):
            raise ValueError(f"n_head={n_head} is not divisible by n_kv_head={n_kv_head}")
        if proj.sequence_dim != qkv.sequence_dim:
            raise ValueError(f"qkv's sequence_dim={qkv.sequence_dim!r} and proj's={proj.sequence_dim!r} differ")
        heads, kv = _divide("n_head", n_head, qkv.group), _heads_of("n_kv_head", n_kv_head or n_head, qkv.group)[1]
        self.qkv, self.proj, d = qkv, proj, qkv.weight.shape[0] // (heads + 2 * kv)
        self.head_dim, self.split = d, [heads * d, kv * d, kv * d]

    @classmethod
    def from_dense(cls, attn, group=None, sequence_parallel=False, sequence_dim=1):
        """attn: nanoGPT-style, c_attn (rows [q; k; v]), c_proj, n_head, n_kv_head (GQA; default n_head), dropout 0."""
        if getattr(attn, "dropout", 0):
            raise ValueError(f"from_dense takes attention without dropout (dropout={attn.dropout})")
        n_head, n_kv_head = attn.n_head, getattr(attn, "n_kv_head", attn.n_head)
        options = dict(group=group, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
        qkv = ColumnParallelLinear.from_dense(attn.c_attn, fused=(n_head, n_kv_head, n_kv_head), **options)
        return cls(qkv, RowParallelLinear.from_dense(attn.c_proj, **options), n_head, n_kv_head)

    def forward(self, x):                                   # [s, b, h] (sequence_dim 1: [b, s, h]); SP: s/p of s
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).permute(1, 2, 0, 3)                 # [b, heads, s, d] each
                   for t in self.qkv(x).movedim(self.qkv.sequence_dim, 0).split(self.split, -1))   # [s, b, own ..]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # [b, H/p, s, d]
        return self.proj(o.permute(2, 0, 1, 3).flatten(2).movedim(0, self.qkv.sequence_dim))   # [s, b, h] memory


def tp_dp_groups(tp: int, timeout=None):
    """This rank's (tp_group, dp_group): rank = dp_rank * tp + tp_rank (init_device_mesh's (dp, tp)); timeout: theirs"""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"world size {world} is not divisible by the tensor-parallel size {tp}")
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp)), timeout=timeout) for d in range(world // tp)]
    dp_groups = [dist.new_group(list(range(t, world, tp)), timeout=timeout) for t in range(tp)]
    return tp_groups[rank // tp], dp_groups[rank % tp]


# ---- demo: each claim against one process (needs common.py; the blocks above need only torch) ------------------
HIDDEN, HEADS, KV_HEADS, FFN, BATCH, SEQ = 32, 8, 2, 64, 2, 8  # 1, 2, 4, 8 ranks divide them (4, 8: K/V replicated)


def dense_attention(c_attn, c_proj, x):
    """The reference, nanoGPT's attention on [b, s, h] with GQA: K/V heads read by groups of query heads."""
    kv = (c_attn.out_features - HIDDEN) // 2
    q, k, v = (t.unflatten(-1, (-1, HIDDEN // HEADS)).transpose(1, 2) for t in c_attn(x).split([HIDDEN, kv, kv], -1))
    return c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).flatten(2))


def against_dense(dense_fn, block, x, dy, pairs, seq=None):
    """block on this rank's x (seq: SP's dim) == dense_fn, forward and backward, each pair's (layer, dense) grads too"""
    from common import traffic
    part = lambda t, dim: t if dim is None else t.chunk(dist.get_world_size(), dim)[dist.get_rank()]   # the demo's own
    x_p, x_d = part(x, seq).clone().requires_grad_(), x.clone().requires_grad_()
    with traffic() as t:
        y = block(x_p)
        y.backward(part(dy, seq))
    allreduce_sequence_parallel_grads(block.parameters())       # the row bias under SP: partial sums
    y_d = dense_fn(x_d)
    y_d.backward(dy)
    torch.testing.assert_close([y, x_p.grad], [part(y_d, seq), part(x_d.grad, seq)])
    grads = lambda m: (m.weight.grad, None if m.bias is None else m.bias.grad)
    torch.testing.assert_close([grads(layer) for layer, _ in pairs], [layer.shard(*grads(d)) for layer, d in pairs])
    return t


def main():
    from types import SimpleNamespace
    from common import finish, head, launched_world_size, log, refuse, ring_bytes, setup
    W = launched_world_size()
    if HEADS % W:
        refuse(f"{W} ranks: {HEADS} heads, hidden {HIDDEN}, ffn {FFN}, sequence {SEQ} split over 1, 2, 4 or 8 only")
    rank, world, device = setup()
    ints = lambda s: torch.randint(-9, 10, (SEQ, BATCH, HIDDEN), generator=torch.Generator().manual_seed(s))
    x, dy = (ints(s).to(device, torch.float64) for s in (1, 2))          # [s, b, h], integers: exact sums
    xb, dyb = x.transpose(0, 1).contiguous(), dy.transpose(0, 1).contiguous()   # nanoGPT's [b, s, h]
    V, lin = x.numel() * x.element_size(), lambda i, o, bias=True: nn.Linear(i, o, bias, device, torch.float64)
    wire = lambda t: sum(ring_bytes(n, world * b if n == "all_gather" else b, world) for n, _, b in t.calls)

    head(f"nanoGPT's MLP on p = {world} ranks, fc1 column-parallel, fc2 row-parallel (SwiGLU's: tests/check_05.py)")
    fc1, fc2 = lin(HIDDEN, FFN), lin(FFN, HIDDEN)                          # nanoGPT's c_fc, c_proj
    mlp = parallel_mlp((fc1, nn.GELU(), fc2))
    t = against_dense(lambda x: fc2(F.gelu(fc1(x))), mlp, x, dy, [(mlp[0], fc1), (mlp[2], fc2)])
    assert [c[0] for c in t.calls] == ["all_reduce"] * 2 * (world > 1) and wire(t) == 4 * (world - 1) / world * V
    log(f"== dense, forward and backward (every grad shard); one all-reduce each way: {wire(t):g} B sent = "
        f"2 x 2({world}-1)/{world} x {V} B")

    head(f"GQA attention from a nanoGPT-style module (fused c_attn, batch-first): {HEADS} query, {KV_HEADS} K/V heads")
    c_attn, c_proj = lin(HIDDEN, HIDDEN + 2 * KV_HEADS * HIDDEN // HEADS), lin(HIDDEN, HIDDEN)
    user = SimpleNamespace(c_attn=c_attn, c_proj=c_proj, n_head=HEADS, n_kv_head=KV_HEADS)    # a user's module
    attn = ParallelSelfAttention.from_dense(user)                         # batch-first, as nanoGPT's
    against_dense(lambda x: dense_attention(c_attn, c_proj, x), attn, xb, dyb,
                  [(attn.qkv, c_attn), (attn.proj, c_proj)])
    log(f"== SDPA(enable_gqa=True) on the dense projections, forward and backward; a rank holds {HEADS // world} "
        f"query heads, {max(KV_HEADS // world, 1)} K/V head(s), each on {max(world // KV_HEADS, 1)} rank(s)")

    head("sequence parallelism: the activations between blocks split along s, of [s, b, h] or of [b, s, h]")
    for seq, xs, dys in ((0, x, dy), (1, xb, dyb)):                      # sequence_dim=1: nanoGPT's [b, s, h]
        fc1, fc2 = lin(HIDDEN, FFN), lin(FFN, HIDDEN)
        mlp = parallel_mlp((fc1, nn.GELU(), fc2), sequence_parallel=True, sequence_dim=seq)
        t = against_dense(lambda x: fc2(F.gelu(fc1(x))), mlp, xs, dys, [(mlp[0], fc1), (mlp[2], fc2)], seq=seq)
        assert wire(t) == 5 * (world - 1) / world * V + 64 * (world - 1), t.calls     # + the 64-B slice check
    log(f"the MLP on [s/p, b, h] and on [b, s/p, h] == dense; each sends {wire(t):g} B = (2 + 3)({world}-1)/{world} "
        f"x {V} B + {64 * (world - 1)} B (the slice check)")
    finish(f"MLP and GQA attention over p = {world}, TP and SP ([s, b, h], [b, s, h]) == dense, forward and backward")


if __name__ == "__main__":
    main()
