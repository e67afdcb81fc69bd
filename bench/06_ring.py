"""06's ring attention timed: causal attention, forward and backward, over a sequence split on P ranks, beside
all-gather CP (Llama 3's), PyTorch's own ring (what torch's context_parallel runs) and one process.

    torchrun --nproc-per-node=2 bench/06_ring.py          (BENCH_SMALL=1: s = 256, 2 rounds, a few seconds)

Sides, on q, k, v [s, b, h, d] = [4096, 1, 8, 64] fp32 in zig-zag shards: ours (06's ring_attention, one fused
kernel call a ring step); all-gather CP (one all-gather of K and V, then SDPA for each of the rank's two chunks over
its prefix, causal at its end); PyTorch's ring, _templated_ring_attention and its backward driven with the CPU flash
kernel, with its all-gather and its all-to-all rotater (CPU only, MHA only); one process running SDPA on the whole
sequence. Every side is first checked equal to one process's SDPA (output, dq, dk, dv at this rank's rows), then
rounds interleave; a round's time is the slowest rank's (the max over ranks, asserted equal to the largest of the
ranks' own times); ratios are medians of per-round ratios; on gloo each line also gives the bytes rank 0 wrote to
its sockets for that side's forward and backward (tests/tools.written()). Then one ring step's overlap (the K, V
exchange beside one attention block) and the SP linear's (grad_x's reduce-scatter beside dW), printed, not asserted:
on a shared CPU gloo's threads compete with the compute. BENCH_ROUNDS (default 10), BENCH_KV_HEADS (default h;
fewer: GQA). Tables: bench/README.md.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, launched_world_size, log, refuse, setup, sync, time_overlap  # noqa: E402
from tests.tools import lesson, slowest, written  # noqa: E402

m = lesson("06_sequence_parallel.py")


class Posted:
    """A started exchange as common.time_overlap takes it: wait() completes it."""
    def __init__(self, wait):
        self.wait = wait


def torch_ring(device):
    """PyTorch's ring attention (torch.distributed.tensor.experimental), as context_parallel drives it, for each
    rotater: name -> side(q, k, v, dout) in [b, h, s, d]; {} where this torch lacks it or not on the CPU."""
    if device.type != "cpu":
        return {}
    try:                                                 # torch 2.8+ moved it; older torch has the first home
        try:
            from torch.distributed.tensor.experimental._context_parallel import _attention as cp
        except ImportError:
            from torch.distributed.tensor.experimental import _attention as cp
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        ring, ring_backward, rotate = cp._templated_ring_attention, cp._templated_ring_attention_backward, \
            cp._RotateMethod
    except (ImportError, AttributeError) as err:
        log(f"PyTorch's ring attention not timed: {err}")
        return {}

    def side(method):
        def run(q, k, v, dout):
            cp._cp_options.rotate_method = method
            out, lse = ring(dist.group.WORLD, 2, flash.default, q, k, v, is_causal=True)
            grads = ring_backward(dist.group.WORLD, 2, flash_backward, grad_out=dout, grad_out_name="grad_out",
                                  query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True, dropout_p=0.0)
            return (out, *grads[:3])
        return run
    return {"torch ring (all-gather)": side(rotate.ALL_GATHER), "torch ring (all-to-all)": side(rotate.ALL_TO_ALL)}


def main():
    launched_world_size()                               # `python bench/06_ring.py` runs it under torchrun
    small = os.environ.get("BENCH_SMALL", "").strip()
    if small not in ("", "0", "1"):
        refuse(f"BENCH_SMALL={os.environ['BENCH_SMALL']!r}: 1 runs s = 256 twice, 0 (or unset) the full size")
    s, b, h, d, rounds = (256, 1, 4, 32, 2) if small == "1" else (4096, 1, 8, 64, int(os.environ.get(
        "BENCH_ROUNDS", "10")))
    h_kv = int(os.environ.get("BENCH_KV_HEADS", "") or h)
    rank, P, device = setup()
    if s % (2 * P) or h % h_kv:
        refuse(f"s = {s} must split into 2P = {2 * P} chunks and {h_kv} K/V heads divide {h} heads")
    head(f"causal attention fwd+bwd, q [s, b, h, d] = [{s}, {b}, {h}, {d}], {h_kv} K/V heads, fp32, {P} ranks "
         f"({torch.get_num_threads()} thread(s) a rank; load average {os.getloadavg()[0]:.1f} on "
         f"{len(os.sched_getaffinity(0))} cores)")
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(s, b, n, d, generator=g).to(device) for n in (h, h_kv, h_kv, h)]   # q, k, v, dout
    mine = [m.zigzag_shard(t, 0).contiguous() for t in whole]
    c, bhsd, sbhd = s // (2 * P), (lambda t: t.permute(1, 2, 0, 3)), (lambda t: t.permute(2, 0, 1, 3))

    def one_process():                                   # SDPA on the whole sequence, the zig-zag rows kept
        qkv = [t.clone().requires_grad_() for t in whole[:3]]
        out = sbhd(F.scaled_dot_product_attention(*map(bhsd, qkv), is_causal=True, enable_gqa=True))
        return [m.zigzag_shard(x, 0) for x in (out, *torch.autograd.grad(out, qkv, whole[3]))]

    def ours():
        qkv = [t.clone().requires_grad_() for t in mine[:3]]
        out = m.ring_attention(*qkv, is_causal=True)
        return [out, *torch.autograd.grad(out, qkv, mine[3])]

    def all_gather_cp():                                 # Llama 3: all-gather K, V; my 2 chunks see their prefix
        from torch.nn.attention.bias import causal_lower_right
        qkv = [t.clone().requires_grad_() for t in mine[:3]]
        k, v = m.zigzag_unshard(torch.cat(qkv[1:], dim=-1), 0).split(d, dim=-1)    # one all-gather, [s, b, h_kv, d]
        outs = []
        for i, start in enumerate((rank * c, (2 * P - 1 - rank) * c)):           # chunk r, chunk 2P-1-r
            mask = causal_lower_right(c, start + c)                              # the prefix, causal at its end
            outs.append(F.scaled_dot_product_attention(bhsd(qkv[0][i * c:(i + 1) * c]), bhsd(k[:start + c]),
                                                       bhsd(v[:start + c]), attn_mask=mask, enable_gqa=True))
        out = sbhd(torch.cat(outs, dim=2))
        return [out, *torch.autograd.grad(out, qkv, mine[3])]

    sides = {"ours": ours, "all-gather CP": all_gather_cp, "one process": one_process}
    if h_kv == h:                                        # PyTorch's ring: [b, h, s, d] in and out, MHA
        for name, run in torch_ring(device).items():
            sides[name] = lambda run=run: [sbhd(t) for t in run(*map(bhsd, mine))]
    want, wrote = one_process(), {}
    for name, fn in sides.items():                       # every side first equals one process's SDPA
        dist.barrier()
        with written() as w:                             # and writes this many bytes to its sockets (gloo)
            outs = fn()
        wrote[name] = w.bytes
        for got, ref in zip(outs, want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=lambda e: f"{name}: {e}")
    log(f"output, dq, dk, dv of every side == one process's SDPA (rtol 1e-4); {rounds} interleaved rounds, each "
        "the slowest rank's time")
    ms = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync(device)
            ms[name].append(1e3 * slowest(time.perf_counter() - t0, device))
    for name in sides:
        ratio = statistics.median(a / b for a, b in zip(ms["ours"], ms[name]))
        log(f"{name:24} {statistics.median(ms[name]):8.1f} ms   ours / it: x{ratio:.2f} (median of per-round ratios)"
            + (f"; rank 0 wrote {wrote[name]} B" if wrote[name] is not None else ""))
    log(f"load average now {os.getloadavg()[0]:.1f}")

    head("overlap: a ring step's K, V exchange beside its attention block; the SP linear's reduce-scatter beside dW")
    n = 64 if small == "1" else 512
    q, kv = torch.randn(1, 4, n, 64, device=device), torch.randn(2, 1, 4, n, 64, device=device)   # [b, h, n, d]
    block, _ = m._block_kernels(q)
    steps = [(f"ring step, K+V {kv.nbytes} B", lambda: Posted(m._ring_exchange(kv, None)),
              lambda: block(q, kv[0], kv[1], False, 64 ** -0.5))]
    grad_x = torch.randn(P * (8 if small == "1" else 60), 4, 256, device=device)  # grad_x [s, b, h] fp32
    g2, t2, dw = (torch.randn(*shape, device=device) for shape in ((960, 128), (960, 256), (128, 256)))
    scatter = lambda: Posted(lambda works=m._reduce_scatter_along_dim(grad_x, 0, None, async_op=True)[1]:
                             m._wait(works))
    steps.append((f"SP linear, grad_x {grad_x.nbytes} B", scatter, lambda: dw.addmm_(g2.t(), t2)))
    for name, start, compute in steps:
        t = time_overlap(start, compute, device, iters=2 if small == "1" else 5)
        hidden, most = t["comm"] + t["compute"] - t["overlapped"], min(t["comm"], t["compute"])
        log(f"{name}: comm {t['comm'] * 1e3:.2f} ms + compute {t['compute'] * 1e3:.2f} ms one after the other, "
            f"{t['overlapped'] * 1e3:.2f} ms overlapped: {hidden * 1e3:+.2f} ms hidden, of at most {most * 1e3:.2f}"
            + (" (beyond that: this shared machine's noise)" if abs(hidden) > most else ""))
    log(f"{P} ranks share {len(os.sched_getaffinity(0))} CPU core(s) here: gloo's send, receive and reduce-scatter "
        "run on CPU threads competing with the compute, so with no core idle nothing hides. On GPUs NCCL moves bytes "
        "beside the kernels and a step hides its transfer once its compute takes longer")
    finish(f"ring attention timed beside all-gather CP, PyTorch's ring and one process at {P} ranks, every side == "
           "one process, each time the slowest rank's")


if __name__ == "__main__":
    main()
