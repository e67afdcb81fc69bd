"""05's tensor-parallel blocks beside PyTorch's own (DTensor: parallelize_module with ColwiseParallel/RowwiseParallel,
and SequenceParallel's layouts for SP), on the same weights, forward + backward, one line each block.

    torchrun --nproc-per-node=2 bench/05_tp.py          (BENCH_SMALL=1: [2, 16, 128] activations, two rounds)

Blocks, batch-first [b, s, h] (nanoGPT's and torch's layout; SP splits s, sequence_dim=1): nanoGPT's GELU MLP (fc1
column-, fc2 row-parallel, biases), Llama's SwiGLU MLP (ours w1|w3 fused by rank, torch's w1, w3 each colwise) and
GQA attention (ours a fused q|k|v, torch's wq, wk, wv each colwise; wo row-parallel), each with and without
sequence parallelism. Torch's side follows torchtitan's apply_tp: PrepareModuleInput on the block (Replicate, or
Shard(1) -> Replicate under SP), its linears Colwise/RowwiseParallel (SP: wo/fc2 output_layouts=Shard(1)), on
init_device_mesh over the world. Ours sums SP's row-bias gradient (allreduce_sequence_parallel_grads) inside the
timed step, as DTensor does inside its backward. Asserted in both modes (the speeds are measurements, not claims):
each pair's outputs, input gradients and every weight gradient agree (ours == its shard of DTensor's full_tensor());
each round's time is the slowest rank's (the max over the ranks, checked against every rank's own); a ratio is the
median of per-round ratios, the order of the two reversed every other round. On gloo each line also gives the bytes
rank 0 wrote to its sockets for the block's forward and backward (tests/tools.written(), in the float64 check).
Default [4, 256, 512] fp32, 16 query heads and 8 K/V heads, ffn 2048, BENCH_ROUNDS=10 rounds. Table: bench/README.md.
"""
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, launched_world_size, log, refuse, setup, sync  # noqa: E402
from tests.tools import lesson, slowest, written  # noqa: E402


class SwiGLU(nn.Module):
    """Llama's feed-forward, torchtitan's names: w2(silu(w1 x) * w3 x)."""
    def __init__(self, h, ffn):
        super().__init__()
        self.w1, self.w3, self.w2 = (nn.Linear(i, o, bias=False) for i, o in ((h, ffn), (h, ffn), (ffn, h)))

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """Llama's grouped-query attention, torchtitan's names (no rotary: 05's block has none), [b, s, h] in and out;
    the head count a rank holds is read from its local projections (view(.., -1, d)), as torchtitan does."""
    def __init__(self, h, heads, kv_heads):
        super().__init__()
        d, self.head_dim, self.heads, self.kv_heads = h // heads, h // heads, heads, kv_heads
        self.wq, self.wk, self.wv = (nn.Linear(h, n * d, bias=False) for n in (heads, kv_heads, kv_heads))
        self.wo = nn.Linear(heads * d, h, bias=False)

    def forward(self, x):
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))                 # local [b, s, own heads * d]
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (q, k, v))   # [b, heads, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).flatten(2))


def fused(*linears):
    """One nn.Linear whose rows are the linears' in turn ([wq; wk; wv], [w1; w3]): what 05's fused_shard splits."""
    dense = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears), bias=False)
    dense.weight = nn.Parameter(torch.cat([m.weight for m in linears]).detach().clone())
    return dense


def torch_tp(dense, mesh, sp, names):
    """torchtitan's apply_tp on a copy of `dense`: names = (column-parallel linears, the row-parallel one)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)
    module, (cols, row) = copy.deepcopy(dense), names
    parallelize_module(module, mesh, PrepareModuleInput(input_layouts=(Shard(1) if sp else Replicate(),),
                                                        desired_input_layouts=(Replicate(),)))
    plan = {c: ColwiseParallel() for c in cols}
    plan[row] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    return parallelize_module(module, mesh, plan)


def main():
    world = launched_world_size()                          # `python bench/05_tp.py` runs it under torchrun
    small = os.environ.get("BENCH_SMALL", "").strip()
    if small not in ("", "0", "1"):
        refuse(f"BENCH_SMALL={os.environ['BENCH_SMALL']!r}: 1 runs [2, 16, 128] activations twice, 0 (or unset) "
               f"[4, 256, 512], BENCH_ROUNDS times")
    if world not in (1, 2, 4, 8):
        refuse(f"{world} ranks: 8 K/V heads and the sequence split over 1, 2, 4 or 8 ranks only (DTensor's colwise "
               f"wk, wv cannot replicate K/V heads)")
    b, s, h, ffn, rounds = (2, 16, 128, 256, 2) if small == "1" else (4, 256, 512, 2048,
                                                                      int(os.environ.get("BENCH_ROUNDS", "10")))
    heads, kv_heads = 16, 8
    m = lesson("05_tp_layers.py")
    rank, world, device = setup()
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (world,))
    head(f"TP blocks on [{b}, {s}, {h}] fp32 activations (SP: [{b}, {s}/{world}, {h}]), ffn {ffn}, {heads}/{kv_heads} "
         f"heads, forward + backward, {rounds} rounds; {dist.get_backend()}, {world} ranks, load average "
         f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    def build(dtype):
        """name: (ours, torch's, [(our layer, torch's linears)]), on the same weights; x, dy [b, s, h]."""
        torch.manual_seed(0)
        gelu = nn.Sequential(nn.Linear(h, ffn), nn.GELU(), nn.Linear(ffn, h)).to(device, dtype)
        swiglu, attn = SwiGLU(h, ffn).to(device, dtype), Attention(h, heads, kv_heads).to(device, dtype)
        pairs = {}
        for sp in (False, True):
            opt, tag = dict(sequence_parallel=sp, sequence_dim=1), " + SP" if sp else ""
            ours = m.parallel_mlp(copy.deepcopy(gelu), **opt)
            theirs = torch_tp(gelu, mesh, sp, (["0"], "2"))
            pairs["GELU MLP" + tag] = ours, theirs, [(ours[0], [theirs[0]]), (ours[2], [theirs[2]])]
            ours = m.parallel_mlp((fused(swiglu.w1, swiglu.w3), nn.SiLU(), copy.deepcopy(swiglu.w2)), gated=True,
                                  **opt)
            theirs = torch_tp(swiglu, mesh, sp, (["w1", "w3"], "w2"))
            pairs["SwiGLU MLP" + tag] = ours, theirs, [(ours[0], [theirs.w1, theirs.w3]), (ours[2], [theirs.w2])]
            user = nn.Module()                             # nanoGPT's names for 05's from_dense
            user.c_attn, user.c_proj = fused(attn.wq, attn.wk, attn.wv), copy.deepcopy(attn.wo)
            user.n_head, user.n_kv_head = heads, kv_heads
            ours = m.ParallelSelfAttention.from_dense(user, **opt)
            theirs = torch_tp(attn, mesh, sp, (["wq", "wk", "wv"], "wo"))
            pairs["GQA attention" + tag] = ours, theirs, [(ours.qkv, [theirs.wq, theirs.wk, theirs.wv]),
                                                          (ours.proj, [theirs.wo])]
        g = torch.Generator().manual_seed(1)
        return pairs, [torch.randn(b, s, h, generator=g).to(device, dtype) for _ in range(2)]  # same on every rank

    part = lambda t: t.chunk(world, 1)[rank].contiguous()                          # this rank's part of s
    pairs, (x, dy) = build(torch.float64)                  # the check: float64, the sums' order apart

    def run(name, side):
        module, sp = pairs[name][side], name.endswith("SP")
        for p in module.parameters():
            p.grad = None
        xi = (part(x) if sp else x).detach().requires_grad_()
        y = xi + module(xi)     # the residual, as in a transformer (it waits DTensor's output, in flight till used)
        y.backward(part(dy) if sp else dy)
        if side == 0 and sp:
            m.allreduce_sequence_parallel_grads(module.parameters())   # fc2's bias: partial sums over the ranks
        grad = xi.grad          # DTensor's: an AsyncCollectiveTensor (its collective in flight), waited in the time
        return y, grad.wait() if hasattr(grad, "trigger_wait") else grad

    wrote = {}
    for name, (ours, theirs, layers) in pairs.items():     # ours == DTensor's, forward and backward
        outs = []
        for side in (0, 1):                                # the bytes each side writes to its sockets (gloo)
            dist.barrier()
            with written() as w:
                outs.append(run(name, side))
            wrote[name, side] = w.bytes
        (y, gx), (y_t, gx_t) = outs
        torch.testing.assert_close([y, gx], [y_t, gx_t], rtol=1e-9, atol=1e-12, msg=lambda e: f"{name}: {e}")
        for layer, linears in layers:                      # every weight gradient: ours == its shard of torch's
            full = [(lin.weight.grad.full_tensor(), None if lin.bias is None else lin.bias.grad.full_tensor())
                    for lin in linears]
            want = layer.shard(torch.cat([w for w, _ in full]), None if full[0][1] is None else torch.cat(
                [bb for _, bb in full]))
            got = (layer.weight.grad, None if layer.bias is None else layer.bias.grad)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda e: f"{name}: {e}")
    log(f"{len(pairs)} blocks: ours == DTensor's (output, input gradient, every weight gradient), float64")
    pairs, (x, dy) = build(torch.float32)                  # the times: fp32
    ms = {(name, side): [] for name in pairs for side in (0, 1)}
    for i in range(rounds):
        for name in pairs:
            for side in (0, 1)[::1 if i % 2 else -1]:      # interleaved, the order reversed every other round
                sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                run(name, side)
                sync(device)
                ms[(name, side)].append(1e3 * slowest(time.perf_counter() - t0, device))
    for name in pairs:
        ratio = statistics.median(a / b for a, b in zip(ms[(name, 0)], ms[(name, 1)]))
        ours, theirs = (statistics.median(ms[(name, side)]) for side in (0, 1))
        log(f"{name:20} ours {ours:8.2f} ms, DTensor {theirs:8.2f} ms (slowest rank, medians)   ours / DTensor "
            f"x{ratio:.2f} (median of the rounds' ratios)"
            + (f"; rank 0 wrote {wrote[name, 0]} B, DTensor {wrote[name, 1]} B" if wrote[name, 0] is not None else ""))
    finish(f"{len(pairs)} TP blocks at {world} ranks == DTensor's, forward and backward; each time the slowest rank's "
           f"(the speeds are measurements)")


if __name__ == "__main__":
    main()
