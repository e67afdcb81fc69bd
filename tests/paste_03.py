"""03's blocks pasted alone (m), inside the user's nanoGPT-style GPT (tests/nanogpt.py), float64, against the dense
GPT: data parallelism with ring_all_reduce summing the gradients before AdamW, Megatron's tensor-parallel MLP made
of f and g in every block, and a block's MLP sequence-parallel (batch-first, dim=1) between the gather and the
reduce-scatter regions. Run by test_all at 2 and 4 ranks with torch, dist, nn, F, m, rank, world defined."""
import copy

from tests.nanogpt import GPT, GPTConfig

torch.manual_seed(0)
cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)   # c_fc: 64 = 16 x 4 columns
dense = GPT(cfg).double()
B, T = 2, 8                                            # B sequences a rank, T tokens each
idx = torch.randint(cfg.vocab_size, (world * B, T))
targets = torch.randint(cfg.vocab_size, (world * B, T))
targets[:, 0] = -1                                     # ignore_index=-1, as many skipped targets on every rank
mine = slice(rank * B, (rank + 1) * B)
logits, loss = dense(idx, targets)
loss.backward()
grads = {n: p.grad.clone() for n, p in dense.named_parameters()}   # the tied wte / lm_head once

# 1. data parallel: each rank its own sequences, the gradients summed by the ring, averaged, then AdamW
ddp = copy.deepcopy(dense)
ddp.zero_grad()
_, loss_r = ddp(idx[mine], targets[mine])
loss_r.backward()
torch.testing.assert_close(m.ring_all_reduce(loss_r.detach().view(1)) / world, loss.detach().view(1))
for n, p in ddp.named_parameters():
    p.grad = m.ring_all_reduce(p.grad) / world
    torch.testing.assert_close(p.grad, grads[n], rtol=1e-12, atol=1e-14, msg=n)
ref = copy.deepcopy(dense)                             # the dense model, one AdamW step on the dense gradients
for n, p in ref.named_parameters():
    p.grad = grads[n].clone()
for model in (ref, ddp):
    model.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95)).step()
for (n, p), (_, p_ref) in zip(ddp.named_parameters(), ref.named_parameters()):
    torch.testing.assert_close(p, p_ref, rtol=1e-12, atol=1e-14, msg=n)
assert not torch.equal(ref.lm_head.weight, dense.lm_head.weight)   # the step moved the weights


# 2. tensor parallel: every block's MLP split Megatron's way, f before it, g after it
class TensorParallelMLP(nn.Module):
    """nanoGPT's MLP: c_fc split by output features (rows of its weight), c_proj by input features; the
    c_proj bias is added once, after g."""

    def __init__(self, mlp, group=None):
        super().__init__()
        G, r = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.fc_w = nn.Parameter(mlp.c_fc.weight.detach().chunk(G, 0)[r].clone())
        self.fc_b = nn.Parameter(mlp.c_fc.bias.detach().chunk(G, 0)[r].clone())
        self.proj_w = nn.Parameter(mlp.c_proj.weight.detach().chunk(G, 1)[r].clone())
        self.proj_b = nn.Parameter(mlp.c_proj.bias.detach().clone())

    def forward(self, x):                              # x [B, T, C], the same on every rank
        x = m.copy_to_tensor_model_parallel_region(x, self.group)
        h = F.gelu(F.linear(x, self.fc_w, self.fc_b))  # [B, T, 4C / G]
        return m.reduce_from_tensor_model_parallel_region(F.linear(h, self.proj_w), self.group) + self.proj_b


tp = copy.deepcopy(dense)
tp.zero_grad()
for block in tp.transformer.h:
    block.mlp = TensorParallelMLP(block.mlp)
tp_logits, tp_loss = tp(idx, targets)
tp_loss.backward()
torch.testing.assert_close(tp_logits, logits, rtol=1e-12, atol=1e-14)
torch.testing.assert_close(tp_loss, loss, rtol=1e-12, atol=1e-14)
for n, p in tp.named_parameters():
    if ".mlp." not in n:                               # replicated: f's all-reduce made the whole gradient
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-12, atol=1e-14, msg=n)
G = world
for i, block in enumerate(tp.transformer.h):
    d = f"transformer.h.{i}.mlp."
    shards = {"fc_w": grads[d + "c_fc.weight"].chunk(G, 0)[rank], "fc_b": grads[d + "c_fc.bias"].chunk(G, 0)[rank],
              "proj_w": grads[d + "c_proj.weight"].chunk(G, 1)[rank], "proj_b": grads[d + "c_proj.bias"]}
    for name, want in shards.items():
        torch.testing.assert_close(getattr(block.mlp, name).grad, want, rtol=1e-12, atol=1e-14, msg=name)


# 3. sequence parallel, batch-first: rank r holds tokens r*T/W .. of [B, T, C]; gather along dim 1 before c_fc,
#    reduce-scatter along dim 1 after c_proj
class SequenceParallelMLP(TensorParallelMLP):
    def forward(self, x):                              # x [B, T/G, C]: this rank's tokens
        x = m.gather_from_sequence_parallel_region(x, self.group, dim=1)                 # [B, T, C]
        h = F.gelu(F.linear(x, self.fc_w, self.fc_b))
        return m.reduce_scatter_to_sequence_parallel_region(F.linear(h, self.proj_w), self.group, dim=1) + self.proj_b


mlp = copy.deepcopy(dense.transformer.h[0].mlp)
mlp.zero_grad()
X = torch.randn(B, T, cfg.n_embd, dtype=torch.float64, requires_grad=True)
dY = torch.randn(B, T, cfg.n_embd, dtype=torch.float64)
(mlp(X) * dY).sum().backward()
sp = SequenceParallelMLP(mlp)
part = slice(rank * T // G, (rank + 1) * T // G)
x = X.detach()[:, part].clone().requires_grad_()
out = sp(x)
(out * dY[:, part]).sum().backward()
torch.testing.assert_close(out, mlp(X).detach()[:, part], rtol=1e-12, atol=1e-14)
torch.testing.assert_close(x.grad, X.grad[:, part], rtol=1e-12, atol=1e-14)
torch.testing.assert_close(sp.fc_w.grad, mlp.c_fc.weight.grad.chunk(G, 0)[rank], rtol=1e-12, atol=1e-14)
torch.testing.assert_close(sp.proj_w.grad, mlp.c_proj.weight.grad.chunk(G, 1)[rank], rtol=1e-12, atol=1e-14)
torch.testing.assert_close(m.ring_all_reduce(sp.proj_b.grad), mlp.c_proj.bias.grad, rtol=1e-12, atol=1e-14)
