"""08 - pipeline parallelism: Megatron's P2P layer; 1F1B, GPipe, interleaved 1F1B and ZB-H1, each == one process.

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
Interleaved 1F1B (Megatron): stage s holds v chunks, chunk c being model chunk c*p + s, so a micro-batch goes round
the ring of stages v times. Warm-up 2(p-s-1) + (v-1)p chunk forwards: the last stage reaches micro-batch 0's last
chunk after (v-1)p of them, and stage s waits 2(p-s-1) chunk ticks more for its gradient (p-s-1 hops each way).
ZB-H1 (Qi et al., ICLR 2024) splits each B into B, the input gradient the previous stage waits for, and W, the
weight gradients nobody waits for: W k runs after B k+s, while the call after that B travels; the Ws left fill the
cool-down. It keeps min(p, m) micro-batches from F to W (after B only each Linear's input and output gradient).
Bubbles, one tick per op (interleaved: a chunk's op, 1/v of a tick), messages free:
  1F1B, GPipe  2(m+p-1) ticks, 2(p-1) idle: (p-1)/(m+p-1) of the step; Narayanan et al. divide by the work: (p-1)/m
  interleaved  2mv + 2(p-1) chunk-ticks, 2(p-1) idle: v times less time, a share (p-1)/(mv+p-1): p=4, m=8, v=2 27%->16%
  ZB-H1        F = B = W = 1 tick: max(3m+p-1, 2m+2p-1) ticks; for m >= p, p-1 idle: (p-1)/(3m+p-1)
The P2P layer (Megatron's p2p_communication.py): named calls on one communicate(send_next, send_prev, recv_prev,
recv_next); a send waits for its receive, so where both ends of a link send (1F1B's steady state) each posts its
send and receive in one call: send_forward_recv_backward meets send_backward_recv_forward. The runner posts one
call after each unit of work (an F or a B; with chunks, Megatron's steady F-B pairs): what it made, what comes next.
Bytes sent per step, A = one micro-batch's activation: m*A forward unless last, m*A backward unless first;
interleaved (2v - [first] - [last]) m*A, in v times the messages; each message one transfer, one element longer (its
flag; variable_shapes: padded, behind a 56-B header). Kept: the schedule's micro-batches (a sent output shrinks to one
element: Megatron's deallocate_output_tensor), one call's sends in flight. A tied embedding (GPT-2's wte = lm_head) on
the first and last stage: allreduce_tied_grad() sums its copies' gradients (V*h) over embedding_group().

Run:  torchrun --nproc-per-node=4 08_pipeline_1f1b.py
tests/check_08.py proves the rest: bytes to the byte, calls replayed as NCCL runs them, refusals at both ends, hooks.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- building blocks: paste from here to the demo marker (they need only torch) ----------------------------
# the P2P layer --------------------------------------------------------------------------------------------
HEADER_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
                 torch.bool)                 # a message's header: [its dtype's index here, ndim, dims padded to 5]
MAX_NDIM = 5


class P2PCommunicator:
    """Moves activations to the next stage and gradients to the previous one; stage = rank in `group`.

    shape, dtype, device: every message, agreed by all stages when built. A message is one transfer: a copy of the
    tensor and one element more, its flag (1: refused by its sender, zeros in its place: no receiver is left
    waiting); both ends refuse one that is not what they move, in one line. variable_shapes (Megatron's
    variable_seq_lengths): any shape up to `shape`, padded to it, behind a header (7 int64: dtype, ndim, dims).
    batched: one batch_isend_irecv a call, else isend/irecv one by one in Megatron's even/odd order; second_group
    (2 stages, one by one): odd-to-even messages go on it, NCCL running one group's P2P in order. Neighbours wrap
    round (the interleaved ring); the named calls drop what has no neighbour. self.log: each call posted, its ops
    in order (send | recv, peer stage, bytes, group 0 | second 1).
    """

    def __init__(self, shape, dtype, device, group=None, batched=True, variable_shapes=False, second_group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.stage, self.num_stages = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.stage < 0:
            raise ValueError(f"rank {dist.get_rank()} is not in the pipeline group")
        if dtype not in HEADER_DTYPES or len(shape) > MAX_NDIM:
            raise ValueError(f"a message's header names a dtype of {[str(d)[6:] for d in HEADER_DTYPES]} and at "
                             f"most {MAX_NDIM} dims; got {dtype}, shape {tuple(shape)}")
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
        self._numel = torch.Size(shape).numel()
        self._in_flight, self._loop = [], ([], [])  # sends not waited for yet; a one-stage ring's messages
        mine = torch.cat([self._header(torch.empty(shape, dtype=dtype)), torch.tensor([variable_shapes])])
        every = [torch.empty_like(mine, device=self.device) for _ in range(self.num_stages)]
        dist.all_gather(every, mine.to(self.device), group=self.group)
        if any(not torch.equal(e.cpu(), mine) for e in every):   # each stage sees them all: all refuse
            raise ValueError(f"the stages move different messages: [dtype, ndim, dims, variable] per stage "
                             f"{[e.tolist() for e in every]} (dtypes: {[str(d)[6:] for d in HEADER_DTYPES]})")

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

    def communicate(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False, wait_sends=True,
                    meanwhile=lambda: None):
        """The one routine under the named calls: (tensor from prev or None, from next or None), its receives waited
        for; meanwhile() runs while they travel (ZB-H1's W). wait_sends=False leaves its sends in flight (the next F
        or B computes meanwhile) until the next call, which waits for them first: one call's sends in flight."""
        sends = (send_next, send_prev)
        wrong = [self._said(f"stage {self.stage} cannot send a {t.dtype} tensor of shape {tuple(t.shape)}")
                 for t in sends if t is not None and self._bad(t.dtype, tuple(t.shape))]
        if self.num_stages == 1:                     # a ring of one: this stage receives what it sent
            if wrong:
                raise ValueError(wrong[0])
            for t, box in zip(sends, self._loop):
                box += [t.detach()] if t is not None else []
            meanwhile()
            return self._loop[0].pop(0) if recv_prev else None, self._loop[1].pop(0) if recv_next else None
        self.wait_sends()                            # the previous call's sends, before this one's are made
        out = [[] if t is None else self._framed(t) for t in sends]
        inbox = [([torch.empty(2 + MAX_NDIM, dtype=torch.int64, device=self.device),
                   torch.empty(self.shape, dtype=self.dtype, device=self.device)] if self.variable_shapes else
                  [torch.empty(self._numel + 1, dtype=self.dtype, device=self.device)]) if want else []
                 for want in (recv_prev, recv_next)]
        self._p2p(*out, *inbox, wait_sends, meanwhile)
        got = []
        for box, peer in zip(inbox, ((self.stage - 1) % self.num_stages, (self.stage + 1) % self.num_stages)):
            said = f"stage {self.stage} got from stage {peer} a "
            if box and not self.variable_shapes:     # [the tensor, flag]: 0 what the pipeline moves, 1 refused
                wrong += [self._said(said + "message its sender refused (zeros)")] * bool(box[0][-1].item())
                box[0] = box[0][:-1].view(self.shape)
            elif box:                                # [header: dtype's index (-1: none), ndim, dims...], tensor
                told = box[0].tolist()
                dtype, shape = HEADER_DTYPES[told[0]] if told[0] >= 0 else None, tuple(told[2:2 + told[1]])
                if told[1] > MAX_NDIM or self._bad(dtype, shape):
                    wrong.append(self._said(said + f"{dtype or 'another dtype'} tensor of " + (
                        f"shape {shape}" if told[1] <= MAX_NDIM else f"{told[1]} dims")))
                elif shape != self.shape:            # its corner
                    box[1] = box[1][tuple(slice(0, n) for n in shape)].clone()
            got.append(box[-1] if box else None)
        if wrong:
            raise ValueError(wrong[0])
        return tuple(got)

    def _bad(self, dtype, shape):                    # not what this pipeline moves
        return dtype != self.dtype or len(shape) != len(self.shape) or any(
            n > w if self.variable_shapes else n != w for n, w in zip(shape, self.shape))

    def _said(self, what):
        return f"{what}: the pipeline moves {self.dtype}, shape {'up to ' * self.variable_shapes}{self.shape}"

    def _header(self, t):                            # [dtype's index in HEADER_DTYPES (-1: none), ndim, dims]
        dims = list(t.shape)[:MAX_NDIM] if t.dim() <= MAX_NDIM else []
        return torch.tensor([HEADER_DTYPES.index(t.dtype) if t.dtype in HEADER_DTYPES else -1, t.dim(), *dims,
                             *[0] * (MAX_NDIM - len(dims))], dtype=torch.int64)

    def _framed(self, t):                            # what goes on the wire for t; zeros where t is refused
        bad = self._bad(t.dtype, tuple(t.shape))
        if not self.variable_shapes:                 # one transfer: t and its flag
            data = torch.zeros(self._numel, dtype=self.dtype, device=self.device) if bad else t.detach().reshape(-1)
            return [torch.cat([data, data.new_full((1,), bad)])]
        buf = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        if not bad:
            buf[tuple(slice(0, n) for n in t.shape)] = t
        return [self._header(t).to(self.device), buf]

    def wait_sends(self):
        """Wait for the sends the last communicate(wait_sends=False) left in flight, and let their tensors go."""
        for req, _ in self._in_flight:
            req.wait()
        self._in_flight = []

    def _p2p(self, send_next, send_prev, recv_prev, recv_next, wait_sends, meanwhile):
        """Post the given transfers (a list of tensors each) as one call; run meanwhile(); wait for its receives."""
        ops, call, reqs = [], [], []                 # (each tensor contiguous, as NCCL takes them: made so)
        for op, t, step, second in _posting_order(self, send_next, send_prev, recv_prev, recv_next):
            ops.append(dist.P2POp(op, t, self.next if step > 0 else self.prev,
                                  self.second_group if second else self.group))
            call.append(("send" if op is dist.isend else "recv", (self.stage + step) % self.num_stages,
                         t.numel() * t.element_size(), int(second)))
        if ops:
            self.log.append(call)
            reqs = dist.batch_isend_irecv(ops) if self.batched else [o.op(o.tensor, o.peer, group=o.group) for o in ops]
        meanwhile()
        # gloo: one request per op, each waited for (waiting on one hung, pytorch#132644); NCCL may give one in all
        for req, o in zip(reqs, ops) if len(reqs) == len(ops) else ((r, None) for r in reqs):
            if o is not None and o.op is dist.isend and not wait_sends:
                self._in_flight.append((req, o.tensor))                # keep the tensor alive until it is sent
            else:
                req.wait()


def _posting_order(comm, send_next, send_prev, recv_prev, recv_next):
    """The transfers (a list of tensors each) as [(isend | irecv, tensor, +1 next | -1 prev, on second group)], in
    Megatron's even/odd order: even stages send_next, recv_prev, send_prev, recv_next, odd ones swap each pair, so
    that posted one by one each link has one end sending while the other receives."""
    even = comm.stage % 2 == 0
    order = [(dist.isend, send_next, 1), (dist.irecv, recv_prev, -1), (dist.isend, send_prev, -1),
             (dist.irecv, recv_next, 1)]
    return [(op, t, step, comm.second_group is not comm.group and (op is dist.isend) != even)
            for op, ts, step in (order if even else [order[i] for i in (1, 0, 3, 2)]) for t in ts]


def deallocate_output_tensor(out):
    """Megatron's: once `out` is sent, backward needs only its grad_fn: point it at one element expanded to its shape
    (torch.autograd.backward(out, grad) still takes it). A view keeps its base: left alone."""
    if isinstance(out, torch.Tensor) and out.grad_fn is not None and out._base is None:
        out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)


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
    """This stage's ops, [("F" | "B", micro-batch, chunk)], in Megatron's interleaved 1F1B order: forwards take p
    micro-batches through chunk 0, the same p through chunk 1, ..., then the next p; backwards go the same way from
    the last chunk. Warm-up 2(p - s - 1) + (v - 1)p forwards, then F, B pairs, then the Bs left."""
    _check_schedule(num_stages, stage, num_microbatches)
    p, m, v = num_stages, num_microbatches, num_chunks
    if v < 2 or m % p:
        raise ValueError(f"interleaved 1F1B needs num_microbatches a multiple of num_stages and num_chunks >= 2; "
                         f"got num_microbatches={m}, num_stages={p}, num_chunks={v}")
    fwd = [("F", k // (p * v) * p + k % p, k // p % v) for k in range(m * v)]  # the k-th forward of this stage
    bwd = [("B", mb, v - 1 - c) for _, mb, c in fwd]                          # backwards: from the last chunk
    warmup = min(2 * (p - stage - 1) + (v - 1) * p, m * v)
    ops = fwd[:warmup]                                                         # warm-up
    for i in range(m * v - warmup):                                            # steady: F, B pairs
        ops += [fwd[warmup + i], bwd[i]]
    return ops + bwd[m * v - warmup:]                                          # cool-down


def schedule_zb_h1(num_stages, stage, num_microbatches):
    """This stage's ops, [("F" | "B" | "W", micro-batch)], in ZB-H1 order: 1F1B's Fs and Bs (B: the input gradient),
    W k (the weight gradients) after B k + stage, the Ws left in the cool-down. Holds min(p, m) from F until W."""
    ops = []
    for op, k in schedule_1f1b(num_stages, stage, num_microbatches):
        ops.append((op, k))
        if op == "B" and k >= stage:
            ops.append(("W", k - stage))
    return ops + [("W", k) for k in range(max(num_microbatches - stage, 0), num_microbatches)]


# the split backward: B (the input gradient, which the previous stage waits for), then W (the weight gradients) --
def forward_keeping(model, x):
    """F for a schedule with W: model(x), noting each parametrised module's input and output (B needs the output,
    W the input). W covers each parameter's uses inside its own module's forward (an embedding tied to a head that
    is an nn.Linear, as nanoGPT's, is two modules: both covered; a weight used by F.linear elsewhere is not)."""
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
    """W: each module's weight gradients from its input and output gradient, a Linear's dW = (X^T dZ)^T, db = sum dZ
    as autograd computes them, any other module's by running it again; into .grad through autograd's AccumulateGrad
    in one backward: autograd's layout (contiguous), and each parameter's post-accumulate-grad hooks fire once."""
    grads = {}                                       # parameter -> its gradient from this micro-batch
    for mod, args, dz in store:
        own = [q for q in mod.parameters(recurse=False) if q.requires_grad]
        if not own:
            continue
        if type(mod) is nn.Linear:
            with torch.no_grad():
                x2, dz2 = args[0].reshape(-1, mod.in_features), dz.reshape(-1, mod.out_features)
                new = [(mod.weight, (x2.t() @ dz2).t()), (mod.bias, dz2.sum(0) if mod.bias is not None else None)]
        else:
            with torch.enable_grad():
                z = mod(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
            new = list(zip(own, torch.autograd.grad(z, own, dz)))
        for q, g in new:
            if q is not None and q.requires_grad:
                grads[q] = g if q not in grads else grads[q] + g
    if grads:
        torch.autograd.backward(list(grads), list(grads.values()))


# the runner: any schedule above, one model chunk or v ---------------------------------------------------------
def run_schedule(stages, schedule_fn, comm, inputs, targets, loss_fn):
    """One training step of this pipeline stage, in the order schedule_fn gives; gradients accumulate in .grad.

    stages       this stage's nn.Module, or a list of v >= 2 chunks (chunk c runs model chunk c*p + s)
    schedule_fn  (num_stages, stage, num_microbatches) -> [(op, micro-batch[, chunk])], op "F", "B" or "W" (the
                 four above); with Ws, B is backward_input and W backward_weight (model chunk 0: B none, W all)
    comm         a P2PCommunicator on the pipeline group (stage = group rank, p = group size)
    inputs       m micro-batches, read by the first stage only (any tensors: token ids are never sent)
    targets      m targets, read by the last stage only; loss_fn(the last chunk's output, target) -> a scalar
    returns      the mean of the m losses on the last stage (else None), which the step backpropagates; the ops
                 as run, [(op, micro-batch, chunk)], each inside record_function("F mb3 c0"); the calls posted
    """
    p, s, m = comm.num_stages, comm.stage, len(inputs)
    chunks = [stages] if isinstance(stages, nn.Module) else list(stages)
    v, last = len(chunks), p * len(chunks) - 1        # model chunk u = c*p + s; the loss follows model chunk `last`
    ops = [(o[0], o[1], o[2] if len(o) > 2 else 0) for o in schedule_fn(p, s, m)]
    _check_order(ops, p, s, m, v)
    fwd, bwd = [o for o in ops if o[0] == "F"], [o for o in ops if o[0] == "B"]
    after, done = {}, []                              # ZB-H1: the Ws that follow each F or B
    for o in ops:
        after.setdefault(done[-1], []).append(o) if o[0] == "W" else done.append(o)
    # units of work, one call after each (what the unit made out, what the next one needs in): each F and B; with
    # chunks, Megatron's interleaved loop: warm-up Fs, steady F-B pairs (both inputs in one call), cool-down Bs
    warmup = min(2 * (p - s - 1) + (v - 1) * p, m * v)
    units = [[o] for o in done] if v == 1 else [[f] for f in fwd[:warmup]] + [
        [f, b] for f, b in zip(fwd[warmup:], bwd)] + [[b] for b in bwd[m * v - warmup:]]
    held, store, got, loss, trace, start = {}, {}, {}, [], [], len(comm.log)

    def run(op):                                     # one F or B; returns what it sends on (None: nothing)
        kind, mb, c = op
        u = c * p + s
        with torch.profiler.record_function(f"{kind} mb{mb} c{c}"):
            if kind == "F":
                x = got.pop(op).requires_grad_() if u > 0 else inputs[mb]
                y, keep = forward_keeping(chunks[c], x) if after and u > 0 else (chunks[c](x), None)
                if u == last:                        # the last model chunk: the loss
                    y = loss_fn(y, targets[mb]) / m
                    loss.append(y.detach())
                held[(mb, c)] = (x, y, keep)
                out = None if u == last else y       # sent as a copy: y is then deallocated
            else:
                x, y, keep = held.pop((mb, c))
                dy = got.pop(op) if u < last else None       # None where y is the loss
                if after:                            # model chunk 0: no input gradient, its W the whole backward
                    dx, store[(mb, c)] = backward_input(x, y, dy, keep) if u > 0 else (None, (y, dy))
                else:
                    torch.autograd.backward(y, dy)
                    dx = x.grad
                out = dx if u > 0 else None
        trace.append(op)
        return out

    def posted(made, unit):                          # while the call travels: what it sent is copied (backward
        for o, t in made:                            # needs only an output's grad_fn, nothing an input's gradient);
            if t is not None:                        # then the Ws the schedule runs after this unit
                deallocate_output_tensor(t) if o[0] == "F" else t.set_()
        for w in [w for op in unit for w in after.get(op, [])]:
            with torch.profiler.record_function(f"W mb{w[1]} c{w[2]}"):
                torch.autograd.backward(*store.pop(w[1:])) if w[2] * p + s == 0 else backward_weight(store.pop(w[1:]))
            trace.append(w)

    def call(made, unit, done):                      # send what `made` holds; receive what `unit` needs
        needs = [o for o in unit if (o[2] * p + s > 0 if o[0] == "F" else o[2] * p + s < last)]
        sends = {("send_next" if o[0] == "F" else "send_prev"): t for o, t in made if t is not None}
        a, b = comm.communicate(**sends, recv_prev=any(o[0] == "F" for o in needs), recv_next=any(
            o[0] == "B" for o in needs), wait_sends=False, meanwhile=lambda: posted(made, done))
        got.update({o: a if o[0] == "F" else b for o in needs})

    call([], units[0], [])                           # the first unit's input
    for i, unit in enumerate(units):
        call([(op, run(op)) for op in unit], units[i + 1] if i + 1 < len(units) else [], unit)
    comm.wait_sends()
    return sum(loss) if loss else None, trace, comm.log[start:]


def _check_order(ops, p, s, m, v):
    """Refuse, in one line, an order run_schedule cannot run: with chunks, any but Megatron's interleaved one; with
    one, Fs or Bs out of micro-batch order, a B before its F; a W before its B, or not one W for each B."""
    fb, ws = [o for o in ops if o[0] != "W"], [o for o in ops if o[0] == "W"]
    f, b = ([o[1] for o in fb if o[0] == kind] for kind in "FB")
    if (ops != schedule_interleaved_1f1b(p, s, m, v) if v > 1 else {o[2] for o in ops} != {0} or f != b or
            f != list(range(m)) or any(fb.index(("F", k, 0)) > fb.index(("B", k, 0)) for k in f)):
        raise ValueError(f"run_schedule runs {v} chunk(s) in " + ("schedule_interleaved_1f1b's order" if v > 1 else
                         "any order of F 0..m-1 and B 0..m-1, each after its F") + f"; the schedule gives {ops}")
    if ws and (sorted(ws) != sorted(("W",) + o[1:] for o in fb if o[0] == "B") or
               any(ops.index(w) < ops.index(("B",) + w[1:]) for w in ws)):
        raise ValueError(f"a schedule with Ws runs one W after each B; the schedule gives {ops}")


def stage_layers(blocks: nn.Sequential, num_stages, stage, num_chunks=1):
    """The consecutive blocks this stage runs (the same Parameter objects); with num_chunks = v > 1, a list of
    v chunks, chunk c being model chunk c*p + stage (the interleaved layout)."""
    parts = num_stages * num_chunks
    if len(blocks) % parts:
        raise ValueError(f"{len(blocks)} blocks do not split evenly over {num_stages} stages x {num_chunks} chunks")
    k = len(blocks) // parts
    chunks = [blocks[(c * num_stages + stage) * k:(c * num_stages + stage + 1) * k] for c in range(num_chunks)]
    return chunks[0] if num_chunks == 1 else chunks


# a tied embedding across stages ------------------------------------------------------------------------------
def embedding_group(pipelines=None, timeout=None):
    """Megatron's embedding group, which a tied model split into stages needs: the first and last stage of this
    rank's pipeline, holding the embedding and the head tied to it, each copy getting only its part of the gradient.
    pipelines: every pipeline's global ranks in stage order, alike on every rank (default: the world); every rank
    makes every group (new_group is collective). -> this rank's group; None on a middle stage, or one stage."""
    pipelines = [list(range(dist.get_world_size()))] if pipelines is None else [list(r) for r in pipelines]
    members = [r for ranks in pipelines for r in ranks]
    if len(set(members)) != len(members) or not all(0 <= r < dist.get_world_size() for r in members):
        raise ValueError(f"pipelines must be disjoint lists of ranks below {dist.get_world_size()}; got {pipelines}")
    mine = None
    for ranks in (r for r in pipelines if len(r) > 1):
        group = dist.new_group([ranks[0], ranks[-1]], timeout=timeout)
        mine = group if dist.get_rank() in (ranks[0], ranks[-1]) else mine
    return mine


def allreduce_tied_grad(weight, group):
    """After the step's backward, before the optimizer step: this stage's copy's gradient summed in place with the
    other copy's over the embedding group (Megatron's _allreduce_word_embedding_grads), in weight.main_grad where a
    data-parallel wrapper sums (Megatron's, 09's: before its sync_gradients()), else in weight.grad (None: zeros).
    A no-op where group is None. Sends V*h elements, all-reduced over 2 ranks."""
    if group is None:
        return
    grad = getattr(weight, "main_grad", None)        # read once: a wrapper's main_grad may be a property
    if grad is None:
        grad = weight.grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    flat = grad.contiguous()                         # gloo sums a non-contiguous tensor wrongly
    dist.all_reduce(flat, group=group)
    if flat is not grad:
        grad.copy_(flat)


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
HIDDEN, ROWS, M, V = 8, 4, 8, 2  # the model: 2 blocks per chunk, p stages x V chunks


class TanhBlock(nn.Module):
    """x + tanh(x W^T + b): the demo model's unit, which the pipeline splits."""

    def __init__(self, hidden, dtype=None, device=None):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden, dtype=dtype, device=device)

    def forward(self, x):                            # (rows, hidden) -> (rows, hidden)
        return x + torch.tanh(self.fc(x))


def schedule(fn, v):
    """fn as run_schedule takes it: the interleaved one with v chunks."""
    return (lambda p, s, m: schedule_interleaved_1f1b(p, s, m, v)) if fn is schedule_interleaved_1f1b else fn


def op_ticks(orders, num_chunks=1, ticks=None):
    """Every stage's ops on one clock, an op taking ticks[op] (default 1) and a message none: an op ends its time
    after both its stage's previous op and its input (the op of the model chunk before, or after, for a B) end.
    orders: each stage's [(op, micro-batch, chunk)]. Returns {(stage, op): end tick}."""
    p, ticks, end, at, free = len(orders), ticks or {}, {}, [0] * len(orders), [0] * len(orders)
    while any(at[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while at[s] < len(orders[s]):
                op, mb, c = orders[s][at[s]]
                u = c * p + s + (1 if op == "B" else -1)          # the model chunk it takes its input from
                dep = (u % p, (op, mb, u // p)) if op != "W" and 0 <= u < p * num_chunks else None
                if dep is not None and dep not in end:
                    break                                # its input is not made yet
                free[s] = end[(s, (op, mb, c))] = max(free[s], end.get(dep, 0)) + ticks.get(op, 1)
                at[s], moved = at[s] + 1, True
        if not moved:
            raise ValueError("the schedules wait on each other in a cycle")
    return end


class Kept:
    """A tensor autograd saved for backward (saved_tensors_hooks' pack; detached: no cycle through its grad_fn):
    its bytes count in Kept.live while autograd holds it, Kept.peak is the most at once; not parameters (skip)."""
    live, peak, skip = 0, 0, set()

    def __init__(self, t):
        self.t, self.n = t.detach(), (t.untyped_storage().data_ptr() not in Kept.skip) * t.numel() * t.element_size()
        Kept.live += self.n
        Kept.peak = max(Kept.peak, Kept.live)

    def __del__(self):
        Kept.live -= self.n


def step(full, fn, m, device, v=1, stages=None, data=None, loss_fn=F.mse_loss, meter=False, tied=None):
    """One step of `full` through the pipeline (this rank's `stages`, default its blocks) == the same m micro-batches
    in one process: the loss, this stage's gradients. meter: Kept counts what the step keeps. -> the ops as run."""
    p, s = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device).manual_seed(m)
    xs, ts = data or ([torch.randn(ROWS, HIDDEN, dtype=torch.float64, device=device, generator=gen)
                       for _ in range(m)] for _ in "xt")
    full.zero_grad(set_to_none=True)
    ref = sum(loss_fn(full(x), t) for x, t in zip(xs, ts)) / m          # one process: the whole batch
    ref.backward()
    want = {q: q.grad for q in full.parameters()}
    full.zero_grad(set_to_none=True)
    stages = stages if stages is not None else stage_layers(full, p, s, v)
    comm = P2PCommunicator((ROWS, HIDDEN), torch.float64, device)
    with torch.autograd.graph.saved_tensors_hooks(Kept, lambda k: k.t) if meter else torch.enable_grad():
        Kept.peak = 0
        loss, trace, _ = run_schedule(stages, schedule(fn, v), comm, xs, ts, loss_fn)
    if tied is not None:
        allreduce_tied_grad(*tied)
    assert comm.is_last <= (loss is not None and torch.allclose(loss, ref, rtol=1e-12, atol=0)), (loss, ref)
    for q in nn.ModuleList([stages] if v == 1 else stages).parameters():
        assert torch.allclose(q.grad, want[q], rtol=1e-9, atol=1e-15), fn
    return trace


def main():
    from common import finish, head, log, pg_timeout, setup
    rank, world, device = setup()                    # any number of ranks: the model grows with it
    dist.barrier()  # NCCL: a group's first batch_isend_irecv must include all its ranks; the last stage's posts none
    p, s = world, rank
    full = nn.Sequential(*(TanhBlock(HIDDEN, torch.float64, device) for _ in range(2 * V * world)))  # alike: seeded

    head("the P2P layer: send_forward_recv_backward, then send_backward_recv_forward, on every rank")
    comm = P2PCommunicator((2, 3), torch.float64, device)
    sent = lambda r, d: torch.full((2, 3), 10.0 * r + d, dtype=torch.float64, device=device)   # rank r, way d
    got_next = comm.send_forward_recv_backward(sent(rank, 0))          # my activation right, their gradient back
    got_prev = comm.send_backward_recv_forward(sent(rank, 1))          # my gradient left, their activation in
    # rank r => got_next = rank r+1's gradient (None on the last), got_prev = rank r-1's activation (None on 0)
    assert got_next is None if comm.is_last else torch.equal(got_next, sent(rank + 1, 1)), got_next
    assert got_prev is None if comm.is_first else torch.equal(got_prev, sent(rank - 1, 0)), got_prev
    log("each stage got its next stage's gradient and its previous stage's activation; the two ends got None")

    m = -(-4 // p) * p                               # interleaved: m a multiple of p
    head(f"timelines: 1F1B, interleaved 1F1B (v = {V}), ZB-H1 at m = {m}, each == one process; '.' = idle")
    zb = max(3 * m + p - 1, 2 * m + 2 * p - 1)
    for fn, want, what in ((schedule_1f1b, 2 * (m + p - 1), "2(m+p-1) ticks"),
                           (schedule_interleaved_1f1b, 2 * m * V + 2 * (p - 1), "2mv+2(p-1) chunk-ticks"),
                           (schedule_zb_h1, zb, "max(3m+p-1, 2m+2p-1) ticks")):
        v = V if fn is schedule_interleaved_1f1b else 1
        traces = [None] * world
        dist.all_gather_object(traces, step(full, fn, m, device, v))    # the ops each stage ran, in order
        end = op_ticks(traces, v)
        ticks = max(end.values())
        assert ticks == want, (fn.__name__, ticks)
        log(f"{fn.__name__}: loss and grads == one process; {ticks} = {what}" + ", lower case: chunk 1" * (v > 1))
        for st, trace in enumerate(traces if world <= 4 else []):
            row = {end[(st, o)] - 1: (o[0] if o[2] == 0 else o[0].lower()) + str(o[1]) for o in trace}
            log(f"stage {st} |" + "".join(f"{row.get(t, '.'):>3}" for t in range(ticks)))
    slow = max(op_ticks([[(o, k, 0) for o, k in schedule_1f1b(p, st, m)] for st in range(p)], 1, {"B": 2}).values())
    assert slow == 3 * (m + p - 1) and (p == 1 or zb < slow), slow
    log(f"ZB-H1's {zb} ticks against 1F1B's 3(m+p-1) = {slow}, its B doing W's work (2 ticks)")

    head(f"GPipe and 1F1B, m = {M}, == one process; what autograd keeps: m micro-batches against min(p - s, m)")
    Kept.skip = {q.untyped_storage().data_ptr() for q in full.parameters()}
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64, device=device)
    with torch.autograd.graph.saved_tensors_hooks(Kept, lambda k: k.t):  # one micro-batch's F, in one process
        Kept.peak = 0
        y = stage_layers(full, p, s)(x.clone().requires_grad_(s > 0))   # as received (stage 0: the data itself)
        y, one = F.mse_loss(y, x) if s == p - 1 else y, Kept.peak
    del y
    for fn, held in ((schedule_gpipe, M), (schedule_1f1b, min(p - s, M))):   # on every stage s
        step(full, fn, M, device, meter=True)
        assert Kept.live == 0 and Kept.peak == held * one, (fn.__name__, Kept.peak, held * one)
    log(f"kept at the peak, in micro-batches (stage 0's: {one} B): GPipe {[M] * p}, 1F1B "
        f"{[min(p - r, M) for r in range(p)]}; then none")

    head("a tied embedding across stages: embedding_group() and allreduce_tied_grad(), under ZB-H1")
    vocab, gen = 11, torch.Generator(device).manual_seed(2)
    embed = nn.Embedding(vocab, HIDDEN, dtype=torch.float64, device=device)
    lm_head = nn.Linear(HIDDEN, vocab, bias=False, dtype=torch.float64, device=device)
    lm_head.weight = embed.weight                    # tied, as GPT-2's: one Parameter, used twice
    blocks = nn.Sequential(*(TanhBlock(HIDDEN, torch.float64, device) for _ in range(2 * p)))
    mine = nn.Sequential(*[embed] * (s == 0), *stage_layers(blocks, p, s), *[lm_head] * (s == p - 1))
    data = ([torch.randint(vocab, (ROWS,), device=device, generator=gen) for _ in range(M)] for _ in "it")
    group = embedding_group(timeout=pg_timeout())    # stages 0 and p-1 (None on a middle stage, or p = 1)
    step(nn.Sequential(embed, *blocks, lm_head), schedule_zb_h1, M, device, stages=mine, data=data,
         loss_fn=F.cross_entropy, tied=(embed.weight, group))
    log(f"ids in, cross-entropy out; the tied weight's copies on stages {sorted({0, p - 1})} summed: == one process")
    finish("P2P layer; 1F1B, GPipe, interleaved 1F1B, ZB-H1 == one process; their timelines; memory; tied")


if __name__ == "__main__":
    main()
