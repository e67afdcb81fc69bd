"""09 - data parallelism in buckets: DDP all-reduces the gradients; ZeRO-2 reduce-scatters them and shards the optimizer.

Every rank holds the whole model and trains it on its own slice of the global batch; the gradients are summed
over ranks before the optimizer step. DDP (PyTorch DDP, Megatron's DistributedDataParallel) all-reduces them and
every rank runs the same AdamW step on every parameter. ZeRO-2 (DeepSpeed stage 2) reduce-scatters them: rank r
keeps the summed gradient, fp32 master weights and Adam moments of its 1/W shard only, updates that shard, and
all-gathers the updated parameters. (Both hold every parameter; sharding those too is ZeRO-3 / FSDP.)

Both communicate in buckets, as production systems do: parameters, in the order backward produces their
gradients, packed into flat buffers padded to a multiple of W. A hook per parameter (post-accumulate-grad) adds its
gradient into `param.main_grad`, a view of the bucket's fp32 buffer; when a bucket's last gradient arrives its
collective starts (async) while backward computes the rest. ZeRO-2 gathers parameters bucket by bucket: a forward
pre-hook waits for this bucket's gather and starts the next (prefetch), so gathers travel during the forward.

  one bucket, W=2: | a0 a1 a2 | b0 b1 pad |   rank 0 owns elements 0..2, rank 1 owns 3..5 (padding included)
                 DDP                                      ZeRO-2
  backward       rank r: its gradients g_r, all 6         rank r: its gradients g_r, all 6 (freed after the RS)
  communicate    all-reduce: every rank has sum_r g_r     reduce-scatter: rank r has sum_r g_r on its 3
  AdamW          every rank: master, m, v for all 6       rank r: master, m, v for its 3; updates those 3
  after step     every rank: all 6 parameters             all-gather: every rank has all 6 parameters
  held per rank  grad + master + m + v: 4 x 6             4 x 3 = 1/W of DDP's (plus, during backward, the
                                                          full-size gradient of two buckets at most)

Bytes each rank sends per step (ring algorithms; V = bytes of the padded gradient buffer):
  DDP      all-reduce                      2(W-1)/W * V
  ZeRO-2   reduce-scatter + all-gather     (W-1)/W * V + (W-1)/W * V = 2(W-1)/W * V, the same
With M micro-batches of gradient accumulation the two differ. DDP adds every micro-batch into its full gradient
buffer and all-reduces on the last micro-batch only: still 2(W-1)/W * V. ZeRO-2 keeps only its 1/W shard of the
gradient, so it reduce-scatters after every micro-batch, as DeepSpeed stage 2 does: (M+1)(W-1)/W * V.
(With bf16 parameters and fp32 gradients the gather moves half the bytes of the reduce-scatter.)

    torchrun --nproc-per-node=4 09_ddp_zero2.py
"""
import collections
import contextlib
import copy
import functools
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- building blocks (torch only) ---------------------------------------------------------------------
def adamw_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """One AdamW update in place, the arithmetic of torch.optim.AdamW (decoupled decay, bias-corrected moments)."""
    beta1, beta2 = betas
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))


class Bucket:
    """Parameters that communicate as one flat tensor of `numel` elements, padded so that W divides it.

    The parameters become views of `flat` (a gather writes them in place); their gradients are summed into `grad`
    (fp32, or wider) through `p.main_grad` views. Rank r owns `shard`: elements [r*numel/W, (r+1)*numel/W).
    """

    def __init__(self, index, params, world, rank):
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"bucket {index} mixes parameter dtypes/devices {sorted(map(str, kinds))}")
        self.index, self.params = index, params
        self.used = sum(p.numel() for p in params)
        self.numel = -(-self.used // world) * world  # padded up to a multiple of W
        self.shard = slice(rank * self.numel // world, (rank + 1) * self.numel // world)
        self.main_dtype = torch.promote_types(params[0].dtype, torch.float32)
        self.flat = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
        self.offsets = [sum(q.numel() for q in params[:i]) for i in range(len(params))]
        for p, offset in zip(params, self.offsets):
            self.flat[offset:offset + p.numel()].copy_(p.detach().flatten())
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
        self.grad = None        # full-size gradient sum: DDP keeps it, ZeRO-2 frees it after its reduce-scatter
        self.grad_shard = self.out = None  # ZeRO-2: this rank's shard of the summed gradient; an RS output
        self.ready, self.work = 0, None  # gradients arrived in this backward; the gradient collective in flight
        self.send = self.gather = None  # ZeRO-2: the updated shard to all-gather, and that gather in flight

    def new_grad(self):
        self.grad = torch.zeros(self.numel, dtype=self.main_dtype, device=self.flat.device)
        for p, offset in zip(self.params, self.offsets):
            p.main_grad = self.grad[offset:offset + p.numel()].view_as(p)


class DataParallel:
    """DDP (zero2=False) or ZeRO-2 (zero2=True) over the same buckets of `module`'s parameters, AdamW built in.

        out = model(x)                   ZeRO-2: each module first waits for its bucket's gather, prefetches the next
        model.backward(loss, sync=last)  hooks start each bucket's all-reduce / reduce-scatter as soon as it fills;
                                         DDP with sync=False (not the last micro-batch) only accumulates main_grad;
                                         ZeRO-2 reduce-scatters every micro-batch, keeps only its shard of
                                         the sum, and frees each full-size bucket once the next one starts
        model.step()                     waits for the buckets, AdamW on what this rank owns; ZeRO-2 then starts
                                         gathering the updated parameters
    overlap=False starts the collectives only after backward and gathers every parameter inside step(): the same
    arithmetic, no overlap.
    """

    def __init__(self, module, bucket_numel, zero2=False, overlap=True, group=None,
                 lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        # reversed registration order: the order backward produces gradients in most models (the demo checks it)
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel={bucket_numel} must be at least 1 element")
        if not params:
            raise ValueError(f"{type(module).__name__} has no trainable parameters to keep in sync")
        self.module, self.zero2, self.overlap, self.group = module, zero2, overlap, group
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.hyper, self.steps = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), 0
        self.names = {p: n for n, p in module.named_parameters()}
        runs = [[]]
        for p in params:  # cut a bucket as soon as it holds bucket_numel elements
            if sum(q.numel() for q in runs[-1]) >= bucket_numel:
                runs.append([])
            runs[-1].append(p)
        self.buckets = [Bucket(i, run, self.world, rank) for i, run in enumerate(runs)]
        self.state = []  # per bucket: AdamW state of the elements this rank updates
        for b in self.buckets:
            master = (b.flat[b.shard] if zero2 else b.flat).to(b.main_dtype, copy=True)
            self.state.append(dict(master=master, exp_avg=torch.zeros_like(master),
                                   exp_avg_sq=torch.zeros_like(master)))
            if zero2:
                b.grad_shard = torch.zeros_like(master)
            for p in b.params:
                p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, b))
        if zero2:
            for name, m in module.named_modules():
                own = set(m.parameters(recurse=False))
                needs = [b for b in self.buckets[::-1] if own & set(b.params)]  # in forward order
                if needs:
                    m.register_forward_pre_hook(functools.partial(self._before_forward, name, needs))
        self.sync, self.next = True, 0
        self.events = []    # what happened, in order: gradients arriving, collectives starting, waits, forwards
        self.comm_log = []  # (collective, payload bytes) for every collective started

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _record(self, op, b, payload):
        self.events.append(f">{op}{b.index}")
        self.comm_log.append((op, payload.numel() * payload.element_size()))

    # -- gradients: hooks fill the buckets, a full bucket starts communicating --------------------------------
    def _grad_ready(self, b, p):
        if b.grad is None:  # DDP keeps it from the first backward on; ZeRO-2 frees it after each reduce-scatter
            b.new_grad()
        p.main_grad.add_(p.grad)      # accumulate in fp32, across micro-batches too
        p.grad = None                 # autograd's copy is spent
        self.events.append(self.names[p])
        b.ready += 1
        while self.sync and self.overlap and self.next < len(self.buckets) and \
                self.buckets[self.next].ready == len(self.buckets[self.next].params):
            self._start_grad_sync(self.buckets[self.next])  # in bucket order: every rank issues the same sequence
            self.next += 1

    def _start_grad_sync(self, b):
        if self.zero2:
            b.out = torch.empty(b.numel // self.world, dtype=b.main_dtype, device=b.grad.device)
            b.work = dist.reduce_scatter_single(b.out, b.grad, op=dist.ReduceOp.SUM, group=self.group,
                                                async_op=True)
        else:
            b.work = dist.all_reduce(b.grad, group=self.group, async_op=True)
        self._record("RS" if self.zero2 else "AR", b, b.grad)
        if self.zero2 and b.index > 0:  # finish the previous bucket: two full-size gradient buckets live at most
            self._keep_shard(self.buckets[b.index - 1])

    def _keep_shard(self, b):
        """ZeRO-2: wait for b's reduce-scatter, add this rank's shard of the sum, free the full-size gradient."""
        b.work.wait()
        b.grad_shard += b.out
        b.grad = b.work = b.out = None
        for p in b.params:
            p.main_grad = None

    def backward(self, loss, sync=True):
        """loss.backward() while the buckets communicate; sync=False: DDP only accumulates (not last micro-batch)."""
        self.sync = sync or self.zero2  # ZeRO-2 holds no full gradient between micro-batches: it always reduces
        self.next = 0
        for b in self.buckets:
            b.ready = 0
        loss.backward()
        if not self.sync:
            return
        for b in self.buckets[self.next:]:  # overlap=False, or parameters that got no gradient
            if b.grad is None:
                b.new_grad()
            self._start_grad_sync(b)
        self.next = len(self.buckets)
        if self.zero2:
            self._keep_shard(self.buckets[-1])

    # -- the optimizer step on what this rank owns ---------------------------------------------------------------
    def step(self):
        self.steps += 1
        for b, st in zip(self.buckets, self.state):
            if not self.zero2:
                b.work.wait()  # the step waits for every bucket's all-reduce
                b.work = None
            grad = b.grad_shard if self.zero2 else b.grad
            grad.div_(self.world)  # sum over ranks -> mean over the global batch
            adamw_(st["master"], grad, st["exp_avg"], st["exp_avg_sq"], self.steps, **self.hyper)
            grad.zero_()
            if self.zero2:
                b.send = st["master"].to(b.flat.dtype)  # parameters go out in their own dtype
            else:
                b.flat.copy_(st["master"])
        if self.zero2 and self.overlap:
            self._start_gather(self.buckets[-1])  # the first bucket forward needs; its pre-hooks prefetch the rest
        elif self.zero2:
            self.wait_params()

    # -- ZeRO-2 parameters: gathered bucket by bucket, just ahead of the forward -------------------------------
    def _start_gather(self, b):
        if b.send is not None and b.gather is None:
            b.gather = dist.all_gather_single(b.flat, b.send, group=self.group, async_op=True)
            self._record("AG", b, b.flat)

    def _wait_gather(self, b):
        self._start_gather(b)
        if b.gather is not None:
            b.gather.wait()
            b.gather = b.send = None
            self.events.append(f"wait{b.index}")

    def _before_forward(self, name, buckets, module, args):
        for b in buckets:
            self._wait_gather(b)  # this module's parameters must be current
            if b.index > 0:
                self._start_gather(self.buckets[b.index - 1])  # prefetch the next bucket in forward order
        self.events.append(f"fwd:{name}")

    def wait_params(self):
        """ZeRO-2: finish every parameter gather (before reading parameters outside a forward)."""
        for b in self.buckets[::-1]:
            self._wait_gather(b)


# ---- demo -------------------------------------------------------------------------------------------------
STEPS, ROWS, BUCKET = 3, 4, 40  # AdamW steps; rows per rank per step; elements per bucket, at least
HYPER = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
RING = {"AR": 2, "RS": 1, "AG": 1}  # a rank sends RING[op] * (W-1)/W of the collective's payload


def make_model(device):
    # 70 + 110 + 33 = 213 parameters; buckets of 43, 100 and 70: the 43 needs padding at every W > 1
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(),
                         nn.Linear(10, 3)).to(device, torch.float64)


def rank_batch(step, r, device):
    """Rank r's rows for this step: different on every rank, reproducible by every rank."""
    g = torch.Generator().manual_seed(1000 * step + r)
    return [torch.randn(ROWS, n, generator=g, dtype=torch.float64).to(device) for n in (6, 3)]


def forward_backward(model, x, y, micro, phase=contextlib.nullcontext):
    """`micro` micro-batches of x, y; each forward+backward runs inside phase()."""
    for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
        with phase():
            model.backward(F.mse_loss(model(xm), ym) / micro, sync=i == micro - 1)


def held_bytes(model):
    """Bytes of the distinct storages `model` holds for gradients, and for optimizer state."""
    grads = [t for b in model.buckets for p in b.params
             for t in (b.grad, b.grad_shard, p.grad, getattr(p, "main_grad", None))]
    total = lambda ts: sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in ts if t is not None}.values())
    return total(grads), total([t for st in model.state for t in st.values()])


def overlapped(events, names):
    """Did a gradient collective start before the last gradient arrived?"""
    starts = [i for i, e in enumerate(events) if e[:3] in (">AR", ">RS")]
    return starts[0] < max(i for i, e in enumerate(events) if e in names)


def main():
    from common import finish, head, log, setup, sync
    from torch.distributed.tensor.debug import CommDebugMode
    rank, W, device = setup()
    base = make_model(device)
    ddp, zero = (DataParallel(copy.deepcopy(base), BUCKET, zero2=z, **HYPER) for z in (False, True))
    P, nb, names = sum(p.numel() for p in base.parameters()), len(ddp.buckets), set(ddp.names.values())
    V = sum(b.numel for b in ddp.buckets) * 8  # bytes of the padded float64 gradient buffer

    head(f"1. Buckets: parameters in backward order, padded to a multiple of W={W}")
    for b in ddp.buckets:
        log(f"bucket {b.index}: {' '.join(ddp.names[p] for p in b.params)}: {b.used} -> {b.numel} elements")
    assert all(b.numel % W == 0 and 0 <= b.numel - b.used < W for b in ddp.buckets)
    assert W == 1 or any(b.numel > b.used for b in ddp.buckets), "some bucket needs padding"
    for b in ddp.buckets + zero.buckets:  # parameters are views into the flat buffer the collectives fill
        assert all(p.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr() for p in b.params)
    log(f"{P} parameters, {V // 8} with padding; rank r owns elements [r*n/W, (r+1)*n/W) of each bucket")

    head(f"2. {STEPS} AdamW steps, different data on every rank, 1 or 2 micro-batches per step")
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    ops = {"AR": torch.ops.c10d.allreduce_, "RS": torch.ops.c10d._reduce_scatter_base_,
           "AG": torch.ops.c10d._allgather_base_}
    sent, counts = {}, collections.Counter()  # bytes this rank sent in one step; collectives CommDebugMode saw
    # DDP's backward, bucket by bucket: the bucket's gradients arrive in backward order, then its all-reduce starts
    ddp_order = [e for b in ddp.buckets for e in [ddp.names[p] for p in b.params] + [f">AR{b.index}"]]
    live = []  # ZeRO-2: elements of full-size gradient buckets alive, after each gradient it takes in
    for p in zero.module.parameters():  # registered after the wrapper's hooks, so these run after them
        p.register_post_accumulate_grad_hook(
            lambda _: live.append(sum(b.numel for b in zero.buckets if b.grad is not None)))

    @contextlib.contextmanager
    def counted():
        # one CommDebugMode per phase: on torch 2.13 its module tracker raises IndexError on a second forward
        # inside one; and torch warns about its backward hooks on modules whose inputs need no grad (layer 0)
        with warnings.catch_warnings(), CommDebugMode() as comm:
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
        counts.update(comm.get_comm_counts())

    for step in range(STEPS):
        micro = 1 + step % 2
        batches = [rank_batch(step, r, device) for r in range(W)]
        opt.zero_grad()  # the reference: one process, the union of every rank's rows, torch.optim.AdamW
        F.mse_loss(ref(torch.cat([x for x, _ in batches])), torch.cat([y for _, y in batches])).backward()
        opt.step()
        # what one step must issue: collective -> (how many, W x bytes sent in units of (W-1) x V)
        for name, model, expect in (("DDP", ddp, {"AR": (nb, 2)}),
                                    ("ZeRO-2", zero, {"RS": (micro * nb, micro), "AG": (nb, 1)})):
            model.comm_log.clear(), model.events.clear(), counts.clear()
            # CommDebugMode costs ~10x per op: it checks the 2-micro-batch step, the wrapper's log every step
            phase = counted if micro == 2 else contextlib.nullcontext
            forward_backward(model, *batches[rank], micro, phase)
            for b in model.buckets:  # the reduced gradient this rank holds (ZeRO-2: its shard) == one process's
                if b.work is not None:
                    b.work.wait()  # DDP's all-reduce, which step() would wait for
                want = F.pad(torch.cat([ref.get_parameter(model.names[p]).grad.flatten() for p in b.params]),
                             (0, b.numel - b.used))  # zero in the padding
                got, want = (b.grad_shard, want[b.shard]) if model.zero2 else (b.grad, want)
                torch.testing.assert_close(got / W, want, rtol=1e-12, atol=1e-14)
            with phase():
                model.step()
            if model is ddp:  # the micro-batches before the last only add into main_grad: no all-reduce
                assert model.events == [e for e in ddp_order if e in names] * (micro - 1) + ddp_order, model.events
            if step == 0:
                continue  # ZeRO-2's first forward had no gather to wait for: count from the second step
            for op, (n, _) in expect.items():
                assert n == sum(o == op for o, _ in model.comm_log) == (counts[ops[op]] if micro == 2 else n), op
            sent_times_w = sum(RING[op] * (W - 1) * nbytes for op, nbytes in model.comm_log)
            assert sent_times_w == sum(v for _, v in expect.values()) * (W - 1) * V, (name, sent_times_w, V)
            sent[name, micro] = sent_times_w / W
    zev = zero.events[:]  # the last step's, for section 4 (wait_params adds to them)
    zero.wait_params()
    for pname, p in ref.named_parameters():
        for name, model in (("DDP", ddp), ("ZeRO-2", zero)):
            torch.testing.assert_close(model.module.get_parameter(pname), p, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{name} {pname}: {m}")
    log(f"gradients after every backward: DDP's all, ZeRO-2's shard == one process on all {W * ROWS} rows")
    log(f"parameters: DDP == ZeRO-2 == torch.optim.AdamW in one process (float64; rtol 1e-10, atol 1e-12)")
    log(f"B sent per rank and step (V = {V} B): DDP, {nb} all-reduces: 2(W-1)/W x V = {sent['DDP', 1]:.0f}; "
        f"ZeRO-2, {nb} RS + {nb} AG: {sent['ZeRO-2', 1]:.0f}")
    log(f"2 micro-batches: DDP all-reduces on the last only: {sent['DDP', 2]:.0f}; ZeRO-2 reduce-scatters after "
        f"each: 3(W-1)/W x V = {sent['ZeRO-2', 2]:.0f}")

    head("3. Memory per rank: gradient buffer + optimizer state (master weights, exp_avg, exp_avg_sq)")
    (dg, ds), (zg, zs) = held_bytes(ddp), held_bytes(zero)
    assert (dg, ds) == (V, 3 * V), "DDP: the whole padded gradient buffer, and 3 optimizer tensors of its size"
    assert (zg * W, zs * W) == (dg, ds), "ZeRO-2: 1/W of each (the full-size gradients are freed after the RS)"
    two = max(a.numel + b.numel for a, b in zip(zero.buckets, zero.buckets[1:]))
    assert max(live) == two < V // 8, "during backward ZeRO-2 holds two full-size gradient buckets at most"
    log(f"DDP    holds {dg} B of gradients + {ds} B of optimizer state = {dg + ds} B")
    log(f"ZeRO-2 holds {zg} B of gradients + {zs} B of optimizer state = {zg + zs} B = 1/{W} of DDP's "
        f"({4 * P * 8 / W:.0f} B unpadded)")
    log(f"and during backward the full-size gradient of two buckets at most: {8 * max(live)} of DDP's {V} B")

    head("4. Overlap: buckets communicate while backward (and, in ZeRO-2, forward) computes")
    log("4.bias: its gradient arrived; >AR0 >RS0 >AG0: bucket 0's collective starts; wait0: waits for it; "
        "fwd:2: module 2")
    at, split = zev.index, min(i for i, e in enumerate(zev) if e in names)
    log(f"DDP    backward:       {' '.join(ddp.events)}")
    log(f"ZeRO-2 forward:        {' '.join(zev[:split])}")
    log(f"ZeRO-2 backward, step: {' '.join(zev[split:])}")
    assert overlapped(ddp.events, names) and overlapped(zev, names)
    assert any(at(f">AG{b}") < at(f) < at(f"wait{b}") for b in range(nb) for f in zev if f.startswith("fwd:")
               if f">AG{b}" in zev and f"wait{b}" in zev), "a gather travels while a layer computes"
    log("asserted: buckets start in backward order, the first before backward ends; gathers travel during forward")
    times, final = {}, {}
    for name, overlap in (("DDP", True), ("DDP", False), ("ZeRO-2", True), ("ZeRO-2", False)):
        model = DataParallel(copy.deepcopy(base), BUCKET, name == "ZeRO-2", overlap, **HYPER)
        for step in range(2):  # a warm-up step, then the timed one
            model.events.clear()
            sync(device), dist.barrier()
            t0 = time.perf_counter()
            forward_backward(model, *rank_batch(step, rank, device), 1)
            model.step()
            sync(device)
        times[name, overlap] = 1e3 * (time.perf_counter() - t0)
        assert overlapped(model.events, names) == overlap
        model.wait_params()
        final[name, overlap] = list(model.module.parameters())
    assert all(torch.equal(p, q) for n in ("DDP", "ZeRO-2") for p, q in zip(final[n, True], final[n, False]))
    log("ms for one step: " + ", ".join(f"{n} {times[n, True]:.1f} overlapped / {times[n, False]:.1f} not"
                                        for n in ("DDP", "ZeRO-2")))
    log("(printed, not asserted: on a tiny model latency dominates); either way the parameters end bit-for-bit equal")
    finish(f"DDP == ZeRO-2 == one-process AdamW; each sends 2(W-1)/W x V a step (ZeRO-2 with M micro-batches: "
           f"(M+1)(W-1)/W x V); ZeRO-2 holds 1/{W} of grads + optimizer state")


if __name__ == "__main__":
    main()
