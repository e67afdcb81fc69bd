"""What this proves beyond 09's lesson, for DDP, ZeRO-2 and ZeRO-3 (float64 unless said):
- nanoGPT's GPT (tied head) under train.py's loop (2 micro-batches, require_backward_grad_sync and no_sync, lr
  written into param_groups, torch's clip_grad_norm_ / model.clip_grad_norm_, zero_grad(set_to_none=True)) ==
  torch's DistributedDataParallel and one process; the first micro-batch sends nothing;
- buckets: boundaries == the prefix-sum rule at many caps (bf16: 4-B fp32 gradients), padding, views, rank 0's
  values broadcast;
- four ways to run a step (1 micro-batch; no_sync; a pipeline's forwards first, then autograd.backward under
  no_sync and sync_gradients(); every micro-batch reducing) == one process, on the world and on strided
  sub-groups, with AdamW groups and SGD; every collective counted against the closed forms, each synced backward
  starting each bucket's reduction once; overlap: a reduction runs before backward's last gradient, and not
  with overlap=False (bit-equal);
- bytes held == the closed forms; a dropped wrapper frees its model; a step keeps 0 B; ZeRO's full-size gradients
  two adjacent buckets at most; ZeRO-2's all-gathers in flight after a step (NaN), started in forward order, landed
  by forward (== one process); ZeRO-3's gathered parameters at most the running modules' buckets and one prefetched
  (without prefetch: not that one), 0 B before the first forward, a module run twice or skipped freed, a layer run
  alone gathered again by its backward, a zero-size saved tensor not mistaken for a freed bucket;
- bf16: fp32 masters and gradients, gathers in bf16, within 2^-6 of one process; gathered() writes reach the
  master; resume from optimizer.state_dict() bit-equal (the masters ride in it);
- Megatron's main_grad handshake (fused, tied zero_out_wgrad) with no_sync and with every micro-batch reducing;
- ZeRO-3: freed after forward and backward, NaN outside, the raw state_dict refused, a use outside the owning
  module refused, a layer without gradient stepped with zeros, nn.MultiheadAttention (a parent reading its child);
- every wrapper state: step twice without backward (nothing read between: the step lands ZeRO-2's gathers),
  p.grad under no_sync / overlap=False / after sync, step and clip after no_sync refused, sync_gradients() then
  step; 08's ZB-H1 weight gradients (a stand-in);
- torch DDP's names accepted where they mean ours (device_ids=[the module's device], output_device, process_group,
  bucket_cap_mb=None, find_unused_parameters=False), the rest refused;
- refusals at their boundaries, one line on every rank: arguments, optimizer groups, modules differing across
  ranks, load_state_dict (keys, shape, dtype; buffers load), optimizer state (wrapper, world, rank, dtype, buckets);
- checkpoints on the world and on sub-groups; CKPT=DIR CKPT_PHASE=save|load splits them over two launches.
"""
import contextlib
import copy
import gc
import math
import os
import sys
import time
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, log, refuse, ring_bytes, setup, traffic  # noqa: E402
from tests.nanogpt import GPT, GPTConfig, get_lr  # noqa: E402
from tests.tools import held_bytes, lesson, memory, refused, strided_groups  # noqa: E402

m = lesson("09_ddp_zero2.py")
DDP, ZeRO2, ZeRO3 = m.DDP, m.ZeRO2, m.ZeRO3
CLASSES = (DDP, ZeRO2, ZeRO3)
F64, BF16 = torch.float64, torch.bfloat16
VOCAB, HIDDEN, ROWS = m.VOCAB, m.HIDDEN, 4
HYPER = dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8)


def mb(numel, itemsize=8):
    """bucket_cap_mb for `numel` gradients of itemsize bytes."""
    return numel * itemsize / 2 ** 20


BUCKET = mb(70)


def tied_lm(device, dtype=F64, seed=0):
    torch.manual_seed(seed)
    return m.TiedLM().to(device, dtype)


def decay_groups(module, wd=0.1):
    """nanoGPT's configure_optimizers: decay on matrices and embeddings, none (and another lr) on biases."""
    return [{"params": [p for p in module.parameters() if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 0.01}]


def adamw(module):
    return torch.optim.AdamW(decay_groups(module), **HYPER)


def sgd(module):
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)


def wrap(cls, net, opt_fn=adamw, group=None, cap=BUCKET, **kw):
    optimizer = opt_fn(net)
    return cls(net, optimizer, group, bucket_cap_mb=cap, **kw), optimizer


def rank_batch(step, r, device):
    """Global rank r's ROWS tokens and targets at this step (every id, 0 and VOCAB-1 included, over the ranks);
    the ids come as a strided, non-contiguous view."""
    g = torch.Generator().manual_seed(1000 * step + r)
    ids = torch.randint(VOCAB, (ROWS, 2), generator=g)
    ids[0, 0], ids[-1, 0] = 0, VOCAB - 1
    return ids.to(device)[:, 0], torch.randint(VOCAB, (ROWS,), generator=g).to(device)


def close(got, want, what, rtol=1e-12, atol=1e-14):
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=rtol, atol=atol, msg=lambda s: f"{what} {k}: {s}")


def params_of(model):
    return {k: v for k, v in model.state_dict().items()}


def one_line(call, error=ValueError, starts=None):
    said = refused(call, error)
    assert starts is None or said.startswith(starts), (said, starts)
    return said


def storage_bytes(tensors):
    return held_bytes(t for t in tensors if t is not None)


# ---- 1. nanoGPT's train.py loop, against torch's DDP and one process --------------------------------------
def nanogpt_loop(rank, W, device):
    head("1. nanoGPT's GPT under train.py's loop == torch's DistributedDataParallel == one process")
    from torch.nn.parallel import DistributedDataParallel
    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    base = GPT(cfg).to(device, F64)
    B, T, STEPS = 2, 8, 3            # per rank and micro-batch
    g = torch.Generator().manual_seed(5)
    data = torch.randint(cfg.vocab_size, (STEPS, 2, W * B, T + 1), generator=g).to(device)

    def run(model, raw, optimizer, rows, clip, flag):
        """train.py: lr into param_groups; micro-batches, the last synced (the flag, or no_sync); clip; step;
        zero_grad(set_to_none=True). Returns the traffic of each micro-batch's backward."""
        seen = []
        for it in range(STEPS):
            for group in optimizer.param_groups:
                group["lr"] = get_lr(it)
            for micro in range(2):
                X, Y = data[it, micro, rows, :T].contiguous(), data[it, micro, rows, 1:].contiguous()
                last = micro == 1
                with traffic() as t:
                    if flag:
                        model.require_backward_grad_sync = last
                        ctx = contextlib.nullcontext()
                    else:
                        ctx = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
                    with ctx:
                        _, loss = model(X, Y)
                        (loss / 2).backward()
                seen.append(t.counts.copy())
            clip()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return seen

    mine = slice(rank * B, (rank + 1) * B)
    ref = copy.deepcopy(base)
    ref_opt = ref.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    run(ref, ref, ref_opt, slice(None), lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0), False)
    torch_net = copy.deepcopy(base)
    torch_opt = torch_net.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    torch_ddp = DistributedDataParallel(torch_net)
    run(torch_ddp, torch_net, torch_opt, mine, lambda: torch.nn.utils.clip_grad_norm_(torch_ddp.parameters(), 1.0),
        True)
    want_ref, want_torch = ref.state_dict(), torch_net.state_dict()
    for cls in CLASSES:
        for flag in (True, False):
            net = copy.deepcopy(base)
            optimizer = net.configure_optimizers(0.1, 6e-4, (0.9, 0.95))  # before wrapping, as train.py
            model = cls(net, optimizer)                                      # bucket_cap_mb: torch's 25
            clip = ((lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) if cls is DDP else
                    (lambda: model.clip_grad_norm_(1.0)))
            seen = run(model, net, optimizer, mine, clip, flag)
            reductions = [c["all_reduce"] + c["reduce_scatter"] for c in seen]
            assert all(r == 0 for r in reductions[0::2]), (cls.__name__, flag, seen)  # micro-batch 1: no reduction
            assert all(r == len(model.buckets) for r in reductions[1::2]), (cls.__name__, seen)
            got = model.state_dict()
            assert list(got) == list(want_ref)
            close(got, want_torch, f"{cls.__name__} vs torch DDP", rtol=1e-12, atol=1e-13)
            close(got, want_ref, f"{cls.__name__} vs one process", rtol=1e-12, atol=1e-13)
            assert len(optimizer.state_dict()["state"]) == len(model.buckets)  # the user's optimizer stepped them
    log(f"{STEPS} steps, 2 micro-batches (require_backward_grad_sync, then no_sync), get_lr into param_groups, clip "
        f"1.0, zero_grad(set_to_none=True):")
    log("DDP, ZeRO-2, ZeRO-3 (bucket_cap_mb 25) == torch DDP == one process within 1e-12; micro-batch 1 reduces "
        "nothing")


# ---- 2. buckets -----------------------------------------------------------------------------------------------
def buckets(rank, W, device):
    head(f"2. Buckets: the prefix-sum rule, padding to W={W}, views of the flat buffer, rank 0's values")
    import bisect
    import itertools
    model, _ = wrap(DDP, tied_lm(device, seed=rank), opt_fn=lambda n: torch.optim.SGD(n.parameters(), lr=0.1))
    base = tied_lm(device)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(b.numel % W == 0 and 0 <= b.numel - sum(p.numel() for p in b.params) < W for b in model.buckets)
    assert W == 1 or any(b.numel > sum(p.numel() for p in b.params) for b in model.buckets), "some padding"
    for b in model.buckets:
        assert all(p.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr() for p in b.params)
    close(model.state_dict(), base.state_dict(), "broadcast", rtol=0, atol=0)
    bn = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(device, F64)
    bn[1].running_mean.fill_(rank)  # a buffer that differs across ranks: group rank 0's too
    DDP(bn, torch.optim.SGD(bn.parameters(), lr=0.1))
    assert not bn[1].running_mean.any()
    assert model.module.head.weight is model.module.emb.weight and "head.weight" in model.state_dict()
    assert [[names[id(p)] for p in b.params] for b in model.buckets] == \
        [["head.bias", "l2.bias", "l2.weight"], ["l1.bias", "l1.weight"], ["emb.weight"]], \
        [[names[id(p)] for p in b.params] for b in model.buckets]
    params = [p for b in model.buckets for p in b.params]
    sizes = [p.numel() * 8 for p in params]
    prefix = list(itertools.accumulate(sizes))
    low = [nn.Parameter(torch.zeros(p.shape, dtype=BF16, device=device)) for p in params]
    for n in (1, 19, 70, 82, 83, 84, 100, 10 ** 6):
        ends, done = [], 0
        while done < len(sizes):
            done = min(bisect.bisect_left(prefix, (prefix[done - 1] if done else 0) + 8 * n), len(sizes) - 1) + 1
            ends.append(done)
        got = m.bucket_runs(params, [params], 8 * n)
        assert list(itertools.accumulate(len(run) for _, run in got)) == ends, (n, ends)
        got = m.bucket_runs(low, [low], 4 * n)  # bf16 parameters: their fp32 gradients count, 4 B each
        assert list(itertools.accumulate(len(run) for _, run in got)) == ends, (n, ends, "bf16")
    first = lambda n: [names[id(p)] for p in m.bucket_runs(params, [params], 8 * n)[0][1]]
    assert first(83) == ["head.bias", "l2.bias", "l2.weight"] and first(84)[-1] == "l1.bias"
    bf = m.bucket_runs([nn.Parameter(torch.zeros(10, dtype=BF16))] * 1, [[]], 1)
    assert bf == []
    log("boundaries == the prefix-sum rule at caps of 1, 19, 70, 82, 83, 84, 100, 1e6 gradients (bf16: fp32 ones); "
        "padding < W; views; every rank holds group rank 0's values")


# ---- 3. four ways to run a step, counted ------------------------------------------------------------------------
MODES = {"1 micro-batch": (1, 1), "2, no_sync() on the first": (2, 1),
         "2 forwards, then autograd.backward(out, grad) x2 under no_sync, sync_gradients(), clip": (2, 1),
         "2, no no_sync: each backward reduces": (2, 2)}


def forward_backward(model, mode, ids, tgt, after_each=lambda: None):
    M, R = MODES[mode]
    loss_of = lambda out, t: F.cross_entropy(out, t) / M
    if M == 1:
        loss_of(model(ids), tgt).backward()
    elif mode.startswith("2 forwards"):  # a pipeline stage: forwards first, backwards later, all under no_sync
        outs = [model(i) for i in ids.chunk(M)]
        with model.no_sync():
            for out, t in zip(outs, tgt.chunk(M)):
                o = out.detach().requires_grad_()
                torch.autograd.backward(out, torch.autograd.grad(loss_of(o, t), o)[0])
        model.sync_gradients()
    else:
        for i, (xm, tm) in enumerate(zip(ids.chunk(M), tgt.chunk(M))):
            with model.no_sync() if R == 1 and i < M - 1 else contextlib.nullcontext():
                loss_of(model(xm), tm).backward()
            after_each()


def train_and_compare(cls, opt_fn, group, ranks, device, base):
    """cls over `group` (global ranks `ranks`), one step per mode, against one process on all their data with the
    same torch optimizer; every collective counted; each synced backward starts each bucket's reduction once."""
    W = len(ranks)
    model, optimizer = wrap(cls, copy.deepcopy(base), opt_fn, group)
    ref = copy.deepcopy(base)
    opt = opt_fn(ref)
    where = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}  # the groups, by the twin
    twin = {id(p): id(q) for p, q in zip(model.module.parameters(), ref.parameters())}
    assert all(len({where[twin[id(p)]] for p in b.params}) == 1 for b in model.buckets)  # one group a bucket
    assert [len(g["params"]) for g in optimizer.param_groups] == \
        [sum(where[twin[id(b.params[0])]] == i for b in model.buckets) for i in range(len(opt.param_groups))]
    V = sum(b.numel for b in model.buckets) * 8
    read = sum(b.numel * 8 for b in model.buckets if any(p.dim() > 1 for p in b.params))  # backward reads
    started, per_backward = [], []
    reduce = model._reduce
    model._reduce = lambda b: started.append(b.index) or reduce(b)
    nb, names = len(model.buckets), {id(p): n for n, p in model.named_parameters()}
    for step, mode in enumerate(MODES):
        M, R = MODES[mode]
        batches = [rank_batch(step, r, device) for r in ranks]
        me = batches[dist.get_rank(group)]
        opt.zero_grad()
        F.cross_entropy(ref(torch.cat([i for i, _ in batches])), torch.cat([t for _, t in batches])).backward()
        started.clear(), per_backward.clear()
        with traffic() as t:
            forward_backward(model, mode, *me, after_each=lambda: per_backward.append(sorted(started)) or
                             started.clear())
        if mode.startswith("2,"):  # no_sync on the first: nothing; synced backwards: every bucket once, each
            assert per_backward == [[] if R == 1 else list(range(nb)), list(range(nb))], (mode, per_backward)
        grads = {n: p.grad for n, p in ref.named_parameters()}
        for b in model.buckets:  # what the optimizer is handed: the mean gradient (ZeRO: this rank's shard)
            full = F.pad(torch.cat([grads[names[id(p)]].flatten() for p in b.params]),
                         (0, b.numel - sum(p.numel() for p in b.params)))
            torch.testing.assert_close(b.opt.grad, full[b.shard] if cls.sharded else full, rtol=1e-10, atol=1e-13)
        if mode.startswith("2 forwards"):
            with traffic() as tc:
                norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3) if cls is DDP else
                        model.clip_grad_norm_(0.3))
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
            torch.testing.assert_close(norm, want, rtol=1e-12, atol=0)
            assert want > 0.3 and tc.calls == ([] if cls is DDP else [("all_reduce", tuple(ranks), 8)]), tc.calls
            torch.testing.assert_close(model.clip_grad_norm_(1e6), torch.nn.utils.clip_grad_norm_(ref.parameters(),
                                                                                                 1e6), rtol=1e-12, atol=0)
        opt.step()
        with traffic() as ts:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        calls = t.calls + ts.calls
        counts = [name for name, _, _ in calls]
        assert all(r == tuple(ranks) for _, r, _ in calls), f"{cls.__name__}: a collective left the group"
        assert counts.count("all_reduce") == (R * nb if cls is DDP else 0), counts
        assert counts.count("reduce_scatter") == (0 if cls is DDP else R * nb), counts
        gathers = {DDP: 0, ZeRO2: nb, ZeRO3: M * nb + M * sum(any(p.dim() > 1 for p in b.params)
                                                                for b in model.buckets)}[cls]
        assert counts.count("all_gather") == gathers, (cls.__name__, mode, counts)
        sent = sum(ring_bytes(op, n * W if op == "all_gather" else n, W) for op, _, n in calls)
        closed = {DDP: 2 * R * V, ZeRO2: R * V + V, ZeRO3: M * V + M * read + R * V}[cls] * (W - 1) / W
        assert math.isclose(sent, closed, rel_tol=1e-12, abs_tol=1e-9), (cls.__name__, mode, calls)
        close(model.state_dict(), ref.state_dict(), f"{cls.__name__} step {step}", rtol=1e-10, atol=1e-12)


def exact_and_counted(rank, W, device):
    head("3. DDP, ZeRO-2, ZeRO-3 == one process in 4 ways to run a step; every collective counted")
    base = tied_lm(device)
    for cls in CLASSES:
        train_and_compare(cls, adamw, None, tuple(range(W)), device, base)
    made = strided_groups(2) if W >= 4 else []  # {0, 2, ..} and {1, 3, ..}: a group rank is not the global rank
    if made:
        handle, ranks = made[rank % 2]
        for cls in CLASSES:
            train_and_compare(cls, sgd, handle, tuple(ranks), device, base)
    for i, mode in enumerate(MODES):
        log(f"step {i}: {mode}")
    log("== torch's AdamW (nanoGPT's groups) on the world" + (f" and SGD + momentum on sub-groups "
        f"{[tuple(r) for _, r in made]}" if made else "") + ", in one process, rtol 1e-10")
    log("gradients handed to the optimizer and clip norms == one process; each synced backward started each bucket "
        "once; collectives and bytes == the closed forms, inside the group")


def overlap(rank, W, device):
    head("4. Overlap: a bucket's reduction starts before backward's last gradient; overlap=False: after, bit-equal")
    final = {}
    for cls in CLASSES:
        for lap in (True, False):
            model, optimizer = wrap(cls, tied_lm(device), cap=mb(10), overlap=lap)
            in_flight, arrived = [], set()

            def on_grad(p, bs=model.buckets):  # runs after the wrapper's hook: what is in flight then
                arrived.add(id(p))
                in_flight.append(sum(b.work is not None for b in bs))
                full = sum(all(id(q) in arrived for q in b.params) for b in bs)
                assert cls is not DDP or not lap or in_flight[-1] == full, (in_flight, full)  # started at once
            for p in model.module.parameters():
                p.register_post_accumulate_grad_hook(on_grad)
            for step in range(2):
                in_flight.clear(), arrived.clear()
                forward_backward(model, "1 micro-batch", *rank_batch(step, rank, device))
                assert all(b.work is None and b.grad is None for b in model.buckets)  # all landed when it ends
                optimizer.step()
                optimizer.zero_grad()
            assert (in_flight[-2] > 0) == lap, (cls.__name__, lap, in_flight)
            final[cls, lap] = model.state_dict()
    for cls in CLASSES:
        assert all(torch.equal(v, final[cls, False][k]) for k, v in final[cls, True].items()), cls.__name__
    log("with overlap a reduction is in flight before the last gradient (DDP: the moment its bucket is full); "
        "without, none; the same values, bit for bit")


# ---- 5. bytes held ---------------------------------------------------------------------------------------------
def bytes_held(rank, W, device):
    head("5. Bytes held per rank (float64, AdamW), measured; buckets of 10 gradients or more")
    got, peaks, kept = {}, {}, {}
    for cls in (*CLASSES, "ZeRO3 without prefetch"):
        model, optimizer = wrap(ZeRO3, tied_lm(device), cap=mb(10), overlap=False) if type(cls) is str else \
            wrap(cls, tied_lm(device), cap=mb(10))
        seen = []

        def measure(*_):
            seen.append((held_bytes(b.flat for b in model.buckets), storage_bytes(b.grad for b in model.buckets)))
        reduce = model._reduce
        model._reduce = lambda b: measure() or reduce(b)
        for mod in model.module.modules():
            mod.register_forward_pre_hook(measure)
            mod.register_forward_hook(measure)
        for p in model.module.parameters():
            p.register_post_accumulate_grad_hook(measure)
        for step in range(2):
            with memory() as mem:  # the second step allocates no state: whatever it keeps is a leak
                forward_backward(model, "1 micro-batch", *rank_batch(step, rank, device))
                optimizer.step()
                if step == 1:
                    state = [t for st in optimizer.state.values() for t in st.values() if t.dim()]
                    got[cls] = (held_bytes([*(b.flat for b in model.buckets), *(b.local for b in model.buckets)]),
                                storage_bytes([b.grad for b in model.buckets] + [b.opt.grad for b in model.buckets]),
                                held_bytes(state))
                optimizer.zero_grad(set_to_none=True)
            for _ in range(100 * step):  # gloo's worker thread lets a finished work's tensors go just after wait()
                if not mem.live():
                    break
                time.sleep(0.01)
            kept[cls] = mem.live()
        peaks[cls] = seen
    sizes = [b.numel * 8 for b in model.buckets]
    V, two = sum(sizes), max(a + b for a, b in zip(sizes, sizes[1:]))
    assert got[DDP] == (V, V, 2 * V), got[DDP]
    assert got[ZeRO2] == (V, V // W, 2 * V // W), got[ZeRO2]
    assert got[ZeRO3] == (V // W, V // W, 2 * V // W), got[ZeRO3]
    assert all(k == 0 for k in kept.values()), kept
    for cls in (ZeRO2, ZeRO3):  # the full-size gradient of two adjacent buckets at most, during backward
        assert max(g for _, g in peaks[cls]) <= two < V, (cls.__name__, two, peaks[cls])
    # ZeRO-3's gathered parameters: the tied bucket between its two uses, plus the buckets of the module running,
    # plus one bucket prefetched (the next one the last forward or backward used first); without prefetch, not that
    tied = next(b for b in model.buckets if any(p is model.module.emb.weight for p in b.params))
    per_module = max(sum(b.numel * 8 for b in model.buckets if any(p is q for p in b.params for q in mod.parameters()))
                     for mod in model.module.modules() if next(mod.parameters(recurse=False), None) is not None
                     and mod is not model.module)
    ahead = max(b.numel * 8 for b in model.buckets if b is not tied)
    peak, alone = (max(p for p, _ in peaks[k]) for k in (ZeRO3, "ZeRO3 without prefetch"))
    assert alone <= tied.numel * 8 + per_module < V and all(p == V for p, _ in peaks[ZeRO2]), (alone, per_module, V)
    assert alone < peak <= tied.numel * 8 + per_module + ahead, (peak, alone, per_module, ahead)
    for cls in CLASSES:  # dropped after a step, a wrapper and its model are freed, every byte (as torch's DDP is)
        with memory() as mem:
            model, optimizer = wrap(cls, tied_lm(device))
            forward_backward(model, "1 micro-batch", *rank_batch(0, rank, device))
            optimizer.step()
            gone = [weakref.ref(model), weakref.ref(model.module)]
            del model, optimizer
            gc.collect()
        for _ in range(100):  # (ZeRO-2's all-gathers, in flight after the step, let go once they land)
            if not mem.live():
                break
            time.sleep(0.01)
        assert all(r() is None for r in gone) and mem.live() == 0, f"{cls.__name__}: a dropped wrapper keeps " \
            f"{mem.live()} B"
    for cls in CLASSES:
        log(f"{cls.__name__:6} parameters {got[cls][0]:5} + gradients {got[cls][1]:5} + state {got[cls][2]:5} B")
    log(f"a step keeps 0 B, a dropped wrapper none; ZeRO's full-size gradients <= two adjacent buckets ({two} B of "
        f"{V}); ZeRO-3's gathered parameters peak at {peak} B (the tied bucket + a module's + one prefetched), "
        f"{alone} B without prefetch")


# ---- 6. bf16 parameters ------------------------------------------------------------------------------------------
def bf16(rank, W, device):
    head("6. bf16 parameters: fp32 masters and gradients, bf16 gathers, against one process; resume exactly")
    low = tied_lm(device).to(BF16)
    ref = copy.deepcopy(low)
    masters = [p.detach().float() for p in ref.parameters()]
    opt = torch.optim.AdamW(masters, **HYPER, weight_decay=0.1)
    models = [wrap(cls, copy.deepcopy(low), lambda n: torch.optim.AdamW(n.parameters(), **HYPER, weight_decay=0.1),
                   cap=mb(70, 4)) for cls in CLASSES]
    for step in range(2):
        batches = [rank_batch(step, r, device) for r in range(W)]
        F.cross_entropy(ref(torch.cat([i for i, _ in batches])), torch.cat([t for _, t in batches])).backward()
        for q, p in zip(masters, ref.parameters()):
            q.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for q, p in zip(masters, ref.parameters()):
                p.copy_(q)
        for model, optimizer in models:
            with traffic() if step == 0 else contextlib.nullcontext() as t:
                forward_backward(model, "1 micro-batch", *batches[rank])
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == 0:  # parameters gathered in bf16 (ZeRO-3: forward and backward), gradients reduced in fp32
                sent = {op: sum(n for name, _, n in t.calls if name == op) for op in ("all_gather", "reduce_scatter")}
                shard = sum(b.numel // W for b in model.buckets)
                read = sum(b.numel // W for b in model.buckets if any(p.dim() > 1 for p in b.params))
                assert sent["all_gather"] == {DDP: 0, ZeRO2: 2 * shard, ZeRO3: 2 * (shard + read)}[type(model)], sent
                assert sent["reduce_scatter"] == (type(model) is not DDP) * 4 * sum(b.numel for b in model.buckets)
    worst = 0.0
    for model, optimizer in models:
        assert all(b.opt.dtype == torch.float32 != b.local.dtype for b in model.buckets)
        full = model.state_dict()
        names = {id(p): n for n, p in model.module.named_parameters()}
        for b in model.buckets:  # the gathered bf16 parameters are this rank's fp32 master, rounded
            flat = F.pad(torch.cat([full[names[id(p)]].flatten() for p in b.params]),
                         (0, b.numel - sum(p.numel() for p in b.params)))
            assert torch.equal(flat[b.shard] if model.sharded else flat, b.opt.to(BF16))
        for name, p in ref.named_parameters():
            err = (full[name].float() - p.float()).abs() / p.float().abs().clamp(min=1)
            worst = max(worst, err.max().item())
    assert worst <= 2 ** -6, worst
    for (model, optimizer), cls in zip(models, CLASSES):  # a checkpoint: the masters ride in optimizer.state_dict()
        state, opt_state = model.state_dict(), copy.deepcopy(optimizer.state_dict())
        assert len(opt_state["dp_masters"]) == len(model.buckets)
        other = tied_lm(device, seed=1).to(BF16)
        fresh, fresh_opt = wrap(cls, other, lambda n: torch.optim.AdamW(n.parameters(), **HYPER, weight_decay=0.1),
                                cap=mb(70, 4))
        fresh_opt.load_state_dict(opt_state)   # the optimizer first, then the model: either order is exact
        fresh.load_state_dict(state)
        assert all(torch.equal(f.opt, b.opt) for f, b in zip(fresh.buckets, model.buckets))
        for mod, o in ((model, optimizer), (fresh, fresh_opt)):
            forward_backward(mod, "1 micro-batch", *rank_batch(7, rank, device))
            o.step()
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items()), cls.__name__
        if cls is ZeRO3:  # gathered() writes in bf16 reach the fp32 master
            with model.gathered(), torch.no_grad():
                model.module.l1.bias.add_(1)
            b = model.module.l1.bias._dp_bucket
            assert torch.equal(b.opt.to(BF16), b.local) and torch.equal(model.state_dict()["l1.bias"],
                                                                       fresh.state_dict()["l1.bias"] + 1)
            untouched = [c for c in model.buckets if c is not b]
            assert all(torch.equal(c.opt, f.opt) for c, f in zip(untouched, [f for f in fresh.buckets
                                                                              if f.index != b.index]))
    log(f"DDP, ZeRO-2, ZeRO-3: within {worst:.4f} x max(|x|, 1) of one process after 2 AdamW steps (bound 2^-6); "
        f"the gathered bf16 == the fp32 master, rounded")
    log("gathers move bf16, reductions fp32; optimizer.state_dict() carries the masters: a resume steps bit-equal; "
        "ZeRO-3's gathered() writes reach the master (the others' masters untouched)")


# ---- 7. Megatron's main_grad handshake --------------------------------------------------------------------------
class FusedLinear(nn.Linear):
    """nn.Linear whose weight gradient goes straight into weight.main_grad when the wrapper asks (the handshake
    05/06's LinearWithSequenceParallel follows)."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            ctx.save_for_backward(x, weight)
            ctx.param = weight
            return F.linear(x, weight, bias)

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            param = ctx.param
            dw = grad.flatten(0, -2).t() @ x.flatten(0, -2)
            if getattr(param, "grad_added_to_main_grad", None) is False:
                param.main_grad.add_(dw)
                param.grad_added_to_main_grad = True
                fill = 0.0 if getattr(param, "zero_out_wgrad", False) else float("nan")  # NaN: dropped, or it shows
                dw = torch.full(weight.shape, fill, dtype=weight.dtype, device=weight.device)
                FusedLinear.fused += 1
            return grad @ weight, dw, grad.flatten(0, -2).sum(0)

    fused = 0

    def forward(self, x):
        return self.Function.apply(x, self.weight, self.bias)


class TiedFused(FusedLinear):
    """y = F.linear(tanh(W x + b), W): the fused use writes main_grad, the ordinary one p.grad (zero_out_wgrad)."""

    def __init__(self, n):
        super().__init__(n, n)
        self.weight.zero_out_wgrad = True

    def forward(self, x):
        return F.linear(torch.tanh(super().forward(x)), self.weight)


def handshake(rank, W, device):
    head("7. A layer that adds dW into main_grad itself (Megatron's handshake) in DDP, ZeRO-2, ZeRO-3")
    def build(tied):
        torch.manual_seed(1)
        net = nn.Sequential(TiedFused(6), nn.Linear(6, 3)) if tied else \
            nn.Sequential(FusedLinear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        return net.to(device, F64)

    torch.manual_seed(2)
    x = torch.randn(4 * W, 6, dtype=F64, device=device)
    for cls in CLASSES:
        for tied in (False, True):
            for every in (False, True):  # no_sync on the first micro-batch, or every micro-batch reducing
                model, optimizer = wrap(cls, build(tied), lambda n: torch.optim.AdamW(n.parameters(), **HYPER),
                                        cap=mb(20))
                ref = build(tied)
                opt = torch.optim.AdamW(ref.parameters(), **HYPER)
                FusedLinear.fused = 0
                for step in range(2):
                    opt.zero_grad()
                    ref(x).pow(2).mean().backward()  # (no wrapper: the layer writes dW into .grad)
                    opt.step()
                    mine = x[4 * rank:4 * rank + 4]
                    with contextlib.nullcontext() if every else model.no_sync():
                        model(mine[:2]).pow(2).mean().div(2).backward()
                    model(mine[2:]).pow(2).mean().div(2).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                close(model.state_dict(), ref.state_dict(), f"{cls.__name__} tied={tied}", rtol=1e-10, atol=1e-12)
                assert FusedLinear.fused == 4, FusedLinear.fused  # every backward fused (main_grad made on demand)
                assert model.module[0].weight.grad_added_to_main_grad is False
    log("== one process's AdamW, 2 steps of 2 micro-batches, the first under no_sync or reducing too: dW counted "
        "once, fused in every backward")
    log("a weight both a fused layer (zero placeholder) and an F.linear use (zero_out_wgrad): both gradients count")


# ---- 8. ZeRO-3's own states --------------------------------------------------------------------------------------
class OutsideHeadLM(nn.Module):
    """The output layer is F.linear(h, emb.weight) in this module's own forward, after the embedding ran."""

    def __init__(self):
        super().__init__()
        self.emb, self.l1 = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids):
        return F.linear(torch.tanh(self.l1(self.emb(ids))), self.emb.weight)


class WithAttention(nn.Module):
    """nn.MultiheadAttention reads its child out_proj's weight without calling out_proj."""

    def __init__(self):
        super().__init__()
        self.emb, self.attn = nn.Embedding(VOCAB, HIDDEN), nn.MultiheadAttention(HIDDEN, 2, batch_first=True)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.emb(ids).unsqueeze(0)
        return self.out(self.attn(x, x, x, need_weights=False)[0][0])


def zero3_states(rank, W, device):
    head("8. ZeRO-3: freed between uses, NaN outside, its refusals, a layer without gradient, a parent's reads")
    model, optimizer = wrap(ZeRO3, tied_lm(device))
    ids, tgt = rank_batch(0, rank, device)
    out = model(ids)
    assert held_bytes(b.flat for b in model.buckets) == 0  # after forward: every bucket freed
    F.cross_entropy(out, tgt).backward()
    assert held_bytes(b.flat for b in model.buckets) == 0  # after backward: freed again
    assert torch.isnan(model.module.l1.weight).all() and model.module.l1.weight.shape == (HIDDEN, HIDDEN)
    raw = one_line(lambda: model.module.state_dict(), RuntimeError, "the wrapped module's own state_dict()")
    assert model.module.state_dict(keep_vars=True)["l1.weight"] is model.module.l1.weight  # no values read
    optimizer.step()
    outside, _ = wrap(ZeRO3, OutsideHeadLM().to(device, F64))
    try:  # (after the forward's first gathers: every rank runs the same forward, so every rank refuses)
        outside(ids)
    except RuntimeError as e:
        used = str(e)
    assert used.startswith("ZeRO3: a parameter was used in forward after") and "\n" not in used, used
    # a step in which one layer gets no gradient: the bucket holding both is freed at the step (not kept with old
    # values), and the layer is stepped with a zero gradient
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)).to(device, F64)
    ref = copy.deepcopy(net)
    model, optimizer = wrap(ZeRO3, copy.deepcopy(net), lambda n: torch.optim.AdamW(n.parameters(), **HYPER),
                            cap=mb(100))
    opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    x = torch.linspace(-1, 1, 12, dtype=F64, device=device).view(4, 3)  # the same on every rank
    for layers in (2, 1, 2):
        opt.zero_grad(set_to_none=False)  # zeros where no gradient comes, as the wrapper steps them
        ref[:layers](x).pow(2).sum().backward()
        opt.step()
        (model(x) if layers == 2 else model.module[0](x)).pow(2).sum().backward()  # (a submodule called alone)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert held_bytes(b.flat for b in model.buckets) == 0
        close(model.state_dict(), ref.state_dict(), f"layers {layers}", rtol=1e-10, atol=1e-12)
    # nn.MultiheadAttention: a module that owns parameters and reads its child's
    torch.manual_seed(3)
    net = WithAttention().to(device, F64)
    ref, (model, optimizer) = copy.deepcopy(net), wrap(ZeRO3, copy.deepcopy(net), sgd, cap=mb(30))
    opt = sgd(ref)
    batches = [rank_batch(1, r, device) for r in range(W)]
    for step in range(2):
        opt.zero_grad()
        sum(F.cross_entropy(ref(i), t) for i, t in batches).div(W).backward()
        opt.step()
        F.cross_entropy(model(batches[rank][0]), batches[rank][1]).backward()
        optimizer.step()
        optimizer.zero_grad()
        close(model.state_dict(), ref.state_dict(), "MultiheadAttention", rtol=1e-10, atol=1e-12)
    log("after forward and after backward every bucket is freed (0 B); outside them a parameter reads NaN; refused:")
    log(raw)
    log(used)
    log("a step where one layer gets no gradient == AdamW stepping it with a zero gradient; nn.MultiheadAttention "
        "(reading out_proj.weight itself) == one process")


# ---- 9. every state a wrapper can reach ---------------------------------------------------------------------
def states(rank, W, device):
    head("9. Wrapper states: step twice, p.grad when unreduced / reduced, refused steps, sync_gradients, ZB-H1")
    ids, tgt = rank_batch(0, rank, device)
    batches = [rank_batch(0, r, device) for r in range(W)]
    for cls in CLASSES:
        for lap in (True, False):
            model, optimizer = wrap(cls, tied_lm(device), overlap=lap)
            ref = tied_lm(device)
            opt = adamw(ref)
            with model.no_sync():
                F.cross_entropy(model(ids), tgt).backward()
            w = model.module.l1.weight
            said = one_line(lambda: w.grad, RuntimeError, "l1.weight.grad: this rank's gradient is not reduced")
            assert torch.equal(w.main_grad, w.main_grad) and w.main_grad.abs().sum() > 0  # the local sum
            one_line(optimizer.step, RuntimeError, "optimizer.step(): this rank's gradients are not reduced")
            one_line(lambda: model.clip_grad_norm_(1.0), RuntimeError, "model.clip_grad_norm_(): this rank's")
            one_line(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), RuntimeError)
            model.zero_grad()  # drops this rank's no_sync gradients
            assert all(b.grad is None and b.opt.grad is None for b in model.buckets) and w.grad is None
            F.cross_entropy(model(ids), tgt).backward()  # synced (overlap or not): reduced when backward ends
            F.cross_entropy(ref(torch.cat([i for i, _ in batches])), torch.cat([t for _, t in batches])).backward()
            if cls is DDP:
                torch.testing.assert_close(w.grad, ref.l1.weight.grad, rtol=1e-10, atol=1e-13)  # the mean
            else:
                shard = one_line(lambda: w.grad, RuntimeError, "l1.weight.grad: ZeRO")
            # step() twice without a backward between: as torch's, the same grads again. Nothing read between (a
            # state_dict() lands ZeRO-2's gathers): the second step itself must land them before it steps
            for _ in range(2):
                opt.step()
                optimizer.step()
            close(model.state_dict(), ref.state_dict(), f"{cls.__name__} step twice", rtol=1e-10, atol=1e-12)
            if cls is ZeRO2:  # a step leaves its all-gathers in flight, the parameters at NaN; forward waits for them
                opt.step()
                with traffic() as t:
                    optimizer.step()
                gathers = [n for op, _, n in t.calls if op == "all_gather"]  # in forward order: the first
                want = [b.local.nbytes for b in model.buckets[::-1]]             # module's bucket first
                assert gathers == want and len(set(want)) == len(want), (gathers, want)
                assert all(b.gathering is not None for b in model.buckets) and w.isnan().all()
                torch.testing.assert_close(model(ids), ref(ids), rtol=1e-10, atol=1e-12)
                assert all(b.gathering is None for b in model.buckets) and not w.isnan().any()
            optimizer.zero_grad(set_to_none=True)
            opt.zero_grad(set_to_none=True)
            optimizer.step()  # no gradient at all: nothing moves (torch skips a .grad of None)
            opt.step()
            close(model.state_dict(), ref.state_dict(), f"{cls.__name__} empty step", rtol=1e-10, atol=1e-12)
            with model.no_sync():  # then sync_gradients() by hand: the same as a synced backward
                F.cross_entropy(model(ids), tgt).backward()
            model.sync_gradients()
            F.cross_entropy(ref(torch.cat([i for i, _ in batches])), torch.cat([t for _, t in batches])).backward()
            optimizer.step(), opt.step()
            optimizer.zero_grad(set_to_none=False), opt.zero_grad(set_to_none=False)  # zeros, then added to
            F.cross_entropy(model(ids), tgt).backward()
            F.cross_entropy(ref(torch.cat([i for i, _ in batches])), torch.cat([t for _, t in batches])).backward()
            optimizer.step(), opt.step()
            close(model.state_dict(), ref.state_dict(), f"{cls.__name__} sync by hand", rtol=1e-10, atol=1e-12)
    for cls in CLASSES:  # an nn.Module as torch's; a backward that reaches one parameter leaves the others at zero
        base = tied_lm(device)
        model, optimizer = wrap(cls, copy.deepcopy(base))
        assert isinstance(model, nn.Module) and [n for n, _ in model.named_parameters()] == \
            [n for n, _ in base.named_parameters()] and list(model.state_dict()) == list(base.state_dict())
        assert all(p is q for p, q in zip(model.parameters(), model.module.parameters()))
        model.eval()
        assert not model.module.l1.training
        model.train()
        assert model.module.l1.training
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in base.parameters())
        with model.gathered():
            model.module.head.bias.sum().backward()
        torch.testing.assert_close(model.clip_grad_norm_(1e9), torch.tensor(VOCAB ** 0.5, dtype=F64))
    log(said)
    log(shard)
    log("nn.Modules: parameters(), named_parameters() and state_dict() by the module's names; train()/eval(); a "
        "backward reaching head.bias alone: its bucket's others 0")
    log("refused after a no_sync backward: optimizer.step(), clip (both); zero_grad() drops; step twice == torch's; "
        "sync_gradients() by hand == a synced backward; overlap=False the same")
    zb_h1(rank, W, device)


def zb_h1(rank, W, device):
    """08's ZB-H1 splits backward: B (input gradients, autograd.grad) then W (weight gradients), each parameter's
    handed to autograd by torch.autograd.backward([p], [dW]) so that its post-accumulate hook fires; all under
    no_sync, then sync_gradients(). A stand-in for 08's backward_weight, on Linear layers."""
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)).to(device, F64)
    torch.manual_seed(4)
    x = torch.randn(2 * W, 5, dtype=F64, device=device)
    for cls in CLASSES:
        ref, (model, optimizer) = copy.deepcopy(net), wrap(cls, copy.deepcopy(net), sgd, cap=mb(12))
        opt = sgd(ref)
        for step in range(2):
            opt.zero_grad()
            ref(x).pow(2).sum().div(W).backward()
            opt.step()
            with model.no_sync():
                for xm in x[2 * rank:2 * rank + 2].chunk(2):
                    kept = []
                    hooks = [mod.register_forward_hook(lambda mod, a, out: kept.append((mod, a[0], out)))
                             for mod in model.module if isinstance(mod, nn.Linear)]
                    y = model(xm)
                    for h in hooks:
                        h.remove()
                    loss = y.pow(2).sum()
                    dz = torch.autograd.grad(loss, [z for _, _, z in kept])  # B: no weight gradient yet
                    for (mod, a, _), g in zip(kept, dz):                    # W: dW = dZ^T X, db = sum dZ
                        torch.autograd.backward([mod.weight, mod.bias], [g.t() @ a.detach(), g.sum(0)])
            model.sync_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            close(model.state_dict(), ref.state_dict(), f"ZB-H1 {cls.__name__}", rtol=1e-10, atol=1e-12)
    log("08's ZB-H1 (B by autograd.grad, W by torch.autograd.backward([p], [dW]), all under no_sync, then "
        "sync_gradients()) == one process")


# ---- 10. refusals ----------------------------------------------------------------------------------------------
def refusals(rank, W, device):
    head("10. Misuse is refused in one line on every rank, at its boundary")
    net = tied_lm(device)
    said = [one_line(lambda: DDP(net, adamw(net), bucket_cap_mb=v), starts=f"bucket_cap_mb={v!r}")
            for v in (0, -1, True, "25", float("nan"))]
    tiny, _ = wrap(DDP, tied_lm(device), cap=1e-12)  # the smallest cap passes: a bucket per parameter
    assert len(tiny.buckets) == len({id(p) for p in tiny.module.parameters()})
    one_line(lambda: DDP(net, "AdamW"), starts="optimizer is a str")
    one_line(lambda: DDP(nn.Tanh(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)),
             starts="Tanh has no trainable parameters")
    other = tied_lm(device)
    foreign = torch.optim.AdamW([*net.parameters(), other.l1.weight], **HYPER)
    one_line(lambda: DDP(net, foreign), starts="optimizer.param_groups[0] holds a tensor that is not")
    partial = torch.optim.AdamW(decay_groups(net)[:1], **HYPER)
    said.append(one_line(lambda: DDP(net, partial), starts="head.bias is in no parameter group"))
    stateful = adamw(net)
    F.cross_entropy(net(rank_batch(0, 0, device)[0]), rank_batch(0, 0, device)[1]).backward()
    stateful.step()
    net.zero_grad()
    said.append(one_line(lambda: DDP(net, stateful), starts="the optimizer holds state already"))
    wrapped, _ = wrap(ZeRO2, net)
    said.append(one_line(lambda: DDP(net, adamw(net)), starts="head.bias is a _WrappedParameter, not a plain nn.Parameter"))
    # torch DDP's names: accepted where they mean ours (the module's device, its group, 25 MiB), else refused
    for cls in CLASSES:
        net = tied_lm(device)
        mine = [device, str(device)] + ([device.index] if device.index is not None else [])
        for d in mine:
            model = cls(net, adamw(net), device_ids=[d], output_device=d, find_unused_parameters=False,
                        bucket_cap_mb=None)
            assert len(model.buckets) == 2 and model.group is None, (d, len(model.buckets))  # 25 MiB: a group each
            net = tied_lm(device)
        for (g, ranks) in strided_groups():
            if rank in ranks:
                model = cls(net, adamw(net), process_group=g)
                assert (model.group, model.world, model.rank) == (g, len(ranks), ranks.index(rank))
        net, g = tied_lm(device), strided_groups()[rank % 2 if W > 1 else 0][0]
        other = "meta" if device.type != "meta" else "cpu"
        for kw, starts in ((dict(group=None, process_group=None, device_ids=None), None),  # the defaults pass below
                           (dict(group=g, process_group=g), "group= and process_group= both given"),
                           (dict(device_ids=[0]) if device.index is None else dict(device_ids=[device.index + 1]),
                            "device_ids=["),
                           (dict(device_ids=[other]), f"device_ids=['{other}']: the module's parameters are on"),
                           (dict(device_ids=[device, device]), "device_ids=["),
                           (dict(device_ids=device), "device_ids="),
                           (dict(device_ids=[True]), "device_ids=[True]"),
                           (dict(output_device=other), f"output_device='{other}': the output stays on"),
                           (dict(output_device=1 if device.index is None else device.index + 1), "output_device=1"
                            if device.index is None else "output_device="),
                           (dict(find_unused_parameters=True), "find_unused_parameters=True is not honoured")):
            if starts is None:
                assert cls(net, adamw(net), **kw).group is None
                net = tied_lm(device)
            else:
                said.append(one_line(lambda: cls(net, adamw(net), **kw), starts=starts))
    # load_state_dict: keys, shapes, dtypes; buffers load
    model, optimizer = wrap(ZeRO3, tied_lm(device))
    good = model.state_dict()
    for bad, starts in (({**good, "extra": torch.zeros(1)}, "load_state_dict: missing keys [], unexpected keys "
                                                             "['extra']"),
                        ({k: v for k, v in good.items() if k != "l1.bias"}, "load_state_dict: missing keys ['l1.bias']"),
                        ({**good, "head.bias": good["head.bias"].float()}, "load_state_dict: head.bias is torch.float32"),
                        # the same numel, another shape (a transpose of the [11, 8] embedding)
                        ({**good, "emb.weight": good["emb.weight"].t()}, "load_state_dict: emb.weight is torch.float64 "
                                                                         "[8, 11] in the state_dict")):
        said.append(one_line(lambda: model.load_state_dict(bad), starts=starts))
    keys = model.load_state_dict({k: v for k, v in good.items() if k != "l1.bias"}, strict=False)
    assert keys.missing_keys == ["l1.bias"] and keys.unexpected_keys == []
    close(model.state_dict(), good, "strict=False", rtol=0, atol=0)
    bn = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(device, F64)
    bn_model, _ = wrap(DDP, bn, sgd)
    state = {k: v + 1 if v.is_floating_point() else v + 1 for k, v in bn_model.state_dict().items()}
    bn_model.load_state_dict(state)
    close(bn_model.state_dict(), state, "buffers", rtol=0, atol=0)
    assert bn.state_dict()["1.num_batches_tracked"] == state["1.num_batches_tracked"]
    # optimizer states: another wrapper, world size, rank, dtype, buckets; a plain torch state
    for cls in CLASSES:
        model, optimizer = wrap(cls, tied_lm(device))
        forward_backward(model, "1 micro-batch", *rank_batch(0, rank, device))
        optimizer.step()
        saved = optimizer.state_dict()
        layout = saved["dp_layout"]
        cases = [({**saved, "dp_layout": {**layout, "world": W + 1}}, f"optimizer.load_state_dict: saved with world={W + 1}"),
                 ({k: v for k, v in saved.items() if not k.startswith("dp_")}, "optimizer.load_state_dict: saved with wrapper=None"),
                 ({**saved, "dp_layout": {**layout, "wrapper": "Other"}}, "optimizer.load_state_dict: saved with wrapper=Other"),
                 ({**saved, "dp_layout": {**layout, "dtypes": ["torch.bfloat16"]}}, "optimizer.load_state_dict: saved with dtypes="),
                 ({**saved, "dp_layout": {**layout, "buckets": layout["buckets"][:-1]}}, "optimizer.load_state_dict: saved with buckets=")]
        every = [None] * W
        dist.all_gather_object(every, saved)  # what each rank saved
        if cls.sharded and W > 1:  # another rank's shard, as it saved it
            cases.append((every[(rank + 1) % W], f"optimizer.load_state_dict: saved with rank={(rank + 1) % W}"))
        elif not cls.sharded:
            assert layout["rank"] is None  # DDP's state is the same on every rank: any rank's loads
            optimizer.load_state_dict(every[-1])
        for bad, starts in cases:
            said.append(one_line(lambda: optimizer.load_state_dict(bad), starts=starts))
        optimizer.load_state_dict(saved)  # its own loads
        assert len(optimizer.state) == len(model.buckets)
        plain = torch.optim.AdamW(tied_lm(device).parameters(), **HYPER)
        one_line(lambda: plain.load_state_dict(saved), ValueError)  # torch's own refusal: other group sizes
    # modules that differ across ranks: refused at wrap time on every rank, one line (the check is a collective)
    if W > 1:
        net = nn.Linear(4, 4 + (rank == W - 1)).to(device, F64)
        try:
            DDP(net, torch.optim.SGD(net.parameters(), lr=0.1))
        except ValueError as e:
            differs = str(e)
        else:
            raise AssertionError("modules differing across ranks were accepted")
        want = (f"the module differs across ranks: group rank 0 has ('weight', [4, 4], 'torch.float64'), group rank "
                f"{W - 1} has ('weight', [5, 4], 'torch.float64'); build the same model on every rank")
        assert differs == want, differs
        said.append(differs)
    for line in said[:2] + said[5:8] + said[8:9] + said[16:17] + said[-1:]:
        log(line if len(line) <= 114 else line[:line.rfind(" ", 0, 111)] + " ...")
    log(f"... {len(said)} in all, each one line before any message (the module check: after its one all-gather)")


# ---- 11. checkpoints -----------------------------------------------------------------------------------------
def run_steps(model, optimizer, steps, rank, device):
    for step in steps:
        forward_backward(model, "2, no_sync() on the first", *rank_batch(step, rank, device))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def checkpoints(rank, W, device, where=None, phase=None):
    """Train 2 steps, save (the model's state_dict on group rank 0 after every rank gathered; each rank its
    optimizer's); then in a fresh wrapper over another module, load and train steps 3 and 4: bit-equal to the
    run that went on. CKPT=DIR CKPT_PHASE=save|load splits it over two launches."""
    import shutil
    import tempfile
    head(f"11. Checkpoint after step 2, resume in a new wrapper{' (new processes)' if phase == 'load' else ''}, "
         f"== the run that went on")
    handles, subgroups = zip(*strided_groups(2))
    subgroups = [tuple(r) for r in subgroups]
    temporary = where is None
    if temporary:
        box = [tempfile.mkdtemp(prefix="ckpt09-") if rank == 0 else None]
        dist.broadcast_object_list(box)
        where = box[0]
    meta = os.path.join(where, "world.pt")
    if phase == "load":
        saved = torch.load(meta)
        if saved != W:
            refuse(f"the checkpoint in {where} was saved at {saved} ranks, this run has {W}: ZeRO's optimizer "
                   f"state is sharded per rank; resume at {saved} ranks")
    elif rank == 0:
        torch.save(W, meta)
    mine = rank % 2
    runs = [("world", None, tuple(range(W))), (f"sub{mine}", handles[mine], subgroups[mine])]
    base = tied_lm(device)
    for cls in CLASSES:
        for tag, group, ranks in runs:
            stem = os.path.join(where, f"{cls.__name__}-{tag}")
            make = lambda module: wrap(cls, module, adamw, group)
            if phase != "load":
                model, optimizer = make(copy.deepcopy(base))
                run_steps(model, optimizer, range(2), rank, device)
                state = model.state_dict()  # ZeRO-3: a collective, every rank of the group calls it
                if dist.get_rank(group) == 0:
                    torch.save(state, stem + ".model.pt")
                torch.save(optimizer.state_dict(), f"{stem}.optim.{rank}.pt")  # each rank its own
                dist.barrier()
            if phase != "save":
                went_on, went_opt = make(copy.deepcopy(base))
                run_steps(went_on, went_opt, range(4), rank, device)
                model, optimizer = make(tied_lm(device, seed=1))
                model.load_state_dict(torch.load(stem + ".model.pt"))
                optimizer.load_state_dict(torch.load(f"{stem}.optim.{rank}.pt"))
                run_steps(model, optimizer, range(2, 4), rank, device)
                got, want = model.state_dict(), went_on.state_dict()
                assert all(torch.equal(got[k], want[k]) for k in want), (cls.__name__, tag)
    if phase != "save":  # the model's state_dict is full: it loads on a group of another size (here W -> W/2)
        saved = torch.load(os.path.join(where, "ZeRO3-world.model.pt"))
        model, optimizer = wrap(ZeRO3, tied_lm(device, seed=2), adamw, handles[mine])
        model.load_state_dict(saved)
        assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        other = torch.load(os.path.join(where, f"ZeRO3-world.optim.{rank}.pt"))
        said = "(one rank: the same world size)" if W == 1 else \
            one_line(lambda: optimizer.load_state_dict(other), starts="optimizer.load_state_dict: saved with world=")
    dist.barrier()
    if temporary and rank == 0:
        shutil.rmtree(where)
    if phase == "save":
        return log(f"saved after step 2: model state_dict (group rank 0), optimizer states (each rank); {subgroups}")
    log(f"DDP, ZeRO-2, ZeRO-3, world and {subgroups}: model.state_dict() and each rank's optimizer.state_dict()")
    log("after step 2, loaded into a new wrapper over other values: steps 3-4 bit-equal to the run that went on")
    log(f"the model's state_dict loads at another world size ({W} -> {len(subgroups[mine])}); the optimizer's "
        f"does not, in one line:")
    log(said if len(said) <= 114 else said[:said.rfind(" ", 0, 111)] + " ...")


# ---- issue 31's probes: states and refusals no section reached ---------------------------------------------------
class Reversed(nn.Module):
    """Two layers used in forward in the reverse of their registration: backward completes the buckets out of the
    wrapper's predicted order."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.a(self.b(x))


def probes_31(rank, W, device):
    head("12. Issue 31's probes: mixed dtypes, buffers across ranks, no_sync's restore, out-of-order buckets, bf16 "
         "p.grad, ZeRO-3's arrival count")
    # a parameter group of two dtypes: one bucket per dtype, every parameter keeps its own
    net = nn.Sequential(nn.Linear(3, 3).to(device, F64), nn.Linear(3, 3).to(device, torch.float32))
    model, _ = wrap(DDP, net, sgd, cap=mb(1000))
    assert [p.dtype for p in net.parameters()] == [F64, F64, torch.float32, torch.float32]
    assert sorted(str(b.flat.dtype) for b in model.buckets) == ["torch.float32", "torch.float64"], model.buckets
    # a buffer that differs across ranks: refused at wrap time, one line (not gloo's abort in the broadcast)
    if W > 1:
        net = nn.Linear(4, 4).to(device, F64)
        net.register_buffer("scale", torch.ones(2 + (rank == W - 1), device=device, dtype=F64))
        try:
            DDP(net, torch.optim.SGD(net.parameters(), lr=0.1))
        except ValueError as e:
            assert str(e).startswith("the module differs across ranks") and "scale" in str(e), str(e)
        else:
            raise AssertionError("a buffer differing across ranks was accepted")
    # no_sync() restores the flag as it found it (require_backward_grad_sync=False outside stays False)
    for cls in CLASSES:
        model, _ = wrap(cls, tied_lm(device))
        model.require_backward_grad_sync = False
        with model.no_sync():
            pass
        assert model.require_backward_grad_sync is False, cls.__name__
    # buckets that backward completes out of the predicted order: each started by the hook that completed it, none
    # left for backward's end
    for cls in CLASSES:
        model, optimizer = wrap(cls, Reversed().to(device, F64), sgd, cap=1e-12)  # a bucket per parameter
        waiting, sync = [], model.sync_gradients
        model.sync_gradients = lambda: (waiting.append(sum(b.grad is not None and b.work is None
                                                           for b in model.buckets)), sync())[1]
        model(torch.ones(2, 3, device=device, dtype=F64)).sum().backward()
        assert waiting == [0] and all(b.opt.grad is not None for b in model.buckets), (cls.__name__, waiting)
    # bf16 DDP: p.grad is refused (the reduced gradient is an fp32 copy), not handed out in another dtype
    model, optimizer = wrap(DDP, tied_lm(device, torch.bfloat16))
    F.cross_entropy(model(rank_batch(0, rank, device)[0]), rank_batch(0, rank, device)[1]).backward()
    one_line(lambda: model.module.l1.weight.grad, RuntimeError,
             "l1.weight.grad: DDP keeps only an fp32 copy beside the bf16 the reduced gradient")
    # ZeRO-3: after a step where one layer got no gradient, later backwards still free the bucket when they end
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)).to(device, F64)
    model, optimizer = wrap(ZeRO3, net, lambda n: torch.optim.SGD(n.parameters(), lr=0.1), cap=mb(100))
    x = torch.linspace(-1, 1, 12, dtype=F64, device=device).view(4, 3).requires_grad_()  # layer 0's W read too
    for layers in (1, 2, 2, 2):
        (model(x) if layers == 2 else model.module[0](x)).pow(2).sum().backward()
        if layers == 2:
            assert held_bytes(b.flat for b in model.buckets) == 0, layers  # freed once its gradients are in
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    log("a group of two dtypes: two buckets; a buffer differing across ranks refused; no_sync() restores False; "
        "out-of-order buckets all in flight at backward's end; bf16 p.grad refused; ZeRO-3 frees after a partial step")


# ---- 13. ZeRO-3's frees: a layer run alone or twice, a module skipped, a saved tensor of no storage ---------
class Reuse(nn.Module):
    """a runs twice (shared weights, as ALBERT's); c shares b's bucket and runs only when asked (a skipped layer)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, skip):
        h = self.b(self.a(self.a(x)))
        return h if skip else self.c(h)


class EmptySaved(m.TiedLM):
    """TiedLM whose forward ends by saving a zero-size tensor for backward (no storage: data_ptr 0, as a freed
    bucket's flat)."""

    def forward(self, ids):
        out = super().forward(ids)
        return out + (out[:0] * torch.zeros(0, VOCAB, dtype=out.dtype, device=out.device)).sum()


def zero3_frees(rank, W, device):
    head("13. ZeRO-3 frees: a layer run alone or twice, a skipped user, a saved tensor of no storage")
    torch.manual_seed(5)
    net = Reuse().to(device, F64)
    ref, (model, optimizer) = copy.deepcopy(net), wrap(ZeRO3, net, sgd, cap=mb(24))  # buckets [c, b] and [a]
    padded = lambda n: -(-n // W) * W * 8
    assert [b.numel * 8 for b in model.buckets] == [padded(24), padded(12)]
    assert held_bytes(b.flat for b in model.buckets) == 0  # freed from the start, before any forward
    x = torch.linspace(-1, 1, 6, dtype=F64, device=device).view(2, 3)
    xs = [x.clone().requires_grad_() for _ in range(2)]  # a run alone (as a pipeline's W runs a layer): backward
    for layer, xi in ((model.module.a, xs[0]), (ref.a, xs[1])):  # reads its weight, gathered again
        layer(xi).pow(2).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-12, atol=0)
    assert held_bytes(b.flat for b in model.buckets) == 0
    optimizer.zero_grad(set_to_none=True)
    seen = []
    model.module.b.register_forward_pre_hook(lambda *_: seen.append(held_bytes(b.flat for b in model.buckets)))
    for skip in (True, False):
        out = model(x, skip)
        assert seen[-1] == padded(24), seen  # a's bucket freed after its second run: only b's (and c's) gathered
        assert held_bytes(b.flat for b in model.buckets) == 0, skip  # b's bucket freed too when c was skipped
        out.sum().backward()
        if skip:  # c got no gradient: [c, b] stays gathered until the step, a's is freed: the raw read is refused
            assert held_bytes(b.flat for b in model.buckets) == padded(24)
            one_line(lambda: model.module.state_dict(), RuntimeError, "the wrapped module's own state_dict()")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model, optimizer = wrap(ZeRO3, EmptySaved().to(device, F64))  # AdamW's groups: the biases' bucket first
    out = model(rank_batch(0, rank, device)[0])
    with traffic() as t:
        out.logsumexp(-1).sum().backward()
    read = sum(any(p.dim() > 1 for p in b.params) for b in model.buckets)
    assert t.counts["all_gather"] == read == len(model.buckets) - 1, (t.calls, read)  # not the biases' bucket
    log("0 B before the first forward; a layer run alone is gathered again by its backward (== one process)")
    log("a module run twice: freed after each run; a bucket whose other module is skipped: freed when forward ends")
    log("gathered by a backward that left c without gradient: kept to the step, the raw state_dict refused meanwhile")
    log("backward gathers only the buckets it reads (not the biases'), though forward saved a tensor of no storage")


def main():
    rank, W, device = setup()
    if os.environ.get("CKPT_PHASE"):  # CKPT=DIR CKPT_PHASE=save, then (new processes) CKPT_PHASE=load
        checkpoints(rank, W, device, os.environ["CKPT"], os.environ["CKPT_PHASE"])
        return finish(f"checkpoint {os.environ['CKPT_PHASE']} at {W} ranks")
    # every section at 1 and 2 ranks; beyond, those whose arithmetic changes with W (padding at 3, sub-groups whose
    # group rank is not the global rank at 4 and 8, another rank's optimizer state at 4): the suite's time
    few = W <= 2
    sections = [(nanogpt_loop, few), (buckets, True), (exact_and_counted, True), (overlap, few),
                (bytes_held, few or W == 3), (bf16, few or W == 3), (handshake, few), (zero3_states, few or W == 4),
                (states, few), (refusals, few or W == 4), (checkpoints, few), (probes_31, few),
                (zero3_frees, True)]  # (the suite: checkpoints at 4)
    for section, runs in sections:
        if runs:
            section(rank, W, device)
    finish("DDP, ZeRO-2, ZeRO-3: nanoGPT's loop == torch DDP; every way to step, state, byte and refusal checked")


if __name__ == "__main__":
    main()
