"""What this proves beyond 01's lesson, on the world and on the strided sub-groups {0, 2, ..} and {1, 3, ..} (group
rank != global rank, so a block that confuses the two fails):
- the pipeline's four calls handed column-major (non-contiguous) views: activations, gradients and layer grads
  == one process; every send and recv on the group, V per boundary and direction, to the byte;
- the orders, replayed as blocking sends for W = 2..8: all-sends-first deadlocks (the ring shift and both
  neighbours), even/odd completes, odd W included; a rank left waiting, and two tagged messages received in the
  other order, are deadlocks too; the order p2p_ops really posts (what reached c10d) replays, sends-first would
  not; at W = 2 Megatron's untagged batched order swaps the two messages;
- ring and both-neighbour exchanges from strided views, on sub-groups; variable shapes alternating [s, H] and
  [H, s] (non-contiguous), in float64 (bf16 and int64 on the sub-groups); the header for 0 and MAX_NDIM dims;
- the refusals at their boundary, on every rank: a contiguous view as a receive buffer passes, a strided one is
  refused (recv_prev and recv_next, p2p_ops and batched_p2p_ops); MAX_NDIM dims pass, MAX_NDIM + 1 are refused.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import finish, head, log, setup, traffic  # noqa: E402
from tests.tools import lesson, refused, replays, strided_groups  # noqa: E402

m = lesson("01_p2p.py")
F64, BF16 = torch.float64, torch.bfloat16
R, L = m.TAG_RIGHT, m.TAG_LEFT


def column_major(t):
    """t's values in column-major memory (what .T of a transposed result gives): a view that is not contiguous."""
    return t.T.contiguous().T


def payload(r, which, device, dtype=F64):
    """Rank r's message number `which`: values that say who sent which message (exact in bf16: all below 256)."""
    return (torch.arange(3, device=device) + 20 * (r % 8) + 3 * which).to(dtype)


def on_group(t, members, sends, recvs):
    """The traffic `t` was `sends` sends and `recvs` recvs, every one on the group of `members`."""
    assert t.counts["send"] == sends and t.counts["recv"] == recvs, dict(t.counts)
    assert all(ranks == tuple(members) for _, ranks, _ in t.calls), t.calls


def pipeline(device, group, members, H=8, B=2):
    """One micro-batch forward and backward through the stages `members` (stage i runs layer i on members[i]),
    handed column-major views, against the whole model in one process."""
    n, me = len(members), members.index(dist.get_rank())
    torch.manual_seed(n)
    layers = [torch.nn.Linear(H, H, dtype=F64, device=device) for _ in range(n)]
    x = torch.randn(B, H, dtype=F64, device=device)
    acts = [x.clone().requires_grad_()]
    for layer in layers:
        acts.append(torch.tanh(layer(acts[-1])))
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    ref = torch.autograd.grad(acts[-1].pow(2).sum(), acts[:-1] + params)
    act_grads, param_grads = ref[:n], ref[n:]
    stage = layers[me]
    with traffic() as t:
        got = m.recv_forward((B, H), F64, device, group)
        inp = (x if got is None else got).clone().requires_grad_()
        out = torch.tanh(stage(inp))
        m.send_forward(column_major(out.detach()), group)            # a non-contiguous view: sent contiguous
        grad_out = m.recv_backward(out.shape, out.dtype, device, group)
        out.backward(2 * out.detach() if grad_out is None else grad_out)
        m.send_backward(column_major(inp.grad), group)
    assert (got is None) == (me == 0) and (grad_out is None) == (me == n - 1)
    torch.testing.assert_close(inp.detach(), acts[me].detach())
    if grad_out is not None:
        torch.testing.assert_close(grad_out, act_grads[me + 1])
    torch.testing.assert_close(inp.grad, act_grads[me])
    torch.testing.assert_close(stage.weight.grad, param_grads[2 * me])
    torch.testing.assert_close(stage.bias.grad, param_grads[2 * me + 1])
    hops = (me < n - 1) + (me > 0)
    on_group(t, members, hops, hops)
    assert t.bytes["send"] == t.bytes["recv"] == hops * out.nbytes


def played_orders():
    naive = lambda n: [[("send", (r + 1) % n, R), ("recv", (r - 1) % n, R)] for r in range(n)]
    shift = lambda n: [[op for op in m.even_odd_order(r, n) if op[2] == R] for r in range(n)]
    both = lambda n: [m.even_odd_order(r, n) for r in range(n)]
    both_naive = lambda n: [sorted(m.even_odd_order(r, n), key=lambda op: op[0] == "recv") for r in range(n)]
    for n in range(2, 9):
        assert not replays(naive(n)) and not replays(both_naive(n)), n
        assert replays(shift(n)) and replays(both(n)), n
    # ranks 0 and 1 finish, rank 2 waits for a message nobody sends: still a hang
    assert not replays([[("send", 1, R)], [("recv", 0, R)], [("recv", 0, L)]])
    # two tagged messages to one peer, received in the other order: the first blocking send waits for a receive
    # posted after the one its peer is blocked in
    assert not replays([[("send", 1, R), ("send", 1, L)], [("recv", 0, L), ("recv", 0, R)]])


def posted_order(rank, W, device):
    """The order p2p_ops really posts, from every rank, replayed as blocking sends: it must complete."""
    ops = m._neighbour_ops(*[torch.empty(3, dtype=F64, device=device)] * 4, group=None)
    with traffic() as t:
        [w.wait() for w in m.p2p_ops(**{k: torch.empty(3, dtype=F64, device=device) for k in
                                        ("send_prev", "recv_prev", "send_next", "recv_next")})]
    posted = [("send" if op is dist.isend else "recv", peer, tag) for op, _, peer, tag in ops]
    assert [kind for kind, _, _ in posted] == [name for name, _, _ in t.calls]   # what really went out, in order
    schedules = [None] * W
    dist.all_gather_object(schedules, posted)
    assert replays(schedules)
    assert W == 1 or not replays([sorted(s, key=lambda op: op[0] == "recv") for s in schedules])
    if W == 2:  # Megatron's batched order, untagged: rank 0's leftward message meets rank 1's first recv
        a, b = torch.empty(3, dtype=F64, device=device), torch.empty(3, dtype=F64, device=device)
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, payload(rank, 3, device), peer), dist.P2POp(dist.irecv, a, peer),
               dist.P2POp(dist.isend, payload(rank, 2, device), peer), dist.P2POp(dist.irecv, b, peer)]
        [w.wait() for w in dist.batch_isend_irecv(ops)]
        assert torch.equal(a, payload(peer, 3, device)) and torch.equal(b, payload(peer, 2, device))


def exchanges(rank, device, rings):
    """Ring exchange (p2p_ops) and both neighbours (both blocks) from strided views, on each ring, in F64 and bf16."""
    for (grp, ring), dtype in ((r, d) for r in rings for d in (F64, BF16)):
        i, n = ring.index(rank), len(ring)
        pair = torch.stack([payload(rank, 1, device, dtype), payload(rank, 4, device, dtype)], dim=1)  # [3, 2]
        got = torch.empty(3, dtype=dtype, device=device)
        with traffic() as t:
            [w.wait() for w in m.p2p_ops(send_next=pair[:, 0], recv_prev=got, group=grp)]  # a column: strided
        assert torch.equal(got, payload(ring[(i - 1) % n], 1, device, dtype))
        on_group(t, ring, n > 1, n > 1)
        assert t.bytes["send"] == t.bytes["recv"] == (n > 1) * got.nbytes
        for exchange in (m.batched_p2p_ops, m.p2p_ops):
            from_prev, from_next = (torch.empty(3, dtype=dtype, device=device) for _ in range(2))
            with traffic() as t:
                [w.wait() for w in exchange(send_next=pair[:, 0], send_prev=pair[:, 1],
                                            recv_prev=from_prev, recv_next=from_next, group=grp)]
            assert torch.equal(from_prev, payload(ring[(i - 1) % n], 1, device, dtype)), exchange
            assert torch.equal(from_next, payload(ring[(i + 1) % n], 4, device, dtype)), exchange
            on_group(t, ring, 2 * (n > 1), 2 * (n > 1))
            assert t.bytes["send"] == t.bytes["recv"] == 2 * (n > 1) * from_prev.nbytes


def variable_shapes(rank, device, rings, H=8):
    """Stage i receives (mb + i), transposed i times, and sends (that + 1).T: [s, H] and [H, s] alternate."""
    torch.manual_seed(5)
    seq_lens = torch.randint(1, 9, (3,)).tolist()
    hdr = m.shape_header((1, 2), device).nbytes
    assert hdr == 8 * (m.MAX_NDIM + 1)
    runs = [(ring, F64, seq_lens) for ring in rings] + [(rings[1], d, seq_lens[:1]) for d in (BF16, torch.int64)]
    for (grp, chain), dtype, lens in runs:                        # bf16 and int64: one micro-batch, on the sub-group
        i, n = chain.index(rank), len(chain)
        batch = torch.arange(max(seq_lens) * 3 * H, device=device).remainder(200).reshape(max(seq_lens), 3, H)
        batch = batch.to(dtype)                                    # [S, M, H]; values < 256: exact in bf16
        for k, s in enumerate(lens):
            mb = batch[:s, k]                                      # [s, H], sequence-first: not contiguous
            assert m.shape_from_header(m.shape_header(mb.shape, device)) == mb.shape
            with traffic() as t:
                got = mb if i == 0 else m.recv_with_shape(chain[i - 1], dtype, device, grp)
                if i < n - 1:
                    m.send_with_shape((got + 1).T, chain[i + 1], grp)
            assert got.dtype == dtype and torch.equal(got, (mb + i).T if i % 2 else mb + i), (k, got.shape)
            on_group(t, chain, 2 * (i < n - 1), 2 * (i > 0))
            assert t.bytes["send"] == (i < n - 1) * (hdr + mb.nbytes)
            assert t.bytes["recv"] == (i > 0) * (hdr + mb.nbytes)
    for shape in ((), (5,), tuple(range(2, 2 + m.MAX_NDIM))):    # 0 dims, 1, and the most a header holds
        assert m.shape_from_header(m.shape_header(torch.Size(shape), device)) == torch.Size(shape)


def refusals(rank, W, device):
    """Every rank calls each block at its boundary: what passes runs for real, what is refused sends nothing."""
    full = torch.Size((2,) * m.MAX_NDIM)                          # the most dims a header holds: accepted
    assert m.shape_from_header(m.shape_header(full, device)) == full
    said = refused(lambda: m.shape_header((2,) * (m.MAX_NDIM + 1), device))      # one dim more: refused
    assert f"MAX_NDIM={m.MAX_NDIM}" in said, said
    for exchange in (m.p2p_ops, m.batched_p2p_ops):
        for name in ("recv_prev", "recv_next"):
            ok = torch.empty(3, 1, dtype=F64, device=device)[:, 0]  # a view, but contiguous: accepted
            send = {"recv_prev": "send_next", "recv_next": "send_prev"}[name]
            [w.wait() for w in exchange(**{name: ok, send: payload(rank, 5, device)})]
            peer = (rank - 1) % W if name == "recv_prev" else (rank + 1) % W
            assert torch.equal(ok, payload(peer, 5, device)), (exchange, name)
            strided = torch.empty(3, 2, dtype=F64, device=device)[:, 0]  # every other element: refused
            said = refused(lambda: exchange(**{name: strided, send: payload(rank, 5, device)}))
            assert name in said and "not contiguous" in said, said


def main():
    rank, W, device = setup()
    sub, members = strided_groups(2)[rank % 2]
    rings = ((None, list(range(W))), (sub, members))

    head("pipeline: column-major views, on the world and on strided sub-groups")
    for grp, ring in rings:
        pipeline(device, grp, ring)
    log("send_forward/recv_forward/send_backward/recv_backward == one process on both; V per hop on the group")

    head("orders replayed as blocking sends, and the order p2p_ops posts")
    played_orders()
    posted_order(rank, W, device)
    log("all-sends-first deadlocks at W = 2..8, even/odd completes; a waiting rank and crossed tags deadlock; "
        "p2p_ops' posted order replays" + ("; W=2: untagged batched order swaps" if W == 2 else ""))

    head("exchanges from strided views, on sub-groups, in float64 and bf16")
    exchanges(rank, device, rings)
    log("ring exchange and both neighbours (both blocks) == prev's / next's tensors; counts and bytes on the group")

    head("variable shapes: non-contiguous, alternating layouts, float64 / bf16 / int64, on sub-groups")
    variable_shapes(rank, device, rings)
    log("each stage receives the shape it was sent, in its dtype; header + V bytes; 0..MAX_NDIM dims round-trip")

    head("refusals at their boundary, on every rank")
    refusals(rank, W, device)
    log(f"a contiguous view is a receive buffer, a strided one is refused; {m.MAX_NDIM} dims fit, "
        f"{m.MAX_NDIM + 1} are refused; nothing sent")
    finish("01's blocks on sub-groups, from strided views, in three dtypes; orders replayed; refusals at their "
           "boundary")


if __name__ == "__main__":
    main()
