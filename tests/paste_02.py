# 02's blocks pasted alone, around the user's nanoGPT-style GPT, in float64: rank 0's checkpoint to every rank
# (broadcast_module), rank 0's batch handed out (scatter_along_dim), the logits collected on rank 0 (gather_along_dim,
# along the batch and along a vocab-sharded head), the loss and the gradients summed onto rank 0 (reduce_to), and
# the token count to every rank (broadcast_binomial). Checked against the dense GPT on the whole batch.
from tests.nanogpt import GPT, GPTConfig

cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
torch.manual_seed(10)
dense = GPT(cfg).double()                              # rank 0's model, built alike on every rank: the reference
torch.manual_seed(10 + rank)
model = GPT(cfg).double()                              # every rank's own initialisation
m.broadcast_module(model, src=0)
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), dense.state_dict().values()))

g = torch.Generator().manual_seed(1)
B, T = 2, 8                                            # a micro-batch of B sequences on each rank
idx = torch.randint(0, cfg.vocab_size, (B * world, T), generator=g)
targets = torch.roll(idx, -1, 1).masked_fill(torch.rand(idx.shape, generator=g) < 0.3, -1)
my_idx = m.scatter_along_dim(idx if rank == 0 else None, torch.empty(B, T, dtype=torch.long), 0, src=0)
my_tgt = m.scatter_along_dim(targets if rank == 0 else None, torch.empty(B, T, dtype=torch.long), 0, src=0)
assert torch.equal(my_idx, idx[rank * B:(rank + 1) * B]) and torch.equal(my_tgt, targets[rank * B:(rank + 1) * B])

dense_logits, dense_loss = dense(idx, targets)         # the whole batch in one process
dense_loss.backward()

count = torch.tensor(float((targets != -1).sum()) if rank == 0 else 0.0, dtype=torch.float64)
m.broadcast_binomial(count, src=0)                     # every rank divides by the global count of tokens
logits, _ = model(my_idx)
loss_sum = F.cross_entropy(logits.view(-1, cfg.vocab_size), my_tgt.view(-1), ignore_index=-1, reduction="sum")
(loss_sum / count).backward()
all_logits = m.gather_along_dim(logits.detach(), 0, dst=0)
total = m.reduce_to(loss_sum.detach(), dst=0)
grads = {n: m.reduce_to(p.grad, dst=0) for n, p in model.named_parameters()}  # DDP's sum, onto rank 0 only
if rank == 0:
    torch.testing.assert_close(all_logits, dense_logits.detach())
    torch.testing.assert_close(total / count, dense_loss.detach())
    for n, p in dense.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
else:
    assert all_logits is None and total is None and all(v is None for v in grads.values())

# a vocab-sharded head (tensor parallel): every rank runs the same tokens (rank 0's micro-batch) and computes the
# logits of its slice of the vocabulary; rank 0 gathers them along the last dim
tr, same = model.transformer, idx[:B]
with torch.no_grad():
    h = tr.ln_f(tr.h[1](tr.h[0](tr.wte(same) + tr.wpe(torch.arange(T)))))         # [B, T, C]
    shard = F.linear(h, model.lm_head.weight.chunk(world, 0)[rank])                  # [B, T, vocab / world]
    full = m.gather_along_dim(shard, -1, dst=0)
    if rank == 0:
        torch.testing.assert_close(full, logits.detach())        # rank 0's logits from the whole head
    else:
        assert full is None
