# 06's blocks, pasted alone, inside the user's nanoGPT-style GPT (tests/nanogpt.py): ring attention over zig-zag
# shards and Ulysses over contiguous shards in place of its SDPA call (nanoGPT's [B, nh, T, hs]: layout="bhsd"),
# each rank feeding its shard of the tokens at the positions m.shard_positions gives (wpe indexed by the global
# positions), and each Block's MLP half as Megatron SP over the same ranks, m.mlp_block on the model's [B, T/P, C]
# (sequence_dim=1, no transpose; fc1's rows and fc2's columns split, the tokens gathered in rank order: the MLP is
# token-wise, so zig-zag shards need no reordering), against the dense GPT in float64: the logits, the loss with
# ignore_index=-1, every gradient; then the SP linear in a plain model with a torch optimizer, [s, b, h] and
# [b, s, h]. Names given: torch, dist, nn, F, m, rank, world.
from tests.nanogpt import GPT, GPTConfig

rows = slice(rank * 128 // world, (rank + 1) * 128 // world)           # this rank's rows of c_fc (4 x n_embd)
SP_MLP = {"ln_w": ("ln_2.weight", None), "ln_b": ("ln_2.bias", None), "w1": ("mlp.c_fc.weight", rows),  # dense name,
          "b1": ("mlp.c_fc.bias", rows), "w2": ("mlp.c_proj.weight", (slice(None), rows)),         # this rank's part
          "b2": ("mlp.c_proj.bias", None)}


class SPBlock(nn.Module):
    """nanoGPT's Block: x + attn(ln_1(x)), then its MLP half, x + c_proj(gelu(c_fc(ln_2(x)))), as m.mlp_block."""
    def __init__(self, block):
        super().__init__()
        self.ln_1, self.attn, whole = block.ln_1, block.attn, dict(block.named_parameters())
        self.p = nn.ParameterDict({k: nn.Parameter(whole[name].detach()[cut].clone() if cut else whole[name].detach())
                                   for k, (name, cut) in SP_MLP.items()})
        for k in ("ln_w", "ln_b", "b2"):
            self.p[k].sequence_parallel = True                        # each rank's own tokens: summed over ranks

    def forward(self, x):                                             # [B, T/P, C]
        x = x + self.attn(self.ln_1(x))
        return m.mlp_block(x, self.p, True, sequence_dim=1)

torch.manual_seed(0)
cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
dense = GPT(cfg).double()
idx, targets = torch.randint(64, (2, 16)), torch.randint(64, (2, 16))
targets[0, 3] = targets[1, 12] = -1                                    # skipped by the loss, as nanoGPT does
logits, loss = dense(idx, targets)
loss.backward()

for zigzag, attention in ((True, m.ring_attention), (False, m.ulysses_attention)):
    model = GPT(cfg).double()
    model.load_state_dict(dense.state_dict())
    for block in model.transformer.h:                                 # the call a context-parallel attention replaces
        block.attn.attention = lambda q, k, v: attention(q, k, v, is_causal=True, layout="bhsd")
    model.transformer.h = nn.ModuleList(SPBlock(block) for block in model.transformer.h)
    pos = m.shard_positions(16, zigzag=zigzag)                        # my tokens' places in the whole sequence
    mine = targets[:, pos]
    my_logits, my_loss = model(idx[:, pos], mine, pos=pos)
    torch.testing.assert_close(my_logits, logits[:, pos])
    counted = (mine != -1).sum().double()                             # the loss is a mean over counted tokens
    parts = torch.stack([my_loss.detach() * counted, counted])
    dist.all_reduce(parts)
    torch.testing.assert_close(parts[0] / parts[1], loss.detach())
    (my_loss * counted / parts[1]).backward()                         # my share of the mean
    dense_grads = {name: p.grad for name, p in dense.named_parameters()}
    for name, p in model.named_parameters():
        dense_name, cut = name, None
        if ".p." in name:                                             # the SP MLP's: fc1's rows, fc2's columns
            block, key = name.split(".p.")
            dense_name, cut = f"{block}.{SP_MLP[key][0]}", SP_MLP[key][1]
        if cut is None:
            dist.all_reduce(p.grad)                                   # replicated weights: summed over the shards
        want = dense_grads[dense_name] if cut is None else dense_grads[dense_name][cut]
        torch.testing.assert_close(p.grad, want, msg=lambda s: f"{name}: {s}")
        assert p.grad.is_contiguous(), name
    naive = model(idx[:, pos], mine)[0]                               # nanoGPT's own pos = arange(t) on a shard
    assert torch.equal(pos, torch.arange(16 // world)) or not torch.allclose(naive, logits[:, pos])

# the SP linear as its docstring shows, in a plain model trained by torch.optim: W moves as the dense layer's rows,
# on [s, b, h] (Megatron's) and on [b, s, h] (sequence_dim=1)
for seq in (0, 1):
    x, g = torch.randn(8, 2, 6, dtype=torch.float64), torch.randn(8, 2, 4 * world, dtype=torch.float64)
    x, g = x.movedim(0, seq).contiguous(), g.movedim(0, seq).contiguous()
    full = nn.Linear(6, 4 * world, dtype=torch.float64)
    w, b = (nn.Parameter(t.detach()[4 * rank:4 * rank + 4].clone()) for t in (full.weight, full.bias))
    for params, step in (([w, b], lambda: (m.LinearWithSequenceParallel.apply(x.chunk(world, seq)[rank], w, b, None,
                                                                              True, seq) *
                                           g[..., 4 * rank:4 * rank + 4]).sum()),
                         (list(full.parameters()), lambda: (full(x) * g).sum())):
        opt = torch.optim.AdamW(params, lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            step().backward()
            opt.step()
    torch.testing.assert_close([w, b], [full.weight[4 * rank:4 * rank + 4], full.bias[4 * rank:4 * rank + 4]])
