"""08 - pipeline parallelism: Megatron's P2P layer and the 1F1B schedule, checked against one process.

Pipeline parallelism gives each rank a run of consecutive layers (a stage) and streams m micro-batches through
p stages: activations go right, gradients come back left (lesson 01). A schedule is the order of a stage's
forwards (F) and backwards (B). GPipe runs every F, then every B; 1F1B (PipeDream-flush, Megatron's default)
starts each B as early as it can. Both leave the same bubble, (p-1)/(m+p-1) of each stage's time idle, but a
stage keeps a micro-batch's activations from its F to its B: GPipe keeps m, 1F1B at most min(p - stage, m).

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
ordered (isend/irecv one by one; even stages send_next, recv_prev, send_prev, recv_next, odd stages recv_prev,
send_next, recv_next, send_prev: on each link the lower stage sends as the upper receives, at the same step).
Megatron's third, ring_exchange, exists only in its own PyTorch build.
The two-stage trick: NCCL runs the P2P ops between two ranks of one group on one communicator, in order, so an
activation going right and a gradient coming left queue behind each other though the link carries both at once.
With exactly two stages (every transfer has the same peer) Megatron moves one direction to a second group: here
even->odd on `group`, odd->even on `second_group`, in the ordered implementation (batch_isend_irecv wants all
its ops on one group and launches them together anyway). On gloo only the results can be checked.

Why every send meets its receive. Each stage runs its Fs in micro-batch order and its Bs too (asserted), so the
k-th activation stage s sends is the k-th stage s+1 receives, and likewise for gradients. The ends of a link
must also agree on which comes first, an activation or a gradient. In 1F1B's steady state they do not: stage s
runs F_m then B_k (sends act m, then waits for grad k), stage s+1 runs B_k then F_m (sends grad k, then waits
for act m), and as a send waits for its receive (NCCL; gloo too, lesson 01) both would wait for ever. Exactly
there the runner puts the two messages in one call on each end, send_forward_recv_backward on s and
send_backward_recv_forward on s+1; everywhere else (warm-up, cool-down, all of GPipe) each message is a call of
its own and both ends see the same order. Calls pair one to one, so the shape rounds pair too. The demo
records every op each stage posts and replays them with each op blocking until its peer reaches the matching
op: the replay must reach the end.

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
_EVEN = ("send_next", "recv_prev", "send_prev", "recv_next")
_ODD = ("recv_prev", "send_next", "recv_next", "send_prev")


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
        if second_group is not None:
            if self.num_stages != 2 or batched:
                raise ValueError(f"second_group needs exactly 2 stages and batched=False; got "
                                 f"{self.num_stages} stages, batched={batched}")
            if not set(ranks) <= set(dist.get_process_group_ranks(second_group)):
                raise ValueError(f"second_group must hold both pipeline ranks {ranks}")
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
        shape_prev = shape_next = self.shape
        if self.variable_shapes:                     # round 1: the shapes, so that each receiver can allocate
            dims = lambda t: None if t is None else torch.tensor(t.shape, dtype=torch.int64, device=self.device)
            room = lambda want: torch.empty(len(self.shape), dtype=torch.int64, device=self.device) if want else None
            sp, sn = room(recv_prev), room(recv_next)
            self._p2p(dims(send_next), dims(send_prev), sp, sn)
            shape_prev, shape_next = (None if s is None else tuple(s.tolist()) for s in (sp, sn))
        buf = lambda want, shape: torch.empty(shape, dtype=self.dtype, device=self.device) if want else None
        from_prev, from_next = buf(recv_prev, shape_prev), buf(recv_next, shape_next)
        self._p2p(send_next, send_prev, from_prev, from_next)
        return from_prev, from_next

    def _p2p(self, send_next, send_prev, recv_prev, recv_next):
        """Post the given transfers (a tensor or None each) in this stage's even/odd order; wait for all."""
        even = self.stage % 2 == 0
        where = {"send_next": (dist.isend, send_next, self.next), "recv_prev": (dist.irecv, recv_prev, self.prev),
                 "send_prev": (dist.isend, send_prev, self.prev), "recv_next": (dist.irecv, recv_next, self.next)}
        ops = []
        for name in (_EVEN if even else _ODD):
            op, t, peer = where[name]
            if t is not None:
                group = self.group if (op is dist.isend) == even else self.second_group  # even->odd on group
                ops.append((op, t, peer, group))
                self.log.append((name[:4], self.stage + (1 if name.endswith("next") else -1),
                                 t.numel() * t.element_size()))
        if self.batched and ops:
            reqs = dist.batch_isend_irecv([dist.P2POp(op, t, peer, g) for op, t, peer, g in ops])
        else:
            reqs = [op(t, peer, group=g) for op, t, peer, g in ops]
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


def _crosses(done, upcoming, theirs):
    """The neighbour runs `upcoming` before `done`: both ends would send first, so fuse into one call."""
    return theirs is not None and theirs.index(upcoming) < theirs.index(done)


def run_schedule(model, schedule_fn, comm, inputs, targets, loss_fn):
    """One step of this stage: the forwards and backwards schedule_fn orders, fed by comm.

    inputs / targets: the micro-batches (read on the first / last stage). Gradients accumulate in .grad.
    Returns (loss on the last stage, mean over micro-batches, else None; the ops as run, e.g. ["F0", "B0"];
    the peak number of micro-batches whose activations this stage held at once, measured).
    """
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
            if nxt[0] == "B" and _crosses(("F", m), nxt, after):   # 1F1B steady state: one call, both messages
                got = comm.send_forward_recv_backward(y.detach())
            else:
                comm.send_forward(y.detach())
                got = recv[nxt[0]]()
        else:
            x, y = held.pop(m)
            torch.autograd.backward(y, got)          # got is None on the last stage, where y is the loss
            if nxt is not None and nxt[0] == "F" and _crosses(("B", m), nxt, before):
                got = comm.send_backward_recv_forward(x.grad)
            else:
                comm.send_backward(x.grad)           # x.grad is None on the first stage: nothing is sent
                got = recv[nxt[0]]() if nxt is not None else None
        trace.append(f"{op}{m}")
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


def check_pipeline(full, rows, device, combos, group=None, second_group=None):
    """Micro-batches for `full` (micro-batch m has rows[m] rows), alike on every rank, and the loss and grads of
    the whole model in one process on the whole batch; then, for each (schedule, batched) in combos, one step
    through the pipeline on `group`'s ranks, every stage checked against that reference. Every rank calls it;
    returns, per combo, every stage's results (after checking that the run's recorded ops replay)."""
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
    variable = len(set(rows)) > 1
    mine = []
    for schedule_fn, batched in combos:
        full.zero_grad(set_to_none=True)
        if dist.get_rank(group if group is not None else dist.group.WORLD) < 0:
            mine.append(None)                        # this rank is not in the pipeline
            continue
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
        mine.append({"loss": None if loss is None else loss.item(), "trace": trace, "peak": peak,
                     "log": comm.log, "sent": sent})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    runs = [[r[i] for r in everyone if r[i] is not None] for i in range(len(combos))]
    for stages in runs:
        assert replays_to_the_end([r["log"] for r in stages]), "a send would wait for ever"
    return runs


def main():
    from common import finish, head, launched_world_size, log, refuse, setup
    W = launched_world_size()
    if NUM_BLOCKS % W:
        refuse(f"{NUM_BLOCKS} blocks do not split evenly over {W} stages; use 1, 2, 3, 4, 6 or 8 ranks")
    rank, world, device = setup()
    full = nn.Sequential(*(Block(HIDDEN, torch.float64, device) for _ in range(NUM_BLOCKS)))  # alike: seeded
    name = {schedule_1f1b: "1F1B", schedule_gpipe: "GPipe"}
    combos = [(fn, batched) for fn in name for batched in (True, False)]
    impl = lambda batched: "batched" if batched else "ordered"
    peaks = lambda stages: [r["peak"] for r in stages]

    head("P2P layer: one _communicate sends to and receives from both neighbours")
    sent_by = lambda r, d, n: torch.randint(-9, 10, (n, 3), generator=torch.Generator().manual_seed(
        10 * r + d)).to(device, torch.float64)       # what rank r sends in direction d: every rank can rebuild it
    for batched in (True, False):
        for variable in (True, False):
            n = (lambda r: 1 + r % 3) if variable else (lambda r: 2)
            comm = P2PCommunicator((2, 3), torch.float64, device, batched=batched, variable_shapes=variable)
            x, y = sent_by(rank, 0, n(rank)), sent_by(rank, 1, n(rank))
            got_prev, got_next = comm._communicate(send_next=x, send_prev=y, recv_prev=True, recv_next=True)
            # rank r => got_prev = rank r-1's x (None at r = 0), got_next = rank r+1's y (None at the last rank)
            assert got_prev is None if rank == 0 else torch.equal(got_prev, sent_by(rank - 1, 0, n(rank - 1)))
            assert got_next is None if rank == world - 1 else torch.equal(got_next, sent_by(rank + 1, 1, n(rank + 1)))
    # adjoint, on the last exchange: sum_r <S x, y>_r = sum_r <x, S^T y>_r with S = send_forward, S^T = send_backward
    zero = torch.zeros((), dtype=torch.float64, device=device)
    dots = torch.stack([zero if got_prev is None else (got_prev * y).sum(), zero if got_next is None else (x * got_next).sum()])
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
    for fn, p, m in [(fn, p, m) for fn in name for p in range(1, 9) for m in range(1, 13)]:
        for s in range(p):
            ops, live, most = fn(p, s, m), 0, 0
            assert [k for o, k in ops if o == "F"] == [k for o, k in ops if o == "B"] == list(range(m))
            for i, (o, k) in enumerate(ops):
                live += 1 if o == "F" else -1
                most = max(most, live)
                assert live >= 0 and (o == "F" or ("F", k) in ops[:i])
            assert live == 0 and most == (min(p - s, m) if fn is schedule_1f1b else m)
    log(f"{len(by_hand)} hand-worked orders match; p <= 8, m <= 12: Fs, Bs in micro-batch order, each B after its F, "
        f"live >= 0, ends at 0, peak min(p - stage, m) (1F1B), m (GPipe)")

    head(f"{world} stages x {M} micro-batches = the whole model in one process: loss and every gradient")
    runs = check_pipeline(full, [ROWS] * M, device, combos)
    for (fn, batched), stages in zip(combos, runs):
        log(f"{name[fn]:5} {impl(batched)}: loss {stages[-1]['loss']:.6f}, {2 * NUM_BLOCKS} grads match; "
            f"peak live activations per stage, measured: {peaks(stages)}")
    log(f"bytes sent per stage {[r['sent'] for r in runs[0]]} = m*A per neighbour (A = {ROWS}x{HIDDEN}x8); "
        f"each run's P2P ops replay to the end with every send waiting for its receive")

    head("timeline: each stage's recorded order, one tick per F or B ('.' = idle)")
    for (fn, batched), stages in zip(combos, runs):
        if batched:
            grid, ticks = place_on_ticks([r["trace"] for r in stages])
            log(name[fn])
            for s, row in enumerate(grid):
                log(f"stage {s} |" + "".join(f"{row.get(t, '.'):>3}" for t in range(ticks)))
                idle = ticks - 2 * M
                assert idle * (M + world - 1) == ticks * (world - 1), (name[fn], s, idle, ticks)
    log(f"bubble, every stage, both schedules: {idle}/{ticks} ticks idle = (p-1)/(m+p-1) = "
        f"{(world - 1) / (M + world - 1):.3f}; the same bubble, but 1F1B holds min(p - stage, m), not m")

    head("1F1B with any number of micro-batches: m = 1, m < p, m > p")
    for i, m in enumerate(sorted({1, (world + 1) // 2, world + 1})):
        [stages] = check_pipeline(full, [ROWS] * m, device, [(schedule_1f1b, i % 2 == 0)])
        log(f"m = {m}, {impl(i % 2 == 0)}: loss and grads match, ops replay; peak live activations {peaks(stages)}")

    head("variable sequence length: shapes travel before tensors")
    rows = [1, 4, 2, 5, 3]
    check_pipeline(full, rows, device, [(schedule_1f1b, True), (schedule_1f1b, False)])
    log(f"micro-batch rows {rows}: 1F1B, batched and ordered, matches the one-process model")

    head("two stages, two groups: the ordered implementation's two-stage trick")
    if world == 1:
        log("needs 2 ranks; skipped at world size 1")
    else:
        pair = [world - 2, world - 1]
        pp, second = dist.new_group(pair), dist.new_group(pair)   # every rank creates every group
        [stages] = check_pipeline(full, [ROWS] * M, device, [(schedule_1f1b, False)], pp, second)
        log(f"ranks {pair} as stages 0 and 1, odd->even transfers on the second group: loss "
            f"{stages[-1]['loss']:.6f}, grads match")
    finish("P2P layer (batched, ordered, shapes, two groups); 1F1B and GPipe equal one process; memory measured")


if __name__ == "__main__":
    main()
