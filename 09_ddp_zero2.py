"""09 - data parallelism in buckets: DDP, ZeRO-2 and ZeRO-3, each a small step from the one before.

Every rank trains the same model on its own slice of the global batch; gradients are averaged over the ranks
before the optimizer step. DDP (PyTorch DDP) all-reduces them. ZeRO-2 (DeepSpeed stage 2) reduce-scatters them:
rank r keeps and steps its 1/W shard, then all-gathers the parameters. ZeRO-3 (DeepSpeed stage 3, PyTorch FSDP)
keeps only its shard of the parameters too: a bucket is gathered for the modules that use it, forward and backward.

All three communicate in buckets: the parameters, in the order backward produces their gradients, packed into
flat buffers padded to a multiple of W (one optimizer parameter group per bucket). A hook per parameter adds its
gradient into `p.main_grad`, its view of the bucket's gradient sum; a full bucket starts its collective (async)
while backward computes the rest. You keep your torch optimizer (DDP's docstring).

  one bucket, W=2: | a0 a1 a2 | b0 b1 pad |   rank 0 owns elements 0..2, rank 1 owns 3..5 (padding included)
                DDP                    ZeRO-2                             ZeRO-3
  parameters    all 6                  all 6                              its 3; all 6 only while a module that
                                                                          uses them runs forward or backward
  gradients     all 6, all-reduced     all 6 during backward; reduce-     as ZeRO-2
                                       scatter: it keeps the sum of its 3
  optimizer     state of all 6,        state of its 3, steps its 3, then  state of its 3, steps its 3
                steps all 6            all-gathers the 6 new parameters

Bytes held per rank, P parameters of B bytes each, AdamW (two moments), gradients of G = max(B, 4) bytes:
  DDP      parameters P*B + gradients P*G + state 2P*G
  ZeRO-2   parameters P*B + (gradients + state) / W, and during backward the full gradient of two buckets at most
  ZeRO-3   (parameters + gradients + state) / W, the same two gradient buckets, and the gathered buckets of the
           modules running (a tied weight's from its first use in forward to its last), plus one prefetched
bf16 parameters (B=2) add an fp32 master copy (4P/W) and keep gradients in fp32 (G=4), as Megatron's main_grad.
Bytes each rank sends per step, ring algorithms, V = bytes of the padded buffers (bf16 gathers move half), with M
micro-batches, no_sync() on all but the last (the gradients add up locally, full size, and reduce once):
  DDP      all-reduce                                      2(W-1)/W * V
  ZeRO-2   reduce-scatter + all-gather                     2(W-1)/W * V, the same
  ZeRO-3   all-gather per forward and per backward + reduce-scatter    (2M+1)(W-1)/W * V
(ZeRO-3's backward skips buckets it never reads: biases alone). Without no_sync each micro-batch reduces: DDP 2M,
ZeRO-2 M+1, ZeRO-3 3M, times (W-1)/W * V. NCCL runs rings; on gloo a reduce-scatter is an all-reduce (03).

    torchrun --nproc-per-node=4 09_ddp_zero2.py    (tests/check_09.py proves the rest; bench/09_dp.py: beside torch's)
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


# ---- building blocks (torch only) ---------------------------------------------------------------------
import contextlib
import functools

# torch 2.13 renamed these two collectives (the old names warn there); older torch has only the old names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bucket_runs(params, groups, cap_bytes):
    """[(group index, parameters)] of each bucket. params: in backward order; groups: lists of parameters. A bucket
    holds one group's parameters in backward order, closing after the one that brings its gradient to cap_bytes
    or more (or before a new dtype or device); buckets are ordered as backward completes them."""
    order, runs = {id(p): i for i, p in enumerate(params)}, []
    size = lambda p: p.numel() * torch.promote_types(p.dtype, torch.float32).itemsize  # its gradient's bytes
    for g, members in enumerate(groups):
        runs.append((g, []))
        for p in sorted(members, key=lambda p: order[id(p)]):
            run = runs[-1][1]
            if run and (sum(size(q) for q in run) >= cap_bytes or
                        (p.dtype, p.device) != (run[0].dtype, run[0].device)):
                runs.append((g, []))
            runs[-1][1].append(p)
    return sorted([run for run in runs if run[1]], key=lambda run: order[id(run[1][-1])])


class Bucket:
    """Parameters that communicate as one flat tensor of `numel` elements, padded so that W divides it.

    flat    their values: each parameter p is the view flat[p._dp_slice]  shard  rank r's [r*numel/W, (r+1)*numel/W)
    grad    this rank's gradient sum since the last reduction (fp32, or wider; p.main_grad is p's view), else None.
            Not zeroed: blank holds the slices not yet written (zeroed when read or reduced, or given p's first)
    local   what this rank steps, in the parameters' dtype: flat (DDP) or its shard (ZeRO)
    opt     the tensor the optimizer steps (its .grad: the reduced gradient): local, or an fp32 master copy of it
    work    the reduction in flight, or None;  ready: how many of its gradients this synced backward brought
    gathering  ZeRO: the all-gather of flat in flight, or None (its parameters point at `nan` until it lands)
    """

    def __init__(self, index, params, world, rank):
        self.index, self.params, self.used = index, params, sum(p.numel() for p in params)
        self.numel = -(-self.used // world) * world  # padded up to a multiple of W
        self.shard = slice(rank * self.numel // world, (rank + 1) * self.numel // world)
        self.flat = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
        start = 0
        for p in params:
            p._dp_bucket, p._dp_slice = self, slice(start, start + p.numel())
            self.flat[p._dp_slice].copy_(p.detach().flatten())
            p.data = self.flat[p._dp_slice].view_as(p)  # p stays the same nn.Parameter (its hooks, its optimizer)
            start += p.numel()
        self.grad, self.work, self.ready, self.gathering = None, None, 0, None
        self.nan = torch.full((1,), float("nan"), dtype=self.flat.dtype, device=self.flat.device)


class _WrappedParameter(nn.Parameter):
    """A wrapped module's parameter (the same object and data): `p.main_grad`, its view of the bucket's gradient
    sum (made on first use); `p.grad`, once the hook took autograd's: DDP's mean gradient, or one line why not."""

    @property
    def main_grad(self):
        return self._dp_owner._main_grad(self)

    @property
    def grad(self):
        own = torch.Tensor.grad.__get__(self)
        return own if own is not None else self._dp_owner._reduced_grad(self)

    @grad.setter
    def grad(self, value):
        torch.Tensor.grad.__set__(self, value)


class DDP(nn.Module):
    """Data parallelism in buckets: every rank holds everything; gradients are all-reduced bucket by bucket.

        optimizer = torch.optim.AdamW(module.parameters(), lr=...)  # yours, any parameter groups (nanoGPT's)
        model = DDP(module, optimizer, group=None, bucket_cap_mb=25, overlap=True)  # ZeRO2, ZeRO3 alike (README)
        for i, (x, y) in enumerate(micro_batches):
            model.require_backward_grad_sync = i == len(micro_batches) - 1   # or `with model.no_sync():`
            loss_fn(model(x), y).div(len(micro_batches)).backward()   # synced: reduced when it ends
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)         # DDP (ZeRO, bf16: model.clip_grad_norm_)
        optimizer.step(); optimizer.zero_grad(set_to_none=True)         # lr written into its param_groups: used
        model.state_dict(), model.load_state_dict(sd)        # the module's names, full values (ZeRO-3: collectives)
        optimizer.state_dict(), optimizer.load_state_dict(sd)   # this rank's state (ZeRO: its shard), fp32 masters in
    Your optimizer's groups are pointed at the flat tensors the wrapper steps, one per bucket (ZeRO: this rank's
    shard): elementwise optimizers (SGD, Adam, AdamW) are exact, per-tensor ones (LAMB) are not. Its step is
    hooked: unreduced gradients (no_sync) are refused; fp32 masters are rounded into bf16 parameters after it.
    Every rank starts from group rank 0's values. A parameter with no gradient in a bucket that got some steps
    with a zero gradient. A pipeline stage: backwards under no_sync(), then model.sync_gradients(). Megatron's
    main_grad handshake: a layer that sees p.grad_added_to_main_grad False may add dW into p.main_grad itself, set
    the flag True and return a placeholder, which the hook drops (it adds p.grad where whoever tied p to another
    op set p.zero_out_wgrad). overlap=False reduces only when backward ends: the same arithmetic.
    """
    sharded = False  # ZeRO: each rank keeps, and steps, only its shard of every bucket

    def __init__(self, module, optimizer, group=None, bucket_cap_mb=25, overlap=True, *, process_group=None,
                 device_ids=None, output_device=None, find_unused_parameters=False):
        super().__init__()
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # the order backward produces them in
        self._names = {id(p): n for n, p in module.named_parameters()}
        group = _torch_names(params, group, process_group, device_ids, output_device, find_unused_parameters)
        bucket_cap_mb = 25 if bucket_cap_mb is None else bucket_cap_mb  # (torch's default, None, is 25 MiB)
        _check_arguments(module, optimizer, params, self._names, bucket_cap_mb)
        self.module, self.group, self.overlap = module, group, overlap
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        _check_same_on_every_rank(module, group, self.world)
        runs = bucket_runs(params, [g["params"] for g in optimizer.param_groups], bucket_cap_mb * 2 ** 20)
        self.buckets = [Bucket(i, run, self.world, self.rank) for i, (_, run) in enumerate(runs)]
        source = dist.get_global_rank(group or dist.group.WORLD, 0)
        for t in [b.flat for b in self.buckets] + list(module.buffers()):
            dist.broadcast(t, source, group=group)  # every rank starts from group rank 0's values
        for b in self.buckets:
            b.local = self._local(b)
            wide = torch.promote_types(b.local.dtype, torch.float32)
            b.opt = b.local if b.local.dtype == wide else b.local.to(wide)  # bf16: an fp32 master copy
            for p in b.params:  # the hook holds nothing (a bound method: a cycle through p, which torch never frees)
                p.__class__, p._dp_owner, p.grad_added_to_main_grad = _WrappedParameter, self, False
                p.register_post_accumulate_grad_hook(lambda q: q._dp_owner._on_grad(q._dp_bucket, q))
        for g, options in enumerate(optimizer.param_groups):  # your optimizer now steps the buckets' tensors
            options["params"] = [b.opt for (h, _), b in zip(runs, self.buckets) if h == g]
        optimizer.register_step_pre_hook(lambda *_: self._unreduced("optimizer.step()"))
        optimizer.register_step_pre_hook(self._land)
        optimizer.register_step_post_hook(self._after_step)
        optimizer.register_state_dict_post_hook(self._save_extras)
        optimizer.register_load_state_dict_pre_hook(self._load_extras)
        self.require_backward_grad_sync, self._next, self._queued = True, 0, False  # (torch DDP's flag's name)

    def _local(self, b):
        return b.flat  # DDP: this rank steps the whole bucket

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)  # the module's names, unprefixed

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only add up this rank's gradients (torch DDP's no_sync)."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    # -- gradients: hooks fill the buckets, a full bucket starts reducing, the optimizer gets the mean ------------
    def _main_grad(self, p, first=None):
        """p's view of its bucket's gradient sum, zeroed when first read, or given `first` (adding it later)."""
        b = p._dp_bucket
        if b.grad is None:  # the first gradient since the last reduction: not zeroed, each slice is written first
            b.grad, b.blank = torch.empty(b.numel, dtype=b.opt.dtype, device=b.flat.device), {id(q) for q in b.params}
        view = b.grad[p._dp_slice].view(p.shape)
        if id(p) not in b.blank:
            return view if first is None else view.add_(first)
        b.blank.remove(id(p))
        return view.zero_() if first is None else view.copy_(first)

    def _on_grad(self, b, p):
        """p's post-accumulate-grad hook: p.grad joins b's sum; in a synced backward full buckets start reducing."""
        if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False):
            self._main_grad(p, p.grad)  # (else a fused layer added dW itself: p.grad is its placeholder, dropped)
        p.grad, p.grad_added_to_main_grad = None, False
        if self.require_backward_grad_sync:
            if not self._queued:  # when this backward ends: reduce the rest, wait for all (as torch's DDP does)
                torch.autograd.Variable._execution_engine.queue_callback(self.sync_gradients)
                self._queued = True
            b.ready += 1  # full buckets reduce in bucket order: every rank issues the same collectives
            while self.overlap and self._next < len(self.buckets) and \
                    self.buckets[self._next].ready == len(self.buckets[self._next].params):
                self._reduce(self.buckets[self._next])
                self._next += 1

    def _reduce(self, b):
        """Start summing b's gradient over the group (async), divided by W first (torch DDP's order): the mean."""
        b.work = dist.all_reduce(self._filled(b).div_(self.world), group=self.group, async_op=True)

    def _filled(self, b):
        """b.grad, its slices no gradient reached and its padding zeroed (a zero gradient for those)."""
        for q in (q for q in b.params if id(q) in b.blank):
            self._main_grad(q)
        b.grad[b.used:].zero_()
        return b.grad

    def _finish(self, b):
        """Wait for b's reduction and hand the group's mean gradient to the optimizer's tensor; the sum is dropped."""
        b.work.wait()
        mean = b.out.div_(self.world) if self.sharded else b.grad  # (ZeRO: this rank's shard of the sum)
        b.opt.grad = mean if b.opt.grad is None else b.opt.grad.add_(mean)  # added, as autograd adds into .grad
        b.grad = b.work = b.out = None

    def sync_gradients(self):
        """Reduce what the hooks have not (no_sync, overlap=False, parameters without gradient) and wait for all. It
        runs when a synced backward ends; call it after backwards that all ran under no_sync() (a pipeline)."""
        for b in self.buckets:
            if b.grad is not None and b.work is None:
                self._reduce(b)
        for b in self.buckets:
            if b.work is not None:
                self._finish(b)
            b.ready = 0
        self._next, self._queued = 0, False

    def _reduced_grad(self, p):
        """p.grad once the hook has taken autograd's: a view of DDP's averaged gradient; None before any."""
        b, name = p._dp_bucket, self._names[id(p)]
        if b.grad is not None:
            raise RuntimeError(f"{name}.grad: this rank's gradient is not reduced yet (no_sync(), or backward still "
                               f"running); its sum is in {name}.main_grad")
        if b.opt.grad is None:
            return None
        if b.opt is not b.local or self.sharded:
            kept = f"this rank's 1/{self.world} shard of" if self.sharded else "an fp32 copy beside the bf16"
            raise RuntimeError(f"{name}.grad: {type(self).__name__} keeps only {kept} the reduced gradient; clip with "
                               f"model.clip_grad_norm_(max_norm) (the global norm)")
        return b.opt.grad[p._dp_slice].view(p.shape)

    def _unreduced(self, caller):
        if any(b.grad is not None for b in self.buckets):
            raise RuntimeError(f"{caller}: this rank's gradients are not reduced (the last backward ran under "
                               f"no_sync()): run the last micro-batch synced, or call model.sync_gradients() first")

    def clip_grad_norm_(self, max_norm):
        """torch.nn.utils.clip_grad_norm_ over the whole model: the global 2-norm of the reduced gradients (ZeRO:
        the shards' squares summed by one all-reduce); scales them to at most max_norm; returns the norm before."""
        self._unreduced("model.clip_grad_norm_()")
        grads = [b.opt.grad for b in self.buckets if b.opt.grad is not None]
        total = sum((torch.linalg.vector_norm(g) ** 2 for g in grads),
                    torch.zeros((), dtype=self.buckets[0].opt.dtype, device=self.buckets[0].flat.device))
        if self.sharded:
            dist.all_reduce(total, group=self.group)
        total = total.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
        for g in grads:
            g.mul_(scale)
        return total

    def zero_grad(self, set_to_none=True):
        """Drop every gradient since the last step: this rank's sums and the reduced ones."""
        for b in self.buckets:
            b.grad = b.opt.grad = None

    # -- your optimizer's step, hooked --------------------------------------------------------------------------
    def _after_step(self, optimizer, args, kwargs):
        for b in self.buckets:
            if b.opt is not b.local:
                b.local.copy_(b.opt)  # the stepped fp32 master, rounded into the parameters' dtype

    # -- reading, writing and checkpoints ------------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self):
        """Every parameter full, readable and writable inside (ZeRO-3: a collective); writes reach the master."""
        self._land()
        try:
            yield
        finally:
            self._masters_follow()

    def _land(self, *_):
        for b in self.buckets:  # (ZeRO-2's gathers in flight)
            self._wait(b)

    def _wait(self, b):
        """b's all-gather in flight (ZeRO) lands: its parameters are views of the gathered values again."""
        if b.gathering is not None:
            b.gathering.wait()
            b.gathering = None
            for p in b.params:
                p.data = b.flat[p._dp_slice].view(p.shape)

    def _masters_follow(self):
        for b in self.buckets:  # a master that no longer rounds to its parameters takes their (written) values
            if b.opt is not b.local and not torch.equal(b.opt.to(b.local.dtype), b.local):
                b.opt.copy_(b.local)

    def state_dict(self, *args, **kwargs):
        """The module's state_dict: its own names, every value full (DDP, ZeRO-2: the tensors themselves)."""
        return self.module.state_dict(*args, **kwargs)  # (ZeRO-2: its pre-hook lands the gathers)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """A full state_dict (the module's names, any world size, buffers too), the same on every rank of the group.
        Refused in one line before anything loads: keys missing or unexpected (strict=True), a shape or dtype."""
        want = self.module.state_dict(keep_vars=True)
        missing, unexpected = [k for k in want if k not in state_dict], [k for k in state_dict if k not in want]
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} (strict=True)")
        for k, got, mine in ((k, state_dict[k], v) for k, v in want.items() if k in state_dict):
            if isinstance(got, torch.Tensor) and (got.shape, got.dtype) != (mine.shape, mine.dtype):
                raise ValueError(f"load_state_dict: {k} is {got.dtype} {list(got.shape)} in the state_dict, "
                                 f"{mine.dtype} {list(mine.shape)} in the model")
        with torch.no_grad(), self.gathered():
            self.module.load_state_dict(state_dict, strict=False)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _layout(self):
        return dict(wrapper=type(self).__name__, world=self.world, rank=self.rank if self.sharded else None,
                    buckets=[b.numel for b in self.buckets], dtypes=sorted({str(b.local.dtype) for b in self.buckets}))

    def _save_extras(self, optimizer, state):  # optimizer.state_dict()'s post-hook: what a resume needs besides
        state["dp_layout"] = self._layout()
        state["dp_masters"] = [b.opt for b in self.buckets if b.opt is not b.local]
        return state

    def _load_extras(self, optimizer, state):  # optimizer.load_state_dict()'s pre-hook
        saved, mine = state.get("dp_layout") or {}, self._layout()  # (a plain torch state: wrapper=None)
        if saved != mine:
            key = next(k for k in mine if saved.get(k) != mine[k])
            raise ValueError(f"optimizer.load_state_dict: saved with {key}={saved.get(key)}, loaded with {key}="
                             f"{mine[key]}: each rank loads the state it saved, with the same world size, wrapper, "
                             f"model, dtype and bucket_cap_mb (the model's state_dict loads at any world size)")
        for b, master in zip([b for b in self.buckets if b.opt is not b.local], state["dp_masters"]):
            b.opt.copy_(master)
        return {k: v for k, v in state.items() if not k.startswith("dp_")}


def _check_arguments(module, optimizer, params, names, bucket_cap_mb):
    """The one-line refusals of DDP(...), before any collective."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer is a {type(optimizer).__name__}: give the torch.optim optimizer you step, "
                         f"built over the module's parameters")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r}: give the MiB of gradients per bucket, a number > 0")
    if not params:
        raise ValueError(f"{type(module).__name__} has no trainable parameters to keep in sync")
    for p in (p for p in params if type(p) is not nn.Parameter):
        raise ValueError(f"{names[id(p)]} is a {type(p).__name__}, not a plain nn.Parameter (wrapped already?)")
    if optimizer.state:
        raise ValueError("the optimizer holds state already: wrap the module first, then optimizer.load_state_dict()")
    grouped = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    for i in (i for k, i in grouped.items() if k not in {id(p) for p in params}):
        raise ValueError(f"optimizer.param_groups[{i}] holds a tensor that is not a trainable parameter of the module")
    missing = [names[id(p)] for p in params if id(p) not in grouped]
    if missing:
        raise ValueError(f"{missing[0]} is in no parameter group of the optimizer: give it every trainable parameter")


def _torch_names(params, group, process_group, device_ids, output_device, find_unused_parameters):
    """torch DDP's names for ours: process_group is group; device_ids=[i] and output_device=i name the module's
    device (not moved). Those ours cannot honour are refused."""
    device = params[0].device if params else torch.device("cpu")
    mine = lambda d: any(type(d) is type(x) and d == x for x in (device, str(device), device.index) if x is not None)
    if group is not None and process_group is not None:
        raise ValueError("group= and process_group= both given: they name the same group; give one")
    if device_ids is not None and not (isinstance(device_ids, (list, tuple)) and len(device_ids) == 1
                                       and mine(device_ids[0])):
        raise ValueError(f"device_ids={device_ids!r}: the module's parameters are on {device}; move the module "
                         f"to the device first and give [its index] (torch's [local_rank]), or leave it out (CPU)")
    if output_device is not None and not mine(output_device):
        raise ValueError(f"output_device={output_device!r}: the output stays on the module's device ({device})")
    if find_unused_parameters is not False:
        raise ValueError(f"find_unused_parameters={find_unused_parameters!r} is not honoured: every rank's backward "
                         f"must reach the same parameters (set requires_grad=False on those forward never uses)")
    return process_group if group is None else group


def _check_same_on_every_rank(module, group, world):
    """Refuse, on every rank in one line, a module whose names, shapes or dtypes differ across ranks (as torch DDP)."""
    mine = [(n, list(t.shape), str(t.dtype)) for n, t in (*module.named_parameters(), *module.named_buffers())]
    every = [None] * world
    dist.all_gather_object(every, mine, group=group)
    for r, theirs in enumerate(every):
        if theirs != every[0]:
            a, b = next(((a, b) for a, b in zip(every[0], theirs) if a != b), (len(every[0]), len(theirs)))
            raise ValueError(f"the module differs across ranks: group rank 0 has {a}, group rank {r} has {b}; "
                             f"build the same model on every rank")


class ZeRO2(DDP):
    """DDP whose gradients are reduce-scattered: rank r keeps and steps only its shard of each bucket (gradient,
    optimizer state, fp32 master), then all-gathers the new parameters: optimizer.step() starts them, the next
    forward overlaps them (DeepSpeed's overlap_comm), each module's forward pre-hook waits for its buckets. In
    flight, parameters point at one NaN; state_dict(), gathered() and the next step wait for all (README)."""
    sharded = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._users = []  # (module, the buckets it reads): a module owning parameters may read its children's too
        for m in self.module.modules():  # (nn.MultiheadAttention)
            owned = {id(p) for p in m.parameters()} if next(m.parameters(recurse=False), None) is not None else ()
            needs = [b for b in self.buckets[::-1] if any(id(p) in owned for p in b.params)]  # in forward order
            if needs:
                m.register_forward_pre_hook(functools.partial(self._before_forward, needs))
                self._users.append((m, needs))
        self.module.register_state_dict_pre_hook(self._land)

    def _before_forward(self, needs, module, args):
        for b in needs:
            self._wait(b)

    def _start_gather(self, b):
        """All-gather b's values from every rank's shard (async); its parameters point at one NaN until it lands."""
        for p in b.params:
            p.data = b.nan.expand(p.shape)
        b.gathering = all_gather_single(b.flat, b.local, group=self.group, async_op=True)

    def _local(self, b):
        return b.flat[b.shard]  # this rank steps its shard of the parameters, in place

    def _reduce(self, b):
        b.out = torch.empty_like(b.opt)  # this rank's shard of the sum
        b.work = reduce_scatter_single(b.out, self._filled(b), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        for other in self.buckets:  # the full-size gradient of two buckets at most: finish the one before
            if other is not b and other.work is not None:
                self._finish(other)

    def _after_step(self, *args):
        super()._after_step(*args)
        for b in self.buckets[::-1]:  # every rank's new shard to every rank, in forward order
            self._start_gather(b)


class ZeRO3(ZeRO2):
    """ZeRO-2 that also keeps only its shard of the parameters. A bucket is gathered (all-gather) before the
    modules that use it run forward, freed after the last of them, gathered again when backward reads its values
    (autograd's saved-tensor hooks say when), and freed once all its gradients are in; the bucket used next is
    prefetched beside it. A freed parameter points at one NaN: read it through model.state_dict() or inside `with
    model.gathered():` (README). A tied weight is one Parameter in both modules (nanoGPT's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for b in self.buckets:  # modules that use b; those that ran this forward; gradients in; done this forward;
            b.users, b.ran, b.arrived, b.done, b.pending = 0, 0, 0, False, False  # saved for a backward not yet run
            self._free(b)
        for m, needs in self._users:
            m.register_forward_hook(functools.partial(self._after_forward, needs), always_call=True)
            for b in needs:
                b.users += 1
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._seq, self._prev = {"f": [], "b": []}, {"f": [], "b": []}  # buckets in order of first use: this pass, last
        self.module.register_forward_pre_hook(self._start_forward)
        self.module.register_forward_hook(self._end_forward, always_call=True)
        self.module.register_state_dict_pre_hook(self._refuse_raw_read)

    def _local(self, b):
        return b.flat[b.shard].clone()  # this rank's parameters: the shard is all it keeps

    def _gathered(self, b):
        return b.flat.untyped_storage().nbytes() > 0

    def _start_gather(self, b):
        if not self._gathered(b):  # (else gathered, or on its way)
            b.flat.untyped_storage().resize_(b.numel * b.flat.element_size())
            super()._start_gather(b)

    def _use(self, b, phase, fits):
        """b gathered now. If this forward or backward (phase) uses b first, the bucket the last one used first
        next starts gathering, if it `fits` (FSDP2's prefetch: one bucket ahead, its all-gather beside b's use)."""
        self._start_gather(b)
        self._wait(b)
        seq, prev = self._seq[phase], self._prev[phase]
        if b.index not in seq:
            seq.append(b.index)
            if self.overlap and len(seq) < len(prev) and fits(self.buckets[prev[len(seq)]]):
                self._start_gather(self.buckets[prev[len(seq)]])

    def _new_pass(self, phase):
        self._prev[phase], self._seq[phase] = self._seq[phase] or self._prev[phase], []

    def _free(self, b):
        """b's full values are dropped (what autograd saved of them too: the storage shrinks to 0 bytes)."""
        self._wait(b)  # (a prefetch in flight lands first)
        b.flat.untyped_storage().resize_(0)
        for p in b.params:
            p.data = b.nan.expand(p.shape)

    # -- forward: gather before a module, free after the last module using the bucket -----------------------------
    def _start_forward(self, *_):
        self._saving.__enter__()
        self._new_pass("f")

    def _before_forward(self, needs, module, args):
        self._saving.__enter__()  # (the module's own too: run alone, as a pipeline's W may run it again)
        for b in needs:
            self._use(b, "f", lambda c: not c.done)  # (prefetch one this forward will use)

    def _after_forward(self, needs, module, args, out):
        self._saving.__exit__(None, None, None)
        for b in needs:
            b.ran += 1
            if b.ran == b.users:  # every module that uses b has run (a tied weight's: both)
                b.ran, b.done = 0, True
                self._free(b)

    def _end_forward(self, module, args, out):
        self._saving.__exit__(None, None, None)
        self._new_pass("b")
        for b in self.buckets:  # (a module that did not run leaves its buckets' count short)
            b.ran, b.done = 0, False
            self._free(b)

    # -- backward: autograd's saved tensors say which buckets it reads; free a bucket once its gradients are in --
    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if any(ptr == b.nan.untyped_storage().data_ptr() for b in self.buckets):
            raise RuntimeError("ZeRO3: a parameter was used in forward after the modules that own it ran (freed); "
                               "assign the Parameter to the module that uses it too (lm_head.weight = wte.weight)")
        b = next((b for b in self.buckets if self._gathered(b) and ptr == b.flat.untyped_storage().data_ptr()), None)
        if b is not None:
            b.pending = True
        return b, t.detach()  # t's bucket, if t is (a view of) parameters

    def _unpack(self, saved):
        b, t = saved
        if b is not None:
            self._use(b, "b", lambda c: c.pending)  # backward reads b's values: gathered again
        return t

    def _on_grad(self, b, p):
        super()._on_grad(b, p)
        b.arrived += 1
        if b.arrived == len(b.params):  # every gradient of b is in: backward is done with its values
            b.arrived, b.pending = 0, False
            self._free(b)

    # -- the step, reading, checkpoints ----------------------------------------------------------------------
    def _after_step(self, *args):
        DDP._after_step(self, *args)  # not ZeRO-2's all-gather: each bucket is gathered where it is next used
        for b in self.buckets:  # (one gathered by a backward that left a parameter without gradient)
            b.arrived, b.pending = 0, False
            self._free(b)

    @contextlib.contextmanager
    def gathered(self):
        for b in self.buckets:  # every rank's shards to every rank (a collective)
            self._start_gather(b)
            self._wait(b)
        try:
            yield
        finally:
            for b in self.buckets:
                b.local.copy_(b.flat[b.shard])  # what was written inside is kept (every rank wrote the same)
                self._free(b)
            self._masters_follow()

    def state_dict(self, *args, **kwargs):
        """Every rank of the group gathers (call it on all of them) and gets the full copy: save it on one."""
        with self.gathered():
            state = super().state_dict(*args, **kwargs)
            for k, v in state.items():
                state[k] = v.detach().clone()
        return state

    def _refuse_raw_read(self, module, prefix, keep_vars):
        if not keep_vars and not all(self._gathered(b) for b in self.buckets):
            raise RuntimeError("the wrapped module's own state_dict() under ZeRO3 holds no values: call "
                               "model.state_dict() on every rank (it gathers them), then save it on one")


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
try:
    from common import finish, head, log, ring_bytes, setup, traffic
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

VOCAB, HIDDEN, ROWS, CAP = 11, 8, 4, 70 * 8 / 2 ** 20  # model; rows per rank and micro-batch; 70 float64 gradients
STEPS = 3


class TiedLM(nn.Module):
    """Embedding -> 2 tanh layers -> output layer whose weight IS the embedding's (tied, as in GPT-2)."""

    def __init__(self):
        super().__init__()
        self.emb, self.l1, self.l2 = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(self.emb(ids))))))


def make(device, cls=None, group=None, seed=0):
    """TiedLM (88 tied + 72 + 72 + 11 parameters) and nanoGPT's AdamW groups (no decay on biases), in cls."""
    torch.manual_seed(seed)
    net = TiedLM().to(device, torch.float64)
    optimizer = torch.optim.AdamW([{"params": [p for p in net.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in net.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=0.02, betas=(0.9, 0.95))
    return (cls(net, optimizer, group, bucket_cap_mb=CAP) if cls else net), optimizer


def batch(step, W, device):
    """Every rank's tokens and targets at this step: [2 micro-batches, ROWS rows of rank 0, of rank 1, ...]."""
    g = torch.Generator().manual_seed(step)
    return [torch.randint(VOCAB, (2, ROWS * W), generator=g).to(device) for _ in ("ids", "targets")]


def train_step(model, optimizer, ids, tgt, step):
    """nanoGPT's train.py: lr into the groups, 2 micro-batches (the first without sync), clip at 0.3, step."""
    for g in optimizer.param_groups:
        g["lr"] = 0.02 * (step + 1) / STEPS
    for i in range(2):
        model.require_backward_grad_sync = i == 1  # (the one-process reference has no use for it)
        F.cross_entropy(model(ids[i]), tgt[i]).div(2).backward()
    plain = type(model) in (DDP, TiedLM)  # torch's clip where p.grad is the whole averaged gradient
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3) if plain else model.clip_grad_norm_(0.3)
    optimizer.step()
    return norm


def main():
    rank, W, device = setup()
    me = slice(rank * ROWS, (rank + 1) * ROWS)
    head(f"1. Buckets: parameters in backward order, padded to a multiple of W={W}; rank 0's values everywhere")
    model, _ = make(device, DDP, seed=rank)  # every rank but 0 builds other values: rank 0's are broadcast
    names = {id(p): n for n, p in model.named_parameters()}
    for b in model.buckets:
        log(f"bucket {b.index}: {' '.join(names[id(p)] for p in b.params)}: "
            f"{sum(p.numel() for p in b.params)} -> {b.numel} elements")
    assert all(torch.equal(v, make(device)[0].state_dict()[k]) for k, v in model.state_dict().items())
    log("every rank holds rank 0's values (each built its own from seed=rank); head.weight is emb.weight, one copy")

    head(f"2. DDP, ZeRO-2, ZeRO-3 == one process: {STEPS} steps of nanoGPT's train.py loop, float64")
    ref, ref_opt = make(device)
    models = {cls: make(device, cls) for cls in (DDP, ZeRO2, ZeRO3)}
    V = sum(b.numel for b in models[DDP][0].buckets) * 8
    read = sum(b.numel * 8 for b in models[DDP][0].buckets if any(p.dim() > 1 for p in b.params))  # not biases
    for step in range(STEPS):
        ids, tgt = batch(step, W, device)
        want = train_step(ref, ref_opt, ids, tgt, step)
        ref_opt.zero_grad(set_to_none=True)
        for cls, (model, optimizer) in models.items():
            with traffic() as t:
                norm = train_step(model, optimizer, ids[:, me], tgt[:, me], step)
            torch.testing.assert_close(norm, want, rtol=1e-12, atol=0)  # (the clip scales: check_09)
            if step == STEPS - 1:
                nbytes = lambda ts: sum({s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in ts)}.values())
                held = dict(parameters=nbytes([x for b in model.buckets for x in (b.flat, b.local)]),
                            gradients=nbytes([b.opt.grad for b in model.buckets]),
                            state=nbytes([x for s in optimizer.state.values() for x in s.values() if x.dim()]))
                assert held == {DDP: dict(parameters=V, gradients=V, state=2 * V),
                                ZeRO2: dict(parameters=V, gradients=V // W, state=2 * V // W),
                                ZeRO3: dict(parameters=V // W, gradients=V // W, state=2 * V // W)}[cls], held
                log(f"{cls.__name__:5} holds " + ", ".join(f"{k} {v} B" for k, v in held.items()))
            optimizer.zero_grad(set_to_none=True)
            sent = sum(ring_bytes(op, n * W if op == "all_gather" else n, W) for op, _, n in t.calls)
            closed = (0 if cls is DDP else ring_bytes("all_reduce", 8, W)) + (W - 1) / W * \
                {DDP: 2 * V, ZeRO2: 2 * V, ZeRO3: 2 * V + 2 * read + V}[cls]
            assert abs(sent - closed) < 1e-9, (cls.__name__, t.calls)
            for k, v in model.state_dict().items():
                torch.testing.assert_close(v, ref.state_dict()[k], rtol=1e-12, atol=1e-14)
    log(f"every parameter == torch.optim.AdamW in one process on all {2 * ROWS * W} rows a step (rtol 1e-12); "
        f"the clip's global norm too")
    log(f"bytes sent a step, x (W-1)/W: DDP 2V, ZeRO-2 2V, ZeRO-3 (2M+1)V less M x the bias bucket backward never "
        f"reads (M=2, V={V} B), + ZeRO's 8-B norm")

    finish("DDP == ZeRO-2 == ZeRO-3 == one process; 2, 2, 2M+1 x (W-1)/W x V a step; bytes held")


if __name__ == "__main__":
    main()
