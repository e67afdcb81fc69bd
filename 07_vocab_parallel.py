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

The merge is online softmax's log-sum-exp rule (06's ring attention merges blocks the same way). Megatron's form
(and PyTorch's loss_parallel) issues three all-reduces instead (MAX, SUM of exp, SUM of the target logit); it
stays below as megatron_vocab_parallel_cross_entropy. Label smoothing is over the GLOBAL V, as in F.cross_entropy:
eps * mean(z) over all V logits is linear, so it rides in c_i (averaging over V/W: NVIDIA/Megatron-LM#737).
Memory, besides the logits (N x V/W): the loss keeps 14 bytes a token for backward (Megatron's keeps its
softmax, N x V/W), works through a few rows at a time, and makes one N x V/W tensor, dlogits, in backward.

Bytes each rank sends (N tokens, b bytes an activation element, ring algorithms):
  embedding forward and LM-head backward (dL/dhidden): one all-reduce, 2(W-1)/W * N*D*b (sequence_parallel: a
  reduce-scatter forward and an all-gather backward, (W-1)/W * N*D*b each). The loss, fp32: one all-gather of 3N
  numbers sends (W-1) * 3N*4; Megatron's three all-reduces 3 * 2(W-1)/W * N*4; gathering the logits would send
  (W-1)/W * N*V*b. The all-gather saves 2 latencies and sends 3(W-1)(W-2)/W * N*4 bytes more: at W <= 2 it
  always wins; at W = 8, 20 us a latency and 100 GB/s, while N < 63k tokens a micro-batch.

    torchrun --nproc-per-node=4 07_vocab_parallel.py       (BENCH=1: beside PyTorch's loss_parallel)
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


# Megatron's public names. The sequence-parallel regions cut dim 0, the sequence of Megatron's [s, b, h]; a
# batch-first [b, s, h] caller passes dim=1. f and g act on the whole tensor.
def copy_to_tensor_model_parallel_region(x, group=None):
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    return _ReduceFromModelParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None, *, dim=0):
    return _ReduceScatterToSequenceParallelRegion.apply(x, dim, group)


# ---- building blocks: the vocabulary-parallel embedding, LM head and loss ---------------------------------------
def vocab_range(vocab_size: int, group=None):
    """Rows [start, end) of a vocabulary of `vocab_size` that this rank of `group` holds."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if vocab_size % world:
        raise ValueError(f"vocab_size={vocab_size} is not divisible by the tensor-parallel size {world}")
    per_rank = vocab_size // world
    return rank * per_rank, (rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows split over `group`: rank i holds rows [i*V/W, (i+1)*V/W).

        ids [3, 17, 40], V=48, W=4    rank 0 (rows  0-11) -> [e3,  0,   0 ]
                                      rank 1 (rows 12-23) -> [0,  e17,  0 ]   all-reduce   [e3, e17, e40]
                                      rank 2 (rows 24-35) -> [0,   0,   0 ]   ---------->  on every rank
                                      rank 3 (rows 36-47) -> [0,   0,  e40]
    Backward: `g`'s backward is the identity; each rank's rows receive the grads of the ids it holds, locally.
    sequence_parallel=True (Megatron's reduce_scatter_embeddings): ids are [s, b], the sequence first, and the
    partial [s, b, D] is reduce-scattered along s instead: rank i gets rows [i*s/W, (i+1)*s/W) of the sum, the
    [s/W, b, D] slice a sequence-parallel layer takes (06); backward all-gathers dL/dout along s.
    Ids outside [0, V) come out as zero rows (nn.Embedding raises instead).
    Initialised N(0, 1) like nn.Embedding from each rank's RNG; use from_dense() to match a dense table.
    """

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
                    sequence_parallel=sequence_parallel)
        layer = layer.to_empty(device=w.device)
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
    """Column-parallel LM head with the embedding's own shard (tied weights): (..., D) -> (..., V/W).

    hidden is the same on every rank; `f` all-reduces dL/dhidden in backward, because each rank's logits
    see hidden through its own V/W rows only.
    """
    return F.linear(copy_to_tensor_model_parallel_region(hidden, group), weight_shard)  # (..., D) @ (D, V/W)


def _target_columns(target, per_rank, rank):
    """Where each token's target lies for this rank: (held here, its local column; any valid column elsewhere)."""
    start = rank * per_rank
    held = (target >= start) & (target < start + per_rank)
    return held, (target - start).masked_fill(~held, 0)


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
        logits, lse, held, local_target, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
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


def _check_loss_args(logits, target, label_smoothing, reduction, vocab, ignore_index):
    """Arguments checked before any work, on every rank and without communication: target is the same on every
    rank, so each finds the same bad value alone."""
    if target.shape != logits.shape[:-1] or target.is_floating_point():
        raise ValueError(f"target must hold class indices of shape {tuple(logits.shape[:-1])} (the logits' shape "
                         f"without the vocab dimension); got {target.dtype} {tuple(target.shape)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 1]")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"reduction={reduction!r}; use 'none', 'mean' or 'sum'")
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
                                 reduction="mean", *, chunk_numel="auto"):
    """F.cross_entropy(full_logits, target, label_smoothing=..., ignore_index=..., reduction=...) from this
    rank's (..., V/W) slice of the full logits, with one all-gather of 3 numbers per token and nothing in
    backward. target (...) holds classes in [0, V) or ignore_index (loss 0, gradient 0), else ValueError;
    reduction "mean" (the default, as F.cross_entropy's) averages over the tokens not ignored, "sum" adds, "none"
    gives the per-token loss (Megatron's). Computed in fp32 at least; the loss and the gradient come in the
    logits' dtype. Every rank of `group` returns the same loss; the caller's logits are never modified.
    Memory: besides the logits, dlogits in backward and a work buffer (fp32) of at most chunk_numel elements, the
    rows it takes at a time (None: all). "auto": 2**20 on the CPU, where a fresh large buffer costs more than
    the math; an eighth of the rows elsewhere, where each chunk costs kernel launches."""
    per_rank = logits.size(-1)
    _check_loss_args(logits, target, label_smoothing, reduction, per_rank * dist.get_world_size(group), ignore_index)
    if logits.dim() == 1:  # one token, unbatched, as F.cross_entropy takes it
        return vocab_parallel_cross_entropy(logits.unsqueeze(0), target.unsqueeze(0), label_smoothing, group,
                                            ignore_index, reduction, chunk_numel=chunk_numel).squeeze(0)
    if chunk_numel == "auto":
        chunk_numel = 2 ** 20 if logits.device.type == "cpu" else -(-logits.numel() // (8 * per_rank)) * per_rank
    loss = _VocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), ignore_index, group, chunk_numel)
    return _reduce_loss(loss, target != ignore_index, reduction, logits.dtype)


class _MegatronVocabParallelCrossEntropy(torch.autograd.Function):
    """forward: three all-reduces of one number per token (MAX, SUM, SUM); backward: local, no communication."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        eps, per_rank = label_smoothing, logits.size(-1)
        vocab = per_rank * dist.get_world_size(group)
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        m = z.amax(dim=-1)                                                 # (...,) global max: exp never overflows
        if dist.get_world_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = z - m.unsqueeze(-1)                                      # (..., V/W) new: the input stays as is
        exp = shifted.exp()
        sum_exp = _reduce(exp.sum(dim=-1), group)                          # (...,) S over all V columns
        held, local_target = _target_columns(target, per_rank, dist.get_rank(group))
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~held, 0.0)
        target_term = (1.0 - eps) * picked                                 # z_target - M on its rank, else 0
        if eps:  # + eps/V * sum of all V logits: linear, so it shares the third all-reduce
            target_term = target_term + (eps / vocab) * shifted.sum(dim=-1)
        target_term = _reduce(target_term, group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))                          # (..., V/W), reusing exp's buffer
        ctx.save_for_backward(softmax, held, local_target)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = eps, vocab, logits.dtype
        return sum_exp.log() - target_term

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, held, local_target = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax - eps / ctx.vocab
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-(1.0 - eps) * held.to(grad.dtype)).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None, None


def megatron_vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0, group=None, reduction="mean"):
    """The same loss in Megatron-LM's form, three all-reduces of N numbers; targets in [0, V) (no ignore_index).
    Otherwise as vocab_parallel_cross_entropy."""
    _check_loss_args(logits, target, label_smoothing, reduction, logits.size(-1) * dist.get_world_size(group), None)
    loss = _MegatronVocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), group)
    return _reduce_loss(loss, torch.ones_like(target, dtype=torch.bool), reduction, logits.dtype)


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
try:
    from common import (finish, head, launched_world_size, log, log_all, memory, refuse, refused, setup,
                        strided_groups, traffic)
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass
import os
import time
import types

V, D, B, T = 384, 16, 2, 12  # V/W rows per rank > 3W numbers per token gathered, for W up to 8; N = B*T
N = B * T
WORLDS = (1, 2, 3, 4, 6, 8)  # V splits evenly over W and W/2; N-1 tokens hold every rank's first and last row
TOL = {torch.float64: {}, torch.bfloat16: dict(rtol=2 ** -8, atol=1e-6), torch.float16: dict(rtol=2 ** -10, atol=1e-6)}
# bf16/fp16 against float64: fp32 inside, then one rounding to 8 (bf16) or 11 (fp16) bits, at most half of rtol


def tokens(device, world):
    """(B, T) ids: 0, V-1 and every rank's first and last row (for W ranks and for W/2), one repeated, then a
    fixed pattern; shuffled alike on every rank."""
    rows = sorted({row for w in {world, (world + 1) // 2, max(world // 2, 1)} for r in range(w)
                   for row in (r * V // w, (r + 1) * V // w - 1)})
    rows += rows[:1] + [(13 * i + 5) % V for i in range(N - len(rows) - 1)]
    return torch.tensor(rows, device=device)[torch.randperm(N, device=device)].view(B, T)


def ranks_of(group):
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def same_on_every_rank(t, group=None):
    w = dist.get_world_size(group)
    gathered = torch.empty(w * t.numel(), dtype=torch.float64, device=t.device)
    all_gather_single(gathered, t.detach().reshape(-1).to(torch.float64), group=group)
    return all(g.isclose(gathered[:t.numel()], rtol=0, atol=0, equal_nan=True).all() for g in gathered.split(t.numel()))


def largest_tensor():
    """A dispatch mode remembering the element count of the largest tensor any op makes inside it (those
    autograd runs in backward too): what "no rank ever holds N x V numbers" means, checked."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.numel = max([self.numel] + [t.numel() for t in outs if isinstance(t, torch.Tensor)])
            return out

    return Largest()


def check_embedding(group, device, sequence_parallel=False):
    """VocabParallelEmbedding on `group` against nn.Embedding (exact): output, weight grad, traffic. ids [s, b] are
    a non-contiguous view; sequence_parallel: s = N (every group size divides it), rank r gets rows r*s/W.. of s."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    dense = nn.Embedding(V, D, device=device, dtype=torch.float64)
    ids = tokens(device, dist.get_world_size())
    ids = torch.stack([ids.view(-1), ids.view(-1).flip(0)]).t() if sequence_parallel else ids.t()  # (s, b)
    s, b = ids.shape
    layer = VocabParallelEmbedding.from_dense(dense, group, sequence_parallel=sequence_parallel)
    lo, hi = layer.vocab_start, layer.vocab_end
    assert (lo, hi) == (r * V // w, (r + 1) * V // w) and torch.equal(layer.weight, dense.weight[lo:hi])
    grad_out = torch.randn(s, b, D, device=device, dtype=torch.float64)
    ref = dense(ids)
    ref.backward(grad_out)
    mine = slice(r * s // w, (r + 1) * s // w) if sequence_parallel else slice(None)  # this rank's rows of s
    with traffic() as fwd:
        out = layer(ids)                                             # (s, b, D), or (s/W, b, D) under SP
    with traffic() as bwd:
        out.backward(grad_out[mine])
    assert torch.equal(out, ref[mine]), "one nonzero term per token: the sum is exact"
    assert torch.equal(layer.weight.grad, dense.weight.grad[lo:hi])
    many, full = w > 1, s * b * D * 8
    if sequence_parallel:
        assert fwd.calls == [("reduce_scatter", ranks_of(group), full)] * many
        assert bwd.calls == [("all_gather", ranks_of(group), full // w)] * many
    else:
        assert fwd.calls == [("all_reduce", ranks_of(group), full)] * many and bwd.calls == []
    return lo, hi, int(((ids >= lo) & (ids < hi)).sum())


def check_regions(group, device):
    """g and f on rank-dependent values handed over as transposed views: g's forward sums every rank's x; f's
    backward sums every rank's grad (which reaches it non-contiguous)."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    x = torch.randn(D, N, device=device, dtype=torch.float64)       # the same on every rank
    y = reduce_from_tensor_model_parallel_region(x.t() * (r + 1), group)  # (N, D), not contiguous
    torch.testing.assert_close(y, x.t() * (w * (w + 1) / 2))          # sum over ranks of (r + 1) * x
    mine = x * (r + 1)
    reduce_from_tensor_model_parallel_region(mine, group)             # contiguous: all-reduced in a copy
    assert torch.equal(mine, x * (r + 1)), "g modified the caller's tensor"
    leaf = x.clone().requires_grad_()
    copy_to_tensor_model_parallel_region(leaf, group).t().backward((x.t() * (r + 1)).contiguous())
    torch.testing.assert_close(leaf.grad, x * (w * (w + 1) / 2))


def check_loss(loss_fn, z, target, group=None, chunk_numel="auto", keeps=None, **options):
    """loss_fn on this rank's slice of z (B, T, V), handed over in Megatron's [s, b] order as a non-contiguous
    (T, B, V/W) view, against F.cross_entropy on all of z in float64: the loss and dlogits under a non-uniform
    upstream grad, in z's dtype within TOL. Also: every rank's loss is the same, the input is untouched, no
    tensor exceeds N x V/W elements. Returns the loss, the forward's traffic and the bytes it held (common.memory): its
    forward's peak, what it kept for backward (the loss aside; `keeps`: what it should keep) and its backward's peak."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    lo, hi = r * V // w, (r + 1) * V // w
    full = z.detach().double().requires_grad_()
    ref = F.cross_entropy(full.view(N, V), target.view(N), **options)
    ref = ref.view(B, T) if ref.dim() else ref
    upstream = torch.randint(1, 9, ref.shape, device=z.device) / 8   # exact in every dtype
    (ref * upstream).sum().backward()
    leaf = z[..., lo:hi].contiguous().requires_grad_()               # (B, T, V/W): its grad lands here
    logits = leaf.transpose(0, 1)                                      # (T, B, V/W), not contiguous
    before, version = leaf.detach().clone(), leaf._version
    if loss_fn is vocab_parallel_cross_entropy:
        options = dict(options, chunk_numel=chunk_numel)
    with largest_tensor() as big, memory() as mem:
        with traffic() as fwd:
            loss = loss_fn(logits, target.t(), group=group, **options)
        held = types.SimpleNamespace(forward=mem.peak, kept=mem.live() - loss.nbytes)  # the loss aside
        deadline = time.monotonic() + 5  # gloo's worker thread may hold a message's buffers a moment after its wait
        while keeps is not None and held.kept != keeps and time.monotonic() < deadline:
            time.sleep(0.001)
            held.kept = mem.live() - loss.nbytes
        mem.reset()
        with traffic() as bwd:
            (loss * upstream.t().to(loss.dtype)).sum().backward()
        held.backward = mem.peak
    loss = loss.t()                                                    # (B, T) as the reference (or a scalar)
    assert loss.dtype == leaf.grad.dtype == z.dtype
    torch.testing.assert_close(loss.double(), ref, equal_nan=True, **TOL[z.dtype])
    torch.testing.assert_close(leaf.grad.double(), full.grad[..., lo:hi], **TOL[z.dtype])
    assert torch.equal(leaf, before) and leaf._version == version, "the input logits were modified"
    assert big.numel == N * V // w, f"a tensor of {big.numel} elements: larger than the local N x V/W slice"
    assert same_on_every_rank(loss, group) and bwd.calls == []
    return loss, fwd, held


def loss_calls(group, itemsize, megatron=False):
    """What the loss hands to c10d: 3 all-reduces of N numbers, or 1 all-gather of 3N; none on one rank."""
    if dist.get_world_size(group) == 1:
        return []
    return [("all_reduce", ranks_of(group), N * itemsize)] * 3 if megatron else \
        [("all_gather", ranks_of(group), 3 * N * itemsize)]


def section_embedding(rank, world, device):
    head("1. VocabParallelEmbedding: each rank looks up the rows it holds, one all-reduce sums them")
    lo, hi, held = check_embedding(None, device)
    log_all(f"holds rows [{lo}, {hi}): looks up {held} of the {N} ids; its other {N - held} outputs are zeros")
    log(f"output and weight-grad shards equal nn.Embedding's exactly; 1 all-reduce of N*D={N * D} forward, 0 backward")
    check_embedding(None, device, sequence_parallel=True)
    s, b = N, 2
    log(f"sequence_parallel, ids [s={s}, b={b}]: rank r gets rows [r*s/W, (r+1)*s/W) of the sum, exactly as dense")
    log(f"  1 reduce-scatter of s*b*D={s * b * D} forward (half an all-reduce's bytes), 1 all-gather of "
        f"s/W*b*D={s * b * D // world} backward")
    sp = VocabParallelEmbedding(V, D, device=device, sequence_parallel=True)
    padded = nn.Embedding(V, D, padding_idx=0, device="meta")
    for why, bad in (("V+1 rows", lambda: VocabParallelEmbedding(V + 1, D)),
                     ("s=W+1", lambda: sp(torch.zeros(world + 1, 2, dtype=torch.long, device=device))),
                     ("one id under SP", lambda: sp(torch.tensor(3, device=device))),
                     ("padding_idx", lambda: VocabParallelEmbedding.from_dense(padded)))[2 * (world == 1):]:
        log(f"refused: {refused(bad)}")                               # before any work


def section_loss(rank, world, device):
    head("2. Cross-entropy in one all-gather, and Megatron's three all-reduces, against F.cross_entropy")
    logits = torch.randn(B, T, V, device=device, dtype=torch.float64) * 3
    target = tokens(device, world)                                   # every rank's first and last row
    row = V // world                                                 # a row of this rank's (T, B, V/W) logits
    shape = torch.empty(T, B, row, device="meta")
    assert _chunks(shape, 5 * B * row) == [(slice(i, i + 5),) for i in (0, 5, 10)]      # 5, 5 and 2 of T's rows
    assert _chunks(shape, row) == [(t, slice(b, b + 1)) for t in range(T) for b in range(B)]  # one row of V/W
    assert _chunks(shape, None) == _chunks(shape, N * row) == [(...,)]                 # all at once
    for eps, scale, chunk, work in ((0.0, 1.0, 5 * B * row, 5 * B * row), (0.0, 1000.0, None, N * row),
                                    (0.1, 1.0, row, row), (0.1, 1000.0, 7 * B * row, 7 * B * row)):
        z = logits * scale                                           # x1000: exp(z) overflows past z = 709
        for megatron in (False, True):                               # forward's pieces: 5 (or 7) of T's rows,
            fn = megatron_vocab_parallel_cross_entropy if megatron else vocab_parallel_cross_entropy  # all, or 1 x 1
            _, fwd, held = check_loss(fn, z, target, chunk_numel=chunk, label_smoothing=eps, reduction="none",
                                      keeps=None if megatron else loss_bytes(z.dtype, world, work)["kept"])
            assert fwd.calls == loss_calls(None, 8, megatron)
            assert_held(held, torch.float64, world, work, megatron)
        log(f"eps={eps} logits x{scale:<6g}(|z| <= {z.abs().max():.0f}): both forms' loss and dlogits equal "
            f"F.cross_entropy")
    b = 8  # float64 here
    log(f"forward: 1 all-gather of 3 numbers per token (Megatron: 3 all-reduces of 1); backward: nothing, both")
    log(f"N={N}, b={b}: both hand in 3N*b = {3 * N * b} B; the all-gather sends (W-1)*3N*b = "
        f"{(world - 1) * 3 * N * b} B, all-reduces 6(W-1)/W*N*b = {6 * (world - 1) * N * b // world} B")
    log(f"same loss on every rank, input untouched; the largest tensor any op made: N x V/W = {N * V // world} "
        f"elements (the full logits: {N * V})")
    a = N * V // world * b
    log(f"bytes held besides the logits (slice A = N x V/W = {a} B; the full logits {N * V * b} B): ours peaks at "
        f"A{held_by['ours'] - a:+d} B")
    log(f"  (dlogits), keeps {N * (b + 10)} B = {b + 10} B a token for backward; Megatron's peaks at "
        f"2A{held_by['megatron'] - 2 * a:+d} B and keeps A (its softmax)")


held_by = {}  # the last peak each form held, for the log


def loss_bytes(dtype, world, work, reduction="none"):
    """Closed forms, in bytes, of what vocab_parallel_cross_entropy holds on (T, B, V/W) logits of `dtype` besides
    them, taking `work` elements at a time: one slice A = N x V/W in the compute dtype (fp32 at least); forward's
    work buffer, then the merge: the 3N x W numbers gathered and three (W, N) temporaries, either one beside the
    per-token numbers (m, s, c in the compute dtype, local target and owner in int64, two flags); kept for backward, per
    token the log-sum-exp, the local target (int64) and two flags; backward's dlogits (N x V/W in dtype) and,
    where dtype is narrower than fp32, the work buffer. "mean" also keeps its divisor (one int64)."""
    b, cb = dtype.itemsize, torch.promote_types(dtype, torch.float32).itemsize
    return dict(slice=N * V // world * cb, work=work * cb, merge=6 * world * N * cb, tokens=N * (3 * cb + 8 + 8 + 2),
                sent=3 * N * cb,
                kept=N * (cb + 8 + 1 + 1) + 8 * (reduction == "mean"),
                dlogits=N * V // world * b + (work * cb if cb != b else 0))


def assert_held(held, dtype, world, work, megatron=False, reduction="none"):
    """What the loss held (check_loss, common.memory) against its closed form (loss_bytes). Megatron's form: two
    slices at once in forward, keeps one (the softmax), one more in backward. Keeping one more slice fails these."""
    c = loss_bytes(dtype, world, work or 0, reduction)
    a = c["slice"]
    if megatron:  # bf16/fp16: forward's fp32 copy of the logits, backward's dlogits in dtype, one more each
        up, narrow = (1, N * V // world * dtype.itemsize) if dtype.itemsize < 4 else (0, 0)
        assert (2 + up) * a <= held.forward < (3 + up) * a and a <= held.kept < 2 * a, held
        assert 2 * a + narrow <= held.backward < 3 * a + narrow, held
        held_by["megatron"] = max(held.forward, held.backward)
        return
    assert held.kept == c["kept"], (held, c)                         # exact
    top = max(c["work"], c["merge"]) + c["tokens"]  # work freed before the merge. Besides: the 3N sent (gloo's
    assert top <= held.forward < top + c["sent"] + 8 * N + 64, (held, c)  # thread may hold it), a temporary, scalars
    assert c["dlogits"] <= held.backward < c["dlogits"] + a, (held, c)
    # (fp32 work on more than half of a bf16 slice's rows is, at W=2, as many bytes as the full bf16 logits)
    if world > 1 and (2 * work <= N * V // world or dtype.itemsize >= 4):
        assert max(held.forward, held.backward) < N * V * dtype.itemsize, "a rank held the full logits' bytes"
    held_by["ours"] = max(held.forward, held.backward)


def section_dtypes(rank, world, device):
    head("3. bf16 and fp16 logits (fp32 inside), ignore_index, reduction")
    target = tokens(device, world)
    ignored = torch.arange(N, device=device).view(B, T) % 5 == 2    # every fifth token
    for dtype in (torch.bfloat16, torch.float16):
        z = (torch.randn(B, T, V, device=device) * 3).to(dtype)
        for reduction, ignore_index, work in (("none", -100, 5 * B * V // world), ("mean", -100, N * V // world),
                                              ("sum", 7, 5 * B * V // world)):  # 5 of T's rows, or all
            _, fwd, held = check_loss(vocab_parallel_cross_entropy, z, target.masked_fill(ignored, ignore_index),
                                      chunk_numel=work, label_smoothing=0.1, reduction=reduction,
                                      keeps=loss_bytes(dtype, world, work, reduction)["kept"],
                                      ignore_index=ignore_index)
            assert fwd.calls == loss_calls(None, 4), "the fp32 numbers are gathered"
            assert_held(held, dtype, world, work, reduction=reduction)
        _, fwd, held = check_loss(megatron_vocab_parallel_cross_entropy, z, target, label_smoothing=0.1)
        assert fwd.calls == loss_calls(None, 4, megatron=True)
        assert_held(held, dtype, world, None, megatron=True)
        name = str(dtype).removeprefix("torch.")
        log(f"{name}: both forms' loss and dlogits, in {name}, equal F.cross_entropy in float64 within "
            f"rtol={TOL[dtype]['rtol']:.2g}")
    log("the one-collective form with ignore_index -100 and 7 (inside [0, V)); reduction none, mean over the tokens "
        "not ignored, sum")
    z = torch.randn(B, T, V, device=device, dtype=torch.float64)
    loss, _, _ = check_loss(vocab_parallel_cross_entropy, z, torch.full_like(target, -100))  # the default: mean
    assert loss.isnan()
    log("every token ignored: the mean is nan and the gradient 0, as F.cross_entropy's")
    one = vocab_parallel_cross_entropy(z[0, 0, slice(*vocab_range(V))], target[0, 0], reduction="none")
    torch.testing.assert_close(one, F.cross_entropy(z[0, 0], target[0, 0], reduction="none"))  # shape () too
    for fn in (vocab_parallel_cross_entropy, megatron_vocab_parallel_cross_entropy):
        shape = f"target must hold class indices of shape {(B, T)} (the logits' shape without the vocab dimension)"
        for option, said in ((dict(label_smoothing=1.5), "label_smoothing=1.5 must lie in [0, 1]"),
                             (dict(reduction="avg"), "reduction='avg'; use 'none', 'mean' or 'sum'"),
                             (dict(target=target.t()), f"{shape}; got torch.int64 {(T, B)}"),
                             (dict(target=target.double()), f"{shape}; got torch.float64 {(B, T)}")):
            got = refused(lambda: fn(z[..., slice(*vocab_range(V))], **{"target": target, **option}))
            assert got == said, (option, got)                         # on every rank alone, no collective
    first, said = divmod(int(ignored.view(-1).nonzero()[0]), T), None  # where the bad targets start: (0, 2)
    for fn, bad, also in ((vocab_parallel_cross_entropy, -1, " or ignore_index=-100"),
                          (vocab_parallel_cross_entropy, V, " or ignore_index=-100"),
                          (megatron_vocab_parallel_cross_entropy, -100, "")):  # Megatron's has no ignore_index
        got = refused(lambda: fn(z[..., slice(*vocab_range(V))], target.masked_fill(ignored, bad)))
        assert got == f"target{list(first)}={bad} is not a class of the vocabulary: classes lie in [0, {V}){also}", got
        said = said if bad != V else got                              # on every rank alone, no collective
    log(f"refused on every rank, no collective sent: {said}")


def section_subgroups(rank, world, device):
    head("4. every block on a sub-group whose group rank is not the global rank")
    group, _ = strided_groups(2)[rank % 2]                            # {0, 2, ..} and {1, 3, ..}
    lo, hi, _ = check_embedding(group, device)
    check_embedding(group, device, sequence_parallel=True)
    z = torch.randn(B, T, V, device=device, dtype=torch.float64)
    target = tokens(device, world)
    for megatron in (False, True):
        fn = megatron_vocab_parallel_cross_entropy if megatron else vocab_parallel_cross_entropy
        _, fwd, _ = check_loss(fn, z, target, group, label_smoothing=0.1, reduction="sum")
        assert fwd.calls == loss_calls(group, 8, megatron)
    check_regions(group, device)
    check_lm_head(group, device)
    log_all(f"group {list(ranks_of(group))}, group rank {dist.get_rank(group)}: rows [{lo}, {hi})")
    log("embedding (SP too), f and g, LM head and both losses equal their references on the sub-groups, traffic on "
        "them only")


def check_lm_head(group, device):
    """Embed, mix, tied LM head, mean loss on `group`, against the same dense model; returns the logits' bytes."""
    f64 = dict(device=device, dtype=torch.float64)
    dense = nn.Embedding(V, D, **f64)
    mix = (torch.randn(D, D, **f64) / D ** 0.5).requires_grad_()       # a replicated stand-in for the layers
    ids, target = tokens(device, dist.get_world_size()), torch.randint(0, V, (B, T), device=device)
    dense_logits = torch.tanh(dense(ids) @ mix) @ dense.weight.T        # (B, T, V)
    dense_loss = F.cross_entropy(dense_logits.view(N, V), target.view(N), label_smoothing=0.1)
    dense_loss.backward()
    dense_mix_grad, mix.grad = mix.grad, None
    layer = VocabParallelEmbedding.from_dense(dense, group)
    with traffic() as fwd:
        hidden = torch.tanh(layer(ids.t()) @ mix).transpose(0, 1)     # (B, T, D), a non-contiguous view
        local_logits = parallel_lm_logits(hidden, layer.weight, group)  # (B, T, V/W)
        loss = vocab_parallel_cross_entropy(local_logits, target, label_smoothing=0.1, group=group)  # mean
    with traffic() as bwd:
        loss.backward()
    torch.testing.assert_close(loss, dense_loss)
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad[layer.vocab_start:layer.vocab_end])
    torch.testing.assert_close(mix.grad, dense_mix_grad)                 # embedding + head grads, summed above
    assert same_on_every_rank(loss, group) and same_on_every_rank(mix.grad, group)
    many = dist.get_world_size(group) > 1
    assert fwd.calls == [("all_reduce", ranks_of(group), N * D * 8)] * many + loss_calls(group, 8)
    assert bwd.calls == [("all_reduce", ranks_of(group), N * D * 8)] * many  # f on dL/dhidden
    assert local_logits.nbytes * dist.get_world_size(group) == dense_logits.nbytes
    return local_logits.nbytes, dense_logits.nbytes


def section_lm_head(rank, world, device):
    head("5. LM head with tied weights: embed, mix, logits from the embedding's own shard, mean loss")
    check_regions(None, device)
    mine, dense = check_lm_head(None, device)
    log("f and g on rank-dependent transposed views: g sums the values over the ranks, f's backward the grads")
    log("loss, tied-weight grad shard and mixing grad equal the dense model's")
    log(f"forward: 1 all-reduce (embedding, N*D={N * D}) + 1 all-gather (loss, 3N={3 * N}); backward: 1 all-reduce "
        f"(f on dL/dhidden, N*D)")
    log(f"logits per rank: {mine} bytes = 1/{world} of the dense {dense}")


def benchmark(tokens=1024, vocab=32768, rounds=int(os.environ.get("BENCH_ROUNDS", "21"))):
    """BENCH=1: the loss, forward + backward, beside PyTorch's loss_parallel (DTensor logits sharded on the vocab)
    and Megatron's three all-reduces: fp32 logits [tokens, vocab/W]; all three first checked equal; then each
    round times the three in a rotating order, and the ratios are the medians of the per-round ratios."""
    import statistics
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    rank, world, device = setup()
    head(f"BENCH: cross-entropy on [{tokens}, {vocab}/{world}] fp32 logits a rank, forward + backward, {rounds} rounds")
    gen = torch.Generator().manual_seed(0)
    full, target = torch.randn(tokens, vocab, generator=gen) * 3, torch.randint(0, vocab, (tokens,), generator=gen)
    local, target = full.chunk(world, dim=1)[rank].contiguous().to(device), target.to(device)
    mesh = init_device_mesh(device.type, (world,))

    def run(name):
        x = local.detach().requires_grad_()
        if name == "loss_parallel":
            with loss_parallel():
                loss = F.cross_entropy(DTensor.from_local(x, mesh, [Shard(1)]), target)
                loss.backward()
            return loss.full_tensor(), x.grad
        fn = vocab_parallel_cross_entropy if name == "ours" else megatron_vocab_parallel_cross_entropy
        loss = fn(x, target)
        loss.backward()
        return loss, x.grad

    names = ("ours", "Megatron's", "loss_parallel")
    want = run("loss_parallel")
    for name in names[:2]:
        for got, ref in zip(run(name), want):
            torch.testing.assert_close(got, ref)
    ms = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % 3:] + names[:i % 3]:
            sync(device), dist.barrier()
            t0 = time.perf_counter()
            run(name)
            sync(device)
            ms[name].append(1e3 * (time.perf_counter() - t0))
    for name in names:
        ratio = statistics.median(a / b for a, b in zip(ms[name], ms["loss_parallel"]))
        log(f"{name:13} {statistics.median(ms[name]):8.2f} ms   / loss_parallel: x{ratio:.2f} (median of the rounds)")
    finish(f"benchmark at {world} ranks: loss and dlogits of the three agree")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    if os.environ.get("BENCH", "0") not in ("", "0"):
        return benchmark()
    if launched_world_size() not in WORLDS:
        refuse(f"a vocabulary of {V} rows and {N} tokens fit {', '.join(map(str, WORLDS))} ranks, "
               f"not {launched_world_size()}")
    rank, world, device = setup()
    section_embedding(rank, world, device)
    section_loss(rank, world, device)
    section_dtypes(rank, world, device)
    section_subgroups(rank, world, device)
    section_lm_head(rank, world, device)
    finish("vocab-parallel embedding (sequence-parallel too), tied LM head and cross-entropy in one all-gather "
           "(bf16/fp16, ignore_index, global label smoothing, sub-groups) equal the dense model, forward and "
           "backward; the loss holds one N x V/W slice at most besides the logits")


if __name__ == "__main__":
    main()
