"""08's run_schedule beside torch.distributed.pipelining: 1F1B / Schedule1F1B, interleaved 1F1B (v = 2) /
ScheduleInterleaved1F1B and ZB-H1 / ScheduleInterleavedZeroBubble (one stage a rank: ZB-H1), one line each.

    torchrun --nproc-per-node=2 bench/08_pipeline.py        (BENCH_SMALL=1: h = 32, 2 rounds, a few seconds)

On 16 TanhBlocks (x + tanh(x W^T + b), h = 256, fp32), M = 8 micro-batches of 32 rows, one thread a rank, MSE
loss: each pair is first checked to give the same loss and the same gradients on every stage (rtol 1e-5), then
rounds interleave (the order reversed every other round): a round times one step of each side, the slowest rank's
time (the max over ranks, asserted equal to the largest of the ranks' own times); a ratio is the median of
per-round ratios. torch infers its stages' shapes in its first step (not timed). On gloo each line also gives the
bytes rank 0 wrote to its sockets in the warm-up round's step (tests/tools.written()), asserted on every rank to be
torch's plus 4 bytes a message it sent (each message one transfer: the tensor and its fp32 flag). BENCH_ROUNDS
(default 20), BENCH_ROWS (rows a micro-batch, default 32).
Tables: bench/README.md.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, log, refuse, setup, sync  # noqa: E402
from tests.tools import lesson, slowest, written  # noqa: E402

m = lesson("08_pipeline_1f1b.py")
BLOCKS, M, V = 16, 8, 2
ROWS = int(os.environ.get("BENCH_ROWS", "32"))


def pairs(W):
    """(name, our schedule, torch's class, chunks a stage)."""
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)
    il = lambda p, s, mb: m.schedule_interleaved_1f1b(p, s, mb, V)
    return [("1F1B", m.schedule_1f1b, Schedule1F1B, 1), ("interleaved", il, ScheduleInterleaved1F1B, V),
            ("ZB-H1", m.schedule_zb_h1, ScheduleInterleavedZeroBubble, 1)]


class Ours:
    def __init__(self, full, fn, v, device, h):
        p, s = dist.get_world_size(), dist.get_rank()
        self.stages, self.fn = m.stage_layers(full, p, s, v), fn
        self.comm = m.P2PCommunicator((ROWS, h), torch.float32, device)
        self.params = list(nn.ModuleList([self.stages] if v == 1 else self.stages).parameters())

    def step(self, xs, ts):
        return m.run_schedule(self.stages, self.fn, self.comm, xs, ts, F.mse_loss)[0]


class Torch:
    def __init__(self, full, cls, v, device, h):
        from torch.distributed.pipelining import PipelineStage
        p, s = dist.get_world_size(), dist.get_rank()
        chunks = [m.stage_layers(full, p, s, v)] if v == 1 else m.stage_layers(full, p, s, v)
        self.stages = [PipelineStage(c, k * p + s, p * v, device) for k, c in enumerate(chunks)]
        self.first, self.last = s == 0, s == p - 1           # (interleaved: the first and last model chunk)
        self.schedule = cls(self.stages if cls.__name__ != "Schedule1F1B" else self.stages[0], M, loss_fn=F.mse_loss)
        self.params = [q for c in chunks for q in c.parameters()]

    def step(self, xs, ts):
        losses = []
        args = (torch.cat(xs),) if self.first else ()
        self.schedule.step(*args, **(dict(target=torch.cat(ts), losses=losses) if self.last else {}))
        return sum(losses) / M if self.last else None


def main():
    small = os.environ.get("BENCH_SMALL", "").strip()
    torch.set_num_threads(1)                          # one thread a rank
    rank, W, device = setup()
    if small not in ("", "0", "1"):
        refuse(f"BENCH_SMALL={os.environ['BENCH_SMALL']!r}: 1 runs h = 32 twice, 0 (or unset) the full size")
    if BLOCKS % (V * W):
        refuse(f"{BLOCKS} blocks split into {V} chunks on each of W stages: W in 1, 2, 4, 8; got W = {W}")
    h, rounds = (32, 2) if small == "1" else (256, int(os.environ.get("BENCH_ROUNDS", "20")))
    head(f"BENCH: {BLOCKS} TanhBlocks h = {h}, fp32, {W} stages, M = {M} micro-batches of {ROWS} rows, 1 thread")
    full = nn.Sequential(*(m.TanhBlock(h, torch.float32, device) for _ in range(BLOCKS)))   # alike: seeded
    gen = torch.Generator(device).manual_seed(1)
    data = [[[torch.randn(ROWS, h, device=device, generator=gen) for _ in range(M)] for _ in "xt"] for _ in range(2)]
    sides, ms = {}, {}
    for name, fn, cls, v in pairs(W):
        ours, theirs = Ours(full, fn, v, device, h), Torch(full, cls, v, device, h)
        got = []
        for side in (ours, theirs):                   # the same step: the same loss and gradients
            full.zero_grad(set_to_none=True)
            loss = side.step(*data[0])
            got.append((loss, [q.grad.clone() for q in side.params]))
        (a, ga), (b, gb) = got
        assert (a is None) == (b is None) == (rank != W - 1), (a, b)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0, msg=lambda s: f"{name} loss: {s}")
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7, msg=lambda s: f"{name} grads: {s}")
        sides[name], ms[name] = (ours, theirs), ([], [])
    log(f"1F1B, interleaved (v = {V}), ZB-H1: our loss and every stage's gradients == torch's (rtol 1e-5)")
    wrote, sent = {}, {}
    for i in range(1 + rounds):                       # round 0: warm-up, not counted; it counts the bytes
        for name, (ours, theirs) in sides.items():
            for k, side in [(0, ours), (1, theirs)][::1 if i % 2 else -1]:
                full.zero_grad(set_to_none=True)
                sync(device), dist.barrier()
                posted = len(ours.comm.log)
                t0 = time.perf_counter()
                with written(on=i == 0) as w:
                    side.step(*data[i % 2])
                    sync(device)
                ms[name][k].append(1e3 * slowest(time.perf_counter() - t0, device))
                if w.bytes is not None:
                    wrote[name, k] = w.bytes
                    if side is ours:                  # the messages this rank sent in that step
                        sent[name] = sum(op == "send" for call in ours.comm.log[posted:] for op, *_ in call)
    for name in sides if wrote else ():               # one transfer a message: torch's bytes + its 4-byte flag
        assert wrote[name, 0] - wrote[name, 1] == 4 * sent[name], (name, wrote[name, 0], wrote[name, 1], sent[name])
    for name, (a, b) in ms.items():
        ratio = statistics.median(x / y for x, y in zip(a[1:], b[1:]))
        log(f"{name:11} ours {statistics.median(a[1:]):7.2f} ms  torch {statistics.median(b[1:]):7.2f} ms  "
            f"ours/torch x{ratio:.2f}" + (f"; rank 0 wrote {wrote[name, 0]} B, torch {wrote[name, 1]} B a step"
                                          if wrote else ""))
    finish(f"benchmark at {W} ranks, {rounds} rounds; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
