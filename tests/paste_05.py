# 05's blocks pasted alone, inside the user's nanoGPT-style GPT (tests/nanogpt.py): every Block's attention becomes
# ParallelSelfAttention.from_dense(attn) (its fused c_attn sharded by heads, batch-first) and its MLP
# parallel_mlp((c_fc, gelu, c_proj), sequence_dim=1), both on the model's [B, T, C] as it is (no transpose), over
# all ranks, TP and then SP. Under SP each rank runs the embeddings, the LayerNorms, the residuals, ln_f and the tied
# head on its own T/p positions (GPT.forward(pos=...)), the loss is summed over the ranks' tokens, and every
# replicated parameter's gradient (a partial sum) is summed by allreduce_sequence_parallel_grads. Checked against
# the dense GPT in one process, float64: the loss, every gradient (this rank's shard), and the parameters after one
# step of nanoGPT's own AdamW (configure_optimizers).
from tests.nanogpt import GPT, GPTConfig

# the PASTED check this file replaces: a column layer with gather_output == its nn.Linear
dense = torch.nn.Linear(6, 4 * world, dtype=torch.float64)
col = m.ColumnParallelLinear.from_dense(dense, gather_output=True)
x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
torch.testing.assert_close(col(x), dense(x))


cfg = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)
g = torch.Generator().manual_seed(1)
B, T, C = 2, cfg.block_size, cfg.n_embd
idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
targets = torch.roll(idx, -1, 1).masked_fill(torch.rand(idx.shape, generator=g) < 0.2, -1)    # some ignored
mine = lambda t: t.chunk(world, 0)[rank]                          # this rank's contiguous slice of rows


def shard(name, grad):
    """This rank's part of a dense parameter (or gradient) `name`, by the rule written out: c_attn's rows are
    [q; k; v], each split by heads; c_fc's rows and both c_proj's columns are split; everything else whole."""
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        return torch.cat([mine(piece) for piece in grad.split(C)])
    if name.endswith("c_fc.weight") or name.endswith("c_fc.bias"):
        return mine(grad)
    if name.endswith("c_proj.weight"):
        return mine(grad.t()).t()
    return grad


# the parallel model's parameter names, in the dense model's terms
rename = {"attn.qkv.": "attn.c_attn.", "attn.proj.": "attn.c_proj.", "mlp.0.": "mlp.c_fc.", "mlp.2.": "mlp.c_proj."}


def dense_name(name):
    for a, b in rename.items():
        name = name.replace(a, b)
    return name


for sp in (False, True):
    torch.manual_seed(0)
    dense = GPT(cfg).double()                                     # the same seed on every rank: the same weights
    model = GPT(cfg).double()
    model.load_state_dict(dense.state_dict())
    for blk in model.transformer.h:                               # the user's blocks, replaced in place
        blk.attn = m.ParallelSelfAttention.from_dense(blk.attn, sequence_parallel=sp)
        blk.mlp = m.parallel_mlp((blk.mlp.c_fc, blk.mlp.gelu, blk.mlp.c_proj), sequence_parallel=sp, sequence_dim=1)
    assert len(list(model.parameters())) == len(list(dense.parameters()))
    opt_dense = dense.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95))
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, betas=(0.9, 0.95))

    _, dense_loss = dense(idx, targets)
    dense_loss.backward()
    if not sp:                                                    # every rank the whole sequence
        _, loss = model(idx, targets)
        loss.backward()
    else:                                                         # every rank its T/p positions
        for name, p in model.named_parameters():
            if not (".attn." in name or ".mlp." in name):         # replicated: a partial grad under SP
                p.sequence_parallel = True
        pos = mine(torch.arange(T))                               # the global positions this rank holds
        logits, _ = model(idx[:, pos], pos=pos)
        tgt = targets[:, pos]
        counted = (targets != -1).sum()                           # the dense loss's denominator: every rank's tokens
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-1, reduction="sum") / counted
        loss.backward()
        m.allreduce_sequence_parallel_grads(model.parameters())
        loss = loss.detach().clone()
        dist.all_reduce(loss)
    torch.testing.assert_close(loss, dense_loss.detach())
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, shard(dense_name(name), dense_params[dense_name(name)].grad), msg=name)
        assert p.grad.is_contiguous(), name

    fc1 = model.transformer.h[0].mlp[0]
    before = fc1.weight.detach().clone()
    opt.step()
    opt_dense.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, shard(dense_name(name), dense_params[dense_name(name)]), msg=name)
    assert not torch.equal(fc1.weight, before)                    # the (SP) column weight did move
