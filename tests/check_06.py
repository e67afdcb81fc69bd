"""What this proves beyond 06's lesson: every block on the world and on sub-groups whose group rank is not the
global rank, on strided (non-contiguous) inputs; the regions' values and adjoints along dims 0 and 1; the MLP block
under TP and SP, on [s, b, h] and batch-first [b, s, h] (sequence_dim=1), with its traffic and activation bytes to the
byte; the SP linear (both layouts) in a plain model with a torch optimizer, under saved-tensor hooks and in a
wrapper's main_grad handshake (fused, declined, tied), sequence_dim refused at its edges; Ulysses and ring
attention with MHA, GQA and MQA, causal and not, in every layout, fp64 and bf16, with their messages counted and
replayed as blocking sends; RoPE against a complex-number reference; the fused kernel against the explicit block,
the work it is asked for and the bytes a ring step holds, to the byte; every refusal at its boundary."""
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, launched_world_size, log, refuse, ring_bytes, setup, traffic  # noqa: E402
from tests.tools import kept_for_backward, lesson, memory, refused, replays, strided_groups  # noqa: E402

m = lesson("06_sequence_parallel.py")
S, B, H, FFN, NH, KV, D = m.S, m.B, m.H, m.FFN, m.NH, m.KV, m.D
LAYOUTS = (("bshd", (1, 0, 2, 3)), ("bhsd", (1, 2, 0, 3)))   # flash-attn's [b, s, h, d], nanoGPT's [b, h, s, d]


def every_size():
    """Whether to run the variants that do not depend on P (layouts, MQA, MHA in bf16, the wrapper's handshake, the
    explicit ring): at 1 to 4 ranks, not again at 8 (the suite's time); what depends on P (values, bytes, replays,
    memory) runs at every size."""
    return dist.get_world_size() <= 4


# ---- instruments --------------------------------------------------------------------------------------------
def members(group):
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def sent(t, ranks=None):
    """The lesson's bytes on the wire, after asserting every call ran on the group of global `ranks`."""
    assert ranks is None or all(r == tuple(ranks) for _, r, _ in t.calls), (t.calls, ranks)
    return m.sent(t)


def ints(shape, seed, device):
    """Integer-valued float64 from a seed, so any rank can rebuild any rank's tensor and sums are exact."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).double().to(device)


def vjp(out, inputs, dout):
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


def sdpa(q, k, v, causal, layout="sbhd"):
    """One process, the whole sequence, in `layout`; GQA by enable_gqa."""
    to, back = m._LAYOUTS[layout], m._BACK[layout]
    out = F.scaled_dot_product_attention(*(t.permute(to) for t in (q, k, v)), is_causal=causal, enable_gqa=True)
    return out.permute(back)


def bf16_within(mine, one, ref, shard, roundings):
    """Each of mine (bf16 output, dq, dk, dv on this rank's shard) is off the float64 reference by at most what
    one-process bf16 SDPA is off (one) plus `roundings` bf16 roundings of the largest value; the worst ratio."""
    worst = 0
    for got, theirs, want in zip(mine, one, ref):
        want = shard(want)
        err, sdpa_err = ((x.double() - want).abs().max().item() for x in (got, shard(theirs)))
        assert err <= sdpa_err + roundings * 2 ** -8 * want.abs().max().item(), (err, sdpa_err)
        worst = max(worst, err / sdpa_err)
    return worst


def rejected(call, starts):
    said = refused(call)
    assert said.startswith(starts), (said, starts)
    return said


# ---- the regions ------------------------------------------------------------------------------------------------
def regions(groups, device):
    for group in groups:
        ranks, P, r = members(group), dist.get_world_size(group), dist.get_rank(group)
        for dim in (0, 1):                                                   # [s, b, h] and batch-first [b, s, h]
            shape = [3, 3, 3]
            shape[dim] = 2                                                   # each rank's slice: 2 rows along dim
            every = torch.cat([ints(shape, g, device) for g in ranks], dim)  # every member's slice, in group order
            x = strided(ints(shape, dist.get_rank(), device))
            kw = {} if dim == 0 else {"dim": dim}                            # dim 0: the public default
            gathered = adjoint_checked(lambda t: m.gather_from_sequence_parallel_region(t, group, **kw), x, group)
            assert torch.equal(gathered, every)
            partial, total = strided((r + 1) * every), P * (P + 1) // 2 * every   # rank r's partial sums; sum
            out = adjoint_checked(lambda t: m.reduce_scatter_to_sequence_parallel_region(t, group, **kw), partial,
                                  group)
            assert torch.equal(out, total.chunk(P, dim)[r])
            out = adjoint_checked(lambda t: m.scatter_to_sequence_parallel_region(t, group, **kw), strided(every),
                                  group, replicated=True)
            assert torch.equal(out, every.chunk(P, dim)[r]) and out.is_contiguous()
        mine = ints((3, 4), 50 + dist.get_rank(), device)                    # f and g on a caller's tensor
        keep, x = mine.clone(), ints((3, 4), 60, device).requires_grad_()
        summed = m.reduce_from_tensor_model_parallel_region(mine, group)
        same = m.copy_to_tensor_model_parallel_region(x, group)
        assert same.data_ptr() == x.data_ptr()                               # f's forward: x itself, no copy
        (g,) = torch.autograd.grad(same, x, mine)
        want = sum(ints((3, 4), 50 + s, device) for s in ranks)
        assert torch.equal(summed, want) and torch.equal(g, want) and torch.equal(mine, keep)   # mine left alone
        assert P > 1 or summed.data_ptr() == mine.data_ptr()                 # one rank: a no-op, no copy
    W = dist.get_world_size()
    for op in (m.reduce_scatter_to_sequence_parallel_region, m.scatter_to_sequence_parallel_region):
        assert op(torch.zeros(2 * W, 1, device=device)).shape == (2, 1)      # the last valid: 2W rows
        if W > 1:                                                            # W + 1 rows do not split over W
            rejected(lambda: op(torch.zeros(W + 1, 1, device=device)),
                     f"x.shape[0]={W + 1} is not divisible by the group size {W}")
    log("gather, reduce-scatter, scatter: values and adjoints exact, dims 0 and 1, strided inputs, world and "
        f"sub-groups {members(groups[-1])}, ..; f no copy, g leaves the caller's tensor; W + 1 rows refused")


# ---- the MLP block: TP and SP, its traffic and the bytes it keeps --------------------------------------------
def mlp_runs(dense, x, dy, group):
    """TP (False), SP on [s/tp, b, h] (True) and SP on batch-first [b, s/tp, h] ("bf", sequence_dim=1; its output
    and dx handed back in [s, b, h] order, to compare)."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    rows = slice(r * FFN // P, (r + 1) * FFN // P)
    shard = lambda k, t: t[:, rows] if k == "w2" else t[rows] if k in ("w1", "b1") else t
    runs = {"shard": shard}
    for sp in (False, True, "bf"):
        p = {k: shard(k, v.detach()).clone().requires_grad_() for k, v in dense.items()}
        for k in ("ln_w", "ln_b", "b2"):
            p[k].sequence_parallel = True
        seq = int(sp == "bf")
        xin = (x.chunk(P)[r] if sp else x).movedim(0, seq).clone(memory_format=torch.contiguous_format)  # its own
        xin.requires_grad_()                                                                            # storage
        with traffic() as fwd:
            y, kept = kept_for_backward(lambda: m.mlp_block(xin, p, bool(sp), group, sequence_dim=seq), p.values(),
                                        [xin])
        with traffic() as bwd:
            (y * strided((dy.chunk(P)[r] if sp else dy).movedim(0, seq))).sum().backward()
        runs[sp] = dict(p=p, x=SimpleNamespace(grad=xin.grad.movedim(seq, 0)), y=y.movedim(seq, 0), fwd=fwd, bwd=bwd,
                        kept=kept)
    return runs


def mlp(groups, device):
    f64 = dict(dtype=torch.float64, device=device)
    dense = {k: v.to(**f64).requires_grad_() for k, v in {
        "ln_w": 1 + 0.1 * torch.randn(H), "ln_b": 0.1 * torch.randn(H), "w1": torch.randn(FFN, H) / H ** .5,
        "b1": 0.1 * torch.randn(FFN), "w2": torch.randn(H, FFN) / FFN ** .5, "b2": 0.1 * torch.randn(H)}.items()}
    x, dy = torch.randn(S, B, H, **f64), torch.randn(S, B, H, **f64)
    x_ref = x.clone().requires_grad_()
    ref = x_ref + F.linear(F.gelu(F.linear(F.layer_norm(x_ref, (H,), dense["ln_w"], dense["ln_b"]),
                                           dense["w1"], dense["b1"])), dense["w2"], dense["b2"])
    (ref * dy).sum().backward()
    V, e = S * B * H * 8, 8                                                  # activation bytes; bytes per float64
    for group in groups:
        P, r, ranks = dist.get_world_size(group), dist.get_rank(group), members(group)
        runs = mlp_runs(dense, x, dy, group)
        tp, sp, bf, shard = runs[False], runs[True], runs["bf"], runs["shard"]
        torch.testing.assert_close(tp["y"], ref)
        torch.testing.assert_close(tp["x"].grad, x_ref.grad)
        for k in ("w1", "b1", "w2"):
            torch.testing.assert_close(tp["p"][k].grad, shard(k, dense[k].grad))
        for run in (sp, bf):                                                     # [s/tp, b, h], [b, s/tp, h]
            torch.testing.assert_close(run["y"], tp["y"].chunk(P)[r])
            torch.testing.assert_close(run["x"].grad, tp["x"].grad.chunk(P)[r])
            for k in ("w1", "b1", "w2"):
                torch.testing.assert_close(run["p"][k].grad, tp["p"][k].grad)    # fc1's dW in W.grad
                assert run["p"][k].grad.is_contiguous(), k
            for k in ("ln_w", "ln_b", "b2"):                                     # partial sums, the same
                torch.testing.assert_close(run["p"][k].grad, sp["p"][k].grad)
            assert not hasattr(run["p"]["w1"], "main_grad")                      # the layer makes none itself
        assert dict(bf["fwd"].counts) == dict(sp["fwd"].counts) and dict(bf["bwd"].counts) == dict(sp["bwd"].counts)
        assert (sent(bf["fwd"], ranks), sent(bf["bwd"], ranks)) == (sent(sp["fwd"], ranks), sent(sp["bwd"], ranks))
        assert bf["kept"] == sp["kept"], (bf["kept"], sp["kept"])   # LN's x; fc1 a copy of LN's out, not LN's out
        off = max((sp["p"][k].grad - dense[k].grad).abs().max().item() for k in ("ln_w", "ln_b", "b2"))
        assert P == 1 or off > 1e-3                                              # each rank saw s/tp rows
        b2 = sp["p"]["b2"]
        b2.main_grad, b2.grad = b2.grad, None               # as a data-parallel wrapper keeps it (read from there)
        with traffic() as fix:
            m.allreduce_sequence_parallel_grads(sp["p"].values(), group)
        with traffic() as unmarked:                                   # none marked sequence_parallel: nothing to do
            m.allreduce_sequence_parallel_grads([sp["p"]["w1"], sp["p"]["w2"]], group)
        assert not unmarked.calls, unmarked.calls
        for k in ("ln_w", "ln_b", "b2"):
            torch.testing.assert_close(tp["p"][k].grad, dense[k].grad)
            torch.testing.assert_close(sp["p"][k].main_grad if k == "b2" else sp["p"][k].grad, dense[k].grad)
        expect = lambda **counts: counts if P > 1 else {}   # a group of one rank issues no collective
        assert dict(fix.counts) == expect(all_reduce=1) and sent(fix, ranks) == 2 * (P - 1) * 3 * H * e // P
        ring = 2 * (P - 1) * V // P                   # a ring all-reduce of V, or an all-gather plus a reduce-scatter
        assert dict(tp["fwd"].counts) == dict(tp["bwd"].counts) == expect(all_reduce=1)
        assert sent(tp["fwd"], ranks) == sent(tp["bwd"], ranks) == ring
        assert dict(sp["fwd"].counts) == expect(all_gather=1, reduce_scatter=1) and sent(sp["fwd"], ranks) == ring
        assert dict(sp["bwd"].counts) == expect(all_gather=2, reduce_scatter=1)
        assert sent(sp["bwd"], ranks) == ring + (P - 1) * V // P
        ln = (2 * S * B * H + 2 * S * B) * e          # LN's input and output (fc1's input), LN's mean and rstd
        act = 2 * S * B * (FFN // P) * e              # fc1's output (GeLU's input) and GeLU's output, [s, b, f/tp]
        assert tp["kept"] == ln + act and sp["kept"] == ln // P + act, (tp["kept"], sp["kept"])
    log("MLP block: TP == SP == dense (output, dx, every grad), LN grads off before and exact after the all-reduce "
        "(fc2 bias's read from main_grad), unmarked params send nothing; TP and SP collectives and bytes == closed "
        "forms; kept for backward: TP LN + act, SP LN/tp + act, to the byte; world and sub-groups")
    log("batch-first [b, s/tp, h] (sequence_dim=1) == [s/tp, b, h]: output, dx, every grad, the collectives, the "
        "bytes sent and kept")


# ---- the SP linear: in a plain model, and in a wrapper's main_grad handshake ------------------------------------
def handshake(inputs, g_out, group, tied=True):
    """A data-parallel wrapper's side of Megatron's handshake, as 09's is: W.main_grad a view of a flat bucket,
    W.grad_added_to_main_grad = False, and a post-accumulate-grad hook that adds W.grad into main_grad only when
    `not W.grad_added_to_main_grad or W.zero_out_wgrad`, then drops it. Micro-batch 2 runs under saved-tensor hooks
    that hand W back as another object: main_grad must still land on W. Also declined (fusion=False), and tied."""
    ids = torch.arange(inputs[1].shape[0], device=g_out.device).flip(0).repeat(3)   # every row of W, 3 times
    g_emb = ints((len(ids), H), 77 + dist.get_rank(), g_out.device)
    if tied:
        w_ref = inputs[1].detach().clone().requires_grad_()                        # dense: autograd, both uses
        ((F.linear(m.gather_from_sequence_parallel_region(inputs[0].detach(), group), w_ref, inputs[2].detach())
          * g_out).sum() + (F.embedding(ids, w_ref) * g_emb).sum()).backward()
    main = {}
    cases = ((False, False, True), (False, False, False), (True, True, True), (True, False, True))
    for tie, zero_out, fusion in cases[:4 if tied else 2]:
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
        for micro in range(2):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach() if micro else t, lambda t: t):
                loss = (m.LinearWithSequenceParallel.apply(x, w, b, group, fusion) * g_out).sum()
            (loss + (F.embedding(ids, w) * g_emb).sum() if tie else loss).backward()
        assert fired == [(fusion, w.shape)] * 2 and w.grad is None and not bucket[:3].any(), fired
        torch.testing.assert_close(x.grad, 2 * inputs[0].grad)
        main[tie, zero_out, fusion] = w.main_grad
    linear_dw = 2 * inputs[1].grad                                    # the linear's dW alone, 2 micro-batches
    torch.testing.assert_close(main[False, False, True], linear_dw)   # untied: the empty placeholder, dropped
    torch.testing.assert_close(main[False, False, False], linear_dw)  # declined: dW in W.grad, the hook adds it
    if not tied:
        return
    torch.testing.assert_close(main[True, True, True], 2 * w_ref.grad)    # tied: == autograd over both uses
    torch.testing.assert_close(main[True, False, True], linear_dw)        # no zero_out_wgrad: the lookup's dW lost
    assert not torch.allclose(main[True, False, True], main[True, True, True])


def linear(groups, device):
    f64 = dict(dtype=torch.float64, device=device)
    x, w, b = torch.randn(S, B, H, **f64), torch.randn(FFN, H, **f64), torch.randn(FFN, **f64)
    g_out = torch.randn(S, B, FFN, **f64)
    for group in groups:
        P, r = dist.get_world_size(group), dist.get_rank(group)
        rows = slice(r * FFN // P, (r + 1) * FFN // P)
        plain = [t.clone().requires_grad_() for t in (x.chunk(P)[r], w[rows], b[rows])]  # x slice, fc1's rows
        (F.linear(m.gather_from_sequence_parallel_region(plain[0], group), *plain[1:]) * g_out[..., rows]).sum() \
            .backward()                                                                         # synchronous
        mine = [t.detach().clone().requires_grad_() for t in plain]
        y, kept = kept_for_backward(lambda: m.LinearWithSequenceParallel.apply(*mine, group), mine[1:], mine[:1])
        assert kept == mine[0].nbytes, kept               # its own [s/tp, b, h] slice: no copy, nothing gathered
        (y * strided(g_out[..., rows])).sum().backward()                                        # micro-batch 1
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):      # 2: saved tensors
            y = m.LinearWithSequenceParallel.apply(*mine, group)                               # as other objects
        (y * strided(g_out[..., rows])).sum().backward()
        for got, want in zip((t.grad for t in mine), (t.grad for t in plain)):
            torch.testing.assert_close(got, 2 * want)                  # accumulated in .grad, as nn.Linear's
        assert mine[1].grad.is_contiguous() and not hasattr(mine[1], "main_grad")
        unfused = [t.detach().clone().requires_grad_() for t in (plain[0].unsqueeze(2), *plain[1:])]  # dW in W.grad
        (m.LinearWithSequenceParallel.apply(*unfused, group, False) * g_out[..., rows].unsqueeze(2)).sum().backward()
        assert not hasattr(unfused[1], "main_grad")                   # x [s/tp, b, 1, h]: any dims, as nn.Linear
        for got, want in zip((t.grad for t in unfused), (plain[0].grad.unsqueeze(2), plain[1].grad, plain[2].grad)):
            torch.testing.assert_close(got, want)
        if every_size():                                                      # tied: on the sub-group
            handshake(plain, g_out[..., rows], group, tied=group is not None)
        if group is not None:
            continue
        # a plain model and torch.optim: SGD moves this rank's rows of W as it moves the dense layer's
        w_sp, b_sp = (torch.nn.Parameter(t.detach().clone()) for t in (w[rows], b[rows]))
        w_d, b_d = (torch.nn.Parameter(t.detach().clone()) for t in (w, b))
        for params, loss in (([w_sp, b_sp], lambda: (m.LinearWithSequenceParallel.apply(
                x.chunk(P)[r], w_sp, b_sp, group) * g_out[..., rows]).sum()),
                             ([w_d, b_d], lambda: (F.linear(x, w_d, b_d) * g_out).sum())):
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
            for _ in range(2):
                opt.zero_grad()
                loss().backward()
                opt.step()
        torch.testing.assert_close([w_sp, b_sp], [w_d[rows], b_d[rows]])
        assert not torch.equal(w_sp, w[rows])
    for group in groups:                                  # batch-first [b, s/tp, h]: sequence_dim=1, no transpose
        P, r = dist.get_world_size(group), dist.get_rank(group)
        rows, xb, gb = slice(r * FFN // P, (r + 1) * FFN // P), x.transpose(0, 1).contiguous(), g_out.transpose(0, 1)
        plain = [t.clone().requires_grad_() for t in (xb.chunk(P, 1)[r], w[rows], b[rows])]
        (F.linear(m.gather_from_sequence_parallel_region(plain[0], group, dim=1), *plain[1:]) * gb[..., rows]).sum() \
            .backward()                                                    # the region along dim 1, and autograd
        mine = [t.detach().clone().requires_grad_() for t in plain]
        for _ in range(2):                                                 # 2 micro-batches, accumulated in .grad
            y, kept = kept_for_backward(lambda: m.LinearWithSequenceParallel.apply(*mine, group, True, 1), mine[1:],
                                        mine[:1])
            assert y.shape == (B, S, FFN // P) and kept == 2 * mine[0].nbytes, kept   # its [s/tp, b, h] copy, and
            (y * strided(gb[..., rows])).sum().backward()                             # not the caller's slice
        torch.testing.assert_close([t.grad for t in mine], [2 * t.grad for t in plain])
        assert mine[1].grad.is_contiguous() and mine[0].grad.shape == plain[0].shape
    z, lin = torch.zeros(B, 2, H, **f64), lambda t, dim: m.LinearWithSequenceParallel.apply(t, w, None, None, True, dim)
    for good, bad in ((1, 2), (0, -1)):                 # 0, 1 of a 3-dim x pass; 2 (its features), -1 are refused
        lin(z, good)
        rejected(lambda: lin(z, bad), f"sequence_dim={bad} is not a dim of x {tuple(z.shape)} before its features")
    for bad in ("1", True, 1.0):
        rejected(lambda: lin(z, bad), f"sequence_dim={bad!r} is not a dim of x")
    p = {k: torch.ones(n, **f64) for k, n in (("ln_w", H), ("ln_b", H), ("b1", FFN), ("b2", H))}
    p["w1"], p["w2"] = w, w.t()
    m.mlp_block(z, p, True, sequence_dim=1)
    rejected(lambda: m.mlp_block(z, p, True, sequence_dim=2), f"sequence_dim=2 is not a dim of x {tuple(z.shape)}")
    W, Rk = dist.get_world_size(), dist.get_rank()
    xs, w16 = x.chunk(W)[Rk].bfloat16(), w.bfloat16().requires_grad_()      # bf16: W.grad bf16, no main_grad
    m.LinearWithSequenceParallel.apply(xs, w16).sum().backward()
    want = m.gather_from_sequence_parallel_region(xs).double().flatten(0, 1).sum(0).expand(FFN, H)
    assert w16.grad.dtype == torch.bfloat16 and not hasattr(w16, "main_grad")
    torch.testing.assert_close(w16.grad.double(), want, rtol=2 ** -7, atol=1e-3)
    w16.grad, w16.main_grad, w16.grad_added_to_main_grad = None, torch.zeros(FFN, H, device=device), False
    m.LinearWithSequenceParallel.apply(xs, w16).sum().backward()            # a wrapper's fp32 main_grad
    assert w16.main_grad.dtype == torch.float32 and w16.grad_added_to_main_grad and w16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(w16.main_grad.double(), want, rtol=1e-6, atol=1e-4)   # summed in fp32
    log("SP linear: dW in W.grad == gather region + autograd over 2 micro-batches (also under saved-tensor hooks), "
        "contiguous, no main_grad made; fusion=False on a 4-d x; kept: its [s/tp, b, h] slice, to the byte")
    log("batch-first x [b, s/tp, h] (sequence_dim=1) == the region along dim 1 + autograd, 2 micro-batches, world and "
        "sub-group; it keeps a [s/tp, b, h] copy, not x; sequence_dim 2 (x's features), -1, '1', True, 1.0 refused "
        "(0 and 1 pass), by mlp_block too")
    log("torch.optim.SGD with momentum on the pasted layer moves W's rows as on the dense layer; bf16 W: W.grad bf16; "
        "with a wrapper's fp32 main_grad: summed in fp32")
    log("handshake (a bucket's main_grad, grad_added_to_main_grad = False): the hook fires once a backward and drops "
        "the placeholder, micro-batch 2 under saved-tensor hooks; declined with fusion=False: the hook adds W.grad; "
        "W also an embedding table with W.zero_out_wgrad == autograd over both uses (without: the lookup's dW lost)")


# ---- Ulysses ----------------------------------------------------------------------------------------------------
def ulysses(groups, device):
    f64 = dict(dtype=torch.float64, device=device)
    for group in groups:
        ranks, P, r = members(group), dist.get_world_size(group), dist.get_rank(group)
        q = ints((S // P, B, NH, D), 30 + dist.get_rank(), device)          # sequence slice r, all heads
        full = torch.cat([ints((S // P, B, NH, D), 30 + g, device) for g in ranks], dim=0)   # [s, b, h, d]
        a2a = adjoint_checked(lambda t: m.all_to_all_4d(t, 2, 0, group), strided(q), group)
        assert torch.equal(a2a, full.chunk(P, dim=2)[r]) and torch.equal(m.all_to_all_4d(strided(a2a), 0, 2, group), q)
        mine = lambda t: t.chunk(P, dim=0)[r]                                # this rank's slice of the sequence
        cases = ((True, KV), (False, NH), (True, 2), (False, 1))[:4 if every_size() else 2]
        cases = cases if group is None else cases[:1]
        for causal, h_kv in cases:                          # GQA, MHA, 2 K/V heads (replicated at P = 4), MQA
            q, k, v, dout = (torch.randn(S, B, n, D, **f64) for n in (NH, h_kv, h_kv, NH))
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = sdpa(*ref_in, causal)
            my_in = [strided(mine(t)).requires_grad_() for t in (q, k, v)]
            with traffic() as uly:
                out = m.ulysses_attention(*my_in, is_causal=causal, group=group)
            torch.testing.assert_close(out, mine(ref))
            for a, b in zip(vjp(out, my_in, mine(dout)), vjp(ref, ref_in, dout)):
                torch.testing.assert_close(a, mine(b))                       # dq, dk, dv
            sent_heads = next(n for n in range(h_kv, NH + 1, h_kv) if n % P == 0)    # lcm(h_kv, P)
            assert dict(uly.counts) == ({"all_to_all": 4} if P > 1 else {})
            assert sent(uly, ranks) == (P - 1) * S * B * D * 8 * (2 * NH + 2 * sent_heads) // P ** 2
    P, r = dist.get_world_size(), dist.get_rank()
    for layout, dims in LAYOUTS[:2 if every_size() else 0]:
        q, k, v, dout = (torch.randn(S, B, n, D, **f64) for n in (NH, KV, KV, NH))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = sdpa(*ref_in, True)
        my_in = [t.chunk(P)[r].permute(dims).contiguous().requires_grad_() for t in (q, k, v)]
        out = m.ulysses_attention(*my_in, is_causal=True, layout=layout)
        back = [dims.index(i) for i in range(4)]
        torch.testing.assert_close(out.permute(back), ref.chunk(P)[r])
        for a, b in zip(vjp(out, my_in, dout.chunk(P)[r].permute(dims)), vjp(ref, ref_in, dout)):
            torch.testing.assert_close(a.permute(back), b.chunk(P)[r])
    q, k, v, dout = (torch.randn(S, B, n, D, device=device).bfloat16() for n in (NH, KV, KV, NH))
    one, ref_in = [t.clone().requires_grad_() for t in (q, k, v)], [t.double().requires_grad_() for t in (q, k, v)]
    one_out, ref = sdpa(*one, True), sdpa(*ref_in, True)                 # bf16 in one process: SDPA's own error
    my_in = [t.chunk(P)[r].clone().requires_grad_() for t in (q, k, v)]
    out = m.ulysses_attention(*my_in, is_causal=True)
    got = (out, *vjp(out, my_in, dout.chunk(P)[r]))
    assert all(t.dtype == torch.bfloat16 for t in got)
    copies = next(n for n in range(KV, NH + 1, KV) if n % P == 0) // KV  # dK, dV: replicas summed in bf16
    worst = bf16_within(got, (one_out, *vjp(one_out, one, dout)), (ref, *vjp(ref, ref_in, dout.double())),
                        lambda t: t.chunk(P)[r], copies)
    log(f"all_to_all_4d exact with its adjoint; Ulysses == SDPA (output, dq, dk, dv) causal and not, MHA {NH}/{NH}, "
        f"GQA {NH}/{KV} and {NH}/2, MQA {NH}/1 (K/V sent at lcm(h_kv, P) heads), strided inputs, world and sub-groups; layouts "
        f"bshd and bhsd; bf16 off float64 by <= bf16 SDPA's error + a rounding a K/V replica ({worst:.2f} x)")
    log("4 all-to-alls, (P-1)/P^2 * (2V + 2V*h_kv'/h) bytes a rank, on every group")
    # refusals, each at its boundary: the last valid passes, the first invalid is refused
    z = lambda *shape: torch.zeros(shape, device=device)
    m.all_to_all_4d(z(2, B, P, D), 2, 0)                                       # P heads: the last valid
    if P > 1:
        rejected(lambda: m.all_to_all_4d(z(2, B, P + 1, D), 2, 0), f"x.shape[2]={P + 1} is not divisible by the group")
        rejected(lambda: m.ulysses_attention(z(2, B, P + 1, D), z(2, B, 1, D), z(2, B, 1, D)),
                 f"heads={P + 1} is not divisible by the group size {P}")
    for bad in (lambda: m.all_to_all_4d(z(P, B, NH, D), 2, 2), lambda: m.all_to_all_4d(z(P, B, NH, D), 2, 4),
                lambda: m.all_to_all_4d(z(P, B, NH), 1, 0), lambda: m.all_to_all_4d(z(P, B, NH, D), -1, 0)):
        rejected(bad, "all_to_all_4d takes a 4-dim tensor and two different dims in 0..3")
    m.all_to_all_4d(z(P, B, NH, P), 3, 0)                                      # dims 0..3: 3 is the last
    attention_refusals(m.ulysses_attention, "ulysses_attention", P, device)
    log("refused at their edges: P + 1 heads (P pass), equal or out-of-range dims, a 3-dim x, and attention's own")


def attention_refusals(attn, who, P, device):
    """What both attention blocks refuse, each beside the last shape that passes: k and v of one shape, q's b, s,
    d those of k, q's heads a multiple of k's, 4-dim tensors, a layout of the three."""
    z = lambda *shape: torch.zeros(shape, device=device)
    n, h = 2, 2 * P                                                    # 2 rows a rank, 2P query heads
    attn(z(n, B, h, D), z(n, B, P, D), z(n, B, P, D))                  # valid: 2 query heads a K/V head
    pair = f"{who}: q "
    rejected(lambda: attn(z(n, B, h, D), z(n, B, P, D), z(n, B, P, D + 1)), pair)            # v's d != k's
    rejected(lambda: attn(z(n, B, h, D), z(n, B, P, D), z(n, B, 2 * P, D)), pair)            # v's heads != k's
    rejected(lambda: attn(z(n, B, h, D), z(n, B + 1, P, D), z(n, B + 1, P, D)), pair)        # b
    rejected(lambda: attn(z(n, B, h, D), z(n + 2, B, P, D), z(n + 2, B, P, D)), pair)        # s
    rejected(lambda: attn(z(n, B, h, D + 1), z(n, B, P, D), z(n, B, P, D)), pair)            # d
    rejected(lambda: attn(z(n, B, h, D), z(n, B, 4 * P, D), z(n, B, 4 * P, D)), pair)        # q's heads: 2P of 4P
    rejected(lambda: attn(z(n, B, h, D), z(n, B, P, D), z(n, B, P, D), layout="shbd"), f"{who} takes 4-dim")
    rejected(lambda: attn(z(n, B, h), z(n, B, P), z(n, B, P)), f"{who} takes 4-dim")


# ---- zig-zag shards and the positions they hold ---------------------------------------------------------------
def zigzag(groups, device):
    pos = torch.arange(S, device=device, dtype=torch.float64)            # each token's position in the sequence
    x = ints((S, B, 3), 7, device)                                        # [s, b, 3], the same on every rank
    for group in groups:
        P, r = dist.get_world_size(group), dist.get_rank(group)
        c = S // (2 * P)
        rows = m.zigzag_shard(pos, 0, group)
        zig = [*range(r * c, (r + 1) * c), *range((2 * P - 1 - r) * c, (2 * P - r) * c)]
        assert rows.tolist() == zig
        assert m.shard_positions(S, group, device=device).tolist() == zig
        held = m.shard_positions(S, group, zigzag=False, device=device)
        assert held.dtype == torch.long and held.tolist() == list(range(r * S // P, (r + 1) * S // P))
        held = m.zigzag_shard(strided(x), 0, group)                        # along dim 0, from a strided view
        assert torch.equal(held, x[rows.long()])
        assert torch.equal(adjoint_checked(lambda t: m.zigzag_unshard(t, 0, group), strided(held), group), x)
        xt = x.transpose(0, 1)                                             # batch-first [b, s, 3]: dim 1
        assert torch.equal(m.zigzag_unshard(m.zigzag_shard(xt, 1, group), 1, group), xt)
        pairs = torch.stack([(rows + 1).sum(), (pos.chunk(P)[r] + 1).sum()])   # causal query-key pairs, mine
        every = [torch.empty_like(pairs) for _ in range(P)]
        dist.all_gather(every, pairs, group=group)
        zigs, contiguous = zip(*(p.long().tolist() for p in every))
        assert set(zigs) == {S * (S + 1) // (2 * P)} and (P == 1 or len(set(contiguous)) == P)
    P = dist.get_world_size()
    m.zigzag_shard(torch.zeros(2 * P, device=device), 0)                   # 2P rows: the last valid
    rejected(lambda: m.zigzag_shard(torch.zeros(2 * P + 1, device=device), 0),
             f"sequence length={2 * P + 1} is not divisible by 2 x {P} ranks")
    m.zigzag_unshard(torch.zeros(2, device=device), 0)                     # 2 rows a rank pass, 1 does not
    rejected(lambda: m.zigzag_unshard(torch.zeros(1, device=device), 0), f"sequence length={P} is not divisible")
    m.shard_positions(2 * P)
    rejected(lambda: m.shard_positions(2 * P + 1), f"sequence length={2 * P + 1} is not divisible by 2 x {P}")
    m.shard_positions(P, zigzag=False)
    for zig in (True, False):  # on the device asked for, not torch's default ("meta": any machine can tell)
        assert m.shard_positions(2 * P, zigzag=zig, device="meta").device.type == "meta", zig
    if P > 1:
        rejected(lambda: m.shard_positions(P + 1, zigzag=False), f"x.shape[0]={P + 1} is not divisible")
    log("zig-zag: rows r and 2P-1-r, shard_positions (zig-zag and contiguous), shard from a strided view, unshard "
        "exact with its adjoint along dims 0 and 1, causal pairs s(s+1)/2P; world and sub-groups; lengths refused")


# ---- rotary positions -------------------------------------------------------------------------------------------
def rope(groups, device):
    f64 = dict(dtype=torch.float64, device=device)
    d, pos = 8, torch.arange(S, device=device)
    x = torch.randn(S, B, 3, d, **f64)
    theta = 10000.0 ** (-torch.arange(0, d, 2, **f64) / d)                # Llama's frequencies, [d/2]
    turn = torch.polar(torch.ones(S, d // 2, **f64), pos[:, None].double() * theta)   # e^(i pos theta), [s, d/2]
    z = torch.complex(x[..., :d // 2], x[..., d // 2:]) * turn[:, None, None]          # (x1 + i x2) e^(i pos theta)
    want = torch.cat([z.real, z.imag], dim=-1)                             # the complex-number reference
    torch.testing.assert_close(m.apply_rope(x, pos), want)
    for layout, dims in LAYOUTS:
        torch.testing.assert_close(m.apply_rope(x.permute(dims), pos, layout=layout), want.permute(dims))
    q, k = torch.randn(2, 1, 1, 1, d, **f64)
    dots = [(m.apply_rope(q, torch.tensor([a], device=device)) * m.apply_rope(k, torch.tensor([a - 5], device=device)))
            .sum() for a in (5, 17, 40)]                                   # q at a, k at a - 5: one dot product
    torch.testing.assert_close(torch.stack(dots), dots[0].expand(3))
    x16 = x.bfloat16()
    out16 = m.apply_rope(x16, pos)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), m.apply_rope(x16.double(), pos), rtol=2 ** -7, atol=2 ** -7)
    xg = x.clone().requires_grad_()
    y = ints(x.shape, 5, device)
    (g,) = vjp(m.apply_rope(strided(xg), pos), xg, y)                       # backward: the inverse rotation
    torch.testing.assert_close(g, m.apply_rope(y, -pos))
    for group in groups:
        P, r = dist.get_world_size(group), dist.get_rank(group)
        for zig, shard in ((True, lambda t: m.zigzag_shard(t, 0, group)), (False, lambda t: t.chunk(P)[r])):
            at = m.shard_positions(S, group, zigzag=zig, device=device)
            torch.testing.assert_close(m.apply_rope(shard(x), at), shard(want))
            naive = torch.arange(S // P, device=device)                   # nanoGPT's arange(t) on a shard
            assert torch.equal(at, naive) or not torch.allclose(m.apply_rope(shard(x), naive), shard(want))
    m.apply_rope(x, pos.int())                                             # int32 positions: integers, pass
    m.apply_rope(x[..., :2], pos)                                          # d = 2: the smallest even head dim
    rejected(lambda: m.apply_rope(x[..., :7], pos), "apply_rope takes an even head dim")
    rejected(lambda: m.apply_rope(x, pos[:-1]), f"apply_rope takes an even head dim and {S} integer positions")
    rejected(lambda: m.apply_rope(x, torch.arange(S + 1)), "apply_rope takes an even head dim")
    rejected(lambda: m.apply_rope(x, pos.double()), "apply_rope takes an even head dim")
    rejected(lambda: m.apply_rope(x, pos, layout="sbdh"), "apply_rope takes 4-dim")
    log("RoPE == the complex-number rotation (fp64; layouts bshd, bhsd; bf16 within its rounding); q.k depends on "
        "the distance only; backward the inverse rotation; a shard at shard_positions == the whole's rows, at "
        "arange(s/P) not; odd d, a wrong count or float positions, a bad layout refused (d = 2 and int32 pass)")


# ---- ring attention -----------------------------------------------------------------------------------------------
def ring(groups, device):
    f64 = dict(dtype=torch.float64, device=device)
    h, h_kv, d = m.RING
    fused = device.type == "cpu"                # float64: CUDA's FlashAttention takes fp16/bf16, so explicit there
    for group in groups:
        ranks, P, r = members(group), dist.get_world_size(group), dist.get_rank(group)
        got = m._ring_exchange(strided(ints((2, 3), dist.get_rank(), device)), group)()   # one ring step
        assert torch.equal(got, ints((2, 3), ranks[(r - 1) % P], device))   # the previous group rank's tensor
        mine = lambda t: m.zigzag_shard(t, 0, group)
        cases = ((True, h_kv), (False, h), (True, h), (False, 1))[:4 if every_size() else 2]
        cases = cases if group is None else cases[:1]
        for i, (causal, kv_heads) in enumerate(cases):                      # MHA, GQA, MQA; a sub-group: GQA
            q, k, v, dout = (torch.randn(S, B, n, d, **f64) for n in (h, kv_heads, kv_heads, h))
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = sdpa(*ref_in, causal)
            my_in = [strided(mine(t)).requires_grad_() for t in (q, k, v)]        # [s/P, b, h, d], non-contiguous
            with traffic() as fwd:
                out = m.ring_attention(*my_in, is_causal=causal, group=group, fused=fused)
            with traffic() as bwd:
                grads = vjp(out, my_in, strided(mine(dout)))
            torch.testing.assert_close(out, mine(ref))
            for a, b in zip(grads, vjp(ref, ref_in, dout)):
                torch.testing.assert_close(a, mine(b))                       # dq, dk, dv
            kv = my_in[1].nbytes + my_in[2].nbytes                           # this rank's K and V, h_kv heads
            assert dict(fwd.counts) == ({"send": P - 1, "recv": P - 1} if P > 1 else {})
            assert dict(bwd.counts) == ({"send": 2 * P - 1, "recv": 2 * P - 1} if P > 1 else {})
            assert sent(fwd, ranks) == (P - 1) * kv and sent(bwd, ranks) == (P - 1) * kv + P * kv * (P > 1)
            assert all(n == kv for name, _, n in fwd.calls + bwd.calls)   # each message: K+V or dK+dV at h_kv
            if i == 0:                                           # the same posted order in every case
                ops = [(op, (r + 1) % P if op == "send" else (r - 1) % P, n) for op, _, n in fwd.calls + bwd.calls]
                logs = [None] * P
                dist.all_gather_object(logs, ops, group=group)
                assert replays(logs), "a posted send would wait for ever"
    P = dist.get_world_size()
    for layout, dims in LAYOUTS[:2 if every_size() else 0]:
        q, k, v, dout = (torch.randn(S, B, n, d, **f64) for n in (h, h_kv, h_kv, h))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = sdpa(*ref_in, True)
        my_in = [m.zigzag_shard(t, 0).permute(dims).contiguous().requires_grad_() for t in (q, k, v)]
        out = m.ring_attention(*my_in, is_causal=True, layout=layout, fused=fused)
        back = [dims.index(i) for i in range(4)]
        torch.testing.assert_close(out.permute(back), m.zigzag_shard(ref, 0))
        for a, b in zip(vjp(out, my_in, m.zigzag_shard(dout, 0).permute(dims)), vjp(ref, ref_in, dout)):
            torch.testing.assert_close(a.permute(back), m.zigzag_shard(b, 0))
    log(f"ring == SDPA (output, dq, dk, dv) causal and not, MHA {h}/{h}, GQA {h}/{h_kv}, MQA {h}/1, strided inputs, "
        "world and sub-groups (neighbours by group rank); layouts bshd and bhsd")
    log("P-1 sends forward, 2P-1 backward, each message K+V (dK+dV) at the K/V heads; the posted order replays to "
        "the end with blocking sends")
    for kv_heads in (h_kv, h)[:2 if every_size() else 1]:
        ring_bf16(kv_heads, device)
    ring_refusals(device)


def ring_bf16(h_kv, device):
    P, (h, _, d) = dist.get_world_size(), m.RING
    q, k, v, dout = (torch.randn(S, B, n, d, device=device).bfloat16() for n in (h, h_kv, h_kv, h))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]        # the same bf16 values, in float64
    ref = sdpa(*ref_in, True)
    ref_grads = vjp(ref, ref_in, dout.double())
    my_in = [m.zigzag_shard(t, 0).requires_grad_() for t in (q, k, v)]
    out = m.ring_attention(*my_in, is_causal=True)
    with traffic() as bwd:
        grads = vjp(out, my_in, m.zigzag_shard(dout, 0))
    kv = my_in[1].nbytes + my_in[2].nbytes                          # bf16 K and V; dK, dV travel in fp32
    assert sent(bwd) == (P - 1) * kv + P * 2 * kv * (P > 1)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    one = [t.clone().requires_grad_() for t in (q, k, v)]              # one process, bf16: SDPA's own error
    one_out = sdpa(*one, True)
    worst = bf16_within((out, *grads), (one_out, *vjp(one_out, one, dout)), (ref, *ref_grads),
                        lambda t: m.zigzag_shard(t, 0), P)                      # + P blocks' roundings
    log(f"bf16, {h}/{h_kv} heads (kernel in bf16; merging, dq and dK, dV sums in fp32, dK, dV sent in fp32): output, "
        f"dq, dk, dv off float64 by <= one-process bf16 SDPA's error + P roundings; {worst:.2f} x SDPA's at most")


def ring_refusals(device):
    P = dist.get_world_size()
    z = lambda *shape: torch.zeros(shape, device=device)
    m.ring_attention(z(2, B, 2, 8), z(2, B, 1, 8), z(2, B, 1, 8))             # 2 rows a rank: the last valid
    rejected(lambda: m.ring_attention(z(3, B, 2, 8), z(3, B, 1, 8), z(3, B, 1, 8)),  # 3 rows a rank
             f"sequence length={3 * P} is not divisible by 2 x {P} ranks")
    attention_refusals(m.ring_attention, "ring_attention", P, device)
    log("refused at their edges: an odd count of rows a rank (2 pass), v unlike k, q's b, s or d unlike k's, q's "
        "heads not a multiple of k's, 3-dim tensors, a layout of none of the three; each valid neighbour passes")


# ---- the fused kernel, the work it does, the bytes a ring step holds --------------------------------------------
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


def fused_and_work(device):
    """The fused kernel is what ring_attention runs by default, one call a ring step forward and backward, asked
    for exactly the query-key pairs attention needs; it agrees with the explicit block, GQA too."""
    import warnings
    P = dist.get_world_size()
    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16   # what each device's fused kernel takes
    tol = {} if dtype == torch.float64 else dict(rtol=2 ** -6, atol=2 ** -6)        # bf16: a few roundings
    h, scale = 6, 8 ** -0.5
    close = lambda a, b: torch.testing.assert_close([t.double() for t in a], [t.double() for t in b], **tol)
    for h_kv in (h, 2):
        q, dout = (torch.randn(S // P, B, h, 8, dtype=dtype, device=device) for _ in range(2))
        k, v = (torch.randn(S // P, B, h_kv, 8, dtype=dtype, device=device) for _ in range(2))
        for causal, n, mk in ((True, S // P, S // P), (False, S // P, S // (2 * P))):   # a diagonal, a full block
            qt, kt, vt = (t[:rows].permute(1, 2, 0, 3) for t, rows in ((q, n), (k, mk), (v, mk)))  # [b, h, rows, d]
            fused, explicit = m._fused_block(qt, kt, vt, causal, scale), m._explicit_block(qt, kt, vt, causal, scale)
            close(fused[:2], explicit[:2])                                               # output, log-sum-exp
            do = dout.permute(1, 2, 0, 3)
            close(m._fused_block_backward(do, qt, kt, vt, *fused[:2], causal, scale, fused[2]),
                  m._explicit_block_backward(do, qt, kt, vt, *explicit[:2], causal, scale))
    log(f"fused kernel == explicit block ({dtype}), {h}/{h} and {h}/2 heads: one block's output, log-sum-exp, and "
        "dq, dk, dv from them, causal square and full")
    with warnings.catch_warnings(record=True) as said:                   # where no fused kernel takes q
        warnings.simplefilter("always")
        kernels = [m._block_kernels(torch.empty(2, 1, 1, 8, device="meta")) for _ in range(2)]
    assert kernels == [(m._explicit_block, m._explicit_block_backward)] * 2 and len(said) == 1, said
    assert m._block_kernels(torch.empty(2, 1, 1, 8, device="meta"), fused=False)[0] is m._explicit_block
    log(f"no fused kernel (a meta tensor here): the explicit block, said once: {str(said[0].message)[16:]}")
    pairs = {}
    q, k, v, dout = (torch.randn(S // P, B, n, 8, dtype=dtype, device=device) for n in (h, 2, 2, h))
    for causal in (False, True):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out, fwd, products = kernel_calls(lambda: m.ring_attention(*qkv, is_causal=causal))
        grads, bwd, bwd_products = kernel_calls(lambda: vjp(out, qkv, dout))
        assert products == bwd_products == [] and len(fwd) == len(bwd) == P, (products, fwd, bwd)
        pairs[causal] = [sum(n * (n + 1) // 2 if c else n * mk for _, n, mk, c in calls) for calls in (fwd, bwd)]
        if every_size() or causal:
            qkv = [t.clone().requires_grad_() for t in (q, k, v)]
            explicit, _, products = kernel_calls(lambda: m.ring_attention(*qkv, is_causal=causal, fused=False))
            assert len(products) > 0                                      # the recorder sees an explicit block
            close((explicit, *vjp(explicit, qkv, dout)), (out, *grads))    # the explicit ring == the fused ring
    every = [None] * P
    dist.all_gather_object(every, pairs)
    assert all(p == {False: [S * S // P] * 2, True: [S * (S + 1) // (2 * P)] * 2} for p in every), every
    log(f"by default one fused kernel call a ring step ({P} forward, {P} backward, no matrix product), asked for "
        f"{pairs[False][0]} = s^2/P query-key pairs, causal {pairs[True][0]} = s(s+1)/2P on every rank; the explicit "
        "ring == the fused ring")


def ring_step_bytes(P, r, n, d, bh, bkv, causal):
    """Closed forms, fp32: the most bytes a ring step holds, forward and backward (inputs, and forward's saved
    output and log-sum-exp, not counted). One number per query row is A bytes; q's rows `row`, a K/V head's
    rows `kv`, a K/V or dK/dV message 2 kv."""
    A = bh * n * 4
    row, kv = A * d, bkv * n * 4 * d
    msg = 2 * kv

    def block(src):                               # the step's query rows and key rows, as fractions of n
        return (1, 1) if not causal or src == r else (1, 0.5) if src < r else (0.5, 1)
    # step 0: forward holds out, lse, K/V and the K/V arriving; backward dq, K/V (+ arriving), the block's dq, dk, dv
    # when the dK/dV sum starts
    fwd, bwd = [row + A + min(P, 2) * msg], [row + min(P, 2) * msg + row + 2 * kv + msg]
    for t in range(1, P):                         # + the block's output, lse and 2 lse temporaries of the merge;
        fq, fk = block((r - t) % P)               # backward: dK/dV sent and arriving, the block's grads, an lse copy
        arriving = msg * (t < P - 1)
        fwd.append(row + A + msg + arriving + int(fq * (row + 3 * A)))
        bwd.append(row + msg + arriving + 2 * msg + int(fq * (row + A) + 2 * fk * kv))
    return max(fwd), max(bwd)


def ring_message_bytes(P, n, d, bh, bkv):
    """Closed forms, fp32: the bytes held as each message of the ring starts (a send and its receive alike),
    forward then backward. A sent buffer is freed at its wait, so a step holds its K/V and the K/V arriving;
    forward also the output and log-sum-exp (from step 1); backward dq, and at the dK/dV exchange the dK/dV sent
    and the one arriving (at the next step's K/V exchange still in flight)."""
    A = bh * n * 4
    row, msg = A * d, 2 * bkv * n * 4 * d
    fwd = [2 * msg + (row + A) * (t > 0) for t in range(P - 1)]
    bwd = []
    for t in range(P):
        bwd += [row + 2 * msg + 2 * msg * (t > 0)] * (t < P - 1) + [row + msg + msg * (t < P - 1) + 2 * msg]
    return ([b for b in fwd for _ in "sr"], [b for b in bwd for _ in "sr"]) if P > 1 else ([], [])


def ring_memory(device):
    """No score matrix on a rank: the bytes a ring step holds, measured, equal the closed form of the messages,
    accumulators and one block's output, and are less than one head's [s/P x s/P] fp32 score; under GQA the K/V
    terms shrink to the K/V heads."""
    P, r = dist.get_world_size(), dist.get_rank()
    b, h, d, n = 1, 2, 8, 256                                             # n = s/P rows a rank
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16    # fused here (the closed form: fp32)
    score = b * n * n * 4                                                 # one head's [s/P x s/P] fp32 scores
    for causal, h_kv in ((True, h), (False, 1)):                     # MHA causal, MQA not
        q, dout = (torch.randn(n, b, h, d, dtype=dtype, device=device) for _ in range(2))
        k, v = (torch.randn(n, b, h_kv, d, dtype=dtype, device=device) for _ in range(2))
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        with memory() as fwd:
            out = m.ring_attention(*qkv, is_causal=causal)
        with memory() as bwd:
            torch.autograd.grad(out, qkv, dout)
        want = ring_step_bytes(P, r, n, d, b * h, b * h_kv, causal)
        exact = dtype != torch.float32 or (fwd.peak, bwd.peak) == want                # bf16 adds its casts
        assert exact and max(fwd.peak, bwd.peak) < score, ((fwd.peak, bwd.peak), want, score)
        held = ([x for _, x in fwd.comms], [x for _, x in bwd.comms])              # as each message starts
        assert dtype != torch.float32 or held == ring_message_bytes(P, n, d, b * h, b * h_kv), (held, fwd.comms)
    with memory() as explicit:
        m.ring_attention(*qkv, is_causal=False, fused=False)
    assert explicit.peak >= b * h * n * n * 4                             # the meter sees a score when one exists
    log(f"peak bytes of a ring step (n = s/P = {n}, d {d}, {h} heads, {dtype}): forward {fwd.peak}, backward "
        f"{bwd.peak} == closed form (MHA causal, and 1 K/V head not), < one head's score {score}; "
        f"explicit blocks {explicit.peak} B (the meter does not see the kernel's tiles)")
    log("bytes held as each K/V and dK/dV message starts == closed form: a sent buffer is freed at its wait")


def main():
    W = launched_world_size()
    if 24 % W:
        refuse(f"world size {W} does not divide {NH} heads, ffn {FFN} and the sequence's {S // 2} chunk pairs: "
               "use 1, 2, 3, 4, 6 or 8")
    rank, _, device = setup()
    groups = (None, strided_groups()[rank % 2][0])                # the world, and my parity's ranks {r % 2}
    head("the sequence-parallel regions: values and adjoints, on rank-dependent inputs")
    regions(groups, device)
    head(f"the MLP block on [s, b, h] = [{S}, {B}, {H}], ffn {FFN}: dense == TP == SP, traffic and bytes kept")
    mlp(groups, device)
    head("LinearWithSequenceParallel: W.grad by default, main_grad when a wrapper asks, a torch optimizer")
    linear(groups, device)
    head(f"Ulysses: all_to_all_4d, attention with {NH} query heads and {NH}, {KV} or 1 K/V heads, layouts, bf16")
    ulysses(groups, device)
    head(f"zig-zag shards of {S} and the positions a shard holds")
    zigzag(groups, device)
    head("rotary positions: the rotation, its backward, shards at their global positions")
    rope(groups, device)
    head("ring attention == SDPA: MHA, GQA, MQA, causal and not, layouts, float64 and bf16, messages replayed")
    ring(groups, device)
    head("ring attention's blocks: the fused kernel, the work it does and the bytes a step holds")
    fused_and_work(device)
    ring_memory(device)
    finish("06's regions, MLP block, SP linear, Ulysses, zig-zag, RoPE and ring attention on sub-groups, strided, "
           "in every layout, MHA/GQA/MQA, fp64 and bf16, with traffic, memory and refusals at their edges")


if __name__ == "__main__":
    main()
