"""What this proves beyond 10's lesson, for its Llama (GQA, SwiGLU, RoPE) on dp x pp x tp grids:
- the closed forms count real modules: stage_numel == the toy Llama's parameters (tied and untied) and every
  rank's bucket; published Llamas (3.2 1B and 3B, 3 8B, 70B, 405B) within 0.5 %;
- every grid that fits W: each rank in one group of each kind, each group varying one coordinate in order, the
  embedding group = first + last stage (a middle stage is in none); the default grids written out; Grid's and
  LlamaStage's refusals, the scale calculator's (bench/10_scale.py) at their boundaries;
- 06's SP MLP block inside 09's DDP, ZeRO-2 and ZeRO-3 on tp x dp: 3 AdamW steps == one process in fp64, fp32,
  bf16; ZeRO's parameter and optimizer bytes == the closed forms in each dtype;
- grids the lesson does not run (middle stages at 4 and 8 ranks, ZeRO-3, the untied and the tied head), in
  float64 == one process: every gradient shard before the DP reduction, the loss each step, every parameter
  after; every column layer adds dW into main_grad itself in every backward; one step's traffic == the closed
  forms (a middle stage joins no tied-weight all-reduce); in bf16 (fp32 gradients and master) with e = 2,
  eg = 4, ep = 2; the bytes each rank holds == step_memory: parameters, gradients (the stage's summed over the
  micro-batches, then the reduced shard), AdamW's state and fp32 masters, activations min(pp - p, m) x one.
- one dense layer's activations (autograd's saved tensors from one micro-batch) == the docstring's form, to the
  byte, on cp x tp in 1, 2 (s/cp b/t tokens, RoPE's tables at s/cp) at every world size they fit;
- fewer K/V heads than TP ranks (tp = W, W/2 K/V heads, each on 2 ranks: 05's replication): one stage's loss
  and every gradient slice == one process, at 2, 4 and 8 ranks.
- 5D (a Llama-MoE: 6 SwiGLU experts top-2 + a shared one), 2 micro-batches a replica, 3 AdamW steps in float64: cp 2
  x ep 2 (ZeRO-3, untied) at 2 ranks, dp 2 x cp 2, ep 2 (edp 2) at 4, dp 2 x cp 2 x tp 2, ep 2 (ZeRO-3) and dp 2 x
  pp 2 x tp 2, ep 2 (tied) and pp 4 x cp 2, ep 2 (middle stages, one with a mixture; tied) at 8 (the lesson runs pp
  2 x cp 2 x tp 2): before ZeRO's reduction every gradient's mean over its group (dense: dp x cp; experts: edp,
  after / ep) == one process's; the losses, every parameter, one step's traffic (ring K/V, all-to-alls) == the
  closed forms; the bytes held, the dense weights' and the experts' ZeRO's apart (parameters, gradients, AdamW) ==
  bench/10_scale.py's moe_memory; stage_numel (dense + experts) == the model's; cp 2 x ep 2 again in bf16 (fp32
  gradients and master): the first loss within 2^-7, traffic and bytes held == the forms; refusals: ep not dividing
  dp x cp, the sequence not dividing 2 cp tp, 6 experts over ep 4; at 2 and 3 ranks a capacity factor that drops
  assignments (dp = ep = W) == one process applying 04's rule per source rank.
The joint runs at 3 and 4 ranks (dp 3; tp 2 x dp 2), the rest at every world size. GRID=dpxppxtp trains that grid
alone (float64, ZeRO-2, tied; refused in one line if it does not fit).
"""
import contextlib
import copy
import functools
import gc
import importlib
import math
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import finish, head, launched_world_size, log, pg_timeout, refuse, setup, traffic  # noqa: E402
from tests.tools import held_bytes, lesson, refused  # noqa: E402

ten = lesson("10_3d_parallel.py")
calc = importlib.import_module("bench.10_scale")
seq_par, data_par = lesson("06_sequence_parallel.py"), lesson("09_ddp_zero2.py")
F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
HYPER = ten.HYPER
# (grid, zero, tied, dtype) trained at each world size: what the lesson (its default grid, ZeRO-2, tied) does not
RUNS = {1: [((1, 1, 1), 3, 0, F64), ((1, 1, 1), 2, 1, BF16)],
        2: [((2, 1, 1), 3, 0, F64), ((1, 2, 1), 2, 1, BF16)],
        3: [((3, 1, 1), 3, 1, F64), ((3, 1, 1), 2, 0, BF16)],
        4: [((1, 4, 1), 2, 1, F64), ((2, 2, 1), 3, 0, F64), ((2, 1, 2), 3, 1, BF16)],
        8: [((1, 4, 2), 3, 1, F64), ((2, 2, 2), 2, 0, BF16)]}


def fitting_grids(world):
    """Every dp x pp x tp of `world` the toy Llama takes: tp divides K/V heads, seq, vocab, ffn; pp the layers."""
    return [(world // (pp * tp), pp, tp) for tp in range(1, world + 1) for pp in range(1, world // tp + 1)
            if world % (pp * tp) == 0 and not (ten.KV_HEADS % tp or ten.SEQ % tp or ten.VOCAB % tp or ten.FFN % tp
                                               or ten.LAYERS % pp)]


def choose_grid(world, raw):
    """GRID=dpxppxtp: (grid, None), (None, None) without GRID, or (None, one line naming the value and what fits)."""
    fits, parts = " ".join("x".join(map(str, g)) for g in fitting_grids(world)), raw.strip().lower().split("x")
    if not raw.strip():
        return None, None
    if len(parts) != 3 or not all(v.isdigit() and int(v) >= 1 for v in parts):
        return None, f"GRID={raw!r}: write dpxppxtp, three whole numbers >= 1; at {world} ranks these fit: {fits}"
    if tuple(map(int, parts)) not in fitting_grids(world):
        return None, (f"GRID={raw}: dp x pp x tp must be {world} ranks, tp dividing K/V heads {ten.KV_HEADS}, seq "
                      f"{ten.SEQ}, vocab {ten.VOCAB} and ffn {ten.FFN}, pp dividing {ten.LAYERS} layers; these fit: "
                      f"{fits}")
    return tuple(map(int, parts)), None


# ---- the closed forms count real modules -------------------------------------------------------------------
def counts():
    head("the parameter count of the closed forms against real modules and published Llamas")
    for tied in (0, 1):
        llama = ten.Llama(ten.VOCAB, ten.HIDDEN, ten.HEADS, ten.KV_HEADS, ten.FFN, ten.LAYERS, tied)
        c = dict(hidden=ten.HIDDEN, heads=ten.HEADS, kv_heads=ten.KV_HEADS, ffn=ten.FFN, layers=ten.LAYERS,
                 vocab=ten.VOCAB, tied=tied, tp=1, pp=1)
        assert ten.stage_numel(c, 0) == sum(p.numel() for p in llama.parameters()), tied
    for name, (published, shape) in calc.PUBLISHED.items():
        total = ten.stage_numel({**shape, "tp": 1, "pp": 1}, 0)
        assert abs(total / published - 1) < 0.005, (name, total, published)
    log("stage_numel == the toy Llama's parameters (tied and untied); " + ", ".join(
        f"{name} {ten.stage_numel({**shape, 'tp': 1, 'pp': 1}, 0) / 1e9:.2f}B" for name, (_, shape) in
        calc.PUBLISHED.items()) + ": each within 0.5 % of its published count")


# ---- grids and refusals ---------------------------------------------------------------------------------------
WRITTEN = {(2, 2, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                       "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "embedding": [[0, 2], [1, 3], [4, 6], [5, 7]]},
           (1, 2, 2): {"tp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]], "dp": [[0], [1], [2], [3]],
                       "embedding": [[0, 2], [1, 3]]},
           (1, 4, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
                       "dp": [[r] for r in range(8)], "embedding": [[0, 6], [1, 7]]},    # middle stages 1, 2
           (1, 4, 1): {"tp": [[0], [1], [2], [3]], "pp": [[0, 1, 2, 3]], "dp": [[0], [1], [2], [3]],
                       "embedding": [[0, 3]]}}


def layout_is_right(grid, mine):
    """mine: {kind: global ranks of this rank's group}. Each rank is in one group of each kind, a group varies one
    coordinate (in order), the embedding group is the first and last stage of this rank's pipe, none in between."""
    rank, world = dist.get_rank(), dist.get_world_size()
    coords = lambda r: (r // (grid.pp_size * grid.tp_size), r // grid.tp_size % grid.pp_size, r % grid.tp_size)
    assert coords(rank) == (grid.d, grid.p, grid.t) and sorted(r for g in grid.ranks["tp"] for r in g) == \
        list(range(world))
    assert all(rank in ranks for ranks in mine.values()) and mine["tp"][grid.t] == rank, mine
    for kind, varies in (("tp", 2), ("pp", 1), ("dp", 0)):
        assert [coords(r)[varies] for r in mine[kind]] == list(range(len(mine[kind]))), (kind, mine[kind])
        assert all(coords(r)[:varies] + coords(r)[varies + 1:] == coords(rank)[:varies] + coords(rank)[varies + 1:]
                   for r in mine[kind]), (kind, mine[kind])
    ends = sorted({0, grid.pp_size - 1})                          # (one stage: no embedding group, one copy)
    assert ("embedding" in mine) == (grid.p in ends and grid.pp_size > 1), (grid.p, mine)
    if "embedding" in mine:
        assert [coords(r) for r in mine["embedding"]] == [(grid.d, p, grid.t) for p in ends], mine["embedding"]


def grids(world):
    head(f"every grid of {world} ranks the toy takes: the groups each rank is in; refusals")
    made, real_new_group = [], dist.new_group
    dist.new_group = lambda ranks, timeout=None: tuple(ranks)    # the layouts alone: a group is its ranks here
    try:
        for shape in fitting_grids(world):
            grid = ten.Grid(*shape)
            layout_is_right(grid, {k: list(getattr(grid, k)) for k in grid.ranks if getattr(grid, k) is not None})
            assert shape not in WRITTEN or {k: grid.ranks[k] for k in WRITTEN[shape]} == WRITTEN[shape], grid.ranks
            made.append(shape)
    finally:
        dist.new_group = real_new_group
    dp, pp, tp = ten.default_grid(world)
    said = refused(lambda: ten.Grid(dp + 1, pp, tp))             # refused before any group is made
    assert said == f"grid dp={dp + 1} x pp={pp} x tp={tp} = {(dp + 1) * pp * tp} ranks, but the world has {world}"
    if world > 1:                                                # too few ranks, as too many
        assert refused(lambda: ten.Grid(1, 1, 1)) == f"grid dp=1 x pp=1 x tp=1 = 1 ranks, but the world has {world}"
    fake = types.SimpleNamespace(tp=None, pp_size=2)             # the split is checked before anything is built
    for layers in (ten.LAYERS + 1, 1):
        llama = ten.Llama(ten.VOCAB, ten.HIDDEN, ten.HEADS, ten.KV_HEADS, ten.FFN, layers)
        assert refused(lambda: ten.LlamaStage(llama, fake)) == f"{layers} layers do not split evenly over 2 " \
                                                                 f"pipeline stages"
    for raw in ("2x", "0x1x1", "-2x-1x1", "1x1x1x1", f"{world + 1}x1x1", "1x3x1" if world == 3 else "1x1x3"):
        assert choose_grid(world, raw)[1].startswith(f"GRID={raw}") or choose_grid(world, raw)[1].startswith(
            f"GRID={raw!r}"), raw
    assert choose_grid(world, f"{world}x1x1") == ((world, 1, 1), None) and choose_grid(world, "") == (None, None)
    log(f"{len(made)} grids ({' '.join('x'.join(map(str, g)) for g in made)}): each rank in one group of each kind, "
        f"varying one coordinate, the embedding group first + last stage (none in the middle); refused: a grid of "
        f"{world + world // dp} ranks{' and of 1' if world > 1 else ''}, {ten.LAYERS + 1} and 1 layers over 2 "
        f"stages, 6 bad GRIDs")


def calculator_boundaries():
    head("the scale calculator's refusals, at their boundaries (the last value that fits passes, the next is refused)")
    fine = ["tp=1", "tp=8", "pp=1", "pp=80", "pp=40", "dp=1", "m=1", "micro=1", "e=1", "tied=0", "tied=1",
            "bucket_mb=1e-6", "nvlink_GBps=1e-9", "ib_GBps=0.5", "kv_heads=64", "kv_heads=1 tp=1", "heads=8192",
            "heads=8 kv_heads=8 tp=8", "hidden=4096 heads=32 ffn=14336 layers=32"]
    bad = {"tp=0": "tp=0: tp is a whole number >= 1", "tp=3": "tp=3 does not divide hidden=8192",
           "tp=16": "tp=16 does not divide kv_heads=8", "pp=0": "pp=0: pp is a whole number", "pp=3": "pp=3 does not "
           "divide layers=80", "pp=81": "pp=81 does not divide", "dp=0": "dp=0:", "m=0": "m=0:", "tied=2": "tied=2: "
           "tied is 0 or 1", "tied=-1": "tied=-1:", "bucket_mb=0": "bucket_mb=0: bucket_mb is a number > 0",
           "nvlink_GBps=0": "nvlink_GBps=0: nvlink_GBps is a number > 0", "ib_GBps=-1": "ib_GBps=-1:",
           "ib_GBps=inf": "ib_GBps=inf:", "ib_GBps=nan": "ib_GBps=nan:", "ib_GBps=fast": "ib_GBps=fast:",
           "hidden=4096.7": "hidden=4096.7: hidden is a whole number", "kv_heads=128": "kv_heads=128 does not divide "
           "heads=64", "heads=7": "tp=8 does not divide heads=7", "heads=16384": "heads=16384 does not divide",
           "depth=3": "'depth=3' is not key=value", "tp": "'tp' is not key=value", "...": "README's '...'"}
    for pair in fine:
        c, why = calc.scale_config(pair.split())
        assert why is None and all(c[k] == type(ten.SCALE[k])(float(v)) for k, v in (p.split("=") for p in
                                                                                       pair.split())), (pair, why)
    for pair, said in bad.items():
        c, why = calc.scale_config(pair.split())
        assert c is None and said in why and "\n" not in why, (pair, why)
    log(f"{len(fine)} settings that fit pass, {len(bad)} that do not are refused in one line naming the value")


# ---- 06's SP MLP block inside 09's wrappers ---------------------------------------------------------------------
class SPMLPBlock(nn.Module):
    """06's mlp_block as a module: this rank's TP shards of one dense LayerNorm + MLP, x + fc2(GeLU(fc1(LN(x)))),
    [s/tp, b, h] in and out (SP); fc1's weight gets its gradient through 06's SP linear (into main_grad, asked by
    09's wrapper)."""

    def __init__(self, ln, fc1, fc2, group):
        super().__init__()
        t, r, whole = dist.get_world_size(group), dist.get_rank(group), lambda w: nn.Parameter(w.detach().clone())
        self.group, self.ln_w, self.ln_b, self.b2 = group, whole(ln.weight), whole(ln.bias), whole(fc2.bias)
        self.w1, self.b1 = whole(fc1.weight.chunk(t, 0)[r]), whole(fc1.bias.chunk(t, 0)[r])  # fc1's rows
        self.w2 = whole(fc2.weight.chunk(t, 1)[r])                                         # fc2's columns
        for p in (self.ln_w, self.ln_b, self.b2):
            p.sequence_parallel = True                        # applied to this rank's slice of s: summed over TP

    def forward(self, x):
        return seq_par.mlp_block(x, {n: getattr(self, n) for n in ("ln_w", "ln_b", "w1", "b1", "w2", "b2")},
                                 True, self.group)

    def shards_of(self, ln, fc1, fc2):
        t, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        return {"ln_w": ln.weight, "ln_b": ln.bias, "b2": fc2.bias, "w1": fc1.weight.chunk(t, 0)[r],
                "b1": fc1.bias.chunk(t, 0)[r], "w2": fc2.weight.chunk(t, 1)[r]}


def zero_bytes(model, optimizer):
    """(parameter bytes, optimizer bytes) a ZeRO rank holds: its buckets' values (ZeRO-3: the shard; a freed full
    bucket counts 0), AdamW's moments and the fp32 masters beside narrower parameters."""
    state = [t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    return (held_bytes([t for b in model.buckets for t in (b.flat, b.local)]),
            held_bytes(state + [b.opt for b in model.buckets if b.opt is not b.local]))


def compose(world, device):
    tp = 2 if world % 2 == 0 else 1
    grid = ten.Grid(world // tp, 1, tp, timeout=pg_timeout())
    head(f"06's SP MLP block in 09's DDP, ZeRO-2, ZeRO-3 on tp {tp} x dp {grid.dp_size}: 3 AdamW steps, 1 process")
    s, b, h, f = 4 * tp, 2 * grid.dp_size, 8, 16
    # eps 1 (gradients here are O(1)): the update is continuous in the gradient, so bf16's rounding moves it as
    # little as it moves the gradient; with eps 1e-8 AdamW takes the sign of a near-zero gradient, which bf16 flips
    hyper = dict(lr=0.01, betas=(0.9, 0.95), eps=1.0, weight_decay=0.1)
    seq, rows = slice(grid.t * s // tp, (grid.t + 1) * s // tp), slice(grid.d * 2, grid.d * 2 + 2)
    worst = {}
    for dtype, tol in ((F64, 1e-12), (F32, 2 ** -16), (BF16, 2 ** -7)):
        for cls in (data_par.DDP, data_par.ZeRO2, data_par.ZeRO3):
            torch.manual_seed(1)
            ln, fc1, fc2 = nn.LayerNorm(h), nn.Linear(h, f), nn.Linear(f, h)
            dense = nn.ModuleList([ln, fc1, fc2]).to(device, F64)
            with torch.no_grad():                                     # start from values bf16 holds exactly
                for p in dense.parameters():
                    p.copy_(p.to(dtype))
            block = SPMLPBlock(ln, fc1, fc2, grid.tp).to(dtype)
            optimizer = torch.optim.AdamW(block.parameters(), **hyper)
            eg = max(torch.finfo(dtype).bits // 8, 4)                 # gradients and AdamW: fp32 or wider
            model = cls(block, optimizer, grid.dp, bucket_cap_mb=40 * eg / 2 ** 20)   # 40 elements a bucket
            opt = torch.optim.AdamW(dense.parameters(), **hyper)
            for step in range(3):
                g = torch.Generator().manual_seed(10 + step)
                x, target = (torch.randn(s, b, h, generator=g, dtype=F64).to(device) for _ in range(2))
                opt.zero_grad()
                y = x + fc2(F.gelu(fc1(ln(x))))
                (y * target).sum().backward()                         # the whole batch, one process
                opt.step()
                with model.no_sync():                                 # this rank: its replica's rows, its TP slice
                    y = model(x[seq, rows].to(dtype))
                    ((y.double() * target[seq, rows]).sum() * grid.dp_size).backward()  # DP averages: x dp
                seq_par.allreduce_sequence_parallel_grads(block.parameters(), group=grid.tp)  # LN, b2: over TP
                model.sync_gradients()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if cls is not data_par.DDP:                               # bytes held: ZeRO's closed forms
                ep = torch.finfo(dtype).bits // 8
                c = dict(dp=grid.dp_size, ep=ep, eg=eg, pp=1, m=1, layers=1, act=0, bucket_mb=0, seq=0, micro=0,
                         vocab=0, tp=1, e=ep)
                want = calc.step_memory(c, 0, 3 if cls is data_par.ZeRO3 else 2, sum(bk.numel for bk in model.buckets))
                assert zero_bytes(model, optimizer) == (want["parameters"], want["optimizer"]), (cls, dtype, want)
            got, scale = model.state_dict(), max(p.abs().max().item() for p in dense.parameters())
            err = max(((got[n].double() - w).abs().max().item() for n, w in block.shards_of(ln, fc1, fc2).items()))
            worst[(dtype, cls.__name__)] = err / max(scale, 1)
            assert worst[(dtype, cls.__name__)] <= tol, (cls.__name__, dtype, err)
    log(f"DDP, ZeRO-2, ZeRO-3 == one process after 3 steps: float64 within 1e-12, fp32 2^-16, bf16 (fp32 master) "
        f"2^-7 (worst {max(v for (d, _), v in worst.items() if d == BF16):.1e}) of max(|w|, 1)")
    log("ZeRO's parameter and optimizer bytes == the closed forms in each dtype (fp32 master beside bf16 only)")


# ---- the Llama on other grids: gradients, fused dW, traffic, bytes held --------------------------------------------
@contextlib.contextmanager
def saved_activations(stage, readings):
    """Inside: after every forward of `stage`, append the bytes of the tensors autograd keeps for backward that
    are still alive (parameters left out): the activations of the micro-batches in flight, measured."""
    import gc
    from torch.multiprocessing.reductions import StorageWeakRef
    params = {p.untyped_storage()._cdata for p in stage.parameters()}
    refs = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in params and s.device.type != "meta" and (s._cdata not in refs or refs[s._cdata].expired()):
            refs[s._cdata] = StorageWeakRef(s)          # (an expired entry's address may be reused by a new one)
        return t

    def live(*_):
        gc.collect()           # what is still reachable: a reference cycle awaiting the collector is not kept
        for key, ref in list(refs.items()):
            if ref.expired():
                del refs[key]
        readings.append(sum(torch.UntypedStorage._new_with_weak_ptr(k).nbytes() for k in refs))

    hook = stage.register_forward_hook(live)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        hook.remove()


def slices(llama, grid, values=None):
    """{name: this rank's slice} of the one-process llama's parameters, or of `values` (one per parameter): the
    names and slices of a LlamaStage built from it."""
    if values is not None:
        llama = copy.deepcopy(llama)
        for p, v in zip(llama.parameters(), values):
            p.data = v.detach()
    return {n: p.detach() for n, p in ten.LlamaStage(llama, grid).named_parameters(remove_duplicate=False)}


def keep_reduced(wrapper, optimizer, held, key):
    """held[key] = the bytes of the wrapper's reduced gradient shards, read as its optimizer steps (after the DP
    reduction, before AdamW: the shards at their peak)."""
    optimizer.register_step_pre_hook(lambda *_: held.__setitem__(key, held_bytes([b.opt.grad for b in
                                                                                 wrapper.buckets])))


def parameters_are(model, llama, grid, values=True):
    """model.state_dict() has the names of the stage built from the one-process llama, and (values) every
    parameter shard == its slice of llama's."""
    got, want = model.state_dict(), slices(llama, grid)
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name, w in want.items() if values else ():
        torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-12, msg=lambda s: f"{name}: {s}")


def train_on(shape, zero, tied, dtype, device):
    grid, f64 = ten.Grid(*shape, timeout=pg_timeout()), dtype == F64
    sizes = dict(e=8, eg=8, ep=8) if f64 else dict(e=2, eg=4, ep=2)
    head(f"dp {shape[0]} x pp {shape[1]} x tp {shape[2]}, ZeRO-{zero}, {'tied' if tied else 'untied'} head, "
         f"{'float64' if f64 else 'bf16 (fp32 gradients and master)'}")
    mine = {k: dist.get_process_group_ranks(getattr(grid, k)) for k in grid.ranks if getattr(grid, k) is not None}
    layout_is_right(grid, mine)                                   # the real groups, as the arithmetic says
    torch.manual_seed(0)
    llama = ten.Llama(ten.VOCAB, ten.HIDDEN, ten.HEADS, ten.KV_HEADS, ten.FFN, ten.LAYERS, tied, dtype).to(device)
    stage = ten.LlamaStage(llama, grid)
    columns = {id(m.weight): m.weight for m in stage.modules() if isinstance(m, ten.tp_layers.ColumnParallelLinear)}
    fused = dict.fromkeys(columns, 0)  # backwards in which the layer added dW into main_grad itself (seen before 09)
    for p in columns.values():
        p.register_post_accumulate_grad_hook(
            lambda p: fused.__setitem__(id(p), fused[id(p)] + p.grad_added_to_main_grad))
    optimizer = torch.optim.AdamW(stage.parameters(), **HYPER)
    model = (data_par.ZeRO2 if zero == 2 else data_par.ZeRO3)(stage, optimizer, grid.dp, 1024)
    model.grid = grid
    c = ten.toy_config(grid, zero, tied, **sizes)
    assert [b.numel for b in model.buckets] == c["buckets"], ([b.numel for b in model.buckets], c["buckets"])
    comm = ten.pipeline.P2PCommunicator((ten.SEQ // grid.tp_size, ten.MICRO, ten.HIDDEN), dtype, device, grid.pp)
    opt = torch.optim.AdamW(llama.parameters(), **HYPER)
    rows = slice(grid.d * ten.M * ten.MICRO, (grid.d + 1) * ten.M * ten.MICRO)
    held, kept = {}, []
    keep_reduced(model, optimizer, held, "reduced")
    steps = ten.STEPS if f64 else 2                               # bf16: traffic and bytes only
    for step in range(steps):
        ids, targets = ten.batch(step, grid.dp_size, device)
        check = None
        if f64:
            opt.zero_grad()
            ref_loss = F.cross_entropy(llama(ids).flatten(0, 1), targets.flatten())
            ref_loss.backward()
            if step == 0:      # this replica's share of the gradient, what ZeRO is handed before it averages
                share = F.cross_entropy(llama(ids[rows]).flatten(0, 1), targets[rows].flatten())
                want = slices(llama, grid, torch.autograd.grad(share, list(llama.parameters())))
                check = lambda: [torch.testing.assert_close(p.main_grad, want[n], rtol=1e-9, atol=1e-13,
                                                            msg=lambda s: f"grad {n}: {s}")
                                 for n, p in stage.named_parameters(remove_duplicate=False)]
            opt.step()
        if step == 1:          # the gradients at their peak: every micro-batch added up, before the reduction
            check = lambda: held.__setitem__("summed", held_bytes([b.grad for b in model.buckets]))
        with traffic() if step == 1 else saved_activations(stage, kept) if step == 0 and zero == 2 else \
                contextlib.nullcontext() as t:      # (ZeRO-3's own saved-tensor hooks would hide the activations)
            loss = ten.train_step(model, optimizer, comm, list(ids[rows].split(ten.MICRO)),
                                  list(targets[rows].split(ten.MICRO)), check)
        if step == 1:
            got = ten.traffic_is(t.calls, grid, c)
            assert grid.p in (0, grid.pp_size - 1) or {k for k, _ in got} <= {"tp", "pp", "dp"}, got  # a middle stage
            summed = held["summed"]
        assert (loss is not None) == grid.is_last, loss
        if f64 and grid.is_last:
            dist.all_reduce(loss, group=grid.dp)
            torch.testing.assert_close(loss / grid.dp_size, ref_loss.detach(), rtol=1e-12, atol=0)
    assert fused == dict.fromkeys(columns, steps * ten.M), fused
    if f64:
        parameters_are(model, llama, grid)
    want = calc.step_memory({**c, "act": 0, "bucket_mb": 1024}, grid.p, zero, c["buckets"][0])
    k = min(grid.pp_size - grid.p, ten.M)                         # 1F1B: micro-batches in flight on stage p
    params, state = zero_bytes(model, optimizer)
    assert (params, summed + held["reduced"], state) == (want["parameters"], want["gradients"], want["optimizer"]), \
        (dist.get_rank(), params, summed, held["reduced"], state, want)
    assert zero == 3 or kept[0] > 0 and max(kept) == k * kept[0], (k, kept)  # one micro-batch's each, k at once
    log((f"each gradient shard before the DP reduction, the loss of {ten.STEPS} steps and every parameter == one "
         f"process; " if f64 else "") + f"{len(columns)} column weights fused dW into main_grad in all "
        f"{steps * ten.M} backwards; one step's traffic == the closed forms"
        + ("; middle stages: no tied-weight all-reduce" if grid.pp_size > 2 and tied else "")
        + f"; bytes held == step_memory" + (f" (activations: {k} x {kept[0]} on rank 0)" if kept else ""))


def layer_activations(world, device):
    """What one dense layer keeps for backward from one micro-batch (autograd's saved tensors, parameters left out)
    == bench/10_scale.py's activations(), as moe_memory gives it to the 5D table (at s/cp), on each cp x tp of W ranks
    (cp, tp in 1, 2), float64."""
    head("one dense layer's activations under CP and TP, measured, against the docstring's form")
    shapes = [(cp, tp) for cp in (1, 2) for tp in (1, 2) if world % (cp * tp) == 0]
    torch.manual_seed(0)
    llama = ten.Llama(ten.VOCAB, ten.HIDDEN, ten.HEADS, ten.KV_HEADS, ten.FFN, 2, False, F64).to(device)
    ids = ten.batch(0, 1, device)[0][:ten.MICRO]
    for cp, tp in shapes:
        grid = ten.Grid(world // (cp * tp), 1, tp, pg_timeout(), cp=cp)
        stage = ten.LlamaStage(llama, grid)
        skip = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        x = stage.tok_embeddings((seq_par.zigzag_shard(ids, 1, grid.cp) if cp > 1 else ids).t())
        for blk in stage.layers:
            saved = []
            keep = lambda t: saved.append(t) or t.detach()       # (t itself: a cycle through its graph, never freed)
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                x = x + blk.attention(blk.attention_norm(x))
                x = x + blk.feed_forward(blk.ffn_norm(x))
            one = dict(hidden=ten.HIDDEN, heads=ten.HEADS, kv_heads=ten.KV_HEADS, ffn=ten.FFN, seq=ten.SEQ, cp=cp,
                       micro=ten.MICRO, tp=tp, e=8, eg=8, ep=8, dp=1, pp=1, m=1, layers=1, vocab=0)   # one layer
            want = calc.moe_memory(one, 0, 2, 0, 0)[0]["activations"]   # the 5D table's: activations() at s/cp
            got = held_bytes([t for t in saved if t.untyped_storage().data_ptr() not in skip])
            assert got == want, (cp, tp, got, want)
    log(f"each layer keeps activations(s/cp, tp) bytes exactly on cp x tp = "
        f"{', '.join(f'{cp} x {tp}' for cp, tp in shapes)}")


# ---- 5D: context and expert parallelism with the rest, a Llama-MoE -------------------------------------------------
FIVE_D = {2: [(dict(dp=1, pp=1, cp=2, tp=1, ep=2), 3, 0, F64), (dict(dp=1, pp=1, cp=2, tp=1, ep=2), 2, 1, BF16)],
          4: [(dict(dp=2, pp=1, cp=2, tp=1, ep=2), 2, 1, F64)],
          8: [(dict(dp=2, pp=1, cp=2, tp=2, ep=2), 3, 0, F64), (dict(dp=2, pp=2, cp=1, tp=2, ep=2), 2, 1, F64),
              (dict(dp=1, pp=4, cp=2, tp=1, ep=2), 2, 1, F64)]}        # middle stages 1 (a mixture) and 2
FIVE_D_M = 2                  # (grid, zero, tied, dtype); micro-batches a replica (the lesson: M, pp2 x cp2 x tp2)


def five_d_refusals(world):
    """Grid's, train_step's and the mixture's refusals at their boundaries, before any collective."""
    head("5D refusals: ep not dividing dp x cp, the sequence not dividing 2 cp tp, experts not dividing ep")
    assert refused(lambda: ten.Grid(world, 1, 1, ep=world + 1)) == f"ep={world + 1} does not divide dp x cp = " \
        f"{world} (experts spread over the data ranks)"
    assert refused(lambda: ten.Grid(1, 1, 1, cp=2)) == f"grid dp=1 x pp=1 x cp=2 x tp=1 = 2 ranks, but the world " \
        f"has {world}" if world != 2 else True
    fake = types.SimpleNamespace(grid=types.SimpleNamespace(cp_size=2, tp_size=2, cp=None), experts=None)
    ids = [torch.zeros(1, 12, dtype=torch.long)]                  # 12 = 8 + 4: the first length past 8 refused
    assert refused(lambda: ten.train_step(fake, None, None, ids, ids)) == "sequence length 12 is not divisible by " \
        "2 x cp 2 x tp 2 (zig-zag's 2 chunks a CP rank, split over TP)"
    if world in (4, 8):                                           # 6 experts over ep 3 (last fitting) and 4
        grid = ten.Grid(world // 4, 1, 4 // 4, pg_timeout(), cp=4, ep=4) if world == 4 else \
            ten.Grid(2, 1, 1, pg_timeout(), cp=4, ep=4)
        dense = ten.Llama(ten.VOCAB, ten.HIDDEN, ten.HEADS, ten.KV_HEADS, ten.FFN, 2, **ten.MOE).layers[1].feed_forward
        assert refused(lambda: ten.MoE(dense, 2, grid)) == "num_experts=6 is not divisible by the expert-parallel " \
                                                           "size 4"
    log("each refused in one line on every rank before any collective; the last fitting values train below")


def five_d(shape, zero, tied, dtype, device):
    """A Llama-MoE on a 5D grid, STEPS AdamW steps against one process on the same batch (each replica's first
    FIVE_D_M micro-batches), float64: before ZeRO's reduction every gradient's mean over its group (dense: dp x cp;
    an expert: edp) == the one-process gradient's slice (AdamW alone would hide a wrong scale); the losses, every
    parameter after == one process; in float64 and bf16 (fp32 gradients and master), one step's traffic == the closed
    forms, the bytes held by the dense weights and by the experts' own ZeRO (parameters, gradients summed and
    reduced, AdamW's) == bench/10_scale.py's moe_memory."""
    grid, m, f64 = ten.Grid(shape["dp"], shape["pp"], shape["tp"], pg_timeout(), cp=shape["cp"], ep=shape["ep"]), \
        FIVE_D_M, dtype == F64
    head(f"5D: dp {shape['dp']} x pp {shape['pp']} x cp {shape['cp']} x tp {shape['tp']}, ep {shape['ep']} (edp "
         f"{shape['dp'] * shape['cp'] // shape['ep']}), ZeRO-{zero}, {'tied' if tied else 'untied'}, {m} "
         f"micro-batches, {'float64' if f64 else 'bf16 (fp32 gradients and master)'}")
    torch.manual_seed(0)
    llama = ten.Llama(ten.VOCAB, ten.HIDDEN, ten.HEADS, ten.KV_HEADS, ten.FFN, ten.LAYERS, tied, dtype, **ten.MOE)
    llama = llama.to(device)
    c = dict(ten.toy_config(grid, zero, tied, ten.MOE, **({} if f64 else dict(e=2, eg=4, ep=2))), m=m, bucket_mb=1024)
    whole = dict(c, tp=1, pp=1, ep_size=1)
    assert ten.stage_numel(whole, 0) + ten.stage_numel(whole, 0, True) == sum(p.numel() for p in llama.parameters())
    model, optimizer = ten.parallelize(llama, grid, zero, **HYPER)
    opt, stage, n_dp = torch.optim.AdamW(llama.parameters(), **HYPER), model.module, grid.dp_size * grid.cp_size
    comm = ten.pipeline.P2PCommunicator((ten.SEQ // grid.cp_size // grid.tp_size, ten.MICRO, ten.HIDDEN), dtype,
                                        device, grid.pp)
    parts, held = [(model, optimizer)] + [(model.experts, model.expert_optimizer)] * bool(c["expert_buckets"]), {}
    assert (model.experts is None) == (not c["expert_buckets"])  # a stage without a mixture: no experts' ZeRO
    assert [b.numel for b in model.buckets] == c["buckets"] and [b.numel for b in (model.experts.buckets if
                                                                        model.experts else ())] == c["expert_buckets"]
    for i, (wrapper, o) in enumerate(parts):
        keep_reduced(wrapper, o, held, i)
    rows, summed = slice(grid.d * m * ten.MICRO, (grid.d + 1) * m * ten.MICRO), []

    def mean_is_reference():                                      # after finalize_grads, before the reduction
        for name, p in stage.named_parameters():
            mean = p.main_grad.clone()
            dist.all_reduce(mean, group=grid.edp if p.expert else grid.dp)
            torch.testing.assert_close(mean / (n_dp // grid.ep_size if p.expert else n_dp), want[name], rtol=1e-9,
                                       atol=1e-13, msg=lambda s: f"grad {name}: {s}")
    for step in range(ten.STEPS if f64 else 2):                  # bf16: traffic and bytes only
        ids, targets = (t.unflatten(0, (grid.dp_size, -1))[:, :m * ten.MICRO].flatten(0, 1)
                        for t in ten.batch(step, grid.dp_size, device))
        if f64 or step == 0:                                      # bf16: the first loss alone, no training
            opt.zero_grad()
            ref_loss = F.cross_entropy(llama(ids).flatten(0, 1).to(F64 if f64 else F32), targets.flatten())
            ref_loss.backward()
            want = slices(llama, grid, [p.grad for p in llama.parameters()]) if step == 0 else None
            if f64:
                opt.step()
        check = mean_is_reference if step == 0 and f64 else (lambda: summed.extend(  # the summed gradients, at
            held_bytes([b.grad for b in w.buckets]) for w, _ in parts)) if step == 1 else None   # their peak
        with traffic() if step == 1 else contextlib.nullcontext() as counted:
            loss = ten.train_step(model, optimizer, comm, list(ids[rows].split(ten.MICRO)),
                                  list(targets[rows].split(ten.MICRO)), check)
        if step == 1:
            calls, reduced = counted.calls, [held[i] for i in range(len(parts))]
        assert (loss is not None) == grid.is_last, loss
        if grid.is_last and (f64 or step == 0):
            dist.all_reduce(loss, group=grid.dp)
            torch.testing.assert_close(loss / n_dp, ref_loss.detach().to(loss.dtype), rtol=1e-12 if f64 else 2 ** -7,
                                       atol=0)
    parameters_are(model, llama, grid, values=f64)
    ten.traffic_is(calls, grid, c)
    forms = calc.moe_memory(c, grid.p, zero, c["buckets"][0], sum(c["expert_buckets"]))[:len(parts)]
    for (wrapper, o), form, at_peak, after in zip(parts, forms, summed, reduced, strict=True):
        params, state = zero_bytes(wrapper, o)
        assert (params, at_peak + after, state) == (form["parameters"], form["gradients"], form["optimizer"]), \
            (dist.get_rank(), params, at_peak, after, state, form)
    log((f"every gradient's mean over its group (dense over dp x cp, experts over edp, / ep) == one process's; the "
         f"loss of {ten.STEPS} steps, every parameter (experts too) == one process; " if f64 else "the first loss == "
         "one process's within 2^-7; ") +
        "one step's traffic == the closed forms; bytes held (dense, experts) == moe_memory")


def capped_llama(llama, ids, group, cf):
    """One process's Llama-MoE forward (logits [B, s, V]) with 04's capacity rule written out as its docstring says:
    each source rank (here: each `group` rows of ids, its tokens in [s, b] order, as a stage flattens them) fills
    each expert's C = ceil(cf N k / E) slots with every token's 1st choice in token order, then every 2nd, ...;
    an assignment finding its expert full is dropped. Returns the logits and the assignments dropped."""
    x, pos, dropped = llama.tok_embeddings(ids), torch.arange(ids.shape[1], device=ids.device), 0
    for blk in llama.layers:
        a, f, h = blk.attention, blk.feed_forward, blk.attention_norm(x)
        q, k, v = (w(h).unflatten(-1, (-1, llama.head_dim)) for w in (a.wq, a.wk, a.wv))
        q, k = (seq_par.apply_rope(t, pos, layout="bshd", base=5e5) for t in (q, k))
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True)
        x = x + a.wo(o.transpose(1, 2).flatten(2))
        h = blk.ffn_norm(x)
        if isinstance(f, ten.SwiGLU):
            x = x + f(h)
            continue
        out = []
        for rows in h.split(group):                               # one source rank's tokens, [s, b] order
            t = rows.transpose(0, 1).flatten(0, 1)                # [N, h]
            gates, idx = f.router(t).softmax(-1).topk(llama.top_k, dim=-1)
            cap, used, keep = math.ceil(cf * len(t) * llama.top_k / len(f.experts)), [0] * len(f.experts), \
                torch.zeros_like(gates, dtype=torch.bool)
            for c in range(llama.top_k):
                for n in range(len(t)):
                    e = int(idx[n, c])
                    if used[e] < cap:
                        used[e], keep[n, c] = used[e] + 1, True
            dropped += int((~keep).sum())
            y = sum((gates[:, c, None] * keep[:, c, None]) * torch.stack([ex(t) for ex in f.experts])[
                idx[:, c], torch.arange(len(t))] for c in range(llama.top_k))
            out.append(y.unflatten(0, (rows.shape[1], rows.shape[0])).transpose(0, 1))
        x = x + torch.cat(out) + f.shared(h)
    return llama.output(llama.norm(x)), dropped


def capacity(world, device):
    """dp = ep = W, one stage, capacity factor 0.5 (assignments dropped): one forward and backward of each rank's
    micro-batch == capped_llama on all of them: the loss, every dense gradient's mean over dp, every expert's."""
    head(f"capacity factor 0.5 on ep {world}: drops, against one process applying 04's rule per source rank")
    grid = ten.Grid(world, 1, 1, pg_timeout(), ep=world)
    torch.manual_seed(2)
    llama = ten.Llama(ten.VOCAB, ten.HIDDEN, ten.HEADS, ten.KV_HEADS, ten.FFN, 2, False, F64, **ten.MOE).to(device)
    stage = ten.LlamaStage(llama, grid, capacity_factor=0.5)
    ids, targets = (t[:world * ten.MICRO] for t in ten.batch(0, world, device))
    logits, dropped = capped_llama(llama, ids, ten.MICRO, 0.5)
    ref = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    ref.backward()
    mine = slice(grid.d * ten.MICRO, (grid.d + 1) * ten.MICRO)
    loss = ten.vocab_par.vocab_parallel_cross_entropy(stage(ids[mine]), targets[mine].t(), group=grid.tp)
    loss.backward()
    got = torch.tensor([loss.item(), sum(m.moe.stats["dropped"] for m in stage.modules() if isinstance(m, ten.MoE))],
                       dtype=F64, device=device)
    dist.all_reduce(got)
    assert int(got[1]) == dropped > 0, (got, dropped)
    torch.testing.assert_close(got[0] / world, ref.detach(), rtol=1e-12, atol=0)
    want = slices(llama, grid, [p.grad for p in llama.parameters()])
    for name, p in stage.named_parameters():
        g = p.grad.clone()
        if not p.expert:                                          # an expert's already holds every rank's tokens
            dist.all_reduce(g)
        torch.testing.assert_close(g / world, want[name], rtol=1e-10, atol=1e-13, msg=lambda s: f"grad {name}: {s}")
    log(f"{dropped} assignments dropped, the same as one process's; the loss and every gradient == one process's")


# ---- GQA with fewer K/V heads than TP ranks: 05's replicated heads inside 10's stage ------------------------------
def replicated_kv(world, device):
    """tp = W > H_kv = W/2: each K/V head on 2 ranks (05's replication), the rest as the toy; one forward and
    backward of one stage (untied, pp = dp = 1) == the one-process Llama: the loss, every gradient's slice."""
    tp, kv = world, world // 2
    head(f"tp {tp} > {kv} K/V heads: each K/V head replicated on {tp // kv} ranks, against one process, float64")
    alone = [dist.new_group([r], timeout=pg_timeout()) for r in range(world)][dist.get_rank()]   # cp: one rank
    grid = types.SimpleNamespace(tp=None, cp=alone, pp_size=1, p=0, is_first=True, is_last=True)   # tp = W
    torch.manual_seed(1)
    llama = ten.Llama(ten.VOCAB, ten.HIDDEN, ten.HEADS, kv, ten.FFN, 2, False, F64).to(device)
    stage = ten.LlamaStage(llama, grid)
    ids, targets = ten.batch(0, 1, device)
    ref = F.cross_entropy(llama(ids).flatten(0, 1), targets.flatten())
    ref.backward()
    loss = ten.vocab_par.vocab_parallel_cross_entropy(stage(ids), targets.t(), group=grid.tp, check_slices=False)
    loss.backward()
    ten.finalize_grads(stage, grid)                               # the norms' gradients summed over TP
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=0)
    want = slices(llama, grid, [p.grad for p in llama.parameters()])
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-13, msg=lambda s: f"grad {name}: {s}")
    log(f"loss and every gradient slice == one process ({kv} K/V heads on {tp} ranks: each head's gradient summed "
        f"over its {tp // kv} replicas)")


def freed(run):
    """run, then its process groups destroyed and the collector run, so that what run left lets them go: a live
    gloo group costs every rank CPU while it idles (its thread wakes every 10 ms)."""
    @functools.wraps(run)
    def run_then_free(*args):
        made, new_group = [], dist.new_group
        dist.new_group = lambda *a, **k: made.append(new_group(*a, **k)) or made[-1]
        try:
            run(*args)
        finally:
            dist.new_group = new_group
        for group in made:
            dist.destroy_process_group(group)       # (every rank is past its last collective on it: run returned)
        made.clear()
        gc.collect()
    return run_then_free


def main():
    extra, why = choose_grid(launched_world_size(), os.environ.get("GRID", ""))
    if why:                                                       # before any work: one line on every rank
        refuse(why)
    rank, world, device = setup()
    runs = [(extra, 2, 1, F64)] if extra else RUNS.get(world, [(ten.default_grid(world), 3, 0, F64)])
    if not extra:                                                 # GRID: that grid alone
        counts()
        grids(world)
        calculator_boundaries()
        if world in (3, 4):                                       # dp 3 (odd), tp 2 x dp 2: the joint's two shapes
            freed(compose)(world, device)
        if world % 2 == 0:                                        # tp = W > W/2 K/V heads: replicated
            freed(replicated_kv)(world, device)
        freed(layer_activations)(world, device)
        freed(five_d_refusals)(world)
        if world in (2, 3):                                       # 6 experts over ep 2, 3
            freed(capacity)(world, device)
        for shape, zero, tied, dtype in FIVE_D.get(world, []):
            freed(five_d)(shape, zero, tied, dtype, device)
    for shape, zero, tied, dtype in runs:
        freed(train_on)(shape, zero, tied, dtype, device)
    finish(f"{len(runs)} more grids == one process (gradients, losses, parameters), traffic and bytes held == the "
           f"closed forms; the joints, every layout and every refusal")


if __name__ == "__main__":
    main()
