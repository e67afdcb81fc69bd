"""10 - 3D parallelism: a small GPT trained with data, pipeline, tensor, sequence and vocabulary parallelism at once.

The blocks of 05-09, imported unchanged (importlib: a module name cannot start with a digit), composed into one
training step as Megatron-LM and picotron do; this file adds the grid of groups, the model and the step.
The grid: W = dp * pp * tp, tp fastest: rank = (d * pp + p) * tp + t (picotron's order, dp-pp-tp). Megatron's
default order "tp-cp-ep-dp-pp" also keeps TP on consecutive ranks but puts dp inside pp: rank = (p * dp + d) * tp + t.
8 ranks as dp 2 x pp 2 x tp 2 (a middle stage, with pp >= 3, is in no embedding group):

            replica d=0               replica d=1         TP groups  [0 1] [2 3] [4 5] [6 7]   (NVLink)
        stage 0     stage 1       stage 0     stage 1     PP groups  [0 2] [1 3] [4 6] [5 7]   (across nodes)
       [ 0  1 ] -> [ 2  3 ]      [ 4  5 ] -> [ 6  7 ]     DP groups  [0 4] [1 5] [2 6] [3 7]   (across nodes)
        t=0 t=1     t=0 t=1       t=0 t=1     t=0 t=1     embedding  [0 2] [1 3] [4 6] [5 7]   (first+last stage)

Who holds what. Activations are Megatron's [s, b, h], the sequence split over TP between layers ([s/tp, b, h]).
Stage 0: the vocabulary-parallel embedding (07), its partial sums reduce-scattered to [s/tp, b, h]; every stage: L/pp
layers, attention and MLP column/row-parallel (05) with 06's SP linear (it keeps [s/tp, b, h] and all-gathers
again in backward; dW into main_grad, 09's handshake); last stage: final LayerNorm, the LM head tied to the
embedding, the vocabulary-parallel loss (07). Micro-batches run in 1F1B order (08); ZeRO-2 (ZERO=3: ZeRO-3) over DP.
After the last micro-batch the gradients applied to a slice of the sequence (LayerNorms, row biases) are summed
over TP, and the tied weight's two copies over the embedding group, then ZeRO reduce-scatters over DP. Megatron's
finalize_model_grads runs the DP reduction first (finish_grad_sync), then the LayerNorm/SP sum over TP, then the
embedding group: all are sums, so every order gives the same gradient.

One step, bytes each rank SENDS (ring: all-reduce 2(n-1)/n of its input, all-gather (n-1) x, reduce-scatter
(n-1)/n); A = s*b*h*e one micro-batch's whole activation, m micro-batches, t = tp, L/pp layers a stage:
  TP per layer and micro-batch: 6 all-gathers of A/t (2 forward, 2 SP re-gathers, 2 reduce-scatter backwards)
      and 4 reduce-scatters of A: 10 (t-1)/t A. Stage 0 per micro-batch: the embedding's reduce-scatter
      and its backward all-gather, 2 (t-1)/t A (an all-reduce, then a split, would send 3 (t-1)/t A). Last
      stage: the head's 2 all-gathers + 1 reduce-scatter, and the loss's all-gather of 3 fp32 per token.
      Per step: the SP gradients' all-reduce, 5h per layer (+2h on the last stage)
  PP per micro-batch: A/t forward unless last stage, A/t back unless first; embedding group once: V/t*h
  DP per step and bucket: reduce-scatter (dp-1)/dp of its gradients; all-gather (dp-1)/dp of its parameters
      once (ZeRO-2) or for each F and each B, 2m times (ZeRO-3)
Bytes each rank HOLDS at its peak, P parameters a rank: parameters P*ep (ZeRO-3: P/dp*ep); gradients P*eg
(added up over the micro-batches under no_sync) + P/dp*eg reduced; AdamW 2P/dp*eg (+4P/dp fp32 master copy for
narrower parameters); activations: stage p keeps min(pp - p, m) micro-batches' saved tensors.
The demo first checks a joint: 06's SP MLP block in 09's DDP, ZeRO-2 and ZeRO-3 on tp x dp (fp64, fp32, bf16) ==
one process. Then it trains the GPT, counts one step's collectives per group (common.traffic; again in bf16, where
e, eg and ep differ) and the bytes held (held_bytes, saved tensors alive), asserts these forms, and step_traffic
and step_memory evaluate them at scale.

    torchrun --nproc-per-node=8 10_3d_parallel.py     (1-4 ranks too; GRID=dpxppxtp, e.g. GRID=1x4x2; ZERO=3)
    torchrun --nproc-per-node=1 10_3d_parallel.py hidden=8192 ffn=28672 layers=80 tp=8 pp=8 dp=16 m=16  (70B)
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ---- building blocks: the lessons' blocks, composed (needs 05-09 beside it, and torch) -------------------------
import contextlib
import copy
import importlib
from fractions import Fraction

tp_layers = importlib.import_module("05_tp_layers")          # Column/RowParallelLinear, attention, MLP
seq_par = importlib.import_module("06_sequence_parallel")    # sequence-parallel regions, SP gradient all-reduce
vocab_par = importlib.import_module("07_vocab_parallel")     # VocabParallelEmbedding, the vocab-parallel loss
pipeline = importlib.import_module("08_pipeline_1f1b")       # schedule_1f1b, P2PCommunicator, run_schedule
data_par = importlib.import_module("09_ddp_zero2")           # ZeRO-2, ZeRO-3 (nn.Modules, main_grad handshake)


class Grid:
    """dp x pp x tp process groups, tp fastest: rank = (d * pp + p) * tp + t. Every rank creates every group, in
    the same order (dist.new_group's rule). self.tp / .pp / .dp / .embedding: this rank's groups (a middle stage
    is in no embedding group: None); self.ranks: {kind: [global ranks of each group]}; self.d, .p, .t: this
    rank's coordinates (replica, stage, TP rank). timeout: the groups' (None: torch's default, 30 min on gloo)."""

    def __init__(self, dp, pp, tp, timeout=None):
        world, rank = dist.get_world_size(), dist.get_rank()
        if dp * pp * tp != world:
            raise ValueError(f"grid dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp} ranks, but the world has {world}")
        self.dp_size, self.pp_size, self.tp_size = dp, pp, tp
        self.d, self.p, self.t = rank // (pp * tp), rank // tp % pp, rank % tp
        at = lambda d, p, t: (d * pp + p) * tp + t
        pipes = [[at(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
        self.ranks = {"tp": [[at(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
                      "pp": pipes,
                      "dp": [[at(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
                      "embedding": [sorted({ranks[0], ranks[-1]}) for ranks in pipes]}  # first + last stage
        for kind, groups in self.ranks.items():
            made = [dist.new_group(ranks, timeout=timeout) for ranks in groups]
            setattr(self, kind, next((g for g, ranks in zip(made, groups) if rank in ranks), None))
        self.is_first, self.is_last = self.p == 0, self.p == pp - 1


class GPT(nn.Module):
    """The model, in one process: tied embedding, L pre-LN blocks (causal attention, GeLU MLP), final LayerNorm."""

    def __init__(self, vocab, hidden, heads, ffn, layers, dtype=None):
        super().__init__()
        kw = dict(dtype=dtype)
        self.embed = nn.Embedding(vocab, hidden, **kw)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(hidden, **kw), ln2=nn.LayerNorm(hidden, **kw),
            attn=nn.MultiheadAttention(hidden, heads, bias=False, batch_first=True, **kw),  # no bias, as Llama
            mlp=nn.Sequential(nn.Linear(hidden, ffn, **kw), nn.GELU(), nn.Linear(ffn, hidden, **kw))))
            for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, **kw)

    def forward(self, ids):                                           # ids [b, s] -> logits [b, s, V]
        x = self.embed(ids)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=x.device, dtype=x.dtype)
        for blk in self.blocks:
            h = blk.ln1(x)
            x = x + blk.attn(h, h, h, need_weights=False, attn_mask=causal, is_causal=True)[0]
            x = x + blk.mlp(blk.ln2(x))
        return F.linear(self.ln_f(x), self.embed.weight)              # tied LM head


class GPTStage(nn.Module):
    """This rank's part of GPT: its stage's layers (all stages), the embedding (first stage), the final LayerNorm,
    the tied head and the loss (last stage), every weight split over the TP group. Built from the one-process
    model, so both start equal. Activations are Megatron's [s, b, h]. forward: ids [b, s] (first stage) or
    [s/tp, b, h] -> [s/tp, b, h], or logits [s, b, V/tp] (last stage). Column layers, the tied head included,
    add dW straight into main_grad (gradient-accumulation fusion, 09's handshake). With one stage the head's
    weight is the embedding's Parameter, whose lookup writes .grad: it carries zero_out_wgrad (Megatron's rule),
    so the head's placeholder is zeros and 09's hook adds that .grad into main_grad too."""

    def __init__(self, gpt: GPT, grid: Grid):
        super().__init__()
        tp, layers = grid.tp, len(gpt.blocks)
        if layers % grid.pp_size:
            raise ValueError(f"{layers} layers do not split evenly over {grid.pp_size} pipeline stages")
        per = layers // grid.pp_size
        self.group, self.is_first, self.is_last = tp, grid.is_first, grid.is_last
        self.first_layer = grid.p * per
        self.layers = nn.ModuleList()
        for blk in gpt.blocks[self.first_layer:self.first_layer + per]:
            mine = nn.ModuleDict(dict(
                ln1=copy.deepcopy(blk.ln1), ln2=copy.deepcopy(blk.ln2),
                attn=tp_layers.ParallelSelfAttention.from_dense(blk.attn, tp, sequence_parallel=True),
                mlp=tp_layers.parallel_mlp(blk.mlp, tp, sequence_parallel=True)))
            for m in mine.modules():
                if isinstance(m, tp_layers.ColumnParallelLinear):
                    m.gradient_accumulation_fusion = True             # dW into main_grad (Megatron's fusion)
                    m.check_slices = False          # equal by construction: every slice comes from a reduce-scatter
            for p in (*mine.ln1.parameters(), *mine.ln2.parameters(), mine.mlp[2].bias):
                p.sequence_parallel = True                            # applied to this rank's slice of s
            self.layers.append(mine)
        if self.is_first:
            # its partial sums reduce-scattered straight to [s/tp, b, h] (Megatron's reduce_scatter_embeddings)
            self.embed = vocab_par.VocabParallelEmbedding.from_dense(gpt.embed, tp, sequence_parallel=True)
        if self.is_last:
            self.ln_f = copy.deepcopy(gpt.ln_f)
            for p in self.ln_f.parameters():
                p.sequence_parallel = True
            tied = nn.Linear(gpt.embed.embedding_dim, gpt.embed.num_embeddings, bias=False, device="meta")
            tied.weight = gpt.embed.weight                            # [V, h]: column-parallel splits its rows
            self.head = tp_layers.ColumnParallelLinear.from_dense(tied, tp, sequence_parallel=True)
            self.head.gradient_accumulation_fusion, self.head.check_slices = True, False
            if self.is_first:
                self.head.weight = self.embed.weight                  # one stage: one Parameter, as in GPT
                self.head.weight.zero_out_wgrad = True                # used by the lookup too: dW in .grad

    def tied_weight(self):
        """The embedding's shard (first stage) or the head's copy of it (last stage); None on middle stages."""
        return self.embed.weight if self.is_first else self.head.weight if self.is_last else None

    def forward(self, x):
        if self.is_first:                                             # ids [b, s] -> [s, b] -> [s/tp, b, h]
            x = self.embed(x.t())
        for blk in self.layers:
            x = x + blk.attn(blk.ln1(x))
            x = x + blk.mlp(blk.ln2(x))
        return self.head(self.ln_f(x)) if self.is_last else x        # logits [s, b, V/tp]

    def shards_of(self, gpt: GPT, val=torch.Tensor.detach):
        """{name: this rank's slice of val(p) for gpt's parameter p} for every parameter here (val: the value,
        or a gradient of it)."""
        out = {}
        if self.is_first:
            out["embed.weight"] = val(gpt.embed.weight)[self.embed.vocab_start:self.embed.vocab_end]
        for i, blk in enumerate(self.layers):
            ref = gpt.blocks[self.first_layer + i]
            for ln in ("ln1", "ln2"):
                out.update({f"layers.{i}.{ln}.{n}": val(p) for n, p in ref[ln].named_parameters()})
            out[f"layers.{i}.attn.qkv.weight"] = blk.attn.qkv.shard(
                tp_layers.head_major(val(ref.attn.in_proj_weight), ref.attn.num_heads))[0]
            out[f"layers.{i}.attn.proj.weight"] = blk.attn.proj.shard(val(ref.attn.out_proj.weight))[0]
            for j in (0, 2):                                          # the MLP's column and row layers
                w, b = blk.mlp[j].shard(val(ref.mlp[j].weight), val(ref.mlp[j].bias))
                out[f"layers.{i}.mlp.{j}.weight"], out[f"layers.{i}.mlp.{j}.bias"] = w, b
        if self.is_last:
            out.update({f"ln_f.{n}": val(p) for n, p in gpt.ln_f.named_parameters()})
            if not self.is_first:
                out["head.weight"] = self.head.shard(val(gpt.embed.weight))[0]
        return out


def finalize_grads(stage: GPTStage, grid: Grid):
    """After the last micro-batch, before the DP reduction: sum over TP the gradients SP applied to a slice of
    the sequence (06), and the tied weight's two halves over the embedding group (first + last stage; nothing
    to do with one stage, where embedding and head are one Parameter). Megatron's finalize_model_grads does the
    same two after its DP reduction (sums: the order is free). The gradients are where 09 adds them: main_grad."""
    seq_par.allreduce_sequence_parallel_grads(stage.parameters(), group=grid.tp)  # reads p.main_grad
    if grid.pp_size > 1 and stage.tied_weight() is not None:
        dist.all_reduce(stage.tied_weight().main_grad, group=grid.embedding)  # a view of a flat bucket: contiguous


def train_step(stage, model, comm, ids, targets, before_step=None):
    """One step of this rank: the micro-batches through the pipeline in 1F1B order (08), their gradients added
    up without DP traffic (no_sync); finalize_grads; ZeRO's reduce-scatter and step (09). Returns
    the mean loss over this replica's micro-batches on the last stage, else None."""
    def loss_fn(logits, target):                                      # mean over the micro-batch's tokens
        return vocab_par.vocab_parallel_cross_entropy(logits, target.t(), group=stage.group)  # [s, b, V/tp]

    with model.no_sync():
        loss, _, _ = pipeline.run_schedule(stage, pipeline.schedule_1f1b, comm, ids, targets, loss_fn)
    finalize_grads(stage, model.grid)
    if before_step is not None:
        before_step()                                                 # (the demo checks the gradients here)
    model.sync_gradients()                                            # one reduce-scatter per bucket
    model.step()                                  # AdamW on this rank's shard (ZeRO-2 then all-gathers it)
    return loss


def data_parallel(stage, grid, bucket_numel, zero=2, **optimizer_kwargs):
    """09's ZeRO-2 (or ZeRO-3) over the DP group, holding the grid for finalize_grads."""
    model = (data_par.ZeRO2 if zero == 2 else data_par.ZeRO3)(stage, bucket_numel, group=grid.dp, **optimizer_kwargs)
    model.grid = grid
    return model


# ---- the closed forms of the docstring: bytes each rank sends in one step ---------------------------------------
RING = {"all_reduce": lambda n: Fraction(2 * (n - 1), n), "all_gather": lambda n: n - 1,
        "reduce_scatter": lambda n: Fraction(n - 1, n), "send": lambda n: 1, "recv": lambda n: 0}


def step_traffic(c, stage):
    """{(group kind, collective): (calls, bytes this rank sends)} for one step of pipeline stage `stage`.
    c: hidden, ffn, layers, seq, vocab, micro (sequences per micro-batch), m (micro-batches), dp, pp, tp,
    e (activation bytes), eg (gradient bytes), ep (parameter bytes), buckets (each bucket's elements)."""
    t, pp, m = c["tp"], c["pp"], c["m"]
    first, last, per = stage == 0, stage == pp - 1, c["layers"] // pp
    A = c["micro"] * c["seq"] * c["hidden"] * c["e"]                 # one micro-batch's activation, whole
    out = {}

    def add(kind, op, n, calls, payload):                             # payload: the bytes handed in per call
        if n > 1 and calls:
            old = out.get((kind, op), (0, 0))
            out[(kind, op)] = (old[0] + calls, old[1] + calls * RING[op](n) * payload)

    add("tp", "all_gather", t, 6 * per * m, A // t)   # per layer: 2 forward, 2 re-gathers and 2 of RS's backward
    add("tp", "reduce_scatter", t, 4 * per * m, A)    # 2 forward (row layers), 2 backward (column layers' dx)
    if first:                                         # the embedding: reduce-scatter to the sequence split
        add("tp", "reduce_scatter", t, m, A)
        add("tp", "all_gather", t, m, A // t)                         # its backward
    if last:
        add("tp", "all_gather", t, 2 * m, A // t)                     # the head's input, again in backward
        add("tp", "reduce_scatter", t, m, A)                          # its input's gradient
        add("tp", "all_gather", t, m, 3 * c["micro"] * c["seq"] * max(c["e"], 4))  # the loss: 3 fp32 a token
    sp_numel = 5 * c["hidden"] * per + (2 * c["hidden"] if last else 0)
    add("tp", "all_reduce", t, 1, sp_numel * c["eg"])
    add("pp", "send", pp, m * (2 - first - last), A // t)
    add("pp", "recv", pp, m * (2 - first - last), A // t)
    if first or last:
        add("embedding", "all_reduce", min(pp, 2), 1, c["vocab"] // t * c["hidden"] * c["eg"])
    for numel in c["buckets"]:                        # ZeRO-3 gathers each bucket for every F and every B instead
        add("dp", "reduce_scatter", c["dp"], 1, numel * c["eg"])
        add("dp", "all_gather", c["dp"], 2 * m if c.get("zero", 2) == 3 else 1, numel // c["dp"] * c["ep"])
    return out


def step_memory(c, stage, zero, numel=None):
    """{what: bytes one rank of pipeline stage `stage` holds at its peak} under ZeRO-1, 2 or 3 as 09 runs them,
    the m micro-batches added up under no_sync. parameters: all, or 1/dp (ZeRO-3, between uses); gradients: the
    whole stage's in the gradient dtype, added up over the micro-batches, plus the 1/dp shard the optimizer steps;
    optimizer: AdamW's two moments on 1/dp in the gradient dtype, and an fp32 master copy where parameters are
    narrower; activations: 1F1B keeps min(pp - stage, m) micro-batches in flight, c["act"] bytes a layer each."""
    numel = stage_numel(c, stage) if numel is None else numel       # numel: padded to dp, as a bucket is
    shard, dp, ep, eg = -(-numel // c["dp"]), c["dp"], c["ep"], c["eg"]
    return {"parameters": (shard if zero == 3 else numel) * ep,
            "gradients": numel * eg + shard * eg,
            "optimizer": shard * (2 * eg + (4 if ep < 4 else 0)),
            "activations": min(c["pp"] - stage, c["m"]) * (c.get("act_stage") or c["layers"] // c["pp"] * c["act"])}


def stage_numel(c, stage):
    """Elements of this stage's parameters on one TP rank: its share of ZeRO-2's buckets."""
    h, f, t, per, pp = c["hidden"], c["ffn"], c["tp"], c["layers"] // c["pp"], c["pp"]
    layer = 4 * h + 4 * h * h // t + (h * f + f) // t + f * h // t + h   # LNs, attention (no bias), MLP
    return per * layer + (c["vocab"] // t * h if stage in (0, pp - 1) else 0) + (2 * h if stage == pp - 1 else 0)


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
import math

try:
    from common import (finish, head, held_bytes, launched_world_size, log, pg_timeout, refuse, refused, ring_bytes,
                        setup, traffic)
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

VOCAB, HIDDEN, HEADS, FFN, LAYERS, SEQ = 64, 16, 8, 32, 4, 8   # tp in 1, 2, 4, 8; pp in 1, 2, 4
MICRO, M, STEPS = 2, 4, 3              # sequences per micro-batch, micro-batches per replica, optimizer steps
HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BUCKET = 10 ** 6                       # one bucket per stage: the DP bytes are exact, padding included
SCALE = dict(hidden=4096, ffn=16384, layers=32, seq=8192, vocab=128256, micro=1, m=8, dp=8, pp=4, tp=8,
             e=2, eg=4, ep=2, bucket=40_000_000, nvlink_GBps=450.0, ib_GBps=50.0)


def fitting_grids(world):
    """Every dp x pp x tp of `world` the toy model can take: tp divides heads, seq, vocab and ffn, pp the layers."""
    return [(world // (pp * tp), pp, tp) for tp in range(1, world + 1) for pp in range(1, world // tp + 1)
            if world % (pp * tp) == 0 and not (HEADS % tp or SEQ % tp or VOCAB % tp or FFN % tp or LAYERS % pp)]


def choose_grid(world):
    """GRID=dpxppxtp if given, else tp 2 if it divides W, then pp 2 if it divides the rest, dp the rest.
    Returns ((dp, pp, tp), None) or (None, one line naming the value and what would fit)."""
    import os
    raw = os.environ.get("GRID", "").strip()
    fits = " ".join("x".join(map(str, g)) for g in fitting_grids(world))
    if not raw:
        tp = 2 if world % 2 == 0 else 1
        pp = 2 if world // tp % 2 == 0 else 1
        return (world // (tp * pp), pp, tp), None
    parts = raw.lower().split("x")
    if len(parts) != 3 or not all(v.isdigit() and int(v) >= 1 for v in parts):
        return None, f"GRID={raw!r}: write dpxppxtp, three whole numbers >= 1; at {world} ranks these fit: {fits}"
    dp, pp, tp = map(int, parts)
    if (dp, pp, tp) not in fitting_grids(world):
        return None, (f"GRID={raw}: dp {dp} x pp {pp} x tp {tp} needs dp*pp*tp = {world} ranks, tp dividing heads "
                      f"{HEADS}, seq {SEQ}, vocab {VOCAB} and ffn {FFN}, pp dividing {LAYERS} layers; these fit: "
                      f"{fits}")
    return (dp, pp, tp), None


def choose_zero():
    """ZERO=2 (default) or ZERO=3: the data-parallel wrapper of 09 the grid trains with."""
    import os
    raw = os.environ.get("ZERO", "").strip() or "2"
    return (int(raw), None) if raw in ("2", "3") else (None, f"ZERO={raw!r}: give 2 (ZeRO-2, the default) or 3")


def scale_overrides():
    """key=value pairs from the command line and from SCALE="key=value,..."; every bad one is refused in one
    line naming it: a whole number >= 1 for sizes and bytes, a number > 0 for bandwidths, tp dividing what it
    splits and pp the layers. Returns (overrides, None) or ({}, why)."""
    import os
    import sys
    pairs = os.environ.get("SCALE", "").replace(",", " ").split() + sys.argv[1:]
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if key not in SCALE or not eq:
            return {}, (f"{pair!r} is not key=value with a key of {', '.join(SCALE)}"
                        + (" (README's '...' stands for more of them)" if "..." in pair else ""))
        if isinstance(SCALE[key], int):
            if not (value.isdigit() and int(value) >= 1):
                return {}, f"{key}={value}: {key} is a whole number >= 1 (default {key}={SCALE[key]})"
            out[key] = int(value)
        else:
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not 0 < number < math.inf:
                return {}, f"{key}={value}: {key} is a number > 0 (default {key}={SCALE[key]:g})"
            out[key] = number
    c = {**SCALE, **out}
    split = [k for k in ("hidden", "ffn", "seq", "vocab") if c[k] % c["tp"]]
    if split:
        fits = " or ".join(str(d) for d in divisors(c, ("hidden", "ffn", "seq", "vocab")))
        return {}, (f"tp={c['tp']} does not divide {', '.join(f'{k}={c[k]}' for k in split)}: tensor parallelism "
                    f"splits them; tp {fits} would")
    if c["layers"] % c["pp"]:
        return {}, (f"pp={c['pp']} does not divide layers={c['layers']}: each stage holds layers/pp of them; pp "
                    f"{' or '.join(str(d) for d in divisors(c, ('layers',)))} would")
    return out, None


def divisors(c, keys, most=64):
    """The numbers up to `most` that divide every c[k]: what tp or pp could be."""
    return [d for d in range(1, most + 1) if all(c[k] % d == 0 for k in keys)]


def batch(step, dp, device):
    """The global batch of a step, the same on every rank: ids, targets [dp*M*MICRO, SEQ]; ids non-contiguous."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(VOCAB, (SEQ, dp * M * MICRO), generator=g).to(device).t()    # a transposed view
    targets = torch.randint(VOCAB, (dp * M * MICRO, SEQ), generator=g).to(device)
    targets[0, :4] = torch.tensor([0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])         # first/last row of shards
    return ids, targets


def show_grid(grid, world):
    head(f"the grid: {world} ranks = dp {grid.dp_size} x pp {grid.pp_size} x tp {grid.tp_size}, tp fastest")
    for kind, groups in grid.ranks.items():
        log(f"{kind:9} groups: {' '.join(str(g) for g in groups)}")
    want = {8: {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "embedding": [[0, 2], [1, 3], [4, 6], [5, 7]]},
            4: {"tp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]], "dp": [[0], [1], [2], [3]],
                "embedding": [[0, 2], [1, 3]]},                          # the default grids, written out
            (1, 4, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[0, 2, 4, 6], [1, 3, 5, 7]],
                        "dp": [[r] for r in range(8)], "embedding": [[0, 6], [1, 7]]},    # middle stages 1, 2
            (1, 4, 1): {"tp": [[0], [1], [2], [3]], "pp": [[0, 1, 2, 3]], "dp": [[0], [1], [2], [3]],
                        "embedding": [[0, 3]]}}
    shape = (grid.dp_size, grid.pp_size, grid.tp_size)
    if shape in want or (world in want and shape in ((2, 2, 2), (1, 2, 2))):
        assert grid.ranks == want.get(shape, want.get(world)), grid.ranks
    rank, coords = dist.get_rank(), lambda r: (r // (grid.pp_size * grid.tp_size), r // grid.tp_size % grid.pp_size,
                                               r % grid.tp_size)   # (d, p, t) of a global rank, by arithmetic
    mine = {kind: dist.get_process_group_ranks(getattr(grid, kind)) for kind in grid.ranks
            if getattr(grid, kind) is not None}
    assert all(rank in ranks for ranks in mine.values()) and mine["tp"][grid.t] == rank
    for kind, varies in (("tp", 2), ("pp", 1), ("dp", 0)):           # a group varies one coordinate, in order
        assert [coords(r)[varies] for r in mine[kind]] == list(range(len(mine[kind]))), (kind, mine[kind])
        assert all(coords(r)[:varies] + coords(r)[varies + 1:] == coords(rank)[:varies] + coords(rank)[varies + 1:]
                   for r in mine[kind]), (kind, mine[kind])
    ends = sorted({0, grid.pp_size - 1})                               # the stages that hold the tied weight
    assert ("embedding" in mine) == (grid.p in ends), (grid.p, mine)  # a middle stage is in no embedding group
    if "embedding" in mine:
        assert [coords(r) for r in mine["embedding"]] == [(grid.d, p, grid.t) for p in ends], mine["embedding"]
    log("each rank: one group of each kind, varying one coordinate; embedding: first + last stage, none in the middle")
    bad = [(lambda: Grid(grid.dp_size + 1, grid.pp_size, grid.tp_size),
            f"grid dp={grid.dp_size + 1} x pp={grid.pp_size} x tp={grid.tp_size} = {world + world // grid.dp_size} "
            f"ranks, but the world has {world}")]
    if grid.pp_size > 1:                                              # (fitting grids' pp divide LAYERS)
        bad.append((lambda: GPTStage(GPT(VOCAB, HIDDEN, HEADS, FFN, LAYERS + 1), grid),
                    f"{LAYERS + 1} layers do not split evenly over {grid.pp_size} pipeline stages"))
    for make, said in bad:                                           # refused before any group is made
        assert refused(make) == said, said
    log(f"refused: {'; '.join(said for _, said in bad)}")


def train(grid, device, zero):
    """The same GPT trained STEPS steps in one process (whole batch) and on the grid; one step's traffic counted,
    the bytes held measured: gradients at their peak (step 1), activations after each forward (step 2), the rest
    after the last step."""
    head(f"{STEPS} AdamW steps on the grid against one process on the whole batch, float64")
    torch.manual_seed(0)
    gpt = GPT(VOCAB, HIDDEN, HEADS, FFN, LAYERS, dtype=torch.float64).to(device)
    stage = GPTStage(gpt, grid)
    fused = {}  # column weights (the head too): in how many backwards their layer added dW into main_grad itself
    for m in stage.modules():
        if isinstance(m, tp_layers.ColumnParallelLinear):  # a hook before 09's: it sees the layer's flag
            m.weight.register_post_accumulate_grad_hook(
                lambda p: fused.__setitem__(id(p), fused.get(id(p), 0) + p.grad_added_to_main_grad))
    model = data_parallel(stage, grid, BUCKET, zero, **HYPER)
    comm = pipeline.P2PCommunicator((SEQ // grid.tp_size, MICRO, HIDDEN), torch.float64, device, grid.pp)
    opt = torch.optim.AdamW(gpt.parameters(), **HYPER)
    rows = slice(grid.d * M * MICRO, (grid.d + 1) * M * MICRO)      # this replica's share of the batch
    micro = lambda t: list(t[rows].split(MICRO))
    counted, held, kept = None, {}, []
    for step in range(STEPS):
        ids, targets = batch(step, grid.dp_size, device)
        opt.zero_grad()
        ref_loss = F.cross_entropy(gpt(ids).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        check = None
        if step == 0:      # this replica's share of the gradient: what ZeRO is handed
            share = F.cross_entropy(gpt(ids[rows]).flatten(0, 1), targets[rows].flatten())  # ZeRO averages
            share = dict(zip(gpt.parameters(), torch.autograd.grad(share, list(gpt.parameters()))))
            check = lambda: check_grads(stage, gpt, share)
        opt.step()
        if step == 1:      # the gradients at their peak: all micro-batches added up, before the DP reduction
            check = lambda: held.update(gradients=held_bytes([t for b in model.buckets for t in (b.grad, b.main)]))
        with traffic() if step == 1 else saved_activations(stage, kept) if step == 2 else \
                contextlib.nullcontext() as t:
            loss = train_step(stage, model, comm, micro(ids), micro(targets), check)
        counted = t if step == 1 else counted
        check_loss(loss, ref_loss, grid)
    log(f"loss of each of the {STEPS} steps == one process's on the whole batch (mean over DP on the last stage)")
    columns = {id(m.weight) for m in stage.modules() if isinstance(m, tp_layers.ColumnParallelLinear)}
    assert fused == dict.fromkeys(columns, STEPS * M), (fused, len(columns))
    log(f"{len(columns)} column weights (qkv, fc1{', the tied head' if grid.is_last else ''}): dW into main_grad by "
        f"the layer in each of the {STEPS * M} backwards" + (" (zero_out_wgrad: the lookup's .grad added too)"
                                                               if grid.is_first and grid.is_last else ""))
    state = [t for st in model.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    held.update(parameters=held_bytes([t for b in model.buckets for t in (b.flat, b.local)]),
                optimizer=held_bytes(state + [b.opt for b in model.buckets if b.opt is not b.local]),
                activations=max(kept), first=kept[0])   # (ZeRO-2's all-gather may still be in flight: bytes alike)
    params = model.full_parameters()                  # waits for ZeRO-2's last all-gather; ZeRO-3 gathers
    for name, want in stage.shards_of(gpt).items():
        torch.testing.assert_close(params[name], want, rtol=1e-10, atol=1e-12, msg=lambda s: f"{name}: {s}")
    log(f"after {STEPS} steps every parameter shard on every rank == its slice of the one-process GPT")
    return counted, stage, model, held


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


class SPMLPBlock(nn.Module):
    """06's mlp_block as a module: this rank's TP shards of one dense LayerNorm + MLP, x + fc2(GeLU(fc1(LN(x)))),
    [s/tp, b, h] in and out (SP). fc1's weight gets its gradient through 06's SP linear straight into main_grad."""

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


def compose(world, device):
    """06's SP MLP block inside 09's DDP, ZeRO-2 and ZeRO-3 on a tp x dp grid: 3 AdamW steps == one process."""
    tp = 2 if world % 2 == 0 else 1
    grid = Grid(world // tp, 1, tp, timeout=pg_timeout())
    head(f"06's SP MLP block in 09's DDP, ZeRO-2, ZeRO-3 on tp {tp} x dp {grid.dp_size}: 3 AdamW steps, 1 process")
    s, b, h, f = 4 * tp, 2 * grid.dp_size, 8, 16
    # eps 1 (gradients here are O(1)): the update is continuous in the gradient, so bf16's rounding moves it as
    # little as it moves the gradient; with eps 1e-8 AdamW takes the sign of a near-zero gradient, which bf16 flips
    hyper = dict(lr=0.01, betas=(0.9, 0.95), eps=1.0, weight_decay=0.1)
    seq, rows = slice(grid.t * s // tp, (grid.t + 1) * s // tp), slice(grid.d * 2, grid.d * 2 + 2)
    worst = {}
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2 ** -16), (torch.bfloat16, 2 ** -7)):
        for cls in (data_par.DDP, data_par.ZeRO2, data_par.ZeRO3):
            torch.manual_seed(1)
            ln, fc1, fc2 = nn.LayerNorm(h), nn.Linear(h, f), nn.Linear(f, h)
            dense = nn.ModuleList([ln, fc1, fc2]).to(device, torch.float64)
            with torch.no_grad():                                     # start from values bf16 holds exactly
                for p in dense.parameters():
                    p.copy_(p.to(dtype))
            block = SPMLPBlock(ln, fc1, fc2, grid.tp).to(dtype)
            model = cls(block, 40, group=grid.dp, **hyper)
            opt = torch.optim.AdamW(dense.parameters(), **hyper)
            for step in range(3):
                g = torch.Generator().manual_seed(10 + step)
                x, target = (torch.randn(s, b, h, generator=g, dtype=torch.float64).to(device) for _ in range(2))
                opt.zero_grad()
                y = x + fc2(F.gelu(fc1(ln(x))))
                (y * target).sum().backward()                         # the whole batch, one process
                opt.step()
                with model.no_sync():                                 # this rank: its replica's rows, its TP slice
                    y = model(x[seq, rows].to(dtype))
                    ((y.double() * target[seq, rows]).sum() * grid.dp_size).backward()  # DP averages: x dp
                seq_par.allreduce_sequence_parallel_grads(block.parameters(), group=grid.tp)  # LN, b2: over TP
                model.sync_gradients()
                model.step()
            if cls is not data_par.DDP:                               # bytes held: ZeRO's closed forms
                ep = torch.finfo(dtype).bits // 8                     # gradients and AdamW in fp32 or wider
                c = dict(dp=grid.dp_size, ep=ep, eg=max(ep, 4), pp=1, m=1, layers=1, act=0)
                want = step_memory(c, 0, 3 if cls is data_par.ZeRO3 else 2, sum(bk.numel for bk in model.buckets))
                state = [t for st in model.optimizer.state.values() for t in st.values() if t.dim()]
                assert (held_bytes([t for bk in model.buckets for t in (bk.flat, bk.local)]) == want["parameters"]
                        and held_bytes(state + [bk.opt for bk in model.buckets if bk.opt is not bk.local]) ==
                        want["optimizer"]), (cls.__name__, dtype, want)
            got, scale = model.full_parameters(), max(p.abs().max().item() for p in dense.parameters())
            err = max(((got[n].double() - w).abs().max().item() for n, w in block.shards_of(ln, fc1, fc2).items()))
            worst[(dtype, cls.__name__)] = err / max(scale, 1)
            assert worst[(dtype, cls.__name__)] <= tol, (cls.__name__, dtype, err)
    log(f"DDP, ZeRO-2, ZeRO-3 == one process after 3 steps: float64 within 1e-12, fp32 2^-16, bf16 (fp32 master) "
        f"2^-7 (worst {max(v for (d, _), v in worst.items() if d == torch.bfloat16):.1e}) of max(|w|, 1)")
    log("ZeRO's parameter and optimizer bytes == the closed forms in each dtype (fp32 master beside bf16 only)")


def check_grads(stage, gpt, share):
    grads = {n: p.main_grad for n, p in stage.named_parameters()}
    want = stage.shards_of(gpt, lambda p: share[p])
    assert sorted(want) == sorted(grads), (sorted(want), sorted(grads))
    for name, w in want.items():
        torch.testing.assert_close(grads[name], w, rtol=1e-9, atol=1e-13, msg=lambda s: f"grad {name}: {s}")
    log("step 1, before the DP reduction: every gradient shard == one process's on this replica's micro-batches")


def check_loss(loss, ref_loss, grid):
    assert (loss is not None) == grid.is_last, loss
    if grid.is_last:
        loss = loss.clone()
        dist.all_reduce(loss, group=grid.dp)                         # the replicas' mean: the whole batch's
        torch.testing.assert_close(loss / grid.dp_size, ref_loss.detach(), rtol=1e-12, atol=0)


def tally(calls, grid):
    """{(group kind, collective): (calls, bytes this rank sent)} from traffic().calls, each call's group known by
    its ranks (a PP group and an embedding group may hold the same two ranks: P2P is the pipeline's), the bytes
    by common.ring_bytes (not step_traffic's RING). Calls on a group of one rank move nothing and are left out; a
    group that is none of this rank's shows as its ranks."""
    mine = {kind: tuple(dist.get_process_group_ranks(getattr(grid, kind))) for kind in grid.ranks
            if getattr(grid, kind) is not None}
    out = {}
    for op, ranks, nbytes in calls:
        if len(ranks) == 1:
            continue
        kinds = [k for k, r in mine.items() if r == ranks] or [str(list(ranks))]
        if len(kinds) > 1:                                            # pp and embedding: the same two ranks
            kinds = ["pp" if op in ("send", "recv") else "embedding"]
        kind = kinds[0]
        n, sent = out.get((kind, op), (0, 0))
        w = len(ranks)  # traffic() records what each call is handed: an all-gather's input is 1/w of its output
        out[(kind, op)] = (n + 1, sent + ({"send": nbytes, "recv": 0}[op] if op in ("send", "recv") else
                                          ring_bytes(op, nbytes * w if op == "all_gather" else nbytes, w)))
    return out


def toy_config(grid, zero=2):
    c = dict(hidden=HIDDEN, ffn=FFN, layers=LAYERS, seq=SEQ, vocab=VOCAB, micro=MICRO, m=M, dp=grid.dp_size,
             pp=grid.pp_size, tp=grid.tp_size, e=8, eg=8, ep=8, zero=zero)
    c["buckets"] = [-(-stage_numel(c, grid.p) // grid.dp_size) * grid.dp_size]  # one bucket, padded to dp
    return c


def traffic_is(calls, grid, c):
    """The calls traffic() counted, tallied per (group kind, collective), == step_traffic(c) on this rank's stage:
    the same keys, calls and bytes. Returns the tally."""
    got, want = tally(calls, grid), step_traffic(c, grid.p)
    assert got.keys() == want.keys() and all(got[k][0] == want[k][0] and
                                             math.isclose(got[k][1], want[k][1], rel_tol=1e-12) for k in want), \
        (dist.get_rank(), sorted(got.items()), sorted(want.items()))
    return got


def count_traffic(counted, grid, zero):
    head("one step's collectives, counted per group, against the docstring's closed forms")
    got = traffic_is(counted.calls, grid, toy_config(grid, zero))
    middle = 0 < grid.p < grid.pp_size - 1                            # no tied weight: no embedding all-reduce,
    assert not middle or not any(kind not in ("tp", "pp", "dp") for kind, _ in got), got  # nor any other group
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, got)
    pipe = grid.ranks["pp"][0]                                        # replica 0's stages, TP rank 0
    shown = sorted({0, min(1, grid.pp_size - 1), grid.pp_size - 1})  # first, a middle one, last
    rows = sorted(set().union(*(everyone[pipe[s]] for s in shown)))
    log(f"{'group':10} {'collective':15} " + " ".join(f"{f'stage {s}: calls':>15} {'bytes sent':>11}" for s in shown))
    for key in rows:
        cells = [everyone[pipe[s]].get(key, (0, 0)) for s in shown]
        log(f"{key[0]:10} {key[1]:15} " + " ".join(f"{n:>15} {round(b):>11}" for n, b in cells))
    log(f"every rank's calls and bytes per (group, collective) == the closed forms (A = {SEQ}x{MICRO}x{HIDDEN}x8, "
        f"m = {M})"
        + ("; middle stages: no tied-weight all-reduce" if grid.pp_size > 2 else ""))


def count_traffic_mixed(grid, device, zero):
    """Two steps of the same GPT in bf16 (09's fp32 gradients and master), the second's traffic against the closed
    forms with each dtype its own (float64 gives every term 8 bytes): activations e = 2, the loss's statistics
    fp32, gradients eg = 4, parameters ep = 2."""
    torch.manual_seed(0)
    stage = GPTStage(GPT(VOCAB, HIDDEN, HEADS, FFN, LAYERS, dtype=torch.bfloat16).to(device), grid)
    model = data_parallel(stage, grid, BUCKET, zero, **HYPER)
    comm = pipeline.P2PCommunicator((SEQ // grid.tp_size, MICRO, HIDDEN), torch.bfloat16, device, grid.pp)
    rows = slice(grid.d * M * MICRO, (grid.d + 1) * M * MICRO)
    for step in range(2):
        ids, targets = (t[rows].split(MICRO) for t in batch(step, grid.dp_size, device))
        with traffic() if step else contextlib.nullcontext() as t:
            train_step(stage, model, comm, list(ids), list(targets))
    model.full_parameters()                                           # ZeRO-2's last all-gather, waited for
    traffic_is(t.calls, grid, {**toy_config(grid, zero), "e": 2, "eg": 4, "ep": 2})
    log("bf16 (fp32 gradients and master): one step's calls and bytes == the closed forms with e = 2, eg = 4, ep = 2")


def count_memory(held, model, grid, zero):
    head(f"bytes each rank holds at its peak (ZeRO-{zero}, float64), measured against the closed forms")
    c = toy_config(grid, zero)
    [numel] = [b.numel for b in model.buckets]                        # one bucket: the stage, padded to dp
    assert [numel] == c["buckets"], (numel, c["buckets"])            # stage_numel, the scale tables' count
    k = min(grid.pp_size - grid.p, M)                                 # 1F1B: micro-batches in flight on stage p
    c["act_stage"] = held["first"]                                    # one micro-batch's on this stage, measured
    want = step_memory(c, grid.p, zero, numel)
    got = {key: held[key] for key in want}
    assert held["first"] > 0 and got == want, (dist.get_rank(), got, want)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (grid.p, k, held["first"], got))
    rows = {}
    for p, k_, first, g in everyone:                                  # TP rank 0 of replica 0 speaks for a stage
        rows.setdefault(p, (k_, first, g))
    log(f"{'stage':>5} {'parameters':>11} {'gradients':>10} {'optimizer':>10} {'activations':>12}  = in flight x one")
    for p, (k_, first, g) in sorted(rows.items()):
        log(f"{p:>5} {g['parameters']:>11} {g['gradients']:>10} {g['optimizer']:>10} {g['activations']:>12}  "
            f"= {k_} x {first}")
    log(f"every rank == the closed forms: parameters {'1/dp of ' if zero == 3 else ''}the stage's, gradients the "
        f"stage's + 1/dp, AdamW 2/dp; activations min(pp - stage, m) x one")


def scale(overrides, zero):
    """The closed forms asserted above, for a real model: bytes each rank sends per step and the seconds, and the
    bytes each rank holds under ZeRO-1, 2 and 3."""
    c = {**SCALE, **overrides, "zero": zero}
    head(f"the same forms at scale: hidden {c['hidden']}, {c['layers']} layers, seq {c['seq']}, vocab {c['vocab']}, "
         f"{c['m']} micro-batches of {c['micro']}, dp {c['dp']} x pp {c['pp']} x tp {c['tp']}")
    log(f"bytes an element: activations {c['e']}, gradients {c['eg']}, parameters {c['ep']}; TP at "
        f"{c['nvlink_GBps']:g} GB/s (NVLink), the others {c['ib_GBps']:g} GB/s (InfiniBand)")
    link = {"tp": c["nvlink_GBps"], "pp": c["ib_GBps"], "dp": c["ib_GBps"], "embedding": c["ib_GBps"]}
    stages = sorted({0, c["pp"] - 1})
    per_stage = []
    for stage in stages:
        numel = stage_numel(c, stage)
        full, rest = divmod(numel, c["bucket"])
        by_group = {}
        for (kind, op), (n, sent) in step_traffic({**c, "buckets": [c["bucket"]] * full + [rest] * bool(rest)},
                                                   stage).items():
            calls, b = by_group.get(kind, (0, 0))
            by_group[kind] = (calls + n, b + sent)
        per_stage.append(by_group)
    log("parameters a rank: " + ", ".join(f"stage {s} {stage_numel(c, s) / 1e6:,.1f} million "
                                          f"({stage_numel(c, s) * c['ep'] / 1e9:.2f} GB)" for s in stages))
    log(f"{f'ZeRO-{zero}':10} " + " ".join(f"{f'stage {s}: calls':>15} {'GB sent':>8} {'seconds':>8}" for s in stages))
    for kind in sorted(set().union(*per_stage)):
        cells = [by_group.get(kind, (0, 0)) for by_group in per_stage]
        log(f"{kind:10} " + " ".join(f"{n:>15} {float(b) / 1e9:>8.2f} {float(b) / 1e9 / link[kind]:>8.3f}"
                                     for n, b in cells))
    log("seconds if nothing overlaps; TP sits on the critical path of every layer, DP can hide behind backward")
    act = 34 * c["seq"] * c["micro"] * c["hidden"] // c["tp"] * c["e"] // 2   # Korthikanti et al. 2022, with SP
    log(f"GB held at the peak; activations 34*s*b*h/tp*e/2 = {act / 1e6:.0f} MB a layer and micro-batch (flash: no "
        f"s^2 term)")
    log(f"{'':10} " + " ".join(f"{f'stage {s}: params':>15} {'grads':>6} {'optim':>6} {'activ':>6} {'total':>6}"
                               for s in stages))
    for z in (1, 2, 3):
        cells = [step_memory({**c, "act": act}, s, z) for s in stages]
        log(f"{f'ZeRO-{z}':10} " + " ".join(f"{d['parameters'] / 1e9:>15.1f} {d['gradients'] / 1e9:>6.1f} "
                                             f"{d['optimizer'] / 1e9:>6.1f} {d['activations'] / 1e9:>6.1f} "
                                             f"{sum(d.values()) / 1e9:>6.1f}" for d in cells))
    log(f"ZeRO-2/3 keep the whole gradient while {c['m']} micro-batches add up (reducing each: {c['m']} x DP's bytes)")


def main():
    W = launched_world_size()
    shape, why = choose_grid(W)                       # every input checked before any work: one line on each rank
    zero, bad_zero = choose_zero()
    overrides, bad = scale_overrides()
    if why or bad_zero or bad:
        refuse(why or bad_zero or bad)
    rank, world, device = setup()
    grid = Grid(*shape, timeout=pg_timeout())
    show_grid(grid, world)
    compose(world, device)
    counted, stage, model, held = train(grid, device, zero)
    count_traffic(counted, grid, zero)
    count_traffic_mixed(grid, device, zero)
    count_memory(held, model, grid, zero)
    scale(overrides, zero)
    finish(f"a GPT on dp {grid.dp_size} x pp {grid.pp_size} x tp {grid.tp_size} (SP, vocab-parallel, 1F1B, "
           f"ZeRO-{zero}) == one process over {STEPS} steps; bytes sent and held == the closed forms")


if __name__ == "__main__":
    main()
