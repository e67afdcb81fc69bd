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
- A blocking send completes only once the receiver has posted the matching recv: gloo's send blocks even for
  ten floats (measured, torch 2.13); NCCL's returns to the CPU at once but its kernel waits on the GPU for the
  matching receive, so the GPU stalls the same way. If every rank sends first, every rank
  waits for a recv its peer posts only after its own send: a deadlock. Even ranks send first and odd ranks
  receive first, and the chain of waits always ends (section 2 plays both orders and checks; it never runs the
  bad one). On NCCL an isend/irecv also waits on its GPU stream for its partner, so Megatron posts even its
  non-blocking ops in this order (p2p_ops below); batch_isend_irecv hands the whole set to NCCL at once.
- Two messages between the same two ranks match in the order they were posted (NCCL ignores tags) or by tag
  (gloo). At W = 2 "prev" and "next" are the same peer: post rightward before leftward on both sides, and tag them.
- A receiver allocates before it receives, so it must know the shape. With variable sequence lengths, send the
  shape first as a fixed-size int64 header, then the tensor.

Bytes each rank sends for a V-byte message: pipeline, V per boundary in each direction (activation right,
gradient left; the first stage sends no gradient, the last no activation); ring exchange, V (and receives V);
both neighbours, 2V; with a shape header, 8 * (MAX_NDIM + 1) bytes more per message.

Run:  torchrun --nproc-per-node=4 01_p2p.py
"""
import copy

import torch
import torch.distributed as dist

TAG_RIGHT, TAG_LEFT, TAG_SHAPE = 1, 2, 3  # activations go right, gradients left; gloo matches tags, NCCL ignores them
MAX_NDIM = 4                              # shape header = [ndim, d0, d1, d2, d3], int64


# ---- building blocks: ranks ------------------------------------------------------------------------------
def _global(group, group_rank):
    """send/recv take global ranks; translate a rank within `group`."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


# ---- building blocks: a pipeline with blocking send/recv (Megatron's p2p_communication names) ------------
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


# ---- building blocks: variable shapes, the shape travels first -------------------------------------------
def shape_header(shape, device):
    """[ndim, d0, ..., 0 padding]: MAX_NDIM + 1 int64s, a size both sides know in advance."""
    if len(shape) > MAX_NDIM:
        raise ValueError(f"a {len(shape)}-d tensor does not fit a shape header of MAX_NDIM={MAX_NDIM} dims")
    return torch.tensor([len(shape), *shape] + [0] * (MAX_NDIM - len(shape)), dtype=torch.int64, device=device)


def shape_from_header(header):
    return torch.Size(header[1:1 + int(header[0])].tolist())


def send_with_shape(x, dst, group=None):
    """Send x's shape (a fixed-size header), then x, to global rank dst."""
    dist.send(shape_header(x.shape, x.device), dst, group=group, tag=TAG_SHAPE)
    dist.send(x.contiguous(), dst, group=group, tag=TAG_RIGHT)


def recv_with_shape(src, dtype, device, group=None):
    """Receive the header, allocate that shape, receive the tensor: no shape needed in advance."""
    header = torch.empty(MAX_NDIM + 1, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group, tag=TAG_SHAPE)
    x = torch.empty(shape_from_header(header), dtype=dtype, device=device)
    dist.recv(x, src, group=group, tag=TAG_RIGHT)
    return x


# ---- building blocks: exchange with ring neighbours -------------------------------------------------------
def even_odd_order(me, n):
    """The order rank `me` of a ring of n posts its four neighbour messages: even ranks send first, odd ranks
    receive first; rightward messages (to next, from prev) before leftward ones (to prev, from next)."""
    prev, nxt = (me - 1) % n, (me + 1) % n
    ops = [("send", nxt, TAG_RIGHT), ("recv", prev, TAG_RIGHT), ("send", prev, TAG_LEFT), ("recv", nxt, TAG_LEFT)]
    return ops if me % 2 == 0 else [ops[1], ops[0], ops[3], ops[2]]


def _neighbour_ops(send_prev, recv_prev, send_next, recv_next, group):
    """(isend or irecv, tensor, global peer, tag) in even/odd order, skipping the tensors that are None."""
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
    return [op for op in ops if op[1] is not None]


def p2p_ops(*, send_prev=None, recv_prev=None, send_next=None, recv_next=None, group=None):
    """Exchange with both ring neighbours by isend/irecv posted in even/odd order (Megatron's _p2p_ops).
    Returns the Work handles: wait on each before reading a received buffer."""
    return [op(t, peer, group=group, tag=tag)
            for op, t, peer, tag in _neighbour_ops(send_prev, recv_prev, send_next, recv_next, group)]


def batched_p2p_ops(*, send_prev=None, recv_prev=None, send_next=None, recv_next=None, group=None):
    """The same exchange as one batch_isend_irecv call (Megatron's _batched_p2p_ops). Wait on EVERY handle
    returned: gloo returns one per op (NCCL one per batch); waiting on only one hung torch's own pipelining
    on gloo (pytorch#132644)."""
    ops = [dist.P2POp(op, t, peer, group, tag)
           for op, t, peer, tag in _neighbour_ops(send_prev, recv_prev, send_next, recv_next, group)]
    return dist.batch_isend_irecv(ops) if ops else []


def completes(schedules):
    """Play blocking sends and recvs where a send finishes only when its peer reaches the matching recv (gloo's
    rule; NCCL's for large messages). schedules[r] = rank r's ops in order, (kind, peer, tag).
    True when every rank finishes; False is a deadlock."""
    pos, moved = [0] * len(schedules), True
    while moved:
        moved = False
        for a, ops in enumerate(schedules):
            if pos[a] < len(ops) and ops[pos[a]][0] == "send":
                _, b, tag = ops[pos[a]]
                if pos[b] < len(schedules[b]) and schedules[b][pos[b]] == ("recv", a, tag):
                    pos[a], pos[b], moved = pos[a] + 1, pos[b] + 1, True
    return all(p == len(ops) for p, ops in zip(pos, schedules))


# ---- demo ---------------------------------------------------------------------------------------------------
def main():
    from common import setup, finish, log, head
    rank, W, device = setup()
    prev, nxt = (rank - 1) % W, (rank + 1) % W
    f64 = dict(dtype=torch.float64, device=device)
    payload = lambda r, which: torch.arange(3, **f64) + 100 * r + 10 * which  # rank r's message number `which`
    wait_all = lambda works: [w.wait() for w in works]
    sent = lambda nbytes: f"{nbytes} B sent per rank" if W > 1 else "W=1: a ring of one is its own neighbour, copied"

    head(f"1. a {W}-stage pipeline: activations right, gradients left (blocking send/recv, tagged)")
    B, H = 2, 8
    stages = [torch.nn.Linear(H, H, **f64) for _ in range(W)]     # every rank builds all W layers alike
    x = torch.randn(B, H, **f64)                                   # [B, H], the micro-batch
    ref_layers, ref_acts = copy.deepcopy(stages), [x.clone().requires_grad_()]
    for layer in ref_layers:                                       # reference: the whole model in one process
        ref_acts.append(torch.tanh(layer(ref_acts[-1])))
        ref_acts[-1].retain_grad()
    ref_acts[-1].pow(2).sum().backward()

    stage = stages[rank]                                           # this rank runs layer `rank` only
    got = recv_forward((B, H), torch.float64, device)              # None on the first stage
    assert (got is None) == (rank == 0)
    inp = (x if got is None else got).requires_grad_()
    out = torch.tanh(stage(inp))                                   # [B, H]
    send_forward(out.detach())
    grad_out = recv_backward(out.shape, out.dtype, device)         # None on the last stage
    assert (grad_out is None) == (rank == W - 1)
    if grad_out is None:
        out.pow(2).sum().backward()                                # the loss lives on the last stage only
    else:
        torch.testing.assert_close(grad_out, ref_acts[rank + 1].grad)
        out.backward(grad_out)
    send_backward(inp.grad)
    torch.testing.assert_close(inp.detach(), ref_acts[rank].detach())  # rank r received activation r
    torch.testing.assert_close(inp.grad, ref_acts[rank].grad)
    torch.testing.assert_close(stage.weight.grad, ref_layers[rank].weight.grad)
    torch.testing.assert_close(stage.bias.grad, ref_layers[rank].bias.grad)
    if W == 1:
        log("W=1: one stage, both recvs return None; its grads equal the reference's")
    else:
        log(f"each boundary: {out.nbytes} B activation right (tag {TAG_RIGHT}), {out.nbytes} B gradient left "
            f"(tag {TAG_LEFT})")
        log("every stage's received activation and gradient, and its layer's grads, == the one-process model")

    head("2. deadlock: every rank sends first vs even ranks send first")
    naive = lambda n: [[("send", (r + 1) % n, TAG_RIGHT), ("recv", (r - 1) % n, TAG_RIGHT)] for r in range(n)]
    shift = lambda n: [[op for op in even_odd_order(r, n) if op[2] == TAG_RIGHT] for r in range(n)]
    both = lambda n: [even_odd_order(r, n) for r in range(n)]
    both_naive = lambda n: [sorted(even_odd_order(r, n), key=lambda op: op[0] == "recv") for r in range(n)]
    for n in range(2, 9):
        assert not completes(naive(n)) and not completes(both_naive(n)), n
        assert completes(shift(n)) and completes(both(n)), n
    log("ring shift, sends first on every rank: rank r waits for r+1's recv, which waits behind r+1's send...")
    log("   ... around the ring back to r: a cycle, deadlock at every W in 2..8 (played, not run)")
    log("even ranks send first, odd ranks receive first: completes at every W in 2..8, odd W included")
    if W == 1:
        log("W=1: no peer, nothing to run for real (gloo cannot send to itself)")
    else:
        got = torch.empty(3, **f64)
        if rank % 2 == 0:
            dist.send(payload(rank, 0), nxt)
            dist.recv(got, prev)
        else:
            dist.recv(got, prev)
            dist.send(payload(rank, 0), nxt)
        assert torch.equal(got, payload(prev, 0))
        log(f"run for real with blocking send/recv over {W} ranks: every rank holds its prev's tensor")

    head("3. ring exchange with isend/irecv: send to next, receive from prev, at once")
    got = torch.empty(3, **f64)
    wait_all(p2p_ops(send_next=payload(rank, 1), recv_prev=got))
    assert torch.equal(got, payload(prev, 1))                      # rank r holds x_{r-1}
    log(f"rank r holds rank (r-1)'s tensor ({sent(got.nbytes)})")

    head("4. both neighbours at once: batch_isend_irecv, and even/odd isend/irecv")
    sub = dist.new_group(list(range(1, W))) if W >= 3 else None   # ranks 1..W-1: group rank = global rank - 1
    rings = [(None, list(range(W)))] + ([(sub, list(range(1, W)))] if sub is not None else [])
    for name, exchange in (("batch_isend_irecv", batched_p2p_ops), ("even/odd isend/irecv", p2p_ops)):
        for group, ring in rings:
            if rank not in ring:
                continue
            i, n = ring.index(rank), len(ring)
            from_prev, from_next = torch.empty(3, **f64), torch.empty(3, **f64)
            wait_all(exchange(send_next=payload(rank, 2), send_prev=payload(rank, 3),
                              recv_prev=from_prev, recv_next=from_next, group=group))
            assert torch.equal(from_prev, payload(ring[(i - 1) % n], 2))  # prev's rightward tensor
            assert torch.equal(from_next, payload(ring[(i + 1) % n], 3))  # next's leftward tensor
        log(f"{name}: rank r holds prev's rightward and next's leftward tensor ({sent(2 * from_prev.nbytes)})"
            + (", also in the ring of ranks 1..W-1" if sub is not None else ""))
    if W == 2:  # Megatron's batched order, untagged: rank 0's leftward message meets rank 1's first recv
        a, b = torch.empty(3, **f64), torch.empty(3, **f64)
        ops = [dist.P2POp(dist.isend, payload(rank, 3), prev), dist.P2POp(dist.irecv, a, prev),
               dist.P2POp(dist.isend, payload(rank, 2), nxt), dist.P2POp(dist.irecv, b, nxt)]
        wait_all(dist.batch_isend_irecv(ops))
        assert torch.equal(a, payload(prev, 3)) and torch.equal(b, payload(nxt, 2))
        log("W=2, prev == next: posted leftward first and untagged, the two messages land swapped")

    head("5. variable sequence lengths: the shape travels first")
    seq_lens = torch.randint(1, 9, (3,)).tolist()                  # same on every rank: the shared seed
    micro = [torch.arange(s * H, **f64).reshape(s, H) + 1000 * m for m, s in enumerate(seq_lens)]
    for m, mb in enumerate(micro):                                 # stage r adds 1, so stage r receives mb + r
        assert shape_from_header(shape_header(mb.shape, device)) == mb.shape
        got = mb if rank == 0 else recv_with_shape(rank - 1, torch.float64, device)
        assert got.shape == mb.shape and torch.equal(got, mb + rank), (m, got.shape)
        if rank < W - 1:
            send_with_shape(got + 1, rank + 1)
    hdr = shape_header(micro[0].shape, device).nbytes
    assert hdr == 8 * (MAX_NDIM + 1)
    log(f"3 micro-batches of {seq_lens} tokens x {H}: each stage allocates from a {hdr} B header, then receives"
        + (" (W=1: nothing to send; the header round-trips)" if W == 1 else ""))

    finish("pipeline send/recv fwd+bwd, even/odd order without deadlock, ring and neighbour exchange, "
           "variable shapes")


if __name__ == "__main__":
    main()
