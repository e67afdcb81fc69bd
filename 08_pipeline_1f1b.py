"""08 - pipeline parallelism: Megatron's P2P layer; 1F1B, interleaved 1F1B and ZB-H1, checked against one process.

Each rank holds a run of consecutive layers (a stage); m micro-batches stream through the p stages, activations
going right and gradients coming back left (lesson 01). A schedule orders each stage's forwards (F) and backwards
(B). A stage keeps a micro-batch's activations from its F to its B: GPipe (every F, then every B) keeps m, 1F1B
(PipeDream-flush, Megatron's default) starts each B as early as it can and keeps at most min(p - s, m) on stage s.
  16 blocks, p = 4: stage 0 holds blocks 0-3 and the input micro-batches | 1: 4-7 | 2: 8-11 | 3: 12-15, targets;
  after the step stage 3 holds the loss, each stage its blocks' gradients summed over the micro-batches.
  1F1B, m = 4, one tick per op: warm-up p-s-1 Fs, steady F B pairs, cool-down Bs ('.' = idle, the bubble)
    stage 0 | F0 F1 F2 F3  .  .  . B0  . B1  . B2  . B3
    stage 1 |  . F0 F1 F2  .  . B0 F3 B1  . B2  . B3  .
    stage 2 |  .  . F0 F1  . B0 F2 B1 F3 B2  . B3  .  .
    stage 3 |  .  .  . F0 B0 F1 B1 F2 B2 F3 B3  .  .  .
Interleaved 1F1B (Megatron): stage s holds v chunks, chunk c being model chunk c*p + s, so a micro-batch crosses
the stages v times (the last stage's chunk c feeds the first stage's chunk c+1). Warm-up, 2(p-s-1) + (v-1)p chunk
forwards: the last stage reaches micro-batch 0's last chunk after (v-1)p forwards, and stage s waits 2(p-s-1) chunk
ticks more for that gradient (p-s-1 hops there, p-s-1 back), which it fills with forwards; it keeps up to that + 1
chunks' activations, each 1/v of a stage's. ZB-H1 (Qi et al., ICLR 2024) splits each B into B, the input gradient
the previous stage waits for, and W, the weight gradients nobody waits for: W k runs after B k+s, the Ws left fill
the cool-down. It keeps what 1F1B keeps from F to B (and each Linear's output), then until W each Linear's input
and output gradient (the paper's weight-gradient store): min(p, m) micro-batches from F to W.
Bubbles, one tick per op (interleaved: a chunk's op, 1/v of a tick), messages free:
  1F1B         2(m+p-1) ticks, 2(p-1) idle: (p-1)/(m+p-1) of the step; Narayanan et al. divide by the work: (p-1)/m
  interleaved  2mv + 2(p-1) chunk-ticks, 2(p-1) idle (2(p-1)/v ticks): the idle time is v times smaller, the share
               of the step (p-1)/(mv+p-1) less so: p=4, m=8, v=2 goes 27% -> 16% ((p-1)/m: 38% -> (p-1)/(vm): 19%)
  ZB-H1        F = B = W = 1 tick: max(3m+p-1, 2m+2p-1) ticks; for m >= p, p-1 idle: (p-1)/(3m+p-1)
The P2P layer (Megatron's p2p_communication.py): six calls on one communicate(send_next, send_prev, recv_prev,
recv_next); a send waits for its receive, so where both ends of a link would send first (1F1B's steady state) they
post send and receive in one call: send_forward_recv_backward meets send_backward_recv_forward.
  recv_forward: recv_prev   send_forward: send_next   recv_backward: recv_next   send_backward: send_prev
Bytes: a stage keeps each micro-batch's activations (a sent output shrinks to one element, Megatron's
deallocate_output_tensor) and one call's sends in flight. It sends per step, A = one micro-batch's activation:
m*A forward unless last, m*A backward unless first; interleaved (2v - [first] - [last]) m*A, in v times the
messages; with variable shapes, 8*ndim bytes more a message.

Run:  torchrun --nproc-per-node=4 08_pipeline_1f1b.py
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- building blocks: paste from here to the demo marker (they need only torch) ----------------------------
# the P2P layer --------------------------------------------------------------------------------------------
class P2PCommunicator:
    """Moves activations to the next stage and gradients to the previous one; stage = rank in `group`.

    shape, dtype, device: what a received tensor is (with variable_shapes, only len(shape) is fixed).
    batched: batch_isend_irecv if True, else isend/irecv one by one in even/odd order (an extra, below).
    variable_shapes: a round of shapes before the data; second_group: the two-stage trick (extras, below).
    Neighbours wrap around (the last stage's next is the first, as the interleaved schedule needs); the six
    named calls drop what has no neighbour at the pipeline's two ends. self.log lists every call, each a list
    of the ops it posted, in order: (send | recv, peer stage, bytes, 0 on group or 1 on second_group).
    """

    def __init__(self, shape, dtype, device, group=None, batched=True, variable_shapes=False, second_group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.stage, self.num_stages = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.stage < 0:
            raise ValueError(f"rank {dist.get_rank()} is not in the pipeline group")
        ranks = dist.get_process_group_ranks(self.group)           # isend/irecv take global ranks
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        self.prev, self.next = ranks[(self.stage - 1) % self.num_stages], ranks[(self.stage + 1) % self.num_stages]
        if second_group is not None and (self.num_stages != 2 or batched
                                         or not set(ranks) <= set(dist.get_process_group_ranks(second_group))):
            raise ValueError(f"second_group needs exactly 2 stages, batched=False and both pipeline ranks; got "
                             f"{self.num_stages} stages {ranks}, batched={batched}")
        self.second_group = second_group if second_group is not None else self.group
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.batched, self.variable_shapes, self.log = batched, variable_shapes, []
        self._in_flight, self._loop = [], ([], [])  # sends not waited for yet; a one-stage ring's messages

    def recv_forward(self):                          # -> the previous stage's activation (None on the first)
        return None if self.is_first else self.communicate(recv_prev=True)[0]

    def send_forward(self, output):                  # this stage's activation -> the next stage
        if not self.is_last:
            self.communicate(send_next=output)

    def recv_backward(self):                         # -> the gradient of this stage's output (None on the last)
        return None if self.is_last else self.communicate(recv_next=True)[1]

    def send_backward(self, input_grad):             # the gradient of this stage's input -> the previous stage
        if not self.is_first:
            self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output):    # 1F1B steady state, after an F
        return None if self.is_last else self.communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad):  # 1F1B steady state, after a B
        return None if self.is_first else self.communicate(send_prev=input_grad, recv_prev=True)[0]

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, wait_sends=True):
        """The one routine under the six calls: returns (tensor from prev or None, tensor from next or None).
        It waits for its receives. wait_sends=False leaves its sends in flight (the next F or B computes meanwhile)
        until the next call, which waits for them first: one call's messages in flight at most."""
        for t in (send_next, send_prev):
            if t is not None and (t.dtype != self.dtype or t.dim() != len(self.shape)
                                  or not (self.variable_shapes or t.shape == self.shape)):
                raise ValueError(f"cannot send a {t.dtype} tensor of shape {tuple(t.shape)}: this communicator "
                                 f"moves {self.dtype}, shape {self.shape} (variable_shapes={self.variable_shapes})")
        if self.num_stages == 1:                     # a ring of one: this stage receives what it sent
            for t, box in ((send_next, self._loop[0]), (send_prev, self._loop[1])):
                if t is not None:
                    box.append(t)
            return self._loop[0].pop(0) if recv_prev else None, self._loop[1].pop(0) if recv_next else None
        shape_prev = shape_next = self.shape         # variable shapes: a round of shapes first (an extra, below)
        if self.variable_shapes:
            shape_prev, shape_next = _exchange_shapes(self, send_next, send_prev, recv_prev, recv_next, wait_sends)
        from_prev, from_next = (torch.empty(shape, dtype=self.dtype, device=self.device) if want else None
                                for want, shape in ((recv_prev, shape_prev), (recv_next, shape_next)))
        self._p2p(send_next, send_prev, from_prev, from_next, wait_sends)
        return from_prev, from_next

    def wait_sends(self):
        """Wait for the sends the last communicate(wait_sends=False) left in flight, and let their tensors go."""
        for req, _ in self._in_flight:
            req.wait()
        self._in_flight = []

    def _p2p(self, send_next, send_prev, recv_prev, recv_next, wait_sends):
        """Post the given transfers (a tensor or None each) as one call; wait for its receives."""
        self.wait_sends()                                     # the previous call's sends, before this call posts
        ops, call = [], []
        for op, t, step, second in _posting_order(self, send_next, send_prev, recv_prev, recv_next):
            t = t.contiguous() if op is dist.isend else t         # NCCL takes contiguous tensors only
            ops.append(dist.P2POp(op, t, self.next if step > 0 else self.prev,
                                  self.second_group if second else self.group))
            call.append(("send" if op is dist.isend else "recv", (self.stage + step) % self.num_stages,
                         t.numel() * t.element_size(), int(second)))
        if not ops:
            return
        self.log.append(call)
        reqs = dist.batch_isend_irecv(ops) if self.batched else [o.op(o.tensor, o.peer, group=o.group) for o in ops]
        # gloo: one request per op, each waited for (waiting on one hung, pytorch#132644); NCCL may give one in all
        for req, o in zip(reqs, ops) if len(reqs) == len(ops) else ((r, None) for r in reqs):
            if o is not None and o.op is dist.isend and not wait_sends:
                self._in_flight.append((req, o.tensor))                # keep the tensor alive until it is sent
            else:
                req.wait()


def deallocate_output_tensor(out):
    """Megatron's: once `out` has been sent, backward needs only its grad_fn, not its values. Point it at one
    element, expanded to its shape, so that torch.autograd.backward(out, grad) still accepts it (Megatron keeps a
    [1] tensor and calls autograd's engine directly, its custom_backward). A view keeps its base: left alone."""
    if isinstance(out, torch.Tensor) and out.grad_fn is not None and out._base is None:
        out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)


# 1F1B as a reader first meets it: three phases, the six P2P calls ----------------------------------------------
def train_step_1f1b(model, comm, inputs, targets, loss_fn):
    """One 1F1B step of this stage, written out (picotron's form); run_schedule(model, schedule_1f1b, ...) posts
    the same calls. Arguments as run_schedule's; returns the loss on the last stage, else None."""
    p, s, m = comm.num_stages, comm.stage, len(inputs)
    warmup = min(p - s - 1, m)                       # forwards before the first backward: fill the stages after
    held, loss = [], []                              # held: (input, output) of each micro-batch from F until B
    done = [0, 0]                                    # Fs and Bs run: the profiler labels

    def forward(x):                                  # F of the next micro-batch; returns what goes to the next stage
        k = done[0]
        with torch.profiler.record_function(f"F mb{k} c0"):
            x = inputs[k] if comm.is_first else x.requires_grad_()
            y = model(x)
            if comm.is_last:                         # the last stage turns its output into the loss
                y = loss_fn(y, targets[k]) / m
                loss.append(y.detach())
        held.append((x, y))
        done[0] += 1
        return y.detach()

    def sent():                                      # the output just sent: backward needs only its grad_fn
        if not comm.is_last:
            deallocate_output_tensor(held[-1][1])

    def backward(dy):                                # B of the oldest micro-batch held; returns its input's grad
        x, y = held.pop(0)
        with torch.profiler.record_function(f"B mb{done[1]} c0"):
            torch.autograd.backward(y, dy)           # dy is None on the last stage, where y is the loss
        done[1] += 1
        return x.grad

    for _ in range(warmup):                          # warm-up: forwards only
        comm.send_forward(forward(comm.recv_forward()))
        sent()
    x = comm.recv_forward() if warmup < m else None
    for i in range(m - warmup):                      # steady 1F1B: F, then the oldest B; each send meets a recv
        dy = comm.send_forward_recv_backward(forward(x))
        sent()
        if i < m - warmup - 1:
            x = comm.send_backward_recv_forward(backward(dy))
        else:                                        # the last steady B: no forward follows
            comm.send_backward(backward(dy))
    for _ in range(warmup):                          # cool-down: the backwards of the micro-batches still held
        comm.send_backward(backward(comm.recv_backward()))
    return sum(loss) if loss else None


# ---- the extras: shape exchange, the ordered implementation and its second group, the general runner -------
def _exchange_shapes(comm, send_next, send_prev, recv_prev, recv_next, wait_sends):
    """Variable sequence lengths: a round of int64 shapes before the data, so that each receiver can allocate
    (Megatron's _communicate_shapes; 8*ndim bytes a message). Returns (shape from prev, shape from next)."""
    dims = lambda t: None if t is None else torch.tensor(t.shape, dtype=torch.int64, device=comm.device)
    sp, sn = (torch.empty(len(comm.shape), dtype=torch.int64, device=comm.device) if want else None
              for want in (recv_prev, recv_next))
    comm._p2p(dims(send_next), dims(send_prev), sp, sn, wait_sends)
    return tuple(None if t is None else tuple(t.tolist()) for t in (sp, sn))


def _posting_order(comm, send_next, send_prev, recv_prev, recv_next):
    """The transfers given (a tensor or None each) as [(isend | irecv, tensor, +1 next | -1 prev, on second
    group)], in Megatron's even/odd order: even stages send_next, recv_prev, send_prev, recv_next; odd stages swap
    each pair. Posted one by one (batched=False), each link then has one end sending while the other receives
    (batch_isend_irecv does not need it: one grouped launch). With second_group (the two-stage trick), odd->even
    transfers go on it: NCCL runs two ranks' P2P on one group in order, so an activation going right and a
    gradient coming left would queue behind each other."""
    even = comm.stage % 2 == 0
    order = [(dist.isend, send_next, 1), (dist.irecv, recv_prev, -1), (dist.isend, send_prev, -1),
             (dist.irecv, recv_next, 1)]
    return [(op, t, step, comm.second_group is not comm.group and (op is dist.isend) != even)
            for op, t, step in (order if even else [order[i] for i in (1, 0, 3, 2)]) if t is not None]


# schedules: pure functions, [(op, micro-batch[, chunk])] for one stage --------------------------------------
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


def schedule_interleaved_1f1b(num_stages, stage, num_microbatches, num_chunks):
    """This stage's ops, [("F" | "B", micro-batch, chunk)], in Megatron's interleaved 1F1B order.

    Chunk c of stage s runs model chunk c*p + s. Forwards take p micro-batches through chunk 0, the same p
    through chunk 1, ..., then the next p; backwards go the same way from the last chunk. Warm-up:
    2(p - s - 1) + (v - 1)p forwards (the last stage meets micro-batch 0's last chunk after (v - 1)p of them;
    stage s waits 2(p - s - 1) chunk ops more for its gradient to come back), then F, B pairs, then the Bs left."""
    _check_schedule(num_stages, stage, num_microbatches)
    p, m, v = num_stages, num_microbatches, num_chunks
    if v < 1 or m % p:
        raise ValueError(f"interleaved 1F1B needs num_microbatches a multiple of num_stages and num_chunks >= 1; "
                         f"got num_microbatches={m}, num_stages={p}, num_chunks={v}")
    fwd = [("F", k // (p * v) * p + k % p, k // p % v) for k in range(m * v)]  # the k-th forward of this stage
    bwd = [("B", mb, v - 1 - c) for _, mb, c in fwd]                          # backwards: from the last chunk
    warmup = min(2 * (p - stage - 1) + (v - 1) * p, m * v)
    ops = fwd[:warmup]                                                         # warm-up
    for i in range(m * v - warmup):                                            # steady: F, B pairs
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[m * v - warmup:]                                          # cool-down


def schedule_zb_h1(num_stages, stage, num_microbatches):
    """This stage's ops, [("F" | "B" | "W", micro-batch)], in ZB-H1 order (Qi et al., ICLR 2024): 1F1B's Fs
    and Bs, where B is only the input gradient and W, the weight gradients, of micro-batch k runs after
    B k + stage; the Ws left fill the cool-down. From F until B: min(p - stage, m); from F until W: min(p, m)."""
    ops = []
    for op, k in schedule_1f1b(num_stages, stage, num_microbatches):
        ops.append((op, k))
        if op == "B" and k >= stage:
            ops.append(("W", k - stage))
    return ops + [("W", k) for k in range(max(num_microbatches - stage, 0), num_microbatches)]


# the split backward: B (the input gradient, which the previous stage waits for), then W (the weight gradients) --
def forward_keeping(model, x):
    """F for a schedule with W: model(x), noting each parametrised module's input and output (B needs the output,
    W the input). W then covers each parameter's use inside its own module's forward (a weight used elsewhere
    too, e.g. an embedding tied to an LM head through F.linear, needs the ordinary backward: a schedule without W)."""
    kept = []
    hooks = [mod.register_forward_hook(lambda mod, args, out: kept.append((mod, args, out)))
             for mod in model.modules() if next(mod.parameters(recurse=False), None) is not None]
    try:
        y = model(x)
    finally:
        for h in hooks:
            h.remove()
    return y, kept


def backward_input(x, y, grad_y, kept):
    """B: the gradient of the stage input x (None if x needs none) and of each kept module's output z, no weight
    gradient; the graph is freed. Returns (x's gradient, [(module, its inputs, dL/dz)]): the zero-bubble paper's
    weight-gradient store, all W needs (a Linear: X and dZ). grad_y is None where y is the loss."""
    wrt = ([x] if x.requires_grad else []) + [z for _, _, z in kept]
    grads = list(torch.autograd.grad(y, wrt, grad_y, allow_unused=True)) if wrt else []
    x_grad = grads.pop(0) if x.requires_grad else None
    return x_grad, [(mod, args, g) for (mod, args, _), g in zip(kept, grads) if g is not None]


def backward_weight(store):
    """W: each module's weight gradients from its input and output gradient, accumulated into .grad; a Linear
    by dW = dZ^T X, db = sum dZ (as autograd computes them), any other module by running it again on its input."""
    for mod, args, dz in store:
        params = [q for q in mod.parameters(recurse=False) if q.requires_grad]
        if type(mod) is nn.Linear:
            with torch.no_grad():                    # as autograd's own accumulation: no graph for the grads
                x2, dz2 = args[0].reshape(-1, mod.in_features), dz.reshape(-1, mod.out_features)
                grads = [(x2.t() @ dz2).t()] + ([dz2.sum(0)] if mod.bias is not None else [])
                for q, g in zip([mod.weight] + ([mod.bias] if mod.bias is not None else []), grads):
                    if q.requires_grad:
                        q.grad = g if q.grad is None else q.grad.add_(g)
        elif params:
            with torch.enable_grad():
                z = mod(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
            torch.autograd.backward(z, dz, inputs=params)


# the general runner: any schedule above, one model chunk or v ------------------------------------------------
def _link(p, v, stage, op, mb, c, out):
    """The other end of an op's output (out=True) or input: (stage, its op), or None (the model's ends, or a W).
    Chunk c of stage s runs model chunk u = c*p + s. An F takes its input from chunk u-1 and gives its output to
    u+1; a B the other way round. Chunk u runs on stage u % p as its chunk u // p: so the last stage's chunk c
    hands on to the first stage's chunk c+1, round the ring."""
    u = c * p + stage + (1 if (op == "F") == out else -1)
    return None if op == "W" or not 0 <= u < p * v else (u % p, (op, mb, u // p))


def op_ticks(orders, num_chunks=1, ticks=None):
    """Every stage's ops on one clock, where an op takes ticks[op] (default 1) and a message none: an op ends
    after the later of its stage's previous op and its input (its _link), both done. orders: each stage's
    [(op, micro-batch, chunk)]. Returns {(stage, op): end tick}."""
    p, ticks = len(orders), ticks or {"F": 1, "B": 1, "W": 1}
    end, at, free = {}, [0] * p, [0] * p
    while any(at[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while at[s] < len(orders[s]):
                op, mb, c = orders[s][at[s]]
                dep = _link(p, num_chunks, s, op, mb, c, out=False)   # (a W's B, a last chunk's F: this stage's)
                if dep is not None and dep not in end:
                    break                                # its input is not made yet
                free[s] = end[(s, (op, mb, c))] = max(free[s], end[dep] if dep else 0) + ticks[op]
                at[s], moved = at[s] + 1, True
        if not moved:
            raise ValueError("the schedules wait on each other in a cycle")
    return end


def _events(orders, num_chunks, stage, end):
    """This stage's ops and messages in one order that every stage agrees on, op_ticks's clock: a message goes
    at the tick its consumer starts (on a tie, the one to the later stage first), before the ops that start then.
    So the receiver takes it just before its op, and the sender sends it when the receiver is ready for it.
    Items: ("op", op), ("send" | "recv", peer stage, the producer (stage, op), the consumer (stage, op))."""
    p, out = len(orders), []
    for op in orders[stage]:
        out.append(((end[(stage, op)] - 1, 1, 0), ("op", op)))
        to = _link(p, num_chunks, stage, *op, out=True)
        if to:
            out.append(((end[to] - 1, 0, -to[0]), ("send", to[0], (stage, op), to)))
        src = _link(p, num_chunks, stage, *op, out=False)
        if src:
            out.append(((end[(stage, op)] - 1, 0, -stage), ("recv", src[0], src, (stage, op))))
    return [e for _, e in sorted(out, key=lambda ke: ke[0])]


def plan_calls(orders, num_chunks, stage):
    """This stage's step as run_schedule runs it: [("op", op) or ("call", [one or two messages])].

    One order for all: a send waits for its receive (NCCL; gloo too) and NCCL runs two ranks' calls in the order
    posted. When every stage posts its messages in the order of one clock (_events), the earliest message not yet
    through has both its ends waiting on it, so no cycle of waits can form. (Sending each output when made and
    receiving each input just before its op, as this runner once did, stops part-way at p = 2, m = 4 and p = 4,
    m = 4 or 8 when the interleaved calls are replayed as NCCL runs them: a stage waits in a call for a message
    its peer posts only after a call that waits on this stage. gloo ran them: their sends stayed in flight.)
    Meeting in one call: a send and a receive that are next to each other in this stage's order, with one peer,
    and next to each other in the peer's order too, go in one communicate(). In 1F1B's steady state stage s, after
    F k, sends activation k to s+1 and needs gradient j from it, while s+1, after B j, sends gradient j and needs
    activation k: at both ends nothing comes between the two messages, so they go in one call each,
    send_forward_recv_backward on s and send_backward_recv_forward on s+1, as train_step_1f1b posts them. Each
    end posts them as one group (batched) or in the even/odd order (_posting_order), which pairs them either way.
    Any other message goes in a call of its own: one peer stage per call."""
    end = op_ticks(orders, num_chunks)
    evs = [_events(orders, num_chunks, st, end) for st in range(len(orders))]
    where = [{(e[0], e[2]): i for i, e in enumerate(ev) if e[0] != "op"} for ev in evs]
    flip = {"send": "recv", "recv": "send"}

    def next_at_both(a, b):                          # two messages with one peer, adjacent on both its ends
        if a[0] == "op" or b[0] == "op" or a[1] != b[1] or a[0] == b[0] or a[1] == stage:
            return False
        peer = where[a[1]]
        return peer[(flip[b[0]], b[2])] == peer[(flip[a[0]], a[2])] + 1

    steps, ev, i = [], evs[stage], 0
    while i < len(ev):
        if ev[i][0] == "op":
            steps.append(ev[i])
        elif i + 1 < len(ev) and next_at_both(ev[i], ev[i + 1]):
            steps.append(("call", [ev[i], ev[i + 1]]))
            i += 1
        else:
            steps.append(("call", [ev[i]]))
        i += 1
    return steps


def run_schedule(stages, schedule_fn, comm, inputs, targets, loss_fn):
    """One training step of this pipeline stage: the ops schedule_fn orders; gradients accumulate in .grad.

        loss, trace, messages = run_schedule(stages, schedule_fn, comm, inputs, targets, loss_fn)

    stages       this stage's nn.Module, or a list of v (chunk c runs model chunk c*p + s: interleaved)
    schedule_fn  (num_stages, stage, num_microbatches) -> [(op, micro-batch[, chunk])], op "F", "B" or "W";
                 with a W in it, B is backward_input and W backward_weight
    comm         a P2PCommunicator on the pipeline group (any ranks: stage = group rank, p = group size)
    inputs       m micro-batches, read by the first stage only (any tensors: token ids are never sent)
    targets      m targets, read by the last stage only
    loss_fn      loss_fn(the last chunk's output, target) -> a scalar; the step backpropagates their mean
    returns      the mean loss on the last stage, else None; the ops as run, [(op, micro-batch, chunk)]; for
                 each call posted (comm.log's), its messages: [(send | recv, peer stage, the producer's op)]
    Messages go in plan_calls's order; each call first waits for the sends of the call before it. From F to B a
    stage keeps the F's input and what its graph saved (a sent output shrinks to one element); from B to W (a
    schedule with W) only each module's input and output gradient. Each op runs inside
    torch.profiler.record_function("F mb3 c0") (its kind, micro-batch and chunk), which a trace shows.
    """
    p, s, m = comm.num_stages, comm.stage, len(inputs)
    chunks = [stages] if isinstance(stages, nn.Module) else list(stages)
    v = len(chunks)
    orders = [[(o[0], o[1], o[2] if len(o) > 2 else 0) for o in schedule_fn(p, st, m)] for st in range(p)]
    if {c for _, _, c in orders[s]} != set(range(v)):
        raise ValueError(f"the schedule runs chunks {sorted({c for _, _, c in orders[s]})}; this stage has {v} "
                         f"chunk(s)")
    split = any(op == "W" for op, _, _ in orders[s])
    held, store, received, results, trace, messages, loss = {}, {}, {}, {}, [], [], []

    def post(msgs):                                  # one communicate(): send what is due, receive what is due
        sends, recvs = {}, {}
        for kind, peer, (src, made), (dst, due) in msgs:
            if kind == "send":                       # the side: toward the higher model chunk is "next"
                sends["send_next" if due[2] * p + dst > made[2] * p + s else "send_prev"] = made
            else:
                recvs["prev" if due[2] * p + s > made[2] * p + src else "next"] = due
        got = comm.communicate(**{side: results[made][0] for side, made in sends.items()},
                               **{f"recv_{side}": True for side in recvs}, wait_sends=False)
        for side, due in recvs.items():
            received[due] = got[0 if side == "prev" else 1]
        for made in sends.values():                  # sent: its tensor is the communicator's until the next call
            deallocate_output_tensor(results.pop(made)[1])   # and backward needs only the output's grad_fn
        messages.append([(kind, peer, made) for kind, peer, (_, made), _ in msgs])

    def run(op, mb, c):                              # one F, B or W of this stage
        with torch.profiler.record_function(f"{op} mb{mb} c{c}"):
            if op == "F":
                x = received.pop((op, mb, c)).requires_grad_() if (op, mb, c) in received else inputs[mb]
                y, keep = forward_keeping(chunks[c], x) if split else (chunks[c](x), None)
                if c * p + s == p * v - 1:           # the last model chunk: the loss
                    y = loss_fn(y, targets[mb]) / m
                    loss.append(y.detach())
                held[(mb, c)] = (x, y, keep)
                out = (y.detach(), y)
            elif op == "B":
                x, y, keep = held.pop((mb, c))
                dy = received.pop((op, mb, c), None)  # None where y is the loss
                if split:
                    dx, store[(mb, c)] = backward_input(x, y, dy, keep)
                else:
                    torch.autograd.backward(y, dy)
                    dx = x.grad
                out = (dx, None)
            else:
                backward_weight(store.pop((mb, c)))
                out = None
        if _link(p, v, s, op, mb, c, out=True):     # a result some stage waits for: sent by a later call
            results[(op, mb, c)] = out
        trace.append((op, mb, c))

    for step in plan_calls(orders, v, s):
        post(step[1]) if step[0] == "call" else run(*step[1])
    comm.wait_sends()
    return sum(loss) if loss else None, trace, messages


# the model the demo splits ------------------------------------------------------------------------------------
class Block(nn.Module):
    """x + tanh(x W^T + b): the unit the pipeline splits."""

    def __init__(self, hidden, dtype=None, device=None):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden, dtype=dtype, device=device)

    def forward(self, x):                            # (rows, hidden) -> (rows, hidden)
        return x + torch.tanh(self.fc(x))


def stage_layers(blocks: nn.Sequential, num_stages, stage, num_chunks=1):
    """The consecutive blocks this stage runs (the same Parameter objects); with num_chunks = v > 1, a list of
    v chunks, chunk c being model chunk c*p + stage (the interleaved layout)."""
    parts = num_stages * num_chunks
    if len(blocks) % parts:
        raise ValueError(f"{len(blocks)} blocks do not split evenly over {num_stages} stages x {num_chunks} chunks")
    k = len(blocks) // parts
    chunks = [blocks[(c * num_stages + stage) * k:(c * num_stages + stage + 1) * k] for c in range(num_chunks)]
    return chunks[0] if num_chunks == 1 else chunks


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
import contextlib

try:
    from common import (finish, head, held_bytes, log, memory, pg_timeout, refused, replays, setup, strided_groups,
                        traffic)
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

HIDDEN, ROWS, M, V = 8, 4, 8, 2  # the model: 2 blocks per chunk, p stages x V chunks
NAME = {schedule_1f1b: "1F1B", schedule_gpipe: "GPipe", schedule_interleaved_1f1b: "interleaved",
        schedule_zb_h1: "ZB-H1", train_step_1f1b: "1F1B loop"}


def label(op, mb, c):
    """F3 for chunk 0, f3 for chunk 1 (the timelines' two chunks)."""
    return (op if c == 0 else op.lower()) + str(mb)


def schedule(fn, v):
    """fn as run_schedule takes it: the interleaved one with v chunks, the hand loop as 1F1B (its order)."""
    if fn is schedule_interleaved_1f1b:
        return lambda p, s, m: schedule_interleaved_1f1b(p, s, m, v)
    return schedule_1f1b if fn is train_step_1f1b else fn


def expected_peak(fn, p, s, m, v):
    """Micro-batches (x chunks) held from F until B and from F until W, as the docstring states."""
    if fn is schedule_gpipe:
        return {"B": m, "W": m}
    if fn is schedule_interleaved_1f1b:
        held = min(2 * (p - s - 1) + (v - 1) * p + 1, m * v)
        return {"B": held, "W": held}
    return {"B": min(p - s, m), "W": min(p, m) if fn is schedule_zb_h1 else min(p - s, m)}


# ---- checking code: a reader may skip from here to p2p_layer (it replays and measures what the blocks did) ----
def place_on_ticks(traces, num_chunks=1, ticks=None):
    """Each stage's ops as op_ticks places them: ({start tick: op} per stage, total ticks)."""
    end = op_ticks(traces, num_chunks, ticks)
    rows = [{end[(s, o)] - (ticks or {}).get(o[0], 1): o for o in trace} for s, trace in enumerate(traces)]
    return rows, max(end.values())


def one_by_one(logs):
    """Each stage's posted ops (comm.log) as common.replays takes them, isend/irecv one by one, each blocking;
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


def kept_per_microbatch(p, s, v, blocks, a, split):
    """Bytes one micro-batch keeps on chunk c of stage s, from the model: each Block keeps its Linear's input and
    its tanh's output (2a); the chunk's input is the micro-batch itself on the first stage (allocated before the
    step: not counted); the loss keeps its input (a); a sent output shrinks to one element (8). With W
    (split), B needs each Linear's output too (+a each) and from B to W each Linear keeps its input and output
    gradient (2a each). Returns [(F..B, B..W) for each chunk]."""
    out = []
    for c in range(v):
        first, last = s == 0 and c == 0, c * p + s == p * v - 1
        out.append(((2 * blocks - first + last + blocks * split) * a + 8, (2 * blocks - first) * a * split))
    return out                                       # (+8: a sent output's one element, or the loss)


def working_set(chunk, x, target, last, split, m):
    """{op: the most bytes it holds above what it keeps after (F) or holds before (B, W)}: each op's temporaries
    (the gradients on their way through a backward), measured in one process on one micro-batch of this chunk."""
    x = x.detach().clone().requires_grad_(x.dtype.is_floating_point)   # as a received input (or token ids)
    with memory() as mem:
        y, keep = forward_keeping(chunk, x) if split else (chunk(x), None)
        y = F.mse_loss(y, target) / m if last else y
        temps = {"F": mem.peak - mem.live()}
        dy = None if last else torch.ones_like(y)   # the gradient B receives
        mem.reset()
        before = mem.live()
        if split:
            _, store = backward_input(x, y, dy, keep)
            del keep, y, dy
            temps["B"] = mem.peak - before
            mem.reset()
            before = mem.live()
            backward_weight(store)
            temps["W"] = mem.peak - before
        else:
            torch.autograd.backward(y, dy)
            temps["B"] = mem.peak - before
        return temps


def most_kept(steps, kept, a, temps):
    """The most bytes a stage holds at once, walking its steps (plan_calls): what each micro-batch keeps from F
    to B (kept[c][0]) and from B to W (kept[c][1]), plus its messages (a each): an output from its op until the
    call that sends it, then in flight until the next call; an input from the call that receives it until its
    op (an F's input is then part of what the F keeps; a B's is let go); plus, during each op, its temporaries
    (temps[c][op], working_set's: above what an F keeps after it, above what a B or W finds before it)."""
    msgs = [m for kind, what in steps if kind == "call" for m in what]
    sent, got = {m[2][1] for m in msgs if m[0] == "send"}, {m[3][1] for m in msgs if m[0] == "recv"}
    now, most, flight = 0, 0, 0
    for kind, what in steps:
        if kind == "call":                           # the last call's sends are let go; receives arrive
            now += sum(m[0] == "recv" for m in what) * a - flight
            flight = sum(m[0] == "send" for m in what) * a
        else:
            op, _, c = what
            before = now
            now += {"F": kept[c][0], "B": kept[c][1] - kept[c][0], "W": -kept[c][1]}[op] + a * (what in sent) \
                - a * (what in got)
            most = max(most, (now if op == "F" else before) + temps[c][op])
        most = max(most, now)
    return most


class Metered(P2PCommunicator):
    """A P2PCommunicator that notes, as each call starts, the bytes the previous call's sends still hold."""

    in_flight = 0

    def _p2p(self, *args):
        self.in_flight = max(self.in_flight, held_bytes(t for _, t in self._in_flight))
        super()._p2p(*args)


def check_pipeline(full, device, runs, variable=False, group=None, second_group=None):
    """For each (fn, batched, rows) in runs: micro-batches for `full` (micro-batch k has rows[k] rows), alike on
    every rank; the loss and grads of the whole model in one process on the whole batch; one step through the
    pipeline on `group`'s ranks (fn: a schedule for run_schedule, or the hand loop train_step_1f1b), each stage
    checked against them: loss, grads, bytes kept and in flight, bytes sent, one peer per call. Every rank calls
    it; returns, per run, every stage's results, once each run's calls replay as NCCL would run them, and every
    message reaches the receive that expects it."""
    pg = group if group is not None else dist.group.WORLD
    mine, refs = [None] * len(runs), {}              # mine stays None where this rank is not in the pipeline
    for i, (fn, batched, rows) in enumerate(runs if dist.get_rank(pg) >= 0 else []):
        if tuple(rows) not in refs:
            gen = torch.Generator(device).manual_seed(len(rows))
            xs = [torch.randn(n, HIDDEN, dtype=torch.float64, device=device, generator=gen) for n in rows]
            ts = [torch.randn(n, HIDDEN, dtype=torch.float64, device=device, generator=gen) for n in rows]
            # reference: the whole batch at once; row weights make it the mean over micro-batches of each one's MSE
            weight = torch.cat([torch.full((n, 1), 1 / (len(rows) * n * HIDDEN), dtype=torch.float64,
                                           device=device) for n in rows])
            full.zero_grad(set_to_none=True)
            ref_loss = ((full(torch.cat(xs)) - torch.cat(ts)) ** 2 * weight).sum()
            ref_loss.backward()
            refs[tuple(rows)] = xs, ts, ref_loss.detach(), {id(q): q.grad.clone() for q in full.parameters()}
        xs, ts, ref_loss, ref = refs[tuple(rows)]
        full.zero_grad(set_to_none=True)
        comm = Metered((rows[0], HIDDEN), torch.float64, device, group, batched, variable, second_group)
        p, s, m = comm.num_stages, comm.stage, len(rows)
        v = V if fn is schedule_interleaved_1f1b else 1
        stage = stage_layers(full, p, s, v)
        own = list(nn.ModuleList([stage] if v == 1 else stage).parameters())
        measure = batched and len(set(rows)) == 1   # bytes kept: a closed form for micro-batches of one size
        for q in own:                                # gradients exist before the step: memory() sees activations
            q.grad = torch.zeros_like(q)
        if measure:                                  # one op's temporaries, on one micro-batch in one process
            temps = [working_set(chunk, xs[0], ts[0], c * p + s == p * v - 1, fn is schedule_zb_h1, m)
                     for c, chunk in enumerate([stage] if v == 1 else stage)]
            for q in own:
                q.grad.zero_()
        with traffic() as t, (memory() if measure else contextlib.nullcontext()) as mem:
            if fn is train_step_1f1b:
                loss, trace, messages = train_step_1f1b(stage, comm, xs, ts, F.mse_loss), None, None
            else:
                loss, trace, messages = run_schedule(stage, schedule(fn, v), comm, xs, ts, F.mse_loss)
            left = mem.live() if measure else 0
        if comm.is_last:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        for q in full.parameters():                  # this stage's grads are the reference's; no other grad
            assert q.grad is None if all(q is not o for o in own) else torch.allclose(q.grad, ref[id(q)], rtol=1e-9,
                                                                                       atol=0)
        # bytes: what the schedule's micro-batches keep, [K, K + one micro-batch more); nothing left after the step
        a = max(rows) * HIDDEN * 8                   # one activation (or message) of the largest micro-batch
        kept = kept_per_microbatch(p, s, v, len(full) // (p * v), a, fn is schedule_zb_h1)
        orders = [[(o[0], o[1], o[2] if len(o) > 2 else 0) for o in schedule(fn, v)(p, st, m)] for st in range(p)]
        most = most_kept(plan_calls(orders, v, s), kept, a, temps) if measure else None
        bare = most_kept(plan_calls(orders, v, s), kept, a, [dict.fromkeys(t, 0) for t in temps]) if measure else None
        # peak = what the micro-batches and messages keep + the temporaries of the op running then (+ the losses'
        # scalars, 8 bytes each): one activation or message more at the peak fails it, ZB-H1's too
        worst = max(t for ops in temps for t in ops.values()) if measure else None   # one op's temporaries
        if measure and fn is train_step_1f1b:        # the hand loop frees on its own clock: kept + the largest op's
            assert bare <= mem.peak < bare + worst + a // 2, (NAME[fn], s, mem.peak / a, bare / a, worst / a)
        elif measure:  # (8 bytes below: interleaved stage 0 measures one 8-byte element less than the walk counts)
            assert most - 8 <= mem.peak < most + a // 2, (NAME[fn], s, mem.peak / a, most / a)
        if measure and v == 1 and fn is not schedule_zb_h1 and worst + 2 * a < kept[0][0]:  # where one op's
            # temporaries and two messages weigh less than a micro-batch, the count: 1F1B min(p - s, m), GPipe m
            assert mem.peak // kept[0][0] == expected_peak(fn, p, s, m, v)["B"], (NAME[fn], s, mem.peak / kept[0][0])
        assert not measure or left == held_bytes([loss] if loss is not None else []), (NAME[fn], s, left)
        assert comm.in_flight <= a * (p > 1), (NAME[fn], s, comm.in_flight)   # one message in flight at most
        per_side = sum(n * HIDDEN * 8 + (16 if variable else 0) for n in rows)  # data (+ a 2-dim int64 shape)
        sends = (2 * v - (s == 0) - (s == p - 1)) * m if p > 1 else 0            # messages this stage sends
        assert t.counts["send"] == sends * (1 + variable) and t.bytes["send"] == sends // m * per_side, (s, t.bytes)
        assert {ranks for _, ranks, _ in t.calls} <= {tuple(dist.get_process_group_ranks(pg))}, t.calls
        assert sum(b for call in comm.log for kind, _, b, _ in call if kind == "send") == t.bytes["send"]
        assert all(len({peer for _, peer, _, _ in call}) == 1 for call in comm.log), comm.log  # one peer a call
        mine[i] = {"loss": None if loss is None else loss.item(), "trace": trace, "log": comm.log,
                   "sent": t.bytes["send"], "messages": messages, "peak": mem.peak if measure else None,
                   "most": bare, "a": a}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    results = [[r[i] for r in everyone if r[i] is not None] for i in range(len(runs))]
    for (fn, batched, _), stages in zip(runs, results):
        logs = [r["log"] for r in stages]            # NCCL: isend/irecv one by one, or each call one group
        assert replays(one_by_one(logs)) and replays_batched(logs), NAME[fn]
        if stages[0]["messages"] is not None:        # the i-th send from a to b is the one b's i-th receive expects
            for a, b in {(a, peer) for a, r in enumerate(stages) for call in r["messages"] for _, peer, _ in call}:
                of = lambda st, kind, peer: [made for call in stages[st]["messages"] for k, q, made in call
                                             if (k, q) == (kind, peer)]
                sent, due = of(a, "send", b), of(b, "recv", a)
                assert sent == due, (NAME[fn], a, b, sent, due)
    return results


def p2p_layer(rank, world, device):
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
    if world % 2 == 0:                               # all four at once, on a ring: even/odd order pairs every link
        comm = P2PCommunicator((2, 3), torch.float64, device, batched=False)
        from_prev, from_next = comm.communicate(send_next=x, send_prev=y, recv_prev=True, recv_next=True)
        assert torch.equal(from_prev, sent_by((rank - 1) % world, 0, 2)), from_prev
        assert torch.equal(from_next, sent_by((rank + 1) % world, 1, 2)), from_next
        logs = [None] * world
        dist.all_gather_object(logs, comm.log)
        assert replays(one_by_one(logs)), "posted one by one, the four transfers wait on each other"
    log(f"batched and ordered, fixed and exchanged shapes: each stage got its neighbours' tensors")
    log(f"sum <S x, y> = sum <x, S^T y> = {dots[0].item():.0f} (S = send_forward, S^T = send_backward)"
        + ("; all four at once round the ring: every link pairs up" if world % 2 == 0 else ""))


def schedules_checked(rank, world):
    show = lambda ops: " ".join(label(*op) if len(op) == 3 else f"{op[0]}{op[1]}" for op in ops)
    by_hand = [(schedule_1f1b(2, 0, 4), "F0 F1 B0 F2 B1 F3 B2 B3"),      # warm-up 1, 3 steady pairs, cool-down 1
               (schedule_1f1b(2, 1, 4), "F0 B0 F1 B1 F2 B2 F3 B3"),      # the last stage: each B right after its F
               (schedule_1f1b(3, 0, 4), "F0 F1 F2 B0 F3 B1 B2 B3"),      # warm-up 2
               (schedule_1f1b(4, 1, 2), "F0 F1 B0 B1"),                  # m < p: warm-up min(2, 2) is every F
               (schedule_gpipe(3, 1, 2), "F0 F1 B0 B1"),
               (schedule_interleaved_1f1b(2, 0, 4, 2), "F0 F1 f0 f1 F2 b0 F3 b1 f2 B0 f3 B1 b2 b3 B2 B3"),
               (schedule_interleaved_1f1b(2, 1, 4, 2), "F0 F1 f0 b0 f1 b1 F2 B0 F3 B1 f2 b2 f3 b3 B2 B3"),
               (schedule_zb_h1(2, 0, 4), "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3"),
               (schedule_zb_h1(2, 1, 4), "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3")]
    for ops, want in by_hand:
        assert show(ops) == want, (show(ops), want)
    refused(lambda: schedule_interleaved_1f1b(4, 0, 6, 2))           # m = 6 micro-batches over 4 stages
    configs = [(fn, v, p, m) for fn, v in ((schedule_1f1b, 1), (schedule_gpipe, 1), (schedule_zb_h1, 1),
                                           (schedule_interleaved_1f1b, 2), (schedule_interleaved_1f1b, 3))
               for p in range(1, 9) for m in range(1, 13) if v == 1 or m % p == 0]
    for fn, v, p, m in configs[rank::world]:         # each rank checks its share
        traces = [[(o[0], o[1], o[2] if len(o) > 2 else 0) for o in schedule(fn, v)(p, s, m)] for s in range(p)]
        for s, ops in enumerate(traces):
            for c in range(v):                       # each chunk: Fs, Bs (and Ws) in micro-batch order
                for op in "FBW" if fn is schedule_zb_h1 else "FB":
                    assert [k for o, k, cc in ops if o == op and cc == c] == list(range(m)), (fn, p, s, m, op)
            pos = {o: i for i, o in enumerate(ops)}
            assert all(pos[("F", k, c)] < pos[("B", k, c)] < pos.get(("W", k, c), len(ops))
                       for k in range(m) for c in range(v)), (fn, p, s, m)   # B after its F, W after its B
            until_w, live, peak = "W" if fn is schedule_zb_h1 else "B", [0, 0], [0, 0]  # held F..B, F..W
            for o, _, _ in ops:
                live = [live[0] + (o == "F") - (o == "B"), live[1] + (o == "F") - (o == until_w)]
                peak = [max(a, b) for a, b in zip(peak, live)]
            assert {"B": peak[0], "W": peak[1]} == expected_peak(fn, p, s, m, v), (fn, p, s, m, peak)
        total = {schedule_1f1b: 2 * (m + p - 1), schedule_gpipe: 2 * (m + p - 1),
                 schedule_zb_h1: max(3 * m + p - 1, 2 * m + 2 * p - 1),
                 schedule_interleaved_1f1b: 2 * m * v + 2 * (p - 1)}
        assert place_on_ticks(traces, v)[1] == total[fn], (fn, v, p, m)
        if fn is schedule_1f1b:                      # 1F1B with each B also doing W's work: 2 ticks
            assert place_on_ticks(traces, 1, {"F": 1, "B": 2})[1] == 3 * (m + p - 1), (p, m)
    log(f"{len(by_hand)} hand-worked orders match; {len(configs)} schedules, p <= 8, m <= 12, interleaved v = 2, 3:")
    log("in micro-batch order, B after F, W after B; held and ticks equal the closed forms")


def split_backward(device):
    model = nn.Sequential(*(Block(HIDDEN, torch.float64, device) for _ in range(3)))
    x = torch.randn(ROWS, 2 * HIDDEN, dtype=torch.float64, device=device)[:, ::2]   # a non-contiguous input
    dy = torch.randn(ROWS, HIDDEN, dtype=torch.float64, device=device)
    x1 = x.clone().requires_grad_()
    model(x1).backward(dy)                           # the ordinary backward: input and weight grads at once
    want = [x1.grad] + [q.grad for q in model.parameters()]
    model.zero_grad(set_to_none=True)
    x2 = x.clone().requires_grad_()
    y, kept = forward_keeping(model, x2)
    x_grad, saved = backward_input(x2, y, dy, kept)
    assert x2.grad is None and all(q.grad is None for q in model.parameters()), "B wrote a gradient"
    assert [mod for mod, _, _ in saved] == [b.fc for b in model], saved
    backward_weight(saved)
    got = [x_grad] + [q.grad for q in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "B then W differs from the ordinary backward"
    log(f"B: the input's grad and each Linear's output grad, no weight grad; W: {len(want) - 1} weight grads from "
        f"them; exactly the ordinary backward")


def equal_one_process(full, device, world):
    m_int = -(-M // world) * world                  # interleaved: m a multiple of p
    fns = (train_step_1f1b, schedule_1f1b, schedule_gpipe, schedule_interleaved_1f1b, schedule_zb_h1)
    combos = [(fn, batched, [ROWS] * (m_int if fn is schedule_interleaved_1f1b else M))
              for fn in fns for batched in (True, False)]
    runs = check_pipeline(full, device, combos)
    for (fn, batched, rows), stages in zip(combos, runs):
        if batched:
            ma = len(rows) * ROWS * HIDDEN * 8       # m*A: one activation per micro-batch
            over = [(r['peak'] - r['most']) / r['a'] for r in stages]
            log(f"{NAME[fn]:11} loss, {2 * len(full)} grads match; sent {[r['sent'] // ma for r in stages]} m*A; kept "
                f"{[r['most'] // r['a'] for r in stages]} A, peak kept + {min(over):.1f}..{max(over):.1f} A")
    for i in (0, 1):                                 # batched, ordered: the loop and the runner post the same calls
        assert [r["log"] for r in runs[i]] == [r["log"] for r in runs[2 + i]], "run_schedule != the 1F1B loop"
    log(f"m = {M} (interleaved {m_int}), A = {ROWS}x{HIDDEN}x8 bytes; kept: the model's closed form for what the")
    log("schedule's micro-batches and messages keep; peak (memory()) - (kept + the running op's temporaries) in")
    log("[-8 B, A/2) (the 1F1B loop: [0, the largest op's + A/2));")
    log("peak // one micro-batch's bytes = min(p - s, m) for 1F1B, m for GPipe; one message in flight at most;")
    log("nothing left after the step; the 1F1B loop and run_schedule post the same calls; every run's calls")
    log("replay as NCCL runs them (one by one; each call one group), one peer a call, each message reaching the")
    log("receive that expects it")


def timelines(full, device, world):
    m = -(-4 // world) * world
    fns = (schedule_1f1b, schedule_interleaved_1f1b, schedule_zb_h1)
    runs = check_pipeline(full, device, [(fn, True, [ROWS] * m) for fn in fns])
    p, v = world, V
    closed = {schedule_1f1b: (2 * (m + p - 1), 2 * m, "2(m+p-1) ticks"),
              schedule_interleaved_1f1b: (2 * m * v + 2 * (p - 1), 2 * m * v, "2mv+2(p-1) chunk-ticks"),
              schedule_zb_h1: (max(3 * m + p - 1, 2 * m + 2 * p - 1), 3 * m, "max(3m+p-1, 2m+2p-1) ticks")}
    for fn, stages in zip(fns, runs):
        grid, ticks = place_on_ticks([r["trace"] for r in stages], v if fn is schedule_interleaved_1f1b else 1)
        assert ticks == closed[fn][0], (NAME[fn], ticks)
        if world <= 4:
            log(NAME[fn] + (" (upper case: chunk 0, lower case: chunk 1)" if fn is schedule_interleaved_1f1b else ""))
            for s, row in enumerate(grid):
                log(f"stage {s} |" + "".join(f"{label(*row[t]) if t in row else '.':>3}" for t in range(ticks)))
    one_f_one_b = place_on_ticks([r["trace"] for r in runs[0]], 1, {"F": 1, "B": 2})[1]
    assert one_f_one_b == 3 * (m + p - 1) and (p == 1 or closed[schedule_zb_h1][0] < one_f_one_b), one_f_one_b
    idle = {fn: f"{t - work}/{t}" for fn, (t, work, _) in closed.items()}
    log(f"idle per stage, m = {m}, p = {p}, v = {v}: 1F1B {idle[schedule_1f1b]} = (p-1)/(m+p-1); interleaved "
        f"{idle[schedule_interleaved_1f1b]} chunk-ticks = (p-1)/(mv+p-1)")
    log(f"ZB-H1 (F = B = W = 1 tick) {idle[schedule_zb_h1]}, p-1 of 3m+p-1 when m >= p, where 1F1B (B doing W's "
        f"work, 2 ticks) takes 3(m+p-1) = {one_f_one_b}")


def any_m(full, device, world):
    rows = lambda m: [1 + 3 * k % 5 for k in range(m)]                       # 1, 4, 2, 5, 3, 1, ...
    ms = sorted({1, (world + 1) // 2, world + 1})
    sweep = [(fn, i % 2 == 0, rows(m)) for i, m in enumerate(ms) for fn in (schedule_1f1b, schedule_zb_h1)]
    sweep.append((schedule_interleaved_1f1b, False, rows(2 * world)))
    runs = check_pipeline(full, device, sweep, variable=True)
    log(f"1F1B and ZB-H1 at m = {ms}, interleaved at m = {2 * world}, rows 1, 4, 2, 5, 3, ...: losses and grads "
        f"match;")
    log("calls replay as NCCL runs them, one message in flight at most")


def two_stage_trick(full, device, world):
    try:                                             # second_group: accepted with exactly two stages
        P2PCommunicator((1,), torch.float64, device, batched=False, second_group=dist.group.WORLD)
        assert world == 2, f"second_group accepted with {world} stages"
    except ValueError:
        assert world != 2, "second_group refused with 2 stages"
    log(f"second_group with the {world}-stage world pipeline: {'accepted' if world == 2 else 'ValueError'}")
    if world == 1:
        return
    pair = [world - 2, world - 1]
    pp, second = (dist.new_group(pair, timeout=pg_timeout()) for _ in "12")   # every rank creates every group
    runs = [(schedule_1f1b, False, [ROWS] * 3), (schedule_interleaved_1f1b, False, [ROWS] * 4)]
    for (fn, _, _), stages in zip(runs, check_pipeline(full, device, runs, group=pp, second_group=second)):
        for s, r in enumerate(stages):               # sends from the odd stage, receives on the even one: group 1
            groups = [g for call in r["log"] for kind, _, _, g in call]
            assert groups == [int((kind == "send") == (s == 1)) for call in r["log"] for kind, *_ in call], groups
        log(f"{NAME[fn]:11} on ranks {pair}: loss {stages[-1]['loss']:.6f}, grads match; every odd->even transfer "
            f"on the second group")


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
    blocks = [Block(HIDDEN, torch.float64, device) for _ in range(2 * p)]
    embed, lm_head = nn.Embedding(vocab, HIDDEN, dtype=torch.float64, device=device), nn.Linear(
        HIDDEN, vocab, dtype=torch.float64, device=device)
    full = nn.Sequential(embed, *blocks, lm_head)
    stage = nn.Sequential(*([embed] if s == 0 else []), *blocks[2 * s:2 * s + 2],
                          *([lm_head] if s == p - 1 else [Strided()]))
    ids = torch.randint(0, vocab, (M, 2 * ROWS), device=device, generator=gen)[:, ::2]   # token ids, strided
    targets = torch.randint(0, vocab, (M, ROWS), device=device, generator=gen)
    ref_loss = F.cross_entropy(full(ids.reshape(-1)), targets.reshape(-1))
    ref_loss.backward()
    ref = {id(q): q.grad.clone() for q in full.parameters()}
    for fn in (train_step_1f1b, schedule_1f1b, schedule_zb_h1):
        full.zero_grad(set_to_none=True)
        comm = P2PCommunicator((ROWS, HIDDEN), torch.float64, device, pp)
        with traffic() as t:
            if fn is train_step_1f1b:
                loss = train_step_1f1b(stage, comm, list(ids), list(targets), F.cross_entropy)
            else:
                loss = run_schedule(stage, fn, comm, list(ids), list(targets), F.cross_entropy)[0]
        if s == p - 1:
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
        own = {id(q) for q in stage.parameters()}
        for q in full.parameters():
            assert q.grad is None if id(q) not in own else torch.allclose(q.grad, ref[id(q)], rtol=1e-9, atol=0)
        assert {c[1] for c in t.calls} <= {tuple(ranks)}, t.calls   # on this pipeline's group, nowhere else
        assert t.counts["send"] == (2 - (s == 0) - (s == p - 1)) * M * (p > 1), t.counts
    log(f"pipelines on {members} at once: token ids in (never sent), cross-entropy out, non-contiguous activations;")
    log("the 1F1B loop, run_schedule with 1F1B and with ZB-H1: loss and grads equal each pipeline in one process")


def main():
    rank, world, device = setup()                    # any number of ranks: the model grows with it
    dist.barrier()  # NCCL: a group's first batch_isend_irecv must include all its ranks; the last stage's posts none
    full = nn.Sequential(*(Block(HIDDEN, torch.float64, device) for _ in range(2 * V * world)))  # alike: seeded
    head("P2P layer: send_forward_recv_backward, then send_backward_recv_forward, on every rank")
    p2p_layer(rank, world, device)
    head("schedules: pure functions, against orders worked out by hand and exhaustive properties")
    schedules_checked(rank, world)
    head("the split backward: B (input grad) then W (weight grads) = the ordinary backward")
    split_backward(device)
    head(f"{world} stages = the whole model in one process: loss, every gradient, held activations, bytes sent")
    equal_one_process(full, device, world)
    head("timelines: each stage's recorded order, one tick per op ('.' = idle)")
    timelines(full, device, world)
    head("any m (1, m < p, m > p), micro-batches of different lengths: shapes travel first")
    any_m(full, device, world)
    head("two stages, two groups: the ordered implementation's two-stage trick")
    two_stage_trick(full, device, world)
    head("pipelines on sub-groups (a tp x pp grid's): token ids in, a user's loss out")
    pipelines_on_subgroups(device, rank, world)
    finish("P2P layer; 1F1B, GPipe, interleaved 1F1B and ZB-H1 equal one process; bubbles and memory measured")


if __name__ == "__main__":
    main()
