"""04's blocks pasted alone (m), inside the user's nanoGPT-style GPT (tests/nanogpt.py), float64: every block's MLP
becomes a top-2 mixture of experts. The dense GPT holds all E experts in one process (the user's own MoE, written
out below) and runs every rank's sequences; the expert-parallel GPT holds E/W experts a rank, runs only this
rank's sequences, and must give the same logits and loss, expert gradients equal to the dense ones as they are
(the all-to-all backward brings every rank's tokens' share), replicated gradients (router included) equal once
summed over the ranks, and the same weights after an AdamW step. Ragged and padded dispatch. Run by test_all at 2
and 4 ranks with torch, dist, nn, F, m, rank, world defined."""
import copy

from tests.nanogpt import GPT, GPTConfig

E, K = 2 * world, 2                                    # experts (E/W = 2 a rank), experts a token picks


class DenseMoE(nn.Module):
    """All E experts in one process: every expert on every token, each token's top-k outputs weighted by their
    (not renormalised) softmax gates; no capacity, nothing dropped."""

    def __init__(self, n_embd):
        super().__init__()
        self.router = nn.Linear(n_embd, E, bias=False)
        self.experts = nn.ModuleList(m.make_expert(n_embd, 4 * n_embd) for _ in range(E))

    def forward(self, x):                              # [B, T, C]
        flat = x.reshape(-1, x.shape[-1])              # [N, C]
        gates, idx = self.router(flat).softmax(-1).topk(K, dim=-1)                   # [N, K]
        every = torch.stack([expert(flat) for expert in self.experts], dim=1)        # [N, E, C]
        picked = every.gather(1, idx[..., None].expand(-1, -1, flat.shape[-1]))      # [N, K, C]
        return (gates[..., None] * picked).sum(1).view_as(x)


class ExpertParallelMLP(nn.Module):
    """A block's MLP as the expert-parallel layer: [B, T, C] -> N = B*T tokens -> ExpertParallelMoE -> [B, T, C]."""

    def __init__(self, dense_moe, padded):
        super().__init__()
        C, L = dense_moe.router.in_features, E // world
        self.moe = m.ExpertParallelMoE(C, 4 * C, E, k=K, padded=padded, dtype=torch.float64)
        self.moe.router.load_state_dict(dense_moe.router.state_dict())
        self.moe.experts.load_state_dict(nn.ModuleList(dense_moe.experts[rank * L:(rank + 1) * L]).state_dict())

    def forward(self, x):
        return self.moe(x.reshape(-1, x.shape[-1])).view_as(x)


torch.manual_seed(0)
cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=8)
dense = GPT(cfg)
for block in dense.transformer.h:
    block.mlp = DenseMoE(cfg.n_embd)
dense.double()
B, T, L = 2, 8, E // world
idx = torch.randint(cfg.vocab_size, (world * B, T))
targets = torch.randint(cfg.vocab_size, (world * B, T))
targets[:, 0] = -1                                     # ignore_index=-1, as many skipped targets on every rank
mine = slice(rank * B, (rank + 1) * B)
logits, loss = dense(idx, targets)
loss.backward()
grads = {n: p.grad.clone() for n, p in dense.named_parameters()}
ref = copy.deepcopy(dense)                             # one AdamW step on the dense gradients
for n, p in ref.named_parameters():
    p.grad = grads[n].clone()
ref.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95)).step()
close = dict(rtol=1e-12, atol=1e-14)

for padded in (False, True):
    ep = copy.deepcopy(dense)
    for block in ep.transformer.h:
        block.mlp = ExpertParallelMLP(block.mlp, padded)
    ep_logits, ep_loss = ep(idx[mine], targets[mine])
    (ep_loss / world).backward()                       # the dense loss is the mean of the ranks' losses
    torch.testing.assert_close(ep_logits, logits.detach()[mine], **close)
    total = ep_loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total / world, loss.detach(), **close)
    for n, p in ep.named_parameters():
        if ".experts." not in n:                       # replicated (attention, norms, wte, router): summed
            dist.all_reduce(p.grad)
            want = grads[n.replace(".mlp.moe.", ".mlp.")]
            torch.testing.assert_close(p.grad, want, **close, msg=f"padded={padded}: {n}")
    for i, block in enumerate(ep.transformer.h):
        for l, expert in enumerate(block.mlp.moe.experts):    # this rank's experts: no sum over the ranks
            dense_expert = dense.transformer.h[i].mlp.experts[rank * L + l]
            for (n, p), q in zip(expert.named_parameters(), dense_expert.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **close, msg=f"padded={padded}: h.{i} expert {l} {n}")
    ep.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95)).step()
    for i, block in enumerate(ep.transformer.h):
        for l, expert in enumerate(block.mlp.moe.experts):
            for p, q in zip(expert.parameters(), ref.transformer.h[i].mlp.experts[rank * L + l].parameters()):
                torch.testing.assert_close(p, q, **close)
        torch.testing.assert_close(block.mlp.moe.router.weight, ref.transformer.h[i].mlp.router.weight, **close)
    torch.testing.assert_close(ep.lm_head.weight, ref.lm_head.weight, **close)
    assert not torch.equal(ep.lm_head.weight, dense.lm_head.weight)    # the step moved the weights
