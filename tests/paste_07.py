# 07's blocks pasted alone, inside the user's nanoGPT-style GPT (tests/nanogpt.py), as a user would build them in:
# the token embedding wte sharded by vocabulary (VocabParallelEmbedding.from_dense), the tied lm_head on the same
# shard (parallel_lm_logits with wte's own Parameter), the loss vocab_parallel_cross_entropy with nanoGPT's
# ignore_index=-1, and generate() sampling from gather_vocab_logits. Checked against the dense GPT, float64: the
# logits (this rank's columns), the loss, every gradient (wte's on its rows: embedding + head), two AdamW steps
# from configure_optimizers, and the tokens generate() samples from one seed, the same on every rank.
from tests import nanogpt
from tests.nanogpt import GPT, GPTConfig

# the pasted section defines no name the user's model.py defines (nanoGPT's classes and functions)
users = {k for k, v in vars(nanogpt).items() if getattr(v, "__module__", None) == nanogpt.__name__}
assert {"GPT", "Block", "MLP"} <= users and not users & set(vars(m)), users & set(vars(m))

# the loss alone on a user's own group, ignore_index -100 (the default), against F.cross_entropy
logits = torch.randn(5, 8 * world, dtype=torch.float64)
target = torch.tensor([0, 8 * world - 1, 3, 4, -100])
loss = m.vocab_parallel_cross_entropy(logits.chunk(world, dim=1)[rank], target)
torch.testing.assert_close(loss, F.cross_entropy(logits, target))


class TiedVocabParallelHead(nn.Module):
    """nanoGPT's lm_head, tied to the vocab-parallel wte: this rank's V/W columns of the logits."""
    def __init__(self, wte):
        super().__init__()
        self.weight = wte.weight            # the same Parameter, as nanoGPT ties lm_head.weight = wte.weight

    def forward(self, x):
        return m.parallel_lm_logits(x, self.weight)


class VocabParallelGPT(GPT):
    """The user's GPT with 07's blocks put in: wte by vocabulary, the tied head on its shard, the loss on the
    vocab-parallel logits, generate() gathering the last position's logits; the rest is nanoGPT's own code."""
    def __init__(self, dense):
        super().__init__(dense.config)
        self.to(dense.lm_head.weight.dtype).load_state_dict(dense.state_dict())
        self.transformer.wte = m.VocabParallelEmbedding.from_dense(dense.transformer.wte)
        self.lm_head = TiedVocabParallelHead(self.transformer.wte)

    def forward(self, idx, targets=None):
        logits, _ = super().forward(idx)    # [B, T, V/W]: this rank's columns
        loss = None if targets is None else m.vocab_parallel_cross_entropy(logits, targets, ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):     # nanoGPT's loop, the gather added
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = m.gather_vocab_logits(logits[:, -1, :]) / temperature   # [B, V] on every rank
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat((idx, torch.multinomial(probs, num_samples=1)), dim=1)
        return idx


cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
torch.manual_seed(0)                        # the same seed on every rank: the same dense weights
dense = GPT(cfg).double()
model = VocabParallelGPT(dense)
lo, hi = model.transformer.wte.vocab_start, model.transformer.wte.vocab_end
assert (lo, hi) == (rank * 64 // world, (rank + 1) * 64 // world)
assert model.lm_head.weight is model.transformer.wte.weight            # still tied
g = torch.Generator().manual_seed(1)
idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
targets = torch.roll(idx, -1, 1).masked_fill(torch.rand(idx.shape, generator=g) < 0.2, -1)   # some ignored

optimizers = [net.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95))
              for net in (dense, model)]
for step in range(3):                       # forward and backward, compared; then an AdamW step on both
    dense_logits, dense_loss = dense(idx, targets)
    logits, loss = model(idx, targets)
    dense_loss.backward()
    loss.backward()
    torch.testing.assert_close(logits, dense_logits[..., lo:hi])
    torch.testing.assert_close(loss, dense_loss)
    dense_params = dict(dense.named_parameters())
    assert set(dense_params) == {n for n, _ in model.named_parameters()}   # wte and lm_head: one tensor, as wte
    for n, p in model.named_parameters():
        rows = slice(lo, hi) if n == "transformer.wte.weight" else slice(None)
        torch.testing.assert_close(p, dense_params[n][rows], msg=n)
        torch.testing.assert_close(p.grad, dense_params[n].grad[rows], msg=n)
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)

with torch.no_grad():                       # the sampler's gather, then whole generate() calls
    prompt = idx[:, :4]
    torch.testing.assert_close(m.gather_vocab_logits(model(prompt)[0][:, -1]), dense(prompt)[0][:, -1])
for top_k in (None, 5):
    torch.manual_seed(5)
    want = dense.generate(prompt, 8, temperature=0.8, top_k=top_k)
    torch.manual_seed(5)
    got = model.generate(prompt, 8, temperature=0.8, top_k=top_k)
    every = [None] * world
    dist.all_gather_object(every, got.tolist())
    assert torch.equal(got, want) and all(e == every[0] for e in every), (got, want)
