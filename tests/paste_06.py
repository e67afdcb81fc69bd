# 06's blocks, pasted alone, inside the user's nanoGPT-style GPT (tests/nanogpt.py): ring attention over zig-zag
# shards and Ulysses over contiguous shards in place of its SDPA call (nanoGPT's [B, nh, T, hs]: layout="bhsd"),
# each rank feeding its shard of the tokens at the positions m.shard_positions gives (wpe indexed by the global
# positions), against the dense GPT in float64: the logits, the loss with ignore_index=-1, every gradient; then the
# SP linear in a plain model with a torch optimizer. Names given: torch, dist, nn, F, m, rank, world.
from tests.nanogpt import GPT, GPTConfig

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
    pos = m.shard_positions(16, zigzag=zigzag)                        # my tokens' places in the whole sequence
    mine = targets[:, pos]
    my_logits, my_loss = model(idx[:, pos], mine, pos=pos)
    torch.testing.assert_close(my_logits, logits[:, pos])
    counted = (mine != -1).sum().double()                             # the loss is a mean over counted tokens
    parts = torch.stack([my_loss.detach() * counted, counted])
    dist.all_reduce(parts)
    torch.testing.assert_close(parts[0] / parts[1], loss.detach())
    (my_loss * counted / parts[1]).backward()                         # my share of the mean
    for (name, p), (_, want) in zip(model.named_parameters(), dense.named_parameters()):
        dist.all_reduce(p.grad)                                       # replicated weights: summed over the shards
        torch.testing.assert_close(p.grad, want.grad, msg=lambda s: f"{name}: {s}")
    naive = model(idx[:, pos], mine)[0]                               # nanoGPT's own pos = arange(t) on a shard
    assert torch.equal(pos, torch.arange(16 // world)) or not torch.allclose(naive, logits[:, pos])

# the SP linear as its docstring shows, in a plain model trained by torch.optim: W moves as the dense layer's rows
x, g = torch.randn(8, 2, 6, dtype=torch.float64), torch.randn(8, 2, 4 * world, dtype=torch.float64)
full = nn.Linear(6, 4 * world, dtype=torch.float64)
w, b = (nn.Parameter(t.detach()[4 * rank:4 * rank + 4].clone()) for t in (full.weight, full.bias))
for params, step in (([w, b], lambda: (m.LinearWithSequenceParallel.apply(x.chunk(world)[rank], w, b) *
                                       g[..., 4 * rank:4 * rank + 4]).sum()),
                     (list(full.parameters()), lambda: (full(x) * g).sum())):
    opt = torch.optim.AdamW(params, lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        step().backward()
        opt.step()
torch.testing.assert_close([w, b], [full.weight[4 * rank:4 * rank + 4], full.bias[4 * rank:4 * rank + 4]])
