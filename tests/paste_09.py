# 09's blocks pasted alone, around the user's nanoGPT-style GPT (tied head) with train.py's loop: the optimizer from
# configure_optimizers, built before wrapping; 2 micro-batches, the first without sync (require_backward_grad_sync,
# then no_sync()); get_lr written into param_groups every step; clip at 1.0; zero_grad(set_to_none=True); then a
# checkpoint (every rank gathers, rank 0 keeps the model's, each rank its optimizer's) loaded into a new wrapper.
# Checked against the dense GPT in one process on every rank's data, float64.
import contextlib
import copy

from tests.nanogpt import GPT, GPTConfig, get_lr

cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)
torch.manual_seed(0)
base = GPT(cfg).double()
B, T, STEPS = 2, 8, 3                                  # sequences per rank and micro-batch
g = torch.Generator().manual_seed(1)
data = torch.randint(cfg.vocab_size, (STEPS + 1, 2, world * B, T + 1), generator=g)


def train(model, optimizer, steps, rows, clip):
    for it in steps:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        for micro in range(2):
            X, Y = data[it, micro, rows, :T].contiguous(), data[it, micro, rows, 1:].contiguous()
            if micro == 0 and it % 2:                   # train.py's flag on even steps, no_sync() on odd ones
                with model.no_sync():
                    (model(X, Y)[1] / 2).backward()
            else:
                model.require_backward_grad_sync = micro == 1
                (model(X, Y)[1] / 2).backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


class Dense(nn.Module):                                 # the one-process reference, with the same loop
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, X, Y):
        return self.net(X, Y)

    def no_sync(self):
        return contextlib.nullcontext()


ref = Dense(copy.deepcopy(base))
ref_opt = ref.net.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
train(ref, ref_opt, range(STEPS + 1), slice(None), lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
want = ref.net.state_dict()
rows = slice(rank * B, (rank + 1) * B)
for cls in (m.DDP, m.ZeRO2, m.ZeRO3):
    net = copy.deepcopy(base)
    optimizer = net.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    model = cls(net, optimizer)
    clip = ((lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) if cls is m.DDP else
            (lambda: model.clip_grad_norm_(1.0)))
    train(model, optimizer, range(STEPS), rows, clip)
    state = model.state_dict()                          # every rank (ZeRO-3 gathers); rank 0 would save it
    opt_state = copy.deepcopy(optimizer.state_dict())   # each rank its own
    box = [state if rank == 0 else None]
    dist.broadcast_object_list(box)                     # what the other ranks load: rank 0's file
    torch.manual_seed(1)
    net2 = GPT(cfg).double()                            # other values, until loaded
    optimizer2 = net2.configure_optimizers(0.1, 6e-4, (0.9, 0.95))
    resumed = cls(net2, optimizer2)
    resumed.load_state_dict(box[0])
    optimizer2.load_state_dict(opt_state)
    clip2 = ((lambda: torch.nn.utils.clip_grad_norm_(resumed.parameters(), 1.0)) if cls is m.DDP else
             (lambda: resumed.clip_grad_norm_(1.0)))
    train(resumed, optimizer2, range(STEPS, STEPS + 1), rows, clip2)
    got = resumed.state_dict()
    assert list(got) == list(want), list(got)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-13, msg=lambda s: f"{cls.__name__} {k}: {s}")
