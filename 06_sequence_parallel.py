"""06 - sequence parallelism: Megatron's (split what TP leaves whole) and Ulysses (all-to-all to heads).

Megatron SP (Korthikanti et al., 2022). Tensor parallelism runs LayerNorm, dropout and the residual on the whole
[s, b, h] activation on every rank. SP splits them along the sequence and cuts TP's all-reduce into its halves:

    TP:  x[s, b, h]     LN  f (identity)  fc1 GeLU fc2  g (all-reduce)   + x     every rank holds all of s
    SP:  x[s/tp, b, h]  LN  all-gather    fc1 GeLU fc2  reduce-scatter   + x     rank i holds s_i only
         R0 [s0]  --all-gather-->  R0 [s0 s1 s2 s3] ... R0 [s0 s1 s2 s3] partial  --reduce-scatter-->  R0 [s0]
         R1 [s1]                   R1 [s0 s1 s2 s3] ... R1 [s0 s1 s2 s3] partial                      R1 [s1]

Bytes each rank sends, V = s*b*h*bytes: all-gather (tp-1)/tp*V + reduce-scatter (tp-1)/tp*V = 2(tp-1)/tp*V, TP's
ring all-reduce exactly. SP buys activation memory: LayerNorm's input and output are kept at 1/tp (fc1 keeps its
[s/tp, b, h] input and all-gathers it again in backward, one more (tp-1)/tp*V, for that memory). The price: LN's
weight and bias and fc2's bias see a different slice of the sequence on each rank, so their gradients need one
all-reduce over the TP group (NVIDIA/Megatron-LM#443).

Overlap. fc1's backward starts the reduce-scatter of its input gradient with async_op=True and computes the weight
gradient into an fp32 `main_grad` while it travels (Megatron's gradient-accumulation fusion). On GPUs Megatron sets
CUDA_DEVICE_MAX_CONNECTIONS=1: with one hardware queue kernels start in launch order, so the NCCL kernel is running
before the weight-gradient GEMM takes the SMs (with several queues the GEMM may start first and the communication
wait behind it). gloo has no streams: its collectives run on gloo's own CPU threads over TCP and overlap the matmul
only when a core is free for those threads.

Ulysses (Jacobs et al., 2023). q, k, v arrive as [b, s/P, h, d]; an all-to-all each makes them [b, s, h/P, d],
attention runs over the whole sequence on h/P heads, and one more all-to-all brings the output back:

    R0 [s0 | h0 h1 h2 h3]  --all_to_all_4d(x, scatter_dim=2, gather_dim=1)-->  R0 [s0 s1 s2 s3 | h0]
    R1 [s1 | h0 h1 h2 h3]  <--all_to_all_4d(x, scatter_dim=1, gather_dim=2)--  R1 [s0 s1 s2 s3 | h1]

Each all-to-all sends (P-1)/P of a rank's [b, s/P, h*d] slice: in forward q, k, v and out send 4(P-1)/P^2 * V,
against 2(P-1)/P * V for Megatron SP's all-gather in and reduce-scatter out of the same layer: 2/P of it. h caps P.

    torchrun --nproc-per-node=4 06_sequence_parallel.py
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


# ---- building blocks: helpers ---------------------------------------------------------------------------
def _check_divisible(n: int, what: str, group):
    if n % dist.get_world_size(group):
        raise ValueError(f"{what}={n} is not divisible by the group size {dist.get_world_size(group)}")


def _split_along_first_dim(x, group):
    _check_divisible(x.size(0), "sequence length", group)
    return x.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()


def _gather_along_first_dim(x, group, async_op=False):
    out = x.new_empty((dist.get_world_size(group) * x.size(0), *x.shape[1:]))
    work = dist.all_gather_single(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def _reduce_scatter_along_first_dim(x, group, async_op=False):
    _check_divisible(x.size(0), "sequence length", group)
    out = x.new_empty((x.size(0) // dist.get_world_size(group), *x.shape[1:]))
    work = dist.reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return (out, work) if async_op else out


def _reduce(x, group):
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


# ---- building blocks: regions, each a forward op paired with its backward op (group=None: the world) ----
class _Region(torch.autograd.Function):
    """forward: fwd(x, group); backward: bwd(grad, group), the transpose of fwd. Each region names its pair."""
    @staticmethod
    def forward(ctx, x, fwd, bwd, group):
        ctx.bwd, ctx.group = bwd, group
        return fwd(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.group), None, None, None


def copy_to_tensor_model_parallel_region(x, group=None):
    """forward: identity; backward: all-reduce (TP's `f`)."""
    return _Region.apply(x, lambda t, g: t, _reduce, group)


def reduce_from_tensor_model_parallel_region(x, group=None):
    """forward: all-reduce; backward: identity (TP's `g`)."""
    return _Region.apply(x, _reduce, lambda t, g: t, group)


def scatter_to_sequence_parallel_region(x, group=None):
    """forward: keep this rank's slice of the sequence (dim 0, no comm); backward: all-gather. x is replicated."""
    return _Region.apply(x, _split_along_first_dim, _gather_along_first_dim, group)


def gather_from_sequence_parallel_region(x, group=None):
    """forward: all-gather along the sequence (dim 0); backward: reduce-scatter."""
    return _Region.apply(x, _gather_along_first_dim, _reduce_scatter_along_first_dim, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    """forward: reduce-scatter along the sequence (dim 0); backward: all-gather."""
    return _Region.apply(x, _reduce_scatter_along_first_dim, _gather_along_first_dim, group)


class LinearWithSequenceParallel(torch.autograd.Function):
    """forward: all-gather x, then x @ W.T + b; backward: grad_x = grad @ W, reduce-scattered async while dW is
    accumulated into W.main_grad (fp32, or the weight's dtype if wider; created on first use). W gets no .grad.

        x: [s/tp, b, h] this rank's slice     W: [f/tp, h] this rank's rows     out: [s, b, f/tp]
    Only the [s/tp, b, h] slice is kept for backward, which all-gathers it again (overlapping grad @ W).
    """
    @staticmethod
    def forward(ctx, x, weight, bias=None, group=None):
        if not hasattr(weight, "main_grad"):
            weight.main_grad = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        # main_grad rides on ctx: a saved tensor can come back as another Python object (saved-tensor hooks)
        ctx.group, ctx.main_grad, ctx.has_bias = group, weight.main_grad, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_along_first_dim(x, group), weight, bias)          # [s, b, h] @ [h, f/tp]

    @staticmethod
    def backward(ctx, grad):                                                      # grad: [s, b, f/tp]
        x, weight = ctx.saved_tensors
        total, gathering = _gather_along_first_dim(x, ctx.group, async_op=True)   # [s, b, h], in flight
        grad_input = grad.matmul(weight)                                          # [s, b, h], partial over ranks
        gathering.wait()
        grad_x, scattering = _reduce_scatter_along_first_dim(grad_input, ctx.group, async_op=True)  # [s/tp, b, h]
        main = ctx.main_grad                       # while the reduce-scatter travels: dW += grad.T @ total
        main.addmm_(grad.flatten(0, -2).t().to(main.dtype), total.flatten(0, -2).to(main.dtype))
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        scattering.wait()
        return grad_x, None, grad_bias, None


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
    under SP each rank applied them to its own slice of the sequence (NVIDIA/Megatron-LM#443)."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def _all_to_all(x, scatter_dim, gather_dim, group):
    send = torch.stack(x.chunk(dist.get_world_size(group), dim=scatter_dim))   # send[j]: what rank j gets
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                             # recv[j]: what rank j sent
    return torch.cat(recv.unbind(0), dim=gather_dim)


def all_to_all_4d(x, scatter_dim: int, gather_dim: int, group=None):
    """forward: all-to-all that splits scatter_dim and concatenates gather_dim; backward: the swapped all-to-all.
    [b, s/P, h, d] -> [b, s, h/P, d] with (scatter_dim=2, gather_dim=1); (1, 2) goes back."""
    if x.dim() != 4 or scatter_dim == gather_dim or not {scatter_dim, gather_dim} <= {0, 1, 2, 3}:
        raise ValueError(f"all_to_all_4d takes a [b, s, h, d] tensor and two different dims in 0..3, got shape "
                         f"{tuple(x.shape)}, scatter_dim={scatter_dim}, gather_dim={gather_dim}")
    _check_divisible(x.size(scatter_dim), ("batch", "sequence", "heads", "head_dim")[scatter_dim], group)
    return _Region.apply(x, lambda t, g: _all_to_all(t, scatter_dim, gather_dim, g),
                         lambda t, g: _all_to_all(t, gather_dim, scatter_dim, g), group)


def ulysses_attention(q, k, v, is_causal: bool = False, group=None):
    """Attention over the whole sequence from [b, s/P, h, d] slices of q, k, v; returns the output's slice."""
    q, k, v = (all_to_all_4d(t, 2, 1, group).transpose(1, 2) for t in (q, k, v))         # [b, h/P, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)                     # [b, h/P, s, d]
    return all_to_all_4d(out.transpose(1, 2), 1, 2, group)                                 # [b, s/P, h, d]


# ---- demo -----------------------------------------------------------------------------------------------
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402  (the demo's, not the blocks')
from common import finish, head, launched_world_size, log, refuse, setup, time_overlap  # noqa: E402


class CommCounter(CommDebugMode):
    """CommDebugMode counts collectives; this also sums the bytes this rank sends under ring algorithms, read off
    the tensors each c10d op is handed, with n = the world size (the demo uses no sub-group)."""
    # op: (name, bytes sent); a = the op's args: allreduce_ takes [tensor] first, the others (out, in) first
    SENDS = {torch.ops.c10d.allreduce_: ("all-reduce", lambda a, n: 2 * (n - 1) * a[0][0].nbytes // n),
             torch.ops.c10d._allgather_base_: ("all-gather", lambda a, n: (n - 1) * a[1].nbytes),
             torch.ops.c10d._reduce_scatter_base_: ("reduce-scatter", lambda a, n: (n - 1) * a[0].nbytes),
             torch.ops.c10d.alltoall_base_: ("all-to-all", lambda a, n: (n - 1) * a[1].nbytes // n)}
    sent = 0                   # bytes; `self.sent += ...` gives each counter its own

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "overloadpacket", None) in self.SENDS:
            self.sent += self.SENDS[func.overloadpacket][1](args, dist.get_world_size())
        return super().__torch_dispatch__(func, types, args, kwargs)

    def counts(self):
        return {self.SENDS[op][0]: n for op, n in self.get_comm_counts().items()}


def kept_for_backward(fn, params):
    """Run fn(); return its result and the bytes of activations autograd keeps for backward (params excluded)."""
    skip, kept = {p.data_ptr() for p in params}, {}

    def pack(t):
        if t.data_ptr() not in skip:   # views of one storage count once
            kept[t.data_ptr()] = max(t.nbytes, kept.get(t.data_ptr(), 0))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


def ints(shape, seed, device):
    """Integer-valued float64 from a seed, so any rank can rebuild any rank's tensor and sums are exact."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).double().to(device)


def adjoint_checked(op, x, replicated=False):
    """op(x), after asserting sum over ranks <op(x), y> == sum over ranks <x, op's backward(y)> exactly, for a
    y different on every rank. A replicated x is one tensor held by every rank: its side counts once (rank 0's)."""
    x = x.clone().requires_grad_()
    out = op(x)
    y = ints(out.shape, 1000 + dist.get_rank(), x.device)
    (g,) = torch.autograd.grad(out, x, y)
    sides = torch.stack([(out * y).sum(), (x * g).sum() * (dist.get_rank() == 0 or not replicated)]).detach()
    dist.all_reduce(sides)
    assert sides[0] == sides[1], f"adjoint test: {sides.tolist()}"
    return out.detach()


S, B, NH, D = 16, 2, 8, 4      # [s, b] and Ulysses' 8 heads of 4
H, FFN = NH * D, 64            # the MLP block's width (the attention layer's, so their bytes compare) and fc1's


def main():
    W = launched_world_size()
    if 8 % W:
        refuse(f"world size {W} does not divide 8 heads, sequence {S} and ffn {FFN}: use 1, 2, 4 or 8")
    rank, P, device = setup()
    e, f64 = 8, dict(dtype=torch.float64, device=device)   # bytes per float64

    head("the sequence-parallel regions: values and adjoints, on rank-dependent inputs")
    x = ints((2, 3), rank, device)                                         # rank r holds its own [2, 3]
    every = torch.cat([ints((2, 3), q, device) for q in range(P)])         # [2P, 3]: every rank's x in order, on all
    assert torch.equal(adjoint_checked(gather_from_sequence_parallel_region, x), every)
    partial, total = (rank + 1) * every, P * (P + 1) // 2 * every          # rank r's partial sums; their sum
    assert torch.equal(adjoint_checked(reduce_scatter_to_sequence_parallel_region, partial), total.chunk(P)[rank])
    assert torch.equal(adjoint_checked(scatter_to_sequence_parallel_region, every, True), every.chunk(P)[rank])
    log("gather = all-gather, reduce_scatter = sum then slice, scatter = slice: exact values on every rank")
    log("adjoint: sum over ranks <op(x), y> == <x, op_backward(y)> for all three (scatter's replicated x once)")

    head(f"an MLP block on [s, b, h] = [{S}, {B}, {H}], ffn {FFN}: dense == TP == SP, forward and backward")
    dense = {k: v.to(**f64).requires_grad_() for k, v in {                 # the whole block's parameters
        "ln_w": 1 + 0.1 * torch.randn(H), "ln_b": 0.1 * torch.randn(H), "w1": torch.randn(FFN, H) / H ** .5,
        "b1": 0.1 * torch.randn(FFN), "w2": torch.randn(H, FFN) / FFN ** .5, "b2": 0.1 * torch.randn(H)}.items()}
    x, dy = torch.randn(S, B, H, **f64), torch.randn(S, B, H, **f64)      # input, upstream gradient
    x_ref = x.clone().requires_grad_()
    ref = x_ref + F.linear(F.gelu(F.linear(F.layer_norm(x_ref, (H,), dense["ln_w"], dense["ln_b"]),
                                           dense["w1"], dense["b1"])), dense["w2"], dense["b2"])
    (ref * dy).sum().backward()
    rows = slice(rank * FFN // P, (rank + 1) * FFN // P)
    shard = lambda k, t: t[:, rows] if k == "w2" else t[rows] if k in ("w1", "b1") else t   # this rank's part
    runs = {}
    for sp in (False, True):
        p = {k: shard(k, v.detach()).clone().requires_grad_() for k, v in dense.items()}
        for k in ("ln_w", "ln_b", "b2"):
            p[k].sequence_parallel = True
        xin = (x.chunk(P)[rank] if sp else x).clone().requires_grad_()
        with CommCounter() as fwd:
            y, kept = kept_for_backward(lambda: mlp_block(xin, p, sp), p.values())
        with CommCounter() as bwd:
            (y * (dy.chunk(P)[rank] if sp else dy)).sum().backward()
        runs[sp] = dict(p=p, x=xin, y=y, fwd=fwd, bwd=bwd, kept=kept)
    tp, sp = runs[False], runs[True]
    torch.testing.assert_close(tp["y"], ref)
    torch.testing.assert_close(sp["y"], tp["y"].chunk(P)[rank])
    torch.testing.assert_close(tp["x"].grad, x_ref.grad)
    torch.testing.assert_close(sp["x"].grad, tp["x"].grad.chunk(P)[rank])
    for k in ("w1", "b1", "w2"):
        torch.testing.assert_close(tp["p"][k].grad, shard(k, dense[k].grad))
        torch.testing.assert_close(sp["p"][k].main_grad if k == "w1" else sp["p"][k].grad, tp["p"][k].grad)
    log(f"output, x grad, fc1 and fc2 grads: SP == TP == dense, each rank computing s/tp = {S // P} rows of LN")
    off = max((sp["p"][k].grad - dense[k].grad).abs().max().item() for k in ("ln_w", "ln_b", "b2"))
    assert P == 1 or off > 1e-3
    log(f"LN weight, LN bias, fc2 bias grads as each rank has them: off by up to {off:.3f} (each saw s/tp)")
    with CommCounter() as fix:
        allreduce_sequence_parallel_grads(sp["p"].values())
    for k in ("ln_w", "ln_b", "b2"):
        torch.testing.assert_close(tp["p"][k].grad, dense[k].grad)
        torch.testing.assert_close(sp["p"][k].grad, dense[k].grad)
    assert fix.counts() == {"all-reduce": 1} and fix.sent == 2 * (P - 1) * 3 * H * e // P
    log(f"after one all-reduce of those {3 * H} values ({fix.sent} B sent): equal to dense (Megatron-LM#443)")

    head("one block's traffic and activation memory, TP vs SP, measured")
    V = S * B * H * e
    ring = 2 * (P - 1) * V // P                      # a ring all-reduce of V, or an all-gather plus a reduce-scatter
    assert tp["fwd"].counts() == tp["bwd"].counts() == {"all-reduce": 1} and tp["fwd"].sent == tp["bwd"].sent == ring
    assert sp["fwd"].counts() == {"all-gather": 1, "reduce-scatter": 1} and sp["fwd"].sent == ring
    assert sp["bwd"].counts() == {"all-gather": 2, "reduce-scatter": 1} and sp["bwd"].sent == ring + (P - 1) * V // P
    log(f"forward:  TP 1 all-reduce, SP all-gather + reduce-scatter: each sends 2(tp-1)/tp*V = {ring} B, V = {V} B")
    log(f"backward: TP {ring} B; SP {sp['bwd'].sent} B = the same + (tp-1)/tp*V, fc1 gathering its input again")
    ln = (2 * S * B * H + 2 * S * B) * e             # LN's input and output (fc1's input), LN's mean and rstd
    act = 2 * S * B * (FFN // P) * e                 # fc1's output (GeLU's input) and GeLU's output, [s, b, f/tp]
    assert tp["kept"] == ln + act and sp["kept"] == ln // P + act
    log(f"kept for backward: TP {tp['kept']} B, SP {sp['kept']} B: LN in/out/stats {ln} B -> {ln // P} B (1/tp)")

    head("overlap: grad_x's reduce-scatter travels while dW accumulates into main_grad")
    g_out = torch.randn(S, B, FFN, **f64)[..., rows]                      # fc1's output gradient, [s, b, f/tp]
    plain = [t.detach().clone().requires_grad_() for t in (x.chunk(P)[rank], dense["w1"][rows], dense["b1"][rows])]
    fused = [t.detach().clone().requires_grad_() for t in plain]          # x slice, fc1's rows of W and b
    (F.linear(gather_from_sequence_parallel_region(plain[0]), *plain[1:]) * g_out).sum().backward()  # synchronous
    for _ in range(2):                                                                          # two micro-batches
        (LinearWithSequenceParallel.apply(*fused) * g_out).sum().backward()
    for got, want in zip((fused[0].grad, fused[1].main_grad, fused[2].grad), (t.grad for t in plain)):
        torch.testing.assert_close(got, 2 * want)
    w_bf16 = plain[1].detach().bfloat16().requires_grad_()                 # bf16 weights: main_grad is fp32
    LinearWithSequenceParallel.apply(plain[0].detach().bfloat16(), w_bf16).sum().backward()
    assert fused[1].grad is None and w_bf16.grad is None and w_bf16.main_grad.dtype == torch.float32
    log("async reduce-scatter, dW into main_grad == gather region + autograd, 2 micro-batches; bf16 W: fp32 main_grad")
    grad_x = torch.randn(64, 4, 64, device=device)                        # timing: grad_x [s, b, h] fp32
    g2, t2, dw = (torch.randn(*shape, device=device) for shape in ((256, 256 // P), (256, 64), (256 // P, 64)))
    t = time_overlap(lambda: _reduce_scatter_along_first_dim(grad_x, None, async_op=True)[1],
                     lambda: dw.addmm_(g2.t(), t2), device, iters=2)    # dW [f/tp, h] += grad.T @ total
    log(f"reduce-scatter {t['comm'] * 1e3:.2f} ms + dW {t['compute'] * 1e3:.2f} ms one after the other, "
        f"{t['overlapped'] * 1e3:.2f} ms overlapped (printed, not asserted)")

    head(f"Ulysses: all_to_all_4d on q [b, s/P, h, d] = [{B}, {S // P}, {NH}, {D}]")
    q = ints((B, S // P, NH, D), 30 + rank, device)                      # rank r: sequence slice r, all heads
    full = torch.cat([ints((B, S // P, NH, D), 30 + j, device) for j in range(P)], dim=1)   # [b, s, h, d]
    out = adjoint_checked(lambda t: all_to_all_4d(t, 2, 1), q)
    assert torch.equal(out, full.chunk(P, dim=2)[rank]) and torch.equal(all_to_all_4d(out, 1, 2), q)
    log(f"{list(q.shape)} -> [b, s, h/P, d] {list(out.shape)}: the whole sequence, heads slice r; and back")
    log("adjoint: sum over ranks <a2a(x), y> == <x, swapped a2a(y)>, exact")
    for bad, dims in (((B, 2, P + 1, D), (2, 1)), ((B, S // P + 1, NH // P, D), (1, 2))) if P > 1 else ():
        try:
            all_to_all_4d(torch.zeros(bad, device=device), *dims)
            raise AssertionError(f"shape {bad} accepted")
        except ValueError as err:
            assert "not divisible by the group size" in str(err)
            log(f"refused {list(bad)}: ValueError: {err}")

    head("Ulysses attention == F.scaled_dot_product_attention on the whole sequence")
    qkv, dout = [torch.randn(B, S, NH, D, **f64) for _ in range(3)], torch.randn(B, S, NH, D, **f64)
    mine = lambda t: t.chunk(P, dim=1)[rank]                             # this rank's slice of the sequence
    for causal in (False, True):
        ref_in = [t.clone().requires_grad_() for t in qkv]
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref_in), is_causal=causal).transpose(1, 2)
        my_in = [mine(t).clone().requires_grad_() for t in qkv]
        with CommCounter() as uly:
            out = ulysses_attention(*my_in, is_causal=causal)
        torch.testing.assert_close(out, mine(ref))
        for a, b in zip(torch.autograd.grad(out, my_in, mine(dout)), torch.autograd.grad(ref, ref_in, dout)):
            torch.testing.assert_close(a, mine(b))                       # dq, dk, dv
    log(f"causal and not: output, dq, dk, dv equal full attention; each rank ran {NH // P} of {NH} heads")
    assert uly.counts() == {"all-to-all": 4} and uly.sent == 4 * (P - 1) * V // P ** 2 and uly.sent * P == 2 * ring
    log(f"forward bytes per rank, V = b*s*h*d*bytes = {V} B: Ulysses' 4 all-to-alls send 4(P-1)/P^2*V = {uly.sent} B")
    log(f"Megatron SP's all-gather in + reduce-scatter out (the MLP block's) send 2(P-1)/P*V = {ring} B: Ulysses 2/P")

    finish("SP regions and adjoints, MLP block SP == TP == dense with LN grads all-reduced, SP traffic and "
           "memory, async reduce-scatter overlap, Ulysses all-to-all and attention")


if __name__ == "__main__":
    main()
