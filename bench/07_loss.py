"""07's loss beside PyTorch's loss_parallel: cross-entropy on vocabulary-sharded logits, forward and backward.

    torchrun --nproc-per-node=2 bench/07_loss.py        (BENCH_SMALL=1: [64, 1024/W] logits, two rounds)

Times, on fp32 logits [tokens, vocab/W] a rank (default [1024, 32768/W], BENCH_ROUNDS=21 rounds): 07's
vocab_parallel_cross_entropy (one all-gather of 3 numbers a token, after its 16-B slice check), the same with
check_slices=False, Megatron's form (three all-reduces of one number a token) and PyTorch's loss_parallel
(F.cross_entropy on a DTensor sharded on the vocabulary). Asserted in both modes (the speeds are measurements, not
claims): the four losses and dlogits equal F.cross_entropy on the whole logits, in one process; each round's time
is the slowest rank's (the max over the ranks, checked against every rank's own); a ratio is the median of the
per-round ratios, the order rotating each round. On gloo each line also gives the bytes rank 0 wrote to its sockets
for that loss's forward and backward (tests/tools.written()). Table: bench/README.md.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, launched_world_size, log, refuse, setup, sync  # noqa: E402
from tests.tools import slowest  # noqa: E402


def main():
    world = launched_world_size()                          # `python bench/07_loss.py` runs it under torchrun
    small = os.environ.get("BENCH_SMALL", "").strip()
    if small not in ("", "0", "1"):
        refuse(f"BENCH_SMALL={os.environ['BENCH_SMALL']!r}: 1 runs [64, 1024/W] logits twice, 0 (or unset) the full "
               f"[1024, 32768/W], BENCH_ROUNDS times")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from tests.tools import lesson, written
    m = lesson("07_vocab_parallel.py")
    tokens, vocab, rounds = (64, 1024, 2) if small == "1" else (1024, 32768, int(os.environ.get("BENCH_ROUNDS", "21")))
    if vocab % world:
        refuse(f"a vocabulary of {vocab} splits over a power of two ranks, not {world}")
    rank, world, device = setup()
    head(f"cross-entropy on [{tokens}, {vocab}/{world}] fp32 logits a rank, forward + backward, {rounds} rounds; "
         f"{dist.get_backend()}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    gen = torch.Generator().manual_seed(0)
    full, target = torch.randn(tokens, vocab, generator=gen) * 3, torch.randint(0, vocab, (tokens,), generator=gen)
    full, target = full.to(device), target.to(device)
    lo, hi = m.vocab_range(vocab)
    local = full[:, lo:hi].contiguous()
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)   # the world's own group: no new one

    def run(name):
        x = local.detach().requires_grad_()
        if name == "loss_parallel":
            with loss_parallel():
                loss = F.cross_entropy(DTensor.from_local(x, mesh, [Shard(1)]), target)
                loss.backward()
            return loss.full_tensor(), x.grad
        if name == "Megatron's":
            loss = m.megatron_vocab_parallel_cross_entropy(x, target)
        else:
            loss = m.vocab_parallel_cross_entropy(x, target, check_slices=name == "ours")
        loss.backward()
        return loss, x.grad

    names = ("ours", "ours, no check", "Megatron's", "loss_parallel")
    dense = full.detach().double().requires_grad_()
    want = F.cross_entropy(dense, target)                  # the whole logits in one process, float64
    want.backward()
    wrote = {}
    for name in names:
        dist.barrier()
        with written() as w:                               # the bytes this rank writes to its sockets (gloo)
            loss, grad = run(name)
        wrote[name] = w.bytes
        torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad.double(), dense.grad[:, lo:hi], rtol=1e-5, atol=1e-9)
    ms = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            run(name)
            sync(device)
            ms[name].append(1e3 * slowest(time.perf_counter() - t0, device))
    for name in names:
        ratio = statistics.median(a / b for a, b in zip(ms[name], ms["loss_parallel"]))
        log(f"{name:15} {statistics.median(ms[name]):8.2f} ms (slowest rank, median)   / loss_parallel: "
            f"x{ratio:.2f} (median of the rounds' ratios)" + (f"; rank 0 wrote {wrote[name]} B" if wrote[name]
                                                               is not None else ""))
    finish(f"{len(names)} losses at {world} ranks: loss and dlogits == F.cross_entropy on the whole logits; each "
           f"time the slowest rank's (the speeds are measurements)")


if __name__ == "__main__":
    main()
