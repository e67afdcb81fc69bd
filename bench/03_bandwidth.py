"""03's bandwidth table: nccl-tests' algbw and busbw for the collectives of lesson 03, and for its ring all-reduce.

    torchrun --nproc-per-node=2 bench/03_bandwidth.py        (BENCH_SMALL=1: three tiny sizes, one round each)

For all_reduce, all_gather, reduce_scatter, all_to_all, broadcast and 03's ring_all_reduce (built from
isend/irecv), float32, 8 B .. 256 MiB, nccl-tests' two numbers as its doc/PERFORMANCE.md defines them:
    algbw = S / t      S the bytes of the op's largest buffer (the all-gather's output, the reduce-scatter's
                       input), t the slowest rank's time (every rank of a training step waits for it)
    busbw = algbw * F  F = 2(W-1)/W all-reduce; (W-1)/W all-gather, reduce-scatter, all-to-all; 1 broadcast:
                       common.ring_bytes(op, 1, W), the bytes the busiest link of a ring carries per byte of S
For one link speed algbw falls as W grows; busbw reads against the link's own bandwidth at any W: compare busbw.
Beside them, a memory copy's bandwidth, the ceiling for gloo over loopback, and (gloo, Linux) the bytes a rank
really writes to its sockets at the largest size, per byte of the ring's closed form (the kernel's count: headers
included; gloo's reduce-scatter is an all-reduce inside, 2x). Asserted in both modes (the speeds are measurements,
not claims): every op's result at every size against its closed form; every busbw == algbw times nccl-tests'
factor, written out below; every time the largest of the ranks' own times; no op writes less than its closed form
(the least any algorithm sends, in the mean over ranks). Tables: bench/README.md.
"""
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import finish, head, launched_world_size, log, refuse, ring_bytes, setup, sync  # noqa: E402
from tests.tools import slowest, written  # noqa: E402

# nccl-tests' doc/PERFORMANCE.md, written out: busbw = algbw times this factor, for W ranks
NCCL_TESTS_FACTOR = {"all_reduce": lambda W: 2 * (W - 1) / W, "all_gather": lambda W: (W - 1) / W,
                     "reduce_scatter": lambda W: (W - 1) / W, "all_to_all": lambda W: (W - 1) / W,
                     "broadcast": lambda W: 1}
FULL = tuple(8 << 2 * k for k in range(13)) + (256 << 20,)   # 8 B, 32 B, .., 128 MiB, 256 MiB
SMALL = (8, 1 << 10, 1 << 16)


def human(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB" if nbytes >= 1 << 10 else f"{nbytes} B"


def bandwidths(kind, S, t, W):
    """(algbw, busbw) in GB/s (1e9 bytes/s) of a `kind` collective over W ranks on S bytes taking t seconds."""
    algbw = S / t / 1e9
    return algbw, algbw * ring_bytes(kind, 1, W)


def check_bandwidths():
    """bandwidths() on numbers worked by hand: 3 GB in 1.5 s is an algbw of 2 GB/s at any W."""
    for W in (2, 3, 4, 8):
        for kind, factor in NCCL_TESTS_FACTOR.items():
            algbw, busbw = bandwidths(kind, 3e9, 1.5, W)
            assert algbw == 2.0 and math.isclose(busbw, 2.0 * factor(W)), (kind, W, algbw, busbw)


def bench_ops(rank, W, device):
    """label -> (kind, make): make(n) -> (call, check) for n float32 elements (a multiple of W); check() says
    whether the last call's result equals its closed form."""
    from tests.tools import lesson
    ring_all_reduce = lesson("03_allreduce_rs_ag.py").ring_all_reduce
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    f32 = dict(dtype=torch.float32, device=device)
    W_sum = W * (W + 1) / 2                              # rank r contributes r + 1

    def all_reduce(n):
        x = torch.full((n,), rank + 1.0, **f32)
        return lambda: dist.all_reduce(x), lambda: bool((x == W_sum).all())

    def all_gather(n):
        inp, out = torch.full((n // W,), float(rank), **f32), torch.empty(n, **f32)
        want = torch.arange(W, **f32)[:, None]
        return lambda: all_gather_single(out, inp), lambda: bool((out.view(W, -1) == want).all())

    def reduce_scatter(n):
        inp, out = torch.full((n,), rank + 1.0, **f32), torch.empty(n // W, **f32)
        return lambda: reduce_scatter_single(out, inp), lambda: bool((out == W_sum).all())

    def all_to_all(n):                                   # block j of rank r's input, r*W + j, goes to rank j
        inp = (rank * W + torch.arange(W, **f32)).repeat_interleave(n // W)
        out, want = torch.empty(n, **f32), (torch.arange(W, **f32) * W + rank)[:, None]
        return lambda: dist.all_to_all_single(out, inp), lambda: bool((out.view(W, -1) == want).all())

    def broadcast(n):
        x = torch.full((n,), float(rank), **f32)
        return lambda: dist.broadcast(x, src=0), lambda: bool((x == 0).all())

    def ring(n):                                         # a new tensor each call: its allocation is timed too
        x, out = torch.full((n,), rank + 1.0, **f32), [None]
        return lambda: out.__setitem__(0, ring_all_reduce(x)), lambda: bool((out[0] == W_sum).all())

    return {"all_reduce": ("all_reduce", all_reduce), "all_gather": ("all_gather", all_gather),
            "reduce_scatter": ("reduce_scatter", reduce_scatter), "all_to_all": ("all_to_all", all_to_all),
            "broadcast": ("broadcast", broadcast), "ring (03)": ("all_reduce", ring)}


def timed(call, device, rounds=None, budget=0.05):
    """Mean seconds of one call, the slowest rank's: `rounds` calls, or (None) as many as fit `budget` once one
    call has been timed (the same count on every rank)."""
    if rounds is None:
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        call()
        sync(device)
        rounds = max(1, min(50, int(budget / max(slowest(time.perf_counter() - t0, device), 1e-9))))
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(rounds):
        call()
    sync(device)
    mine = (time.perf_counter() - t0) / rounds
    t = slowest(mine, device)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    assert t == max(every) > 0, (t, every)              # the slowest rank's time: not a sum, not this rank's
    return t


def main():
    launched_world_size()                               # `python bench/03_bandwidth.py` runs it under torchrun
    small = os.environ.get("BENCH_SMALL", "").strip()
    if small not in ("", "0", "1"):
        refuse(f"BENCH_SMALL={os.environ['BENCH_SMALL']!r}: 1 runs three tiny sizes once each, 0 (or unset) the "
               f"full table")
    sizes, rounds = (SMALL, 1) if small == "1" else (FULL, None)
    rank, W, device = setup()
    check_bandwidths()
    head(f"bandwidth: {dist.get_backend()} at {W} ranks, float32, {human(sizes[0])} .. {human(sizes[-1])}; "
         f"GB/s = 1e9 bytes/s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    src = torch.ones(sizes[-1] // 4, device=device)      # touched: its pages exist before the clock starts
    dst = torch.zeros_like(src)
    copy = timed(lambda: dst.copy_(src), device, rounds, 0.5)
    assert torch.equal(dst, src)
    del src, dst
    limit = "the most loopback gloo can approach" if device.type == "cpu" else "GPU memory, far above any link"
    log(f"memory copy (copy_ of {human(sizes[-1])} on every rank at once): {sizes[-1] / copy / 1e9:.2f} GB/s "
        f"per rank, {limit}")
    ops = bench_ops(rank, W, device)
    log("algbw = S/t; busbw = algbw x 2(W-1)/W (all_reduce, ring), (W-1)/W (all_gather, reduce_scatter, "
        "all_to_all), 1 (broadcast)")
    log(f"{'S (bytes)':>10} {'AR time':>9} " + " ".join(f"{name:^13}" for name in ops) + "  algbw/busbw GB/s")
    for size in sizes:
        n = max(W, size // 4 // W * W)                  # elements: a multiple of W, as nccl-tests rounds
        row = []
        for name, (kind, make) in ops.items():
            call, check = make(n)
            call()
            assert check(), f"{name} of {n * 4} B: wrong result"
            t = timed(call, device, rounds)
            algbw, busbw = bandwidths(kind, n * 4, t, W)
            assert math.isclose(busbw, algbw * NCCL_TESTS_FACTOR[kind](W)), (name, algbw, busbw)
            row.append(f"{algbw:6.2f}/{busbw:<6.2f}")
            ar_us = t * 1e6 if name == "all_reduce" else ar_us
            del call, check
        log(f"{n * 4:>10} {ar_us:>7.0f}us " + " ".join(row))
    ratios = {}
    for name, (kind, make) in ((k, v) for k, v in ops.items() if k != "broadcast"):   # (its form: the root's)
        call, _ = make(n)
        dist.barrier()
        with written(on=W > 1) as w:                    # None on NCCL, off Linux (alike on every rank)
            call()
        if w.bytes is None:
            break
        mean = torch.tensor(float(w.bytes), dtype=torch.float64)
        dist.all_reduce(mean)
        ratios[name] = mean.item() / W / ring_bytes(kind, n * 4, W)
    measured = bool(ratios)
    if measured:
        assert all(r >= 1 for r in ratios.values()), ratios
        log(f"bytes a rank writes at {human(n * 4)} (mean over ranks), x the ring's closed form: "
            + ", ".join(f"{k} {r:.2f}" for k, r in ratios.items()))
    finish(f"{len(ops)} ops at {len(sizes)} sizes, {W} ranks: every result == its closed form, busbw == algbw x "
           f"nccl-tests' factor, t == the slowest rank's" + ", no op writes less than its closed form" * measured
           + " (the speeds are measurements)")


if __name__ == "__main__":
    main()
