"""08 - pipeline parallelism: Megatron's P2P layer and the 1F1B schedule, checked against one process.

Pipeline parallelism gives each rank a run of consecutive layers (a stage) and streams m micro-batches through
p stages: activations go right, gradients come back left (lesson 01). A schedule orders a stage's forwards (F)
and backwards (B). GPipe runs every F, then every B; 1F1B (PipeDream-flush, Megatron's default) starts each B
as early as it can. Both leave the same bubble, (p-1)/(m+p-1) of each stage's time idle, but a stage keeps a
micro-batch's activations from its F to its B: GPipe keeps m, 1F1B at most min(p - stage, m).

  24 blocks, p = 4:   stage 0: blocks 0-5 | stage 1: 6-11 | stage 2: 12-17 | stage 3: 18-23 and the loss
  before: each stage holds its blocks; stage 0 the m input micro-batches, stage 3 their targets
  after:  stage 3 holds the loss (mean over micro-batches); each stage its blocks' gradients summed over
          micro-batches, equal to those of the whole model run in one process on the whole batch
  1F1B, stage 0 of 2, m = 4:   F0 F1 B0 F2 B1 F3 B2 B3   (warm-up: 1 F; steady: F, B pairs; cool-down: 1 B)

The P2P layer (Megatron's p2p_communication.py): six calls on one _communicate(send_next, send_prev, recv_prev,
recv_next); the first stage has no prev and the last no next, so those parts are dropped.
  recv_forward                recv_prev              send_forward                send_next
  recv_backward               recv_next              send_backward               send_prev
  send_forward_recv_backward  send_next, recv_next   send_backward_recv_forward  send_prev, recv_prev
With variable sequence lengths a round of int64 shapes goes first, so that each receiver can allocate. Two
implementations: batched (batch_isend_irecv; on NCCL one grouped launch, the order inside does not matter) and
ordered (isend/irecv one by one in Megatron's order: even stages send_next, recv_prev, send_prev, recv_next, odd
stages swap each pair). On each link the lower stage sends before it receives and the upper one receives before
it sends, so the ops pair up; the swap lets a call to both neighbours use both links at the same step.
Megatron's third, ring_exchange, exists only in its own PyTorch build.
The two-stage trick: NCCL runs the P2P ops between two ranks of one group on one communicator, in order, so an
activation going right and a gradient coming left queue behind each other. With exactly two stages Megatron
sends one direction on a second group; here `second_group` carries odd->even, accepted only with two stages and
the ordered implementation (batch_isend_irecv wants one group). On gloo only the results can be checked.

Why every send meets its receive, though a send waits for its receive (NCCL; gloo too, lesson 01). On the link
s -> s+1, s sends act m after F m and receives grad k before B k; s+1 receives act m before F m and sends grad k
after B k. Every stage runs its Fs in micro-batch order and its Bs too (asserted), so the two ends can disagree
only on how activations and gradients interleave. They do in 1F1B's steady state: s runs F m, B k while s+1 runs
B k, F m, so each would send first and wait for ever. The runner finds these places in its neighbours'
schedules and there, only there, puts both messages in one call: send_forward_recv_backward on s (send act m,
receive grad k), send_backward_recv_forward on s+1, which posts its receive before its send, so both ends see
act m, then grad k. A call's shape round pairs like its data. The demo records every op posted and replays
them, each op blocking until its peer reaches it: every stage must reach the end.

Bytes each rank sends per step, A = one micro-batch's activation (rows x hidden x dtype bytes): m*A forward
unless last, m*A backward unless first (2*m*A in the middle); exchanging shapes adds 8*ndim per message.

Run:  torchrun --nproc-per-node=4 08_pipeline_1f1b.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- building blocks: schedules (pure functions) ---------------------------------------------------------
def _check_schedule(num_stages, stage, num_microbatches):
    if num_stages < 1 or not 0 <= stage < num_stages or num_microbatches < 1:
        raise ValueError(f"need num_stages >= 1, 0 <= stage < num_stages and num_microbatches >= 1; got "
                         f"num_stages={num_stages}, stage={stage}, num_microbatches={num_microbatches}")


def schedule_1f1b(num_stages, stage, num_microbatches):
    """This stage's ops, [("F" | "B", micro-batch)], in 1F1B order; holds at most min(p - stage, m) at once."""
    _check_schedule(num_stages, stage, num_microbatches)
    warmup = min(num_stages - stage - 1, num_microbatches)       # fill the stages after this one
    ops = [("F", m) for m in range(warmup)]                      # warm-up
    for i in range(num_microbatches - warmup):                   # steady: one F, then the oldest held B
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", m) for m in range(num_microbatches - warmup, num_microbatches)]  # cool-down


def schedule_gpipe(num_stages, stage, num_microbatches):
    """This stage's ops in GPipe order: every F, then every B; holds all m micro-batches at once."""
    _check_schedule(num_stages, stage, num_microbatches)
    return [("F", m) for m in range(num_microbatches)] + [("B", m) for m in range(num_microbatches)]


# ---- building blocks: the P2P layer -----------------------------------------------------------------------
class P2PCommunicator:
    """Moves activations to the next stage and gradients to the previous one; stage = rank in `group`.

    shape, dtype, device: what a received tensor is (with variable_shapes, only len(shape) is fixed).
    batched: batch_isend_irecv if True, else isend/irecv in even/odd order.
    second_group: the two-stage trick (exactly 2 stages, batched=False): odd->even transfers use this group.
    self.log lists every op posted, in order, as (send | recv, peer stage, bytes); clear it as you like.
    """

    def __init__(self, shape, dtype, device, group=None, batched=True, variable_shapes=False, second_group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.stage, self.num_stages = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.stage < 0:
            raise ValueError(f"rank {dist.get_rank()} is not in the pipeline group")
        ranks = dist.get_process_group_ranks(self.group)           # isend/irecv take global ranks
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        self.prev = None if self.is_first else ranks[self.stage - 1]
        self.next = None if self.is_last else ranks[self.stage + 1]
        if second_group is not None and (self.num_stages != 2 or batched
                                         or not set(ranks) <= set(dist.get_process_group_ranks(second_group))):
            raise ValueError(f"second_group needs exactly 2 stages, batched=False and both pipeline ranks; got "
                             f"{self.num_stages} stages {ranks}, batched={batched}")
        self.second_group = second_group if second_group is not None else self.group
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.batched, self.variable_shapes, self.log = batched, variable_shapes, []

    def recv_forward(self):                          # -> the previous stage's activation (None on the first)
        return self._communicate(recv_prev=True)[0]

    def send_forward(self, output):                  # this stage's activation -> the next stage
        self._communicate(send_next=output)

    def recv_backward(self):                         # -> the gradient of this stage's output (None on the last)
        return self._communicate(recv_next=True)[1]

    def send_backward(self, input_grad):             # the gradient of this stage's input -> the previous stage
        self._communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output):    # 1F1B steady state, after an F
        return self._communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):  # 1F1B steady state, after a B
        return self._communicate(send_prev=input_grad, recv_prev=True)[0]

    def _communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """The one routine under the six calls: returns (tensor from prev or None, tensor from next or None)."""
        if self.is_first:                            # no neighbour on that side: nothing to send or receive
            send_prev, recv_prev = None, False
        if self.is_last:
            send_next, recv_next = None, False
        for t in (send_next, send_prev):
            if t is not None and (t.dtype != self.dtype or t.dim() != len(self.shape)
                                  or not (self.variable_shapes or t.shape == self.shape)):
                raise ValueError(f"cannot send a {t.dtype} tensor of shape {tuple(t.shape)}: this communicator "
                                 f"moves {self.dtype}, shape {self.shape} (variable_shapes={self.variable_shapes})")
        empty = lambda want, shape, dtype: torch.empty(shape, dtype=dtype, device=self.device) if want else None
        shape_prev = shape_next = self.shape
        if self.variable_shapes:                     # round 1: the shapes, so that each receiver can allocate
            dims = lambda t: None if t is None else torch.tensor(t.shape, dtype=torch.int64, device=self.device)
            sp, sn = (empty(want, len(self.shape), torch.int64) for want in (recv_prev, recv_next))
            self._p2p(dims(send_next), dims(send_prev), sp, sn)
            shape_prev, shape_next = (None if s is None else tuple(s.tolist()) for s in (sp, sn))
        from_prev, from_next = empty(recv_prev, shape_prev, self.dtype), empty(recv_next, shape_next, self.dtype)
        self._p2p(send_next, send_prev, from_prev, from_next)
        return from_prev, from_next

    def _p2p(self, send_next, send_prev, recv_prev, recv_next):
        """Post the given transfers (a tensor or None each) in this stage's even/odd order; wait for all."""
        even = self.stage % 2 == 0
        order = [(dist.isend, send_next, 1), (dist.irecv, recv_prev, -1), (dist.isend, send_prev, -1),
                 (dist.irecv, recv_next, 1)]                  # even stages; odd ones swap each pair
        ops = []
        for op, t, step in (order if even else [order[i] for i in (1, 0, 3, 2)]):
            if t is not None:
                group = self.group if (op is dist.isend) == even else self.second_group  # even->odd on group
                ops.append(dist.P2POp(op, t, self.next if step > 0 else self.prev, group))
                self.log.append(("send" if op is dist.isend else "recv", self.stage + step,
                                 t.numel() * t.element_size()))
        if self.batched and ops:
            reqs = dist.batch_isend_irecv(ops)
        else:
            reqs = [o.op(o.tensor, o.peer, group=o.group) for o in ops]
        for req in reqs:  # wait for every request: gloo returns one per op (waiting on one hung, pytorch#132644)
            req.wait()


# ---- building blocks: the model and the runner ------------------------------------------------------------
class Block(nn.Module):
    """x + tanh(x W^T + b): the unit the pipeline splits."""

    def __init__(self, hidden, dtype=None, device=None):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden, dtype=dtype, device=device)

    def forward(self, x):                            # (rows, hidden) -> (rows, hidden)
        return x + torch.tanh(self.fc(x))


def stage_layers(blocks: nn.Sequential, num_stages, stage):
    """The consecutive blocks this stage runs (the same Parameter objects)."""
    if len(blocks) % num_stages:
        raise ValueError(f"{len(blocks)} blocks do not split evenly over {num_stages} stages")
    k = len(blocks) // num_stages
    return blocks[stage * k:(stage + 1) * k]


def run_schedule(model, schedule_fn, comm, inputs, targets, loss_fn):
    """One step of this stage: the Fs and Bs schedule_fn orders, fed by comm; gradients accumulate in .grad.
    inputs / targets: the micro-batches (read on the first / last stage). Returns (the loss, mean over
    micro-batches, on the last stage, else None; the ops as run, e.g. ["F0", "B0"]; the most micro-batches
    whose activations this stage held at once, counted as it ran)."""
    p, s, m_total = comm.num_stages, comm.stage, len(inputs)
    mine = schedule_fn(p, s, m_total)
    before = schedule_fn(p, s - 1, m_total) if s > 0 else None
    after = schedule_fn(p, s + 1, m_total) if s < p - 1 else None
    held, trace, peak, loss = {}, [], 0, None        # held: micro-batch -> (stage input, output), F until B
    recv = {"F": comm.recv_forward, "B": comm.recv_backward}
    got = comm.recv_forward()                        # every schedule starts with F0
    for i, (op, m) in enumerate(mine):
        nxt = mine[i + 1] if i + 1 < len(mine) else None
        if op == "F":
            x = inputs[m] if comm.is_first else got.requires_grad_()
            y = model(x)
            if comm.is_last:
                y = loss_fn(y, targets[m]) / m_total
                loss = y.detach() if loss is None else loss + y.detach()
            held[m] = (x, y)
            peak = max(peak, len(held))
            out, theirs, send, send_and_recv = y.detach(), after, comm.send_forward, comm.send_forward_recv_backward
        else:
            x, y = held.pop(m)
            torch.autograd.backward(y, got)          # got is None on the last stage, where y is the loss
            out, theirs, send, send_and_recv = x.grad, before, comm.send_backward, comm.send_backward_recv_forward
        trace.append(f"{op}{m}")
        # send this op's result, receive the next op's input; where the neighbour runs those two ops the other way
        # round (1F1B's steady state), each end would send first and wait for ever: then both go in one call
        if nxt is not None and theirs is not None and theirs.index(nxt) < theirs.index((op, m)):
            got = send_and_recv(out)
        else:
            send(out)                                # nothing is sent from the last (F) or the first (B) stage
            got = None if nxt is None else recv[nxt[0]]()
    return loss, trace, peak


def replays_to_the_end(logs):
    """Replay each stage's posted ops (comm.log) with every op blocking until its peer reaches the matching
    op (a send meets a receive of the same bytes from the other side). True if every stage gets to the end."""
    pos, moved = [0] * len(logs), True
    while moved:
        moved = False
        for a, ops in enumerate(logs):
            if pos[a] < len(ops):
                kind, b, nbytes = ops[pos[a]]
                if pos[b] < len(logs[b]) and logs[b][pos[b]] == ("recv" if kind == "send" else "send", a, nbytes):
                    pos[a], pos[b], moved = pos[a] + 1, pos[b] + 1, True
    return pos == [len(ops) for ops in logs]


def place_on_ticks(traces):
    """Each stage's recorded ops on a clock where an F or a B takes one tick and messages take none: an op ends
    one tick after the later of its stage's previous op and its input (F m: F m one stage before; B m: B m one
    stage after, or F m on the last stage). Returns ({tick: op} per stage, total ticks)."""
    end = {}

    def end_of(s, op):
        if (s, op) not in end:
            i = traces[s].index(op)
            deps = [end_of(s, traces[s][i - 1])] if i else [0]
            if op[0] == "F" and s > 0:
                deps.append(end_of(s - 1, op))
            if op[0] == "B":
                deps.append(end_of(s + 1, op) if s < len(traces) - 1 else end_of(s, "F" + op[1:]))
            end[(s, op)] = max(deps) + 1
        return end[(s, op)]

    rows = [{end_of(s, op) - 1: op for op in trace} for s, trace in enumerate(traces)]
    return rows, max(end_of(s, trace[-1]) for s, trace in enumerate(traces))


# ---- demo --------------------------------------------------------------------------------------------------
NUM_BLOCKS, HIDDEN, ROWS, M = 24, 8, 4, 8  # 24 blocks split over 1, 2, 3, 4, 6 or 8 stages


def check_pipeline(full, device, runs, variable=False, group=None, second_group=None):
    """For each (schedule, batched, rows) in runs: micro-batches for `full` (micro-batch m has rows[m] rows),
    alike on every rank; the loss and grads of the whole model in one process on the whole batch; one step
    through the pipeline on `group`'s ranks, each stage checked against them. Every rank calls it; returns,
    per run, every stage's results, once each run's recorded P2P ops replay to the end."""
    in_pipeline = dist.get_rank(group if group is not None else dist.group.WORLD) >= 0
    mine = [None] * len(runs)                        # stays None where this rank is not in the pipeline
    for i, (schedule_fn, batched, rows) in enumerate(runs if in_pipeline else []):
        gen = torch.Generator(device).manual_seed(len(rows))
        xs = [torch.randn(n, HIDDEN, dtype=torch.float64, device=device, generator=gen) for n in rows]
        ts = [torch.randn(n, HIDDEN, dtype=torch.float64, device=device, generator=gen) for n in rows]
        # reference: the whole batch at once; row weights make it the mean over micro-batches of each one's MSE
        weight = torch.cat([torch.full((n, 1), 1 / (len(rows) * n * HIDDEN), dtype=torch.float64, device=device)
                            for n in rows])
        full.zero_grad(set_to_none=True)
        ref_loss = ((full(torch.cat(xs)) - torch.cat(ts)) ** 2 * weight).sum()
        ref_loss.backward()
        ref = {id(q): q.grad.clone() for q in full.parameters()}
        full.zero_grad(set_to_none=True)
        comm = P2PCommunicator((rows[0], HIDDEN), torch.float64, device, group, batched, variable, second_group)
        p, s, m = comm.num_stages, comm.stage, len(rows)
        stage = stage_layers(full, p, s)
        loss, trace, peak = run_schedule(stage, schedule_fn, comm, xs, ts, F.mse_loss)
        if comm.is_last:
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
        own = {id(q) for q in stage.parameters()}
        for q in full.parameters():                  # this stage's grads are the reference's; no other grad
            assert q.grad is None if id(q) not in own else torch.allclose(q.grad, ref[id(q)], rtol=1e-9, atol=0)
        assert peak == (min(p - s, m) if schedule_fn is schedule_1f1b else m), (s, peak)
        sent = sum(nbytes for kind, _, nbytes in comm.log if kind == "send")
        per_side = sum(n * HIDDEN * 8 + (16 if variable else 0) for n in rows)  # data (+ a 2-dim int64 shape)
        assert sent == (2 - comm.is_first - comm.is_last) * per_side, (s, sent)
        mine[i] = {"loss": None if loss is None else loss.item(), "trace": trace, "peak": peak, "log": comm.log,
                   "sent": sent}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    results = [[r[i] for r in everyone if r[i] is not None] for i in range(len(runs))]
    for stages in results:
        assert replays_to_the_end([r["log"] for r in stages]), "a send would wait for ever"
    return results


def main():
    from common import finish, head, launched_world_size, log, refuse, setup
    W = launched_world_size()
    if NUM_BLOCKS % W:
        refuse(f"{NUM_BLOCKS} blocks do not split evenly over {W} stages; use 1, 2, 3, 4, 6 or 8 ranks")
    rank, world, device = setup()
    dist.barrier()  # NCCL: a group's first batch_isend_irecv must include all its ranks; the last stage's posts none
    full = nn.Sequential(*(Block(HIDDEN, torch.float64, device) for _ in range(NUM_BLOCKS)))  # alike: seeded
    name = {schedule_1f1b: "1F1B", schedule_gpipe: "GPipe"}
    impl = lambda batched: "batched" if batched else "ordered"

    head("P2P layer: send_forward_recv_backward, then send_backward_recv_forward, on every rank")
    sent_by = lambda r, d, n: torch.randint(-9, 10, (n, 3), generator=torch.Generator().manual_seed(
        10 * r + d)).to(device, torch.float64)       # what rank r sends in direction d: every rank can rebuild it
    for batched in (True, False):
        for variable in (True, False):               # the last round has fixed shapes, for the adjoint below
            n = (lambda r: 1 + r % 3) if variable else (lambda r: 2)
            comm = P2PCommunicator((2, 3), torch.float64, device, batched=batched, variable_shapes=variable)
            x, y = sent_by(rank, 0, n(rank)), sent_by(rank, 1, n(rank))
            # rank r's first call meets rank r+1's second: the calls complete from the last rank back to rank 0
            got_next = comm.send_forward_recv_backward(x)
            got_prev = comm.send_backward_recv_forward(y)
            # rank r => got_prev = rank r-1's x (None at r = 0), got_next = rank r+1's y (None at the last rank)
            assert got_prev is None if rank == 0 else torch.equal(got_prev, sent_by(rank - 1, 0, n(rank - 1)))
            assert got_next is None if rank == world - 1 else torch.equal(got_next, sent_by(rank + 1, 1, n(rank + 1)))
    # adjoint: sum_r <S x, y>_r = sum_r <x, S^T y>_r with S = send_forward, S^T = send_backward
    zero = torch.zeros((), dtype=torch.float64, device=device)
    dots = torch.stack([zero if got_prev is None else (got_prev * y).sum(),      # <S x, y> on this rank
                        zero if got_next is None else (x * got_next).sum()])     # <x, S^T y> on this rank
    dist.all_reduce(dots)
    assert dots[0] == dots[1], dots
    log(f"batched and ordered, fixed and exchanged shapes: each stage got its neighbours' tensors; "
        f"sum <S x, y> = sum <x, S^T y> = {dots[0].item():.0f} (S = send_forward, S^T = send_backward)")

    head("schedules: pure functions, against orders worked out by hand")
    by_hand = [(schedule_1f1b, 2, 4, 0, "F0 F1 B0 F2 B1 F3 B2 B3"),   # warm-up 1, 3 steady pairs, cool-down 1
               (schedule_1f1b, 2, 4, 1, "F0 B0 F1 B1 F2 B2 F3 B3"),   # the last stage: each B right after its F
               (schedule_1f1b, 3, 4, 0, "F0 F1 F2 B0 F3 B1 B2 B3"),   # warm-up 2
               (schedule_1f1b, 4, 2, 1, "F0 F1 B0 B1"),               # m < p: warm-up min(2, 2) is every F
               (schedule_1f1b, 4, 2, 3, "F0 B0 F1 B1"),
               (schedule_gpipe, 3, 2, 1, "F0 F1 B0 B1")]
    for fn, p, m, s, want in by_hand:
        assert " ".join(f"{o}{k}" for o, k in fn(p, s, m)) == want, (fn.__name__, p, m, s)
    for fn, p, m, s in [(fn, p, m, s) for fn in name for p in range(1, 9) for m in range(1, 13) for s in range(p)]:
        ops, live = fn(p, s, m), [0]                 # live: activations held after each op
        for o, _ in ops:
            live.append(live[-1] + (1 if o == "F" else -1))
        assert [k for o, k in ops if o == "F"] == [k for o, k in ops if o == "B"] == list(range(m)), (fn, p, s, m)
        # in order and never negative: B k comes after F k; at the end nothing is held
        assert min(live) >= 0 and live[-1] == 0 and max(live) == (min(p - s, m) if fn is schedule_1f1b else m)
    log(f"{len(by_hand)} hand-worked orders match; p <= 8, m <= 12: Fs, Bs in micro-batch order, each B after its F, "
        f"live >= 0, ends at 0, peak min(p - stage, m) (1F1B), m (GPipe)")

    head(f"{world} stages x {M} micro-batches = the whole model in one process: loss and every gradient")
    combos = [(fn, batched, [ROWS] * M) for fn in name for batched in (True, False)]
    runs = check_pipeline(full, device, combos)
    for (fn, batched, _), stages in zip(combos, runs):
        log(f"{name[fn]:5} {impl(batched)}: loss {stages[-1]['loss']:.6f}, {2 * NUM_BLOCKS} grads match; "
            f"peak live activations per stage, measured: {[r['peak'] for r in stages]}")
    log(f"bytes sent per stage {[r['sent'] for r in runs[0]]} = m*A per neighbour (A = {ROWS}x{HIDDEN}x8); "
        f"each run's P2P ops replay to the end with every send waiting for its receive")

    head("timeline: each stage's recorded order, one tick per F or B ('.' = idle)")
    for (fn, batched, _), stages in zip(combos, runs):
        if batched:
            grid, ticks = place_on_ticks([r["trace"] for r in stages])
            idle = ticks - 2 * M                     # every stage runs 2m ops, one per tick
            assert idle * (M + world - 1) == ticks * (world - 1), (name[fn], idle, ticks)
            log(name[fn])
            for s, row in enumerate(grid):
                log(f"stage {s} |" + "".join(f"{row.get(t, '.'):>3}" for t in range(ticks)))
    log(f"bubble, every stage, both schedules: {idle}/{ticks} ticks idle = (p-1)/(m+p-1) = "
        f"{(world - 1) / (M + world - 1):.3f}; the same bubble, but 1F1B holds min(p - stage, m), not m")

    head("1F1B for any m (1, m < p, m > p), micro-batches of different lengths: shapes travel first")
    sweep = [(schedule_1f1b, i % 2 == 0, [1 + 3 * k % 5 for k in range(m)])      # rows 1, 4, 2, 5, 3, 1, ...
             for i, m in enumerate(sorted({1, (world + 1) // 2, world + 1}))]
    for (_, batched, rows), stages in zip(sweep, check_pipeline(full, device, sweep, variable=True)):
        log(f"m = {len(rows)}, {impl(batched)}, rows {rows}: loss and grads match, ops replay; "
            f"peak live activations {[r['peak'] for r in stages]}")

    head("two stages, two groups: the ordered implementation's two-stage trick")
    try:                                             # second_group: accepted with exactly two stages
        P2PCommunicator((1,), torch.float64, device, batched=False, second_group=dist.group.WORLD)
        assert world == 2, f"second_group accepted with {world} stages"
    except ValueError:
        assert world != 2, "second_group refused with 2 stages"
    log(f"second_group with the {world}-stage world pipeline: {'accepted' if world == 2 else 'ValueError'}")
    if world > 1:
        pair = [world - 2, world - 1]
        pp, second = dist.new_group(pair), dist.new_group(pair)   # every rank creates every group
        [stages] = check_pipeline(full, device, [(schedule_1f1b, False, [ROWS] * 3)], group=pp, second_group=second)
        log(f"ranks {pair} as stages 0 and 1, odd->even transfers on the second group: loss "
            f"{stages[-1]['loss']:.6f}, grads match")
    finish("P2P layer (batched, ordered, shapes, two groups); 1F1B and GPipe equal one process; memory measured")


if __name__ == "__main__":
    main()
