"""01 - point to point: send and recv, the only communication a pipeline needs.

Pipeline parallelism cuts the model into stages, one per rank. A micro-batch's activation travels right,
stage to stage; in the backward pass its gradient travels left. Each hop is one send matched by one recv:

  forward    stage 0 --act--> stage 1 --act--> stage 2 --act--> stage 3 -> loss
  backward   stage 0 <-grad-- stage 1 <-grad-- stage 2 <-grad-- stage 3
  before: stage r holds layer r (stage 0 also the input)
  after:  the last stage holds the loss; every stage holds the gradient of its own layer

Exchanges with ring neighbours (prev = r-1, next = r+1, mod W) are the other pattern (ring attention, the
ring all-reduce of lesson 03):
  ring exchange      before: rank r holds x_r      after: rank r holds x_{r-1}
  both neighbours    before: rank r holds R_r, L_r after: rank r holds R_{r-1} (from prev) and L_{r+1} (from next)

Three rules keep this correct and free of deadlock:
- A blocking send completes only once the receiver has posted the matching recv (gloo's send blocks even for
  ten floats; NCCL's returns to the CPU at once, but its kernel waits on the GPU for the matching receive, so
  the GPU stalls the same way). If every rank sends first, every rank waits for a recv its peer posts only
  after its own send: a deadlock. Even ranks send first and odd ranks receive first, and the chain of waits
  always ends (section 2 runs that order with blocking calls). On NCCL an isend/irecv also waits on its GPU
  stream for its partner, so Megatron posts even its non-blocking ops in this order (p2p_ops below);
  batch_isend_irecv hands the whole set to NCCL at once.
- Two messages between the same two ranks match in the order they were posted (NCCL ignores tags) or by tag
  (gloo). At W = 2 "prev" and "next" are the same peer: post rightward before leftward on both sides, and tag them.
- A receiver allocates before it receives, so it must know the shape. With variable sequence lengths, send the
  shape first as a fixed-size int64 header, then the tensor.

Bytes each rank sends for a V-byte message: pipeline, V per boundary in each direction (activation right,
gradient left; the first stage sends no gradient, the last no activation); ring exchange, V (and receives V);
both neighbours, 2V; with a shape header, 8 * (MAX_NDIM + 1) bytes more per message.

Run:  torchrun --nproc-per-node=4 01_p2p.py
tests/check_01.py proves beyond it: orders replayed (W = 2..8), sub-groups, strided views, bf16/int64, refusals.
"""
import torch
import torch.distributed as dist


# ---- building blocks: paste from here to the demo marker (they need only torch) ----------------------------
TAG_RIGHT, TAG_LEFT, TAG_SHAPE = 1, 2, 3  # activations go right, gradients left; gloo matches tags, NCCL ignores them
MAX_NDIM = 4                              # shape header = [ndim, d0, d1, d2, d3], int64


def _global(group, group_rank):
    """send/recv take global ranks; translate a rank within `group`."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# a pipeline with blocking send/recv (Megatron's p2p_communication names); stages are the group's ranks in order
def send_forward(output, group=None):
    """Send this stage's output activation to the next stage (nothing on the last stage)."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if me < n - 1:
        dist.send(output.contiguous(), _global(group, me + 1), group=group, tag=TAG_RIGHT)


def recv_forward(shape, dtype, device, group=None):
    """The previous stage's output activation; None on the first stage."""
    me = dist.get_rank(group)
    if me == 0:
        return None
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, _global(group, me - 1), group=group, tag=TAG_RIGHT)
    return buf


def send_backward(input_grad, group=None):
    """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
    me = dist.get_rank(group)
    if me > 0:
        dist.send(input_grad.contiguous(), _global(group, me - 1), group=group, tag=TAG_LEFT)


def recv_backward(shape, dtype, device, group=None):
    """The gradient of this stage's output, from the next stage; None on the last stage."""
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if me == n - 1:
        return None
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, _global(group, me + 1), group=group, tag=TAG_LEFT)
    return buf


# variable shapes: the shape travels first
def shape_header(shape, device):
    """[ndim, d0, ..., 0 padding]: MAX_NDIM + 1 int64s, a size both sides know in advance."""
    if len(shape) > MAX_NDIM:
        raise ValueError(f"a {len(shape)}-d tensor does not fit a shape header of MAX_NDIM={MAX_NDIM} dims")
    return torch.tensor([len(shape), *shape] + [0] * (MAX_NDIM - len(shape)), dtype=torch.int64, device=device)


def shape_from_header(header):
    return torch.Size(header[1:1 + int(header[0])].tolist())


def send_with_shape(x, dst, group=None):
    """Send x's shape (a fixed-size header), then x, to dst (a global rank, as dist.send takes)."""
    dist.send(shape_header(x.shape, x.device), dst, group=group, tag=TAG_SHAPE)
    dist.send(x.contiguous(), dst, group=group, tag=TAG_RIGHT)


def recv_with_shape(src, dtype, device, group=None):
    """Receive the header, allocate that shape, receive the tensor from src (a global rank)."""
    header = torch.empty(MAX_NDIM + 1, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group, tag=TAG_SHAPE)
    x = torch.empty(shape_from_header(header), dtype=dtype, device=device)
    dist.recv(x, src, group=group, tag=TAG_RIGHT)
    return x


# exchange with both ring neighbours
def even_odd_order(me, n):
    """The order rank `me` of a ring of n posts its four neighbour messages: even ranks send first, odd ranks
    receive first; rightward messages (to next, from prev) before leftward ones (to prev, from next)."""
    prev, nxt = (me - 1) % n, (me + 1) % n
    ops = [("send", nxt, TAG_RIGHT), ("recv", prev, TAG_RIGHT), ("send", prev, TAG_LEFT), ("recv", nxt, TAG_LEFT)]
    return ops if me % 2 == 0 else [ops[1], ops[0], ops[3], ops[2]]


def _neighbour_ops(send_prev, recv_prev, send_next, recv_next, group):
    """(isend or irecv, tensor, global peer, tag) in even/odd order, skipping the tensors that are None."""
    for name, t in (("recv_prev", recv_prev), ("recv_next", recv_next)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} of shape {tuple(t.shape)} is not contiguous: receive into a contiguous buffer")
    me, n = dist.get_rank(group), dist.get_world_size(group)
    if n == 1:  # a ring of one is its own neighbour; gloo cannot send to self, so copy instead
        for out, inp in ((recv_prev, send_next), (recv_next, send_prev)):
            if out is not None and inp is not None:
                out.copy_(inp)
        return []
    tensors = {("send", TAG_RIGHT): send_next, ("recv", TAG_RIGHT): recv_prev,
               ("send", TAG_LEFT): send_prev, ("recv", TAG_LEFT): recv_next}
    ops = [(dist.isend if kind == "send" else dist.irecv, tensors[kind, tag], _global(group, peer), tag)
           for kind, peer, tag in even_odd_order(me, n)]
    return [(op, t if op is dist.irecv else t.contiguous(), peer, tag) for op, t, peer, tag in ops if t is not None]


def p2p_ops(*, send_prev=None, recv_prev=None, send_next=None, recv_next=None, group=None):
    """Exchange with both ring neighbours by isend/irecv posted in even/odd order (Megatron's _p2p_ops).
    Returns the Work handles: wait on each before reading a received buffer."""
    return [op(t, peer, group=group, tag=tag)
            for op, t, peer, tag in _neighbour_ops(send_prev, recv_prev, send_next, recv_next, group)]


def batched_p2p_ops(*, send_prev=None, recv_prev=None, send_next=None, recv_next=None, group=None):
    """The same exchange as one batch_isend_irecv call (Megatron's _batched_p2p_ops). Wait on EVERY handle
    returned: gloo returns one per op (NCCL one per batch)."""
    ops = [dist.P2POp(op, t, peer, group, tag)
           for op, t, peer, tag in _neighbour_ops(send_prev, recv_prev, send_next, recv_next, group)]
    return dist.batch_isend_irecv(ops) if ops else []


# ---- demo: checks the blocks above against one process (needs common.py; the blocks need only torch) ----
try:
    from common import finish, head, log, setup, traffic
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

F64 = torch.float64


def payload(r, which, device):
    """Rank r's message number `which`: values that say who sent which message."""
    return torch.arange(3, dtype=F64, device=device) + 100 * r + 10 * which


def pipeline(rank, W, device, H=8, B=2):
    head(f"1. a {W}-stage pipeline: activations right, gradients left (blocking send/recv)")
    torch.manual_seed(W)                                           # the same layers and input on every stage
    layers = [torch.nn.Linear(H, H, dtype=F64, device=device) for _ in range(W)]
    x = torch.randn(B, H, dtype=F64, device=device)                # [B, H], the micro-batch
    acts = [x.clone().requires_grad_()]                            # reference: the whole model in one process
    for layer in layers:
        acts.append(torch.tanh(layer(acts[-1])))
    ref = torch.autograd.grad(acts[-1].pow(2).sum(), acts[:-1] + [layers[rank].weight, layers[rank].bias])

    stage = layers[rank]                                           # this rank runs layer `rank` only
    with traffic() as t:
        got = recv_forward((B, H), F64, device)                    # None on the first stage
        inp = (x if got is None else got).clone().requires_grad_()
        out = torch.tanh(stage(inp))                               # [B, H]
        send_forward(out.detach())
        grad_out = recv_backward(out.shape, out.dtype, device)     # None on the last stage
        out.backward(2 * out.detach() if grad_out is None else grad_out)  # the loss lives on the last stage
        send_backward(inp.grad)
    assert (got is None) == (rank == 0) and (grad_out is None) == (rank == W - 1)
    torch.testing.assert_close(inp.detach(), acts[rank].detach())  # stage r received activation r
    if grad_out is not None:
        torch.testing.assert_close(grad_out, ref[rank + 1])        # ... and the gradient of its output
    torch.testing.assert_close(inp.grad, ref[rank])
    torch.testing.assert_close((stage.weight.grad, stage.bias.grad), ref[W:])
    hops = (rank < W - 1) + (rank > 0)                             # V right unless last, V left unless first
    assert t.bytes["send"] == t.bytes["recv"] == hops * out.nbytes
    log(f"each boundary: {out.nbytes} B activation right, {out.nbytes} B gradient left; every stage's activation, "
        f"gradients and layer grads == the one-process model" if W > 1 else
        "W=1: one stage, both recvs return None; its grads == the one-process model")


def blocking_order(rank, W, device):
    head("2. no deadlock with blocking send/recv: even ranks send first, odd ranks receive first")
    if W == 1:
        log("W=1: no peer to send to (gloo cannot send to itself)")
        return
    sends = {TAG_RIGHT: payload(rank, 0, device), TAG_LEFT: payload(rank, 1, device)}
    got = {TAG_RIGHT: torch.empty(3, dtype=F64, device=device), TAG_LEFT: torch.empty(3, dtype=F64, device=device)}
    for kind, peer, tag in even_odd_order(rank, W):                # each call returns once its peer has matched it
        if kind == "send":
            dist.send(sends[tag], peer, tag=tag)
        else:
            dist.recv(got[tag], peer, tag=tag)
    assert torch.equal(got[TAG_RIGHT], payload((rank - 1) % W, 0, device))  # prev's rightward message
    assert torch.equal(got[TAG_LEFT], payload((rank + 1) % W, 1, device))   # next's leftward message
    log(f"{W} ranks, 4 blocking calls each in even/odd order: all complete, rank r holds prev's rightward and "
        f"next's leftward tensor (every rank sending first would wait in a cycle)")


def ring_exchange(rank, W, device):
    head("3. ring exchange with isend/irecv: send to next, receive from prev, at once")
    got = torch.empty(3, dtype=F64, device=device)
    with traffic() as t:
        [w.wait() for w in p2p_ops(send_next=payload(rank, 2, device), recv_prev=got)]
    assert torch.equal(got, payload((rank - 1) % W, 2, device))   # rank r holds x_{r-1}
    assert t.bytes["send"] == t.bytes["recv"] == (W > 1) * got.nbytes
    log(f"rank r holds rank (r-1)'s tensor, {got.nbytes} B sent and received per rank" if W > 1 else
        "W=1: a ring of one is its own neighbour: copied, nothing sent")


def both_neighbours(rank, W, device):
    head("4. both neighbours at once: batch_isend_irecv, and even/odd isend/irecv")
    for name, exchange in (("batch_isend_irecv", batched_p2p_ops), ("even/odd isend/irecv", p2p_ops)):
        from_prev, from_next = torch.empty(3, dtype=F64, device=device), torch.empty(3, dtype=F64, device=device)
        with traffic() as t:
            [w.wait() for w in exchange(send_next=payload(rank, 3, device), send_prev=payload(rank, 4, device),
                                        recv_prev=from_prev, recv_next=from_next)]
        assert torch.equal(from_prev, payload((rank - 1) % W, 3, device))  # prev's rightward tensor
        assert torch.equal(from_next, payload((rank + 1) % W, 4, device))  # next's leftward tensor
        assert t.bytes["send"] == t.bytes["recv"] == 2 * (W > 1) * from_prev.nbytes
    log(f"both ways: rank r holds prev's rightward and next's leftward tensor, {2 * (W > 1) * from_prev.nbytes} B "
        f"sent per rank")


def variable_shapes(rank, W, device, H=8):
    head("5. variable sequence lengths: the shape travels first")
    torch.manual_seed(5)
    seq_lens = torch.randint(1, 9, (3,)).tolist()                  # the same on every rank: the shared seed
    hdr = 8 * (MAX_NDIM + 1)                                       # the closed form: MAX_NDIM + 1 int64s
    for m, s in enumerate(seq_lens):
        mb = torch.arange(s * H, dtype=F64, device=device).reshape(s, H) + 1000 * m  # [s, H]: micro-batch m
        with traffic() as t:                                       # stage r receives mb + r and sends mb + r + 1
            got = mb if rank == 0 else recv_with_shape(rank - 1, F64, device)
            if rank < W - 1:
                send_with_shape(got + 1, rank + 1)
        assert torch.equal(got, mb + rank), (m, got.shape)
        assert t.bytes["send"] == (rank < W - 1) * (hdr + mb.nbytes)
        assert t.bytes["recv"] == (rank > 0) * (hdr + mb.nbytes)
    log(f"3 micro-batches of {seq_lens} tokens x {H}: each stage allocates from a {hdr} B header, then receives "
        f"the tensor; == the tensor sent" + (" (W=1: nothing to send)" if W == 1 else ""))


def main():
    rank, W, device = setup()
    pipeline(rank, W, device)
    blocking_order(rank, W, device)
    ring_exchange(rank, W, device)
    both_neighbours(rank, W, device)
    variable_shapes(rank, W, device)
    finish("pipeline send/recv forward and backward == one process, the even/odd order run blocking, ring and "
           "neighbour exchanges, variable shapes behind a header; bytes == the closed forms")


if __name__ == "__main__":
    main()
