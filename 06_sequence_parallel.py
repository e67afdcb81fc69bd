"""06 - sequence parallelism: Megatron's (split what TP leaves whole), Ulysses (all-to-all to heads), and context
parallelism (ring attention over zig-zag shards), for GPT- and Llama-shaped attention (GQA, rotary positions).

Megatron SP (Korthikanti et al., 2022). TP runs LayerNorm, dropout and the residual on the whole [s, b, h] on every
rank; SP splits them along s (dim 0 of [s, b, h]; sequence_dim=1 of [b, s, h]), cuts TP's all-reduce in halves:
    TP:  x[s, b, h]     LN  f (identity)  fc1 GeLU fc2  g (all-reduce)   + x     every rank holds all of s
    SP:  x[s/tp, b, h]  LN  all-gather    fc1 GeLU fc2  reduce-scatter   + x     rank i holds s_i only
         R0 [s0]  --all-gather-->  R0 [s0 s1 s2 s3] ... R0 [s0 s1 s2 s3] partial  --reduce-scatter-->  R0 [s0]
Bytes each rank sends, V = s*b*h*bytes: 2(tp-1)/tp*V forward (TP's all-reduce) and (tp-1)/tp*V more in backward,
where fc1 (LinearWithSequenceParallel) all-gathers again the [s/tp, b, h] input it kept: LN's input and output are
kept at 1/tp. LN's weight and bias and fc2's bias see one slice of s per rank: their gradients need one all-reduce
over TP (Megatron-LM#443). fc1's dW is computed (into W.grad, or a wrapper's main_grad) while grad_x is reduced.

Attention blocks take layout="sbhd" ([s, b, h, d], Megatron's; the default), "bshd" or "bhsd" ([b, h, s, d], as
nanoGPT hands SDPA), and answer in it; q has h heads, k and v h_kv heads dividing h (GQA, as SDPA's enable_gqa).

Ulysses (Jacobs et al., 2023), inside a node. An all-to-all turns q [s/P, b, h, d] into [s, b, h/P, d] (k, v too),
attention runs on h/P heads over the whole sequence, one more all-to-all brings the output back; P must divide h.
Where P does not divide h_kv, each K/V head goes to every rank whose queries read it: h_kv' = lcm(h_kv, P) sent.
Forward sends (P-1)/P^2 * (2V + 2V*h_kv'/h), V = s*b*h*d*bytes: 4(P-1)/P^2 * V for MHA, 2/P of Megatron SP's.
    R0 [s0 | h0 h1 h2 h3]  --all_to_all_4d(x, scatter_dim=2, gather_dim=0)-->  R0 [s0 s1 s2 s3 | h0]
    R1 [s1 | h0 h1 h2 h3]  <--all_to_all_4d(x, scatter_dim=0, gather_dim=2)--  R1 [s0 s1 s2 s3 | h1]

Ring attention (context parallelism: Liu et al. 2023; Megatron CP, torch's context_parallel). q, k, v in zig-zag
shards: of 2P chunks rank r holds r and 2P-1-r, an early one and a late one, so causal work is s(s+1)/2P on every
rank (contiguous shards give rank P-1 2P-1 times rank 0's). K, V go round the ring at their own h_kv heads; each
step is one call of the fused attention kernel that returns the log-sum-exp l (CPU flash; FlashAttention-2), merged
online: o = lerp(o, o_B, sigmoid(l_B - l)), l = log(e^l + e^l_B). No [s/P x s/P] score exists outside its tiles.
    R0 [c0 c7]  R1 [c1 c6]  R2 [c2 c5]  R3 [c3 c4]    step t: rank r attends to the K, V of r-t and sends them to r+1
Backward: the kernel's own, given the final o and l; dq stays, dK and dV ride the ring home (picture in backward).
Bytes each rank sends, K and V slices of b*(s/P)*h_kv*d*bytes each: forward (P-1)*2 slices, backward that again
plus P*2 of dK, dV (fp32 for bf16): h_kv/h of MHA's. All-gather CP (Llama 3) gathers K, V once: bench/06_ring.py.
Positions: a shard's rows sit at global positions, not 0..s/P-1 (nanoGPT's arange(t) is wrong on a shard):
shard_positions(s) gives them, zig-zag or contiguous, for wpe(positions) or apply_rope(q, positions) (RoPE).

    torchrun --nproc-per-node=4 06_sequence_parallel.py
tests/check_06.py proves the rest: sub-groups, bf16, layouts, adjoints, refusals at their edges, memory to the byte.
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
    """Post a ring step, x to the next rank and the previous one's into a new tensor: arrived() waits, returns that.
    Even ranks post the send first, odd ranks the receive: blocking sends (gloo; NCCL's large ones) meet a receive."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return lambda: x
    x = x.contiguous()
    recv = torch.empty_like(x)
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    if rank % 2 == 0:
        works = [dist.isend(x, group=group, group_dst=nxt), dist.irecv(recv, group=group, group_src=prev)]
    else:
        works = [dist.irecv(recv, group=group, group_src=prev), dist.isend(x, group=group, group_dst=nxt)]

    def arrived():
        _wait(works)
        works.clear()                                           # the sent x is let go of
        return recv
    return arrived


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
    """forward: all-to-all, scatter_dim split, gather_dim joined (DeepSpeed-Ulysses'); backward: the dims swapped."""
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


def mlp_block(x, p, sequence_parallel: bool, group=None, sequence_dim=0):
    """x + fc2(GeLU(fc1(LayerNorm(x)))) on this rank's TP shard: p['w1'], p['b1'] hold fc1's rows, p['w2'] fc2's
    columns, the rest whole. x, out: [s/tp, b, h] with SP ([b, s/tp, h]: sequence_dim=1), else [s, b, h] whole."""
    h = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"])
    if not sequence_parallel:
        h = F.linear(copy_to_tensor_model_parallel_region(h, group), p["w1"], p["b1"])    # [s, b, f/tp]
        return x + reduce_from_tensor_model_parallel_region(F.linear(F.gelu(h), p["w2"]), group) + p["b2"]
    h = LinearWithSequenceParallel.apply(h, p["w1"], p["b1"], group, True, sequence_dim)   # [s, b, f/tp] memory
    h = F.linear(F.gelu(h).movedim(sequence_dim, 0), p["w2"])               # [s, b, h], partial over ranks
    return x + reduce_scatter_to_sequence_parallel_region(h, group).movedim(0, sequence_dim) + p["b2"]  # [s/tp, b, h]


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


# ---- building blocks: attention's layouts and Ulysses -----------------------------------------------------------
_LAYOUTS = {"sbhd": (1, 2, 0, 3), "bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3)}   # each layout's dims as b, h, s, d
_BACK = {name: [dims.index(i) for i in range(4)] for name, dims in _LAYOUTS.items()}    # [b, h, s, d] -> layout


def _attention_inputs(q, k, v, layout, who):
    """q, k, v as [b, h, s, d] views, checked: k, v of one shape, with q's b, s and d; q's heads a multiple of k's."""
    if layout not in _LAYOUTS or any(t.dim() != 4 for t in (q, k, v)):
        raise ValueError(f"{who} takes 4-dim tensors in layout 'sbhd', 'bshd' or 'bhsd', got layout={layout!r} "
                         f"and shapes {[tuple(t.shape) for t in (q, k, v)]}")
    q, k, v = (t.permute(_LAYOUTS[layout]) for t in (q, k, v))
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"{who}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} as [b, h, s, d] do not "
                         "pair: k and v of one shape, q's b, s and d, and q's heads a multiple of k's")
    return q, k, v


def all_to_all_4d(x, scatter_dim: int, gather_dim: int, group=None):
    """forward: all-to-all that splits scatter_dim and concatenates gather_dim; backward: the swapped all-to-all.
    [s/P, b, h, d] -> [s, b, h/P, d] with (scatter_dim=2, gather_dim=0), (0, 2) back; on [b, h, s/P, d]: (1, 2)."""
    if x.dim() != 4 or scatter_dim == gather_dim or not {scatter_dim, gather_dim} <= {0, 1, 2, 3}:
        raise ValueError(f"all_to_all_4d takes a 4-dim tensor and two different dims in 0..3, got shape "
                         f"{tuple(x.shape)}, scatter_dim={scatter_dim}, gather_dim={gather_dim}")
    _divide(f"x.shape[{scatter_dim}]", x.size(scatter_dim), group)
    return _SeqAllToAll.apply(x, scatter_dim, gather_dim, group)


def ulysses_attention(q, k, v, is_causal: bool = False, group=None, *, layout: str = "sbhd"):
    """Attention over the whole sequence from this rank's contiguous slices of q, k, v along s (layout "sbhd" by
    default) to the output's slice, in that layout. P divides the h query heads; K/V heads go where they are read."""
    q, k, v = _attention_inputs(q, k, v, layout, "ulysses_attention")
    size = dist.get_world_size(group)
    _divide("heads", q.shape[1], group)
    copies = next(c for c in range(1, size + 1) if k.shape[1] * c % size == 0)     # 1 where P divides h_kv
    k, v = (t.repeat_interleave(copies, dim=1) for t in (k, v))                  # lcm(h_kv, P) K/V heads
    q, k, v = (all_to_all_4d(t, 1, 2, group) for t in (q, k, v))                  # [b, h/P, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    return all_to_all_4d(out, 2, 1, group).permute(_BACK[layout])               # [b, h, s/P, d] in layout


# ---- building blocks: zig-zag shards, the positions a shard holds, rotary positions -------------------------------
def _zigzag_check(length: int, what: str, group) -> int:
    size = dist.get_world_size(group)
    if length % (2 * size):
        raise ValueError(f"{what}={length} is not divisible by 2 x {size} ranks (zig-zag's {2 * size} chunks)")
    return size


def zigzag_shard(x, dim, group=None):
    """This rank's zig-zag slice of the whole sequence x along dim: chunks r and 2P-1-r of 2P (no comm)."""
    size = _zigzag_check(x.shape[dim], "sequence length", group)
    chunks, r = x.chunk(2 * size, dim), dist.get_rank(group)
    return torch.cat([chunks[r], chunks[2 * size - 1 - r]], dim)


def zigzag_unshard(x, dim, group=None):
    """The whole sequence from every rank's zig-zag slice along dim: an all-gather (backward: reduce-scatter)."""
    size = _zigzag_check(dist.get_world_size(group) * x.shape[dim], "sequence length", group)
    held = gather_from_sequence_parallel_region(x, group, dim=dim).chunk(2 * size, dim)  # rank r: 2r, 2r+1
    return torch.cat([held[2 * c if c < size else 4 * size - 1 - 2 * c] for c in range(2 * size)], dim)


def shard_positions(seq_len: int, group=None, *, zigzag: bool = True, device=None):
    """The global positions (LongTensor [seq_len/P]) of this rank's rows of a sequence of seq_len, in row order:
    zig-zag (ring attention's, zigzag_shard's) or contiguous (zigzag=False: Ulysses', Megatron SP's)."""
    every = torch.arange(seq_len, device=device)
    return zigzag_shard(every, 0, group) if zigzag else _split_along_dim(every, 0, group)


def apply_rope(x, positions, *, layout: str = "sbhd", base: float = 10000.0):
    """RoPE (RoFormer; Llama's) on q or k in `layout`, its rows along s at `positions` (integers; a shard's from
    shard_positions): halves (x1, x2) of a head turn by pos * base^(-2i/d) for pair i (HF Llama's rotate-half), in
    fp32 or wider. q_m . k_n depends on m - n only: a shard rotated at its global positions attends as the whole."""
    xb = _attention_inputs(x, x, x, layout, "apply_rope")[0]                      # [b, h, n, d]
    n, d = xb.shape[2:]
    if d % 2 or positions.shape != (n,) or positions.is_floating_point():
        raise ValueError(f"apply_rope takes an even head dim and {n} integer positions, one a row, got d={d} and "
                         f"positions of shape {tuple(positions.shape)}, {positions.dtype}")
    acc = torch.promote_types(x.dtype, torch.float32)
    inv_freq = base ** -(torch.arange(0, d, 2, dtype=acc, device=x.device) / d)           # [d/2]
    angle = positions.to(device=x.device, dtype=acc)[:, None] * inv_freq                  # [n, d/2]
    (x1, x2), cos, sin = xb.to(acc).chunk(2, dim=-1), angle.cos(), angle.sin()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype).permute(_BACK[layout])


# ---- building blocks: ring attention, one attention block a ring step --------------------------------------------
def _step_block(rank, src, n, is_causal):
    """(query rows, key rows, causal) of rank's block against src's K, V; each holds n rows, chunks (r, 2P-1-r).
    Causal: step 0 one mask over both chunks; later src < rank: my 2 chunks x src's early one, else my late x both."""
    if not is_causal or src == rank:
        return slice(0, n), slice(0, n), is_causal
    return (slice(0, n), slice(0, n // 2), False) if src < rank else (slice(n // 2, n), slice(0, n), False)


def _scores(q, k, causal, scale):
    """q k^T * scale [b, h, n, m], fp32 or wider, query head i against K head i // (h/h_kv); causal: j > i masked."""
    dtype, k = torch.promote_types(q.dtype, torch.float32), k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.to(dtype) @ k.to(dtype).transpose(-2, -1) * scale
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    return s.masked_fill(mask, float("-inf")) if causal else s


def _explicit_block(q, k, v, causal, scale):
    """One block by definition, [b, h, n, d] q against [b, h_kv, m, d] k, v: (softmax(q k^T * scale) v, each row's
    log-sum-exp). It holds the whole [b, h, n, m] score matrix: the reference the fused kernel is checked against."""
    s = _scores(q, k, causal, scale)
    lse, v = s.logsumexp(-1), v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)   # [b, h, n], K/V head i // g
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.to(s.dtype)).to(q.dtype), lse, ()


def _explicit_block_backward(dout, q, k, v, out, lse, causal, scale, rest=()):
    """One block's (dq, dk, dv), given the FINAL output and log-sum-exp of q's rows over every block: then p is
    this block's share of the whole softmax, and FlashAttention-2's delta = rowsum(dout * out) is the sum over
    ALL keys of p_j dp_j that softmax's backward subtracts: ds = p * (dout v^T - delta)."""
    g = q.shape[1] // k.shape[1]                                                  # query heads a K/V head
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))               # [b, h, n, m]
    q, k, v, dout = (t.to(p.dtype) for t in (q, k, v, dout))
    k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out.to(p.dtype)).sum(-1, keepdim=True))
    dk, dv = ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout          # [b, h, m, d]: summed per K/V head
    return ds @ k * scale, dk.unflatten(1, (-1, g)).sum(2), dv.unflatten(1, (-1, g)).sum(2)


# The fused kernels return the block's log-sum-exp beside its output and take K/V at their own heads; given the
# final output and log-sum-exp, their backward recomputes p tile by tile. CPU: the flash kernel SDPA runs (any float
# dtype). CUDA: FlashAttention-2, fp16/bf16 (memory-efficient attention pads its log-sum-exp); else the explicit block.
def _fused_block(q, k, v, causal, scale):
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))   # rows of d contiguous, as SDPA
    if q.device.type == "cpu":
        return (*torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale), ())
    out, lse, cum_q, cum_k, _, _, rng, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, rng, unused)          # what its backward takes back (no dropout: unused)


def _fused_block_backward(dout, q, k, v, out, lse, causal, scale, rest=()):
    dout, q, k, v, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (dout, q, k, v, out))
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)
    cum_q, cum_k, rng, unused = rest
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, rng, unused,
        scale=scale)


_FALLBACKS_SAID = set()


def _block_kernels(q, fused=True):
    """(forward, backward) of one block for q: a fused kernel where one takes q, else the explicit block (said once)."""
    d, kind = q.shape[-1], q.device.type
    if fused and (kind == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") or
                  kind == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256 and
                  torch.backends.cuda.is_flash_attention_available()):
        return _fused_block, _fused_block_backward
    if fused and (kind, q.dtype, d) not in _FALLBACKS_SAID:
        import warnings
        _FALLBACKS_SAID.add((kind, q.dtype, d))
        warnings.warn(f"ring_attention: no fused attention kernel for {q.dtype}, head dim {d} on {kind} in torch "
                      f"{torch.__version__}; each block uses explicit matmuls (the whole score block)", stacklevel=4)
    return _explicit_block, _explicit_block_backward


class _RingAttention(torch.autograd.Function):
    """forward: attention of this rank's queries to every rank's K, V, passed round the ring; backward: dq here,
    dk and dv round the ring back to their owners. q [b, h, n, d], k and v [b, h_kv, n, d], n = s/P."""
    @staticmethod
    def forward(ctx, q, k, v, is_causal, group, fused):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        block, ctx.block_backward = _block_kernels(q, fused)                 # fused kernel or explicit block
        kv = torch.stack([k, v])                                             # [2, b, h_kv, n, d]: what travels
        # step t: this rank holds the K, V of rank r - t, posts them on to r + 1, and attends to them meanwhile
        for step in range(size):
            kv_next = _ring_exchange(kv, group) if step < size - 1 else None
            rows, cols, causal = _step_block(rank, (rank - step) % size, q.shape[2], is_causal)
            o, lse_b, rest = block(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, q.shape[-1] ** -0.5)
            if step == 0:                                                    # step 0's block covers every row
                out, lse, ctx.rest = o.to(torch.promote_types(q.dtype, torch.float32)), lse_b, rest
            else:                           # online softmax: o = (e^l o + e^lB oB) / (e^l + e^lB), in place
                out[:, :, rows].lerp_(o.to(out.dtype), torch.sigmoid(lse_b - lse[:, :, rows]).unsqueeze(-1))
                lse[:, :, rows] = torch.logaddexp(lse[:, :, rows], lse_b)
            del o, lse_b
            kv = kv_next() if kv_next else kv                                # (the K, V sent are let go of)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.group = is_causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        # A block's backward needs only the FINAL out and lse of its rows (forward kept them). dq stays here; dK, dV
        # join a sum that follows their K, V round the ring a step behind, home one hop after the last step:
        #      step 0          step 1          step 2          one hop more         (P = 3)
        #  R0  dKV0 += R0's    dKV2 += R0's    dKV1 += R0's    dKV0 (R0, R1, R2) home
        #  R1  dKV1 += R1's    dKV0 += R1's    dKV2 += R1's    dKV1 (R1, R2, R0) home
        #  R2  dKV2 += R2's    dKV1 += R2's    dKV0 += R2's    dKV2 (R2, R0, R1) home
        q, k, v, out, lse = ctx.saved_tensors
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        acc, scale = torch.promote_types(q.dtype, torch.float32), q.shape[-1] ** -0.5   # dq, dK, dV sums: fp32+
        dq, dout, kv = torch.zeros(q.shape, dtype=acc, device=q.device), dout.to(q.dtype), torch.stack([k, v])
        for step in range(size):
            # 1. the K, V of rank r - step are here: post them on to r + 1 (they travel while this block computes)
            kv_next = _ring_exchange(kv, ctx.group) if step < size - 1 else None
            # 2. this block's dq, dk, dv, by the kernel's backward from the final out and lse
            rows, cols, causal = _step_block(rank, (rank - step) % size, q.shape[2], ctx.is_causal)
            dq_b, dk_b, dv_b = ctx.block_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols],
                                                  kv[1][:, :, cols], out[:, :, rows], lse[:, :, rows], causal,
                                                  scale, ctx.rest)
            # 3. dq stays; dk, dv join the sum of the ranks this K, V visited before, which moves on with it
            dq[:, :, rows].add_(dq_b)
            dkv = dkv_next() if step else torch.zeros(kv.shape, dtype=acc, device=q.device)
            dkv[0][:, :, cols].add_(dk_b)
            dkv[1][:, :, cols].add_(dv_b)
            del dq_b, dk_b, dv_b
            dkv_next = _ring_exchange(dkv, ctx.group)                        # to r + 1; after the last step: home
            kv = kv_next() if kv_next else kv
        dk, dv = dkv_next()                                                  # this rank's own K, V's, every share in
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q, k, v, is_causal: bool = False, group=None, *, layout: str = "sbhd", fused: bool = True):
    """Attention over the whole sequence from this rank's zig-zag slices of q, k, v (zigzag_shard along s; layout
    "sbhd" by default) to the output's slice, in that layout. Any head count; K, V travel at their h_kv heads and
    dtype. A ring step is one fused kernel call (fused=False: explicit); merging, dq, dk, dv are fp32 for bf16."""
    q, k, v = _attention_inputs(q, k, v, layout, "ring_attention")
    _zigzag_check(dist.get_world_size(group) * q.shape[2], "sequence length", group)
    return _RingAttention.apply(q, k, v, is_causal, group, fused).permute(_BACK[layout])


# ---- demo: each claim against one process (needs common.py; the blocks above need only torch) ------------------
try:
    from common import finish, head, launched_world_size, log, refuse, ring_bytes, setup, traffic
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

S, B, H, FFN = 48, 2, 48, 48   # [s, b, h] and fc1's width: s/2P, ffn/tp and the heads divide for P = 1, 2, 3, 4, 6, 8
NH, KV, D = 24, 8, 4           # Ulysses: 24 query heads, 8 K/V heads (GQA, 3 query heads a K/V head) of dim 4
RING = (6, 2, 8)               # ring attention: 6 query heads, 2 K/V heads of dim 8 (no P > 3 divides them)


def sent(t):
    """Bytes this rank sent for traffic() `t`: a send's, common.ring_bytes of a collective's (V: its output)."""
    wire = lambda name, n, b: b if name == "send" else 0 if name == "recv" else ring_bytes(
        name, n * b if name == "all_gather" else b, n)
    return round(sum(wire(name, len(r), b) for name, r, b in t.calls))


def same_as_one_process(attn, shard, positions, heads, device):
    """attn on my shards of q, k, v (RoPE at `positions`) == causal SDPA on the whole: returns my k, v and traffic."""
    (h, h_kv, d), f64 = heads, dict(dtype=torch.float64, device=device)
    *qkv, dout = (torch.randn(S, B, n, d, **f64) for n in (h, h_kv, h_kv, h))
    whole, mine = [t.clone().requires_grad_() for t in qkv], [shard(t).clone().requires_grad_() for t in qkv]
    rope = lambda q, k, v, pos: (apply_rope(q, pos), apply_rope(k, pos), v)
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in rope(*whole, torch.arange(S))),
                                         is_causal=True, enable_gqa=True).permute(2, 0, 1, 3)   # [s, b, h, d]
    with traffic() as fwd:
        out = attn(*rope(*mine, positions))
    with traffic() as bwd:
        grads = torch.autograd.grad(out, mine, shard(dout))
    torch.testing.assert_close([out, *grads], [shard(t) for t in (ref, *torch.autograd.grad(ref, whole, dout))])
    return mine[1:], fwd, bwd


def megatron_sp(device):
    P, r, f64 = dist.get_world_size(), dist.get_rank(), dict(dtype=torch.float64, device=device)
    dense = {k: t.to(**f64).requires_grad_() for k, t in dict(
        ln_w=1 + 0.1 * torch.randn(H), ln_b=0.1 * torch.randn(H), w1=torch.randn(FFN, H) / H ** .5,
        b1=0.1 * torch.randn(FFN), w2=torch.randn(H, FFN) / FFN ** .5, b2=0.1 * torch.randn(H)).items()}
    x, dy = torch.randn(S, B, H, **f64).requires_grad_(), torch.randn(S, B, H, **f64)
    ln = F.layer_norm(x, (H,), dense["ln_w"], dense["ln_b"])
    ref = x + F.linear(F.gelu(F.linear(ln, dense["w1"], dense["b1"])), dense["w2"], dense["b2"])   # dense block
    (ref * dy).sum().backward()
    cut = slice(r * FFN // P, (r + 1) * FFN // P)                                    # fc1's rows, fc2's columns
    shard = lambda k, t: t[:, cut] if k == "w2" else t[cut] if k in ("w1", "b1") else t
    p = {k: shard(k, t.detach()).clone().requires_grad_() for k, t in dense.items()}
    for k in ("ln_w", "ln_b", "b2"):
        p[k].sequence_parallel = True                        # applied to this rank's s/tp rows: summed over TP
    mine = x.detach().chunk(P)[r].clone().requires_grad_()                           # [s/tp, b, h]
    with traffic() as fwd:
        y = mlp_block(mine, p, sequence_parallel=True)
    with traffic() as bwd:
        (y * dy.chunk(P)[r]).sum().backward()
    allreduce_sequence_parallel_grads(p.values())
    torch.testing.assert_close([y, mine.grad, *(t.grad for t in p.values())],        # fc1's dW in W.grad too
                               [ref.chunk(P)[r], x.grad.chunk(P)[r], *(shard(k, t.grad) for k, t in dense.items())])
    torch.testing.assert_close(mlp_block(mine.transpose(0, 1), p, True, sequence_dim=1), y.transpose(0, 1))  # [b, s, h]
    assert (sent(fwd), sent(bwd)) == (2 * (P - 1) * x.nbytes // P, 3 * (P - 1) * x.nbytes // P), (sent(fwd), sent(bwd))
    log(f"output, dx, every grad == the dense block (LN's, fc2 bias's after 1 all-reduce), y on [b, s/tp, h] too; sent "
        f"{sent(fwd)} B = 2(tp-1)/tp*V forward (TP's all-reduce) and {sent(bwd)} B = 3(tp-1)/tp*V backward")


def ulysses(device):
    P, r = dist.get_world_size(), dist.get_rank()
    pos = shard_positions(S, zigzag=False, device=device)                            # r*s/P .. (r+1)*s/P-1
    attn = lambda *qkv: ulysses_attention(*qkv, is_causal=True)
    _, fwd, _ = same_as_one_process(attn, lambda t: t.chunk(P)[r], pos, (NH, KV, D), device)   # contiguous shards
    kv_heads = next(h for h in range(KV, NH + 1, KV) if h % P == 0)                  # lcm(h_kv, P): heads sent
    V, V_kv = S * B * NH * D * 8, S * B * kv_heads * D * 8
    assert sent(fwd) == (P - 1) * (2 * V + 2 * V_kv) // P ** 2, sent(fwd)
    log(f"output, dq, dk, dv == SDPA (enable_gqa) on the whole sequence, RoPE at shard_positions; forward sent "
        f"{sent(fwd)} B = (P-1)/P^2 * (2V + 2V*{kv_heads}/{NH}), lcm({KV}, P) = {kv_heads} K/V heads sent")


def zigzag(device):
    P, r = dist.get_world_size(), dist.get_rank()
    pos, c = shard_positions(S, device=device), S // (2 * P)                         # my rows' global positions
    assert pos.tolist() == [*range(r * c, (r + 1) * c), *range((2 * P - 1 - r) * c, (2 * P - r) * c)]
    x = torch.randn(B, S, 3, device=device)                                         # batch-first: s is dim 1
    assert torch.equal(zigzag_shard(x, 1), x[:, pos]) and torch.equal(zigzag_unshard(zigzag_shard(x, 1), 1), x)
    pairs = torch.stack([(p + 1).sum() for p in (pos, shard_positions(S, zigzag=False, device=device))])
    zig, contiguous = gather_from_sequence_parallel_region(pairs[None]).t().tolist()   # causal pairs, every rank
    assert set(zig) == {S * (S + 1) // (2 * P)}, zig
    log(f"zig-zag: R0's rows sit at {pos[0]}..{pos[c - 1]} and {(2 * P - 1) * c}..{2 * P * c - 1}; causal pairs a "
        f"rank: {list(zig)} = s(s+1)/2P (contiguous shards: {list(contiguous)}); unshard(shard(x)) == x")


def ring(device):
    P, (h, h_kv, _), pos = dist.get_world_size(), RING, shard_positions(S, device=device)
    attn = lambda *qkv: ring_attention(*qkv, is_causal=True, fused=device.type == "cpu")   # fp64 CUDA: explicit
    (k, v), fwd, bwd = same_as_one_process(attn, lambda t: zigzag_shard(t, 0), pos, RING, device)
    kv = k.nbytes + v.nbytes                                                         # my K and V, h_kv heads
    assert (sent(fwd), sent(bwd)) == ((P - 1) * kv, (2 * P - 1) * kv * (P > 1)), (sent(fwd), sent(bwd), kv)
    log(f"{h} query heads over {h_kv} K/V heads, RoPE at shard_positions: output, dq, dk, dv == SDPA; sent (P-1) x K+V "
        f"= {sent(fwd)} B forward, + P x dK+dV = {sent(bwd)} B backward: {h_kv}/{h} of MHA's")


def main():
    if 24 % launched_world_size():
        refuse(f"world size {launched_world_size()} does not divide {NH} heads, ffn {FFN} and the sequence's "
               f"{S // 2} chunk pairs: use 1, 2, 3, 4, 6 or 8")
    device = setup()[2]
    head(f"Megatron SP: an MLP block on [s/tp, b, h], [s, b, h] = [{S}, {B}, {H}], ffn {FFN}, == the dense block")
    megatron_sp(device)
    head(f"Ulysses: q, k, v [s/P, b, h, d] all-to-all to [s, b, h/P, d]; {NH} query heads, {KV} K/V heads, RoPE")
    ulysses(device)
    head(f"zig-zag shards of a sequence of {S}: the positions a rank holds, the causal work it does")
    zigzag(device)
    head("ring attention over zig-zag shards, RoPE at their positions == SDPA on the whole sequence, float64")
    ring(device)
    finish("Megatron SP ([s, b, h], [b, s, h]) == dense; Ulysses, ring attention (GQA, RoPE) == SDPA; bytes; zig-zag")


if __name__ == "__main__":
    main()
