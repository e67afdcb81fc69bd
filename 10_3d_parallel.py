"""10 - 3D parallelism: a Llama trained with data, pipeline, tensor, sequence and vocabulary parallelism at once.

torchtitan's parallelize recipe on the blocks of 05-09 (imported by importlib: a module name cannot start with a
digit): cut the model into pipeline stages (08), make every linear tensor- and sequence-parallel (05, 06) and the
embedding, head and loss vocabulary-parallel (07), wrap each stage in ZeRO over data parallelism (09), run the
micro-batches in 1F1B order (08). The model is Llama's, in torchtitan's names: tok_embeddings; L blocks of
attention_norm -> attention (grouped-query: H query heads share H_kv K/V heads; rotary positions) and ffn_norm ->
feed_forward (SwiGLU: w2(silu(w1 x) * w3 x)); norm; output, tied to the embedding as in Llama 3.2 1B (TIED=0:
untied, as in Llama 3). W = dp * pp * tp ranks, tp fastest: rank = (d * pp + p) * tp + t (picotron's order):

            replica d=0               replica d=1         TP groups  [0 1] [2 3] [4 5] [6 7]   (NVLink)
        stage 0     stage 1       stage 0     stage 1     PP groups  [0 2] [1 3] [4 6] [5 7]   (across nodes)
       [ 0  1 ] -> [ 2  3 ]      [ 4  5 ] -> [ 6  7 ]     DP groups  [0 4] [1 5] [2 6] [3 7]   (across nodes)
        t=0 t=1     t=0 t=1       t=0 t=1     t=0 t=1     embedding  [0 2] [1 3] [4 6] [5 7]   (first + last stage)

Who holds what (activations: Megatron's [s, b, h], split along s over TP between layers, [s/tp, b, h]). Stage 0:
the embedding's V/tp rows, its partial sums reduce-scattered to [s/tp, b, h]. Every stage: L/pp layers; TP rank t
their query heads [t H/tp, (t+1) H/tp) and K/V heads [t H_kv/tp, ..) (wq|wk|wv fused by rank into one column-parallel
wqkv), ffn/tp of SwiGLU (w1|w3 fused by rank into w13; w2 row-parallel), the norms whole (applied to [s/tp, b, h]:
their gradients summed over TP). Last stage: the final norm, the head's V/tp rows (tied over two stages: a copy of
the embedding's, their gradients summed over the embedding group), the loss.

One step, bytes each rank SENDS (ring: all-reduce 2(n-1)/n of its input, all-gather (n-1) x, reduce-scatter
(n-1)/n); A = s*b*h*e one micro-batch's whole activation, m micro-batches, t = tp, L/pp layers a stage:
  TP per layer and micro-batch: 6 all-gathers of A/t (wqkv, w13 forward and again in backward; wo's, w2's backward)
      and 4 reduce-scatters of A (wo, w2 forward; wqkv's, w13's dx): 10 (t-1)/t A (GQA shrinks wqkv, not x). Per
      micro-batch, stage 0: the embedding's reduce-scatter and its backward all-gather; the last stage: the head's
      2 all-gathers + 1 reduce-scatter and the loss's all-gather of 3 fp32 a token. Per step: the norms'
      gradients, an all-reduce of 2h a layer (+h on the last stage).
  PP per micro-batch: A/t forward unless last stage, A/t back unless first, each behind a header of 56 B (08).
      Tied, pp > 1: the embedding group all-reduces V/t*h once.
  DP per bucket: reduce-scatter (dp-1)/dp of its gradients; all-gather (dp-1)/dp of its parameters once (ZeRO-2)
      or for each F and each B, 2m times (ZeRO-3).
Bytes each rank HOLDS at its peak, P parameters a rank: parameters P*ep (ZeRO-3: P/dp*ep + the buckets in use);
gradients P*eg (added up over the micro-batches under no_sync) + P/dp*eg reduced; AdamW 2P/dp*eg (+4P/dp fp32
master for narrower parameters); activations: stage p keeps min(pp - p, m) micro-batches', each s*b/t*e*(4h +
(4H + 3H_kv)d + 4 ffn) a layer (flash attention); the last stage also its logits and their gradient.

    torchrun --nproc-per-node=8 10_3d_parallel.py     (1-4 ranks too; ZERO=3: ZeRO-3; TIED=0: Llama 3's head)
bench/10_scale.py evaluates these forms for any Llama on any grid: the seconds at link speeds, the bytes held.
tests/check_10.py proves the rest: more grids, gradient shards, fused dW, bf16 traffic, bytes held, refusals, joints.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ---- building blocks: the lessons' blocks, composed (needs 05-09 beside it, and torch) -------------------------
import copy
import importlib
from fractions import Fraction

tp_layers = importlib.import_module("05_tp_layers")          # Column/RowParallelLinear (SP, fused), SwiGLU MLP
seq_par = importlib.import_module("06_sequence_parallel")    # apply_rope: rotary positions
vocab_par = importlib.import_module("07_vocab_parallel")     # VocabParallelEmbedding, the vocab-parallel loss
pipeline = importlib.import_module("08_pipeline_1f1b")       # schedule_1f1b, P2PCommunicator, run_schedule
data_par = importlib.import_module("09_ddp_zero2")           # ZeRO-2, ZeRO-3 (nn.Modules, main_grad handshake)


class Grid:
    """dp x pp x tp process groups, tp fastest: rank = (d * pp + p) * tp + t. Every rank creates every group, in
    the same order (dist.new_group's rule). self.tp / .pp / .dp / .embedding: this rank's groups (embedding: None
    on a middle stage and where pp = 1); self.ranks: {kind: [global ranks of each group]}; self.d, .p, .t: this
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
                      "embedding": [[ranks[0], ranks[-1]] for ranks in pipes if pp > 1]}  # first, last stage
        for kind in ("tp", "pp", "dp"):
            made = [dist.new_group(ranks, timeout=timeout) for ranks in self.ranks[kind]]
            setattr(self, kind, next(g for g, ranks in zip(made, self.ranks[kind]) if rank in ranks))
        self.embedding = pipeline.embedding_group(pipes, timeout)     # 08's (None: a middle stage, or pp = 1)
        self.is_first, self.is_last = self.p == 0, self.p == pp - 1


class Llama(nn.Module):
    """The model in one process, torchtitan's names: ids [b, s] -> logits [b, s, V]."""

    def __init__(self, vocab, hidden, heads, kv_heads, ffn, layers, tied=False, dtype=None):
        super().__init__()
        d, kw, norm = hidden // heads, dict(bias=False, dtype=dtype), lambda: nn.RMSNorm(hidden, 1e-5, dtype=dtype)
        line = lambda i, o: nn.Linear(i, o, **kw)
        self.heads, self.kv_heads, self.head_dim, self.tied = heads, kv_heads, d, tied
        self.tok_embeddings = nn.Embedding(vocab, hidden, dtype=dtype)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            attention_norm=norm(), ffn_norm=norm(),
            attention=nn.ModuleDict(dict(wq=line(hidden, heads * d), wk=line(hidden, kv_heads * d),
                                         wv=line(hidden, kv_heads * d), wo=line(heads * d, hidden))),
            feed_forward=nn.ModuleDict(dict(w1=line(hidden, ffn), w3=line(hidden, ffn), w2=line(ffn, hidden)))))
            for _ in range(layers))
        self.norm, self.output = norm(), line(hidden, vocab)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        x, pos = self.tok_embeddings(ids), torch.arange(ids.shape[1], device=ids.device)     # [b, s, h]
        rope = lambda t: seq_par.apply_rope(t, pos, layout="bshd", base=5e5)   # Llama 3's base
        for blk in self.layers:
            a, f, h = blk.attention, blk.feed_forward, blk.attention_norm(x)
            q, k, v = (w(h).unflatten(-1, (-1, self.head_dim)) for w in (a.wq, a.wk, a.wv))  # [b, s, heads, d]
            q, k, v = (t.transpose(1, 2) for t in (rope(q), rope(k), v))                      # [b, heads, s, d]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.wo(o.transpose(1, 2).flatten(2))
            h = blk.ffn_norm(x)
            x = x + f.w2(F.silu(f.w1(h)) * f.w3(h))
        return self.output(self.norm(x))


def fused(*linears):
    """One dense nn.Linear whose rows are the linears' in turn ([wq; wk; wv], [w1; w3]): what 05's fused_shard
    splits by pieces, rank t getting its query heads, then its K/V heads (its gate, then its up rows)."""
    dense = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears), bias=False, device="meta")
    dense.weight = nn.Parameter(torch.cat([m.weight for m in linears]).detach())
    return dense


class Attention(nn.Module):
    """Grouped-query attention on this rank's heads, [s/tp, b, h] in and out: wqkv (05's column layer, fused by
    heads) all-gathers the sequence, q and k turn by their global positions (the whole sequence, 0..s-1: 06's
    apply_rope), SDPA, wo reduce-scatters the sequence again."""

    def __init__(self, dense, heads, kv_heads, group):
        super().__init__()
        tp = dist.get_world_size(group)
        self.wqkv = tp_layers.ColumnParallelLinear.from_dense(fused(dense.wq, dense.wk, dense.wv), group, fused=(
            heads, kv_heads, kv_heads), sequence_parallel=True, check_slices=False)   # (slices: a reduce-scatter's)
        self.wo = tp_layers.RowParallelLinear.from_dense(dense.wo, group, sequence_parallel=True)
        self.split = [heads // tp, max(kv_heads // tp, 1), max(kv_heads // tp, 1)]   # (tp > H_kv: replicated)

    def forward(self, x):
        qkv = self.wqkv(x)                                            # [s, b, (H + 2 H_kv) d / tp]
        q, k, v = qkv.unflatten(-1, (sum(self.split), -1)).split(self.split, 2)       # [s, b, heads, d]
        pos = torch.arange(qkv.shape[0], device=x.device)
        q, k = (seq_par.apply_rope(t, pos, layout="sbhd", base=5e5) for t in (q, k))
        o = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                           enable_gqa=True)          # [b, heads, s, d]
        return self.wo(o.permute(2, 0, 1, 3).flatten(2))              # [s, b, H d/tp] -> [s/tp, b, h]


def feed_forward(dense, group):
    """SwiGLU on this rank's ffn/tp columns, [s/tp, b, h] in and out: 05's gated parallel_mlp, w1|w3 fused."""
    mlp = tp_layers.parallel_mlp((fused(dense.w1, dense.w3), nn.SiLU(), dense.w2), group, sequence_parallel=True,
                                 gated=True)
    mlp[0].check_slices = False                                       # its slices come from a reduce-scatter
    return mlp


class LlamaStage(nn.Module):
    """This rank's part of the Llama, its parameters the one-process model's slices: its stage's layers, the
    embedding (first stage), the final norm and the head (last stage), split over grid.tp. forward: ids [b, s] or
    [s/tp, b, h] -> [s/tp, b, h], or logits [s, b, V/tp] (last stage). Tied on one stage, the head's weight is the
    embedding's Parameter: the lookup writes its .grad, so it carries zero_out_wgrad (Megatron's rule)."""

    def __init__(self, llama, grid):
        super().__init__()
        tp, n = grid.tp, len(llama.layers)
        if n % grid.pp_size:
            raise ValueError(f"{n} layers do not split evenly over {grid.pp_size} pipeline stages")
        per, self.is_first, self.is_last = n // grid.pp_size, grid.is_first, grid.is_last
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            attention_norm=copy.deepcopy(blk.attention_norm), ffn_norm=copy.deepcopy(blk.ffn_norm),
            attention=Attention(blk.attention, llama.heads, llama.kv_heads, tp),
            feed_forward=feed_forward(blk.feed_forward, tp))) for blk in llama.layers[grid.p * per:(grid.p + 1) * per])
        if self.is_first:                      # reduce-scattered to [s/tp, b, h] (Megatron's reduce_scatter_embeddings)
            self.tok_embeddings = vocab_par.VocabParallelEmbedding.from_dense(llama.tok_embeddings, tp,
                                                                               sequence_parallel=True)
        if self.is_last:
            self.norm = copy.deepcopy(llama.norm)
            self.output = tp_layers.ColumnParallelLinear.from_dense(llama.output, tp, sequence_parallel=True,
                                                                    check_slices=False)   # its V/tp rows
            if llama.tied and self.is_first:
                self.output.weight = self.tok_embeddings.weight
                self.output.weight.zero_out_wgrad = True
        for name, p in self.named_parameters():
            p.sequence_parallel = name.endswith("norm.weight")       # applied to [s/tp]: summed over TP
        self.tied = llama.tied and grid.pp_size > 1 and (self.is_first or self.is_last)   # summed over embedding

    def forward(self, x):
        if self.is_first:
            x = self.tok_embeddings(x.t())                            # ids [b, s] -> [s, b] -> [s/tp, b, h]
        for blk in self.layers:
            x = x + blk.attention(blk.attention_norm(x))
            x = x + blk.feed_forward(blk.ffn_norm(x))
        return self.output(self.norm(x)) if self.is_last else x      # logits [s, b, V/tp]


def parallelize(llama, grid, zero=2, bucket_cap_mb=1024, **adamw):
    """torchtitan's recipe on this rank: the pipeline stage with TP, SP and vocabulary parallelism (LlamaStage),
    an AdamW over it, then ZeRO-2 or ZeRO-3 over grid.dp (09's wrapper; it keeps the grid) -> (model, optimizer)."""
    stage = LlamaStage(llama, grid)
    optimizer = torch.optim.AdamW(stage.parameters(), **adamw)
    model = (data_par.ZeRO2 if zero == 2 else data_par.ZeRO3)(stage, optimizer, grid.dp, bucket_cap_mb)
    model.grid = grid
    return model, optimizer


def finalize_grads(stage, grid):
    """After the last micro-batch, before the DP reduction: sum over TP the norms' gradients (SP applied them to a
    slice of the sequence, 06), and a tied weight's two copies over the embedding group (Megatron's
    finalize_model_grads does both after its DP reduction: sums, so the order is free). 09 adds into main_grad."""
    tp_layers.allreduce_sequence_parallel_grads(stage.parameters(), group=grid.tp)    # reads p.main_grad
    if stage.tied:                 # 08's: into main_grad, before ZeRO shards it
        tied = stage.tok_embeddings if stage.is_first else stage.output
        pipeline.allreduce_tied_grad(tied.weight, grid.embedding)


def train_step(model, optimizer, comm, ids, targets, before_step=None):
    """One step of this rank: the micro-batches through the pipeline in 1F1B order (08), their gradients added up
    without DP traffic (no_sync); finalize_grads; ZeRO's reduce-scatter and AdamW step (09). Returns the mean
    loss over this replica's micro-batches on the last stage, else None."""
    def loss_fn(logits, target):                  # logits [s, b, V/tp] (equal slices: no check), target [b, s]
        return vocab_par.vocab_parallel_cross_entropy(logits, target.t(), group=model.grid.tp, check_slices=False)

    with model.no_sync():
        loss, _, _ = pipeline.run_schedule(model.module, pipeline.schedule_1f1b, comm, ids, targets, loss_fn)
    finalize_grads(model.module, model.grid)
    if before_step is not None:
        before_step()                                                 # (the checks read the gradients here)
    model.sync_gradients()                                            # one reduce-scatter per bucket
    optimizer.step()                              # AdamW on this rank's shard (ZeRO-2 then all-gathers it)
    optimizer.zero_grad(set_to_none=True)
    return loss


# ---- the closed forms of the docstring (c: the sizes, as SCALE below) ------------------------------------------
RING = {"all_reduce": lambda n: Fraction(2 * (n - 1), n), "all_gather": lambda n: n - 1,
        "reduce_scatter": lambda n: Fraction(n - 1, n), "send": lambda n: 1, "recv": lambda n: 0}


def step_traffic(c, stage):
    """{(group kind, collective): (calls, bytes this rank sends)} in one step of stage `stage`; c["buckets"]: the
    elements of each DP bucket."""
    t, pp, m, h = c["tp"], c["pp"], c["m"], c["hidden"]
    first, last, per, A = stage == 0, stage == pp - 1, c["layers"] // pp, c["micro"] * c["seq"] * h * c["e"]
    out = {}

    def add(kind, op, n, calls, payload):                             # payload: the bytes handed in per call
        if n > 1 and calls:
            old = out.get((kind, op), (0, 0))
            out[(kind, op)] = (old[0] + calls, old[1] + calls * RING[op](n) * payload)

    add("tp", "all_gather", t, (6 * per + first + 2 * last) * m, A // t)   # layers; embedding's and head's backward
    add("tp", "reduce_scatter", t, (4 * per + first + last) * m, A)        # layers; embedding; the head's dx
    add("tp", "all_gather", t, last * m, 3 * c["micro"] * c["seq"] * max(c["e"], 4))   # the loss: 3 fp32 a token
    add("tp", "all_reduce", t, 1, (2 * h * per + (h if last else 0)) * c["eg"])      # the norms' gradients
    for payload in (A // t, 8 * (2 + pipeline.MAX_NDIM)):           # each message behind 08's header of 7 int64
        add("pp", "send", pp, m * (2 - first - last), payload)
        add("pp", "recv", pp, m * (2 - first - last), payload)
    add("embedding", "all_reduce", min(pp, 2), c["tied"] * (first or last), c["vocab"] // t * h * c["eg"])
    for numel in c["buckets"]:                        # ZeRO-3 gathers each bucket for every F and every B instead
        add("dp", "reduce_scatter", c["dp"], 1, numel * c["eg"])
        add("dp", "all_gather", c["dp"], 2 * m if c["zero"] == 3 else 1, numel // c["dp"] * c["ep"])
    return out


def stage_numel(c, stage):
    """Elements of stage `stage`'s parameters on a TP rank (tp = pp = 1: the model's): a layer's 2 norms, wqkv and wo
    (H + 2 H_kv and H heads of h/H), SwiGLU's 3 matrices; the embedding (first); the norm and head (last, or tied)."""
    h, t, pp, last = c["hidden"], c["tp"], c["pp"], stage == c["pp"] - 1
    layer = 2 * h + ((2 * c["heads"] + 2 * c["kv_heads"]) * (h // c["heads"]) * h + 3 * c["ffn"] * h) // t
    tables = (stage == 0) + (last and not (c["tied"] and pp == 1))
    return c["layers"] // pp * layer + tables * c["vocab"] // t * h + (h if last else 0)


# ---- demo: the grid against one process (needs common.py; the blocks need only torch) -------------------------
import contextlib
import os

from common import finish, head, log, pg_timeout, refuse, ring_bytes, setup, traffic  # (beside 05-09, as they are)

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, SEQ = 64, 32, 8, 4, 48, 4, 8   # tp in 1, 2, 4; pp in 1, 2, 4
MICRO, M, STEPS = 2, 4, 3              # sequences per micro-batch, micro-batches per replica, optimizer steps
HYPER = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LLAMA3_70B = dict(hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80, vocab=128256, tied=0)
SCALE = dict(LLAMA3_70B, seq=8192, micro=1, m=16, dp=16, pp=8, tp=8, e=2, eg=4, ep=2, bucket_mb=25.0,
             nvlink_GBps=450.0, ib_GBps=50.0)             # what bench/10_scale.py tabulates


def default_grid(world):
    """dp x pp x tp: tp 2 if it divides W, then pp 2 if it divides the rest, dp the rest."""
    tp = 2 - world % 2
    return world // (tp * (2 - world // tp % 2)), 2 - world // tp % 2, tp


def batch(step, dp, device):
    """The global batch of a step, the same on every rank: ids, targets [dp*M*MICRO, SEQ]; ids non-contiguous."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(VOCAB, (SEQ, dp * M * MICRO), generator=g).to(device).t()    # a transposed view
    targets = torch.randint(VOCAB, (dp * M * MICRO, SEQ), generator=g).to(device)
    targets[0, :4] = torch.tensor([0, VOCAB // 2 - 1, VOCAB // 2, VOCAB - 1])         # first/last row of shards
    return ids, targets


def toy_config(grid, zero, tied, **dtypes):
    """The toy's sizes in step_traffic's terms, float64 unless dtypes say: one bucket a stage, padded to dp."""
    c = dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, layers=LAYERS, seq=SEQ, vocab=VOCAB, micro=MICRO,
             m=M, dp=grid.dp_size, pp=grid.pp_size, tp=grid.tp_size, zero=zero, tied=tied, **{"e": 8, "eg": 8, "ep": 8,
                                                                                                **dtypes})
    return dict(c, buckets=[-(-stage_numel(c, grid.p) // grid.dp_size) * grid.dp_size])


def traffic_is(calls, grid, c):
    """traffic().calls tallied {(group kind, collective): (calls, bytes this rank sent)} (a call's group known by its
    ranks; P2P is the pipeline's where the pp and embedding groups are the same two ranks; bytes by common's
    ring_bytes, not RING; a group of one rank moves nothing) == step_traffic(c) on this rank's stage."""
    kinds = {tuple(dist.get_process_group_ranks(getattr(grid, k))): k for k in ("embedding", "dp", "pp", "tp")
             if getattr(grid, k) is not None}
    got = {}
    for op, ranks, nbytes in (call for call in calls if len(call[1]) > 1):
        kind = "pp" if op in ("send", "recv") else "embedding" if op == "all_reduce" and kinds[ranks] == "pp" \
            else kinds.get(ranks, str(ranks))
        sent = nbytes * (op == "send") if op in ("send", "recv") else \
            ring_bytes(op, nbytes * len(ranks) if op == "all_gather" else nbytes, len(ranks))   # traffic: inputs
        got[(kind, op)] = tuple(a + b for a, b in zip(got.get((kind, op), (0, 0)), (1, sent)))
    want = step_traffic(c, grid.p)
    assert got.keys() == want.keys() and all(got[k][0] == want[k][0] and abs(got[k][1] - want[k][1]) <= 1e-12 *
                                             want[k][1] for k in want), (dist.get_rank(), sorted(got.items()), want)
    return got


def train(grid, device, zero, tied):
    """The same Llama trained STEPS AdamW steps in one process (the whole batch) and on the grid, float64: the loss
    of each step, the parameters after; returns the second step's collectives."""
    head(f"a Llama (GQA {HEADS}/{KV_HEADS} heads, SwiGLU, RoPE, {'tied' if tied else 'untied'} head): {STEPS} AdamW "
         f"steps on the grid (ZeRO-{zero}) against one process on the whole batch, float64")
    torch.manual_seed(0)
    llama = Llama(VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, tied, torch.float64).to(device)
    (model, optimizer), opt = parallelize(llama, grid, zero, **HYPER), torch.optim.AdamW(llama.parameters(), **HYPER)
    comm = pipeline.P2PCommunicator((SEQ // grid.tp_size, MICRO, HIDDEN), torch.float64, device, grid.pp)
    rows, calls = slice(grid.d * M * MICRO, (grid.d + 1) * M * MICRO), None   # this replica's share of the batch
    for step in range(STEPS):
        ids, targets = batch(step, grid.dp_size, device)
        opt.zero_grad()
        ref_loss = F.cross_entropy(llama(ids).flatten(0, 1), targets.flatten())   # one process, whole batch
        ref_loss.backward()
        opt.step()
        with traffic() if step == 1 else contextlib.nullcontext() as counted:
            loss = train_step(model, optimizer, comm, list(ids[rows].split(MICRO)), list(targets[rows].split(MICRO)))
        calls = counted.calls if step == 1 else calls
        assert (loss is not None) == grid.is_last, loss               # the loss lives on the last stage
        if grid.is_last:
            dist.all_reduce(loss, group=grid.dp)                      # the replicas' mean: the whole batch's
            torch.testing.assert_close(loss / grid.dp_size, ref_loss.detach(), rtol=1e-12, atol=0)
    log(f"loss of each of the {STEPS} steps == one process's on the whole batch (mean over DP on the last stage)")
    got, want = model.state_dict(), dict(LlamaStage(llama, grid).named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys(), (sorted(got), sorted(want))     # the one-process model's slices
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-12, msg=lambda s: f"{name}: {s}")
    log(f"after {STEPS} steps each parameter shard on every rank == its slice of the one-process Llama")
    return calls


def count_traffic(calls, grid, zero, tied):
    head("one step's collectives, counted per group, against the docstring's closed forms")
    got = traffic_is(calls, grid, toy_config(grid, zero, tied))
    log("every rank's calls and bytes == the closed forms; rank 0 sends " + (", ".join(
        f"{kind} {n} {op} {round(b)} B" for (kind, op), (n, b) in sorted(got.items())) or "nothing (1 rank)"))


def at_scale(zero):
    c = {**SCALE, "zero": zero}
    head(f"the same forms at scale: Llama 3 70B, dp {c['dp']} x pp {c['pp']} x tp {c['tp']}, {c['m']} x {c['seq']} "
         f"tokens")
    total, numel = stage_numel({**c, "tp": 1, "pp": 1}, 0), stage_numel(c, 0)   # the whole model; a rank of stage 0
    assert abs(total / 70.6e9 - 1) < 0.005, total    # the published count: SwiGLU's 3 matrices, GQA's K/V, untied
    step = step_traffic({**c, "buckets": [-(-numel // c["dp"]) * c["dp"]]}, 0)   # one bucket: the same bytes
    sent = {kind: sum(b for (k, _), (_, b) in step.items() if k == kind) for kind, _ in step}
    log(f"{total:,} parameters (published: 70.6B), {numel / 1e9:.2f}B on a rank of stage 0, which sends a step "
        + ", ".join(f"{k} {float(b) / 1e9:.1f} GB" for k, b in sorted(sent.items()))
        + " (bench/10_scale.py: the seconds, the bytes held, other sizes)")


def main():
    zero, tied = os.environ.get("ZERO", "").strip() or "2", os.environ.get("TIED", "").strip() or "1"
    if zero not in ("2", "3") or tied not in ("0", "1"):     # checked before any work: one line on each rank
        refuse(f"ZERO={zero!r}: give 2 (ZeRO-2, the default) or 3" if zero not in ("2", "3") else
               f"TIED={tied!r}: give 1 (the default: the head tied to the embedding) or 0 (untied)")
    rank, world, device = setup()
    grid, zero, tied = Grid(*default_grid(world), timeout=pg_timeout()), int(zero), int(tied)
    head(f"the grid: {world} = dp {grid.dp_size} x pp {grid.pp_size} x tp {grid.tp_size} ranks, tp fastest")
    log("; ".join(f"{kind} {' '.join(map(str, groups))}" for kind, groups in grid.ranks.items()))
    calls = train(grid, device, zero, tied)
    count_traffic(calls, grid, zero, tied)
    at_scale(zero)
    finish(f"a Llama on dp {grid.dp_size} x pp {grid.pp_size} x tp {grid.tp_size} (SP, vocab-parallel, 1F1B, "
           f"ZeRO-{zero}) == one process over {STEPS} steps; each step's bytes == the closed forms")


if __name__ == "__main__":
    main()
