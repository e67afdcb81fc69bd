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
  always ends (section 2 plays both orders; section 4 replays the order p2p_ops really posted). On NCCL an
  isend/irecv also waits on its GPU stream for its partner, so Megatron posts even its non-blocking ops in
  this order (p2p_ops below); batch_isend_irecv hands the whole set to NCCL at once.
- Two messages between the same two ranks match in the order they were posted (NCCL ignores tags) or by tag
  (gloo). At W = 2 "prev" and "next" are the same peer: post rightward before leftward on both sides, and tag them.
- A receiver allocates before it receives, so it must know the shape. With variable sequence lengths, send the
  shape first as a fixed-size int64 header, then the tensor.

Bytes each rank sends for a V-byte message: pipeline, V per boundary in each direction (activation right,
gradient left; the first stage sends no gradient, the last no activation); ring exchange, V (and receives V);
both neighbours, 2V; with a shape header, 8 * (MAX_NDIM + 1) bytes more per message.

Run:  torchrun --nproc-per-node=4 01_p2p.py
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
    from common import finish, head, log, refused, replays, setup, strided_groups, traffic
except ImportError:  # the blocks above, imported alone where common.py is absent
    pass

F64 = torch.float64


# checking helpers (a reader may skip to the sections below): views, payloads, traffic asserts
def column_major(t):
    """t's values in column-major memory (what .T of a transposed result gives): a view that is not contiguous."""
    return t.T.contiguous().T


def payload(r, which, device):
    """Rank r's message number `which`: values that say who sent which message."""
    return torch.arange(3, dtype=F64, device=device) + 100 * r + 10 * which


def on_group(t, members, sends, recvs):
    """The traffic `t` was `sends` sends and `recvs` recvs, every one on the group of `members`."""
    assert t.counts["send"] == sends and t.counts["recv"] == recvs, dict(t.counts)
    assert all(ranks == tuple(members) for _, ranks, _ in t.calls), t.calls


def pipeline(device, group, members, H=8, B=2):
    """One micro-batch forward and backward through the stages `members` (stage i runs layer i on members[i]),
    checked against the whole model in one process: activations, gradients, layer grads, bytes."""
    n, me = len(members), members.index(dist.get_rank())
    torch.manual_seed(n)                                           # the same layers and input on every stage
    layers = [torch.nn.Linear(H, H, dtype=F64, device=device) for _ in range(n)]
    x = torch.randn(B, H, dtype=F64, device=device)                # [B, H], the micro-batch
    acts = [x.clone().requires_grad_()]                            # reference: the whole model in one process
    for layer in layers:
        acts.append(torch.tanh(layer(acts[-1])))
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    ref = torch.autograd.grad(acts[-1].pow(2).sum(), acts[:-1] + params)
    act_grads, param_grads = ref[:n], ref[n:]

    stage = layers[me]                                             # this rank runs layer `me` only
    with traffic() as t:
        got = recv_forward((B, H), F64, device, group)             # None on the first stage
        inp = (x if got is None else got).clone().requires_grad_()
        out = torch.tanh(stage(inp))                               # [B, H]
        send_forward(column_major(out.detach()), group)            # a non-contiguous view: sent contiguous
        grad_out = recv_backward(out.shape, out.dtype, device, group)  # None on the last stage
        out.backward(2 * out.detach() if grad_out is None else grad_out)  # the loss lives on the last stage
        send_backward(column_major(inp.grad), group)
    assert (got is None) == (me == 0) and (grad_out is None) == (me == n - 1)
    torch.testing.assert_close(inp.detach(), acts[me].detach())   # stage i received activation i
    if grad_out is not None:
        torch.testing.assert_close(grad_out, act_grads[me + 1])
    torch.testing.assert_close(inp.grad, act_grads[me])
    torch.testing.assert_close(stage.weight.grad, param_grads[2 * me])
    torch.testing.assert_close(stage.bias.grad, param_grads[2 * me + 1])
    hops = (me < n - 1) + (me > 0)                                 # V right unless last, V left unless first
    on_group(t, members, hops, hops)
    assert t.bytes["send"] == t.bytes["recv"] == hops * out.nbytes
    return out.nbytes


def pipelines(device, W, group, members):
    head(f"1. a {W}-stage pipeline: activations right, gradients left (blocking send/recv, tagged)")
    V = pipeline(device, None, list(range(W)))
    if W == 1:
        log("W=1: one stage, both recvs return None; its grads equal the reference's")
    else:
        log(f"each boundary: {V} B activation right (tag {TAG_RIGHT}), {V} B gradient left (tag {TAG_LEFT}), "
            f"column-major views handed in")
        log("every stage's received activation and gradient, and its layer's grads, == the one-process model")
    pipeline(device, group, members)
    log(f"again on the groups {{0, 2, ..}} and {{1, 3, ..}}: stage = group rank, not global rank; == reference")


def deadlock(rank, W, device):
    head("2. deadlock: every rank sends first vs even ranks send first")
    naive = lambda n: [[("send", (r + 1) % n, TAG_RIGHT), ("recv", (r - 1) % n, TAG_RIGHT)] for r in range(n)]
    shift = lambda n: [[op for op in even_odd_order(r, n) if op[2] == TAG_RIGHT] for r in range(n)]
    both = lambda n: [even_odd_order(r, n) for r in range(n)]
    both_naive = lambda n: [sorted(even_odd_order(r, n), key=lambda op: op[0] == "recv") for r in range(n)]
    for n in range(2, 9):
        assert not replays(naive(n)) and not replays(both_naive(n)), n
        assert replays(shift(n)) and replays(both(n)), n
    # ranks 0 and 1 finish, rank 2 waits for a message nobody sends: still a hang
    assert not replays([[("send", 1, TAG_RIGHT)], [("recv", 0, TAG_RIGHT)], [("recv", 0, TAG_LEFT)]])
    # two tagged messages to one peer, received in the other order: the first blocking send waits for a receive
    # posted after the one its peer is blocked in
    assert not replays([[("send", 1, TAG_RIGHT), ("send", 1, TAG_LEFT)],
                        [("recv", 0, TAG_LEFT), ("recv", 0, TAG_RIGHT)]])
    log("ring shift, sends first on every rank: rank r waits for r+1's recv, which waits behind r+1's send...")
    log("   ... around the ring back to r: a cycle, deadlock at every W in 2..8 (played, not run)")
    log("even ranks send first, odd ranks receive first: completes at every W in 2..8, odd W included")
    if W == 1:
        log("W=1: no peer, nothing to run for real (gloo cannot send to itself)")
        return
    prev, nxt = (rank - 1) % W, (rank + 1) % W
    got = torch.empty(3, dtype=F64, device=device)
    if rank % 2 == 0:
        dist.send(payload(rank, 0, device), nxt)
        dist.recv(got, prev)
    else:
        dist.recv(got, prev)
        dist.send(payload(rank, 0, device), nxt)
    assert torch.equal(got, payload(prev, 0, device))
    log(f"run for real with blocking send/recv over {W} ranks: every rank holds its prev's tensor")


def ring_exchange(rank, W, device, group, members):
    head("3. ring exchange with isend/irecv: send to next, receive from prev, at once")
    for grp, ring in ((None, list(range(W))), (group, members)):
        i, n = ring.index(rank), len(ring)
        pair = torch.stack([payload(rank, 1, device), payload(rank, 4, device)], dim=1)  # [3, 2]
        got = torch.empty(3, dtype=F64, device=device)
        with traffic() as t:
            [w.wait() for w in p2p_ops(send_next=pair[:, 0], recv_prev=got, group=grp)]  # a column: strided
        assert torch.equal(got, payload(ring[(i - 1) % n], 1, device))   # rank r holds x_{r-1}
        on_group(t, ring, n > 1, n > 1)
        assert t.bytes["send"] == t.bytes["recv"] == (n > 1) * got.nbytes
    sent = f"{got.nbytes} B sent and received per rank" if W > 1 else "W=1: a ring of one is its own neighbour, copied"
    log(f"rank r holds rank (r-1)'s tensor ({sent}); the same in the rings {{0, 2, ..}}, {{1, 3, ..}}")


def both_neighbours(rank, W, device, group, members):
    head("4. both neighbours at once: batch_isend_irecv, and even/odd isend/irecv")
    for name, exchange in (("batch_isend_irecv", batched_p2p_ops), ("even/odd isend/irecv", p2p_ops)):
        for grp, ring in ((None, list(range(W))), (group, members)):
            i, n = ring.index(rank), len(ring)
            pair = torch.stack([payload(rank, 2, device), payload(rank, 3, device)], dim=1)  # [3, 2]: R, L
            from_prev, from_next = torch.empty(3, dtype=F64, device=device), torch.empty(3, dtype=F64, device=device)
            with traffic() as t:
                [w.wait() for w in exchange(send_next=pair[:, 0], send_prev=pair[:, 1],
                                            recv_prev=from_prev, recv_next=from_next, group=grp)]
            assert torch.equal(from_prev, payload(ring[(i - 1) % n], 2, device))  # prev's rightward tensor
            assert torch.equal(from_next, payload(ring[(i + 1) % n], 3, device))  # next's leftward tensor
            on_group(t, ring, 2 * (n > 1), 2 * (n > 1))
            assert t.bytes["send"] == t.bytes["recv"] == 2 * (n > 1) * from_prev.nbytes
        log(f"{name}: rank r holds prev's rightward and next's leftward tensor ({2 * from_prev.nbytes} B sent per "
            f"rank), also in the rings {{0, 2, ..}} and {{1, 3, ..}}")


def posted_order(rank, W, device):
    """The order p2p_ops really posts, from every rank, replayed as blocking sends: it must complete."""
    ops = _neighbour_ops(*[torch.empty(3, dtype=F64, device=device)] * 4, group=None)
    with traffic() as t:
        [w.wait() for w in p2p_ops(**{k: torch.empty(3, dtype=F64, device=device) for k in
                                      ("send_prev", "recv_prev", "send_next", "recv_next")})]
    posted = [("send" if op is dist.isend else "recv", peer, tag) for op, _, peer, tag in ops]
    assert [kind for kind, _, _ in posted] == [name for name, _, _ in t.calls]   # what really went out, in order
    schedules = [None] * W
    dist.all_gather_object(schedules, posted)
    assert replays(schedules) and (W == 1 or not replays([sorted(s, key=lambda op: op[0] == "recv")
                                                           for s in schedules]))
    log("the order every rank posted, replayed as blocking sends, completes; all sends first would deadlock")
    refused(lambda: p2p_ops(recv_prev=torch.empty(3, 2, dtype=F64, device=device)[:, 0]))  # a strided buffer
    if W == 2:  # Megatron's batched order, untagged: rank 0's leftward message meets rank 1's first recv
        a, b = torch.empty(3, dtype=F64, device=device), torch.empty(3, dtype=F64, device=device)
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, payload(rank, 3, device), peer), dist.P2POp(dist.irecv, a, peer),
               dist.P2POp(dist.isend, payload(rank, 2, device), peer), dist.P2POp(dist.irecv, b, peer)]
        [w.wait() for w in dist.batch_isend_irecv(ops)]
        assert torch.equal(a, payload(peer, 3, device)) and torch.equal(b, payload(peer, 2, device))
        log("W=2, prev == next: posted leftward first and untagged, the two messages land swapped")


def variable_shapes(rank, W, device, group, members, H=8):
    head("5. variable sequence lengths: the shape travels first")
    torch.manual_seed(5)
    seq_lens = torch.randint(1, 9, (3,)).tolist()                  # same on every rank: the shared seed
    batch = torch.arange(max(seq_lens) * 3 * H, dtype=F64, device=device).reshape(max(seq_lens), 3, H)  # [S, M, H]
    hdr = shape_header(batch.shape, device).nbytes
    for grp, chain in ((None, list(range(W))), (group, members)):
        i, n = chain.index(rank), len(chain)
        for m, s in enumerate(seq_lens):
            mb = batch[:s, m]                                      # [s, H], sequence-first: not contiguous
            assert shape_from_header(shape_header(mb.shape, device)) == mb.shape
            with traffic() as t:   # stage i receives (mb + i), transposed i times; it sends (that + 1).T
                got = mb if i == 0 else recv_with_shape(chain[i - 1], F64, device, grp)
                if i < n - 1:
                    send_with_shape((got + 1).T, chain[i + 1], grp)
            assert torch.equal(got, (mb + i).T if i % 2 else mb + i), (m, got.shape)
            on_group(t, chain, 2 * (i < n - 1), 2 * (i > 0))
            assert t.bytes["send"] == (i < n - 1) * (hdr + mb.nbytes) and t.bytes["recv"] == (i > 0) * (hdr + mb.nbytes)
    assert hdr == 8 * (MAX_NDIM + 1)
    full = torch.Size(range(2, 2 + MAX_NDIM))                      # the most dims a header holds: they fit
    assert shape_from_header(shape_header(full, device)) == full
    refused(lambda: shape_header((1,) * (MAX_NDIM + 1), device))   # one dim more than a header holds
    log(f"3 micro-batches of {seq_lens} tokens x {H}, shapes alternating [s, H] and [H, s]: each stage allocates "
        f"from a {hdr} B header, then receives; also in {{0, 2, ..}}, {{1, 3, ..}}"
        + (" (W=1: nothing to send; the header round-trips)" if W == 1 else ""))


def main():
    rank, W, device = setup()
    group, members = strided_groups(2)[rank % 2]   # {0, 2, ..} and {1, 3, ..}: group rank != global rank
    pipelines(device, W, group, members)
    deadlock(rank, W, device)
    ring_exchange(rank, W, device, group, members)
    both_neighbours(rank, W, device, group, members)
    posted_order(rank, W, device)
    variable_shapes(rank, W, device, group, members)
    finish("pipeline send/recv fwd+bwd, even/odd order without deadlock (posted order replayed), ring and "
           "neighbour exchange, variable shapes; on the world and on strided sub-groups")


if __name__ == "__main__":
    main()
