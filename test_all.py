"""Runs every numbered lesson the ways people run it, and fails loudly (every rank's output) when one breaks.

    pytest test_all.py                 everything (about a minute on 2 cores)
    pytest test_all.py -m "not slow"   the edit loop: everything but the real torchrun launches
    pytest test_all.py -k 05_          one lesson
    pytest test_all.py -m gpu          every lesson under torchrun with NCCL, one process per GPU (skipped without)
    pytest test_all.py -m stress       every lesson at every world size, many times: exits that abort now and then

Two launchers:
- torchrun itself (`slow`): `torchrun --standalone --nproc-per-node=N FILE`, `python FILE` (which relaunches
  itself under torchrun), and two torchrun agents on this machine forming a 2-node job through c10d rendezvous.
- a fast launcher with torchrun's environment contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT). A "zygote" process imports torch once; each rank is forked from it, runs the
  lesson as __main__ and then leaves like any Python program (interpreter shutdown, atexit, thread joins), so a
  crash at exit shows here as it would under torchrun. A run costs a fraction of a second instead of seconds of
  imports. Its ranks also check NCCL's contract on the CPU: a collective or P2P call handed a non-contiguous
  tensor, or one not on the lesson's device, fails the run naming the op and the line (gloo would accept it).

A lesson passes when every rank exits 0, rank 0's last line is "[R0] all checks passed: ...", and no rank
printed a warning. Each run has a deadline; on a hang every rank is killed and every rank's output shown.
"""
import atexit
import functools
import glob
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LESSONS = sorted(Path(p).name for p in glob.glob(str(HERE / "[0-9][0-9]_*.py")))
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


def install_contract(device_type: str):
    """Wrap torch.distributed's collectives and P2P calls: each tensor handed to one must be contiguous and on
    `device_type`, as NCCL demands (gloo accepts a non-contiguous tensor and answers right)."""
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
        install_contract("cpu")
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


def _zygote():
    """`python test_all.py --zygote`: read one launch per line (JSON), fork its ranks, answer their exit codes."""
    import torch  # noqa: F401  (imported once, here; the forked ranks inherit it)
    import torch.distributed  # noqa: F401
    import torch.nn.functional  # noqa: F401
    import torch.testing  # noqa: F401
    import sympy  # noqa: F401  (autograd.grad with grad_outputs imports it on torch 2.13)
    import torch._dynamo  # noqa: F401  (the first torch.optim optimizer imports it)
    import gc
    gc.freeze()  # what the ranks inherit is never collected: their exits take 0.4 s instead of 1.5 s
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.monotonic()
        pids = []
        for rank in range(len(req["env"])):
            pid = os.fork()
            if pid == 0:
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
        print(json.dumps({"codes": codes, "timed_out": timed_out, "seconds": time.monotonic() - t0}), flush=True)


_ZYGOTE = None


def _zygote_process():
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.poll() is not None:
        _ZYGOTE = subprocess.Popen([sys.executable, __file__, "--zygote"], cwd=HERE, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        atexit.register(_ZYGOTE.kill)
    return _ZYGOTE


class Run:
    """What one launch left: exit codes, each rank's stdout and stderr, and whether it hit the deadline."""

    def __init__(self, codes, outs, errs, timed_out, seconds):
        self.codes, self.outs, self.errs, self.timed_out, self.seconds = codes, outs, errs, timed_out, seconds

    def report(self) -> str:
        lines = [f"exit codes {self.codes}, {self.seconds:.1f} s" + (", TIMED OUT" if self.timed_out else "")]
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
    zygote = _zygote_process()
    zygote.stdin.write(json.dumps(req) + "\n")
    zygote.stdin.flush()
    answer = json.loads(zygote.stdout.readline())
    read = lambda p: p.read_text(errors="replace") if p.exists() else ""
    run = Run(answer["codes"], [read(tmp / f"{r}.out") for r in range(world)],
              [read(tmp / f"{r}.err") for r in range(world)], answer["timed_out"], answer["seconds"])
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


def _has_lessons():
    if not LESSONS:
        pytest.skip("no numbered lesson in the tree yet")


def _script(tmp_path, code: str) -> str:
    """A throw-away script (for error paths no lesson should contain) that can import common."""
    path = tmp_path / "probe.py"
    path.write_text(f"import sys; sys.path.insert(0, {str(HERE)!r})\n" + textwrap.dedent(code))
    return str(path)


# ---- every lesson at every world size, through the fast launcher -------------------------------------------
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("script", LESSONS)
def test_world_size(script, world):
    """At 2 ranks every rank leaves through interpreter shutdown, as under torchrun, so an abort at exit fails
    here; the other sizes skip shutdown, which costs 0.4 s a rank (-m stress exits every launch)."""
    check_passed(launch(script, world, real_exit=world == 2))


@pytest.mark.parametrize("script", LESSONS)
def test_world_size_3_runs_or_is_refused_cleanly(script):
    """3 ranks fits some lessons and not others: either it passes, or every rank says why and exits 2, fast."""
    run_ = launch(script, 3, real_exit=False)  # refuse()'s own exit is seen under torchrun (04, below)
    if all(c == 0 for c in run_.codes):
        check_passed(run_)
        return
    assert not run_.timed_out and all(c == 2 for c in run_.codes), run_.report()
    refused_ranks = {int(m.group(1)) for e in run_.errs for m in REFUSED.finditer(e)}
    assert refused_ranks == {0, 1, 2}, "each rank should say why, in one line\n" + run_.report()
    assert all(len(e.strip().splitlines()) == 1 for e in run_.errs), "no traceback, one line\n" + run_.report()
    assert run_.seconds < 10, run_.report()


# ---- a block pasted alone: only torch, your own process group ----------------------------------------------
# For each lesson, a few lines a user would write: import the file where common.py cannot be imported, make the
# process group yourself, call one block at 2 ranks and compare it with plain torch.
PASTED = {
    "01_p2p.py": """
        x = torch.arange(6.).view(2, 3).t()              # a non-contiguous activation: send_forward copes
        if rank == 0:
            m.send_forward(x)
        else:
            got = m.recv_forward((3, 2), torch.float32, torch.device("cpu"))
            assert torch.equal(got, x), got
    """,
    "02_root_collectives.py": """
        full = torch.arange(24.).view(4, 6)
        out = torch.empty(4, 3)
        m.scatter_along_dim(full if rank == 0 else None, out, dim=1, src=0)
        assert torch.equal(out, full.chunk(2, dim=1)[rank]), out
    """,
    "03_allreduce_rs_ag.py": """
        x = torch.arange(8.) * (rank + 1)
        assert torch.equal(m.ring_all_reduce(x.clone()), torch.arange(8.) * 3)
        y = m.gather_from_sequence_parallel_region(x.view(2, 4), dim=1)
        assert torch.equal(y, torch.cat([torch.arange(8.).view(2, 4), 2 * torch.arange(8.).view(2, 4)], 1)), y
    """,
    "04_all_to_all_moe.py": """
        x = torch.arange(4.) + 10 * rank                 # rank r sends rows [2j, 2j+1] to rank j
        y = m.all_to_all(x)
        assert torch.equal(y, torch.tensor([0., 1., 10., 11.]) + 2 * rank), y
    """,
    "05_tp_layers.py": """
        dense = torch.nn.Linear(6, 4, dtype=torch.float64)
        col = m.ColumnParallelLinear.from_dense(dense, gather_output=True)
        x = torch.randn(3, 6, dtype=torch.float64)
        torch.testing.assert_close(col(x), dense(x))
    """,
    "06_sequence_parallel.py": """
        q, k, v = (torch.randn(8, 1, 2, 4) for _ in range(3))           # [s, b, heads, d], sequence first
        want = torch.nn.functional.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                                                is_causal=True).permute(2, 0, 1, 3)
        shard = lambda t: m.zigzag_shard(t, 0)
        out = m.ring_attention(shard(q), shard(k), shard(v), is_causal=True)
        torch.testing.assert_close(m.zigzag_unshard(out, 0), want)
    """,
    "07_vocab_parallel.py": """
        logits = torch.randn(5, 8, dtype=torch.float64)
        target = torch.tensor([0, 7, 3, 4, -100])
        loss = m.vocab_parallel_cross_entropy(logits.chunk(2, dim=1)[rank], target)
        torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, target))
    """,
    "08_pipeline_1f1b.py": """
        order = m.schedule_1f1b(2, rank, 3)
        assert [op[0] for op in order] == (["F", "F", "B", "F", "B", "B"] if rank == 0 else ["F", "B"] * 3), order
    """,
    "09_ddp_zero2.py": """
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 2, dtype=torch.float64)
        ref = torch.nn.Linear(4, 2, dtype=torch.float64)
        ref.load_state_dict(net.state_dict())
        model = m.DDP(net, bucket_numel=8, optimizer_class=torch.optim.SGD, lr=0.1)
        x = torch.randn(4, 4, dtype=torch.float64)
        model(x[2 * rank:2 * rank + 2]).pow(2).sum().backward()
        model.step()
        opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        (ref(x).pow(2).sum() / 2).backward()
        opt.step()
        torch.testing.assert_close(net.weight, ref.weight)
    """,
    "10_3d_parallel.py": """
        grid = m.Grid(1, 1, 2)                                          # 05-09 beside it, as 10 says
        torch.manual_seed(0)
        gpt = m.GPT(64, 16, 8, 32, 2, dtype=torch.float64)
        stage = m.GPTStage(gpt, grid)
        ids = torch.randint(64, (2, 8))
        want = gpt(ids).transpose(0, 1).chunk(2, dim=-1)[grid.t]          # [s, b, V/tp]
        torch.testing.assert_close(stage(ids), want, rtol=1e-12, atol=1e-12)
    """,
}


PASTE_HEADER = "import torch\nimport torch.distributed as dist\nimport torch.nn as nn\nimport torch.nn.functional as F\n"


def building_blocks(path: Path) -> str:
    """The text a reader pastes: from the first `# ---- building blocks` line to the `# ---- demo` line."""
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, l in enumerate(lines) if l.startswith("# ---- building blocks"))
    end = next(i for i, l in enumerate(lines) if l.startswith("# ---- demo"))
    assert start < end, script
    return "".join(lines[start:end])


@pytest.mark.parametrize("script", sorted(PASTED), ids=lambda s: "lesson" + s[:2])
def test_block_pasted_alone(script, tmp_path):
    """The blocks need only torch: the text between the markers, pasted literally under the four torch imports
    (nothing else of the lesson comes along, and common.py cannot be imported), runs at 2 ranks inside a process
    group the user made, as in their own training script."""
    pasted = tmp_path / "pasted.py"
    pasted.write_text(PASTE_HEADER + building_blocks(HERE / script))
    probe = _script(tmp_path, textwrap.dedent(f"""
        import importlib.util, os, torch, torch.distributed as dist
        spec = importlib.util.spec_from_file_location("pasted", {str(pasted)!r})
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    """) + textwrap.dedent(PASTED[script]) + textwrap.dedent("""
        dist.barrier()
        dist.destroy_process_group()
        print("[R0] all checks passed: the block ran alone" if rank == 0 else "", end="")
    """))
    check_passed(launch(probe, 2, without_common=True, real_exit=False))


def test_a_paste_needs_every_import_it_uses(tmp_path):
    """The paste check itself can fail: a block using a module imported above the marker raises NameError."""
    lesson = tmp_path / "99_probe.py"
    lesson.write_text("import contextlib\n# ---- building blocks\ndef quiet():\n    return contextlib.nullcontext()\n"
                      "# ---- demo\n")
    pasted = tmp_path / "pasted.py"
    pasted.write_text(PASTE_HEADER + building_blocks(lesson))
    namespace = {}
    exec(compile(pasted.read_text(), str(pasted), "exec"), namespace)
    with pytest.raises(NameError, match="contextlib"):
        namespace["quiet"]()


def test_one_operator_is_one_text_across_lessons():
    """A block that two lessons carry under one name (the mappings of 03, 05, 06 and 07, the SP linear of 05 and 06)
    is the same text, character for character: a bug mended in one copy cannot live on in another."""
    import ast
    defs = {}
    for script in LESSONS:
        if script.startswith("10_"):
            continue  # 10 imports the others' blocks
        text = building_blocks(HERE / script)
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defs.setdefault(node.name, {})[script] = ast.get_source_segment(text, node)
    shared = {name: by_file for name, by_file in defs.items() if len(by_file) > 1}
    assert {"_reduce", "LinearWithSequenceParallel", "copy_to_tensor_model_parallel_region"} <= set(shared)
    for name, by_file in shared.items():
        first, *rest = by_file
        for other in rest:
            assert by_file[other] == by_file[first], f"{name} differs between {first} and {other}"


def test_every_lesson_has_a_pasted_block_check():
    assert set(PASTED) >= set(LESSONS), "add the lesson to PASTED"


# ---- clear errors instead of hangs -------------------------------------------------------------------------
def test_nccl_without_gpu_is_refused_on_every_rank():
    _has_lessons()
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run_ = launch(LESSONS[0], 2, extra_env={"BACKEND": "nccl"}, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all("NCCL needs one CUDA device per process" in e for e in run_.errs), run_.report()


@pytest.mark.parametrize("value", ["abc", "inf", "0", "-5", "nan"])
def test_bad_pg_timeout_is_one_line_on_every_rank(value):
    _has_lessons()
    run_ = launch(LESSONS[0], 2, extra_env={"PG_TIMEOUT": value}, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and "PG_TIMEOUT" in e for e in run_.errs), run_.report()


def test_bad_backend_is_one_line_on_every_rank():
    _has_lessons()
    run_ = launch(LESSONS[0], 2, extra_env={"BACKEND": "mpi"}, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and "BACKEND='mpi'" in e for e in run_.errs), run_.report()


def test_empty_settings_mean_the_defaults():
    _has_lessons()
    check_passed(launch(LESSONS[0], 2, extra_env={"BACKEND": "", "PG_TIMEOUT": ""}, real_exit=False))


def test_the_contract_check_catches_a_non_contiguous_tensor(tmp_path):
    """The launcher's NCCL contract can fail: a transposed view handed to all_reduce names the op and line."""
    probe = _script(tmp_path, """
        import torch, torch.distributed as dist
        from common import finish, setup
        rank, world, device = setup()
        dist.barrier()  # else rank 0 (the store's host) may fail and leave while rank 1 is still joining
        x = torch.ones(2, 3).t()
        dist.all_reduce(x)
        finish("unreachable")
    """)
    run_ = launch(probe, 2, real_exit=False)
    assert all(c == 1 for c in run_.codes), run_.report()
    assert all(re.search(r"dist.all_reduce was handed a non-contiguous tensor .* at probe.py:8$", e, re.M)
               for e in run_.errs), run_.report()


def test_importing_a_lesson_starts_nothing_and_prints_nothing():
    _has_lessons()
    code = ("import importlib.util, sys, torch.distributed as dist\n"
            "for f in sys.argv[1:]:\n"
            "    spec = importlib.util.spec_from_file_location('m' + f[:2], f)\n"
            "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "    assert not dist.is_initialized(), f\n")
    # every warning shown, but for ResourceWarning: torch 2.6 leaves a TemporaryDirectory of its own at exit
    p = subprocess.run([sys.executable, "-W", "default", "-W", "ignore::ResourceWarning", "-c", code, *LESSONS],
                       cwd=HERE, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stdout + p.stderr


# ---- the real torchrun ---------------------------------------------------------------------------------------
def _torchrun():
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _run_cmd(cmds, timeout=RUN_DEADLINE, env=None):
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


def _check_torchrun(code, out):
    check_passed(Run([code], [out], [""], "TIMED OUT" in out, 0.0))


TORCHRUN_LESSONS = [f for f in LESSONS if f.startswith("09_")]  # buckets, hooks, async work in flight at exit


@pytest.mark.slow
@pytest.mark.parametrize("script", TORCHRUN_LESSONS)
def test_torchrun(script):
    """A lesson under the real torchrun (2 processes, for the suite's time): fresh processes, with imports,
    warnings and exits as a user sees them. For the suite's time one lesson here; the 2-node test runs 05,
    `python FILE` 01, the refusal 04, and `TORCHRUN_ALL=1` runs every other lesson too."""
    [(code, out)] = _run_cmd([_torchrun() + ["--nproc-per-node=2", "--standalone", script]])
    _check_torchrun(code, out)


@pytest.mark.slow
@pytest.mark.parametrize("script", [f for f in LESSONS if f not in TORCHRUN_LESSONS])
def test_torchrun_all(script):
    if os.environ.get("TORCHRUN_ALL") != "1":
        pytest.skip("TORCHRUN_ALL=1 runs every lesson under torchrun --nproc-per-node=4")
    [(code, out)] = _run_cmd([_torchrun() + ["--nproc-per-node=4", "--standalone", script]])
    _check_torchrun(code, out)


@pytest.mark.slow
def test_python_file_relaunches_under_torchrun():
    """`python FILE` runs FILE under torchrun itself (NPROC processes)."""
    _has_lessons()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    [(code, out)] = _run_cmd([[sys.executable, LESSONS[0]]], env={**env, "NPROC": "1"})
    assert "torchrun --standalone --nproc-per-node=1" in out.splitlines()[0], out
    _check_torchrun(code, "\n".join(out.splitlines()[1:]))


@pytest.mark.slow
def test_refusal_under_torchrun_is_said_by_every_rank():
    """torchrun kills the other ranks when one exits: refuse() waits until every rank has said why."""
    refusing = [f for f in LESSONS if f.startswith("04_")]
    if not refusing:
        pytest.skip("04 is the lesson that refuses 3 ranks")
    [(code, out)] = _run_cmd([_torchrun() + ["--nproc-per-node=3", "--standalone", refusing[0]]])
    assert code != 0 and {int(r) for r in REFUSED.findall(out)} == {0, 1, 2}, out


@pytest.mark.slow
def test_a_late_rank_still_says_its_refusal(tmp_path):
    """refuse() after setup() on the first rank waits for a rank that comes 3 s later, so torchrun does not kill it
    unheard."""
    probe = _script(tmp_path, """
        import os, time
        import common
        common.setup()                                                # a refusal after the group exists
        if os.environ["RANK"] == "1":
            time.sleep(3)
        common.refuse("a probe that refuses")
    """)
    [(code, out)] = _run_cmd([_torchrun() + ["--nproc-per-node=2", "--standalone", probe]], timeout=60)
    assert code != 0 and {int(r) for r in REFUSED.findall(out)} == {0, 1}, out


@pytest.mark.slow
def test_two_nodes_with_sub_groups():
    """Two torchrun agents (2 nodes x 2 processes) meet through c10d rendezvous and run a lesson with sub-groups.

    Only the lesson's lines are checked: when the agent that hosts the rendezvous store leaves first, the other
    agent logs a RendezvousConnectionError on its way out (torchrun's own noise, after every rank passed)."""
    uses_groups = sorted((f for f in LESSONS if "new_group(" in (HERE / f).read_text()),
                         key=lambda f: f != "05_tp_layers.py")
    if not uses_groups:
        pytest.skip("no lesson uses sub-groups yet")
    port = free_port()
    cmd = _torchrun() + ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=two-nodes-{port}", uses_groups[0]]
    results = _run_cmd([cmd, cmd])
    outs = "\n".join(out for _, out in results)
    assert all(code == 0 for code, _ in results), outs
    assert len(re.findall(r"^\[R0\] all checks passed: ", outs, re.M)) == 1, outs


# ---- on a machine with GPUs: NCCL ----------------------------------------------------------------------------
def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("script", LESSONS)
def test_nccl(script):
    """Every lesson under torchrun with NCCL, one process per GPU: 1, 2 or 4 of them (the largest the GPUs allow;
    every lesson accepts these sizes)."""
    gpus = _gpus()
    if not gpus:
        pytest.skip("no CUDA device: NCCL needs one per process")
    n = max(k for k in (1, 2, 4) if k <= gpus)
    [(code, out)] = _run_cmd([_torchrun() + [f"--nproc-per-node={n}", "--standalone", script]],
                             env={"BACKEND": "nccl"})
    _check_torchrun(code, out)


# ---- stress: exits that fail now and then --------------------------------------------------------------------
@pytest.mark.stress
@pytest.mark.parametrize("script", LESSONS)
def test_exits_never_abort(script, request):
    """The lesson at 1, 2, 3, 4 and 8 ranks, STRESS_ROUNDS times (default 4: 20 launches a lesson, 200 for the ten
    lessons), each rank a real process that leaves through interpreter shutdown. A failure that hits 2 % of
    launches escapes 200 of them with a chance of about 2 %."""
    if "stress" not in (request.config.option.markexpr or ""):
        pytest.skip("run it with -m stress")
    failed, runs = [], 0
    for _ in range(int(os.environ.get("STRESS_ROUNDS", "4"))):
        for world in (1, 2, 3, 4, 8):
            run_ = launch(script, world)
            runs += 1
            if world == 3 and all(c == 2 for c in run_.codes):
                continue  # refused 3 ranks, cleanly
            try:
                check_passed(run_)
            except AssertionError as e:
                failed.append(f"{script} at {world} ranks: {str(e)[:3000]}")
    print(f"{script}: {runs} launches, {len(failed)} failed")
    assert not failed, f"{len(failed)} of {runs} launches failed:\n" + "\n".join(failed)



# ---- traces, common.py ------------------------------------------------------------------------------------------
def traced(script, tmp_path, world=2):
    """Run `script` with TRACE=tmp_path: it passes, prints nothing on stderr (the profiler's own log lines
    included), and leaves one file with a process row per rank and a range per section. -> (events, stdout)"""
    run_ = launch(script, world, extra_env={"TRACE": str(tmp_path)}, real_exit=False)
    check_passed(run_)
    assert not "".join(run_.errs).strip(), "stderr is not empty\n" + run_.report()
    files = list(tmp_path.glob("*.json"))
    assert [f.name for f in files] == [Path(script).stem + ".json"], files
    events = json.loads(files[0].read_text())["traceEvents"]
    rows = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "process_name"}
    assert rows == {(r, f"rank {r}") for r in range(world)}, rows
    flows = {}                                         # a flow arrow (op -> its backward) stays within one rank
    for e in events:
        if e.get("ph") in ("s", "t", "f"):
            assert flows.setdefault(e["id"], e["pid"]) == e["pid"], e
    titles = [ln[3:] for ln in run_.outs[0].splitlines() if ln.startswith("== ")]
    assert titles, run_.report()
    for r in range(world):
        ranges = sorted((e for e in events if e["pid"] == r and e.get("cat") == "user_annotation"
                         and e["name"] in titles), key=lambda e: e["ts"])
        assert [e["name"] for e in ranges] == titles, (r, [e["name"] for e in ranges], titles)
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(ranges, ranges[1:])), "sections overlap"
    return events, run_.outs[0]


def spans(events, rank, pattern, thread=None):
    """The complete events ("X") of `rank` whose name matches `pattern`, in time order, on the lanes (threads)
    whose name contains `thread` (default: any)."""
    tids = {e["tid"] for e in events if e.get("name") == "thread_name" and e["pid"] == rank
            and (thread or "") in e["args"]["name"]}
    return sorted((e for e in events if e["pid"] == rank and e.get("ph") == "X" and e["tid"] in tids
                   and re.fullmatch(pattern, e["name"])), key=lambda e: e["ts"])


def test_trace_of_08_shows_every_op_of_each_schedule_in_order(tmp_path, script="08_pipeline_1f1b.py"):
    """In the timelines section, each stage's F/B/W ranges ("F mb{i} c{chunk}") are its schedules' ops, in
    order, and the messages between stages are there (gloo's send and recv)."""
    import importlib.util
    events, _ = traced(script, tmp_path)
    spec = importlib.util.spec_from_file_location("pipeline", HERE / script)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    fns = (m.schedule_1f1b, m.schedule_interleaved_1f1b, m.schedule_zb_h1)  # what timelines() runs, m = 4
    sections = [spans(events, stage, r"timelines.*", "main thread") for stage in (0, 1)]
    for stage, [section] in enumerate(sections):
        ops = [e["name"] for e in spans(events, stage, r"[FBW] mb\d+ c\d+", "main thread")
               if section["ts"] <= e["ts"] <= section["ts"] + section["dur"]]
        want = [f"{o[0]} mb{o[1]} c{o[2] if len(o) > 2 else 0}" for fn in fns for o in m.schedule(fn, m.V)(2, stage, 4)]
        assert ops == want, (stage, ops, want)
        assert spans(events, stage, r"gloo:send") and spans(events, stage, r"gloo:recv"), stage
    # one clock for both rows: stage 1's forward of a micro-batch starts after stage 0's forward of it ended
    first = lambda stage, name: next(e for e in spans(events, stage, name, "main thread")
                                     if e["ts"] >= sections[stage][0]["ts"])   # in its 1F1B run
    for mb in range(4):
        f0 = first(0, f"F mb{mb} c0")
        assert first(1, f"F mb{mb} c0")["ts"] >= f0["ts"] + f0["dur"], mb


def test_trace_of_09_shows_all_reduces_under_backward(tmp_path):
    """A bucket's all-reduce, started from a gradient hook, runs on gloo's thread ("gloo:all_reduce" spans its
    real duration; "c10d::allreduce_" on the main thread is only its launch) while the main thread goes on with
    backward: a backward op starts after the all-reduce began and before it ended, on the same rank."""
    events, _ = traced("09_ddp_zero2.py", tmp_path)
    for rank in (0, 1):
        backward = spans(events, rank, r"\w+Backward0", "main thread")
        main = {e["tid"] for e in backward}  # gloo's worker threads are the others (named pt_gloo_runloop on 2.13)
        reduces = [e for e in spans(events, rank, r"gloo:all_reduce") if e["tid"] not in main]
        assert reduces and backward, rank
        under = [(a["ts"], b["name"]) for a in reduces for b in backward if a["ts"] <= b["ts"] < a["ts"] + a["dur"]]
        assert under, f"rank {rank}: no backward op ran while an all-reduce was in flight"


def test_ring_bytes_are_nccl_tests_bus_factors():
    """common.ring_bytes(op, 1, W) is the bus-bandwidth factor nccl-tests' doc/PERFORMANCE.md gives for each op
    (03's BENCH divides by it): all_reduce 2(n-1)/n, reduce_scatter, all_gather and all_to_all (n-1)/n,
    broadcast 1."""
    sys.path.insert(0, str(HERE))
    import common
    from fractions import Fraction
    doc = {"all_reduce": lambda n: Fraction(2 * (n - 1), n), "reduce_scatter": lambda n: Fraction(n - 1, n),
           "all_gather": lambda n: Fraction(n - 1, n), "all_to_all": lambda n: Fraction(n - 1, n),
           "broadcast": lambda n: Fraction(1)}
    for op, factor in doc.items():
        for n in range(1, 9):
            assert abs(common.ring_bytes(op, 1, n) - factor(n)) < 1e-12, (op, n)
            assert abs(common.ring_bytes(op, 4096, n) - 4096 * factor(n)) < 1e-9, (op, n)


@pytest.mark.timeout(60)
def test_memory_meter_held_bytes_kept_for_backward_and_replays():
    """common's checking tools in one process, on tensors whose bytes are known: held_bytes counts a storage once
    (views too) and a resized-to-0 one as 0; memory() counts what is allocated inside and still held, not an
    in-place op on an older tensor, its peak, reset() and track() of a storage that grows; kept_for_backward leaves
    parameters out and adds `inputs`; replays finds a deadlock and matches tags."""
    sys.path.insert(0, str(HERE))
    import common
    import torch
    import torch.nn.functional as F
    x = torch.zeros(10)                                              # 40 B
    assert common.held_bytes([x, x[2:], x.view(2, 5), torch.zeros(3, dtype=torch.float64)]) == 40 + 24
    gone = torch.zeros(4)
    gone.untyped_storage().resize_(0)
    assert common.held_bytes([gone, x]) == 40
    with common.memory() as m:
        a = torch.ones(25)                                           # 100 B
        x.add_(1)                                                    # in place on an older storage: not counted
        assert m.live() == m.peak == 100, (m.live(), m.peak)
        b = torch.ones(50)                                           # 200 B, then freed
        del b
        assert m.live() == 100 and m.peak == 300, (m.live(), m.peak)
        m.reset()
        assert m.peak == 100, m.peak
        gone.untyped_storage().resize_(0)
        m.track([gone])
        gone.untyped_storage().resize_(16)                           # as ZeRO-3 gathers a freed parameter
        m.track([gone])
        assert m.live() == m.peak == 116, (m.live(), m.peak)
    del a
    w, x = torch.ones(3, 4, requires_grad=True), torch.ones(5, 4, requires_grad=True)
    _, kept = common.kept_for_backward(lambda: F.linear(x, w), [w])  # saves x and w: w is a parameter
    assert kept == x.nbytes, kept
    _, kept = common.kept_for_backward(lambda: w * 2, [], inputs=(x,))  # saves nothing; x counted as asked
    assert kept == x.nbytes, kept
    assert common.replays([[("send", 1, "a"), ("send", 1, "b")], [("recv", 0, "a"), ("recv", 0, "b")]])
    assert not common.replays([[("send", 1, "a")], [("recv", 0, "b")]])        # tags differ
    assert not common.replays([[("send", 1), ("recv", 1)], [("send", 0), ("recv", 0)]])  # both send first
    assert not common.replays([[("send", 1)], [("recv", 0)], [("send", 0)]])  # rank 2's send never received


@pytest.mark.timeout(60)
def test_refused_wants_one_line_before_any_message():
    """common.refused: the message of the error asked for; an accepted call, another error, a message of two lines
    or a refusal that sent first all fail (the last on a 1-rank gloo group made in this process)."""
    sys.path.insert(0, str(HERE))
    import common
    import torch
    import torch.distributed as dist
    assert common.refused(lambda: int("x")) == "invalid literal for int() with base 10: 'x'"
    assert common.refused(lambda: [][0], IndexError) == "list index out of range"
    def two_lines():
        raise ValueError("one\ntwo")
    for call in (lambda: None, two_lines):
        with pytest.raises(AssertionError):
            common.refused(call)
    with pytest.raises(KeyError):
        common.refused(lambda: {}["k"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def sends_then_refuses():
            dist.all_reduce(torch.ones(1))
            raise ValueError("too late")
        with pytest.raises(AssertionError):
            common.refused(sends_then_refuses)
    finally:
        dist.destroy_process_group()


def test_two_stuck_ranks_are_both_named(tmp_path):
    """A rank that never arrives is named by the others (monitored_barrier), within the timeout, not a hang; and the
    barrier at the end waits for every rank it can, naming all that never came, not only the first."""
    probe = _script(tmp_path, """
        import time
        from common import finish, setup
        rank, world, device = setup()
        if rank in (1, 3):
            time.sleep(30)
        finish("unreachable")
    """)
    # 2 s, not 1: the timeout also bounds joining the group, which a loaded machine can slow down
    run_ = launch(probe, 4, extra_env={"PG_TIMEOUT": "2"}, deadline=60, real_exit=False, grace=2)
    assert not run_.timed_out and run_.codes[0] not in (0, None), run_.report()
    assert re.search(r"Ranks 1, 3 failed to pass monitoredBarrier", run_.errs[0]), run_.report()


def test_a_sub_group_times_out_like_the_world(tmp_path):
    """A collective on a group a demo makes (common.strided_groups, or new_group with common.pg_timeout()) that a
    rank never joins fails within PG_TIMEOUT, as on the world group; dist.new_group's own default is 30 min."""
    probe = _script(tmp_path, """
        import time, torch, torch.distributed as dist
        from common import setup, strided_groups
        rank, world, device = setup()
        [(group, ranks)] = strided_groups(1)               # every rank, in a group of its own making
        if rank == 1:
            time.sleep(30)
        dist.all_reduce(torch.ones(1), group=group)
    """)
    run_ = launch(probe, 2, extra_env={"PG_TIMEOUT": "1"}, deadline=60, real_exit=False, grace=1)
    assert not run_.timed_out and run_.codes[0] == 1 and run_.seconds < 15, run_.report()
    assert re.search(r"[Tt]imed out", run_.errs[0]), run_.report()


def test_bad_nproc_is_one_line(tmp_path):
    """`python FILE` with an NPROC that is not a number of processes >= 1: one line naming it, exit 2, no torchrun
    (empty means the default, 4, as for BACKEND and PG_TIMEOUT). Run in one forked process, torchrun's variables
    removed, the relaunch (os.execv) recorded instead of run."""
    probe = _script(tmp_path, """
        import os, sys
        for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            del os.environ[v]
        sys.argv = ["01_p2p.py"]
        import common
        os.execv = lambda exe, args: print("execv", *args[1:5])
        for nproc in ["0", "-1", "two", "1.5", "", " 2 "]:
            os.environ["NPROC"] = nproc
            try:
                common.launched_world_size()
            except SystemExit as e:
                print("exit", e.code)
    """)
    run_ = launch(probe, 1, real_exit=False)
    refused = [f"01_p2p.py: NPROC={v!r} is not a number of processes (a whole number >= 1)"
               for v in ["0", "-1", "two", "1.5"]]
    assert run_.codes == [0] and run_.errs[0].splitlines() == refused, run_.report()
    out = [ln for ln in run_.outs[0].splitlines() if not ln.startswith("not started by torchrun")]
    assert out == ["exit 2"] * 4 + ["execv -m torch.distributed.run --standalone --nproc-per-node=4",
                                    "execv -m torch.distributed.run --standalone --nproc-per-node=2"], run_.report()


def test_log_all_on_a_sub_group(tmp_path):
    """log_all(msg, group): each group's first rank prints its members' lines in group-rank order; no one else."""
    probe = _script(tmp_path, """
        import torch.distributed as dist
        from common import finish, log_all, setup
        rank, world, device = setup()
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        log_all(f"parity {rank % 2}", group=groups[rank % 2])
        finish("log_all on sub-groups")
    """)
    run_ = launch(probe, 4, real_exit=False)
    check_passed(run_)
    assert run_.outs[0].splitlines()[:2] == ["[R0] parity 0", "[R2] parity 0"], run_.report()
    assert run_.outs[1] == "[R1] parity 1\n[R3] parity 1\n", run_.report()
    assert run_.outs[2] == run_.outs[3] == "", run_.report()


def test_bad_bench_is_one_line_on_every_rank():
    """03's BENCH takes 1 (the table) or 0 / unset (the lesson); anything else is refused before any work. The
    table itself is not run here (a minute or two); each op's result is checked inside it."""
    run_ = launch("03_allreduce_rs_ag.py", 2, extra_env={"BENCH": "yes"}, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and "BENCH='yes'" in e for e in run_.errs), run_.report()


@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_bad_trace_directory_is_one_line_on_every_rank(tmp_path, where):
    (tmp_path / "file").write_text("")
    run_ = launch(LESSONS[0], 2, extra_env={"TRACE": str(tmp_path / where)}, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and "TRACE=" in e for e in run_.errs), run_.report()


# ---- 09: the wrapper kept (checkpoints, resume) ----
def test_09_resumes_in_new_processes(tmp_path):
    """09 with CKPT_PHASE=save trains DDP, ZeRO-2 and ZeRO-3 two steps on the world and on sub-groups at 4 ranks
    and saves (the model's state_dict by group rank 0, every rank its optimizer shard); new processes with
    CKPT_PHASE=load load it and train steps 3-4 bit-equal to the run that went on; 2 ranks are refused."""
    ckpt = {"CKPT": str(tmp_path)}
    check_passed(launch("09_ddp_zero2.py", 4, {**ckpt, "CKPT_PHASE": "save"}, real_exit=False))
    saved = sorted(f.name for f in tmp_path.glob("*.pt"))
    assert len(saved) == 1 + 3 * (1 + 4 + 2 * (1 + 2)), saved  # W; per wrapper: world and 2 sub-groups' files
    run_ = launch("09_ddp_zero2.py", 4, {**ckpt, "CKPT_PHASE": "load"}, real_exit=False)
    check_passed(run_)
    assert "steps 3-4 bit-equal" in run_.outs[0], run_.report()
    run_ = launch("09_ddp_zero2.py", 2, {**ckpt, "CKPT_PHASE": "load"}, real_exit=False)
    assert run_.codes == [2, 2] and not run_.timed_out, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and "saved at 4 ranks, this run has 2" in e for e in run_.errs), \
        run_.report()


def test_09_readme_training_script_runs(tmp_path):
    """README's "Using 09 in your training script" block, as it stands, at 2 ranks (it asserts the resume)."""
    section = (HERE / "README.md").read_text().split("### Using 09 in your training script", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    probe = _script(tmp_path, code + textwrap.dedent("""
        dist.destroy_process_group()
        print("[R0] all checks passed: README's training script" if rank == 0 else "", end="")
    """))
    check_passed(launch(probe, 2, {"CKPT": str(tmp_path / "ckpt")}, real_exit=False))
    assert (tmp_path / "ckpt" / "optim.1.pt").exists()


# ---- 10: grids and composition ----
TEN = "10_3d_parallel.py"


@pytest.mark.parametrize("world, env, shown", [
    (8, {"GRID": "1x4x2"}, "middle stages: no tied-weight all-reduce"),       # pp 4: stages 1 and 2 are middle
    (4, {"GRID": "1x4x1"}, "middle stages: no tied-weight all-reduce"),
    (4, {"ZERO": "3", "GRID": "2x2x1"}, "dp 2 x pp 2 x tp 1 (SP, vocab-parallel, 1F1B, ZeRO-3)")])
def test_10_middle_stages_and_zero3(world, env, shown):
    """10 on grids with middle pipeline stages (it asserts they are in no embedding group and join no tied-weight
    all-reduce) and with ZeRO-3 over dp 2 and two stages (equal to one process, traffic and bytes held == its closed
    forms; 06's SP block inside ZeRO-3 with tp 2 is checked by every 10 run at 4 and 8 ranks)."""
    run_ = launch(TEN, world, extra_env=env, real_exit=False)
    check_passed(run_)
    assert shown in run_.outs[0], run_.report()


@pytest.mark.parametrize("env, named", [
    ({"SCALE": "tp=0"}, "tp=0"), ({"SCALE": "pp=0"}, "pp=0"), ({"SCALE": "pp=3"}, "pp=3"),
    ({"SCALE": "bucket=0"}, "bucket=0"),
    ({"SCALE": "m=0"}, "m=0"), ({"SCALE": "hidden=4096.7"}, "hidden=4096.7"), ({"SCALE": "tp=3"}, "tp=3"),
    ({"SCALE": "hidden=4096 layers=32 ... tp=8 pp=4 dp=8"}, "'...'"), ({"GRID": "-2x-1x1"}, "GRID='-2x-1x1'"),
    ({"ZERO": "4"}, "ZERO='4'")])
def test_10_bad_input_is_one_line_on_every_rank(env, named):
    """A bad command-line value (SCALE= reads the same key=value pairs) or GRID/ZERO: every rank says in one line
    which value and what would fit, exit 2, within seconds, before any work."""
    run_ = launch(TEN, 2, extra_env=env, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and REFUSED.match(e) and named in e for e in run_.errs), run_.report()
    assert not any(run_.outs), run_.report()                       # refused before any work: nothing printed


def test_10_readme_example_sets_the_scale_tables():
    """README's command line for 10, as written there, is accepted and the scale tables follow its values."""
    line = next(ln for ln in (HERE / "README.md").read_text().splitlines() if f"{TEN} hidden=" in ln)
    args = line.split(TEN, 1)[1].split("`")[0].split()
    run_ = launch(TEN, 1, extra_env={"SCALE": " ".join(args)}, real_exit=False)
    check_passed(run_)
    scale = run_.outs[0].split("at scale", 1)[1]
    shown = {"hidden": "hidden {}", "layers": "{} layers", "seq": "seq {}", "vocab": "vocab {}", "dp": "dp {}",
             "pp": "pp {}", "tp": "tp {}", "m": "{} micro-batches"}
    for key, value in (arg.split("=") for arg in args):              # each value shows in the scale tables' head
        assert key not in shown or shown[key].format(value) in scale, (key, value, scale)


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote()
