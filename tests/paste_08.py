"""08's blocks pasted alone (m), running the user's nanoGPT-style GPT (tests/nanogpt.py) as a pipeline over the world,
float64: each stage (or chunk) runs a run of its transformer blocks, the first also the embeddings, the last ln_f and
the head tied to wte; the two copies of the tied weight are summed over the first and last stage by the blocks'
embedding_group() and allreduce_tied_grad(). Under 1F1B, ZB-H1 (split backward) and interleaved 1F1B (two chunks a
stage), against the dense GPT in one process: the mean loss over the micro-batches (targets of -1 skipped) and every
gradient each stage owns, wte's included; no other gradient. Run by test_all at 2 and 4 ranks with torch, dist, nn,
F, m, rank, world defined."""
from tests.nanogpt import GPT, GPTConfig

order = m.schedule_1f1b(2, rank % 2, 3)            # 1F1B on two stages: warm-up, steady pairs, cool-down
assert [op[0] for op in order] == (["F", "F", "B", "F", "B", "B"] if rank % 2 == 0 else ["F", "B"] * 3), order


class Part(nn.Module):
    """Blocks lo..hi-1 of the user's GPT (the same modules and Parameters); the first part embeds the token ids
    (nanoGPT's positions arange(T)), the last ends in the tied head's logits [B, T, vocab]."""

    def __init__(self, gpt, lo, hi, first, last):
        super().__init__()
        tr = gpt.transformer
        self.wte, self.wpe, self.drop = (tr.wte, tr.wpe, tr.drop) if first else (None, None, None)
        self.h = nn.ModuleList(tr.h[lo:hi])
        self.ln_f, self.lm_head = (tr.ln_f, gpt.lm_head) if last else (None, None)

    def forward(self, x):                              # ids [B, T] (first) or [B, T, C]
        if self.wte is not None:
            x = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.lm_head is not None else x


B, T, MB = 2, 8, 4                                     # a micro-batch: B sequences of T tokens; 4 micro-batches
cfg = GPTConfig(block_size=T, vocab_size=64, n_layer=2 * world, n_head=4, n_embd=32)
torch.manual_seed(0)
dense, model = GPT(cfg).double(), GPT(cfg).double()    # the same seed on every rank: the same weights
model.load_state_dict(dense.state_dict())
g = torch.Generator().manual_seed(1)
ids = [torch.randint(0, cfg.vocab_size, (B, T), generator=g) for _ in range(MB)]
targets = [torch.roll(i, -1, 1).masked_fill(torch.rand(i.shape, generator=g) < 0.2, -1) for i in ids]
dense_loss = sum(dense(i, t)[1] for i, t in zip(ids, targets)) / MB   # the reference, one process
dense_loss.backward()
dense_grads = {n: q.grad for n, q in dense.named_parameters()}
loss_fn = lambda logits, t: F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=-1)
group = m.embedding_group()                            # stages 0 and world-1: the two copies of wte = lm_head

for fn, v in ((m.schedule_1f1b, 1), (m.schedule_zb_h1, 1), (m.schedule_interleaved_1f1b, 2)):
    model.zero_grad(set_to_none=True)
    k = cfg.n_layer // (world * v)                     # blocks a chunk; chunk c of stage s is model chunk c*p + s
    parts = [Part(model, u * k, (u + 1) * k, u == 0, u == world * v - 1) for u in (c * world + rank for c in range(v))]
    comm = m.P2PCommunicator((B, T, cfg.n_embd), torch.float64, torch.device("cpu"))
    schedule = fn if v == 1 else (lambda p, s, mb: m.schedule_interleaved_1f1b(p, s, mb, 2))
    loss, trace, _ = m.run_schedule(parts[0] if v == 1 else parts, schedule, comm, ids, targets, loss_fn)
    m.allreduce_tied_grad(model.transformer.wte.weight, group)
    if rank == world - 1:
        torch.testing.assert_close(loss, dense_loss.detach(), rtol=1e-12, atol=0)
    else:
        assert loss is None, loss
    mine = {id(q) for part in parts for q in part.parameters()}
    for n, q in model.named_parameters():              # wte and lm_head are one tensor: named once, as wte
        if id(q) in mine:
            assert q.grad.is_contiguous(), (n, q.grad.stride())
            torch.testing.assert_close(q.grad, dense_grads[n], rtol=1e-9, atol=1e-14, msg=f"{fn.__name__}: {n}")
        else:
            assert q.grad is None, (fn.__name__, n)      # another stage's block: never touched here
