"""Runs every numbered lesson the ways people run it, and fails loudly (every rank's output) when one breaks.

    pytest test_all.py                 everything (about a minute and a half on 2 cores)
    pytest test_all.py -m "not slow"   the edit loop: the world-size matrix through the fast launcher
    pytest test_all.py -k 05_          one lesson

Two launchers:
- torchrun itself (`slow`): the advertised `torchrun --nproc-per-node=4 --standalone FILE`, and two torchrun
  agents on this machine forming a 2-node job through c10d rendezvous.
- a fast launcher with torchrun's environment contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT). Its workers are forked from a forkserver that imported torch once, so a run
  costs a fraction of a second instead of seconds of imports. Each rank writes to its own files.

A lesson passes when every rank exits 0, rank 0's last line is "[R0] all checks passed: ...", and no rank
printed a warning. Each run has a deadline; on a hang every rank is killed and every rank's output shown.
"""
import glob
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
LESSONS = sorted(Path(p).name for p in glob.glob(str(HERE / "[0-9][0-9]_*.py")))
WORLD_SIZES = (1, 2, 4, 8)
RUN_DEADLINE = 120  # seconds for one launch, all ranks together
GRACE = 10          # seconds the other ranks get after the first one exits, before they are killed
PASSED = re.compile(r"^\[R0\] all checks passed: .+")
REFUSED = re.compile(r"^\[R(\d+)\] \S+ refuses to run: .+", re.M)
WARNING = re.compile(r"warning|\bwarn\b", re.I)
TORCHRUN_BANNER = re.compile(r"torch/distributed/run\.py:\d+\]")  # torchrun's own OMP_NUM_THREADS note

os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun sets it; inherited by the forkserver and its workers

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor.debug", "test_all"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(script: str, env: dict, out_path: str, err_path: str):
    """One rank, in a process forked from the forkserver: torchrun's environment, then the script as __main__."""
    import runpy
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(HERE)
    sys.path.insert(0, str(HERE))
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")


class Run:
    """What one launch left: exit codes, each rank's stdout and stderr, and whether it hit the deadline."""

    def __init__(self, codes, outs, errs, timed_out, seconds):
        self.codes, self.outs, self.errs, self.timed_out, self.seconds = codes, outs, errs, timed_out, seconds

    def report(self) -> str:
        lines = [f"exit codes {self.codes}, {self.seconds:.1f} s" + (", TIMED OUT" if self.timed_out else "")]
        for r, (o, e) in enumerate(zip(self.outs, self.errs)):
            lines.append(f"---- rank {r} stdout ----\n{o}---- rank {r} stderr ----\n{e}")
        return "\n".join(lines)


def launch(script: str, world: int, extra_env=None, deadline: float = RUN_DEADLINE) -> Run:
    """Start `world` ranks of `script` with torchrun's environment contract and wait for all of them."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="lesson-"))
    procs, files = [], []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), **(extra_env or {})}
        out, err = tmp / f"{rank}.out", tmp / f"{rank}.err"
        p = _CTX.Process(target=_rank_main, args=(script, env, str(out), str(err)))
        p.start()
        procs.append(p)
        files.append((out, err))
    t0 = time.monotonic()
    first_exit, timed_out = None, False
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if first_exit is None and any(p.exitcode is not None for p in procs):
            first_exit = now  # ranks leave together (after a barrier, or all refusing): a straggler is stuck
        if now - t0 > deadline or (first_exit is not None and now - first_exit > GRACE):
            timed_out = now - t0 > deadline
            for p in procs:
                p.kill()
            break
        time.sleep(0.02)
    for p in procs:
        p.join()
    seconds = time.monotonic() - t0
    read = lambda p: p.read_text(errors="replace") if p.exists() else ""
    run = Run([p.exitcode for p in procs], [read(o) for o, _ in files], [read(e) for _, e in files],
              timed_out, seconds)
    shutil.rmtree(tmp, ignore_errors=True)
    return run


def check_passed(run_: Run):
    assert not run_.timed_out and all(c == 0 for c in run_.codes), run_.report()
    outputs = run_.outs
    last = [ln for ln in outputs[0].splitlines() if ln.strip()][-1:] or [""]
    assert PASSED.match(last[0]), "rank 0's last line is not the summary\n" + run_.report()
    warned = [ln for text in outputs + run_.errs for ln in text.splitlines()
              if WARNING.search(ln) and not TORCHRUN_BANNER.search(ln)]
    assert not warned, "warnings in the output:\n" + "\n".join(warned) + "\n" + run_.report()


def _has_lessons():
    if not LESSONS:
        pytest.skip("no numbered lesson in the tree yet")


# ---- every lesson at every world size, through the fast launcher ------------------------------------
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("script", LESSONS)
def test_world_size(script, world):
    run_ = launch(script, world)
    check_passed(run_)


@pytest.mark.parametrize("script", LESSONS)
def test_world_size_3_runs_or_is_refused_cleanly(script):
    """3 ranks fits some lessons and not others: either it passes, or every rank says why and exits 2, fast."""
    run_ = launch(script, 3)
    if all(c == 0 for c in run_.codes):
        check_passed(run_)
        return
    assert not run_.timed_out and all(c == 2 for c in run_.codes), run_.report()
    refused_ranks = {int(m.group(1)) for e in run_.errs for m in REFUSED.finditer(e)}
    assert refused_ranks == {0, 1, 2}, "each rank should say why, in one line\n" + run_.report()
    assert all(len(e.strip().splitlines()) == 1 for e in run_.errs), "no traceback, one line\n" + run_.report()
    assert run_.seconds < 10, run_.report()


# ---- clear errors instead of hangs ------------------------------------------------------------------
def test_nccl_without_gpu_is_refused_on_every_rank():
    _has_lessons()
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run_ = launch(LESSONS[0], 2, extra_env={"BACKEND": "nccl"})
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all("NCCL needs one CUDA device per process" in e for e in run_.errs), run_.report()


def test_without_torchrun_prints_the_command():
    _has_lessons()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, LESSONS[0]], cwd=HERE, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"torchrun --nproc-per-node=4 {LESSONS[0]}" in p.stderr, p.stderr


def test_importing_a_lesson_starts_nothing_and_prints_nothing():
    _has_lessons()
    code = ("import importlib.util, sys, torch.distributed as dist\n"
            "for f in sys.argv[1:]:\n"
            "    spec = importlib.util.spec_from_file_location('m' + f[:2], f)\n"
            "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "    assert not dist.is_initialized(), f\n")
    # every warning shown, but for ResourceWarning: torch 2.6 leaves a TemporaryDirectory of its own at exit
    p = subprocess.run([sys.executable, "-W", "default", "-W", "ignore::ResourceWarning", "-c", code, *LESSONS], cwd=HERE,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p.stdout + p.stderr


# ---- the real torchrun --------------------------------------------------------------------------------
def _torchrun():
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _run_cmd(cmds, timeout=RUN_DEADLINE):
    """Run commands side by side in their own sessions; on a deadline kill each whole process group."""
    procs = [subprocess.Popen(c, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
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


@pytest.mark.slow
@pytest.mark.parametrize("script", LESSONS)
def test_torchrun_4(script):
    """The command README advertises, with --standalone (rendezvous on a free local port) and, as for every run
    here, OMP_NUM_THREADS=1 (what torchrun sets for its workers anyway)."""
    [(code, out)] = _run_cmd([_torchrun() + ["--nproc-per-node=4", "--standalone", script]])
    run_ = Run([code], [out], [""], "TIMED OUT" in out, 0.0)
    check_passed(run_)


@pytest.mark.slow
def test_two_nodes_with_sub_groups():
    """Two torchrun agents (2 nodes x 2 processes) meet through c10d rendezvous and run a lesson with sub-groups.

    Only the lesson's lines are checked: when the agent that hosts the rendezvous store leaves first, the other
    agent logs a RendezvousConnectionError on its way out (torchrun's own noise, after every rank passed)."""
    # 05 builds the TP x DP grid of sub-groups; any other lesson that calls new_group will do if it is absent
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
