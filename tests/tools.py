"""The test instruments: what tests/check_NN.py scripts use to prove more than a lesson's headline claims.

    lesson(file)          a numbered lesson's module, loaded by path (a module name cannot start with a digit)
    refused(call, error)  call() raises `error` in one line before any collective or P2P call; its message
    memory()              `with memory() as m:` the bytes this rank allocates and still holds (m.live(), m.peak)
    held_bytes(tensors)   the bytes behind tensors that exist already (distinct storages)
    written()             `with written() as w:` the bytes this process wrote to its sockets, on gloo (w.bytes)
    kept_for_backward     fn()'s output and the bytes autograd saved for its backward
    replays(schedules)    whether posted P2P orders complete as blocking sends (or deadlock)
    strided_groups(s)     sub-groups whose group rank is not the global rank
    slowest(seconds)      the slowest rank's seconds, for the benchmarks
"""
import importlib
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from common import pg_timeout, traffic  # noqa: E402

def lesson(filename: str):
    """The lesson's module, as 10 imports it (importlib: a module name cannot start with a digit); its demo does
    not run (only `python FILE` or torchrun runs main()). lesson("05_tp_layers.py") is 10's tp_layers, the same
    module, so a class from one is the class from the other."""
    return importlib.import_module(os.path.splitext(filename)[0])


def slowest(seconds, device):
    """The slowest rank's seconds (every rank of a step waits for it): the max over the ranks, checked against
    every rank's own number (not a sum, not this rank's). For the benchmarks in bench/."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, seconds)
    assert t.item() == max(every) >= seconds > 0, (t.item(), every, seconds)
    return t.item()


def strided_groups(stride: int = 2):
    """[(group, its global ranks)] for {0, s, 2s, ..}, {1, s+1, ..}, ..., s = stride (W < s: one per rank); this
    rank's is [rank % stride]. Every rank makes every group, in order (new_group is collective). From W > s a group
    rank is not the global rank ({0, 2} and {1, 3} at W = 4), so a block that confuses the two fails."""
    W = dist.get_world_size()
    ranks = [list(range(p, W, stride)) for p in range(min(W, stride))]
    return [(dist.new_group(r, timeout=pg_timeout()), r) for r in ranks]


def replays(schedules) -> bool:
    """Whether every rank's posted P2P order completes when each op blocks: a send finishes only once its peer has
    reached the matching receive (gloo's send; NCCL's above its eager size). schedules[r] = rank r's ops in posted
    order, ("send" | "recv", peer[, tag]); a send meets the peer's receive from this rank with the same tag.
    False is a deadlock: the ranks wait on each other."""
    pos, moved = [0] * len(schedules), True
    while moved:
        moved = False
        for a, ops in enumerate(schedules):
            if pos[a] < len(ops) and ops[pos[a]][0] == "send":
                _, b, *tag = ops[pos[a]]
                if pos[b] < len(schedules[b]) and tuple(schedules[b][pos[b]]) == ("recv", a, *tag):
                    pos[a], pos[b], moved = pos[a] + 1, pos[b] + 1, True
    return all(p == len(ops) for p, ops in zip(pos, schedules))


def refused(call, error=ValueError) -> str:
    """call() must raise `error` with a one-line message before any collective or P2P call (a rank that sent
    first would leave the others waiting for the rest); returns the message."""
    with traffic() as t:
        try:
            call()
        except error as e:
            said = str(e)
        else:
            raise AssertionError(f"accepted, where {error.__name__} was expected")
    assert "\n" not in said and not t.calls, (said, t.calls)
    return said


class written:
    """`with written() as w: ...`: w.bytes = the bytes this process (every thread: gloo's too) handed to write and
    send calls inside the block, the kernel's own count (/proc/self/io, wchar): on gloo, what its collectives put
    on the wire, headers included. w.bytes is None where that count is not theirs or cannot be had: a backend other
    than gloo (NCCL moves its bytes over links no syscall sees), no /proc/self/io (not Linux), or on=False (a
    round that is not measured)."""

    def __init__(self, on=True):
        self.on = on and dist.is_initialized() and dist.get_backend() == "gloo"

    @staticmethod
    def _wchar():
        try:
            with open("/proc/self/io") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
        except (OSError, StopIteration, ValueError):
            return None

    def __enter__(self):
        self.bytes, self._start = None, self._wchar() if self.on else None
        return self

    def __exit__(self, *exc):
        end = None if self._start is None else self._wchar()
        self.bytes = None if end is None else end - self._start


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once; a storage resized to 0,
    as ZeRO-3 frees a parameter, counts 0): what parameters, gradients or optimizer state really occupy."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr() if s.nbytes() else id(t)] = s.nbytes()
    return sum(seen.values())


def kept_for_backward(fn, params, inputs=()):
    """fn()'s output and the bytes of the activations autograd saved for its backward (held_bytes:
    distinct storages, parameters left out), `inputs` counted with them: a block that keeps its input itself,
    not a copy, adds nothing by that."""
    saved, skip = [], {q.untyped_storage().data_ptr() for q in params}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, held_bytes([t for t in saved if t.untyped_storage().data_ptr() not in skip] + list(inputs))


def memory(device=None):
    """A context manager that follows every tensor storage this rank allocates inside it, for as long as it lives.

        with memory() as m:
            loss = stage(x).sum()          # activations saved for backward, messages in flight, gradients ...
            kept = m.live()                # bytes allocated inside the block and still held right now
            loss.backward()
        m.peak                             # the most held at once (checked whenever an op allocates or grows one)
        m.reset()                          # the next peak starts from what is held now
        m.comms                            # [(c10d op, bytes held as it started)]: e.g. is a sent buffer freed?

    It sees each op as it is dispatched (also inside autograd's backward and the c10d ops), notes the storage of
    every output, and keeps a weak reference: a storage is counted while something still holds it (saved for
    backward, a send's buffer kept until its wait, a gradient) and stops counting when the last holder lets it go,
    or when it is resized to 0 bytes. So it measures what the code keeps, on any device, exactly in bytes.
    Storages allocated before the block (parameters, inputs) are not counted: `held_bytes()` counts those.
    On CUDA `m.device_peak` also gives the allocator's own peak over the block (torch.cuda.max_memory_allocated,
    rounded to its blocks and counting temporaries); on the CPU it is None, as torch keeps no CPU statistics.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    def tensors_in(x):  # the tensors of an op's arguments or outputs (as torch's pytree, 2x faster)
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from tensors_in(y)
        elif isinstance(x, dict):
            for y in x.values():
                yield from tensors_in(y)

    class Memory(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):
            return False

        def __init__(self):
            super().__init__()
            self.storages = {}  # cdata -> (weak ref, bytes when last seen)
            self.peak, self.device_peak, self.comms = 0, None, []
            self._device = torch.device(device) if device is not None else None

        def live(self) -> int:
            total, revive = 0, torch.UntypedStorage._new_with_weak_ptr  # None once the storage is freed
            for key in list(self.storages):
                s = revive(key)
                if s is None:
                    del self.storages[key]
                else:
                    total += s.nbytes()
            return total

        def reset(self):
            self.peak = self.live()

        def _note(self, out, skip=()):
            grew = False
            for t in tensors_in(out):
                if t.device.type != "meta":
                    s = t.untyped_storage()
                    if s.data_ptr() in skip and s.data_ptr():  # an input's storage: not allocated here
                        continue
                    ref = StorageWeakRef(s)
                    old = self.storages.get(ref.cdata)
                    if old is None or old[1] != s.nbytes() or old[0].expired():
                        self.storages[ref.cdata] = (ref, s.nbytes())
                        grew = True
            return grew

        def track(self, tensors):
            """Count these storages too, from now on (one allocated before the block that will grow in it)."""
            if self._note(list(tensors)):
                self.peak = max(self.peak, self.live())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.comms.append((func.__name__.split(".")[0], self.live()))
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs))
                      if t.device.type != "meta"}  # views, in-place, c10d ops
            if self._note(out, skip=inputs):
                self.peak = max(self.peak, self.live())
            return out

        def __enter__(self):
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
                self._cuda_start = torch.cuda.memory_allocated(self._device)
                torch.cuda.reset_peak_memory_stats(self._device)
            return super().__enter__()

        def __exit__(self, *exc):
            out = super().__exit__(*exc)
            if self._device is not None and self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
                self.device_peak = torch.cuda.max_memory_allocated(self._device) - self._cuda_start
            return out

    return Memory()
