"""09's DDP, ZeRO-2 and ZeRO-3 beside PyTorch's DDP, DDP + ZeroRedundancyOptimizer and FSDP2 (fully_shard per layer):
DDP / torch DDP, ZeRO-2 / DDP + ZeRO, ZeRO-2 / FSDP2 and ZeRO-3 / FSDP2, one line each.

    torchrun --nproc-per-node=4 bench/09_dp.py          (BENCH_SMALL=1: Linear(32) layers, 2 rounds, a few seconds)

On 4 Linear(512, 512) layers (fp32, AdamW, 64 rows a rank): every system is first checked to reach the same
parameters after 6 steps of the same data (rtol 1e-4), then rounds interleave (the order reversed every other
round). A round times two steps of each system, and ZeRO-2's all-gathers still
in flight after them land inside that time (the second step's forward overlaps the first's). A round's time is the
slowest rank's (the max over ranks, asserted equal to the largest of the ranks' own
times); a ratio is the median of per-round ratios. Bytes held (parameters + gradients + optimizer state) per rank
are measured at the step, and asserted against the closed forms for ours: DDP 4P, ZeRO-2 P + 3P/W, ZeRO-3 4P/W (P
the padded parameter bytes). torch DDP gets our bucket size (bucket_cap_mb), so both send the same all-reduces.
On gloo each line also gives the bytes this rank wrote to its sockets a step (tests/tools.written(): the kernel's
count; gloo's reduce-scatter is an all-reduce inside, so there ZeRO-2 writes what DDP + ZeRO's all-reduce and
broadcasts write). BENCH_ROUNDS (default 20). Tables: bench/README.md.
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

from common import finish, head, log, refuse, setup, sync  # noqa: E402
from tests.tools import held_bytes, lesson, slowest, written  # noqa: E402

m = lesson("09_ddp_zero2.py")


class Ours:
    """09's wrapper with the user's AdamW, behind the loop's interface."""

    def __init__(self, cls, base, bucket_mb):
        net = copy.deepcopy(base)
        self.optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        self.module = cls(net, self.optimizer, bucket_cap_mb=bucket_mb)

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def full_parameters(self):
        return self.module.state_dict()

    def settle(self):  # ZeRO-2's all-gathers in flight after a step land (its state_dict() waits for them)
        if type(self.module) is m.ZeRO2:
            self.module.state_dict()

    def held(self):
        state = [t for st in self.optimizer.state.values() for t in st.values() if t.dim()]
        return (held_bytes([x for b in self.module.buckets for x in (b.flat, b.local)]),
                held_bytes([b.opt.grad for b in self.module.buckets if b.opt.grad is not None]), held_bytes(state))


class Torch:
    """PyTorch's DDP, DDP + ZeroRedundancyOptimizer or FSDP2 (fully_shard per layer) behind the same interface."""

    def __init__(self, kind, base, bucket_mb):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        self.module = copy.deepcopy(base)
        if kind == "FSDP2":
            for layer in self.module:
                fully_shard(layer)
            fully_shard(self.module)
        else:
            self.module = DistributedDataParallel(self.module, bucket_cap_mb=bucket_mb)
        params = self.module.parameters()
        self.optimizer = (ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
                          if kind == "DDP+ZeRO" else torch.optim.AdamW(params, lr=1e-3))

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()

    def settle(self):  # (nothing in flight after torch's steps)
        pass

    def full_parameters(self):
        return {n.removeprefix("module."): p.full_tensor() if hasattr(p, "full_tensor") else p
                for n, p in self.module.named_parameters()}

    def held(self):
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard of a DTensor
        state = getattr(self.optimizer, "optim", self.optimizer).state.values()  # ZeRO: the local optimizer's
        return (held_bytes([local(p) for p in self.module.parameters()]),
                held_bytes([local(p.grad) for p in self.module.parameters() if p.grad is not None]),
                held_bytes([local(t) for st in state for t in st.values() if torch.is_tensor(t) and t.dim()]))


def main():
    small = os.environ.get("BENCH_SMALL", "").strip()
    rank, W, device = setup()
    if small not in ("", "0", "1"):
        refuse(f"BENCH_SMALL={os.environ['BENCH_SMALL']!r}: 1 runs Linear(32) layers twice, 0 (or unset) the full size")
    width, rounds = (32, 2) if small == "1" else (512, int(os.environ.get("BENCH_ROUNDS", "20")))
    steps, bucket = 3, width * width * 4 / 2 ** 20  # a bucket a layer, about
    head(f"BENCH: 4 x Linear({width}, {width}), fp32, AdamW, {W} ranks, 64 rows per rank; buckets of "
         f"{bucket:.3f} MiB")
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).to(device)
    systems = {"DDP": Ours(m.DDP, base, bucket), "torch DDP": Torch("DDP", base, bucket),
               "ZeRO2": Ours(m.ZeRO2, base, bucket), "DDP+ZeRO": Torch("DDP+ZeRO", base, bucket),
               "ZeRO3": Ours(m.ZeRO3, base, bucket), "FSDP2": Torch("FSDP2", base, bucket)}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(64, width, generator=g).to(device) for _ in range(4)]
    ms, mib, wrote = {name: [] for name in systems}, {}, {}
    for i in range(steps + rounds):
        for name in list(systems)[::1 if i % 2 else -1]:  # interleaved, the order reversed every other round
            model = systems[name]
            sync(device), dist.barrier()
            t0 = time.perf_counter()
            with written(on=i == steps) as w:  # (the round measuring bytes)
                for k in range(2):  # two steps: the second's forward overlaps ZeRO-2's all-gathers of the first
                    model.module(batches[(2 * i + k) % 4]).pow(2).mean().backward()
                    if i == steps and k == 0:  # bytes held at the step: gradients complete, before the optimizer
                        mib[name] = model.held()  # frees them
                    model.step()
                model.settle()  # what is still in flight lands inside the time (not in the next system's)
            sync(device)
            if w.bytes is not None:
                wrote[name] = w.bytes / 2
            ms[name].append(1e3 * slowest(time.perf_counter() - t0, device) / 2)  # a step
        if i == steps - 1:  # the same data and the same steps: the same parameters
            want = systems["torch DDP"].full_parameters()
            for name, model in systems.items():
                for n, p in model.full_parameters().items():
                    torch.testing.assert_close(p, want[n], rtol=1e-4, atol=1e-5, msg=lambda s: f"{name} {n}: {s}")
            log(f"after {2 * steps} steps every system's parameters agree (rtol 1e-4); now {rounds} timed rounds")
    P = sum(b.numel for b in systems["DDP"].module.buckets) * 4
    assert mib["DDP"] == (P, P, 2 * P), mib["DDP"]  # ours against the closed forms
    assert mib["ZeRO2"] == (P, P // W, 2 * P // W), mib["ZeRO2"]
    assert mib["ZeRO3"] == (P // W, P // W, 2 * P // W), mib["ZeRO3"]
    median = {name: statistics.median(t[steps + 1:]) for name, t in ms.items()}  # the round measuring bytes: out
    for name in systems:
        p, gr, st = (b / 2 ** 20 for b in mib[name])
        log(f"{name:9} {median[name]:7.2f} ms/step   held: params {p:5.2f} + grads {gr:5.2f} + state {st:5.2f}"
            f" = {p + gr + st:5.2f} MiB" + (f"   wrote {wrote[name] / 2 ** 20:5.2f} MiB/step" if wrote else ""))
    for ours, theirs in (("DDP", "torch DDP"), ("ZeRO2", "DDP+ZeRO"), ("ZeRO2", "FSDP2"), ("ZeRO3", "FSDP2")):
        ratio = statistics.median(a / b for a, b in zip(ms[ours][steps + 1:], ms[theirs][steps + 1:]))
        log(f"{ours} / {theirs}: time x{ratio:.2f}, bytes held x{sum(mib[ours]) / sum(mib[theirs]):.2f}")
    finish(f"benchmark at {W} ranks (torch DDP's own bucket copies of the gradients are not counted)")


if __name__ == "__main__":
    main()
