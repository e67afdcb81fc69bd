"""10 - 5D parallelism (the file keeps its 3D name): a Llama-MoE trained with data, pipeline, context, tensor (with
sequence and vocabulary) and expert parallelism at once.

torchtitan's parallelize recipe on the blocks of 04-09 (imported by importlib: a module name cannot start with a
digit): cut the model into pipeline stages (08), make every linear tensor- and sequence-parallel (05, 06), the
embedding, head and loss vocabulary-parallel (07), attention a ring over context-parallel ranks (06), the mixtures'
experts spread over expert-parallel ranks (04), wrap each stage in ZeRO (09), run the micro-batches in 1F1B order
(08). The model is a Llama-MoE in torchtitan's names: tok_embeddings; L blocks of attention_norm -> attention
(grouped-query: H query heads share H_kv K/V heads; rotary positions) and ffn_norm -> feed_forward (SwiGLU:
w2(silu(w1 x) * w3 x); every 2nd layer a mixture: a router's top-k of E SwiGLU experts + a shared one, DeepSeek's);
norm; output, tied to the embedding as in Llama 3.2 1B (TIED=0: untied, as in Llama 3). W = dp pp cp tp ranks, tp
fastest: rank = ((d pp + p) cp + c) tp + t; ep ranks over dp x cp (torchtitan's, Megatron's), here 8 = pp2 cp2 tp2:

       stage 0 (p=0)          stage 1 (p=1)        TP [0 1] [2 3] [4 5] [6 7]   CP [0 2] [1 3] [4 6] [5 7]
   c=0 [ 0  1 ]   c=1 [ 2  3 ] -> [ 4  5 ]  [ 6  7 ]   PP [0 4] [1 5] [2 6] [3 7]   embedding = PP (first + last)
        t=0 t=1       t=0 t=1     (c=0)     (c=1)      DP = dp x cp [0 2] [1 3] ..   EP [0 2] ..  EDP: dp cp/ep

Who holds what (activations: Megatron's [s, b, h]; CP rank c holds the zig-zag chunks c, 2cp-1-c of the sequence,
split over TP between layers, [s/cp/tp, b, h]). Stage 0: the embedding's V/tp rows, reduce-scattered to [s/cp/tp,
b, h]. Every stage: L/pp layers; TP rank t their query heads [t H/tp, (t+1) H/tp) and K/V heads [t H_kv/tp, ..)
(wq|wk|wv fused by rank into one column-parallel wqkv), ffn/tp of SwiGLU (w1|w3 fused into w13; w2 row-parallel),
the norms whole (applied to [s/cp/tp, b, h]: their gradients summed over TP). A mixture: the router whole, EP rank
r's experts [r E/ep, (r+1) E/ep) whole, run on the tokens every TP rank holds (their gradients summed over TP, as
the norms'), the shared expert TP-parallel. Last stage: the norm, the head's V/tp rows (tied over two stages: a
copy of the embedding's, gradients summed over the embedding group), the loss. Gradients: a dense weight's mean over
DP = dp x cp (every rank there holds other tokens); an expert's over EDP, the ranks holding it, after / ep.

One step, bytes each rank SENDS (ring: all-reduce 2(n-1)/n of its input, all-gather (n-1) x, reduce-scatter and
all-to-all (n-1)/n); A = s/cp*b*h*e one micro-batch's activation on a CP rank, m micro-batches, t = tp:
  TP per layer and micro-batch, each pair of linears (wqkv and wo; w13 and w2 of a SwiGLU or a shared expert): 3
      all-gathers of A/t (forward, again in backward, the row layer's backward) and 2 reduce-scatters of A: 5 (t-1)/t
      A (GQA shrinks wqkv, not x). Per micro-batch, stage 0: the embedding's reduce-scatter and backward all-gather;
      the last stage: the head's 2 all-gathers + 1 reduce-scatter, the loss's all-gather of 3 fp32 a token. Per
      step: an all-reduce of the norms' (2h a layer, +h last), the routers' (E h) and experts' gradients.
  CP per layer and micro-batch: K|V, 2 b s/cp H_kv/t d of e, on cp-1 hops forward and again backward, dK|dV on cp
      hops (fp32 or wider); each a send and a receive.
  EP per mixture and micro-batch (no capacity: every choice kept): an all-to-all of E int64 counts, dispatch and
      combine, forward and backward: 4 all-to-alls handing K_out, K_in rows of h e; K_out = s/cp b/t k, K_in its
      ep group's mean (the routing's), the bytes' mean over the group 4 (ep-1)/ep K_out h e.
  PP per micro-batch: A/t forward unless last stage, A/t back unless first, each one element longer (08's flag).
      Tied, pp > 1: the embedding group all-reduces V/t*h once.
  DP per bucket (n = dp cp; an expert bucket n = dp cp/ep): reduce-scatter (n-1)/n of its gradients; all-gather
      (n-1)/n of its parameters once (ZeRO-2) or for each F and each B, 2m times (ZeRO-3).
Bytes each rank HOLDS at its peak (e_p, e_g: bytes a parameter, a gradient element), P dense parameters a rank over
n = dp cp ranks and P_E expert ones over n_E = dp cp/ep, each part in its own ZeRO: parameters P e_p (ZeRO-3: P/n
e_p + the buckets in use), gradients P e_g (added up under no_sync) + P/n e_g reduced; AdamW 2P/n e_g (+4P/n fp32
master for narrower parameters); the same for P_E over n_E; activations: stage p keeps min(pp - p, m)
micro-batches', each s/cp*b/t*e*(6h + 2 + (4H + 3H_kv)d + H + 4 ffn) + 2 s/cp d e a dense layer (the norms' input,
1/rms, output; q, k, v, qkv, the attention's output twice and lse: flash, no s^2; SwiGLU's 4; RoPE's cos, sin; a
mixture's follow the routing: not in this form); the last stage also its logits at s/cp and their gradient.

    torchrun --nproc-per-node=8 10_3d_parallel.py     (1-4 ranks too; ZERO=3: ZeRO-3; TIED=0: Llama 3's head)
bench/10_scale.py evaluates these forms for any Llama on any grid: the seconds at link speeds, the bytes held.
tests/check_10.py proves the rest: more grids (5D: cp, ep, edp), gradient means, fused dW, bf16 traffic, bytes
held, refusals, joints.
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

moe_par = importlib.import_module("04_all_to_all_moe")      # ExpertParallelMoE: top-k router, all-to-all
tp_layers = importlib.import_module("05_tp_layers")          # Column/RowParallelLinear (SP, fused), SwiGLU MLP
seq_par = importlib.import_module("06_sequence_parallel")    # ring attention (zig-zag), apply_rope
vocab_par = importlib.import_module("07_vocab_parallel")     # VocabParallelEmbedding, the vocab-parallel loss
pipeline = importlib.import_module("08_pipeline_1f1b")       # schedule_1f1b, P2PCommunicator, run_schedule
data_par = importlib.import_module("09_ddp_zero2")           # ZeRO-2, ZeRO-3 (nn.Modules, main_grad handshake)


class Grid:
    """dp x pp x cp x tp process groups, tp fastest: rank = ((d * pp + p) * cp + c) * tp + t. Every rank creates every
    group, in the same order (dist.new_group's rule). self.tp / .cp / .pp: this rank's groups; self.dp: the dense
    weights' data-parallel group, dp x cp ranks (a CP rank holds other tokens of the same weights: torchtitan's
    dp_cp); self.ep: ep consecutive ranks of that group (the experts spread over them), self.edp: the ranks holding
    the same experts (dp cp / ep of them); self.embedding: None on a middle stage and where pp = 1; self.ranks:
    {kind: [global ranks of each group]}; self.d, .p, .c, .t: this rank's coordinates. timeout: the groups'."""

    def __init__(self, dp, pp, tp, timeout=None, *, cp=1, ep=1):
        world, rank = dist.get_world_size(), dist.get_rank()
        if dp * pp * cp * tp != world:
            raise ValueError(f"grid dp={dp} x pp={pp} x " + (f"cp={cp} x " if cp > 1 else "") +
                             f"tp={tp} = {dp * pp * cp * tp} ranks, but the world has {world}")
        if (dp * cp) % ep:
            raise ValueError(f"ep={ep} does not divide dp x cp = {dp * cp} (experts spread over the data ranks)")
        self.dp_size, self.pp_size, self.cp_size, self.tp_size, self.ep_size = dp, pp, cp, tp, ep
        self.d, self.p, self.c, self.t = rank // (pp * cp * tp), rank // (cp * tp) % pp, rank // tp % cp, rank % tp
        at = lambda d, p, c, t: ((d * pp + p) * cp + c) * tp + t
        on = lambda j, p, t: at(j // cp, p, j % cp, t)                     # j: the index over dp x cp
        pipes = [[at(d, p, c, t) for p in range(pp)] for d in range(dp) for c in range(cp) for t in range(tp)]
        stages = [(p, t) for p in range(pp) for t in range(tp)]
        every = lambda n: [(d, p, z) for d in range(dp) for p in range(pp) for z in range(n)]   # (d, p, c or t)
        self.ranks = {"tp": [[at(d, p, c, t) for t in range(tp)] for d, p, c in every(cp)],
                      "cp": [[at(d, p, c, t) for c in range(cp)] for d, p, t in every(tp)],
                      "pp": pipes, "dp": [[on(j, p, t) for j in range(dp * cp)] for p, t in stages],
                      "ep": [[on(j, p, t) for j in range(b, b + ep)] for p, t in stages for b in range(0, dp * cp, ep)],
                      "edp": [[on(j, p, t) for j in range(e, dp * cp, ep)] for p, t in stages for e in range(ep)],
                      "embedding": [[ranks[0], ranks[-1]] for ranks in pipes if pp > 1]}  # first, last stage
        for kind in ("tp", "cp", "pp", "dp", "ep", "edp"):
            made = [dist.new_group(ranks, timeout=timeout) for ranks in self.ranks[kind]]
            setattr(self, kind, next(g for g, ranks in zip(made, self.ranks[kind]) if rank in ranks))
        self.embedding = pipeline.embedding_group(pipes, timeout)     # 08's (None: a middle stage, or pp = 1)
        self.is_first, self.is_last = self.p == 0, self.p == pp - 1


class SwiGLU(nn.Module):
    """Llama's feed-forward, w2(silu(w1 x) * w3 x): the dense layers', each expert's, the shared expert's."""

    def __init__(self, hidden, ffn, dtype=None):
        super().__init__()
        self.w1, self.w3, self.w2 = (nn.Linear(i, o, bias=False, dtype=dtype) for i, o in
                                     ((hidden, ffn), (hidden, ffn), (ffn, hidden)))

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Llama(nn.Module):
    """The model in one process, torchtitan's names: ids [b, s] -> logits [b, s, V]. experts > 0: every moe_every-th
    layer's feed-forward is a mixture (Mixtral's, DeepSeek's): a router picks top_k of `experts` SwiGLUs of moe_ffn
    for each token, their outputs weighted by the router's softmax probabilities (not renormalised, as 04's), plus
    a shared SwiGLU of shared_ffn every token passes (0: none). Written densely: every expert on every token."""

    def __init__(self, vocab, hidden, heads, kv_heads, ffn, layers, tied=False, dtype=None, *, experts=0, top_k=1,
                 moe_every=2, moe_ffn=None, shared_ffn=0):
        super().__init__()
        d, kw, norm = hidden // heads, dict(bias=False, dtype=dtype), lambda: nn.RMSNorm(hidden, 1e-5, dtype=dtype)
        line = lambda i, o: nn.Linear(i, o, **kw)
        self.heads, self.kv_heads, self.head_dim, self.tied, self.top_k = heads, kv_heads, d, tied, top_k
        moe = lambda i: experts and i % moe_every == moe_every - 1
        mixture = lambda: nn.ModuleDict(dict(router=line(hidden, experts), experts=nn.ModuleList(
            SwiGLU(hidden, moe_ffn or ffn, dtype) for _ in range(experts)), **(
            dict(shared=SwiGLU(hidden, shared_ffn, dtype)) if shared_ffn else {})))
        self.tok_embeddings = nn.Embedding(vocab, hidden, dtype=dtype)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            attention_norm=norm(), ffn_norm=norm(),
            attention=nn.ModuleDict(dict(wq=line(hidden, heads * d), wk=line(hidden, kv_heads * d),
                                         wv=line(hidden, kv_heads * d), wo=line(heads * d, hidden))),
            feed_forward=mixture() if moe(i) else SwiGLU(hidden, ffn, dtype))) for i in range(layers))
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
            if isinstance(f, SwiGLU):
                x = x + f(h)
                continue
            gates, idx = f.router(h).softmax(-1).topk(self.top_k, dim=-1)                  # [b, s, k]
            weight = (F.one_hot(idx, len(f.experts)) * gates[..., None]).sum(-2)           # [b, s, E]
            x = x + sum(weight[..., e, None] * ex(h) for e, ex in enumerate(f.experts))
            x = x + f.shared(h) if "shared" in f else x
        return self.output(self.norm(x))


def fused(*linears):
    """One dense nn.Linear whose rows are the linears' in turn ([wq; wk; wv], [w1; w3]): what 05's fused_shard
    splits by pieces, rank t getting its query heads, then its K/V heads (its gate, then its up rows)."""
    dense = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears), bias=False, device="meta")
    dense.weight = nn.Parameter(torch.cat([m.weight for m in linears]).detach())
    return dense


class Attention(nn.Module):
    """Grouped-query attention on this rank's heads, [s/cp/tp, b, h] in and out: wqkv (05's column layer, fused by
    heads) all-gathers this CP rank's zig-zag shard of the sequence, q and k turn by their global positions (06's
    shard_positions, apply_rope), 06's ring attention passes K/V round the cp group, wo reduce-scatters again."""

    def __init__(self, dense, heads, kv_heads, group, cp=None):
        super().__init__()
        tp = dist.get_world_size(group)
        self.wqkv = tp_layers.ColumnParallelLinear.from_dense(fused(dense.wq, dense.wk, dense.wv), group, fused=(
            heads, kv_heads, kv_heads), sequence_parallel=True, check_slices=False)   # (slices: a reduce-scatter's)
        self.wo = tp_layers.RowParallelLinear.from_dense(dense.wo, group, sequence_parallel=True)
        self.split = [heads // tp, max(kv_heads // tp, 1), max(kv_heads // tp, 1)]   # (tp > H_kv: replicated)
        self.cp = cp

    def forward(self, x):
        qkv = self.wqkv(x)                                            # [s, b, (H + 2 H_kv) d / tp]
        q, k, v = qkv.unflatten(-1, (sum(self.split), -1)).split(self.split, 2)       # [s, b, heads, d]
        pos = seq_par.shard_positions(qkv.shape[0] * dist.get_world_size(self.cp), self.cp, device=x.device)
        q, k = (seq_par.apply_rope(t, pos, layout="sbhd", base=5e5) for t in (q, k))
        o = seq_par.ring_attention(q, k, v, True, self.cp, layout="sbhd")  # [s/cp, b, heads, d]
        return self.wo(o.flatten(2))                                  # [s/cp, b, H d/tp] -> [s/cp/tp, b, h]


def feed_forward(dense, group):
    """SwiGLU on this rank's ffn/tp columns, [s/tp, b, h] in and out: 05's gated parallel_mlp, w1|w3 fused."""
    mlp = tp_layers.parallel_mlp((fused(dense.w1, dense.w3), nn.SiLU(), dense.w2), group, sequence_parallel=True,
                                 gated=True)
    mlp[0].check_slices = False                                       # its slices come from a reduce-scatter
    return mlp


class MoE(nn.Module):
    """A mixture on [s/cp/tp, b, h], this TP rank's own tokens: 04's ExpertParallelMoE (ragged all-to-all over
    grid.ep, no capacity unless cf) holding the experts of this EP rank r, E/ep from r E/ep; the router and experts
    whole on every TP rank (their gradients summed over TP, as the norms'); a shared expert TP-parallel as SwiGLU."""

    def __init__(self, dense, top_k, grid, cf=None):
        super().__init__()
        E, h, ep = len(dense.experts), dense.router.in_features, dist.get_world_size(grid.ep)
        self.moe = moe_par.ExpertParallelMoE(h, 1, E, top_k, cf, group=grid.ep, device="meta")   # E % ep: refused
        L, r = E // ep, dist.get_rank(grid.ep)
        self.moe.router, self.moe.experts = copy.deepcopy(dense.router), copy.deepcopy(dense.experts[r * L:(r + 1) * L])
        self.shared = feed_forward(dense.shared, grid.tp) if "shared" in dense else None

    def forward(self, x):
        y = self.moe(x.flatten(0, 1)).view_as(x)                      # [s/cp/tp * b, h] tokens to their experts
        return y if self.shared is None else y + self.shared(x)


class LlamaStage(nn.Module):
    """This rank's part of the Llama, its parameters the one-process model's slices: its stage's layers, the
    embedding (first stage), the final norm and the head (last stage), split over grid.tp; capacity_factor: the
    mixtures' (04's per-source-rank rule; None: none dropped). forward: ids [b, s] or
    [s/tp, b, h] -> [s/tp, b, h], or logits [s, b, V/tp] (last stage). Tied on one stage, the head's weight is the
    embedding's Parameter: the lookup writes its .grad, so it carries zero_out_wgrad (Megatron's rule)."""

    def __init__(self, llama, grid, capacity_factor=None):
        super().__init__()
        tp, n = grid.tp, len(llama.layers)
        if n % grid.pp_size:
            raise ValueError(f"{n} layers do not split evenly over {grid.pp_size} pipeline stages")
        per, self.is_first, self.is_last = n // grid.pp_size, grid.is_first, grid.is_last
        mine = llama.layers[grid.p * per:(grid.p + 1) * per]         # this stage's layers
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            attention_norm=copy.deepcopy(blk.attention_norm), ffn_norm=copy.deepcopy(blk.ffn_norm),
            attention=Attention(blk.attention, llama.heads, llama.kv_heads, tp, getattr(grid, "cp", None)),
            feed_forward=feed_forward(blk.feed_forward, tp) if isinstance(blk.feed_forward, SwiGLU) else
            MoE(blk.feed_forward, llama.top_k, grid, capacity_factor))) for blk in mine)
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
            p.sequence_parallel = name.endswith("norm.weight") or ".moe." in name   # on [s/tp]: summed over TP
            p.expert = ".moe.experts." in name                        # sharded over ep, reduced over edp
        self.tied = llama.tied and grid.pp_size > 1 and (self.is_first or self.is_last)   # summed over embedding

    def forward(self, x):
        if self.is_first:
            x = self.tok_embeddings(x.t())                            # ids [b, s] -> [s, b] -> [s/tp, b, h]
        for blk in self.layers:
            x = x + blk.attention(blk.attention_norm(x))
            x = x + blk.feed_forward(blk.ffn_norm(x))
        return self.output(self.norm(x)) if self.is_last else x      # logits [s, b, V/tp]


def parallelize(llama, grid, zero=2, bucket_cap_mb=25, **adamw):
    """torchtitan's recipe on this rank: the pipeline stage with TP, SP and vocabulary parallelism (LlamaStage),
    an AdamW over it, then ZeRO-2 or ZeRO-3 over grid.dp (09's wrapper, buckets of bucket_cap_mb as torch DDP's;
    it keeps the grid) -> (model, optimizer).
    The experts (p.expert) are left out of it: a second ZeRO over grid.edp, with its own AdamW, holds them
    (model.experts, model.expert_optimizer; None without experts); state_dict() gives both, by the stage's names."""
    stage, wrap = LlamaStage(llama, grid), data_par.ZeRO2 if zero == 2 else data_par.ZeRO3
    experts = [p for p in stage.parameters() if p.expert]
    for p in experts:
        p.requires_grad_(False)                                       # (09 wraps the trainable parameters)
    optimizer = torch.optim.AdamW([p for p in stage.parameters() if not p.expert], **adamw)
    model = wrap(stage, optimizer, grid.dp, bucket_cap_mb)
    model.grid, model.experts, model.expert_optimizer = grid, None, None
    if experts:
        for p in experts:
            p.requires_grad_(True)
        held = nn.ModuleList(m.moe.experts for m in stage.modules() if isinstance(m, MoE))
        model.expert_optimizer = torch.optim.AdamW(held.parameters(), **adamw)
        model.experts = wrap(held, model.expert_optimizer, grid.edp, bucket_cap_mb)
        names = dict(zip((n for n, _ in held.named_parameters()), (n for n, p in stage.named_parameters() if p.expert)))
        dense_state = model.state_dict
        model.state_dict = lambda: {**dense_state(), **{names[n]: v for n, v in model.experts.state_dict().items()}}
    return model, optimizer


def finalize_grads(stage, grid):
    """After the last micro-batch, before the DP reduction: sum over TP the norms' gradients (SP applied them to a
    slice of the sequence, 06), and a tied weight's two copies over the embedding group (Megatron's
    finalize_model_grads does both after its DP reduction: sums, so the order is free). 09 adds into main_grad. An
    expert's gradient holds its ep group's tokens, and edp's mean divides by dp cp / ep: it is divided by ep first
    (Megatron scales expert gradients by the whole data-parallel size) to be the mean over all dp x cp ranks."""
    tp_layers.allreduce_sequence_parallel_grads(stage.parameters(), group=grid.tp)    # reads p.main_grad
    for p in (p for p in stage.parameters() if getattr(p, "expert", False)):
        p.main_grad.div_(grid.ep_size)
    if stage.tied:                 # 08's: into main_grad, before ZeRO shards it
        tied = stage.tok_embeddings if stage.is_first else stage.output
        pipeline.allreduce_tied_grad(tied.weight, grid.embedding)


def train_step(model, optimizer, comm, ids, targets, before_step=None):
    """One step of this rank: its zig-zag shard (06) of each micro-batch's sequence over grid.cp, the micro-batches
    through the pipeline in 1F1B order (08), their gradients added up without DP traffic (no_sync); finalize_grads;
    ZeRO's reduce-scatter and AdamW step (09), the experts' too. Returns the mean loss over this rank's tokens on
    the last stage, else None."""
    grid, parts = model.grid, [(model, optimizer)] + ([(model.experts, model.expert_optimizer)] if getattr(
        model, "experts", None) else [])
    cp, tp = getattr(grid, "cp_size", 1), grid.tp_size
    if ids[0].shape[1] % (2 * cp * tp):                               # before any collective
        raise ValueError(f"sequence length {ids[0].shape[1]} is not divisible by 2 x cp {cp} x tp {tp} (zig-zag's "
                         f"2 chunks a CP rank, split over TP)")
    if cp > 1:
        ids, targets = ([seq_par.zigzag_shard(x, 1, grid.cp) for x in xs] for xs in (ids, targets))

    def loss_fn(logits, target):                  # logits [s, b, V/tp] (equal slices: no check), target [b, s]
        return vocab_par.vocab_parallel_cross_entropy(logits, target.t(), group=model.grid.tp, check_slices=False)

    with contextlib.ExitStack() as quiet:
        for wrapper, _ in parts:
            quiet.enter_context(wrapper.no_sync())
        loss, _, _ = pipeline.run_schedule(model.module, pipeline.schedule_1f1b, comm, ids, targets, loss_fn)
    finalize_grads(model.module, model.grid)
    if before_step is not None:
        before_step()                                                 # (the checks read the gradients here)
    for wrapper, opt in parts:
        wrapper.sync_gradients()                                      # one reduce-scatter per bucket
        opt.step()                                # AdamW on this rank's shard (ZeRO-2 then all-gathers it)
        opt.zero_grad(set_to_none=True)
    return loss


# ---- the closed forms of the docstring (c: the sizes, as SCALE below) ------------------------------------------
RING = {"all_reduce": lambda n: Fraction(2 * (n - 1), n), "all_gather": lambda n: n - 1,
        "reduce_scatter": lambda n: Fraction(n - 1, n), "all_to_all": lambda n: Fraction(n - 1, n),
        "send": lambda n: 1, "recv": lambda n: 0}


def moe_layers(c, stage):
    """How many of stage `stage`'s layers are mixtures (every moe_every-th of the model's; none without experts)."""
    per, every = c["layers"] // c["pp"], c.get("moe_every", 2)
    return sum(i % every == every - 1 for i in range(stage * per, (stage + 1) * per)) if c.get("experts") else 0


def step_traffic(c, stage):
    """{(group kind, collective): (calls, bytes this rank sends)} in one step of stage `stage`; c["buckets"]: the
    elements of each DP bucket, c["expert_buckets"] the experts' (over edp: dp cp / ep ranks)."""
    t, pp, m, h, cp, ep = c["tp"], c["pp"], c["m"], c["hidden"], c.get("cp", 1), c.get("ep_size", 1)
    first, last, per, moe, E = stage == 0, stage == pp - 1, c["layers"] // pp, moe_layers(c, stage), c.get("experts", 0)
    tok = c["micro"] * c["seq"] // cp                                   # a micro-batch's tokens on a CP rank
    A, pairs = tok * h * c["e"], 2 * per - moe + moe * bool(c.get("shared_ffn"))   # TP linear pairs: attention,
    out = {}                                                            # SwiGLU (a mixture: its shared expert)

    def add(kind, op, n, calls, payload):                             # payload: the bytes handed in per call
        if n > 1 and calls:
            old = out.get((kind, op), (0, 0))
            out[(kind, op)] = (old[0] + calls, old[1] + calls * RING[op](n) * payload)

    add("tp", "all_gather", t, (3 * pairs + first + 2 * last) * m, A // t)   # layers; embedding's, head's backward
    add("tp", "reduce_scatter", t, (2 * pairs + first + last) * m, A)        # layers; embedding; the head's dx
    add("tp", "all_gather", t, last * m, 3 * tok * max(c["e"], 4))   # the loss: 3 fp32 a token
    add("tp", "all_reduce", t, 1, (2 * h * per + (h if last else 0) + moe * E * h * (1 + 3 * c.get("moe_ffn", 0) // ep))
        * c["eg"])                                                     # the norms', routers', experts' gradients
    kv = 2 * c["micro"] * max(c["kv_heads"] // t, 1) * (c["seq"] // cp) * (h // c["heads"])   # K|V of a CP rank
    for e, calls in ((c["e"], 2 * (cp - 1)), (max(c["e"], 4), cp)):   # the ring: K|V on cp - 1 hops forward and
        add("cp", "send", cp, per * m * calls, kv * e)                # backward, dK|dV on cp hops (fp32 or wider)
        add("cp", "recv", cp, per * m * calls, kv * e)
    add("ep", "all_to_all", ep, moe * m, 8 * E)                       # the counts, int64
    add("ep", "all_to_all", ep, 4 * moe * m, tok // t * c.get("top_k", 1) * h * c["e"])   # dispatch, combine (mean)
    add("pp", "send", pp, m * (2 - first - last), A // t + c["e"])   # each message one element longer: 08's flag
    add("pp", "recv", pp, m * (2 - first - last), A // t + c["e"])
    add("embedding", "all_reduce", min(pp, 2), c["tied"] * (first or last), c["vocab"] // t * h * c["eg"])
    for numel in c["buckets"]:                        # ZeRO-3 gathers each bucket for every F and every B instead
        add("dp", "reduce_scatter", c["dp"], 1, numel * c["eg"])
        add("dp", "all_gather", c["dp"], 2 * m if c["zero"] == 3 else 1, numel // c["dp"] * c["ep"])
    for numel in c.get("expert_buckets", ()):                          # (ep = 1: edp is the dp group)
        kind, n = "dp" if ep == 1 else "edp", c["dp"] // ep
        add(kind, "reduce_scatter", n, 1, numel * c["eg"])
        add(kind, "all_gather", n, 2 * m if c["zero"] == 3 else 1, numel // n * c["ep"])
    return out


def stage_numel(c, stage, experts=False):
    """Elements of stage `stage`'s parameters on a TP rank (tp = pp = 1: the model's): a layer's 2 norms, wqkv and wo
    (H + 2 H_kv and H heads of h/H), SwiGLU's 3 matrices (a mixture: its router, shared expert); the embedding
    (first); the norm and head (last, or tied). experts: the E/ep experts' of the stage's mixtures instead."""
    h, t, pp, last, moe = c["hidden"], c["tp"], c["pp"], stage == c["pp"] - 1, moe_layers(c, stage)
    E = c.get("experts", 0)
    if experts:
        return moe * E // c.get("ep_size", 1) * 3 * c.get("moe_ffn", 0) * h
    layer = 2 * h + ((2 * c["heads"] + 2 * c["kv_heads"]) * (h // c["heads"]) * h + 3 * c["ffn"] * h) // t
    mixture = moe * (E * h + 3 * c.get("shared_ffn", 0) * h // t - 3 * c["ffn"] * h // t)
    tables = (stage == 0) + (last and not (c["tied"] and pp == 1))
    return c["layers"] // pp * layer + mixture + tables * c["vocab"] // t * h + (h if last else 0)


# ---- demo: the grid against one process (needs common.py; the blocks need only torch) -------------------------
import os

from common import finish, head, log, pg_timeout, refuse, ring_bytes, setup, traffic  # (beside 05-09, as they are)

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, SEQ = 64, 32, 8, 4, 48, 4, 8   # tp in 1, 2, 4; pp in 1, 2, 4
MICRO, M, STEPS = 2, 4, 3              # sequences per micro-batch, micro-batches per replica, optimizer steps
MOE = dict(experts=6, top_k=2, moe_every=2, moe_ffn=16, shared_ffn=16)   # layers 1, 3: mixtures; ep in 1, 2, 3, 6
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


def toy_config(grid, zero, tied, moe=None, **dtypes):
    """The toy's sizes in step_traffic's terms, float64 unless dtypes say: one bucket a stage, padded to its group
    (dp: the dp x cp ranks; the experts' own bucket over edp)."""
    cp, ep = getattr(grid, "cp_size", 1), getattr(grid, "ep_size", 1)
    c = dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, layers=LAYERS, seq=SEQ, vocab=VOCAB, micro=MICRO,
             m=M, dp=grid.dp_size * cp, pp=grid.pp_size, tp=grid.tp_size, cp=cp, ep_size=ep, zero=zero, tied=tied,
             **(moe or {}), **{"e": 8, "eg": 8, "ep": 8, **dtypes})
    pad = lambda numel, n: [-(-numel // n) * n] if numel else []
    return dict(c, buckets=pad(stage_numel(c, grid.p), c["dp"]), expert_buckets=pad(stage_numel(c, grid.p, True) if
                                                                                    moe else 0, c["dp"] // ep))


def traffic_is(calls, grid, c):
    """traffic().calls tallied {(group kind, collective): (calls, bytes this rank sent)} (a call's group known by its
    ranks and its collective, where two groups are the same ranks; bytes by common's ring_bytes, not RING; a group
    of one rank moves nothing) == step_traffic(c) on this rank's stage. The all-to-alls' bytes depend on the
    routing: their mean over the ep group == the form's (each rank dispatches all its N k choices: no capacity)."""
    of = {k: tuple(dist.get_process_group_ranks(getattr(grid, k))) for k in ("embedding", "edp", "ep", "dp", "cp",
                                                                            "pp", "tp") if getattr(grid, k, None)}
    order = {"send": ("cp", "pp"), "recv": ("cp", "pp"), "all_to_all": ("ep",), "all_reduce": ("tp", "embedding")}
    got = {}
    for op, ranks, nbytes in (call for call in calls if len(call[1]) > 1):
        kind = next((k for k in order.get(op, ("tp", "dp", "edp")) if of.get(k) == ranks), str(ranks))
        sent = nbytes * (op == "send") if op in ("send", "recv") else \
            ring_bytes(op, nbytes * len(ranks) if op == "all_gather" else nbytes, len(ranks))   # traffic: inputs
        got[(kind, op)] = tuple(a + b for a, b in zip(got.get((kind, op), (0, 0)), (1, sent)))
    if ("ep", "all_to_all") in got:                                   # the mean over the ep group
        mean = torch.tensor(float(got["ep", "all_to_all"][1]), dtype=torch.float64)
        dist.all_reduce(mean, group=grid.ep)
        got["ep", "all_to_all"] = (got["ep", "all_to_all"][0], mean.item() / grid.ep_size)
    want = step_traffic(c, grid.p)
    assert got.keys() == want.keys() and all(got[k][0] == want[k][0] and abs(got[k][1] - want[k][1]) <= 1e-12 *
                                             want[k][1] for k in want), (dist.get_rank(), sorted(got.items()), want)
    return got


def train(grid, device, zero, tied, moe):
    """The same Llama-MoE trained STEPS AdamW steps in one process (the whole batch, every expert) and on the grid,
    float64: the loss of each step, the parameters after; returns the second step's collectives."""
    head(f"a Llama-MoE (GQA {HEADS}/{KV_HEADS} heads, RoPE, {moe['experts']} SwiGLU experts top-{moe['top_k']} + a "
         f"shared one in layers 1, 3, {'tied' if tied else 'untied'} head): {STEPS} AdamW steps on the grid (ZeRO-"
         f"{zero}) against one process on the whole batch, float64")
    torch.manual_seed(0)
    llama = Llama(VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, tied, torch.float64, **moe).to(device)
    (model, optimizer), opt = parallelize(llama, grid, zero, **HYPER), torch.optim.AdamW(llama.parameters(), **HYPER)
    comm = pipeline.P2PCommunicator((SEQ // grid.cp_size // grid.tp_size, MICRO, HIDDEN), torch.float64, device,
                                    grid.pp)
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
            dist.all_reduce(loss, group=grid.dp)                      # the mean over dp x cp: the whole batch's
            torch.testing.assert_close(loss / grid.dp_size / grid.cp_size, ref_loss.detach(), rtol=1e-12, atol=0)
    log(f"loss of each of the {STEPS} steps == one process's on the whole batch (mean over dp x cp, last stage)")
    got, want = model.state_dict(), dict(LlamaStage(llama, grid).named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys(), (sorted(got), sorted(want))     # the one-process model's slices
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-10, atol=1e-12, msg=lambda s: f"{name}: {s}")
    log(f"after {STEPS} steps each parameter shard on every rank (its experts too) == its slice of one process's")
    return calls


def count_traffic(calls, grid, zero, tied, moe):
    head("one step's collectives, counted per group, against the docstring's closed forms")
    got = traffic_is(calls, grid, toy_config(grid, zero, tied, moe))
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
    dp, pp, tp = default_grid(world)
    cp = 2 - dp % 2                                                   # 8 ranks: dp 2 -> dp 1 x cp 2
    grid, zero, tied = Grid(dp // cp, pp, tp, pg_timeout(), cp=cp, ep=dp), int(zero), int(tied)
    head(f"the grid: {world} = dp {grid.dp_size} x pp {pp} x cp {cp} x tp {tp} ranks, tp fastest; ep {dp} over dp x cp")
    log("; ".join(f"{kind} {' '.join(map(str, groups))}" for kind, groups in grid.ranks.items()))
    calls = train(grid, device, zero, tied, MOE)
    count_traffic(calls, grid, zero, tied, MOE)
    at_scale(zero)
    finish(f"a Llama-MoE on dp {grid.dp_size} x pp {pp} x cp {cp} x tp {tp}, ep {dp} (ZeRO-{zero}, SP, vocab-parallel, "
           f"ring attention, 1F1B) == one process over {STEPS} steps; each step's bytes == the closed forms")


if __name__ == "__main__":
    main()
