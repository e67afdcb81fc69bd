"""What this proves beyond 08's lesson, at every world size W (the pipeline: the world, or sub-groups of it):
- the P2P layer batched and one by one, fixed and variable shapes (padded to the largest), the adjoint
  sum <S x, y> = sum <x, S^T y>; at even W all four transfers at once round the ring, replayed as blocking sends;
- every schedule (1F1B, GPipe, ZB-H1, interleaved v = 2, 3), p <= 8, m <= 12: orders worked by hand, micro-batch
  order, B after F, W after B, micro-batches held and ticks == the closed forms; run_schedule's calls on every
  stage of each (m <= 8; at the W = 2 launch), recorded in one process, replay as NCCL runs them (one by one; each
  call one group), every message received whole, one transfer (the tensor and its flag; variable shapes: its header
  just before it);
- on the world, every schedule batched, 1F1B and interleaved also one by one, == one process (loss, every
  gradient); bytes kept == the model's closed form within [-8 B, A/2) (memory(), to the byte), one call's sends in
  flight, bytes and messages sent == the closed form (a flag an element, or a header), nothing left after the
  step; run_schedule(1F1B) posts the calls of 1F1B written out; micro-batches of different lengths at m = 1,
  m < p, m > p (GPipe and ZB-H1 one by one); the two-stage trick's second group; two pipelines at once on strided
  sub-groups, token ids in, cross-entropy out, non-contiguous activations;
- ZB-H1: B then W == the ordinary backward bit for bit; every .grad contiguous, in autograd's layout, each
  parameter's post-accumulate-grad hook once a micro-batch (as 1F1B); 09's DDP on each stage of a pp x dp grid ==
  one process under ZB-H1 and 1F1B; the tied embedding summed over the first and last stage exactly on gloo, from
  a head's .grad transposed while the embedding's is not; embedding_group on sub-groups;
- every refusal at its boundary, one line on every rank involved: schedules (stage p - 1 passes, p is refused ...),
  messages of another dtype, shape or rank count refused by sender and receiver within seconds, stages built
  differently refused when built; deallocate_output_tensor leaves a view and a leaf alone.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, log, pg_timeout, setup, traffic  # noqa: E402
from tests.tools import held_bytes, lesson, memory, refused, replays, strided_groups  # noqa: E402

m = lesson("08_pipeline_1f1b.py")
HIDDEN, ROWS, M, V = m.HIDDEN, m.ROWS, m.M, m.V
F64 = torch.float64
FLAG = 8                                          # fixed shapes: a message is one transfer, one float64 more
HEADER = 8 * (2 + m.MAX_NDIM)                     # variable_shapes: a header of 7 int64, a transfer before it
NAME = {m.schedule_1f1b: "1F1B", m.schedule_gpipe: "GPipe", m.schedule_interleaved_1f1b: "interleaved",
        m.schedule_zb_h1: "ZB-H1"}


def orders(fn, v, p, mb):
    """Every stage's ops, [(op, micro-batch, chunk)]."""
    return [[(o[0], o[1], o[2] if len(o) > 2 else 0) for o in m.schedule(fn, v)(p, s, mb)] for s in range(p)]


def expected_peak(fn, p, s, mb, v):
    """Micro-batches (x chunks) held from F until B and from F until W, as the docstring states."""
    if fn is m.schedule_gpipe:
        return {"B": mb, "W": mb}
    if fn is m.schedule_interleaved_1f1b:
        held = min(2 * (p - s - 1) + (v - 1) * p + 1, mb * v)
        return {"B": held, "W": held}
    return {"B": min(p - s, mb), "W": min(p, mb) if fn is m.schedule_zb_h1 else min(p - s, mb)}


# ---- replaying posted calls as NCCL runs them ---------------------------------------------------------------
def one_by_one(logs):
    """Each stage's posted ops (comm.log) as tests.tools.replays takes them, isend/irecv one by one, each blocking;
    the tag (group, bytes): a message on the other group, or of another size, does not meet its receive."""
    return [[(kind, peer, (group, nbytes)) for call in log for kind, peer, nbytes, group in call] for log in logs]


def replays_batched(logs):
    """Replay each stage's posted calls (comm.log) as NCCL runs them when each call is one group
    (batch_isend_irecv): its ops wait for each other, in any order, and the stage's next call starts when they
    are all done (NCCL runs a pair's groups in order on one stream). True if every stage gets to the end, each
    message received whole (the i-th send from a to b on a group meets the i-th receive there)."""
    calls, chan, active, at, moved = logs, {}, [[] for _ in logs], [0] * len(logs), True
    while moved:
        moved = False
        for a, mine in enumerate(calls):
            if all(op[1] for op in active[a]) and at[a] < len(mine):   # done: post the next call
                active[a] = []
                for kind, b, nbytes, group in mine[at[a]]:
                    op = [nbytes, False]
                    chan.setdefault((a, b, group) if kind == "send" else (b, a, group), ([], []))[
                        kind == "recv"].append(op)
                    active[a].append(op)
                at[a], moved = at[a] + 1, True
        for sends, recvs in chan.values():
            for snd, rcv in zip(sends, recvs):
                if not snd[1]:
                    if snd[0] != rcv[0]:
                        return False                     # a receive would get a message of another size
                    snd[1] = rcv[1] = moved = True
    return at == [len(c) for c in calls] and all(op[1] for ops in active for op in ops)


def framed(log, nbytes, variable=False):
    """Every message in a stage's calls is one transfer of nbytes (the tensor and its flag); variable: two, the
    tensor padded to nbytes just behind its header, to the same peer, the same way."""
    for call in log:
        pairs = zip(call[::2], call[1::2]) if variable else ((None, d) for d in call)
        assert len(call) % (1 + variable) == 0 and all(d[2] == nbytes and (h is None or (
            h[:2] == d[:2] and h[2] == HEADER and h[3] == d[3])) for h, d in pairs), call
    return True


class Recorder(m.P2PCommunicator):
    """Stage `stage` of a pipeline of p, in this one process: each call runs communicate() as it is, notes in
    self.log the ops it would post, and receives zeros flagged as what this pipeline moves."""

    def __init__(self, p, stage, shape=(1, 1)):
        self.num_stages, self.stage, self.group, self.second_group, self.log = p, stage, None, None, []
        self.is_first, self.is_last = stage == 0, stage == p - 1
        self.shape, self.dtype, self.device, self.variable_shapes = shape, F64, torch.device("cpu"), False
        self._in_flight, self._loop, self._numel = [], ([], []), torch.Size(shape).numel()
        self._flags = [torch.tensor([f], dtype=F64) for f in (0, 1)]

    def _p2p(self, send_next, send_prev, recv_prev, recv_next, wait_sends, meanwhile=None):
        call = [("send" if op is dist.isend else "recv", (self.stage + step) % self.num_stages,
                 t.numel() * t.element_size(), int(second))
                for op, t, step, second in m._posting_order(self, send_next, send_prev, recv_prev, recv_next)]
        self.log += [call] if call else []
        for box in (recv_prev, recv_next):
            for t in box:
                t.zero_()
        if meanwhile is not None:
            meanwhile()


# ---- the schedules, pure, and the runner's calls for every p ---------------------------------------------------
def schedules_checked(rank, world):
    show = lambda ops: " ".join((o[0] if len(o) < 3 or o[2] == 0 else o[0].lower()) + str(o[1]) for o in ops)
    by_hand = [(m.schedule_1f1b(2, 0, 4), "F0 F1 B0 F2 B1 F3 B2 B3"),      # warm-up 1, 3 steady pairs, cool-down 1
               (m.schedule_1f1b(2, 1, 4), "F0 B0 F1 B1 F2 B2 F3 B3"),      # the last stage: each B right after its F
               (m.schedule_1f1b(3, 0, 4), "F0 F1 F2 B0 F3 B1 B2 B3"),      # warm-up 2
               (m.schedule_1f1b(4, 1, 2), "F0 F1 B0 B1"),                  # m < p: warm-up min(2, 2) is every F
               (m.schedule_gpipe(3, 1, 2), "F0 F1 B0 B1"),
               (m.schedule_interleaved_1f1b(2, 0, 4, 2), "F0 F1 f0 f1 F2 b0 F3 b1 f2 B0 f3 B1 b2 b3 B2 B3"),
               (m.schedule_interleaved_1f1b(2, 1, 4, 2), "F0 F1 f0 b0 f1 b1 F2 B0 F3 B1 f2 b2 f3 b3 B2 B3"),
               (m.schedule_zb_h1(2, 0, 4), "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3"),
               (m.schedule_zb_h1(2, 1, 4), "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3")]
    for ops, want in by_hand:
        assert show(ops) == want, (show(ops), want)
    configs = [(fn, v, p, mb) for fn, v in ((m.schedule_1f1b, 1), (m.schedule_gpipe, 1), (m.schedule_zb_h1, 1),
                                            (m.schedule_interleaved_1f1b, 2), (m.schedule_interleaved_1f1b, 3))
               for p in range(1, 9) for mb in range(1, 13) if v == 1 or mb % p == 0]
    replayed = 0
    for fn, v, p, mb in configs[rank::world]:        # each rank checks its share
        traces = orders(fn, v, p, mb)
        for s, ops in enumerate(traces):
            for c in range(v):                       # each chunk: Fs, Bs (and Ws) in micro-batch order
                for op in "FBW" if fn is m.schedule_zb_h1 else "FB":
                    assert [k for o, k, cc in ops if o == op and cc == c] == list(range(mb)), (fn, p, s, mb, op)
            pos = {o: i for i, o in enumerate(ops)}
            assert all(pos[("F", k, c)] < pos[("B", k, c)] < pos.get(("W", k, c), len(ops))
                       for k in range(mb) for c in range(v)), (fn, p, s, mb)   # B after its F, W after its B
            until_w, live, peak = "W" if fn is m.schedule_zb_h1 else "B", [0, 0], [0, 0]  # held F..B, F..W
            for o, _, _ in ops:
                live = [live[0] + (o == "F") - (o == "B"), live[1] + (o == "F") - (o == until_w)]
                peak = [max(a, b) for a, b in zip(peak, live)]
            assert {"B": peak[0], "W": peak[1]} == expected_peak(fn, p, s, mb, v), (fn, p, s, mb, peak)
        total = {m.schedule_1f1b: 2 * (mb + p - 1), m.schedule_gpipe: 2 * (mb + p - 1),
                 m.schedule_zb_h1: max(3 * mb + p - 1, 2 * mb + 2 * p - 1),
                 m.schedule_interleaved_1f1b: 2 * mb * v + 2 * (p - 1)}
        assert max(m.op_ticks(traces, v).values()) == total[fn], (fn, v, p, mb)
        if fn is m.schedule_1f1b:                    # 1F1B with each B also doing W's work: 2 ticks
            assert max(m.op_ticks(traces, 1, {"F": 1, "B": 2}).values()) == 3 * (mb + p - 1), (p, mb)
        if p > 1 and mb <= 8 and world == 2:        # run_schedule's calls on every stage, recorded here (the
            # same at every world size: the launch at W = 2 runs them, its two ranks half each)
            logs = []
            for s in range(p):
                comm = Recorder(p, s)
                chunks = [nn.Linear(1, 1, dtype=F64) for _ in range(v)]
                _, trace, calls = m.run_schedule(chunks[0] if v == 1 else chunks, m.schedule(fn, v), comm,
                                                 [torch.zeros(1, 1, dtype=F64)] * mb, [None] * mb,
                                                 lambda y, t: y.sum())
                assert trace == traces[s] and calls == comm.log and framed(comm.log, 8 + FLAG), (fn, p, s, mb)
                logs.append(comm.log)
            assert replays(one_by_one(logs)) and replays_batched(logs), (NAME[fn], v, p, mb)
            replayed += 1
    counts = torch.tensor([replayed])
    dist.all_reduce(counts)
    log(f"{len(by_hand)} orders worked by hand; {len(configs)} schedules, p <= 8, m <= 12, interleaved v = 2, 3:")
    log("in micro-batch order, B after F, W after B; held and ticks == the closed forms")
    log(f"run_schedule's calls on every stage of {counts.item()} schedules (p <= 8, m <= 8) replay as NCCL runs them"
        if world == 2 else "(run_schedule's calls for every p, m <= 8 are replayed at the W = 2 launch)")


# ---- the P2P layer --------------------------------------------------------------------------------------------
def p2p_layer(rank, world, device):
    sent_by = lambda r, d, n: torch.randint(-9, 10, (n, 3), generator=torch.Generator().manual_seed(
        10 * r + d)).to(device, F64)                 # what rank r sends in direction d: every rank can rebuild it
    for batched in (True, False):
        for variable in (True, False):               # the last round has fixed shapes, for the adjoint below
            n = (lambda r: 1 + r % 3) if variable else (lambda r: 2)
            comm = m.P2PCommunicator((3 if variable else 2, 3), F64, device, batched=batched,
                                     variable_shapes=variable)
            x, y = sent_by(rank, 0, n(rank)), sent_by(rank, 1, n(rank))
            # rank r's first call meets rank r+1's second: the calls complete from the last rank back to rank 0
            got_next = comm.send_forward_recv_backward(x)
            got_prev = comm.send_backward_recv_forward(y)
            # rank r => got_prev = rank r-1's x (None at r = 0), got_next = rank r+1's y (None at the last rank)
            assert got_prev is None if rank == 0 else torch.equal(got_prev, sent_by(rank - 1, 0, n(rank - 1)))
            assert got_next is None if rank == world - 1 else torch.equal(got_next, sent_by(rank + 1, 1, n(rank + 1)))
            assert framed(comm.log, (9 if variable else 6) * 8 + (0 if variable else FLAG), variable)
    # adjoint: sum_r <S x, y>_r = sum_r <x, S^T y>_r with S = send_forward, S^T = send_backward
    zero = torch.zeros((), dtype=F64, device=device)
    dots = torch.stack([zero if got_prev is None else (got_prev * y).sum(),      # <S x, y> on this rank
                        zero if got_next is None else (x * got_next).sum()])     # <x, S^T y> on this rank
    dist.all_reduce(dots)
    assert dots[0] == dots[1], dots
    if world % 2 == 0:                               # all four at once, on a ring: even/odd order pairs every link
        comm = m.P2PCommunicator((2, 3), F64, device, batched=False)
        from_prev, from_next = comm.communicate(send_next=x.t().contiguous().t(), send_prev=y, recv_prev=True,
                                                recv_next=True)
        assert torch.equal(from_prev, sent_by((rank - 1) % world, 0, 2)), from_prev
        assert torch.equal(from_next, sent_by((rank + 1) % world, 1, 2)), from_next
        logs = [None] * world
        dist.all_gather_object(logs, comm.log)
        assert replays(one_by_one(logs)), "posted one by one, the four transfers wait on each other"
    log("batched and one by one, fixed and variable shapes (behind headers): each stage got its neighbours' tensors;")
    log(f"sum <S x, y> = sum <x, S^T y> = {dots[0].item():.0f}"
        + ("; all four at once round the ring (one column-major)" if world % 2 == 0 else ""))


# ---- every schedule on the world against one process, to the byte -----------------------------------------------
def loop_1f1b(model, comm, inputs, targets, loss_fn):
    """1F1B written out in its three phases (picotron's form) on the P2P layer, one call after each F and each B:
    send what it made, receive what the next op needs. run_schedule(model, schedule_1f1b, ...) must post exactly
    these calls. Returns the loss on the last stage, else None."""
    p, s, mb = comm.num_stages, comm.stage, len(inputs)
    first, last, warmup = comm.is_first, comm.is_last, min(p - s - 1, mb)
    held, loss, done = [], [], [0, 0]                # done: Fs and Bs run

    def forward(x):                                  # F of the next micro-batch; returns what goes to the next stage
        k, done[0] = done[0], done[0] + 1
        x = inputs[k] if first else x.requires_grad_()
        y = model(x)
        if last:
            y = loss_fn(y, targets[k]) / mb
            loss.append(y.detach())
        held.append((x, y))
        return None if last else y.detach()

    def backward(dy):                                # B of the oldest micro-batch held; returns its input's grad
        x, y = held.pop(0)
        torch.autograd.backward(y, dy)
        return None if first else x.grad

    def call(y=None, dx=None, recv_prev=False, recv_next=False):
        got = comm.communicate(send_next=y, send_prev=dx, recv_prev=recv_prev and not first,
                               recv_next=recv_next and not last, wait_sends=False)
        if y is not None:
            m.deallocate_output_tensor(held[-1][1])
        return got

    x = comm.recv_forward()
    for i in range(warmup):                          # warm-up: F; its output, the next F's input (or first B's grad)
        x, dy = call(y=forward(x), recv_prev=i + 1 < mb, recv_next=i + 1 == mb)
    steady = mb - warmup
    for i in range(steady):                          # steady: F; its output, B's grad; B; its grad, the next input
        dy = call(y=forward(x), recv_next=True)[1]
        x, dy = call(dx=backward(dy), recv_prev=i + 1 < steady, recv_next=i + 1 == steady and warmup > 0)
    for i in range(warmup):                          # cool-down: B; its grad, the next B's grad
        dy = call(dx=backward(dy), recv_next=i + 1 < warmup)[1]
    comm.wait_sends()
    return sum(loss) if loss else None


class Metered(m.P2PCommunicator):
    """A P2PCommunicator that notes, as each call starts, the bytes the previous call's sends still hold."""

    in_flight = 0

    def communicate(self, *args, **kwargs):
        self.in_flight = max(self.in_flight, held_bytes(t for _, t in self._in_flight))
        return super().communicate(*args, **kwargs)


def kept_per_microbatch(p, s, v, blocks, a, split, flag=FLAG):
    """Bytes one micro-batch keeps on chunk c of stage s, from the model: each TanhBlock keeps its Linear's input
    and its tanh's output (2a); the chunk's input is the micro-batch itself on the first stage (allocated before
    the step: not counted); the loss keeps its input (a); a sent output shrinks to one element (8). With W
    (split), B needs each Linear's output too (+a each) and from B to W each Linear keeps its input and output
    gradient (2a each), except model chunk 0, whose W runs the whole backward: it keeps all its F kept, and the
    gradient received, until W. A received input is its message's view, a + flag (p > 1). Returns [(F..B, B..W)
    for each chunk]."""
    out = []
    for c in range(v):
        first, last = s == 0 and c == 0, c * p + s == p * v - 1
        x = (a + flag * (p > 1)) * (not first)   # the chunk's input
        f_to_b = (2 * blocks - 1 + last + blocks * split * (not first)) * a + x + 8
        dy = (a + flag * (p > 1)) * (not last)   # the gradient received: chunk 0 keeps it from B to W (W: all)
        out.append((f_to_b, f_to_b + dy if split and first else ((2 * blocks - 1) * a + x) * split))
    return out                                       # (+8: a sent output's one element, or the loss)


def working_set(chunk, x, target, last, split, mb, first=False):
    """{op: the most bytes it holds above what it keeps after (F) or holds before (B, W)}: each op's temporaries
    (the gradients on their way through a backward), measured in one process on one micro-batch of this chunk.
    first: model chunk 0 (its input is data); with W, its B does nothing and its W the whole backward."""
    x = x.detach().clone().requires_grad_(x.dtype.is_floating_point and not first)   # as received, or data
    whole, split = split and first, split and not first
    with memory() as mem:
        y, keep = m.forward_keeping(chunk, x) if split else (chunk(x), None)
        y = F.mse_loss(y, target) / mb if last else y
        temps = {"F": mem.peak - mem.live()}
        dy = None if last else torch.ones_like(y)   # the gradient B receives
        mem.reset()
        before = mem.live()
        if split:
            _, store = m.backward_input(x, y, dy, keep)
            del keep, y, dy
            temps["B"] = mem.peak - before
            mem.reset()
            before = mem.live()
            m.backward_weight(store)
            temps["W"] = mem.peak - before
        else:
            torch.autograd.backward(y, dy)
            temps["B"] = mem.peak - before
            if whole:                                # all of it in W
                temps["W"], temps["B"] = temps["B"], 0
        return temps


def runner_steps(p, s, v, ops):
    """run_schedule's walk on stage s, from its rule: [("call", [(send | recv, op)]) or ("op", op)]: a call for the
    first unit's inputs; then each unit's ops, one call (what they made, the next unit's inputs), inside which the
    Ws that follow them run. Units: each F and B; with chunks, Megatron's warm-up Fs, F-B pairs, cool-down Bs."""
    last, core = p * v - 1, [o for o in ops if o[0] != "W"]
    fwd, bwd = [o for o in core if o[0] == "F"], [o for o in core if o[0] == "B"]
    w = min(2 * (p - s - 1) + (v - 1) * p, len(fwd))
    units = [[o] for o in core] if v == 1 else ([[f] for f in fwd[:w]] + [list(fb) for fb in zip(fwd[w:], bwd)]
                                                + [[b] for b in bwd[len(fwd) - w:]])
    needs = lambda u: [("recv", o) for o in u if (o[2] * p + s > 0 if o[0] == "F" else o[2] * p + s < last)]
    makes = lambda u: [("send", o) for o in u if (o[2] * p + s < last if o[0] == "F" else o[2] * p + s > 0)]
    after, prev = {}, None
    for o in ops:
        after.setdefault(prev, []).append(o) if o[0] == "W" else None
        prev = o if o[0] != "W" else prev
    steps = [("call", needs(units[0]))]
    for i, u in enumerate(units):
        steps += [("op", o) for o in u] + [("call", makes(u) + (needs(units[i + 1]) if i + 1 < len(units) else []))]
        steps += [("op", w_) for o in u for w_ in after.get(o, [])]
    return steps


def most_kept(steps, kept, a, temps, loop=False, flag=FLAG, header=0):
    """The most bytes a stage holds at once, walking its steps: what each micro-batch keeps from F to B
    (kept[c][0]) and from B to W (kept[c][1]), plus its messages: an output (a) from its op until the call that
    sends it, its copy (a + flag) in flight from then until the next call; an input (a + flag) from the call that
    receives it until its op (an F's input is then part of what the F keeps; a B's is let go); in the call, before
    the outputs sent are deallocated, both, and each header received (variable shapes; the one sent is made by
    torch.tensor, which memory() does not see); plus, during each op, its temporaries (temps[c][op],
    working_set's: above what an F keeps after it, above what a B or W finds before it). loop: a one-stage ring,
    where the tensor received is the one sent: it is counted from its op to the op that takes it."""
    msgs = [x for kind, what in steps if kind == "call" for x in what]
    sent, got = {o for k, o in msgs if k == "send"}, {o for k, o in msgs if k == "recv"}
    now, most, flight = 0, 0, 0
    for kind, what in steps:
        if kind == "call" and not loop:             # the last call's sends are let go; copies made, receives posted
            sends, recvs = (sum(k == kind for k, _ in what) for kind in ("send", "recv"))
            now, flight = now - flight + (sends + recvs) * (a + flag), sends * (a + flag)
            most = max(most, now + recvs * header)
            now -= sends * a                         # the outputs sent: deallocated
        elif kind == "op":
            op, _, c = what
            before = now
            now += {"F": kept[c][0], "B": kept[c][1] - kept[c][0], "W": -kept[c][1]}[op] + a * (what in sent) \
                - (a + flag * (not loop)) * (what in got)
            most = max(most, (now if op == "F" else before) + temps[c][op])
    return max(most, now)


def check_pipeline(full, device, runs, variable=False, group=None, second_group=None):
    """For each (fn, batched, rows) in runs: micro-batches for `full` (micro-batch k has rows[k] rows), alike on
    every rank; the loss and grads of the whole model in one process on the whole batch; one step through the
    pipeline on `group`'s ranks (fn: a schedule for run_schedule, or loop_1f1b), each stage checked against them:
    loss, grads, bytes kept and in flight, bytes sent, headers. Every rank calls it; returns, per run, every
    stage's results, once each run's calls replay as NCCL would run them."""
    pg = group if group is not None else dist.group.WORLD
    mine, refs = [None] * len(runs), {}              # mine stays None where this rank is not in the pipeline
    for i, (fn, batched, rows) in enumerate(runs if dist.get_rank(pg) >= 0 else []):
        if tuple(rows) not in refs:
            gen = torch.Generator(device).manual_seed(len(rows))
            xs = [torch.randn(n, HIDDEN, dtype=F64, device=device, generator=gen) for n in rows]
            ts = [torch.randn(n, HIDDEN, dtype=F64, device=device, generator=gen) for n in rows]
            # reference: the whole batch at once; row weights make it the mean over micro-batches of each one's MSE
            weight = torch.cat([torch.full((n, 1), 1 / (len(rows) * n * HIDDEN), dtype=F64, device=device)
                                for n in rows])
            full.zero_grad(set_to_none=True)
            ref_loss = ((full(torch.cat(xs)) - torch.cat(ts)) ** 2 * weight).sum()
            ref_loss.backward()
            refs[tuple(rows)] = xs, ts, ref_loss.detach(), {id(q): q.grad.clone() for q in full.parameters()}
        xs, ts, ref_loss, ref = refs[tuple(rows)]
        full.zero_grad(set_to_none=True)
        comm = Metered((max(rows), HIDDEN), F64, device, group, batched, variable, second_group)
        p, s, mb = comm.num_stages, comm.stage, len(rows)
        v = V if fn is m.schedule_interleaved_1f1b else 1
        split = fn is m.schedule_zb_h1
        stage = m.stage_layers(full, p, s, v)
        own = list(nn.ModuleList([stage] if v == 1 else stage).parameters())
        measure = batched and len(set(rows)) == 1   # bytes kept: a closed form for micro-batches of one size
        for q in own:                                # gradients exist before the step: memory() sees activations
            q.grad = torch.zeros_like(q)
        if measure:                                  # one op's temporaries, on one micro-batch in one process
            temps = [working_set(chunk, xs[0], ts[0], c * p + s == p * v - 1, split, mb, c * p + s == 0)
                     for c, chunk in enumerate([stage] if v == 1 else stage)]
            for q in own:
                q.grad.zero_()
        with traffic() as t, memory() as mem:
            if fn is loop_1f1b:
                loss = loop_1f1b(stage, comm, xs, ts, F.mse_loss)
            else:
                loss, trace, calls = m.run_schedule(stage, m.schedule(fn, v), comm, xs, ts, F.mse_loss)
                assert calls == comm.log and trace == orders(fn, v, p, mb)[s], (NAME[fn], s)
            left = mem.live()
        if comm.is_last:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        for q in full.parameters():                  # this stage's grads are the reference's; no other grad
            assert q.grad is None if all(q is not o for o in own) else torch.allclose(q.grad, ref[id(q)], rtol=1e-9,
                                                                                       atol=0)
        # bytes: what the schedule's micro-batches keep, [K, K + half a micro-batch's message); nothing left after
        a = max(rows) * HIDDEN * 8                   # one activation (or message) of the largest micro-batch
        if measure:
            flag = 0 if variable else FLAG           # variable shapes: no flag, a header before each message
            kept = kept_per_microbatch(p, s, v, len(full) // (p * v), a, split, flag)
            steps = runner_steps(p, s, v, orders(m.schedule_1f1b if fn is loop_1f1b else fn, v, p, mb)[s])
            most = most_kept(steps, kept, a, temps, p == 1, flag, HEADER * variable)
            # peak = what the micro-batches and messages keep + the temporaries of the op running then (+ the
            # losses' scalars, 8 bytes each): one activation or message more at the peak fails it, ZB-H1's too
            assert most - 8 <= mem.peak < most + a // 2, (NAME.get(fn, "loop"), s, mem.peak / a, most / a)
            worst = max(x for ops in temps for x in ops.values())
            if v == 1 and not split and worst + 2 * (a + FLAG) < kept[0][0]:   # where one op's temporaries and
                # two messages weigh less than a micro-batch, the count: 1F1B min(p - s, m), GPipe m
                assert mem.peak // kept[0][0] == expected_peak(fn if fn is not loop_1f1b else m.schedule_1f1b, p,
                                                               s, mb, v)["B"], (NAME.get(fn), s, mem.peak)
            assert left == held_bytes([loss] if loss is not None else []), (NAME.get(fn), s, left)
        assert comm.in_flight <= (a + (HEADER if variable else FLAG)) * (1 + (v > 1)) * (p > 1), (s, comm.in_flight)
        sends = (2 * v - (s == 0) - (s == p - 1)) * mb if p > 1 else 0            # messages this stage sends
        per_side = mb * (a + HEADER) if variable else sum(n * HIDDEN * 8 for n in rows) + mb * FLAG
        assert t.counts["send"] == (1 + variable) * sends and t.bytes["send"] == sends // mb * per_side, (s, t.bytes)
        assert {ranks for _, ranks, _ in t.calls} <= {tuple(dist.get_process_group_ranks(pg))}, t.calls
        assert sum(b for call in comm.log for kind, _, b, _ in call if kind == "send") == t.bytes["send"]
        assert framed(comm.log, a + FLAG * (not variable), variable)
        mine[i] = {"loss": None if loss is None else loss.item(), "log": comm.log, "sent": t.bytes["send"],
                   "peak": mem.peak, "a": a}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    results = [[r[i] for r in everyone if r[i] is not None] for i in range(len(runs))]
    for (fn, batched, _), stages in zip(runs, results):
        logs = [r["log"] for r in stages]            # NCCL: isend/irecv one by one, or each call one group
        assert replays(one_by_one(logs)) and replays_batched(logs), NAME.get(fn, "loop")
    return results


def equal_one_process(full, device, world, mb=4):
    m_int = -(-mb // world) * world                  # interleaved: m a multiple of p
    combos = [(fn, batched, [ROWS] * (m_int if fn is m.schedule_interleaved_1f1b else mb)) for fn, batched in (
        (loop_1f1b, True), (m.schedule_1f1b, True), (m.schedule_1f1b, False), (m.schedule_gpipe, True),
        (m.schedule_interleaved_1f1b, True), (m.schedule_interleaved_1f1b, False), (m.schedule_zb_h1, True))]
    runs = check_pipeline(full, device, combos)      # (one by one, GPipe and ZB-H1 run in any_m and the replays)
    assert [r["log"] for r in runs[0]] == [r["log"] for r in runs[1]], "run_schedule != 1F1B written out"
    log(f"1F1B written out, 1F1B, GPipe, interleaved (m = {m_int}), ZB-H1 at m = {mb}, batched (1F1B, interleaved also")
    log(f"one by one): loss and {2 * len(full)} grads == one process; peak (memory()) - (what the micro-batches and")
    log("messages keep + the running op's temporaries) in [-8 B, A/2); peak // one micro-batch = min(p - s, m)")
    log("for 1F1B, m for GPipe; one call's sends in flight; nothing left; bytes and messages (one transfer each)")
    log("== the closed form; run_schedule(1F1B) posts the calls of 1F1B written out")


def any_m(full, device, world):
    rows = lambda mb: [1 + 3 * k % 5 for k in range(mb)]                      # 1, 4, 2, 5, 3, 1, ...
    ms = [1, (world + 1) // 2, world + 1]            # m = 1, m < p, m > p
    sweep = [(m.schedule_1f1b, True, rows(ms[0])), (m.schedule_zb_h1, False, rows(ms[1])),
             (m.schedule_gpipe, False, rows(ms[2])), (m.schedule_interleaved_1f1b, False, rows(world))]
    check_pipeline(full, device, sweep, variable=True)
    log(f"variable shapes, padded to the largest (rows 1, 4, 2, 5, 3, ...): 1F1B at m = {ms[0]}, ZB-H1 at {ms[1]},")
    log(f"GPipe at {ms[2]} (one by one), interleaved at {world}: losses and grads == one process")


def two_stage_trick(full, device, world):
    if world == 2:                                   # second_group: accepted with exactly two stages
        m.P2PCommunicator((1,), F64, device, batched=False, second_group=dist.group.WORLD)
    else:
        refused(lambda: m.P2PCommunicator((1,), F64, device, batched=False, second_group=dist.group.WORLD))
    if world == 1:
        return
    pair = [world - 2, world - 1]
    pp, second = (dist.new_group(pair, timeout=pg_timeout()) for _ in "12")   # every rank creates every group
    if dist.get_rank() in pair:                      # batched with a second group: refused
        refused(lambda: m.P2PCommunicator((1,), F64, device, pp, batched=True, second_group=second))
    runs = [(m.schedule_1f1b, False, [ROWS] * 3), (m.schedule_interleaved_1f1b, False, [ROWS] * 4)]
    for (fn, _, _), stages in zip(runs, check_pipeline(full, device, runs, group=pp, second_group=second)):
        for s, r in enumerate(stages):               # sends from the odd stage, receives on the even one: group 1
            groups = [g for call in r["log"] for kind, _, _, g in call]
            assert groups == [int((kind == "send") == (s == 1)) for call in r["log"] for kind, *_ in call], groups
    log(f"second_group: 2 stages accepted, {world} refused (or batched); 1F1B and interleaved on ranks {pair}")
    log("== one process, every odd->even transfer on the second group")


class Strided(nn.Module):
    """The identity, returning a non-contiguous tensor (what a transpose leaves): P2P must copy it first."""

    def forward(self, x):
        return x.t().contiguous().t()


def pipelines_on_subgroups(device, rank, world):
    made = strided_groups(2)                         # every rank creates every group, in the same order
    members, (pp, ranks) = [r for _, r in made], made[rank % 2]
    p, s, vocab = len(ranks), ranks.index(rank), 11
    gen = torch.Generator(device).manual_seed(rank % 2)   # each pipeline its own model and data
    torch.manual_seed(rank % 2)
    blocks = [m.TanhBlock(HIDDEN, F64, device) for _ in range(2 * p)]
    embed, lm_head = nn.Embedding(vocab, HIDDEN, dtype=F64, device=device), nn.Linear(HIDDEN, vocab, dtype=F64,
                                                                                      device=device)
    full = nn.Sequential(embed, *blocks, lm_head)
    stage = nn.Sequential(*([embed] if s == 0 else []), *blocks[2 * s:2 * s + 2],
                          *([lm_head] if s == p - 1 else [Strided()]))
    ids = torch.randint(0, vocab, (M, 2 * ROWS), device=device, generator=gen)[:, ::2]   # token ids, strided
    targets = torch.randint(0, vocab, (M, ROWS), device=device, generator=gen)
    ref_loss = F.cross_entropy(full(ids.reshape(-1)), targets.reshape(-1))
    ref_loss.backward()
    ref = {id(q): q.grad.clone() for q in full.parameters()}
    for fn in (loop_1f1b, m.schedule_1f1b, m.schedule_zb_h1):
        full.zero_grad(set_to_none=True)
        comm = m.P2PCommunicator((ROWS, HIDDEN), F64, device, pp)
        with traffic() as t:
            if fn is loop_1f1b:
                loss = loop_1f1b(stage, comm, list(ids), list(targets), F.cross_entropy)
            else:
                loss = m.run_schedule(stage, fn, comm, list(ids), list(targets), F.cross_entropy)[0]
        if s == p - 1:
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
        own = {id(q) for q in stage.parameters()}
        for q in full.parameters():
            assert q.grad is None if id(q) not in own else torch.allclose(q.grad, ref[id(q)], rtol=1e-9, atol=0)
        assert {c[1] for c in t.calls} <= {tuple(ranks)}, t.calls   # on this pipeline's group, nowhere else
        assert t.counts["send"] == (2 - (s == 0) - (s == p - 1)) * M * (p > 1), t.counts   # a transfer each
    log(f"pipelines on {members} at once: token ids in (never sent), cross-entropy out, non-contiguous")
    log("activations: 1F1B written out, run_schedule's 1F1B and ZB-H1 == each pipeline in one process")


# ---- ZB-H1's weight gradients: autograd's layout, its hooks, a data-parallel wrapper, a tied embedding ------------
def split_backward(device):
    model = nn.Sequential(*(m.TanhBlock(HIDDEN, F64, device) for _ in range(3)))
    x = torch.randn(ROWS, 2 * HIDDEN, dtype=F64, device=device)[:, ::2]   # a non-contiguous input
    dy = torch.randn(ROWS, HIDDEN, dtype=F64, device=device)
    x1 = x.clone().requires_grad_()
    model(x1).backward(dy)                           # the ordinary backward: input and weight grads at once
    want = [x1.grad] + [q.grad.clone() for q in model.parameters()]
    strides = [q.grad.stride() for q in model.parameters()]
    model.zero_grad(set_to_none=True)
    fired = {id(q): 0 for q in model.parameters()}
    hooks = [q.register_post_accumulate_grad_hook(lambda q: fired.__setitem__(id(q), fired[id(q)] + 1))
             for q in model.parameters()]
    for rounds in (1, 2):                            # the second: W adds into .grad, as autograd does
        x2 = x.clone().requires_grad_()
        y, kept = m.forward_keeping(model, x2)
        x_grad, saved = m.backward_input(x2, y, dy, kept)
        assert x2.grad is None and set(fired.values()) == {rounds - 1}, "B wrote a gradient"
        assert all((q.grad is None) == (rounds == 1) for q in model.parameters()), "B wrote a gradient"
        assert [mod for mod, _, _ in saved] == [b.fc for b in model], saved
        m.backward_weight(saved)
        got = [x_grad] + [q.grad / rounds for q in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), "B then W differs from the ordinary backward"
        assert [q.grad.stride() for q in model.parameters()] == strides and all(
            q.grad.is_contiguous() for q in model.parameters()), "W's .grad is not in autograd's layout"
        assert set(fired.values()) == {rounds}, fired  # each parameter's hook once a W
    for h in hooks:
        h.remove()
    log(f"B: the input's and each Linear's output grad, no weight grad; W: {len(want) - 1} weight grads == the")
    log("ordinary backward bit for bit, in its layout, added into .grad; each post-accumulate hook once a W")


def hooks_per_step(full, device, world):
    """Under 1F1B and ZB-H1: every parameter's post-accumulate-grad hook fires once a micro-batch, every .grad is
    contiguous, in its parameter's layout, and equals one process."""
    p, s = world, dist.get_rank()
    stage = m.stage_layers(full, p, s)
    gen = torch.Generator(device).manual_seed(9)
    xs, ts = ([torch.randn(ROWS, HIDDEN, dtype=F64, device=device, generator=gen) for _ in range(4)] for _ in "xt")
    full.zero_grad(set_to_none=True)
    (sum(F.mse_loss(full(x), t) for x, t in zip(xs, ts)) / 4).backward()          # one process
    want = {id(q): q.grad.clone() for q in stage.parameters()}
    counts = {}
    for fn in (m.schedule_1f1b, m.schedule_zb_h1):
        full.zero_grad(set_to_none=True)
        fired = {id(q): 0 for q in stage.parameters()}
        hooks = [q.register_post_accumulate_grad_hook(lambda q: fired.__setitem__(id(q), fired[id(q)] + 1))
                 for q in stage.parameters()]
        m.run_schedule(stage, fn, m.P2PCommunicator((ROWS, HIDDEN), F64, device), xs, ts, F.mse_loss)
        for q in stage.parameters():
            assert q.grad.is_contiguous() and q.grad.stride() == q.stride(), (NAME[fn], q.grad.stride())
            assert torch.allclose(q.grad, want[id(q)], rtol=1e-9, atol=1e-15), NAME[fn]
        counts[fn] = set(fired.values())
        for h in hooks:
            h.remove()
    assert counts[m.schedule_1f1b] == counts[m.schedule_zb_h1] == {4}, counts
    log("1F1B and ZB-H1 == one process, every .grad contiguous in its parameter's layout; each parameter's")
    log("post-accumulate-grad hook once a micro-batch (4 a step) under both")


def ddp_on_stages(device, rank, world):
    """09's DDP wrapping each stage of a pp x dp grid (pipelines of consecutive ranks, replicas across them) of a
    tied LM: every backward under no_sync(), allreduce_tied_grad on the wrapper's main_grad (p.grad is not there
    yet), then sync_gradients(); each stage's .grad, the tied weight's on both ends, == one process."""
    ddp = lesson("09_ddp_zero2.py")
    pp = 2 if world % 2 == 0 else world
    dp = world // pp
    pipes = [list(range(d * pp, (d + 1) * pp)) for d in range(dp)]
    replicas = [list(range(s, world, pp)) for s in range(pp)]
    pp_groups = [dist.new_group(r, timeout=pg_timeout()) for r in pipes]    # every rank makes every group
    dp_groups = [dist.new_group(r, timeout=pg_timeout()) for r in replicas]
    tied = m.embedding_group(pipes, timeout=pg_timeout())  # this pipeline's first and last stage (pp = 1: None)
    d, s, MB, vocab = rank // pp, rank % pp, 2, 11    # MB micro-batches a pipeline
    gen = torch.Generator(device).manual_seed(7)
    ids, tgt = ([torch.randint(vocab, (ROWS,), device=device, generator=gen) for _ in range(dp * MB)] for _ in "it")
    for fn in (m.schedule_1f1b, m.schedule_zb_h1):
        torch.manual_seed(7)
        embed = nn.Embedding(vocab, HIDDEN, dtype=F64, device=device)
        lm_head = nn.Linear(HIDDEN, vocab, bias=False, dtype=F64, device=device)
        lm_head.weight = embed.weight                 # tied: one Parameter, on stage 0 and stage pp - 1
        blocks = nn.Sequential(*(m.TanhBlock(HIDDEN, F64, device) for _ in range(2 * pp)))
        full = nn.Sequential(embed, *blocks, lm_head)
        ref = sum(F.cross_entropy(full(i), t) for i, t in zip(ids, tgt)) / (dp * MB)   # one process, whole batch
        ref.backward()
        want = {id(q): q.grad.clone() for q in full.parameters()}
        full.zero_grad(set_to_none=True)
        stage = nn.Sequential(*[embed] * (s == 0), *m.stage_layers(blocks, pp, s), *[lm_head] * (s == pp - 1))
        model = ddp.DDP(stage, torch.optim.SGD(stage.parameters(), lr=0.1), group=dp_groups[s])
        comm = m.P2PCommunicator((ROWS, HIDDEN), F64, device, pp_groups[d])
        with model.no_sync():
            mine = slice(d * MB, (d + 1) * MB)
            loss = m.run_schedule(model, fn, comm, ids[mine], tgt[mine], F.cross_entropy)[0]
        m.allreduce_tied_grad(embed.weight, tied)     # into main_grad (p.grad: not there yet), before the sync
        model.sync_gradients()
        for q in stage.parameters():
            assert q.grad.is_contiguous() and torch.allclose(q.grad, want[id(q)], rtol=1e-9, atol=1e-15), NAME[fn]
        losses = torch.stack([loss if loss is not None else torch.zeros((), dtype=F64, device=device)])
        dist.all_reduce(losses)
        torch.testing.assert_close(losses[0] / dp, ref.detach(), rtol=1e-12, atol=0)
    log(f"09's DDP on each stage of {dp} pipeline(s) x {pp} stages of a tied LM (no_sync, allreduce_tied_grad on")
    log("main_grad, then sync_gradients()): 1F1B and ZB-H1 == one process, the tied weight's too (ZB-H1's W reaches")
    log("the buckets through autograd's hooks)")


def tied_embedding(device, rank, world):
    """The tied weight's copies on the first and last stage, summed by allreduce_tied_grad after ZB-H1: equal to
    one process and to each other bit for bit, from a transposed .grad too, and None counting as zeros."""
    p, s, vocab = world, rank, 11
    torch.manual_seed(3)
    embed = nn.Embedding(vocab, HIDDEN, dtype=F64, device=device)
    head_ = nn.Linear(HIDDEN, vocab, bias=False, dtype=F64, device=device)
    head_.weight = embed.weight
    blocks = nn.Sequential(*(m.TanhBlock(HIDDEN, F64, device) for _ in range(2 * p)))
    lm = nn.Sequential(embed, *blocks, head_)
    mine = nn.Sequential(*[embed] * (s == 0), *m.stage_layers(blocks, p, s), *[head_] * (s == p - 1))
    gen = torch.Generator(device).manual_seed(4)
    ids, tgt = ([torch.randint(vocab, (ROWS,), device=device, generator=gen) for _ in range(4)] for _ in "it")
    ref = sum(F.cross_entropy(lm(i), t) for i, t in zip(ids, tgt)) / 4
    ref.backward()
    want = embed.weight.grad.clone()
    group = m.embedding_group(timeout=pg_timeout())
    assert (group is None) == (p == 1 or 0 < s < p - 1), group
    assert group is None or dist.get_process_group_ranks(group) == [0, p - 1], dist.get_process_group_ranks(group)
    copies = []
    for layout in ("autograd's", "transposed"):
        lm.zero_grad(set_to_none=True)
        m.run_schedule(mine, m.schedule_zb_h1, m.P2PCommunicator((ROWS, HIDDEN), F64, device), ids, tgt,
                       F.cross_entropy)
        if s in (0, p - 1):
            assert embed.weight.grad.is_contiguous(), embed.weight.grad.stride()
            if layout == "transposed" and s == p - 1:   # the head's copy transposed, the embedding's not: gloo
                embed.weight.grad = embed.weight.grad.t().contiguous().t()   # sums such a pair wrongly
        m.allreduce_tied_grad(embed.weight, group)
        if s in (0, p - 1):
            torch.testing.assert_close(embed.weight.grad, want, rtol=1e-12, atol=1e-15)
            copies.append(embed.weight.grad.clone())
    every = [None] * world
    dist.all_gather_object(every, [c.cpu() for c in copies])
    assert all(torch.equal(a, b) for a, b in zip(every[0], every[p - 1])), "the two copies differ"
    if group is not None:                            # a copy that got no gradient counts as zeros
        embed.weight.grad = None if s == 0 else want.clone()
        m.allreduce_tied_grad(embed.weight, group)
        assert torch.equal(embed.weight.grad, want), "a .grad of None is not zeros"
    if world == 4:                                   # two pipelines on the strided groups: {0, 2} and {1, 3}
        g = m.embedding_group([[0, 2], [1, 3]], timeout=pg_timeout())
        assert dist.get_process_group_ranks(g) == [rank % 2, rank % 2 + 2], dist.get_process_group_ranks(g)
    log(f"the tied weight after ZB-H1, summed over stages {sorted({0, p - 1})}: == one process, the two copies equal")
    log("bit for bit, from a transposed head's .grad too; None counts as zeros")


# ---- refusals at their boundaries -------------------------------------------------------------------------------
def check_refusals(device, rank, world):
    def said(call, start):                           # refused in one line, nothing sent, saying `start`
        msg = refused(call)
        assert msg.startswith(start), (start, msg)
    for fn in (m.schedule_1f1b, m.schedule_gpipe, m.schedule_zb_h1):
        fn(3, 2, 1), fn(3, 0, 1), fn(1, 0, 1)        # the last valid stage, the first, one stage, one micro-batch
        for bad in ((3, 3, 1), (3, -1, 1), (3, 0, 0), (0, 0, 1)):
            said(lambda: fn(*bad), "need num_stages >= 1")
    il = m.schedule_interleaved_1f1b
    il(2, 1, 2, 2), il(2, 0, 4, 2)                   # m = p, m = 2p; two chunks
    for bad in ((2, 2, 2, 2), (2, 0, 3, 2), (2, 0, 2, 1)):
        said(lambda: il(*bad), "need num_stages" if bad[1] == 2 else "interleaved 1F1B needs")
    blocks = nn.Sequential(*(m.TanhBlock(HIDDEN, F64, device) for _ in range(8)))
    assert len(m.stage_layers(blocks, 2, 1, 2)) == 2 and len(m.stage_layers(blocks, 4, 3)) == 2
    said(lambda: m.stage_layers(blocks, 3, 0), "8 blocks do not split evenly")
    said(lambda: m.op_ticks([[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]]), "the schedules wait")
    # the communicator: MAX_NDIM dims pass, one more is refused; a dtype its header cannot name is refused
    m.P2PCommunicator((1,) * m.MAX_NDIM, torch.bool, device)
    for shape, dtype in (((1,) * (m.MAX_NDIM + 1), F64), ((2,), torch.complex64)):
        said(lambda: m.P2PCommunicator(shape, dtype, device), "a message's header names")
    alone = dist.new_group([0], timeout=pg_timeout())
    if rank != 0:
        said(lambda: m.P2PCommunicator((1,), F64, device, alone), f"rank {rank} is not in")
    else:
        m.P2PCommunicator((1,), F64, device, alone)
    # run_schedule: a schedule it cannot run is refused before anything is sent
    comm, one = m.P2PCommunicator((ROWS, HIDDEN), F64, device), m.TanhBlock(HIDDEN, F64, device)
    xs = [torch.randn(ROWS, HIDDEN, dtype=F64, device=device)] * 2
    run = lambda stages, fn: m.run_schedule(stages, fn, comm, xs, xs, F.mse_loss)
    run(one, m.schedule_1f1b)                        # (then the ones it cannot run, all refused before a send)
    on_chunk_1 = lambda p, s, mb: [(o, k, 1) for o, k in m.schedule_1f1b(p, s, mb)]
    b_first = lambda p, s, mb: [("B", 0), ("F", 0), ("F", 1), ("B", 1)]
    swapped = lambda p, s, mb: [(o, k, 1 - c) for o, k, c in il(p, s, mb, 2)]
    for stages, fn in ((one, on_chunk_1), (one, b_first), ([one, one], m.schedule_1f1b), ([one, one], swapped)):
        said(lambda: run(stages, fn), "run_schedule runs" if isinstance(stages, nn.Module) or 2 % world == 0 else
             "interleaved 1F1B needs")
    w_first = lambda p, s, mb: [("W", 0)] + [o for o in m.schedule_zb_h1(p, s, mb) if o != ("W", 0)]
    no_w = lambda p, s, mb: [o for o in m.schedule_zb_h1(p, s, mb) if o != ("W", 1)]
    for fn in (w_first, no_w):
        said(lambda: run(one, fn), "a schedule with Ws runs one W after each B")
    # embedding_group: pipelines that overlap, or name a rank that does not exist
    for bad in ([[0], [0]], [[0, world]]):
        said(lambda: m.embedding_group(bad, timeout=pg_timeout()), "pipelines must be disjoint")
    # deallocate_output_tensor: an output shrinks to one element; a view (it keeps its base) and a leaf stay
    lin = nn.Linear(3, 3, dtype=F64, device=device)
    out = lin(torch.randn(2, 3, dtype=F64, device=device))
    view, kept = out[:, :2], out.detach().clone()
    m.deallocate_output_tensor(view)
    assert torch.equal(view, kept[:, :2]) and out.untyped_storage().nbytes() == 6 * 8, "a view was shrunk"
    leaf = torch.randn(3, dtype=F64, device=device, requires_grad=True)
    m.deallocate_output_tensor(leaf)
    m.deallocate_output_tensor(None)
    assert leaf.untyped_storage().nbytes() == 3 * 8
    m.deallocate_output_tensor(out)
    assert out.untyped_storage().nbytes() == 8 and out.shape == (2, 3), out.untyped_storage().nbytes()
    torch.autograd.backward(out, torch.ones(2, 3, dtype=F64, device=device))   # backward still runs
    log("refused at their boundary, nothing sent: a stage of p (p - 1 passes), -1, m = 0, p = 0; interleaved m = 3")
    log("over 2 stages, one chunk; 8 blocks over 3 stages; a cycle; 6 header dims (5 pass), complex64;")
    log("a rank outside the group; chunks the schedule does not run, another chunk order, a B before its F, a W")
    log("before its B, a B without W; overlapping pipelines; deallocate_output_tensor: not a view or a leaf")


def message_refusals(device, rank, world):
    """Stage 0 sends the case's tensor round the world's ring (every stage sends right, receives from the left):
    the last valid one passes; the first invalid one is refused on the sender and the receiver, in one line each,
    within seconds, and the others go on."""
    r = lambda *shape, dtype=F64: torch.randn(*shape).to(dtype).to(device)
    cases = [(False, (ROWS, HIDDEN), r(HIDDEN, ROWS).t(), [r(ROWS, HIDDEN, dtype=torch.float32), r(ROWS, HIDDEN + 1),
                                                          r(ROWS - 1, HIDDEN), r(ROWS, HIDDEN, 1),
                                                          r(ROWS, HIDDEN, dtype=torch.complex64), r(*[1] * 6)]),
             (True, (5, HIDDEN), r(5, HIDDEN), [r(6, HIDDEN), r(5, HIDDEN + 1), r(5, HIDDEN, dtype=torch.float32)]),
             (True, (5, HIDDEN), r(1, HIDDEN), [])]
    involved, tried = rank in (0, 1 % world), 0
    for variable, shape, good, bad in cases:
        comm = m.P2PCommunicator(shape, F64, device, variable_shapes=variable)
        for t in [good] + bad:
            mine = t if rank == 0 else torch.zeros(shape, dtype=F64, device=device)
            start, said = time.time(), None
            try:
                got = comm.communicate(send_next=mine, recv_prev=True)[0]
            except ValueError as e:
                said = str(e)
            took, tried = time.time() - start, tried + 1
            if t is good or not involved:
                assert said is None, (rank, said)
                assert rank != 1 % world or torch.equal(got, good), got
            else:
                assert "\n" not in said and took < 5, (said, took)
                told = ("message its sender refused" if not variable else   # fixed shapes: its flag says it
                        t.dtype if t.dtype in m.HEADER_DTYPES else "another dtype")   # variable: its header
                assert said.startswith(f"stage 0 cannot send a {t.dtype}" if rank == 0 else
                                       f"stage 1 got from stage 0 a {told}"), said
    if world > 1:                                    # stages built to move different messages: refused when built
        try:
            m.P2PCommunicator((ROWS, HIDDEN), torch.float32 if rank == world - 1 else F64, device)
            said = None
        except ValueError as e:
            said = str(e)
        assert said is not None and "\n" not in said and said.startswith("the stages move different"), said
    log(f"{tried} messages from stage 0: a transposed one, the largest and a short one of variable shapes pass;")
    log("another dtype, a dim one off, another rank, complex64, 6 dims: refused on the sender and the receiver")
    log("(its flag; variable shapes: its header), one line each, within seconds; stages built with different")
    log("dtypes: refused when built, on every stage")


def main():
    rank, world, device = setup()
    dist.barrier()  # NCCL: a group's first batch_isend_irecv must include all its ranks
    full = nn.Sequential(*(m.TanhBlock(HIDDEN, F64, device) for _ in range(2 * V * world)))  # alike: seeded
    head("P2P layer: batched and one by one, fixed and variable shapes, the adjoint, four at once")
    p2p_layer(rank, world, device)
    head("schedules: orders worked by hand, exhaustive properties, the runner's calls replayed for every p")
    schedules_checked(rank, world)
    head(f"{world} stages == one process, every schedule, batched and one by one: bytes kept, in flight and sent")
    equal_one_process(full, device, world)
    head("any m (1, m < p, m > p), micro-batches of different lengths")
    any_m(full, device, world)
    head("two stages, two groups: the one-by-one implementation's two-stage trick")
    two_stage_trick(full, device, world)
    head("pipelines on sub-groups (a tp x pp grid's): token ids in, a user's loss out")
    pipelines_on_subgroups(device, rank, world)
    head("ZB-H1's W: the ordinary backward's values, layout and hooks; 09's DDP on a stage; a tied embedding")
    split_backward(device)
    hooks_per_step(full, device, world)
    ddp_on_stages(device, rank, world)
    tied_embedding(device, rank, world)
    head("refusals at their boundaries")
    check_refusals(device, rank, world)
    message_refusals(device, rank, world)
    finish("P2P layer; schedules, calls for p <= 8; bytes to the byte; ZB-H1's grads; 09 on a stage; refusals")


if __name__ == "__main__":
    main()
