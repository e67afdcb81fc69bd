"""What this proves beyond 07's lesson, on the world and on the strided sub-groups {0, 2, ..} and {1, 3, ..} (group
rank != global rank), with ids and targets holding every rank's first and last row (for W and W/2 ranks):
- VocabParallelEmbedding, sequence-parallel too, == nn.Embedding exactly from [s, b] views; its rows; its traffic;
  f and g on rank-dependent transposed views (g leaves a contiguous caller's tensor alone);
- both losses == F.cross_entropy, loss and dlogits, handed non-contiguous [s, b] views under a non-uniform
  upstream gradient: float64 with label smoothing 0 and 0.1, logits x1000 (exp would overflow); bf16 and
  fp16 (fp32 inside) with ignore_index -100 and 7 (inside [0, V)), reductions none / mean / sum; every token
  ignored (nan, grad 0); one unbatched token; ignore_index -1 (nanoGPT's) and V. Each time: the same loss on every
  rank bit for bit, the input untouched, no tensor larger than N x V/W, no traffic in backward, forward's traffic
  to the byte (the 16-B slice check, then 1 all-gather of 3N or 3 all-reduces of N);
- the chunking (_chunks) and the bytes the loss holds (tests.tools.memory): kept for backward exactly (14 B a token
  in fp32, 18 in float64; "mean" 8 B more), forward's and backward's peaks within their closed forms (loss_bytes),
  never the full logits' bytes; Megatron's form two slices forward and keeps its softmax;
- the tied LM head on the world and the sub-groups; gather_vocab_logits in float64 and bf16 from a transposed view,
  exact, backward this rank's columns, on the sub-groups, check_slices=False sending the gather only;
- unequal slices (rank 0 [4, 4] logits, the last rank [4, 3]; or another token count) refused by both losses and
  the gather in one line on every rank after the one 16-B all-gather (and, without the check, a different loss
  per rank: what it prevents);
- every refusal at its boundary: the last valid value passes (label smoothing 0 and 1.0 == F.cross_entropy), the
  first invalid one is refused in one line before any message (the targets: after the slice check, on every rank
  alike; with check_slices=False before any).
"""
import math
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, launched_world_size, log, log_all, refuse, setup, traffic  # noqa: E402
from tests.tools import lesson, memory, refused, strided_groups  # noqa: E402

m = lesson("07_vocab_parallel.py")
V, D, B, T = 384, 16, 2, 12  # V/W rows per rank > 3W numbers per token gathered, for W up to 8; N = B*T
N = B * T
WORLDS = (1, 2, 3, 4, 6, 8)  # V splits evenly over W and W/2; N-1 tokens hold every rank's first and last row
CHECK = 16                   # the slice check hands in 2 int64: (tokens, columns)
TOL = {torch.float64: {}, torch.bfloat16: dict(rtol=2 ** -8, atol=1e-6), torch.float16: dict(rtol=2 ** -10, atol=1e-6)}
# bf16/fp16 against float64: fp32 inside, then one rounding to 8 (bf16) or 11 (fp16) bits, at most half of rtol
OURS, MEGATRON = m.vocab_parallel_cross_entropy, m.megatron_vocab_parallel_cross_entropy


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
    m.all_gather_single(gathered, t.detach().reshape(-1).to(torch.float64), group=group)
    return all(g.isclose(gathered[:t.numel()], rtol=0, atol=0, equal_nan=True).all() for g in gathered.split(t.numel()))


def refused_everywhere(call, group=None):
    """call() raises ValueError in one line on every rank of `group` after exactly the slice check's 16-B all-gather
    (no other message: the ranks agree before any real work); returns the line, which each caller compares with the
    one expected, so every rank says the same."""
    with traffic() as t:
        try:
            call()
        except ValueError as e:
            said = str(e)
        else:
            raise AssertionError("accepted, where ValueError was expected")
    many = dist.get_world_size(group) > 1
    assert "\n" not in said and t.calls == [("all_gather", ranks_of(group), CHECK)] * many, (said, t.calls)
    return said


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


# ---- the embedding, the regions, the tied head ----------------------------------------------------------------
def check_embedding(group, device, sequence_parallel=False):
    """VocabParallelEmbedding on `group` against nn.Embedding (exact): output, weight grad, traffic. ids [s, b] are
    a non-contiguous view; sequence_parallel: s = N (every group size divides it), rank r gets rows r*s/W.. of s."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    dense = nn.Embedding(V, D, device=device, dtype=torch.float64)
    ids = tokens(device, dist.get_world_size())
    ids = torch.stack([ids.view(-1), ids.view(-1).flip(0)]).t() if sequence_parallel else ids.t()  # (s, b)
    s, b = ids.shape
    layer = m.VocabParallelEmbedding.from_dense(dense, group, sequence_parallel=sequence_parallel)
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
    y = m.reduce_from_tensor_model_parallel_region(x.t() * (r + 1), group)  # (N, D), not contiguous
    torch.testing.assert_close(y, x.t() * (w * (w + 1) / 2))          # sum over ranks of (r + 1) * x
    mine = x * (r + 1)
    m.reduce_from_tensor_model_parallel_region(mine, group)           # contiguous: all-reduced in a copy
    assert torch.equal(mine, x * (r + 1)), "g modified the caller's tensor"
    leaf = x.clone().requires_grad_()
    m.copy_to_tensor_model_parallel_region(leaf, group).t().backward((x.t() * (r + 1)).contiguous())
    torch.testing.assert_close(leaf.grad, x * (w * (w + 1) / 2))


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
    layer = m.VocabParallelEmbedding.from_dense(dense, group)
    with traffic() as fwd:
        hidden = torch.tanh(layer(ids.t()) @ mix).transpose(0, 1)     # (B, T, D), a non-contiguous view
        local_logits = m.parallel_lm_logits(hidden, layer.weight, group)  # (B, T, V/W)
        loss = OURS(local_logits, target, label_smoothing=0.1, group=group)  # mean
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


def check_gather(group, device, dtype):
    """gather_vocab_logits from a transposed (T, B, V/W) view: every rank's columns in rank order, exact; backward
    (a loss counted once) leaves this rank's columns of the gradient; the check, then one all-gather of the slice."""
    w, r = dist.get_world_size(group), dist.get_rank(group)
    lo, hi = m.vocab_range(V, group)
    z = (torch.randn(B, T, V, device=device) * 3).to(dtype)           # the same on every rank
    leaf = z[..., lo:hi].clone().requires_grad_()
    view, seen = leaf.transpose(0, 1), []                             # (T, B, V/W)
    view.register_hook(lambda g: seen.append(g.is_contiguous()))
    with traffic() as fwd:
        full = m.gather_vocab_logits(view, group)                      # (T, B, V)
    upstream = torch.randint(-4, 5, (T, B, V), device=device).to(dtype)  # exact in bf16
    with traffic() as bwd:
        (full * upstream).sum().backward()
    assert torch.equal(full, z.transpose(0, 1)) and full.dtype == dtype, "a copy: exact in any dtype"
    assert torch.equal(leaf.grad, upstream.transpose(0, 1)[..., lo:hi]) and bwd.calls == []
    assert seen == [True], "the gather's backward handed upstream a non-contiguous slice of the grad"
    many = w > 1
    assert fwd.calls == [("all_gather", ranks_of(group), CHECK), ("all_gather", ranks_of(group), leaf.nbytes)] * many
    with traffic() as fwd:
        again = m.gather_vocab_logits(leaf.detach(), group, check_slices=False)
    assert torch.equal(again, z) and fwd.calls == [("all_gather", ranks_of(group), leaf.nbytes)] * many


# ---- the losses against F.cross_entropy, with their traffic and bytes --------------------------------------------
def check_loss(loss_fn, z, target, group=None, chunk_numel="auto", keeps=None, **options):
    """loss_fn on this rank's slice of z (B, T, V), handed over in Megatron's [s, b] order as a non-contiguous
    (T, B, V/W) view, against F.cross_entropy on all of z in float64: the loss and dlogits under a non-uniform
    upstream grad, in z's dtype within TOL. Also: every rank's loss is the same, the input is untouched, no
    tensor exceeds N x V/W elements. Returns the loss, the forward's traffic and the bytes it held (memory): its
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
    if loss_fn is OURS:
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


def loss_calls(group, itemsize, megatron=False, check=True):
    """What the loss hands to c10d: the slice check's 2 int64, then 3 all-reduces of N numbers, or 1 all-gather of
    3N; none on one rank."""
    if dist.get_world_size(group) == 1:
        return []
    ranks = ranks_of(group)
    return [("all_gather", ranks, CHECK)] * check + ([("all_reduce", ranks, N * itemsize)] * 3 if megatron else
                                                     [("all_gather", ranks, 3 * N * itemsize)])


held_by = {}  # the last peak each form held, for the log


def loss_bytes(dtype, world, work, reduction="none"):
    """Closed forms, in bytes, of what vocab_parallel_cross_entropy holds on (T, B, V/W) logits of `dtype` besides
    them, taking `work` elements at a time: one slice A = N x V/W in the compute dtype (fp32 at least); forward's
    work buffer, then the merge: the 3N x W numbers gathered and three (W, N) temporaries, either one beside the
    per-token numbers (m, s, c in the compute dtype, local target and owner in int64, two flags); kept for backward,
    per token the log-sum-exp, the local target (int64) and two flags; backward's dlogits (N x V/W in dtype) and,
    where dtype is narrower than fp32, the work buffer. "mean" also keeps its divisor (one int64)."""
    b, cb = dtype.itemsize, torch.promote_types(dtype, torch.float32).itemsize
    return dict(slice=N * V // world * cb, work=work * cb, merge=6 * world * N * cb, tokens=N * (3 * cb + 8 + 8 + 2),
                sent=3 * N * cb,
                kept=N * (cb + 8 + 1 + 1) + 8 * (reduction == "mean"),
                dlogits=N * V // world * b + (work * cb if cb != b else 0))


def assert_held(held, dtype, world, work, megatron=False, reduction="none"):
    """What the loss held (check_loss, tests.tools.memory) against its closed form (loss_bytes). Megatron's form: two
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


# ---- sections ---------------------------------------------------------------------------------------------------
def section_embedding(rank, world, device):
    head("1. VocabParallelEmbedding == nn.Embedding (SP too), its refusals at their boundary")
    lo, hi, held = check_embedding(None, device)
    log_all(f"holds rows [{lo}, {hi}): looks up {held} of the {N} ids; its other {N - held} outputs are zeros")
    check_embedding(None, device, sequence_parallel=True)
    f64 = dict(device=device, dtype=torch.float64)
    dense = nn.Embedding(V, D, **f64)
    sp = m.VocabParallelEmbedding.from_dense(dense, sequence_parallel=True)
    ids = torch.randint(0, V, (2 * world,), device=device)
    one = sp(ids[:world])                                            # [s] of s = W passes: [1, D] a rank
    assert torch.equal(one, dense(ids[:world])[rank:rank + 1])
    if world > 1:                                                     # the first lengths W does not divide
        for s in (world + 1, 2 * world - 1):
            said = refused(lambda: sp(ids[:s]))
            assert said == f"the sequence length ids.shape[0]={s} is not divisible by the group size {world}", said
        for v in (V + 1, V - 1):
            said = refused(lambda: m.VocabParallelEmbedding(v, D, device="meta"))
            assert said == f"vocab_size={v} is not divisible by the tensor-parallel size {world}", said
            assert refused(lambda: m.vocab_range(v)) == said
    assert m.vocab_range(V) == (rank * V // world, (rank + 1) * V // world)
    assert refused(lambda: sp(ids[0])) == "sequence_parallel takes ids [s, b] or [s], the sequence first; got one id"
    plain = "from_dense copies plain embeddings only (padding_idx=None, max_norm=None, scale_grad_by_freq=False, " \
            "sparse=False)"
    for option in (dict(padding_idx=0), dict(padding_idx=V - 1), dict(max_norm=1.0), dict(scale_grad_by_freq=True),
                   dict(sparse=True)):
        assert refused(lambda: m.VocabParallelEmbedding.from_dense(nn.Embedding(V, D, device="meta", **option))) \
            == plain, option
    m.VocabParallelEmbedding.from_dense(nn.Embedding(V, D, device="meta"))  # the boundary: every option at default
    fresh = m.VocabParallelEmbedding(V, D, device=device).weight       # N(0, 1), as nn.Embedding: V/W x D draws
    assert fresh.shape == (V // world, D) and abs(fresh.mean()) < 0.2 and 0.85 < fresh.std() < 1.15, fresh.std()
    said = "group=0; pass a ProcessGroup (dist.new_group) or None (the world)"  # nn.Embedding's padding_idx slot
    assert refused(lambda: m.VocabParallelEmbedding(V, D, 0)) == said and refused(lambda: m.vocab_range(V, 0)) == said
    # the reduce-scatter region batch-first (dim=1), against the dense sum: forward rank r's s/W columns, backward
    # every rank's grad gathered along s
    x = torch.randn(B, 2 * world, D, **f64).requires_grad_()
    y = m.reduce_scatter_to_sequence_parallel_region(x * (rank + 1), dim=1)
    upstream = torch.randn(B, 2 * world, D, **f64)                    # the same on every rank: the gather's result
    y.backward(upstream[:, 2 * rank:2 * rank + 2])
    torch.testing.assert_close(y, (x * (world * (world + 1) / 2))[:, 2 * rank:2 * rank + 2])
    torch.testing.assert_close(x.grad, upstream * (rank + 1))
    if world > 1:
        said = refused(lambda: m.reduce_scatter_to_sequence_parallel_region(x[:, 1:], dim=1))
        assert said == f"x.shape[1]={2 * world - 1} is not divisible by the group size {world}", said
    log("exact, SP too; refused in one line, nothing sent: V +- 1 rows, s = W+1 and 2W-1 (s = W passes), one id "
        "under SP ([s] passes), each of padding_idx, max_norm, scale_grad_by_freq, sparse")


def section_loss(rank, world, device):
    head("2. both losses against F.cross_entropy in float64: chunks, overflow, label smoothing 0 and 0.1; bytes")
    logits = torch.randn(B, T, V, device=device, dtype=torch.float64) * 3
    target = tokens(device, world)                                   # every rank's first and last row
    row = V // world                                                 # a row of this rank's (T, B, V/W) logits
    shape = torch.empty(T, B, row, device="meta")
    assert m._chunks(shape, 5 * B * row) == [(slice(i, i + 5),) for i in (0, 5, 10)]      # 5, 5 and 2 of T's rows
    assert m._chunks(shape, row) == [(t, slice(b, b + 1)) for t in range(T) for b in range(B)]  # one row of V/W
    assert m._chunks(shape, None) == m._chunks(shape, N * row) == [(...,)]               # all at once
    assert m._chunks(shape, 1) == m._chunks(shape, row)                                   # at least one row
    for eps, scale, chunk, work in ((0.0, 1.0, 5 * B * row, 5 * B * row), (0.0, 1000.0, None, N * row),
                                    (0.1, 1.0, row, row), (0.1, 1000.0, 7 * B * row, 7 * B * row)):
        z = logits * scale                                           # x1000: exp(z) overflows past z = 709
        for megatron in (False, True):                               # forward's pieces: 5 (or 7) of T's rows,
            fn = MEGATRON if megatron else OURS                      # all, or 1 x 1
            _, fwd, held = check_loss(fn, z, target, chunk_numel=chunk, label_smoothing=eps, reduction="none",
                                      keeps=None if megatron else loss_bytes(z.dtype, world, work)["kept"])
            assert fwd.calls == loss_calls(None, 8, megatron)
            assert_held(held, torch.float64, world, work, megatron)
        log(f"eps={eps} logits x{scale:<6g}(|z| <= {z.abs().max():.0f}): both forms' loss and dlogits equal "
            f"F.cross_entropy")
    b = 8  # float64 here
    log(f"N={N}, b={b}: the slice check hands in {CHECK} B, then both hand in 3N*b = {3 * N * b} B; the all-gather "
        f"sends (W-1)*3N*b = {(world - 1) * 3 * N * b} B, all-reduces 6(W-1)/W*N*b = "
        f"{6 * (world - 1) * N * b // world} B")
    a = N * V // world * b
    log(f"bytes held besides the logits (slice A = N x V/W = {a} B; the full logits {N * V * b} B): ours peaks at "
        f"A{held_by['ours'] - a:+d} B (dlogits), keeps {N * (b + 10)} B = {b + 10} B a token; Megatron's peaks at "
        f"2A{held_by['megatron'] - 2 * a:+d} B and keeps A (its softmax)")


def section_dtypes(rank, world, device):
    head("3. bf16 and fp16 logits (fp32 inside), ignore_index, reduction, one token, every token ignored")
    target = tokens(device, world)
    ignored = torch.arange(N, device=device).view(B, T) % 5 == 2    # every fifth token
    configs = (("none", -100, 5 * B * V // world), ("mean", -100, N * V // world), ("sum", 7, 5 * B * V // world))
    for dtype in (torch.bfloat16, torch.float16):                  # 5 of T's rows, or all; at 8 ranks the mean
        z = (torch.randn(B, T, V, device=device) * 3).to(dtype)     # only (the reductions and ignore_index do not
        for reduction, ignore_index, work in configs[world > 4:][:3 if world <= 4 else 1]:  # depend on W)
            _, fwd, held = check_loss(OURS, z, target.masked_fill(ignored, ignore_index),
                                      chunk_numel=work, label_smoothing=0.1, reduction=reduction,
                                      keeps=loss_bytes(dtype, world, work, reduction)["kept"],
                                      ignore_index=ignore_index)
            assert fwd.calls == loss_calls(None, 4), "the fp32 numbers are gathered"
            assert_held(held, dtype, world, work, reduction=reduction)
        _, fwd, held = check_loss(MEGATRON, z, target, label_smoothing=0.1)
        assert fwd.calls == loss_calls(None, 4, megatron=True)
        assert_held(held, dtype, world, None, megatron=True)
        name = str(dtype).removeprefix("torch.")
        log(f"{name}: both forms' loss and dlogits, in {name}, equal F.cross_entropy in float64 within "
            f"rtol={TOL[dtype]['rtol']:.2g}")
    z = torch.randn(B, T, V, device=device, dtype=torch.float64)
    loss, _, _ = check_loss(OURS, z, torch.full_like(target, -100))  # the default: mean
    assert loss.isnan()
    lo, hi = m.vocab_range(V)
    for ignore_index in (-1, V):                                     # nanoGPT's -1; V, just outside the classes
        full, leaf = z.clone().requires_grad_(), z[..., lo:hi].clone().requires_grad_()
        ref = F.cross_entropy(full.view(N, V), target.masked_fill(ignored, ignore_index).view(N),
                              ignore_index=ignore_index)
        loss = OURS(leaf, target.masked_fill(ignored, ignore_index), ignore_index=ignore_index)
        ref.backward()
        loss.backward()
        torch.testing.assert_close((loss, leaf.grad), (ref, full.grad[..., lo:hi]))
    with traffic() as fwd:
        one = OURS(z[0, 0, slice(*m.vocab_range(V))], target[0, 0], reduction="none")
    assert fwd.calls == [("all_gather", ranks_of(None), CHECK), ("all_gather", ranks_of(None), 3 * 8)] * (world > 1)
    torch.testing.assert_close(one, F.cross_entropy(z[0, 0], target[0, 0], reduction="none"))  # shape () too
    assert one.shape == () and same_on_every_rank(one)
    for reduction in ("mean", "sum"):                                # unbatched, reduced: a scalar, as torch's
        one = OURS(z[0, 0, slice(*m.vocab_range(V))], target[0, 0], reduction=reduction)
        torch.testing.assert_close(one, F.cross_entropy(z[0, 0], target[0, 0], reduction=reduction))
    log("ignore_index -100 and 7 (inside [0, V)), -1 and V; reduction none, mean over the tokens not ignored, sum "
        "(at 8 ranks, bf16 and fp16: mean only); every token ignored: nan and grad 0, as F.cross_entropy; one token")


def torch_refuses(**options):
    """Whether F.cross_entropy itself refuses these options (on a 2 x 3 problem)."""
    z, t = torch.zeros(2, 3), options.pop("target", torch.tensor([0, 2]))
    try:
        F.cross_entropy(z, t, **options)
    except (RuntimeError, ValueError):
        return True
    return False


def section_refusals(rank, world, device):
    head("4. the losses' refusals at their boundary: one line on every rank")
    whole = torch.randn(B, T, V, device=device, dtype=torch.float64) * 3
    z = whole[..., slice(*m.vocab_range(V))]
    target = tokens(device, world)
    shape = f"target must hold int64 class indices of shape {(B, T)} (the logits' shape without the vocab dimension)"
    above, below = math.nextafter(1.0, 2.0), math.nextafter(0.0, -1.0)
    assert torch_refuses(label_smoothing=above) and not torch_refuses(label_smoothing=1.0)
    assert torch_refuses(target=torch.tensor([0, 2], dtype=torch.int32)) and torch_refuses(reduction="avg")
    for fn in (OURS, MEGATRON):
        for option, said in ((dict(label_smoothing=above), f"label_smoothing={above} must be a float in [0, 1]"),
                             (dict(label_smoothing=below), f"label_smoothing={below} must be a float in [0, 1]"),
                             (dict(label_smoothing=math.nan), "label_smoothing=nan must be a float in [0, 1]"),
                             (dict(label_smoothing=True), "label_smoothing=True must be a float in [0, 1]"),  # not 1
                             (dict(label_smoothing=None), "label_smoothing=None must be a float in [0, 1]"),
                             (dict(label_smoothing="0.1"), "label_smoothing='0.1' must be a float in [0, 1]"),
                             (dict(reduction="avg"), "reduction='avg'; use 'none', 'mean' or 'sum'"),
                             (dict(reduction="Mean"), "reduction='Mean'; use 'none', 'mean' or 'sum'"),
                             (dict(target=target.t()), f"{shape}; got torch.int64 {(T, B)}"),
                             (dict(target=target[..., None]), f"{shape}; got torch.int64 {(B, T, 1)}"),
                             (dict(target=target.double()), f"{shape}; got torch.float64 {(B, T)}"),
                             (dict(target=target.int()), f"{shape}; got torch.int32 {(B, T)}")):
            got = refused(lambda: fn(z, **{"target": target, **option}))  # on every rank alone, no collective
            assert got == said, (option, got)
        for eps in (0.0, 1.0):                                        # the boundaries pass, == F.cross_entropy
            full = whole.clone().requires_grad_()
            ref = F.cross_entropy(full.view(N, V), target.view(N), label_smoothing=eps)
            ref.backward()
            leaf = z.clone().requires_grad_()
            loss = fn(leaf, target, label_smoothing=eps)
            loss.backward()
            torch.testing.assert_close((loss, leaf.grad), (ref, full.grad[..., slice(*m.vocab_range(V))]))
    for option in ([dict(chunk_numel=c) for c in ("Auto", "", 2.5, 0, -1, True, False)] +
                   [dict(ignore_index=i) for i in (None, -1.0, "-100")]):
        name, value = next(iter(option.items()))
        said = (f"{name}={value!r}; pass 'auto', None (all rows at once) or an int >= 1" if name == "chunk_numel" else
                f"{name}={value!r}; pass an int, the target value to skip (-100 by default)")
        assert refused(lambda: OURS(z, target, **option)) == said, (option, said)
    full = whole.clone().requires_grad_()
    ref = F.cross_entropy(full.view(N, V), target.view(N))
    ref.backward()
    for chunk in (1, None):                                          # the boundary: one element (so one row), all
        leaf = z.clone().requires_grad_()
        OURS(leaf, target, chunk_numel=chunk).backward()
        torch.testing.assert_close(leaf.grad, full.grad[..., slice(*m.vocab_range(V))])
    first = divmod(int((torch.arange(N, device=device).view(B, T) % 5 == 2).view(-1).nonzero()[0]), T)  # (0, 2)
    bad_at = torch.arange(N, device=device).view(B, T) % 5 == 2
    for fn, bad, options, also in ((OURS, -1, {}, " or ignore_index=-100"), (OURS, V, {}, " or ignore_index=-100"),
                                   (OURS, -100, dict(ignore_index=-1), " or ignore_index=-1"),
                                   (OURS, V + 1, dict(ignore_index=V), f" or ignore_index={V}"),
                                   (MEGATRON, -100, {}, "")):         # Megatron's has no ignore_index
        said = f"target{list(first)}={bad} is not a class of the vocabulary: classes lie in [0, {V}){also}"
        wrong = target.masked_fill(bad_at, bad)
        assert refused(lambda: fn(z, wrong, check_slices=False, **options)) == said   # alone, no collective
        assert refused_everywhere(lambda: fn(z, wrong, **options)) == said        # after the slice check only
    log(f"refused, nothing sent: label_smoothing {above!r}, {below!r}, nan, True, None, '0.1' (0.0 and 1.0 pass, as "
        f"torch's; torch takes a negative as 0), reduction 'avg', 'Mean', a transposed, 3-d, float or int32 target, "
        f"chunk_numel 'Auto', '', 2.5, 0, -1, True, False (1 and None pass), ignore_index None, -1.0, '-100'")
    log(f"refused on every rank after the 16-B slice check (without it, before any message): {said}; targets -1 and "
        f"V (0 and V-1 pass), -100 under ignore_index=-1, V+1 under ignore_index=V")


def section_slices(rank, world, device):
    head("5. unequal vocabulary slices: refused by both losses and the gather, in one line, on every rank")
    if world == 1:
        log("one rank: no other slice to differ from (the check sends nothing)")
        return
    last = rank == world - 1
    f64 = dict(device=device, dtype=torch.float64)
    for tokens_last, columns_last in ((4, 3), (5, 4)):               # the issue's [4, 4] / [4, 3]; more tokens
        z = torch.randn(5, 4, **f64)[:tokens_last if last else 4, :columns_last if last else 4]  # RNG kept in step
        target = torch.full((len(z),), 4 * world - 1, device=device)  # a class only where the slices are 4 wide:
        # the slices are checked first, so the [4, 3] rank does not refuse it alone (the others waiting)
        widths = [(4, 4)] * (world - 1) + [(tokens_last, columns_last)]
        said = (f"the ranks' logits differ: (tokens, vocabulary columns) by rank {widths}; each must hand in the same "
                f"tokens, V/W columns")
        for call in (lambda: OURS(z, target), lambda: MEGATRON(z, target), lambda: m.gather_vocab_logits(z)):
            assert refused_everywhere(call) == said, said
    z = torch.randn(2, 3, 4, **f64)[:, :2 if last else 3]            # (2, 3, 4); the last rank (2, 2, 4): 4 tokens
    said = (f"the ranks' logits differ: (tokens, vocabulary columns) by rank {[(6, 4)] * (world - 1) + [(4, 4)]}; "
            f"each must hand in the same tokens, V/W columns")             # counted over every dim, not dim 0
    assert refused_everywhere(lambda: OURS(z, torch.zeros(z.shape[:-1], dtype=torch.int64, device=device))) == said
    z = torch.randn(world, 4, 4, **f64)[rank, :, :3 if last else 4]   # rank-dependent, the RNG in step
    loss = OURS(z, torch.tensor([0, 3, 1, 3], device=device), check_slices=False)   # what the check prevents:
    assert not same_on_every_rank(loss), "unequal slices, unchecked: a different loss on each rank"
    log(f"refused after one all-gather of {CHECK} B: {said}")
    log("unchecked (check_slices=False), [4, 4] and [4, 3] give each rank another loss, silently")


def section_subgroups(rank, world, device):
    head("6. every block on a sub-group whose group rank is not the global rank")
    group, _ = strided_groups(2)[rank % 2]                            # {0, 2, ..} and {1, 3, ..}
    lo, hi, _ = check_embedding(group, device)
    check_embedding(group, device, sequence_parallel=True)
    z = torch.randn(B, T, V, device=device, dtype=torch.float64)
    target = tokens(device, world)
    for megatron in (False, True):
        fn = MEGATRON if megatron else OURS
        _, fwd, _ = check_loss(fn, z, target, group, label_smoothing=0.1, reduction="sum")
        assert fwd.calls == loss_calls(group, 8, megatron)
    check_regions(group, device)
    check_lm_head(group, device)
    for dtype in (torch.float64, torch.bfloat16):
        check_gather(group, device, dtype)
    log_all(f"group {list(ranks_of(group))}, group rank {dist.get_rank(group)}: rows [{lo}, {hi})")
    log("embedding (SP too), f and g, LM head, both losses and the gather equal their references on the "
        "sub-groups, traffic on them only")


def section_lm_head(rank, world, device):
    head("7. the tied LM head and the sampler's gather on the world")
    check_regions(None, device)
    mine, dense = check_lm_head(None, device)
    for dtype in (torch.float64, torch.bfloat16):
        check_gather(None, device, dtype)
    log("f and g on rank-dependent transposed views: g sums the values over the ranks, f's backward the grads")
    log(f"loss, tied-weight grad shard and mixing grad == the dense model's; logits {mine} B a rank = 1/{world} of "
        f"{dense}; forward: 1 all-reduce (N*D={N * D}), the slice check, 1 all-gather (3N={3 * N}); backward: 1 "
        f"all-reduce")
    log("gather_vocab_logits, float64 and bf16, from a transposed view: exact; backward: this rank's columns")


def main():
    if launched_world_size() not in WORLDS:
        refuse(f"a vocabulary of {V} rows and {N} tokens fit {', '.join(map(str, WORLDS))} ranks, "
               f"not {launched_world_size()}")
    rank, world, device = setup()
    section_embedding(rank, world, device)
    section_loss(rank, world, device)
    section_dtypes(rank, world, device)
    section_refusals(rank, world, device)
    section_slices(rank, world, device)
    section_subgroups(rank, world, device)
    section_lm_head(rank, world, device)
    finish("07's blocks on the world and sub-groups, in float64, bf16 and fp16: exact or within one rounding of "
           "F.cross_entropy / nn.Embedding, traffic and bytes held to their closed forms, every refusal at its edge")


if __name__ == "__main__":
    main()
