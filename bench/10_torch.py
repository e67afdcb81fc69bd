"""The capstone (10_3d_parallel.py) beside torchtitan's recipe on PyTorch's own parallelism: the same Llama, the same
weights, the same data, AdamW, full training steps, pp = 1, one line each grid and ZeRO stage.

    torchrun --nproc-per-node=4 bench/10_torch.py       (2 ranks too; BENCH_SMALL=1: 10's toy sizes, two rounds)

Ours: 10's Grid(dp, pp=1, tp), parallelize (05's TP + SP, 07's vocabulary-parallel embedding, head and loss, 09's
ZeRO-2 or ZeRO-3 over dp in buckets of one block's bytes, as FSDP2 shards block by block) and train_step (one
micro-batch). Theirs, torchtitan's parallelize_llama on a 2-D init_device_mesh (dp, tp): apply_tp's plan through
parallelize_module on the tp dimension (tok_embeddings RowwiseParallel -> Shard(1), the norms SequenceParallel,
PrepareModuleInput Shard(1) -> Replicate on attention and feed_forward, wq/wk/wv/w1/w3 ColwiseParallel, wo/w2
RowwiseParallel -> Shard(1), output ColwiseParallel -> Shard(-1) under loss_parallel), then FSDP2 fully_shard per
block and the root over the dp dimension (reshard_after_forward=False beside ZeRO-2, True, FSDP2's default, beside
ZeRO-3); as torchtitan, no TP at tp = 1, no FSDP at dp = 1. Grids: 2 ranks dp1 x tp2 and dp2 x tp1, 4 ranks dp2 x
tp2, 1 rank dp1 x tp1. Asserted first, in float64: every step's loss of ours == torch's (rtol 1e-9) over 3 AdamW
steps and then every parameter shard (ours == 10's parallelize of a Llama holding torch's full_tensor()s); then, in
fp32, rounds of one step each interleave, the order reversed every other round; a step's time is the slowest rank's
(the max over ranks, checked against every rank's own); a ratio is the median of per-round ratios. One more round,
not timed, counts each side's collectives (common.traffic) and, on gloo, the bytes rank 0 writes to its sockets
(tests/tools.written()); at tp = 1 ZeRO-k and its FSDP2 must hand the same all-gather and reduce-scatter bytes
(within 1 %: a pair that matches, ZeRO-3 beside the FSDP2 that reshards after forward). The untied head
(10's TIED=0, Llama 3's): torch's parallelize_module does not keep a tied weight. Default: vocab 4096, hidden 256,
8/4 heads, ffn 768, 4 layers, 4 x 128 tokens a replica, BENCH_ROUNDS=8. Table: bench/README.md.
"""
import contextlib
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, launched_world_size, log, pg_timeout, refuse, setup, sync, traffic  # noqa: E402
from tests.tools import lesson, slowest, written  # noqa: E402

HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GRIDS = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(2, 2)]}          # (dp, tp), pp = 1


class TitanAttention(nn.Module):
    """10's Llama attention as torchtitan writes it, a module of its own (PrepareModuleInput needs one), [b, s, h]."""
    def __init__(self, dense, head_dim, rope):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = dense.wq, dense.wk, dense.wv, dense.wo
        self.head_dim, self.rope = head_dim, rope

    def forward(self, x):
        q, k, v = (w(x).unflatten(-1, (-1, self.head_dim)) for w in (self.wq, self.wk, self.wv))  # [b, s, own, d]
        pos = torch.arange(q.shape[1], device=q.device)
        q, k, v = (t.transpose(1, 2) for t in (self.rope(q, pos), self.rope(k, pos), v))        # [b, own, s, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).flatten(2))


class TitanFeedForward(nn.Module):
    def __init__(self, dense):
        super().__init__()
        self.w1, self.w2, self.w3 = dense.w1, dense.w2, dense.w3

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, blk, head_dim, rope):
        super().__init__()
        self.attention_norm, self.ffn_norm = blk.attention_norm, blk.ffn_norm
        self.attention = TitanAttention(blk.attention, head_dim, rope)
        self.feed_forward = TitanFeedForward(blk.feed_forward)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLlama(nn.Module):
    """A copy of 10's Llama (its parameters, its names: state_dict() loads into one), modules as torchtitan's."""
    def __init__(self, llama, rope):
        super().__init__()
        llama = copy.deepcopy(llama)
        self.tok_embeddings, self.norm, self.output = llama.tok_embeddings, llama.norm, llama.output
        self.layers = nn.ModuleList(TitanBlock(blk, llama.head_dim, rope) for blk in llama.layers)

    def forward(self, ids):
        x = self.tok_embeddings(ids)
        for blk in self.layers:
            x = blk(x)
        return self.output(self.norm(x))


def torch_parallelize(llama, mesh, reshard, rope):
    """torchtitan's parallelize_llama (apply_tp, then apply_fsdp) on a TitanLlama copy of `llama` -> (model, AdamW)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    model = TitanLlama(llama, rope)
    if mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
        for blk in model.layers:
            parallelize_module(blk, mesh["tp"], {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    if mesh["dp"].size() > 1:
        for blk in model.layers:
            fully_shard(blk, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), **HYPER)


def whole(p):
    """A DTensor's full value: gathered over dp first, then over tp (one all-gather each; asked for both at once,
    DTensor warns of two sequential ones for FSDP2's strided shard of a TP shard)."""
    from torch.distributed.tensor import Replicate
    if not hasattr(p, "full_tensor"):
        return p
    if p.device_mesh.ndim == 2:
        p = p.redistribute(placements=[Replicate(), p.placements[1]])
    return p.full_tensor()


def torch_step(model, optimizer, ids, targets):
    """torchtitan's train step, one micro-batch: loss_parallel where the logits are vocabulary-sharded DTensors."""
    from torch.distributed.tensor.parallel import loss_parallel
    logits = model(ids)
    with loss_parallel() if hasattr(logits, "placements") else contextlib.nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss.detach()


def main():
    world = launched_world_size()                          # `python bench/10_torch.py` runs it under torchrun
    small = os.environ.get("BENCH_SMALL", "").strip()
    if small not in ("", "0", "1"):
        refuse(f"BENCH_SMALL={os.environ['BENCH_SMALL']!r}: 1 runs 10's toy sizes twice, 0 (or unset) the full "
               f"sizes, BENCH_ROUNDS times")
    if world not in GRIDS:
        refuse(f"{world} ranks: grids of 1 (dp1 x tp1), 2 (dp1 x tp2, dp2 x tp1) or 4 ranks (dp2 x tp2) only")
    m, rope = lesson("10_3d_parallel.py"), lesson("06_sequence_parallel.py").apply_rope
    sizes = (dict(vocab=64, hidden=32, heads=8, kv_heads=4, ffn=48, layers=2), 8, 2, 2) if small == "1" else (
        dict(vocab=4096, hidden=256, heads=8, kv_heads=4, ffn=768, layers=4), 128, 4,
        int(os.environ.get("BENCH_ROUNDS", "8")))
    cfg, seq, rows, rounds = sizes
    rope_ = lambda t, pos: rope(t, pos, layout="bshd", base=5e5)       # 10's: Llama 3's base
    rank, world, device = setup()
    from torch.distributed.device_mesh import init_device_mesh
    head(f"a Llama ({', '.join(f'{k} {v}' for k, v in cfg.items())}), {rows} x {seq} tokens a replica, full AdamW "
         f"steps, {rounds} rounds; {dist.get_backend()}, {world} ranks, load average {os.getloadavg()[0]:.1f} on "
         f"{os.cpu_count()} cores")
    for dp, tp in GRIDS[world]:
        grid = m.Grid(dp=dp, pp=1, tp=tp, timeout=pg_timeout())
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        assert mesh["dp"].get_local_rank() == grid.d and mesh["tp"].get_local_rank() == grid.t   # rank = d tp + t

        def batch(step):                                   # this replica's rows of the step's global batch
            g = torch.Generator().manual_seed(100 + step)
            ids, targets = (torch.randint(cfg["vocab"], (dp * rows, seq), generator=g) for _ in range(2))
            mine = slice(grid.d * rows, (grid.d + 1) * rows)
            return ids[mine].to(device), targets[mine].to(device)

        def build(dtype, zero):
            torch.manual_seed(0)
            llama = m.Llama(**cfg, tied=False, dtype=dtype).to(device)
            block = sum(p.numel() * p.element_size() for p in llama.layers[0].parameters()) / 2 ** 20
            ours = m.parallelize(llama, grid, zero=zero, bucket_cap_mb=block, **HYPER)   # a bucket a block, as FSDP2
            comm = m.pipeline.P2PCommunicator((seq // tp, rows, cfg["hidden"]), dtype, device, grid.pp)
            theirs = torch_parallelize(llama, mesh, zero == 3, rope_)   # FSDP2 reshards after forward as ZeRO-3
            return llama, ours, comm, theirs

        def step(side, systems, k):
            llama, (model, optimizer), comm, (t_model, t_optimizer) = systems
            ids, targets = batch(k)
            if side == "ours":
                return m.train_step(model, optimizer, comm, [ids], [targets])
            return torch_step(t_model, t_optimizer, ids, targets)

        zeros = (2, 3) if dp > 1 else (2,)                 # at dp = 1 there is no FSDP (torchtitan's rule)
        for zero in zeros:                                 # float64: ours == torch's, loss by loss, then every shard
            systems = build(torch.float64, zero)
            for k in range(3):
                ours, theirs = step("ours", systems, k), step("torch", systems, k)
                torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=0, msg=lambda e: f"step {k}: {e}")
            full = {n: whole(p) for n, p in systems[3][0].state_dict().items()}
            dense = copy.deepcopy(systems[0])
            dense.load_state_dict(full)                    # torch's parameters, whole, in 10's Llama
            want = m.parallelize(dense, grid, zero=zero, **HYPER)[0].state_dict()
            got = systems[1][0].state_dict()
            assert got.keys() == want.keys(), (sorted(got), sorted(want))
            for n, w in want.items():
                torch.testing.assert_close(got[n], w, rtol=1e-9, atol=1e-12, msg=lambda e: f"{n}: {e}")
        log(f"dp{dp} x tp{tp}: 3 AdamW steps, ours == torch's (every loss, then every parameter shard), float64, "
            f"ZeRO-{' and ZeRO-'.join(map(str, zeros))}")
        for zero in zeros:
            systems = build(torch.float32, zero)
            ms, wrote, handed = {"ours": [], "torch": []}, {}, {}
            for i in range(rounds + 2):                    # round 0: warm-up; the last counts bytes: not timed
                if i > rounds and zero == 2:               # the last timed step's all-gathers land before it
                    systems[1][0].state_dict()
                for side in ("ours", "torch")[::1 if i % 2 else -1]:
                    sync(device)
                    dist.barrier()
                    t0 = time.perf_counter()
                    with written(on=i > rounds) as w, traffic() if i > rounds else contextlib.nullcontext() as t:
                        step(side, systems, i)
                        if i > rounds and side == "ours" and zero == 2:   # its all-gathers in flight land:
                            systems[1][0].state_dict()     # their bytes here (ZeRO-3's would gather: none in flight)
                        sync(device)
                    ms[side].append(1e3 * slowest(time.perf_counter() - t0, device))
                    if i > rounds:
                        handed[side] = {op: sum(n for o, _, n in t.calls if o == op) for op in ("all_gather",
                                                                                              "reduce_scatter")}
                    if w.bytes is not None:
                        wrote[side] = w.bytes / 2 ** 20
            ms = {side: t[1:rounds + 1] for side, t in ms.items()}
            if tp == 1 and dp > 1:   # ZeRO-k and its FSDP2 hand the same gathers and reductions (a matching pair)
                assert all(abs(handed["ours"][op] - handed["torch"][op]) <= 0.01 * handed["torch"][op] for op in
                           handed["torch"]), f"ZeRO-{zero} and its FSDP2 hand c10d other bytes a step: {handed}"
            ratio = statistics.median(a / b for a, b in zip(ms["ours"], ms["torch"]))
            theirs = " + ".join(["TP + SP"] * (tp > 1) + [f"FSDP2 (reshard_after_forward={zero == 3})"] * (dp > 1))
            log(f"dp{dp} x tp{tp}, ours ZeRO-{zero} {statistics.median(ms['ours']):8.1f} ms, torch {theirs} "
                f"{statistics.median(ms['torch']):8.1f} ms a step (slowest rank, medians): ours / torch "
                f"x{ratio:.2f} (median of the rounds' ratios)" + (f"; rank 0 wrote {wrote['ours']:.2f} MiB, torch "
                                                                   f"{wrote['torch']:.2f} MiB a step" if wrote else ""))
    finish(f"10's Llama on {', '.join(f'dp{d} x tp{t}' for d, t in GRIDS[world])} == torchtitan's recipe (losses, "
           f"parameters); each time the slowest rank's (the speeds are measurements)")


if __name__ == "__main__":
    main()
