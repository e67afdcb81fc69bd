"""06 - sequence parallelism: Megatron's (split what TP leaves whole), Ulysses (all-to-all to heads), and context
parallelism (ring attention over zig-zag shards).

Megatron SP (Korthikanti et al., 2022). TP runs LayerNorm, dropout and the residual on the whole [s, b, h] on every
rank; SP splits them along s (dim 0, Megatron's [s, b, h]) and cuts TP's all-reduce into its halves:

    TP:  x[s, b, h]     LN  f (identity)  fc1 GeLU fc2  g (all-reduce)   + x     every rank holds all of s
    SP:  x[s/tp, b, h]  LN  all-gather    fc1 GeLU fc2  reduce-scatter   + x     rank i holds s_i only
         R0 [s0]  --all-gather-->  R0 [s0 s1 s2 s3] ... R0 [s0 s1 s2 s3] partial  --reduce-scatter-->  R0 [s0]
         R1 [s1]                   R1 [s0 s1 s2 s3] ... R1 [s0 s1 s2 s3] partial                      R1 [s1]
Bytes each rank sends, V = s*b*h*bytes: 2(tp-1)/tp*V forward (TP's all-reduce) and (tp-1)/tp*V more in backward,
where fc1 (LinearWithSequenceParallel) all-gathers again the [s/tp, b, h] input it kept: LN's input and output are
kept at 1/tp. LN's weight and bias and fc2's bias see one slice of s per rank: their gradients need one all-reduce
over TP (Megatron-LM#443). fc1's dW goes into an fp32 `main_grad` while grad_x's reduce-scatter travels.

Ulysses (Jacobs et al., 2023). An all-to-all turns q, k, v [s/P, b, h, d] into [s, b, h/P, d], attention runs on
h/P heads over the whole sequence, one more all-to-all brings the output back: forward sends 4(P-1)/P^2 * V, 2/P
of Megatron SP's for the same layer, and P <= h.
    R0 [s0 | h0 h1 h2 h3]  --all_to_all_4d(x, scatter_dim=2, gather_dim=0)-->  R0 [s0 s1 s2 s3 | h0]
    R1 [s1 | h0 h1 h2 h3]  <--all_to_all_4d(x, scatter_dim=0, gather_dim=2)--  R1 [s0 s1 s2 s3 | h1]

Ring attention (context parallelism: Liu et al. 2023; Megatron CP, torch's context_parallel). q, k, v [s/P, b, h, d]
in zig-zag shards: of 2P chunks rank r holds r and 2P-1-r, an early one and a late one, so causal work is s(s+1)/2P
on every rank (contiguous shards give rank P-1 2P-1 times rank 0's). K, V go round the ring; each step is one call
of the fused attention kernel that returns the log-sum-exp l (CPU flash; FlashAttention-2), merged online:
o = lerp(o, o_B, sigmoid(l_B - l)), l = log(e^l + e^l_B). No [s/P x s/P] score exists outside the kernel's tiles.
    R0 [c0 c7]  R1 [c1 c6]  R2 [c2 c5]  R3 [c3 c4]    step t: rank r attends to the K, V of r-t and sends them to r+1
    causal: step 0 one causal mask over [r, 2P-1-r] x [r, 2P-1-r]; at step t > 0 one full block: both query chunks
            x the early K, V chunk of rank r-t (t <= r), or the late query chunk x both K, V chunks (t > r)
Backward: the kernel's own, given the final o and l; dq stays, dK and dV ride the ring home (picture in backward).
Bytes each rank sends, K and V slices of b*(s/P)*h*d*bytes each: forward (P-1)*2 slices, backward that again plus
P*2 of dK, dV (fp32 for bf16). All-gather CP (Llama 3) all-gathers K, V once instead (README: when each wins).
    BENCH=1 torchrun --nproc-per-node=2 06_sequence_parallel.py: beside all-gather CP, torch's ring, one process

Which one (README: Three ways to split a sequence): Megatron SP always with TP; Ulysses inside a node, P <= K/V
heads; ring CP for the longest sequences, across nodes, any head count; Ulysses and ring compose.

    torchrun --nproc-per-node=4 06_sequence_parallel.py
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


# ---- building blocks: private helpers (Megatron's mappings.py), each a no-op on a group of one rank ------------
# torch 2.13 renamed these two collectives (the old names warn there); older torch has only the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def _all_to_all(x, scatter_dim, gather_dim, group):
    """Chunk j of x along scatter_dim goes to rank j; what rank j sent is concatenated along gather_dim."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    send = torch.stack(x.chunk(size, dim=scatter_dim))         # send[j]: what rank j gets (a contiguous copy)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)             # recv[j]: what rank j sent
    return torch.cat(recv.unbind(0), dim=gather_dim)


def _ring_exchange(x, group):
    """Send x to the next rank of the ring and receive the previous rank's x: (received, works), the received
    tensor valid after the wait. Even ranks post the send first, odd ranks the receive, so that blocking
    sends (gloo; NCCL for large messages, and at P = 2 where next == prev) meet a posted receive."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return x, []
    x = x.contiguous()
    recv = torch.empty_like(x)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    if rank % 2 == 0:
        works = [dist.isend(x, group=group, group_dst=nxt), dist.irecv(recv, group=group, group_src=prev)]
    else:
        works = [dist.irecv(recv, group=group, group_src=prev), dist.isend(x, group=group, group_dst=nxt)]
    return recv, works


# ---- building blocks: regions, one autograd.Function per operator (group=None: the world) ----------------------
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


class _SeqAllToAll(torch.autograd.Function):
    """forward: all-to-all, scatter_dim split and gather_dim joined (DeepSpeed-Ulysses' _SeqAllToAll); backward: the
    same with the dims swapped."""
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


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


# ---- building blocks: Megatron SP's linear layer and MLP block ------------------------------------------------
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


def mlp_block(x, p, sequence_parallel: bool, group=None):
    """x + fc2(GeLU(fc1(LayerNorm(x)))) on this rank's TP shard: p['w1'], p['b1'] hold fc1's rows, p['w2'] fc2's
    columns, the rest whole. With SP, x and the output are [s/tp, b, h]; without, [s, b, h] on every rank."""
    h = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    if sequence_parallel:
        h = LinearWithSequenceParallel.apply(h, p["w1"], p["b1"], group)                  # [s, b, f/tp]
    else:
        h = F.linear(copy_to_tensor_model_parallel_region(h, group), p["w1"], p["b1"])    # [s, b, f/tp]
    h = F.linear(F.gelu(h), p["w2"])                                        # [s, b, h], partial over ranks
    if sequence_parallel:
        return x + reduce_scatter_to_sequence_parallel_region(h, group) + p["b2"]         # [s/tp, b, h]
    return x + reduce_from_tensor_model_parallel_region(h, group) + p["b2"]               # [s, b, h]


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


# ---- building blocks: Ulysses ---------------------------------------------------------------------------------
def all_to_all_4d(x, scatter_dim: int, gather_dim: int, group=None):
    """forward: all-to-all that splits scatter_dim and concatenates gather_dim; backward: the swapped all-to-all.
    [s/P, b, h, d] -> [s, b, h/P, d] with (scatter_dim=2, gather_dim=0); (0, 2) goes back."""
    if x.dim() != 4 or scatter_dim == gather_dim or not {scatter_dim, gather_dim} <= {0, 1, 2, 3}:
        raise ValueError(f"all_to_all_4d takes an [s, b, h, d] tensor and two different dims in 0..3, got shape "
                         f"{tuple(x.shape)}, scatter_dim={scatter_dim}, gather_dim={gather_dim}")
    _divide(("sequence", "batch", "heads", "head_dim")[scatter_dim], x.size(scatter_dim), group)
    return _SeqAllToAll.apply(x, scatter_dim, gather_dim, group)


def ulysses_attention(q, k, v, is_causal: bool = False, group=None):
    """Attention over the whole sequence from [s/P, b, h, d] slices of q, k, v (DeepSpeed-Ulysses' layout, s split
    on dim 0 as in Megatron); returns the output's slice."""
    q, k, v = (all_to_all_4d(t, 2, 0, group).permute(1, 2, 0, 3) for t in (q, k, v))    # [b, h/P, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)                     # [b, h/P, s, d]
    return all_to_all_4d(out.permute(2, 0, 1, 3), 0, 2, group)                             # [s/P, b, h, d]


# ---- building blocks: context parallelism (zig-zag shards, ring attention) ------------------------------------
def _zigzag_check(length: int, what: str, group) -> int:
    size = dist.get_world_size(group)
    if length % (2 * size):
        raise ValueError(f"{what}={length} is not divisible by 2 x {size} ranks: zig-zag cuts it into {2 * size} "
                         "chunks")
    return size


def zigzag_shard(x, dim, group=None):
    """This rank's zig-zag slice of the whole sequence x along dim: chunks r and 2P-1-r of 2P (no comm)."""
    size = _zigzag_check(x.shape[dim], "sequence length", group)
    if size == 1:
        return x
    chunks, r = x.chunk(2 * size, dim), dist.get_rank(group)
    return torch.cat([chunks[r], chunks[2 * size - 1 - r]], dim)


def zigzag_unshard(x, dim, group=None):
    """The whole sequence from every rank's zig-zag slice along dim: an all-gather, then the chunks in order
    (backward: the reduce-scatter of gather_from_sequence_parallel_region)."""
    size = _zigzag_check(dist.get_world_size(group) * x.shape[dim], "sequence length", group)
    if size == 1:
        return x
    held = gather_from_sequence_parallel_region(x, group, dim=dim).chunk(2 * size, dim)  # rank r: 2r, 2r+1
    return torch.cat([held[2 * c if c < size else 2 * (2 * size - 1 - c) + 1] for c in range(2 * size)], dim)


def _step_block(rank, src, size, n, is_causal):
    """The one block of a ring step, rank's queries against src's keys: (query rows, key rows, causal). Each
    holds n rows, chunks (r, 2P-1-r) of n/2. Causal: at step 0 one mask over both chunks (in order) masks the
    diagonal blocks, keeps (2P-1-r, r) full and skips (r, 2P-1-r); later, src's chunks are either one in both
    my chunks' past and one in their future (src < rank) or both in my late chunk's past and my early one's future."""
    c = n // 2
    if not is_causal or src == rank:
        return slice(0, n), slice(0, n), is_causal
    return (slice(0, n), slice(0, c), False) if src < rank else (slice(c, n), slice(0, n), False)


def _explicit_block(q, k, v, causal, scale):
    """One block by definition, [b, h, n, d] q against [b, h, m, d] k, v: (softmax(q k^T * scale) v, each row's
    log-sum-exp), fp32 (or wider) inside; causal blocks are square, key j masked for query i < j. It holds the
    whole [b, h, n, m] score matrix: the readable reference the fused kernel is checked against."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    s = q.to(dtype) @ k.to(dtype).transpose(-2, -1) * scale                       # [b, h, n, m]
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = s.logsumexp(-1)                                                         # [b, h, n]
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.to(dtype)).to(q.dtype), lse, ()


def _explicit_block_backward(dout, q, k, v, out, lse, causal, scale, rest=()):
    """One block's (dq, dk, dv), given the FINAL output and log-sum-exp of q's rows over every block: then p is
    this block's share of the whole softmax, and FlashAttention-2's delta = rowsum(dout * out) is the sum over
    ALL keys of p_j dp_j that softmax's backward subtracts: ds = p * (dout v^T - delta)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))                                          # [b, h, n, m]
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out.to(dtype)).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


# The fused kernels: each returns the block's log-sum-exp beside its output (what merging needs), and its
# backward, given the final output and log-sum-exp, recomputes the probabilities tile by tile: no score matrix
# exists outside the kernel's tiles. CPU: the flash kernel F.scaled_dot_product_attention itself dispatches to
# (any float dtype, float64 too). CUDA: FlashAttention-2 for fp16/bf16, the dtypes training runs in, returning
# an unpadded [b, h, n] fp32 log-sum-exp (memory-efficient attention also takes fp32 but pads its log-sum-exp
# to 32 rows); fp32 and fp64 on CUDA use the explicit block.
def _rows_unit_stride(*ts):
    """The kernels read each row of d values as contiguous (F.scaled_dot_product_attention makes it so)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def _fused_block(q, k, v, causal, scale):
    q, k, v = _rows_unit_stride(q, k, v)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    out, lse, cum_q, cum_k, _, _, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, rng, unused)          # what its backward takes back (no dropout: unused)


def _fused_block_backward(dout, q, k, v, out, lse, causal, scale, rest=()):
    dout, q, k, v, out = _rows_unit_stride(dout, q, k, v, out)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)
    cum_q, cum_k, rng, unused = rest
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, rng, unused,
        scale=scale)


_FALLBACKS_SAID = set()


def _block_kernels(q, fused=True):
    """(forward, backward) of one block for q: the fused kernel where it takes q, else the explicit block (saying
    why, once)."""
    if not fused:
        return _explicit_block, _explicit_block_backward
    d, why = q.shape[-1], None
    if q.device.type == "cpu":
        if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
            why = f"torch {torch.__version__} has no CPU flash attention kernel"
    elif q.device.type == "cuda":
        if q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 256 or \
                not torch.backends.cuda.is_flash_attention_available():
            why = f"FlashAttention takes fp16/bf16 and head dims of 8, 16, .. 256, not {q.dtype} and {d}"
    else:
        why = f"no fused attention kernel here for {q.device.type}"
    if why is None:
        return _fused_block, _fused_block_backward
    if why not in _FALLBACKS_SAID:
        import warnings
        _FALLBACKS_SAID.add(why)
        warnings.warn(f"ring_attention: {why}; each block uses explicit matmuls (the whole score block)", stacklevel=4)
    return _explicit_block, _explicit_block_backward


def _merge(out, lse, block_out, block_lse):
    """Online softmax, in place: (out, lse) over keys A merged with a block over keys B, into attention over both.
    o = (e^l o + e^lB oB) / (e^l + e^lB) = lerp(o, oB, sigmoid(lB - l)),  l = log(e^l + e^lB)."""
    out.lerp_(block_out.to(out.dtype), torch.sigmoid(block_lse - lse).unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, block_lse))


class _RingAttention(torch.autograd.Function):
    """forward: attention of this rank's queries to every rank's K, V, passed round the ring, one fused block a
    step; backward: dq here, dk and dv round the ring back to their owners. Inside: [b, h, s/P, d]."""
    @staticmethod
    def forward(ctx, q, k, v, is_causal, group, fused):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        block, _ = _block_kernels(q, fused)
        scale, acc = q.shape[-1] ** -0.5, torch.promote_types(q.dtype, torch.float32)
        qt = q.permute(1, 2, 0, 3)                                           # [b, h, n, d], n = s/P
        kv = torch.stack([k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)])    # [2, b, h, n, d]: what travels
        for step in range(size):
            if step < size - 1:
                kv_next, works = _ring_exchange(kv, group)                   # the next K, V, while we compute
            rows, cols, causal = _step_block(rank, (rank - step) % size, size, qt.shape[2], is_causal)
            block_out, block_lse, rest = block(qt[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale)
            if step == 0:                                                    # every row: the first block sets them
                out, lse, ctx.rest = block_out.to(acc), block_lse, rest
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            del block_out, block_lse
            if step < size - 1:
                _wait(works)
                kv, kv_next, works = kv_next, None, None                     # the K, V sent: freed
        out = out.to(q.dtype)                                                # [b, h, n, d]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.group, ctx.fused = is_causal, group, fused
        return out.permute(2, 0, 1, 3)                                       # [s/P, b, h, d]

    @staticmethod
    def backward(ctx, dout):
        #  who holds which dK, dV (P = 3): rank r adds its queries' share to the K, V block it holds, then passes
        #  the sum on with them; after P steps and one hop more each sum is home, with every rank's share in it
        #      step 0          step 1          step 2          after the last hop
        #  R0  dKV0 += R0's    dKV2 += R0's    dKV1 += R0's    dKV0 (R0, R1, R2) home
        #  R1  dKV1 += R1's    dKV0 += R1's    dKV2 += R1's    dKV1 (R1, R2, R0) home
        #  R2  dKV2 += R2's    dKV1 += R2's    dKV0 += R2's    dKV2 (R2, R0, R1) home
        q, k, v, out, lse = ctx.saved_tensors
        group, size, rank = ctx.group, dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        _, block_backward = _block_kernels(q, ctx.fused)
        scale, acc = q.shape[-1] ** -0.5, torch.promote_types(q.dtype, torch.float32)
        qt, dout = q.permute(1, 2, 0, 3), dout.permute(1, 2, 0, 3).to(q.dtype)   # [b, h, n, d]
        dq = torch.zeros(qt.shape, dtype=acc, device=q.device)
        kv = torch.stack([k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)])
        dkv_works = []
        for step in range(size):
            if step < size - 1:
                kv_next, kv_works = _ring_exchange(kv, group)
            rows, cols, causal = _step_block(rank, (rank - step) % size, size, qt.shape[2], ctx.is_causal)
            dq_b, dk_b, dv_b = block_backward(dout[:, :, rows], qt[:, :, rows], kv[0][:, :, cols],
                                              kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows], causal, scale,
                                              ctx.rest)
            dq[:, :, rows].add_(dq_b)
            _wait(dkv_works)                                 # the sums of the ranks this K, V visited before
            dkv_works = []                                   # (the dK, dV this rank sent: freed)
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device) if step == 0 else dkv_recv
            dkv[0][:, :, cols].add_(dk_b)
            dkv[1][:, :, cols].add_(dv_b)
            del dq_b, dk_b, dv_b
            dkv_recv, dkv_works = _ring_exchange(dkv, group)    # on to the next rank; after the last step, home
            if step < size - 1:
                _wait(kv_works)
                kv, kv_next, kv_works = kv_next, None, None
        _wait(dkv_works)
        dk, dv = (t.permute(2, 0, 1, 3).to(k.dtype) for t in dkv_recv)        # this rank's own dk, dv
        return dq.permute(2, 0, 1, 3).to(q.dtype), dk, dv, None, None, None


def ring_attention(q, k, v, is_causal: bool = False, group=None, *, fused: bool = True):
    """Attention over the whole sequence from this rank's zig-zag slices [s/P, b, h, d] of q, k, v (Megatron's
    sequence-first layout, as ulysses_attention; zigzag_shard(x, 0) makes them); returns the output's zig-zag
    slice. Any head count.
    Each ring step is one call of the fused attention kernel (fused=False: the explicit block); merging and the
    dk, dv that travel are fp32 for bf16 and fp16 inputs; K and V travel in their own dtype."""
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"ring_attention takes q, k, v of one shape [s/P, b, h, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    _zigzag_check(dist.get_world_size(group) * q.shape[0], "sequence length", group)
    return _RingAttention.apply(q, k, v, is_causal, group, fused)


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
import os

try:
    from common import (finish, head, kept_for_backward, launched_world_size, log, memory, refuse, refused,
                        replays, ring_bytes, setup, strided_groups, sync, time_overlap, traffic)
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

S, B, NH, D = 48, 2, 24, 2     # [s, b]; Ulysses' 24 heads of 2: s/(2P) and heads divide for P in 1, 2, 3, 4, 6, 8
H, FFN = NH * D, 48            # the MLP block's width (the attention layer's, so their bytes compare) and fc1's
RING_HEADS, RING_D = 5, 8      # ring attention: 5 heads, which no P > 1 here divides (Ulysses refuses them)
def sent(t, ranks=None):
    """Bytes this rank put on the wire for what traffic() `t` recorded: a send its bytes, a collective
    common.ring_bytes of them (an all-gather's V is its output, n x what it hands in); every call must be on the
    group of global `ranks` when given."""
    assert ranks is None or all(r == tuple(ranks) for _, r, _ in t.calls), (t.calls, ranks)
    wire = lambda name, n, b: b if name == "send" else 0 if name == "recv" else ring_bytes(
        name, n * b if name == "all_gather" else b, n)
    return round(sum(wire(name, len(r), b) for name, r, b in t.calls))


class Posted:
    """The works one call posted, waited for together: what time_overlap's start_comm returns."""
    def __init__(self, works):
        self.works = works

    def wait(self):
        _wait(self.works)


def members(group):
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def ints(shape, seed, device):
    """Integer-valued float64 from a seed, so any rank can rebuild any rank's tensor and sums are exact."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).double().to(device)


def vjp(out, inputs, dout):
    """The gradients of <out, dout> with respect to inputs: dout pulled back through out."""
    return torch.autograd.grad((out * dout).sum(), inputs)


def strided(t):
    """The same values in a non-contiguous layout (a transposed copy, transposed back)."""
    out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not out.is_contiguous() or min(t.shape[-2:]) < 2
    return out


def adjoint_checked(op, x, group=None, replicated=False):
    """op(x), after asserting sum over ranks <op(x), y> == sum over ranks <x, op's backward(y)> exactly, for a
    y different on every rank. A replicated x is one tensor held by every rank: its side counts once."""
    x = x.detach().requires_grad_()
    out = op(x)
    y = ints(out.shape, 1000 + dist.get_rank(), x.device)
    (g,) = vjp(out, x, y)
    once = dist.get_rank(group) == 0 or not replicated
    sides = torch.stack([(out * y).sum(), (x * g).sum() * once]).detach()
    dist.all_reduce(sides, group=group)
    assert sides[0] == sides[1], f"adjoint test: {sides.tolist()}"
    return out.detach()


def regions(groups, device):
    for group in groups:
        ranks, P, r = members(group), dist.get_world_size(group), dist.get_rank(group)
        for dim in (0, 1):                                                   # [s, b, h] and batch-first [b, s, h]
            shape = [3, 3, 3]
            shape[dim] = 2                                                   # each rank's slice: 2 rows along dim
            every = torch.cat([ints(shape, g, device) for g in ranks], dim)  # every member's slice, in group order
            x = strided(ints(shape, dist.get_rank(), device))
            kw = {} if dim == 0 else {"dim": dim}                            # dim 0: the public default
            gathered = adjoint_checked(lambda t: gather_from_sequence_parallel_region(t, group, **kw), x, group)
            assert torch.equal(gathered, every)
            partial, total = strided((r + 1) * every), P * (P + 1) // 2 * every   # rank r's partial sums; sum
            out = adjoint_checked(lambda t: reduce_scatter_to_sequence_parallel_region(t, group, **kw), partial,
                                  group)
            assert torch.equal(out, total.chunk(P, dim)[r])
            out = adjoint_checked(lambda t: scatter_to_sequence_parallel_region(t, group, **kw), strided(every),
                                  group, replicated=True)
            assert torch.equal(out, every.chunk(P, dim)[r]) and out.is_contiguous()
        mine = ints((3, 4), 50 + dist.get_rank(), device)                    # f and g on a caller's tensor
        keep, x = mine.clone(), ints((3, 4), 60, device).requires_grad_()
        summed = reduce_from_tensor_model_parallel_region(mine, group)
        same = copy_to_tensor_model_parallel_region(x, group)
        assert same.data_ptr() == x.data_ptr()                               # f's forward: x itself, no copy
        (g,) = torch.autograd.grad(same, x, mine)
        want = sum(ints((3, 4), 50 + s, device) for s in ranks)
        assert torch.equal(summed, want) and torch.equal(g, want) and torch.equal(mine, keep)   # mine left alone
        assert P > 1 or summed.data_ptr() == mine.data_ptr()                 # one rank: a no-op, no copy
    log("gather = all-gather, reduce_scatter = sum then slice, scatter = slice: exact, on strided inputs")
    W = dist.get_world_size()
    for op in (reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region):
        try:                                                                 # W + 1 rows do not split over W
            op(torch.zeros(W + 1, 1, device=device))
            assert W == 1, f"{op.__name__}: {W + 1} rows accepted"
        except ValueError as err:
            said = str(err)
            assert said == f"x.shape[0]={W + 1} is not divisible by the group size {W}", said
    log("g's forward, f's backward: the group's sum, the caller's tensor left alone" + (
        f"; {W + 1} rows to reduce-scatter or scatter: ValueError('{said}')" if W > 1 else ""))
    log("adjoint: sum over ranks <op(x), y> == <x, op_backward(y)> for all three (scatter's replicated x once)")
    log(f"along dim 0 ([s, b, h]) and dim 1 ([b, s, h]), on the world and on sub-groups {members(groups[-1])}, ..")


def mlp_runs(dense, x, dy, group):
    """TP and SP runs of mlp_block on this rank's shard over `group`, with the traffic and the bytes kept."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    rows = slice(r * FFN // P, (r + 1) * FFN // P)
    shard = lambda k, t: t[:, rows] if k == "w2" else t[rows] if k in ("w1", "b1") else t   # this rank's part
    runs = {"shard": shard}
    for sp in (False, True):
        p = {k: shard(k, v.detach()).clone().requires_grad_() for k, v in dense.items()}
        for k in ("ln_w", "ln_b", "b2"):
            p[k].sequence_parallel = True
        xin = (x.chunk(P)[r] if sp else x).clone().requires_grad_()
        with traffic() as fwd:
            y, kept = kept_for_backward(lambda: mlp_block(xin, p, sp, group), p.values(), [xin])
        with traffic() as bwd:
            (y * strided(dy.chunk(P)[r] if sp else dy)).sum().backward()
        runs[sp] = dict(p=p, x=xin, y=y, fwd=fwd, bwd=bwd, kept=kept)
    return runs


def mlp_block_checks(groups, device):
    f64 = dict(dtype=torch.float64, device=device)
    dense = {k: v.to(**f64).requires_grad_() for k, v in {                 # the whole block's parameters
        "ln_w": 1 + 0.1 * torch.randn(H), "ln_b": 0.1 * torch.randn(H), "w1": torch.randn(FFN, H) / H ** .5,
        "b1": 0.1 * torch.randn(FFN), "w2": torch.randn(H, FFN) / FFN ** .5, "b2": 0.1 * torch.randn(H)}.items()}
    x, dy = torch.randn(S, B, H, **f64), torch.randn(S, B, H, **f64)      # input, upstream gradient
    x_ref = x.clone().requires_grad_()
    ref = x_ref + F.linear(F.gelu(F.linear(F.layer_norm(x_ref, (H,), dense["ln_w"], dense["ln_b"]),
                                           dense["w1"], dense["b1"])), dense["w2"], dense["b2"])
    (ref * dy).sum().backward()
    every_run = {}
    for group in groups:
        P, r = dist.get_world_size(group), dist.get_rank(group)
        runs = every_run[group] = mlp_runs(dense, x, dy, group)
        tp, sp, shard = runs[False], runs[True], runs["shard"]
        torch.testing.assert_close(tp["y"], ref)
        torch.testing.assert_close(sp["y"], tp["y"].chunk(P)[r])
        torch.testing.assert_close(tp["x"].grad, x_ref.grad)
        torch.testing.assert_close(sp["x"].grad, tp["x"].grad.chunk(P)[r])
        for k in ("w1", "b1", "w2"):
            torch.testing.assert_close(tp["p"][k].grad, shard(k, dense[k].grad))
            torch.testing.assert_close(sp["p"][k].main_grad if k == "w1" else sp["p"][k].grad, tp["p"][k].grad)
        off = max((sp["p"][k].grad - dense[k].grad).abs().max().item() for k in ("ln_w", "ln_b", "b2"))
        assert P == 1 or off > 1e-3
        b2 = sp["p"]["b2"]
        b2.main_grad, b2.grad = b2.grad, None               # as a data-parallel wrapper keeps it (read from there)
        with traffic() as runs["fix"]:
            allreduce_sequence_parallel_grads(sp["p"].values(), group)
        with traffic() as unmarked:                                   # none marked sequence_parallel: nothing to do
            allreduce_sequence_parallel_grads([sp["p"]["w1"], sp["p"]["w2"]], group)
        assert not unmarked.calls, unmarked.calls
        for k in ("ln_w", "ln_b", "b2"):
            torch.testing.assert_close(tp["p"][k].grad, dense[k].grad)
            torch.testing.assert_close(sp["p"][k].main_grad if k == "b2" else sp["p"][k].grad, dense[k].grad)
        if group is None:
            log(f"output, x grad, fc1 and fc2 grads: SP == TP == dense, each rank computing s/tp = {S // P} rows of LN")
            log(f"LN weight, LN bias, fc2 bias grads as each rank has them: off by up to {off:.3f} (each saw s/tp)")
            log(f"after allreduce_sequence_parallel_grads of those {3 * H} values (fc2 bias's from its main_grad): "
                "equal to dense (Megatron-LM#443)")
    log(f"the same on sub-groups {members(groups[-1])}, ..: group rank != global rank")
    return every_run


def mlp_traffic(every_run):
    V, e = S * B * H * 8, 8                                                  # activation bytes; bytes per float64
    for group, runs in every_run.items():
        P, ranks, tp, sp = dist.get_world_size(group), members(group), runs[False], runs[True]
        expect = lambda **counts: counts if P > 1 else {}   # a group of one rank issues no collective
        assert dict(runs["fix"].counts) == expect(all_reduce=1)
        assert sent(runs["fix"], ranks) == 2 * (P - 1) * 3 * H * e // P
        ring = 2 * (P - 1) * V // P                   # a ring all-reduce of V, or an all-gather plus a reduce-scatter
        assert dict(tp["fwd"].counts) == dict(tp["bwd"].counts) == expect(all_reduce=1)
        assert sent(tp["fwd"], ranks) == sent(tp["bwd"], ranks) == ring
        assert dict(sp["fwd"].counts) == expect(all_gather=1, reduce_scatter=1) and sent(sp["fwd"], ranks) == ring
        assert dict(sp["bwd"].counts) == expect(all_gather=2, reduce_scatter=1)
        assert sent(sp["bwd"], ranks) == ring + (P - 1) * V // P
        ln = (2 * S * B * H + 2 * S * B) * e          # LN's input and output (fc1's input), LN's mean and rstd
        act = 2 * S * B * (FFN // P) * e              # fc1's output (GeLU's input) and GeLU's output, [s, b, f/tp]
        assert tp["kept"] == ln + act and sp["kept"] == ln // P + act
        if group is None:
            log(f"forward:  TP 1 all-reduce, SP all-gather + reduce-scatter: each sends 2(tp-1)/tp*V = {ring} B, "
                f"V = {V} B")
            log(f"backward: TP {ring} B; SP {sent(sp['bwd'])} B = the same + (tp-1)/tp*V, fc1 gathering its input")
            log(f"LN grads' all-reduce: 2(tp-1)/tp x {3 * H * e} B = {sent(runs['fix'])} B")
            log(f"kept for backward: TP {tp['kept']} B, SP {sp['kept']} B: LN in/out/stats {ln} B -> {ln // P} B")
    log(f"counts and bytes asserted on the world and on sub-groups {members(list(every_run)[-1])}, ..")


def linear_overlap(groups, device):
    import os
    f64 = dict(dtype=torch.float64, device=device)
    x, w, b = torch.randn(S, B, H, **f64), torch.randn(FFN, H, **f64), torch.randn(FFN, **f64)
    g_out = torch.randn(S, B, FFN, **f64)
    for group in groups:
        P, r = dist.get_world_size(group), dist.get_rank(group)
        rows = slice(r * FFN // P, (r + 1) * FFN // P)
        plain = [t.clone().requires_grad_() for t in (x.chunk(P)[r], w[rows], b[rows])]  # x slice, fc1's rows
        fused = [t.detach().clone().requires_grad_() for t in plain]
        (F.linear(gather_from_sequence_parallel_region(plain[0], group), *plain[1:]) * g_out[..., rows]).sum() \
            .backward()                                                                         # synchronous
        y, kept = kept_for_backward(lambda: LinearWithSequenceParallel.apply(*fused, group), fused[1:], fused[:1])
        assert kept == fused[0].nbytes, kept              # its own [s/tp, b, h] slice: no copy, nothing gathered
        (y * strided(g_out[..., rows])).sum().backward()                                        # micro-batch 1
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):  # 2: saved tensors come
            y = LinearWithSequenceParallel.apply(*fused, group)       # back as other objects (as offloading's do):
        (y * strided(g_out[..., rows])).sum().backward()              # main_grad still lands on W itself
        for got, want in zip((fused[0].grad, fused[1].main_grad, fused[2].grad), (t.grad for t in plain)):
            torch.testing.assert_close(got, 2 * want)
        assert fused[1].grad is None
        unfused = [t.detach().clone().requires_grad_() for t in (plain[0].unsqueeze(2), *plain[1:])]  # dW in W.grad
        (LinearWithSequenceParallel.apply(*unfused, group, False) * g_out[..., rows].unsqueeze(2)).sum().backward()
        assert not hasattr(unfused[1], "main_grad")                   # x [s/tp, b, 1, h]: any dims, as nn.Linear
        for got, want in zip((t.grad for t in unfused), (plain[0].grad.unsqueeze(2), plain[1].grad, plain[2].grad)):
            torch.testing.assert_close(got, want)
        handshake(plain, g_out[..., rows], group, tied=group is not None)
    w_bf16 = w.bfloat16().requires_grad_()                                   # bf16 weights: main_grad is fp32
    LinearWithSequenceParallel.apply(x.chunk(dist.get_world_size())[dist.get_rank()].bfloat16(), w_bf16).sum() \
        .backward()
    assert w_bf16.grad is None and w_bf16.main_grad.dtype == torch.float32
    log("async reduce-scatter, dW into main_grad == gather region + autograd, 2 micro-batches, world and sub-groups;"
        " also where saved-tensor hooks hand W back as another object")
    log("bf16 W: main_grad is fp32, W.grad stays None; gradient_accumulation_fusion=False: dW in W.grad == autograd")
    log("handshake with a data-parallel wrapper (a bucket's main_grad, grad_added_to_main_grad): its hook fires "
        "once a backward, drops the placeholder; main_grad == 2 micro-batches' dW. W also an embedding table, "
        "W.zero_out_wgrad: a zero placeholder the hook adds, == autograd over both uses (without: lookup's dW lost)")
    grad_x = torch.randn(240, 4, 256, device=device)      # timing: grad_x [s, b, h] fp32, s divisible by 1..8 but 5, 7
    g2, t2, dw = (torch.randn(*shape, device=device) for shape in ((960, 128), (960, 256), (128, 256)))
    t = time_overlap(lambda: Posted(_reduce_scatter_along_dim(grad_x, 0, None, async_op=True)[1]),
                     lambda: dw.addmm_(g2.t(), t2), device, iters=2)      # dW [f/tp, h] += grad.T @ total
    hidden, most = t["comm"] + t["compute"] - t["overlapped"], min(t["comm"], t["compute"])
    log(f"reduce-scatter {t['comm'] * 1e3:.2f} ms + dW {t['compute'] * 1e3:.2f} ms one after the other, "
        f"{t['overlapped'] * 1e3:.2f} ms overlapped: {hidden * 1e3:+.2f} ms hidden, of at most {most * 1e3:.2f} "
        + ("(beyond that: this shared machine's timing noise)" if abs(hidden) > most else "(printed, not asserted)"))
    log(f"why: {dist.get_world_size()} ranks share {len(os.sched_getaffinity(0))} CPU core(s) here, and gloo's "
        "reduce-scatter runs on CPU threads that compete with dW's matmul: with no core idle, overlap cannot save "
        "time. On GPUs NCCL runs it on its own stream beside dW (Megatron sets CUDA_DEVICE_MAX_CONNECTIONS=1 so "
        "that it is queued first) and hides up to the smaller of the two")


def handshake(inputs, g_out, group, tied=True):
    """A data-parallel wrapper's side of Megatron's handshake, as 09's is: W.main_grad a view of a flat bucket,
    W.grad_added_to_main_grad = False, and a post-accumulate-grad hook that adds W.grad into main_grad only when
    `not W.grad_added_to_main_grad or W.zero_out_wgrad`, then drops it. tied: also with W an embedding table."""
    ids = torch.arange(inputs[1].shape[0], device=g_out.device).flip(0).repeat(3)   # every row of W, 3 times
    g_emb = ints((len(ids), H), 77 + dist.get_rank(), g_out.device)
    if tied:
        w_ref = inputs[1].detach().clone().requires_grad_()                        # dense: autograd, both uses
        ((F.linear(gather_from_sequence_parallel_region(inputs[0].detach(), group), w_ref, inputs[2].detach())
          * g_out).sum() + (F.embedding(ids, w_ref) * g_emb).sum()).backward()
    main = {}
    for tied, zero_out in ((False, False), (True, True), (True, False))[:3 if tied else 1]:
        x, w, b = (t.detach().clone().requires_grad_() for t in inputs)
        wide = torch.promote_types(w.dtype, torch.float32)                           # fp32, or W's if wider
        bucket = torch.zeros(w.numel() + 3, dtype=wide, device=w.device)              # more than W alone
        w.main_grad, w.grad_added_to_main_grad, fired = bucket[3:].view_as(w), False, []
        if zero_out:
            w.zero_out_wgrad = True                                   # whoever ties W says so

        def hook(p):
            fired.append((p.grad_added_to_main_grad, p.grad.shape))
            if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False):   # Megatron's rule
                p.main_grad.add_(p.grad)
            p.grad, p.grad_added_to_main_grad = None, False
        w.register_post_accumulate_grad_hook(hook)
        for _ in range(2):
            loss = (LinearWithSequenceParallel.apply(x, w, b, group) * g_out).sum()
            (loss + (F.embedding(ids, w) * g_emb).sum() if tied else loss).backward()
        assert fired == [(True, w.shape)] * 2 and w.grad is None and not bucket[:3].any(), fired
        torch.testing.assert_close(x.grad, 2 * inputs[0].grad)
        main[tied, zero_out] = w.main_grad
    linear_dw = 2 * inputs[1].grad                                    # the fused linear's dW alone, 2 micro-batches
    torch.testing.assert_close(main[False, False], linear_dw)         # untied: the empty placeholder, dropped
    if not tied:
        return
    torch.testing.assert_close(main[True, True], 2 * w_ref.grad)      # tied: == autograd over both uses
    torch.testing.assert_close(main[True, False], linear_dw)          # tied, no zero_out_wgrad: the lookup's dW lost
    assert not torch.allclose(main[True, False], main[True, True])


def ulysses(groups, device):
    f64 = dict(dtype=torch.float64, device=device)
    qkv, dout = [torch.randn(S, B, NH, D, **f64) for _ in range(3)], torch.randn(S, B, NH, D, **f64)
    V = S * B * NH * D * 8
    for group in groups:
        ranks, P, r = members(group), dist.get_world_size(group), dist.get_rank(group)
        q = ints((S // P, B, NH, D), 30 + dist.get_rank(), device)          # sequence slice r, all heads
        full = torch.cat([ints((S // P, B, NH, D), 30 + g, device) for g in ranks], dim=0)   # [s, b, h, d]
        a2a = adjoint_checked(lambda t: all_to_all_4d(t, 2, 0, group), strided(q), group)
        assert torch.equal(a2a, full.chunk(P, dim=2)[r]) and torch.equal(all_to_all_4d(strided(a2a), 0, 2, group), q)
        mine = lambda t: t.chunk(P, dim=0)[r]                                # this rank's slice of the sequence
        for causal in (False, True):
            ref_in = [t.clone().requires_grad_() for t in qkv]
            ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in ref_in), is_causal=causal)
            ref = ref.permute(2, 0, 1, 3)                                    # [s, b, h, d]
            my_in = [mine(t).clone().requires_grad_() for t in qkv]
            with traffic() as uly:
                out = ulysses_attention(*my_in, is_causal=causal, group=group)
            torch.testing.assert_close(out, mine(ref))
            for a, b in zip(vjp(out, my_in, mine(dout)), vjp(ref, ref_in, dout)):
                torch.testing.assert_close(a, mine(b))                       # dq, dk, dv
        assert dict(uly.counts) == ({"all_to_all": 4} if P > 1 else {})
        assert sent(uly, ranks) == 4 * (P - 1) * V // P ** 2
        if group is None:
            log(f"all_to_all_4d: [s/P, b, h, d] {list(q.shape)} -> [s, b, h/P, d] {list(a2a.shape)} and back, exact;"
                " adjoint exact")
            log(f"attention, causal and not: output, dq, dk, dv == SDPA on the whole sequence; {NH // P} heads a rank")
            log(f"forward bytes per rank, V = b*s*h*d*bytes = {V} B: 4 all-to-alls send 4(P-1)/P^2*V = {sent(uly)} B,"
                f" 2/P of Megatron SP's {2 * (P - 1) * V // P} B")
    W = dist.get_world_size()
    for shape, dims, what in (((2, B, RING_HEADS, D), (2, 0), "heads"), ((W + 1, B, NH, D), (0, 2), "sequence")):
        if W == 1:                              # 5 heads (ring attention's) on Ulysses; a sequence slice of W + 1
            all_to_all_4d(torch.zeros(shape, device=device), *dims)   # on one rank every size divides
            continue
        said = refused(lambda: all_to_all_4d(torch.zeros(shape, device=device), *dims))
        assert said == f"{what}={shape[dims[0]]} is not divisible by the group size {W}", said
        log(f"refused: ValueError: {said}")
    said = refused(lambda: all_to_all_4d(torch.zeros(W, B, NH, D, device=device), 2, 2))
    assert said.startswith("all_to_all_4d takes an [s, b, h, d] tensor and two different dims"), said
    log(f"the same on sub-groups {members(groups[-1])}, ..")


def zigzag(groups, device):
    pos = torch.arange(S, device=device, dtype=torch.float64)            # each token's position in the sequence
    x = ints((S, B, 3), 7, device)                                        # [s, b, 3], the same on every rank
    for group in groups:
        P, r = dist.get_world_size(group), dist.get_rank(group)
        c = S // (2 * P)
        rows = zigzag_shard(pos, 0, group)
        assert rows.tolist() == [*range(r * c, (r + 1) * c), *range((2 * P - 1 - r) * c, (2 * P - r) * c)]
        held = zigzag_shard(strided(x), 0, group)                          # along dim 0, from a strided view
        assert torch.equal(held, x[rows.long()])
        assert torch.equal(adjoint_checked(lambda t: zigzag_unshard(t, 0, group), strided(held), group), x)
        pairs = torch.stack([(rows + 1).sum(), (pos.chunk(P)[r] + 1).sum()])   # causal query-key pairs, mine
        every = [torch.empty_like(pairs) for _ in range(P)]
        dist.all_gather(every, pairs, group=group)
        zig, contiguous = zip(*(p.long().tolist() for p in every))
        assert set(zig) == {S * (S + 1) // (2 * P)} and (P == 1 or len(set(contiguous)) == P)
        if group is None:
            log(f"rank r holds chunks r and 2P-1-r of {2 * P}: positions {rows[:2].long().tolist()}.. on R0; "
                "unshard(shard(x)) == x along dim 0; unshard's adjoint exact")
            log(f"causal query-key pairs per rank: zig-zag {list(zig)}, contiguous {list(contiguous)}")
    P = dist.get_world_size()
    if P > 1:
        said = refused(lambda: zigzag_shard(torch.zeros(S + P, device=device), 0))
        assert said.startswith(f"sequence length={S + P} is not divisible by 2 x {P} ranks"), said
        log(f"refused: ValueError: {said}")
    log(f"the same on sub-groups {members(groups[-1])}, ..")


def ring(groups, device):
    f64 = dict(dtype=torch.float64, device=device)
    qkv, dout = [torch.randn(S, B, RING_HEADS, RING_D, **f64) for _ in range(3)], torch.randn(S, B, RING_HEADS,
                                                                                             RING_D, **f64)
    sdpa = lambda q, k, v, causal: F.scaled_dot_product_attention(  # [s, b, h, d] <-> [b, h, s, d]
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=causal).permute(2, 0, 1, 3)
    fused = device.type == "cpu"                # float64: CUDA's FlashAttention takes fp16/bf16, so explicit there
    for group in groups:
        ranks, P, r = members(group), dist.get_world_size(group), dist.get_rank(group)
        got, works = _ring_exchange(strided(ints((2, 3), dist.get_rank(), device)), group)   # one ring step
        _wait(works)
        assert torch.equal(got, ints((2, 3), ranks[(r - 1) % P], device))   # the previous group rank's tensor
        mine = lambda t: zigzag_shard(t, 0, group)
        for causal in (False, True):
            ref_in = [t.clone().requires_grad_() for t in qkv]
            ref = sdpa(*ref_in, causal)
            my_in = [strided(mine(t)).requires_grad_() for t in qkv]        # [s/P, b, h, d], non-contiguous
            with traffic() as fwd:
                out = ring_attention(*my_in, is_causal=causal, group=group, fused=fused)
            with traffic() as bwd:
                grads = vjp(out, my_in, strided(mine(dout)))
            torch.testing.assert_close(out, mine(ref))
            for a, b in zip(grads, vjp(ref, ref_in, dout)):
                torch.testing.assert_close(a, mine(b))                       # dq, dk, dv
            kv = my_in[1].nbytes + my_in[2].nbytes                           # this rank's K and V slices
            assert dict(fwd.counts) == ({"send": P - 1, "recv": P - 1} if P > 1 else {})
            assert dict(bwd.counts) == ({"send": 2 * P - 1, "recv": 2 * P - 1} if P > 1 else {})
            assert sent(fwd, ranks) == (P - 1) * kv and sent(bwd, ranks) == (P - 1) * kv + P * kv * (P > 1)
            ops = [(name, (r + 1) % P if name == "send" else (r - 1) % P, n) for name, _, n in fwd.calls + bwd.calls]
            logs = [None] * P
            dist.all_gather_object(logs, ops, group=group)
            assert replays(logs), "a posted send would wait for ever"          # common.replays
        if group is None:
            log(f"q, k, v [s/P, b, h, d] = {list(my_in[0].shape)}, {RING_HEADS} heads: output, dq, dk, dv == SDPA on "
                "the whole sequence, causal and not")
            log(f"bytes each rank sends: forward (P-1) x its K+V = {sent(fwd)} B; backward {sent(bwd)} B "
                "= that + P x dK+dV")
            log("every rank's posted sends and receives replay to the end with blocking sends (even/odd order)")
    log(f"the same on sub-groups {members(groups[-1])}, .. (ring neighbours by group rank)")
    ring_bf16(qkv, dout, sdpa, device)


def kernel_calls(fn):
    """fn()'s result, the attention kernels it dispatched [(op, query rows, key rows, causal)] and how many
    matrix products it ran (an explicit block's scores and its p @ v)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    calls, products = [], []

    class Calls(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):  # as common.traffic's: saves importing dynamo (~3 s a rank)
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name, names = func._overloadpacket.__name__, [a.name for a in func._schema.arguments]
            if "flash_attention" in name:
                given = dict(zip(names, args), **(kwargs or {}))
                calls.append((name, given["query"].shape[-2], given["key"].shape[-2], given.get("is_causal")))
            elif name in ("mm", "bmm", "addmm", "baddbmm"):
                products.append(name)
            return func(*args, **(kwargs or {}))
    with Calls():
        out = fn()
    return out, calls, products


def ring_fused_and_work(device):
    """The fused kernel is what ring_attention runs by default, one call a ring step forward and backward, asked
    for exactly the query-key pairs attention needs; it agrees with the explicit block."""
    P, r = dist.get_world_size(), dist.get_rank()
    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16   # what each device's fused kernel takes
    tol = {} if dtype == torch.float64 else dict(rtol=2 ** -6, atol=2 ** -6)        # bf16: a few roundings
    q, k, v, dout = (torch.randn(S // P, B, RING_HEADS, 8, dtype=dtype, device=device) for _ in range(4))
    scale = 8 ** -0.5
    close = lambda a, b: torch.testing.assert_close([t.double() for t in a], [t.double() for t in b], **tol)
    for causal, n, m in ((True, S // P, S // P), (False, S // P, S // (2 * P))):   # a diagonal and a full block
        qt, kt, vt = (t[:rows].permute(1, 2, 0, 3) for t, rows in ((q, n), (k, m), (v, m)))   # [b, h, rows, d]
        fused, explicit = _fused_block(qt, kt, vt, causal, scale), _explicit_block(qt, kt, vt, causal, scale)
        close(fused[:2], explicit[:2])                                                   # output, log-sum-exp
        do = dout.permute(1, 2, 0, 3)
        close(_fused_block_backward(do, qt, kt, vt, *fused[:2], causal, scale, fused[2]),
              _explicit_block_backward(do, qt, kt, vt, *explicit[:2], causal, scale))
    log(f"fused kernel == explicit block ({dtype}): one block's output, log-sum-exp, and dq, dk, dv from them, "
        "causal square and full; the whole ring's output and dq, dk, dv, causal and not")
    import warnings
    with warnings.catch_warnings(record=True) as said:                   # where no fused kernel takes q
        warnings.simplefilter("always")
        kernels = [_block_kernels(torch.empty(2, 1, 1, 8, device="meta")) for _ in range(2)]
    assert kernels == [(_explicit_block, _explicit_block_backward)] * 2 and len(said) == 1, said
    log(f"no fused kernel (a meta tensor here): the explicit block, said once: {str(said[0].message)[16:]}")
    pairs = {}
    for causal in (False, True):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out, fwd, products = kernel_calls(lambda: ring_attention(*qkv, is_causal=causal))
        grads, bwd, bwd_products = kernel_calls(lambda: vjp(out, qkv, dout))
        assert products == bwd_products == [] and len(fwd) == len(bwd) == P, (products, fwd, bwd)
        pairs[causal] = [sum(n * (n + 1) // 2 if c else n * m for _, n, m, c in calls) for calls in (fwd, bwd)]
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        explicit, _, products = kernel_calls(lambda: ring_attention(*qkv, is_causal=causal, fused=False))
        assert len(products) > 0                                          # the recorder sees an explicit block
        close((explicit, *vjp(explicit, qkv, dout)), (out, *grads))        # the explicit ring == the fused ring
    every = [None] * P
    dist.all_gather_object(every, pairs)
    assert all(p == {False: [S * S // P] * 2, True: [S * (S + 1) // (2 * P)] * 2} for p in every), every
    log(f"by default one fused kernel call a ring step ({P} forward, {P} backward, no matrix product), asked for "
        f"{pairs[False][0]} = s^2/P query-key pairs, causal {pairs[True][0]} = s(s+1)/2P on every rank (no more)")


def ring_step_bytes(P, r, n, d, bh, causal):
    """Closed forms, fp32: the most bytes a ring step holds, forward and backward (inputs, and forward's saved
    output and log-sum-exp, not counted). One number per query row is A bytes; a K/V or dK/dV message 2Ad."""
    A = bh * n * 4
    row, msg = A * d, 2 * A * d

    def block(src):                               # the step's query rows and key rows, as fractions of n
        return (1, 1) if not causal or src == r else (1, 0.5) if src < r else (0.5, 1)
    # step 0: forward holds out, lse, K/V and the K/V arriving; backward dq, K/V (+ arriving), the block's dq, dk, dv
    # when the dK/dV sum starts
    fwd, bwd = [row + A + min(P, 2) * msg], [row + min(P, 2) * msg + 3 * row + msg]
    for t in range(1, P):                         # + the block's output, lse and 2 lse temporaries of the merge;
        fq, fk = block((r - t) % P)               # backward: dK/dV sent and arriving, the block's grads, an lse copy
        arriving = msg * (t < P - 1)
        fwd.append(row + A + msg + arriving + int(fq * (row + 3 * A)))
        bwd.append(row + msg + arriving + 2 * msg + int(fq * (row + A) + 2 * fk * row))
    return max(fwd), max(bwd)


def ring_message_bytes(P, n, d, bh):
    """Closed forms, fp32: the bytes held as each message of the ring starts (a send and its receive alike),
    forward then backward. A sent buffer is freed at its wait, so a step holds its K/V and the K/V arriving;
    forward also the output and log-sum-exp (from step 1); backward dq, and at the dK/dV exchange the dK/dV sent
    and the one arriving (at the next step's K/V exchange still in flight)."""
    A = bh * n * 4
    row, msg = A * d, 2 * A * d
    fwd = [2 * msg + (row + A) * (t > 0) for t in range(P - 1)]
    bwd = []
    for t in range(P):
        bwd += [row + 2 * msg + 2 * msg * (t > 0)] * (t < P - 1) + [row + msg + msg * (t < P - 1) + 2 * msg]
    return ([b for b in fwd for _ in "sr"], [b for b in bwd for _ in "sr"]) if P > 1 else ([], [])


def ring_memory(device):
    """No score matrix on a rank: the bytes a ring step holds, measured, equal the closed form of the messages,
    accumulators and one block's output, and are less than one head's [s/P x s/P] fp32 score."""
    P, r = dist.get_world_size(), dist.get_rank()
    b, h, d, n = 1, 2, 8, 256                                             # n = s/P rows a rank
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16    # fused here (the closed form: fp32)
    q, k, v, dout = (torch.randn(n, b, h, d, dtype=dtype, device=device) for _ in range(4))
    score = b * n * n * 4                                                 # one head's [s/P x s/P] fp32 scores
    for causal in (True, False):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        with memory() as fwd:
            out = ring_attention(*qkv, is_causal=causal)
        with memory() as bwd:
            torch.autograd.grad(out, qkv, dout)
        want = ring_step_bytes(P, r, n, d, b * h, causal)
        exact = dtype != torch.float32 or (fwd.peak, bwd.peak) == want                # bf16 adds its casts
        assert exact and max(fwd.peak, bwd.peak) < score, ((fwd.peak, bwd.peak), want, score)
        held = ([b for _, b in fwd.comms], [b for _, b in bwd.comms])              # as each message starts
        assert dtype != torch.float32 or held == ring_message_bytes(P, n, d, b * h), (held, fwd.comms, bwd.comms)
    with memory() as explicit:
        ring_attention(*qkv, is_causal=False, fused=False)
    assert explicit.peak >= b * h * n * n * 4                             # the meter sees a score when one exists
    log(f"peak bytes of a ring step (n = s/P = {n}, d {d}, {h} heads, {dtype}): forward {fwd.peak}, backward "
        f"{bwd.peak} == closed form, < one head's score {score}; explicit blocks {explicit.peak} B (the meter does "
        "not see the kernel's own tiles)")
    log("bytes held as each K/V and dK/dV message starts == closed form: a sent buffer is freed at its wait")


def ring_bf16(qkv, dout, sdpa, device):
    P = dist.get_world_size()
    rounded = [t.bfloat16() for t in (*qkv, dout)]                   # bf16 inputs; the reference sees the same
    ref_in = [t.double().requires_grad_() for t in rounded[:3]]
    ref = sdpa(*ref_in, True)
    ref_grads = vjp(ref, ref_in, rounded[3].double())
    my_in = [zigzag_shard(t, 0).requires_grad_() for t in rounded[:3]]
    out = ring_attention(*my_in, is_causal=True)
    with traffic() as bwd:
        grads = vjp(out, my_in, zigzag_shard(rounded[3], 0))
    kv = my_in[1].nbytes + my_in[2].nbytes                          # bf16 K and V; dK, dV travel in fp32
    assert sent(bwd) == (P - 1) * kv + P * 2 * kv * (P > 1)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    one = [t.clone().requires_grad_() for t in rounded[:3]]            # one process, bf16: SDPA's own error
    one_out = sdpa(*one, True)
    worst = 0
    for mine, theirs, want in zip((out, *grads), (one_out, *vjp(one_out, one, rounded[3])), (ref, *ref_grads)):
        want = zigzag_shard(want, 0)
        err, sdpa_err = ((x.double() - want).abs().max().item() for x in (mine, zigzag_shard(theirs, 0)))
        assert err <= sdpa_err + P * 2 ** -8 * want.abs().max().item(), (err, sdpa_err)   # + P blocks' roundings
        worst = max(worst, err / sdpa_err)
    log(f"bf16 in (each block's kernel in bf16; merging, dq and dK, dV sums in fp32): output, dq, dk, dv off float64 "
        f"SDPA by <= one-process bf16 SDPA's error + P bf16 roundings; here {worst:.2f} x SDPA's error at most")
    bad = torch.zeros(3, B, RING_HEADS, RING_D, device=device)
    said = refused(lambda: ring_attention(bad, bad, bad))                  # 3 rows a rank
    assert said.startswith(f"sequence length={3 * P} is not divisible by 2 x {P} ranks"), said
    log(f"refused: ValueError: {said}")


def ring_overlap(device):
    q, kv = torch.randn(1, 4, 512, 64, device=device), torch.randn(2, 1, 4, 512, 64, device=device)  # [b, h, n, d]
    block, _ = _block_kernels(q)
    t = time_overlap(lambda: Posted(_ring_exchange(kv, None)[1]),
                     lambda: block(q, kv[0], kv[1], False, 64 ** -0.5), device, iters=3)
    hidden, most = t["comm"] + t["compute"] - t["overlapped"], min(t["comm"], t["compute"])
    log(f"one step, K+V {kv.nbytes} B: send/recv {t['comm'] * 1e3:.2f} ms + attention {t['compute'] * 1e3:.2f} ms "
        f"one after the other, {t['overlapped'] * 1e3:.2f} ms overlapped: {hidden * 1e3:+.2f} ms hidden, of at most "
        f"{most * 1e3:.2f} " + ("(beyond that: this shared machine's noise)" if abs(hidden) > most else
                                "(printed, not asserted)"))
    log(f"why: {dist.get_world_size()} ranks share {len(os.sched_getaffinity(0))} CPU core(s) here; gloo's send and "
        "receive run on CPU threads competing with the attention kernel, so with no core idle the ring cannot hide. "
        "On GPUs NCCL moves K, V beside the kernel, and a step hides its transfer once its ~(s/P)^2 pairs take "
        "longer than ~s/P rows on the link")


def ring_benchmark(s=4096, b=1, h=8, d=64, rounds=int(os.environ.get("BENCH_ROUNDS", "10"))):
    """BENCH=1: forward + backward of causal attention over a sequence of s, each side first checked equal to one
    process's SDPA, then timed in interleaved rounds; ratios are medians of per-round ratios."""
    import statistics
    import time
    from torch.nn.attention.bias import causal_lower_right
    rank, P, device = setup()
    head(f"BENCH: causal attention fwd+bwd, [s, b, h, d] = [{s}, {b}, {h}, {d}], fp32, {P} ranks "
         f"({torch.get_num_threads()} thread(s) a rank; load average {os.getloadavg()[0]:.1f} on "
         f"{len(os.sched_getaffinity(0))} cores)")
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(s, b, h, d, generator=g).to(device) for _ in range(4)]     # q, k, v, dout: every rank
    mine = [zigzag_shard(t, 0).contiguous() for t in whole]
    c, bhsd = s // (2 * P), lambda t: t.permute(1, 2, 0, 3)                          # [s, b, h, d] -> [b, h, s, d]

    def one_process():                                   # SDPA on the whole sequence, the zig-zag rows kept
        qkv = [t.clone().requires_grad_() for t in whole[:3]]
        out = F.scaled_dot_product_attention(*map(bhsd, qkv), is_causal=True).permute(2, 0, 1, 3)
        return (zigzag_shard(x, 0) for x in (out, *torch.autograd.grad(out, qkv, whole[3])))

    def ours():
        qkv = [t.clone().requires_grad_() for t in mine[:3]]
        out = ring_attention(*qkv, is_causal=True)
        return out, *torch.autograd.grad(out, qkv, mine[3])

    def all_gather_cp():                                 # Llama 3: all-gather K, V; my 2 chunks see their prefix
        qkv = [t.clone().requires_grad_() for t in mine[:3]]
        k, v = zigzag_unshard(torch.cat(qkv[1:], dim=-1), 0).split(d, dim=-1)      # one all-gather, [s, b, h, d]
        outs = []
        for i, start in enumerate((rank * c, (2 * P - 1 - rank) * c)):           # chunk r, chunk 2P-1-r
            q = bhsd(qkv[0][i * c:(i + 1) * c])
            mask = causal_lower_right(c, start + c)                              # the prefix, causal at its end
            outs.append(F.scaled_dot_product_attention(q, bhsd(k[:start + c]), bhsd(v[:start + c]), attn_mask=mask))
        out = torch.cat(outs, dim=2).permute(2, 0, 1, 3)
        return out, *torch.autograd.grad(out, qkv, mine[3])

    sides = {"ours": ours, "all-gather": all_gather_cp, "one process": one_process}
    try:                                                 # torch 2.8+ moved it; older torch has the first home
        try:
            from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        except ImportError:
            from torch.distributed.tensor.experimental import _attention as cp
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        cp._templated_ring_attention, cp._templated_ring_attention_backward, cp._RotateMethod    # or not timed

        def torch_ring(method):
            def run():
                cp._cp_options.rotate_method = method
                q, k, v, dout = map(bhsd, mine)
                out, lse = cp._templated_ring_attention(dist.group.WORLD, 2, flash.default, q, k, v, is_causal=True)
                grads = cp._templated_ring_attention_backward(
                    dist.group.WORLD, 2, flash_backward, grad_out=dout, grad_out_name="grad_out", query=q, key=k,
                    value=v, out=out, logsumexp=lse, is_causal=True, dropout_p=0.0)
                return (t.permute(2, 0, 1, 3) for t in (out, *grads[:3]))
            return run
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        if device.type == "cpu":
            sides["torch ring (all-gather)"] = torch_ring(cp._RotateMethod.ALL_GATHER)   # context_parallel's default
            sides["torch ring (all-to-all)"] = torch_ring(cp._RotateMethod.ALL_TO_ALL)
    except (ImportError, AttributeError) as err:
        log(f"PyTorch's ring attention not timed: {err}")
    want = list(one_process())
    for name, fn in sides.items():                       # every side first equals one process's SDPA
        for got, ref in zip(fn(), want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    log(f"output, dq, dk, dv of every side == one process's SDPA (rtol 1e-4); {rounds} interleaved rounds")
    ms = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            sync(device), dist.barrier()
            t0 = time.perf_counter()
            list(fn())
            sync(device)
            ms[name].append(1e3 * (time.perf_counter() - t0))
    log(f"load average now {os.getloadavg()[0]:.1f}")
    for name in sides:
        ratio = statistics.median(a / b for a, b in zip(ms["ours"], ms[name]))
        log(f"{name:24} {statistics.median(ms[name]):8.1f} ms   ours / it: x{ratio:.2f} (median of per-round ratios)")
    finish(f"ring attention timed beside all-gather CP, PyTorch's ring and one process at {P} ranks")


def main():
    if os.environ.get("BENCH", "0") not in ("", "0"):
        return ring_benchmark()
    W = launched_world_size()
    if 24 % W:
        refuse(f"world size {W} does not divide {NH} heads, ffn {FFN} and the sequence's {S // 2} chunk pairs: "
               "use 1, 2, 3, 4, 6 or 8")
    rank, _, device = setup()
    groups = (None, strided_groups()[rank % 2][0])                # the world, and my parity's ranks {r % 2}
    head("the sequence-parallel regions: values and adjoints, on rank-dependent inputs")
    regions(groups, device)
    head(f"an MLP block on [s, b, h] = [{S}, {B}, {H}], ffn {FFN}: dense == TP == SP, forward and backward")
    every_run = mlp_block_checks(groups, device)
    head("one block's traffic and activation memory, TP vs SP, measured")
    mlp_traffic(every_run)
    head("overlap: grad_x's reduce-scatter travels while dW accumulates into main_grad")
    linear_overlap(groups, device)
    head(f"Ulysses: q, k, v [s/P, b, h, d] all-to-all to [s, b, h/P, d], {NH} heads")
    ulysses(groups, device)
    head(f"zig-zag shards of a sequence of {S} for ring attention")
    zigzag(groups, device)
    head("ring attention == F.scaled_dot_product_attention on the whole sequence, float64")
    ring(groups, device)
    head("ring attention's blocks: the fused attention kernel, the work it does and the bytes a step holds")
    ring_fused_and_work(device)
    ring_memory(device)
    head("ring overlap: the next K, V travel while this step's attention runs")
    ring_overlap(device)
    finish("SP regions and adjoints, MLP block SP == TP == dense with LN grads all-reduced, SP traffic and "
           "memory, async reduce-scatter overlap, Ulysses, zig-zag, ring attention")


if __name__ == "__main__":
    main()
