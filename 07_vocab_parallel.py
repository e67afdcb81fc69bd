"""07 - vocabulary parallelism: the embedding table, the LM head and the loss, split by vocabulary rows.

The vocabulary (32k to 256k tokens) makes the input embedding and the output layer an LLM's largest matrices,
and the logits (tokens x vocabulary) its largest activation. Megatron-LM splits all three along the vocabulary
over the tensor-parallel group: rank i holds rows [i*V/W, (i+1)*V/W) of the (tied) embedding table.

  embedding   ids (every rank)  -- look up the rows held here, zero the others -->  partial (N, D)
              -- all-reduce SUM -->  every rank holds the full (N, D) embeddings
  LM head     hidden (N, D) @ W_i^T  -->  rank i holds logits[:, i*V/W : (i+1)*V/W], never all V columns
  loss        rank 0: logits[:, 0:V/W]     rank 1: logits[:, V/W:2V/W]   ...   three all-reduces of N numbers:
                max of its slice      -- all-reduce MAX -->  m           (global max: exp never overflows)
                sum of exp(z - m)     -- all-reduce SUM -->  S           (softmax denominator)
                z_target - m if it holds the target, else 0
                                      -- all-reduce SUM -->  z_target - m
                loss = log S - (z_target - m), the same on every rank
              backward: softmax - one_hot on the local slice, no communication

Label smoothing eps means what F.cross_entropy(label_smoothing=eps) means: the target distribution is
(1 - eps) * one_hot + eps / V over the GLOBAL vocabulary V, so the loss subtracts eps * mean(z - m) over all V
logits. That sum is linear, so it rides in the third all-reduce: still three. Averaging over the local V/W
slice instead (NVIDIA/Megatron-LM#737) gives every rank a different, wrong loss.

Bytes each rank sends (ring all-reduce: 2(W-1)/W of its payload; b bytes per element, N tokens):
  embedding forward, and LM-head backward (dL/dhidden): 2(W-1)/W * N*D*b each
  the loss: 3 * 2(W-1)/W * N*b, independent of V; gathering the logits would send (W-1)/W * N*V*b instead
  and hold all N*V of them on every rank.

    torchrun --nproc-per-node=4 07_vocab_parallel.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- building blocks (torch only) ---------------------------------------------------------------------
def vocab_range(vocab_size: int, group=None):
    """Rows [start, end) of a vocabulary of `vocab_size` that this rank of `group` holds."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if vocab_size % world:
        raise ValueError(f"vocab_size={vocab_size} is not divisible by the tensor-parallel size {world}")
    per_rank = vocab_size // world
    return rank * per_rank, (rank + 1) * per_rank


def _reduce(x, group):
    """All-reduce (sum) into a new tensor; `x` is left as it was."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


class _CopyToModelParallelRegion(torch.autograd.Function):
    """forward: identity; backward: all-reduce (the `f` operator)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """forward: all-reduce; backward: identity (the `g` operator)."""

    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tensor_model_parallel_region(x, group=None):
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    return _ReduceFromModelParallelRegion.apply(x, group)


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding with its rows split over `group`: rank i holds rows [i*V/W, (i+1)*V/W).

        ids [3, 17, 40], V=48, W=4    rank 0 (rows  0-11) -> [e3,  0,   0 ]
                                      rank 1 (rows 12-23) -> [0,  e17,  0 ]   all-reduce   [e3, e17, e40]
                                      rank 2 (rows 24-35) -> [0,   0,   0 ]   ---------->  on every rank
                                      rank 3 (rows 36-47) -> [0,   0,  e40]
    Backward: `g`'s backward is the identity; each rank's rows receive the grads of the ids it holds, locally.
    Ids outside [0, V) come out as zero rows (nn.Embedding raises instead).
    Initialised N(0, 1) like nn.Embedding from each rank's RNG; use from_dense() to match a dense table.
    """

    def __init__(self, num_embeddings, embedding_dim, group=None, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, group)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim,
                                               device=device, dtype=dtype))  # (V/W, D)
        nn.init.normal_(self.weight)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group=None):
        """This rank's rows of a dense nn.Embedding."""
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.scale_grad_by_freq \
                or embedding.sparse:
            raise ValueError("from_dense copies plain embeddings only "
                             "(padding_idx=None, max_norm=None, scale_grad_by_freq=False, sparse=False)")
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w[layer.vocab_start:layer.vocab_end])
        return layer

    def forward(self, ids):
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)  # ids another rank holds
        local = (ids - self.vocab_start).masked_fill(outside, 0)      # any valid row; zeroed below
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (..., D) partial
        return reduce_from_tensor_model_parallel_region(out, self.group)


def parallel_lm_logits(hidden, weight_shard, group=None):
    """Column-parallel LM head with the embedding's own shard (tied weights): (..., D) -> (..., V/W).

    hidden is the same on every rank; `f` all-reduces dL/dhidden in backward, because each rank's logits
    see hidden through its own V/W rows only.
    """
    return F.linear(copy_to_tensor_model_parallel_region(hidden, group), weight_shard)  # (..., D) @ (D, V/W)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: three all-reduces of one number per token (MAX, SUM, SUM); backward: local, no communication."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        vocab_local = logits.size(-1)
        vocab = vocab_local * dist.get_world_size(group)
        start = dist.get_rank(group) * vocab_local
        m = logits.max(dim=-1).values                                   # (...,) local max
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)           # (...,) global max
        shifted = logits - m.unsqueeze(-1)                              # (..., V/W) new: the input stays as is
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)                           # (...,) S over all V columns
        # the target's logit: one per row, gathered on the rank that holds it; 0 on the others
        held = (target >= start) & (target < start + vocab_local)
        local_target = (target - start).masked_fill(~held, 0)           # any valid column; zeroed below
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~held, 0.0)
        target_term = (1.0 - label_smoothing) * picked                  # (...,)
        if label_smoothing:  # + eps/V * sum of all V logits: linear, so it shares the all-reduce
            target_term += (label_smoothing / vocab) * shifted.sum(dim=-1)
        dist.all_reduce(target_term, group=group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))                       # (..., V/W), reusing exp's buffer
        ctx.save_for_backward(softmax, held, local_target)
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        return sum_exp.log() - target_term

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, held, local_target = ctx.saved_tensors
        eps = ctx.label_smoothing
        # dloss/dz = softmax - (1 - eps) * one_hot - eps / V, on this rank's V/W columns only
        grad = softmax - eps / ctx.vocab
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-(1.0 - eps) * held.to(grad.dtype)).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0, group=None):
    """Per-token loss, as F.cross_entropy(logits, target, label_smoothing=..., reduction="none") on the full
    logits, from this rank's (..., V/W) slice of them. Targets lie in [0, V); there is no ignore_index
    (multiply the per-token loss by a mask instead). Every rank returns the same loss."""
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal the logits' shape without the vocab "
                         f"dimension, {tuple(vocab_parallel_logits.shape[:-1])}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 1]")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, float(label_smoothing), group)


# ---- demo ---------------------------------------------------------------------------------------------
V, D, B, T = 48, 16, 2, 6  # 48 rows split evenly over 1, 2, 3, 4, 6 or 8 ranks; N = B*T tokens


def main():
    from common import finish, head, launched_world_size, log, log_all, refuse, setup
    if V % launched_world_size():
        refuse(f"the vocabulary of {V} rows does not split evenly over {launched_world_size()} ranks; "
               f"use 1, 2, 3, 4, 6 or 8")
    from torch.distributed.tensor.debug import CommDebugMode

    class Watch(CommDebugMode):
        """CommDebugMode counts collectives; this also adds up the elements all-reduced and the size of the
        largest tensor any op makes. CommDebugMode is a dispatch mode: it sees every op, those autograd runs in
        backward too (torch.cuda's memory statistics would, on CUDA only). Its module tracker puts a backward
        hook on every module called inside it, and torch warns when that hook fires on a module whose only
        input is integer ids: so an embedding is counted in a no_grad forward, and runs for backward outside."""

        def __enter__(self):
            self.reduced, self.largest = 0, 0
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.all_reduces = self.get_comm_counts()[torch.ops.c10d.allreduce_]
            assert self.get_total_counts() == self.all_reduces, "only all-reduces expected"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func._overloadpacket is torch.ops.c10d.allreduce_:
                self.reduced += sum(t.numel() for t in args[0])
            outs = out if isinstance(out, (tuple, list)) else (out,)  # an op returns a tensor or a tuple of them
            self.largest = max([self.largest] + [t.numel() for t in outs if torch.is_tensor(t)])
            return out

    rank, world, device = setup()
    f64 = dict(device=device, dtype=torch.float64)  # float64: exact sums, tight comparisons
    N = B * T

    def same_on_every_rank(t):
        gathered = torch.empty(world * t.numel(), **f64)
        dist.all_gather_single(gathered, t.detach().reshape(-1).to(torch.float64))
        return all(torch.equal(g, gathered[:t.numel()]) for g in gathered.split(t.numel()))

    head("1. VocabParallelEmbedding: each rank looks up the rows it holds, one all-reduce sums them")
    dense = nn.Embedding(V, D, **f64)
    ids = ((torch.arange(N, device=device) * 13 + 5) % V).view(B, T)  # ids in every rank's rows
    ids[-1, -1] = ids[0, 0]                                           # a repeated id: its grad accumulates
    layer = VocabParallelEmbedding.from_dense(dense)
    lo, hi = layer.vocab_start, layer.vocab_end
    assert (lo, hi) == (rank * V // world, (rank + 1) * V // world) and torch.equal(layer.weight, dense.weight[lo:hi])
    held = int(((ids >= lo) & (ids < hi)).sum())
    assert held > 0
    grad_out = torch.randn(B, T, D, **f64)
    ref = dense(ids)
    ref.backward(grad_out)
    out = layer(ids)                                                  # (B, T, D) on every rank
    with Watch() as bwd:
        out.backward(grad_out)
    with Watch() as fwd, torch.no_grad():                             # the forward again, counted (see Watch)
        counted = layer(ids)
    assert torch.equal(out, ref) and torch.equal(counted, ref), "one nonzero term per token: the sum is exact"
    assert torch.equal(layer.weight.grad, dense.weight.grad[lo:hi])
    assert (fwd.all_reduces, fwd.reduced, bwd.all_reduces) == (1, N * D, 0)
    log_all(f"holds rows [{lo}, {hi}): looks up {held} of the {N} ids; its other {N - held} outputs are zeros")
    log(f"output and weight-grad shards equal nn.Embedding's exactly; 1 all-reduce of N*D={N * D} forward, 0 backward")
    if world > 1:
        try:
            VocabParallelEmbedding(V + 1, D)
            raise AssertionError("V+1 rows should be refused")
        except ValueError as e:
            log(f"refused: {e}")

    head("2. Vocab-parallel cross-entropy equals F.cross_entropy, with and without label smoothing")
    logits = torch.randn(B, T, V, **f64) * 3
    target = torch.randint(0, V, (B, T), device=device)
    weights = torch.rand(B, T, **f64)  # d(sum of weighted losses)/dloss: a non-uniform upstream grad
    for eps in (0.0, 0.1):
        for scale in (1.0, 1000.0):
            z = logits * scale
            assert scale == 1 or not torch.isfinite(z.exp()).all(), "exp of these logits overflows"
            full = z.clone().requires_grad_()
            ref = F.cross_entropy(full.view(N, V), target.view(N), label_smoothing=eps, reduction="none")
            (ref.view(B, T) * weights).sum().backward()
            mine = z[..., lo:hi].clone().requires_grad_()             # (B, T, V/W): this rank's columns only
            before, version = mine.detach().clone(), mine._version
            with Watch() as fwd:
                loss = vocab_parallel_cross_entropy(mine, target, label_smoothing=eps)
            with Watch() as bwd:
                (loss * weights).sum().backward()
            torch.testing.assert_close(loss, ref.view(B, T))
            torch.testing.assert_close(mine.grad, full.grad[..., lo:hi])
            assert torch.equal(mine, before) and mine._version == version, "the input logits were modified"
            assert (fwd.all_reduces, fwd.reduced, bwd.all_reduces, bwd.reduced) == (3, 3 * N, 0, 0)
            assert max(fwd.largest, bwd.largest) == N * V // world, "a tensor larger than the local slice"
            assert same_on_every_rank(loss)
            log(f"eps={eps} logits x{scale:<6g}: loss and dlogits equal F.cross_entropy; 3 all-reduces of N={N} "
                f"numbers forward, 0 backward; input untouched")
            if eps and scale == 1 and world > 1:  # the smoothing term averaged over this rank's V/W columns only
                wrong = ref.view(B, T) + eps * (z.mean(-1) - z[..., lo:hi].mean(-1))
                assert not same_on_every_rank(wrong)
                log(f"averaging the smoothing over the local V/W columns instead (Megatron-LM#737) gives each rank "
                    f"a different loss, off by up to {(wrong - loss).abs().max().item():.2f}")
    log(f"every rank returns the identical loss; the largest tensor any op made is N x V/W = {N * V // world} "
        f"elements (full logits: {N * V})")

    head("3. LM head with tied weights: embed, mix, logits from the embedding's own shard, loss")
    dense = nn.Embedding(V, D, **f64)
    mix = (torch.randn(D, D, **f64) / D ** 0.5).requires_grad_()      # a replicated stand-in for the layers
    target = torch.randint(0, V, (B, T), device=device)
    dense_logits = torch.tanh(dense(ids) @ mix) @ dense.weight.T        # (B, T, V)
    dense_loss = F.cross_entropy(dense_logits.view(N, V), target.view(N), label_smoothing=0.1)
    dense_loss.backward()
    dense_mix_grad, mix.grad = mix.grad, None
    layer = VocabParallelEmbedding.from_dense(dense)
    hidden = torch.tanh(layer(ids) @ mix)                             # uncounted (see Watch): 1 all-reduce
    with Watch() as fwd:
        local_logits = parallel_lm_logits(hidden, layer.weight)       # (B, T, V/W)
        loss = vocab_parallel_cross_entropy(local_logits, target, label_smoothing=0.1).mean()
    with Watch() as bwd:
        loss.backward()
    torch.testing.assert_close(loss, dense_loss)
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad[lo:hi])  # embedding + head, summed
    torch.testing.assert_close(mix.grad, dense_mix_grad)
    assert same_on_every_rank(loss) and same_on_every_rank(mix.grad)
    assert (fwd.all_reduces, fwd.reduced, bwd.all_reduces, bwd.reduced) == (3, 3 * N, 1, N * D)
    assert local_logits.nbytes * world == dense_logits.nbytes
    log(f"loss, tied-weight grad shard and mixing grad equal the dense model's; all-reduces after the embedding: "
        f"3 forward (the loss), 1 backward (f on dL/dhidden, N*D={N * D})")
    log(f"logits per rank: {local_logits.nbytes} bytes = 1/{world} of the dense {dense_logits.nbytes}")

    finish("vocab-parallel embedding, tied LM head and cross-entropy (label smoothing over the global vocabulary) "
           "equal the dense model, forward and backward")


if __name__ == "__main__":
    main()
