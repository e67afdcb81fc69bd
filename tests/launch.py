"""The suite's launchers, used by test_all.py and by the lesson suites tests/suite_NN.py.

- launch(script, world): a fast launcher with torchrun's environment contract (RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A "zygote" process imports torch once (one for a whole pytest run,
  its xdist workers included: conftest.py starts it); each rank is forked from it, runs the script as __main__
  and then leaves like any Python program (interpreter shutdown, atexit, thread joins), so a crash at exit shows
  here as it would under torchrun. A run costs a fraction of a second instead of seconds of imports. Its ranks
  also check NCCL's contract on the CPU: a collective or P2P call handed a non-contiguous tensor, or one not on the
  lesson's device, fails the run naming the op and the line (gloo would accept it).
- run_cmd(cmds): real processes (torchrun itself), side by side, each in its own session.
- check_passed(run): every rank exited 0, rank 0's last line is "[R0] all checks passed: ...", no rank printed
  a warning or aborted.
- probe(tmp_path, code): a throw-away script that can import common and tests.
"""
import atexit
import functools
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # the repository
WORLD_SIZES = (1, 2, 4, 8)
RUN_DEADLINE = 120  # seconds for one launch, all ranks together
GRACE = 20          # seconds the other ranks get after the first one exits, before they are killed
PASSED = re.compile(r"^\[R0\] all checks passed: .+")
REFUSED = re.compile(r"^\[R(\d+)\] \S+ refuses to run: .+", re.M)
WARNING = re.compile(r"warning|\bwarn\b", re.I)
ABORTED = re.compile(r"terminate called|core dumped|Aborted|Segmentation fault")
GLOO = {"BACKEND": "gloo"}  # pinned: on a machine with GPUs, setup() would pick NCCL and refuse 8 ranks

os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun sets it; inherited by the zygote and its ranks


def free_port() -> int:
    """A free port for rank 0's store, drawn below the kernel's ephemeral range: a port that bind(0) hands out
    (and closes) can go to any connection made before rank 0 binds it, and launches side by side make many."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low - 10000), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free port below the ephemeral range")


# ---- NCCL's contract, checked on the CPU ------------------------------------------------------------------
CHECKED_OPS = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_gather", "reduce_scatter", "all_to_all_single", "all_to_all",
               "broadcast", "reduce", "scatter", "gather", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def install_contract(device_type: str, groups_time_out: bool = True):
    """Wrap torch.distributed's collectives and P2P calls: each tensor handed to one must be contiguous and on
    `device_type`, as NCCL demands (gloo accepts a non-contiguous tensor and answers right). groups_time_out:
    every dist.new_group must be given timeout=PG_TIMEOUT (common.pg_timeout()), so that a rank stuck in any
    group a block or a demo makes fails within PG_TIMEOUT, as on the world group."""
    import traceback
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dist.P2POp):
            yield x.tensor
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from tensors(y)

    def where():
        frames = [f for f in traceback.extract_stack()[:-2]  # the caller's: not torch's, runpy's or ours
                  if f.filename != __file__ and "/torch/" not in f.filename and not f.filename.startswith("<")]
        return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"

    for name in CHECKED_OPS:
        original = getattr(c10d, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def checked(*args, _original=original, _name=name, **kwargs):
            for t in tensors(list(args) + list(kwargs.values())):
                if not t.is_contiguous():
                    raise RuntimeError(f"NCCL's contract: dist.{_name} was handed a non-contiguous tensor "
                                       f"(shape {tuple(t.shape)}, stride {t.stride()}) at {where()}")
                if t.device.type != device_type:
                    raise RuntimeError(f"NCCL's contract: dist.{_name} was handed a tensor on {t.device}, not "
                                       f"on the lesson's device ({device_type}) at {where()}")
            return _original(*args, **kwargs)

        setattr(c10d, name, checked)
        if getattr(dist, name, None) is original:
            setattr(dist, name, checked)

    if groups_time_out:
        import datetime
        try:  # what common.setup() gives the world group (a bad PG_TIMEOUT it refuses itself)
            want = datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "").strip() or 30))
        except (ValueError, OverflowError):
            want = None
        new_group = c10d.new_group

        @functools.wraps(new_group)
        def timed_new_group(*args, **kwargs):
            if kwargs.get("timeout") != want:
                raise RuntimeError(f"dist.new_group at {where()} was given timeout={kwargs.get('timeout')}, not "
                                   f"PG_TIMEOUT's {want}: a rank stuck in that group would wait torch's default")
            return new_group(*args, **kwargs)

        c10d.new_group = dist.new_group = timed_new_group


# ---- the fast launcher: ranks forked from a zygote that imported torch once --------------------------------
def _rank(req: dict, rank: int):
    """In a forked child: become rank `rank` of the request, run the script, and exit like a Python program."""
    import runpy
    import traceback
    os.environ.update(req["env"][rank])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, f"{rank}.out"), (2, f"{rank}.err")):
        f = os.open(os.path.join(req["dir"], name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(HERE)
    sys.path.insert(0, str(HERE))
    sys.argv = [req["script"]]
    if req["without_common"]:
        sys.modules["common"] = None  # `import common` raises ImportError, as where only the blocks were pasted
    if req["contract"]:
        install_contract("cpu", groups_time_out=not req["without_common"])
    code = 0
    try:
        runpy.run_path(req["script"], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if req["real_exit"]:
        raise SystemExit(code)  # leaves through the zygote's main: a real interpreter shutdown follows
    if code is None or not isinstance(code, int):  # as SystemExit means them: None is 0, a message prints and is 1
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips interpreter shutdown (0.4 s a rank)


def _serve(req: dict, conn) -> dict:
    """In a process forked from the zygote for one launch: fork its ranks, wait for them, answer their exit codes."""
    t0 = time.monotonic()
    pids = []
    for rank in range(len(req["env"])):
        pid = os.fork()
        if pid == 0:
            conn.close()  # the rank keeps no copy of the answer's socket
            _rank(req, rank)  # never returns
        pids.append(pid)
    codes, first_exit, timed_out = [None] * len(pids), None, False
    while None in codes:
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)  # -6: aborted by SIGABRT
        now = time.monotonic()
        if first_exit is None and any(c is not None for c in codes):
            first_exit = now  # ranks leave together (after a barrier, or all refusing): a straggler is stuck
        if None in codes and (now - t0 > req["deadline"] or (first_exit and now - first_exit > req["grace"])):
            timed_out = now - t0 > req["deadline"]
            for i, pid in enumerate(pids):
                if codes[i] is None:
                    os.kill(pid, signal.SIGKILL)
                    codes[i] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.005)
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]  # this and ranks
    return {"codes": codes, "timed_out": timed_out, "seconds": time.monotonic() - t0,
            "cpu": sum(u.ru_utime + u.ru_stime for u in used)}


def _zygote(address: str):
    """`python tests/launch.py --zygote ADDRESS`: import torch once, then serve launches on the Unix socket ADDRESS,
    several at a time (one forked process each: xdist's workers share this zygote); leave when stdin closes."""
    import select
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen(64)  # bound before the imports: a launch asked for meanwhile waits in the backlog
    import torch  # noqa: F401  (imported once, here; the forked ranks inherit it)
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401
    import torch.testing  # noqa: F401
    import sympy  # noqa: F401  (autograd.grad with grad_outputs imports it on torch 2.13)
    import torch._dynamo  # noqa: F401  (the first torch.optim optimizer imports it)
    import gc
    # the ranks import the lessons, common and tests/ compiled once, here (where PYTHONDONTWRITEBYTECODE is set,
    # every rank of every launch would compile each of them again: 0.05-0.15 s a rank)
    sys.pycache_prefix, sys.dont_write_bytecode = os.path.join(os.path.dirname(address), "pyc"), False
    gc.freeze()  # what the ranks inherit is never collected: their exits take 0.4 s instead of 1.5 s
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [], 1.0)
        while True:  # reap the launches that answered
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            break  # whoever started the zygote is done
        if server in ready:
            conn, _ = server.accept()
            if os.fork() == 0:
                server.close()
                with conn.makefile("rw") as f:
                    req = json.loads(f.readline())
                    answer = _serve(req, conn)  # a rank that leaves by interpreter shutdown raises out of here
                    f.write(json.dumps(answer) + "\n")
                os._exit(0)
            conn.close()
    shutil.rmtree(os.path.dirname(address), ignore_errors=True)


ZYGOTE_VARIABLE = "LESSON_ZYGOTE"  # the address of the zygote a test run shares (its workers and their children)
_ZYGOTE = None


def start_zygote() -> str:
    """Start a zygote for this process and every process it starts (ZYGOTE_VARIABLE) and return its address;
    conftest.py starts one for a whole pytest run, before xdist starts its workers."""
    global _ZYGOTE
    address = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "socket")
    _ZYGOTE = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--zygote", address], cwd=HERE,
                               stdin=subprocess.PIPE)
    atexit.register(stop_zygote)
    os.environ[ZYGOTE_VARIABLE] = address
    return address


def stop_zygote():
    if _ZYGOTE is not None and _ZYGOTE.poll() is None:
        _ZYGOTE.stdin.close()  # the zygote leaves (its launches in flight answer first)
        try:
            _ZYGOTE.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _ZYGOTE.kill()


def _ask_zygote(req: dict) -> dict:
    address = os.environ.get(ZYGOTE_VARIABLE) or start_zygote()
    with socket.socket(socket.AF_UNIX) as s:
        for _ in range(600):
            try:
                s.connect(address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if _ZYGOTE is not None and _ZYGOTE.poll() is not None:
                    raise RuntimeError(f"the zygote exited with {_ZYGOTE.returncode}")
                time.sleep(0.05)  # it is binding its socket
        else:
            raise RuntimeError(f"no zygote answers at {address}")
        with s.makefile("rw") as f:
            f.write(json.dumps(req) + "\n")
            f.flush()
            line = f.readline()
    if not line:
        raise RuntimeError(f"the zygote at {address} closed the launch of {req['script']} unanswered")
    return json.loads(line)


class Run:
    """What one launch left: exit codes, each rank's stdout and stderr, whether it hit the deadline, its seconds
    and the CPU seconds its ranks used."""

    def __init__(self, codes, outs, errs, timed_out, seconds, cpu=0.0):
        self.codes, self.outs, self.errs, self.timed_out, self.seconds = codes, outs, errs, timed_out, seconds
        self.cpu = cpu

    def report(self) -> str:
        lines = [f"exit codes {self.codes}, {self.seconds:.1f} s (CPU {self.cpu:.1f} s)"
                 + (", TIMED OUT" if self.timed_out else "")]
        for r, (o, e) in enumerate(zip(self.outs, self.errs)):
            lines.append(f"---- rank {r} stdout ----\n{o}---- rank {r} stderr ----\n{e}")
        return "\n".join(lines)


def launch(script: str, world: int, extra_env=None, deadline: float = RUN_DEADLINE, contract: bool = True,
           without_common: bool = False, real_exit: bool = True, grace: float = GRACE) -> Run:
    """Start `world` ranks of `script` with torchrun's environment contract and wait for all of them.
    real_exit=False lets each rank leave through os._exit once its script is done (no interpreter shutdown):
    faster, and blind to a crash at exit."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="lesson-"))
    env = [{"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **GLOO, **(extra_env or {})}
           for r in range(world)]
    req = {"script": str(script), "env": env, "dir": str(tmp), "deadline": deadline, "contract": contract,
           "without_common": without_common, "real_exit": real_exit,
           "grace": grace}
    answer = _ask_zygote(req)
    read = lambda p: p.read_text(errors="replace") if p.exists() else ""
    run = Run(answer["codes"], [read(tmp / f"{r}.out") for r in range(world)],
              [read(tmp / f"{r}.err") for r in range(world)], answer["timed_out"], answer["seconds"], answer["cpu"])
    shutil.rmtree(tmp, ignore_errors=True)
    return run


def check_passed(run_: Run):
    assert not run_.timed_out and all(c == 0 for c in run_.codes), run_.report()
    last = [ln for ln in run_.outs[0].splitlines() if ln.strip()][-1:] or [""]
    assert PASSED.match(last[0]), "rank 0's last line is not the summary\n" + run_.report()
    warned = [ln for text in run_.outs + run_.errs for ln in text.splitlines() if WARNING.search(ln)]
    assert not warned, "warnings in the output:\n" + "\n".join(warned) + "\n" + run_.report()
    aborted = [ln for text in run_.outs + run_.errs for ln in text.splitlines() if ABORTED.search(ln)]
    assert not aborted, "a rank aborted:\n" + "\n".join(aborted) + "\n" + run_.report()


def probe(tmp_path, code: str) -> str:
    """A throw-away script (for error paths no lesson should contain) that can import common."""
    path = tmp_path / "probe.py"
    path.write_text(f"import sys; sys.path.insert(0, {str(HERE)!r})\n" + textwrap.dedent(code))
    return str(path)



PASTE_HEADER = ("import torch\nimport torch.distributed as dist\nimport torch.nn as nn\n"
                "import torch.nn.functional as F\n")


def building_blocks(path: Path) -> str:
    """The text a reader pastes: from the first `# ---- building blocks` line to the `# ---- demo` line."""
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, l in enumerate(lines) if l.startswith("# ---- building blocks"))
    end = next(i for i, l in enumerate(lines) if l.startswith("# ---- demo"))
    assert start < end, path
    return "".join(lines[start:end])



# ---- the real torchrun ---------------------------------------------------------------------------------------
def torchrun():
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def run_cmd(cmds, timeout=RUN_DEADLINE, env=None):
    """Run commands side by side in their own sessions; on a deadline kill each whole process group."""
    env = {**os.environ, **GLOO, **(env or {})}
    procs = [subprocess.Popen(c, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env=env) for c in cmds]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
            out, _ = p.communicate()
            out += "\nTIMED OUT"
        results.append((p.returncode, out))
    return results


def check_torchrun(code, out):
    check_passed(Run([code], [out], [""], "TIMED OUT" in out, 0.0))


if __name__ == "__main__" and sys.argv[1:2] == ["--zygote"]:
    _zygote(sys.argv[2])
