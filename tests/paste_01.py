# 01's blocks pasted alone, as a pipeline over the user's nanoGPT-style GPT: stage r runs Block r (stage 0 also the
# embeddings, the last stage also ln_f, the tied head and the loss). Two micro-batches of different lengths:
# the activation travels behind its shape header (send_with_shape), the gradient back by send_backward.
# Checked against the dense GPT in one process, float64: the loss, and every stage's gradients.
from tests.nanogpt import GPT, GPTConfig

cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=world, n_head=4, n_embd=32)
torch.manual_seed(0)
dense, model = GPT(cfg).double(), GPT(cfg).double()    # the same seed on every rank: the same weights
model.load_state_dict(dense.state_dict())
g = torch.Generator().manual_seed(1)
batches = [torch.randint(0, cfg.vocab_size, (2, T), generator=g) for T in (9, 5)]    # sequence lengths differ
targets = [torch.roll(idx, -1, 1).masked_fill(torch.rand(idx.shape, generator=g) < 0.2, -1) for idx in batches]

dense_loss = sum(dense(idx, tgt)[1] for idx, tgt in zip(batches, targets)) / len(batches)  # the reference
dense_loss.backward()

tr, first, last = model.transformer, rank == 0, rank == world - 1
for idx, tgt in zip(batches, targets):                 # GPipe-style: each micro-batch forward, then backward
    if first:
        x = tr.drop(tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1])))
    else:
        x = m.recv_with_shape(rank - 1, torch.float64, torch.device("cpu")).requires_grad_()
    y = tr.h[rank](x)                                  # [B, T, C]
    if not last:
        m.send_with_shape(y.detach(), rank + 1)
        y.backward(m.recv_backward(y.shape, y.dtype, y.device))
    else:
        logits = model.lm_head(tr.ln_f(y))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1), ignore_index=-1) / len(batches)
        loss.backward()
        loss_sum = loss.detach() if idx is batches[0] else loss_sum + loss.detach()
    if not first:
        m.send_backward(x.grad)

if last:
    torch.testing.assert_close(loss_sum, dense_loss.detach())
mine = {n for n, _ in tr.h[rank].named_parameters(prefix=f"transformer.h.{rank}")}
mine |= {"transformer.wpe.weight"} if first else set()
mine |= {"transformer.ln_f.weight", "transformer.ln_f.bias"} if last else set()
dense_grads = {n: p.grad for n, p in dense.named_parameters()}
for n, p in model.named_parameters():                  # wte and lm_head are one tensor: named once, as wte
    if n in mine:
        torch.testing.assert_close(p.grad, dense_grads[n], msg=n)
    elif n != "transformer.wte.weight":
        assert p.grad is None, n                        # another stage's layer: never touched here
# the tied embedding: stage 0 holds the embedding's part, the last stage the head's; their sum is the dense grad
wte = model.transformer.wte.weight.grad if (first or last) else None
tied = torch.zeros_like(model.transformer.wte.weight) if wte is None else wte.clone()
dist.all_reduce(tied)
torch.testing.assert_close(tied, dense_grads["transformer.wte.weight"])
