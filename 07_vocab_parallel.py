"""07 - vocabulary parallelism: the embedding table, the LM head and the loss, split by vocabulary rows.

The vocabulary (32k to 256k tokens) makes the input embedding and the output layer an LLM's largest matrices,
and the logits (tokens x vocabulary) its largest activation. Megatron-LM splits all three along the vocabulary
over the tensor-parallel group: rank i holds rows [i*V/W, (i+1)*V/W) of the (tied) embedding table.

  embedding   ids (every rank)  -- look up the rows held here, zero the others -->  partial (N, D)
              -- all-reduce SUM (g) -->  every rank holds the full (N, D) embeddings
              sequence_parallel: ids [s, b] -- reduce-scatter along s -->  rank i holds [s/W, b, D] of the sum
  LM head     hidden (N, D) --f--> @ W_i^T  -->  rank i holds logits[:, i*V/W : (i+1)*V/W], never all V columns
  loss        rank i reduces its slice z to 3 numbers per token, each relative to its own max m_i:
                m_i = max(z),   s_i = sum exp(z - m_i),   c_i = (1-eps)(z_t - m_i) if it holds target t, else 0,
                                                                + eps/V * sum(z - m_i)   (label smoothing eps)
              -- ONE all-gather of 3N numbers -->  every rank holds (m, s, c) of every rank, and merges them:
                M = max_i m_i,   S = sum_i s_i exp(m_i - M),
                loss = log S - sum_i c_i - (1-eps)(m_owner - M) - eps/W sum_i (m_i - M)   (the same everywhere)
              backward: softmax - one_hot on the local slice, no communication
  sampling    gather_vocab_logits: the last position's (B, V/W) -- all-gather along V -->  (B, V) on every rank

The merge is online softmax's log-sum-exp rule (as 06's ring attention merges blocks). Megatron's form (and
PyTorch's loss_parallel) issues three all-reduces instead (MAX, SUM of exp, SUM of the target logit): below. Label
smoothing is over the GLOBAL V, as in F.cross_entropy: linear in z, it rides in c_i. Besides the logits (N x V/W)
the loss keeps 14 B a token (Megatron's: its softmax, N x V/W), makes one N x V/W tensor, dlogits, works in chunks.

Bytes each rank sends (N tokens, b bytes an activation element, ring algorithms):
  embedding forward and LM-head backward (dL/dhidden): one all-reduce, 2(W-1)/W * N*D*b (sequence_parallel: a
  reduce-scatter forward and an all-gather backward, (W-1)/W * N*D*b each). The loss, fp32: one all-gather of 3N
  numbers sends (W-1) * 3N*4; Megatron's three all-reduces 3 * 2(W-1)/W * N*4; gathering the logits would send
  (W-1)/W * N*V*b. The all-gather saves 2 latencies and sends 3(W-1)(W-2)/W * N*4 bytes more: at W <= 2 it
  always wins; at W = 8, 20 us a latency and 100 GB/s, while N < 63k tokens a micro-batch. Both forms first check
  the slices, an all-gather of 2 int64 a rank (tokens, columns), (W-1)*16 B: unequal slices would give each rank
  another loss. parallel_lm_logits makes them equal: check_slices=False. Sampling: (W-1) * B*V/W*b.

    torchrun --nproc-per-node=4 07_vocab_parallel.py       (beside PyTorch's loss_parallel: bench/07_loss.py)
tests/check_07.py proves the rest: sub-groups, bf16/fp16, ignore_index, chunks, bytes held, refusals at their edges.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
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


def reduce_scatter_to_sequence_parallel_region(x, group=None, *, dim=0):
    return _ReduceScatterToSequenceParallelRegion.apply(x, dim, group)


def gather_from_tensor_model_parallel_region(x, group=None):
    return _GatherFromModelParallelRegion.apply(x, group)


# ---- building blocks: the vocabulary-parallel embedding, LM head, loss and the sampler's gather -----------------
def vocab_range(vocab_size: int, group=None):
    """Rows [start, end) of a vocabulary of `vocab_size` that this rank of `group` holds."""
    if group is not None and not isinstance(group, dist.ProcessGroup):  # nn.Embedding's 3rd argument: padding_idx
        raise ValueError(f"group={group!r}; pass a ProcessGroup (dist.new_group) or None (the world)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if vocab_size % world:
        raise ValueError(f"vocab_size={vocab_size} is not divisible by the tensor-parallel size {world}")
    return rank * (vocab_size // world), (rank + 1) * (vocab_size // world)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows split over `group`: rank i holds rows [i*V/W, (i+1)*V/W).

        ids [3, 17, 40], V=48, W=4    rank 0 (rows  0-11) -> [e3,  0,   0 ]
                                      rank 1 (rows 12-23) -> [0,  e17,  0 ]   all-reduce   [e3, e17, e40]
                                      rank 2 (rows 24-35) -> [0,   0,   0 ]   ---------->  on every rank
                                      rank 3 (rows 36-47) -> [0,   0,  e40]
    Backward: `g`'s backward is the identity; each rank's rows receive the grads of the ids it holds, locally.
    sequence_parallel=True (Megatron's reduce_scatter_embeddings): ids [s, b], the sequence first; the partial sums
    are reduce-scattered along s, rank i keeps [s/W, b, D] for a sequence-parallel layer (06); backward all-gathers.
    Ids outside [0, V) come out as zero rows (nn.Embedding raises instead). Initialised N(0, 1) like nn.Embedding
    from each rank's RNG; from_dense() copies a dense table's rows."""

    def __init__(self, num_embeddings, embedding_dim, group=None, device=None, dtype=None, *,
                 sequence_parallel=False):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel = sequence_parallel
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, group)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim,
                                               device=device, dtype=dtype))  # (V/W, D)
        nn.init.normal_(self.weight)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group=None, *, sequence_parallel=False):
        """This rank's rows of a dense nn.Embedding."""
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.scale_grad_by_freq \
                or embedding.sparse:
            raise ValueError("from_dense copies plain embeddings only "
                             "(padding_idx=None, max_norm=None, scale_grad_by_freq=False, sparse=False)")
        w = embedding.weight  # built on "meta", then allocated: no random init, so every rank's RNG stays in step
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device="meta", dtype=w.dtype,
                    sequence_parallel=sequence_parallel).to_empty(device=w.device)
        with torch.no_grad():
            layer.weight.copy_(w[layer.vocab_start:layer.vocab_end])
        return layer

    def forward(self, ids):
        if self.sequence_parallel:  # checked before any work: every rank must get an equal slice of s
            if ids.dim() == 0:
                raise ValueError("sequence_parallel takes ids [s, b] or [s], the sequence first; got one id")
            _divide("the sequence length ids.shape[0]", ids.shape[0], self.group)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # ids another rank holds
        local = (ids - self.vocab_start).masked_fill(outside, 0)      # any valid row; zeroed below
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (..., D) partial
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)  # [s/W, b, D] of the sum
        return reduce_from_tensor_model_parallel_region(out, self.group)


def parallel_lm_logits(hidden, weight_shard, group=None):
    """Column-parallel LM head with the embedding's own shard (tied weights): (..., D) -> (..., V/W). hidden is the
    same on every rank; `f` all-reduces dL/dhidden in backward: each rank's logits see it through V/W rows only."""
    return F.linear(copy_to_tensor_model_parallel_region(hidden, group), weight_shard)  # (..., D) @ (D, V/W)


def gather_vocab_logits(logits, group=None, *, check_slices=True):
    """The full (..., V) logits from this rank's (..., V/W) slice, on every rank, for a sampler (softmax, top-k over
    all V): one all-gather, (W-1) * logits.nbytes sent (hand it logits[:, -1]); backward: this rank's columns (a
    loss counted once, the same on every rank). check_slices: as vocab_parallel_cross_entropy's."""
    if check_slices:
        _check_slices(logits, group)
    return gather_from_tensor_model_parallel_region(logits, group)


def _check_slices(logits, group):
    """V; but first every rank's (tokens, columns) all-gathered (16 B; a host sync on a GPU): unequal, ValueError."""
    world, width = dist.get_world_size(group), logits.size(-1)
    if world > 1:
        mine = torch.tensor([[logits.numel() // max(width, 1), width]], device=logits.device)
        every = _gather_along_dim(mine, 0, group)                             # (W, 2)
        if not bool((every == mine).all()):
            raise ValueError(f"the ranks' logits differ: (tokens, vocabulary columns) by rank "
                             f"{[tuple(r) for r in every.tolist()]}; each must hand in the same tokens, V/W columns")
    return width * world


def _target_columns(target, per_rank, rank):
    """Where each token's target lies for this rank: (held here, its local column; any valid column elsewhere)."""
    held = (target >= rank * per_rank) & (target < (rank + 1) * per_rank)
    return held, (target - rank * per_rank).masked_fill(~held, 0)


def _chunks(x, chunk_numel):
    """Indices cutting x (..., V/W) into pieces of at most chunk_numel elements (at least one row of V/W): slices of
    dim 0, or, where one of its rows is larger, of dim 1 within each row of dim 0, and so on. None: one piece."""
    import itertools
    if chunk_numel is None or x.numel() <= chunk_numel:
        return [(...,)]
    d, per = 0, x.numel() // x.shape[0]                   # elements in one row of dim d
    while per > chunk_numel and d < x.dim() - 2:
        d, per = d + 1, per // x.shape[d + 1]
    rows = max(1, chunk_numel // per)
    return [(*outer, slice(i, i + rows)) for outer in itertools.product(*map(range, x.shape[:d]))
            for i in range(0, x.shape[d], rows)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: one all-gather of 3 numbers per token, merged by log-sum-exp; backward: local, no communication."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, group, chunk_numel):
        eps, world, rank = label_smoothing, dist.get_world_size(group), dist.get_rank(group)
        per_rank, dtype = logits.size(-1), torch.promote_types(logits.dtype, torch.float32)  # fp32 inside
        valid = target != ignore_index                                     # the others: loss 0 and grad 0, below
        held, local_target = _target_columns(target, per_rank, rank)
        owner = target.masked_fill(~valid, 0).div(per_rank, rounding_mode="floor")  # the rank holding the target
        # this rank's 3 numbers per token, each relative to its own max m_i (no exp overflows)
        m = logits.amax(dim=-1).to(dtype)                                  # (...,) max is exact in any dtype
        c = (1 - eps) * (logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).to(dtype) - m)
        c = c.masked_fill(~held, 0.0)                                      # z_t - m_i where t is held here
        s = torch.empty_like(m)                                            # sum of exp(z - m_i) over the slice
        chunks = _chunks(logits, chunk_numel)                              # a few rows at a time: the input is
        work = logits.new_empty(logits[chunks[0]].shape, dtype=dtype)      # never copied whole
        for i in chunks:
            shifted = torch.sub(logits[i], m[i].unsqueeze(-1), out=work[:len(logits[i])])
            if eps:  # + eps/V * (sum of the slice's z - m_i): linear, so it rides in c
                c[i] += (eps / (per_rank * world)) * shifted.sum(dim=-1)
            torch.sum(shifted.exp_(), dim=-1, out=s[i])
        del work, shifted
        m_all, s_all, c_all = _gather_along_dim(torch.stack([m, s, c]), 0, group).view(world, 3, *m.shape).unbind(1)
        # the log-sum-exp merge. loss = logsumexp(z) - (1-eps) z_target - eps/V sum(z); write each z as
        # (z - m_i) + (m_i - M) + M: the M's cancel, the (z - m_i) are in s and c, the (m_i - M) are below
        rel = m_all - m_all.amax(dim=0)                                    # (W, ...) m_i - M <= 0
        log_s = (s_all * rel.exp()).sum(dim=0).log()                       # log sum over all V of exp(z - M)
        loss = (log_s - c_all.sum(dim=0) - (1 - eps) * rel.gather(0, owner.unsqueeze(0)).squeeze(0)
                - (eps / world) * rel.sum(dim=0))
        # backward recomputes softmax = exp(z - lse) from the logits: no (..., V/W) tensor is kept
        ctx.save_for_backward(logits, m + log_s - rel[rank], held, local_target, valid)  # lse = M + log S
        ctx.label_smoothing, ctx.vocab, ctx.chunk_numel = eps, per_rank * world, chunk_numel
        return loss.masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        (logits, lse, held, local_target, valid), eps = ctx.saved_tensors, ctx.label_smoothing
        # dloss/dz = (softmax - (1 - eps) * one_hot - eps / V) * grad_loss, on this rank's V/W columns only
        scale = torch.where(valid, grad_loss, 0.0).to(lse.dtype)     # where: 0 even for an inf grad (mean of none)
        hit = (-(1.0 - eps) * held.to(lse.dtype)).unsqueeze(-1)       # the one_hot's term, where t is held here
        grad = torch.empty_like(logits)  # the one (..., V/W) tensor, laid out as the logits are (a view's too)
        chunks = _chunks(logits, ctx.chunk_numel)
        work = None if grad.dtype == lse.dtype else grad.new_empty(grad[chunks[0]].shape, dtype=lse.dtype)
        for i in chunks:  # fp32 math into grad's rows (or a work buffer, then rounded once into them)
            g = grad[i] if work is None else work[:len(grad[i])]
            torch.sub(logits[i], lse[i].unsqueeze(-1), out=g).exp_().sub_(eps / ctx.vocab)
            g.scatter_add_(-1, local_target[i].unsqueeze(-1), hit[i]).mul_(scale[i].unsqueeze(-1))
            if work is not None:
                grad[i] = g
        return grad, None, None, None, None, None


def _check_loss_args(logits, target, label_smoothing, reduction, ignore_index, group, check_slices):
    """Checked before any work, on every rank: alone, then the slices (check_slices), then the targets against V."""
    if target.shape != logits.shape[:-1] or target.dtype != torch.int64:
        raise ValueError(f"target must hold int64 class indices of shape {tuple(logits.shape[:-1])} (the logits' "
                         f"shape without the vocab dimension); got {target.dtype} {tuple(target.shape)}")
    if label_smoothing is True or not isinstance(label_smoothing, (int, float)) or not 0 <= label_smoothing <= 1:
        raise ValueError(f"label_smoothing={label_smoothing!r} must be a float in [0, 1]")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction={reduction!r}; use 'none', 'mean' or 'sum'")
    vocab = _check_slices(logits, group) if check_slices else logits.size(-1) * dist.get_world_size(group)
    bad = (target < 0) | (target >= vocab)
    if ignore_index is not None:
        bad &= target != ignore_index
    if bad.any():  # one small local reduction (a host sync on a GPU); F.cross_entropy asserts in its kernel
        where = bad.nonzero()[0].tolist()
        also = "" if ignore_index is None else f" or ignore_index={ignore_index}"
        raise ValueError(f"target{where or ''}={target[tuple(where)].item()} is not a class of the vocabulary: "
                         f"classes lie in [0, {vocab}){also}")


def _reduce_loss(loss, valid, reduction, dtype):
    """The per-token loss (fp32) as F.cross_entropy reduces it, in `dtype`: "mean" over the tokens not ignored."""
    if reduction == "mean":
        loss = loss.sum() / valid.sum()  # nan when every token is ignored, as F.cross_entropy
    elif reduction == "sum":
        loss = loss.sum()
    return loss.to(dtype)


def vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, group=None, ignore_index=-100,
                                 reduction="mean", *, chunk_numel="auto", check_slices=True):
    """F.cross_entropy(full_logits, target, label_smoothing=..., ignore_index=..., reduction=...) from this
    rank's (..., V/W) slice of the full logits, with one all-gather of 3 numbers per token and nothing in
    backward. target (...) holds classes in [0, V) or ignore_index (loss 0, gradient 0), else ValueError;
    reduction "mean" (the default, as F.cross_entropy's) averages over the tokens not ignored, "sum" adds, "none"
    gives the per-token loss (Megatron's). Computed in fp32 at least; the loss and the gradient come in the
    logits' dtype. Every rank of `group` returns the same loss; the caller's logits are never modified.
    check_slices: first refuse unequal slices on every rank (16 B a rank; False: equal by construction).
    Memory: besides the logits, dlogits in backward and a work buffer (fp32) of at most chunk_numel elements, the
    rows it takes at a time (None: all). "auto": 2**20 on the CPU, where a fresh large buffer costs more than
    the math; an eighth of the rows elsewhere, where each chunk costs kernel launches."""
    per_rank = logits.size(-1)
    if not isinstance(ignore_index, int):  # checked alone on every rank before any work, as label_smoothing
        raise ValueError(f"ignore_index={ignore_index!r}; pass an int, the target value to skip (-100 by default)")
    if not (chunk_numel in ("auto", None) or isinstance(chunk_numel, int) and chunk_numel > 0) or chunk_numel is True:
        raise ValueError(f"chunk_numel={chunk_numel!r}; pass 'auto', None (all rows at once) or an int >= 1")
    _check_loss_args(logits, target, label_smoothing, reduction, ignore_index, group, check_slices)
    if logits.dim() == 1:  # one token, unbatched, as F.cross_entropy takes it
        return vocab_parallel_cross_entropy(logits[None], target[None], label_smoothing, group, ignore_index,
                                            reduction, chunk_numel=chunk_numel, check_slices=False).squeeze(0)
    if chunk_numel == "auto":
        chunk_numel = 2 ** 20 if logits.device.type == "cpu" else -(-logits.numel() // (8 * per_rank)) * per_rank
    loss = _VocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), ignore_index, group, chunk_numel)
    return _reduce_loss(loss, target != ignore_index, reduction, logits.dtype)


class _MegatronVocabParallelCrossEntropy(torch.autograd.Function):
    """forward: three all-reduces of one number per token (MAX, SUM, SUM); backward: local, no communication."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        eps, per_rank, vocab = label_smoothing, logits.size(-1), logits.size(-1) * dist.get_world_size(group)
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        m = z.amax(dim=-1)                                                 # (...,) global max: exp never overflows
        if dist.get_world_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = z - m.unsqueeze(-1)                                      # (..., V/W) new: the input stays as is
        exp = shifted.exp()
        sum_exp = _reduce(exp.sum(dim=-1), group)                          # (...,) S over all V columns
        held, local_target = _target_columns(target, per_rank, dist.get_rank(group))
        target_term = (1.0 - eps) * shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~held, 0)
        if eps:  # + eps/V * sum of all V logits: linear, so it shares the third all-reduce
            target_term = target_term + (eps / vocab) * shifted.sum(dim=-1)
        target_term = _reduce(target_term, group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))                          # (..., V/W), reusing exp's buffer
        ctx.save_for_backward(softmax, held, local_target)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = eps, vocab, logits.dtype
        return sum_exp.log() - target_term

    @staticmethod
    def backward(ctx, grad_loss):
        (softmax, held, local_target), eps = ctx.saved_tensors, ctx.label_smoothing
        grad = softmax - eps / ctx.vocab
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-(1.0 - eps) * held.to(grad.dtype)).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None, None


def megatron_vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, group=None, reduction="mean", *,
                                          check_slices=True):
    """The same loss in Megatron-LM's form, three all-reduces of N numbers; targets in [0, V) (no ignore_index).
    Otherwise as vocab_parallel_cross_entropy."""
    _check_loss_args(logits, target, label_smoothing, reduction, None, group, check_slices)
    loss = _MegatronVocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), group)
    return _reduce_loss(loss, torch.ones_like(target, dtype=torch.bool), reduction, logits.dtype)


# ---- demo: each claim against one process (needs common.py; the blocks above need only torch) -----------------
def main():
    from common import finish, head, launched_world_size, log, log_all, refuse, setup, traffic
    V, D, B, T = 48, 8, 2, 24                          # V and the sequence split over 1, 2, 3, 4, 6 and 8 ranks
    N, close = B * T, torch.testing.assert_close
    if launched_world_size() not in (1, 2, 3, 4, 6, 8):
        refuse(f"a vocabulary of {V} rows splits over 1, 2, 3, 4, 6 or 8 ranks, not {launched_world_size()}")
    rank, world, device = setup()
    f64, ranks, many = dict(device=device, dtype=torch.float64), tuple(range(world)), world > 1
    lo, hi = vocab_range(V)                            # this rank's rows of the table, its columns of the logits
    ids = torch.randint(0, V, (B, T), device=device)   # one seed: the same ids on every rank
    dense, grad = nn.Embedding(V, D, **f64), torch.randn(B, T, D, **f64)

    head("1. VocabParallelEmbedding: each rank looks up the rows it holds, one all-reduce sums them")
    for sp in (False, True):                           # sequence_parallel: ids [s, b], a reduce-scatter along s
        layer, dense.weight.grad = VocabParallelEmbedding.from_dense(dense, sequence_parallel=sp), None
        x, dy = (ids.t(), grad.transpose(0, 1)) if sp else (ids, grad)  # Megatron's [s, b]: transposed views
        mine = slice(rank * T // world, (rank + 1) * T // world) if sp else slice(None)  # this rank's rows of s
        (ref := dense(x)).backward(dy)
        with traffic() as fwd:
            out = layer(x)
        with traffic() as bwd:
            out.backward(dy[mine])
        assert torch.equal(out, ref[mine]) and torch.equal(layer.weight.grad, dense.weight.grad[lo:hi])  # exact
        want = ([("reduce_scatter", ranks, N * D * 8)], [("all_gather", ranks, N * D * 8 // world)]) if sp else \
            ([("all_reduce", ranks, N * D * 8)], [])
        assert (fwd.calls, bwd.calls) == tuple(calls * many for calls in want)
    log_all(f"rows [{lo}, {hi}): looks up {int(((ids >= lo) & (ids < hi)).sum())} of the {N} ids, zeros for the "
            f"rest; the sum == nn.Embedding's output and row grads exactly (SP: its [s/W, b, D] of it)")

    head("2. cross-entropy from the slices: one all-gather of 3 numbers a token (Megatron's form: 3 all-reduces)")
    z, target = torch.randn(B, T, V, **f64) * 3, torch.randint(0, V, (B, T), device=device)
    full = z.clone().requires_grad_()
    ref = F.cross_entropy(full.view(N, V), target.view(N), label_smoothing=0.1)
    ref.backward()
    for fn, want in ((vocab_parallel_cross_entropy, [("all_gather", ranks, 3 * N * 8)]),
                     (megatron_vocab_parallel_cross_entropy, [("all_reduce", ranks, N * 8)] * 3)):
        mine = z[..., lo:hi].clone().requires_grad_()  # this rank's columns of the logits
        with traffic() as fwd:
            loss = fn(mine, target, label_smoothing=0.1)
        with traffic() as bwd:
            loss.backward()
        close((loss, mine.grad), (ref, full.grad[..., lo:hi]))
        assert bwd.calls == [] and fwd.calls == ([("all_gather", ranks, 16)] + want) * many  # the check, the loss
    log(f"loss and dlogits == F.cross_entropy's (label_smoothing 0.1), both forms; forward: the 16-B slice check, "
        f"then 1 all-gather of 3N={3 * N} numbers (Megatron's: 3 all-reduces of N); backward: nothing")

    head("3. a tied LM head: embed, a layer, logits from the embedding's own shard, the loss == the dense model's")
    dense.weight.grad, layer = None, VocabParallelEmbedding.from_dense(dense)
    mix = (torch.randn(D, D, **f64) / D ** 0.5).requires_grad_()  # a replicated stand-in for the layers
    target = target.masked_fill(torch.rand(B, T, device=device) < 0.2, -1)  # nanoGPT's ignore_index=-1
    dense_logits = torch.tanh(dense(ids) @ mix) @ dense.weight.T  # (B, T, V)
    dense_loss = F.cross_entropy(dense_logits.view(N, V), target.view(N), ignore_index=-1)
    dense_loss.backward()
    dense_mix_grad, mix.grad = mix.grad, None
    logits = parallel_lm_logits(torch.tanh(layer(ids) @ mix), layer.weight)  # (B, T, V/W): this rank's columns
    loss = vocab_parallel_cross_entropy(logits, target, ignore_index=-1, check_slices=False)  # equal by making
    loss.backward()
    close((loss, layer.weight.grad, mix.grad), (dense_loss, dense.weight.grad[lo:hi], dense_mix_grad))  # tied: both
    assert logits.nbytes * world == dense_logits.nbytes
    log(f"loss, the tied shard's grad (embedding + head) and the layer's grad == dense; the logits: {logits.nbytes} "
        f"B a rank, 1/{world} of {dense_logits.nbytes}")

    head("4. sampling: gather_vocab_logits hands every rank the last position's logits over all V")
    piece, ref = (t.detach()[:, -1].clone().requires_grad_() for t in (logits, dense_logits))  # (B, V/W), (B, V)
    with traffic() as fwd:
        last = gather_vocab_logits(piece)                     # (B, V) on every rank
    token, want = (torch.multinomial(F.softmax(t, -1), 1, generator=torch.Generator(device).manual_seed(1))
                   for t in (last, ref))
    dist.all_gather_object(every := [None] * world, token.tolist())
    F.cross_entropy(ref, token.view(-1)).backward()
    F.cross_entropy(last, token.view(-1)).backward()          # a loss counted once: each rank keeps its columns
    close((last, piece.grad), (ref, ref.grad[:, lo:hi]))
    assert torch.equal(token, want) and all(t == every[0] for t in every), (token, want, every)
    assert fwd.calls == [("all_gather", ranks, 16), ("all_gather", ranks, B * (V // world) * 8)] * many
    log(f"(B, V/W) -> (B, V) == the dense logits; every rank draws the same next tokens {token.view(-1).tolist()} "
        f"as the dense model; backward keeps each rank's columns")
    finish("vocab-parallel embedding (sequence-parallel too), tied LM head, cross-entropy in one all-gather and the "
           "sampler's gather equal the dense model, forward and backward")


if __name__ == "__main__":
    main()
