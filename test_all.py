"""The one test command: every lesson, its check script and its benchmark, run the ways people run them; fails
loudly (every rank's output) when one breaks.

    pytest test_all.py                 everything (3 minutes on a 2-core machine, gloo)
    pytest test_all.py -m "not slow"   the edit loop: everything but the real torchrun launches
    pytest test_all.py -k lesson05     one lesson: its demo and check script at every size, paste, bench, suite
    pytest test_all.py -m gpu          every lesson under torchrun with NCCL, one process per GPU (skipped without)
    pytest test_all.py -m stress       every lesson at every world size, many times: exits that abort now and then

What runs (tests/launch.py has the launchers):
- every numbered lesson and every tests/check_NN.py at 1, 2, 4 and 8 ranks, and at 3 (runs, or is refused in one
  line on every rank), through a fast launcher with torchrun's environment contract;
- every lesson's building blocks pasted alone (tests/paste_NN.py) at 2 and 4 ranks;
- every bench/*.py once at 2 ranks, small (BENCH_SMALL=1), for its arithmetic;
- the lesson suites tests/suite_NN.py (runs that need several launches or settings), imported below;
- the real torchrun, two nodes on one machine, `python FILE`, refusals, timeouts, traces, common.py itself.
A lesson passes when every rank exits 0, rank 0's last line is "[R0] all checks passed: ...", and no rank
printed a warning. Each run has a deadline; on a hang every rank is killed and every rank's output shown.
"""
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.launch import (GLOO, HERE, PASTE_HEADER, REFUSED, Run, building_blocks, check_passed, check_torchrun,
                          free_port, launch, probe, run_cmd, torchrun)

LESSONS = sorted(Path(p).name for p in glob.glob(str(HERE / "[0-9][0-9]_*.py")))
CHECKS = sorted("tests/" + Path(p).name for p in glob.glob(str(HERE / "tests" / "check_[0-9][0-9].py")))
BENCHES = sorted("bench/" + Path(p).name for p in glob.glob(str(HERE / "bench" / "[0-9][0-9]_*.py")))
SUITES = sorted(Path(p).stem for p in glob.glob(str(HERE / "tests" / "suite_[0-9][0-9].py")))
WORLD_SIZES = (1, 2, 4, 8)
for _suite in SUITES:  # each lesson's own pytest tests (several launches, settings): collected as this file's
    globals().update({k: v for k, v in vars(importlib.import_module("tests." + _suite)).items()
                      if k.startswith("test_")})


def _has_lessons():
    if not LESSONS:
        pytest.skip("no numbered lesson in the tree yet")


# ---- every lesson and check script at every world size, through the fast launcher ------------------------
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("script", LESSONS + CHECKS)
def test_world_size(script, world):
    """At 2 ranks every rank leaves through interpreter shutdown, as under torchrun, so an abort at exit fails
    here; the other sizes skip shutdown, which costs 0.4 s a rank (-m stress exits every launch)."""
    check_passed(launch(script, world, real_exit=world == 2))


@pytest.mark.parametrize("script", LESSONS + CHECKS)
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
def _paste_file(script):
    return HERE / "tests" / f"paste_{script[:2]}.py"


@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.parametrize("script", [s for s in LESSONS if not s.startswith("10_")], ids=lambda s: "lesson" + s[:2])
def test_block_pasted_alone(script, world, tmp_path):
    """The blocks need only torch: the text between the markers, pasted literally under the four torch imports
    (nothing else of the lesson comes along, and common.py cannot be imported), runs inside a process group the
    user made, as in their own training script: tests/paste_NN.py uses them there (inside tests/nanogpt.py's
    model where the lesson has a block for it) and compares with plain torch."""
    pasted = tmp_path / "pasted.py"
    pasted.write_text(PASTE_HEADER + building_blocks(HERE / script))
    body = _paste_file(script).read_text()
    script_ = probe(tmp_path, textwrap.dedent(f"""
        import importlib.util, os, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
        spec = importlib.util.spec_from_file_location("pasted", {str(pasted)!r})
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        exec(compile({body!r}, {str(_paste_file(script))!r}, "exec"))
        dist.barrier()
        dist.destroy_process_group()
        print("[R0] all checks passed: the blocks ran alone" if rank == 0 else "", end="")
    """))
    check_passed(launch(script_, world, without_common=True, real_exit=False))


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


def test_every_lesson_has_its_check_script_and_paste_check():
    for script in LESSONS:
        assert (HERE / "tests" / f"check_{script[:2]}.py").exists(), f"tests/check_{script[:2]}.py"
        assert script.startswith("10_") or _paste_file(script).exists(), f"tests/paste_{script[:2]}.py"


def test_one_keyword_selects_every_test_of_one_lesson():
    """`-k lessonNN` (conftest.py) collects lesson NN's demo and check script at every world size, its paste check,
    its benchmarks, and no other lesson's file; pytest itself does the selecting for one lesson."""
    from conftest import lesson_of
    collect = [sys.executable, "-m", "pytest", "test_all.py", "--collect-only", "-q", "-n", "0", "-p",
               "no:cacheprovider"]
    (code, out), (code5, out5) = run_cmd([collect, collect + ["-k", "lesson05"]], timeout=120)
    assert code == code5 == 0, out + out5
    ids, picked = ([i.split("::", 1)[1] for i in o.split() if i.startswith("test_all.py::")] for o in (out, out5))
    for script in LESSONS:
        n = script[:2]
        mine = {i for i in ids if lesson_of(i) == f"lesson{n}"}
        want = {f"test_world_size[{f}-{w}]" for f in (script, f"tests/check_{n}.py") for w in WORLD_SIZES}
        want |= {f"test_block_pasted_alone[lesson{n}-{w}]" for w in (2, 4) if n != "10"}
        want |= {f"test_bench_runs_small[{b}]" for b in BENCHES if b.startswith(f"bench/{n}_")}
        assert want <= mine, (script, sorted(want - mine))
        others = [f for f in LESSONS + CHECKS + BENCHES if f[:2] != n and f.split("/")[-1][-5:-3] != n
                  and not f.startswith(f"bench/{n}")]
        assert not [i for i in mine if any(f in i for f in others)], (script, mine)
    assert set(picked) == {i for i in ids if lesson_of(i) == "lesson05"} and len(picked) >= 16, picked


# ---- benchmarks: each once, small, for its arithmetic ----------------------------------------------------
@pytest.mark.parametrize("script", BENCHES)
def test_bench_runs_small(script):
    """Every benchmark the project ships, at 2 ranks with BENCH_SMALL=1 (tiny sizes, a round or two): it checks
    its own results against a reference and its arithmetic (busbw from algbw, the slowest rank's time)."""
    check_passed(launch(script, 2, extra_env={"BENCH_SMALL": "1"}, real_exit=False))


# ---- README's commands, as written there ------------------------------------------------------------------
README_RUN = re.compile(r"^(?:((?:[A-Z_]+=\S+ )*)torchrun (?:--standalone )?--nproc-per-node=(\d+) (\S+\.py)"
                        r"|python (\S+\.py))", re.M)


def readme_commands():
    """Every `torchrun --nproc-per-node=N FILE` and `python FILE` README.md gives, in a code block or in
    backticks: (env, N, FILE)."""
    text = (HERE / "README.md").read_text().replace("`", "\n")
    found = []
    for env, n, script, py in README_RUN.findall(text):
        env = dict(kv.split("=", 1) for kv in env.split())
        found.append((env, int(n) if n else 4, script or py))
    return found


def launched_elsewhere(env, n, script):
    """The test of this file that launches this README command as the test below would (the script, its ranks, its
    settings; test_world_size at 2 ranks also leaves through interpreter shutdown) and checks it passed, or None."""
    if not env and script in LESSONS + CHECKS and n in WORLD_SIZES:
        return f"test_world_size[{script}-{n}]"
    if not env and script in BENCHES and n == 2:
        return f"test_bench_runs_small[{script}]"                  # BENCH_SMALL=1, as below
    if set(env) == {"TRACE"} and n == 2 and script in TRACED:
        return TRACED[script]                                       # TRACE=its tmp_path, as below
    return None


def test_readme_commands_run(tmp_path, request):
    """Each lesson, check script, benchmark and trace command README.md shows runs as written (its world size, its
    settings; benchmarks small), through the fast launcher; 10's scale example is checked in tests/suite_10.py.
    A command whose very launch another selected test makes (05 at 4 ranks is test_world_size's) runs there, once."""
    commands = [c for c in readme_commands() if "hidden=" not in c[2]]
    assert len({c[2] for c in commands}) >= 5, commands
    selected = {item.name for item in request.session.items}
    for env, n, script in commands:
        assert (HERE / script).exists(), script
        if launched_elsewhere(env, n, script) in selected:
            continue
        env = {k: (str(tmp_path) if k == "TRACE" else v) for k, v in env.items()}
        if script.startswith("bench/"):
            env["BENCH_SMALL"] = "1"
        check_passed(launch(script, n, extra_env=env, real_exit=False))


def test_readme_paste_block_runs(tmp_path):
    """README's "Pasting a block into your model", as written, at 2 ranks; on the CPU with gloo in place of its
    GPU lines (set_device dropped, "nccl" -> "gloo", device "cuda" -> "cpu"), then checked against the dense layer."""
    section = (HERE / "README.md").read_text().split("## Pasting a block into your model", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = "\n".join(ln for ln in code.splitlines() if "set_device" not in ln)
    code = code.replace('"nccl"', '"gloo"').replace('device="cuda"', 'device="cpu"')
    script_ = probe(tmp_path, code + textwrap.dedent("""
        x = torch.randn(3, 1024)
        r = dist.get_rank()
        torch.testing.assert_close(layer(x), dense(x)[:, 2048 * r:2048 * (r + 1)])
        dist.destroy_process_group()
        print("[R0] all checks passed: README's paste block" if r == 0 else "", end="")
    """))
    check_passed(launch(script_, 2, without_common=True, real_exit=False))  # the user's script: their timeouts


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
    script_ = probe(tmp_path, """
        import torch, torch.distributed as dist
        from common import finish, setup
        rank, world, device = setup()
        dist.barrier()  # else rank 0 (the store's host) may fail and leave while rank 1 is still joining
        x = torch.ones(2, 3).t()
        dist.all_reduce(x)
        finish("unreachable")
    """)
    run_ = launch(script_, 2, real_exit=False)
    assert all(c == 1 for c in run_.codes), run_.report()
    assert all(re.search(r"dist.all_reduce was handed a non-contiguous tensor .* at probe.py:8$", e, re.M)
               for e in run_.errs), run_.report()


@pytest.mark.parametrize("op, call", [
    ("all_gather", "dist.all_gather([torch.ones(2, 3).t()], torch.ones(3, 2))"),           # a list of outputs
    ("batch_isend_irecv", "dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2, 3).t(), 0)])"),
    ("isend", "dist.isend(torch.ones(2, 3).t(), 0)"),
    ("all_reduce", "dist.all_reduce(torch.ones(2, device='meta'))"),                       # not the lesson's device
])
def test_the_contract_check_covers_every_way_a_tensor_is_handed(tmp_path, op, call):
    script = probe(tmp_path, f"""
        import torch, torch.distributed as dist
        from common import finish, setup
        rank, world, device = setup()
        {call}
        finish("unreachable")
    """)
    run_ = launch(script, 1, real_exit=False)
    assert run_.codes == [1], run_.report()
    assert f"NCCL's contract: dist.{op} was handed a" in run_.errs[0], run_.report()


def test_check_passed_can_fail():
    """A warning, an abort, a crash, a time-out, a failed rank, a last line that is not the summary: each fails."""
    ok = "[R0] all checks passed: x\n"
    check_passed(Run([0, 0], [ok, ""], ["", ""], False, 0.0))
    for bad in (Run([0, 0], [ok, ""], ["", "/x.py:3: UserWarning: y\n"], False, 0.0),
                Run([0, 0], [ok, ""], ["", "terminate called after throwing an instance of 'c10::Error'\n"], False, 0),
                Run([0, 0], [ok, "Segmentation fault (core dumped)\n"], ["", ""], False, 0.0),
                Run([0, 0], [ok, ""], ["", ""], True, 0.0),
                Run([0, 1], [ok, ""], ["", ""], False, 0.0),
                Run([0, 0], [ok + "[R0] more\n", ""], ["", ""], False, 0.0)):
        with pytest.raises(AssertionError):
            check_passed(bad)


@pytest.mark.parametrize("gpus, refused", [(1, False), (0, True)])
def test_nccl_with_one_gpu_per_process_is_not_refused(tmp_path, gpus, refused):
    """CUDA faked to report `gpus` devices (setup() stopped at set_device): 1 process on 1 GPU goes on, on 0 is
    refused. The fake stands in for -m gpu, which no CPU machine runs."""
    script = probe(tmp_path, f"""
        import sys, torch
        torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: {gpus})
        def stop(device):
            print("past the refusal"); sys.exit(0)
        torch.cuda.set_device = stop
        import common
        common.setup()
    """)
    run_ = launch(script, 1, extra_env={"BACKEND": "nccl"}, real_exit=False)
    if refused:
        assert run_.codes == [2] and "NCCL needs one CUDA device per process" in run_.errs[0], run_.report()
    else:
        assert run_.codes == [0] and "past the refusal" in run_.outs[0], run_.report()


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
TORCHRUN_LESSONS = [f for f in LESSONS if f.startswith("09_")]  # buckets, hooks, async work in flight at exit


def _without_torchrun_env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}


@pytest.mark.slow
@pytest.mark.parametrize("script", TORCHRUN_LESSONS)
def test_torchrun(script):
    """A lesson under the real torchrun (2 processes, for the suite's time): fresh processes, with imports,
    warnings and exits as a user sees them. Started as `python FILE` with NPROC=2, which runs FILE under torchrun
    itself (its first line says so; one launch proves both, for the suite's time). For the suite's time one lesson
    here; the 2-node test runs 05, the refusal 04, and `TORCHRUN_ALL=1` runs every other lesson too."""
    [(code, out)] = run_cmd([[sys.executable, script]], env={**_without_torchrun_env(), "NPROC": "2"})
    assert "torchrun --standalone --nproc-per-node=2" in out.splitlines()[0], out
    check_torchrun(code, "\n".join(out.splitlines()[1:]))


@pytest.mark.slow
@pytest.mark.parametrize("script", [f for f in LESSONS if f not in TORCHRUN_LESSONS])
def test_torchrun_all(script):
    if os.environ.get("TORCHRUN_ALL") != "1":
        pytest.skip("TORCHRUN_ALL=1 runs every lesson under torchrun --nproc-per-node=4")
    [(code, out)] = run_cmd([torchrun() + ["--nproc-per-node=4", "--standalone", script]])
    check_torchrun(code, out)


@pytest.mark.slow
def test_refusal_under_torchrun_is_said_by_every_rank():
    """torchrun kills the other ranks when one exits: refuse() waits until every rank has said why."""
    refusing = [f for f in LESSONS if f.startswith("04_")]
    if not refusing:
        pytest.skip("04 is the lesson that refuses 3 ranks")
    [(code, out)] = run_cmd([torchrun() + ["--nproc-per-node=3", "--standalone", refusing[0]]])
    assert code != 0 and {int(r) for r in REFUSED.findall(out)} == {0, 1, 2}, out


def test_a_late_rank_still_says_its_refusal(tmp_path):
    """refuse() after setup() on the first rank waits for a rank that comes 3 s later, so torchrun does not kill it
    unheard: the fast launcher kills the other ranks 0.1 s after the first one exits, as torchrun's agent does (its
    --monitor-interval); torchrun itself kills them in the refusal test above."""
    script_ = probe(tmp_path, """
        import os, time
        import common
        common.setup()                                                # a refusal after the group exists
        if os.environ["RANK"] == "1":
            time.sleep(3)
        common.refuse("a probe that refuses")
    """)
    run_ = launch(script_, 2, deadline=60, real_exit=False, grace=0.1)
    assert not run_.timed_out and run_.codes[0] == 2, run_.report()
    assert {int(r) for e in run_.errs for r in REFUSED.findall(e)} == {0, 1}, run_.report()


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
    cmd = torchrun() + ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                         f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=two-nodes-{port}", uses_groups[0]]
    results = run_cmd([cmd, cmd])
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
    [(code, out)] = run_cmd([torchrun() + [f"--nproc-per-node={n}", "--standalone", script]],
                             env={"BACKEND": "nccl"})
    check_torchrun(code, out)


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
TRACED = {"08_pipeline_1f1b.py": "test_trace_of_08_shows_every_op_of_each_schedule_in_order",
          "09_ddp_zero2.py": "test_trace_of_09_shows_all_reduces_under_backward"}  # traced(script, tmp_path) at 2


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
    backward: a backward op runs while the all-reduce does (their spans overlap), on the same rank (the gloo thread
    may begin it after the main thread began its next op)."""
    events, _ = traced("09_ddp_zero2.py", tmp_path)
    for rank in (0, 1):
        backward = spans(events, rank, r"\w+Backward0", "main thread")
        main = {e["tid"] for e in backward}  # gloo's worker threads are the others (named pt_gloo_runloop on 2.13)
        reduces = [e for e in spans(events, rank, r"gloo:all_reduce") if e["tid"] not in main]
        assert reduces and backward, rank
        under = [(a["ts"], b["name"]) for a in reduces for b in backward
                 if b["ts"] < a["ts"] + a["dur"] and a["ts"] < b["ts"] + b["dur"]]
        assert under, f"rank {rank}: no backward op ran while an all-reduce was in flight"


def test_trace_merge_puts_ranks_with_different_clocks_on_one_timeline():
    """tools/trace.merge, in one process, on two ranks' traces whose profiler clocks started 2 ms apart (as on two
    machines; on one machine the shift is always 0): rank 1's event at 5 us of its own clock lands at 2005 us of
    rank 0's; each rank is one process row; flow ids stay apart; the main thread's lane is named."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_trace_probe", HERE / "tools" / "trace.py")
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    def one(base, pid):
        return {"baseTimeNanoseconds": base, "traceEvents": [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": "python"}},
            {"ph": "M", "pid": pid, "tid": pid, "name": "thread_name", "args": {"name": "python"}},
            {"ph": "X", "pid": pid, "tid": pid, "ts": 5.0, "dur": 1.0, "name": "op"},
            {"ph": "s", "pid": pid, "tid": pid, "ts": 5.0, "id": 7, "name": "flow"}]}
    bases = [3_000_000, 1_000_000]                      # rank 0's clock started 2 ms after rank 1's
    merged = [trace.merge(r, one(bases[r], 100 + r), bases, 100 + r) for r in (0, 1)]
    for r, events in enumerate(merged):
        op = next(e for e in events if e.get("name") == "op")
        assert op["pid"] == r and op["ts"] == 5.0 + (2000.0 if r == 0 else 0.0), (r, op)
        assert next(e for e in events if e.get("name") == "flow")["id"] == 7 + (r << 32)
        assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} == {f"rank {r}"}
        assert [e["args"]["name"] for e in events if e.get("name") == "thread_name"] == ["main thread"]


def test_trace_merge_shifts_every_event_and_keeps_every_name():
    """Every timed event shifted (flows and instants too), every flow id (s, t, f) made unique, the sort index the
    rank, a thread named twice keeps its last name."""
    spec = importlib.util.spec_from_file_location("_trace_probe", HERE / "tools" / "trace.py")
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)

    def one(base, pid):
        return {"baseTimeNanoseconds": base, "traceEvents": [
            {"ph": "M", "pid": pid, "tid": pid, "name": "thread_name", "args": {"name": "python"}},
            {"ph": "M", "pid": pid, "tid": 7, "name": "thread_name", "args": {"name": "old"}},
            {"ph": "M", "pid": pid, "tid": 7, "name": "thread_name", "args": {"name": "pt_gloo_runloop"}},
            {"ph": "X", "pid": pid, "tid": pid, "ts": 5.0, "dur": 1.0, "name": "op"},
            {"ph": "s", "pid": pid, "tid": pid, "ts": 5.0, "id": 7, "name": "flow"},
            {"ph": "t", "pid": pid, "tid": 7, "ts": 5.5, "id": 7, "name": "flow"},
            {"ph": "f", "pid": pid, "tid": 7, "ts": 6.0, "id": 7, "name": "flow", "bp": "e"},
            {"ph": "i", "pid": pid, "tid": pid, "ts": 6.5, "name": "mark", "s": "t"}]}
    bases = [3_000_000, 1_000_000]
    for r in (0, 1):
        raw = one(bases[r], 100 + r)
        events = trace.merge(r, raw, bases, 100 + r)
        shift = 2000.0 if r == 0 else 0.0
        timed_in = [e for e in raw["traceEvents"] if "ts" in e]
        timed_out = [e for e in events if "ts" in e]
        assert [e["ts"] for e in timed_out] == [e["ts"] + shift for e in timed_in], (r, timed_out)  # every event
        assert [e["id"] for e in events if e.get("ph") in ("s", "t", "f")] == [7 + (r << 32)] * 3
        assert [e["args"]["sort_index"] for e in events if e.get("name") == "process_sort_index"] == [r]
        names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert names == {100 + r: "main thread", 7: "pt_gloo_runloop"}, names       # the last name of a tid


def test_ring_bytes_are_nccl_tests_bus_factors():
    """common.ring_bytes(op, 1, W) is the bus-bandwidth factor nccl-tests' doc/PERFORMANCE.md gives for each op
    (bench/03_bandwidth.py multiplies algbw by it): all_reduce 2(n-1)/n, reduce_scatter, all_gather and
    all_to_all (n-1)/n, broadcast 1."""
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
    """tests/tools.py's instruments in one process, on tensors whose bytes are known: held_bytes counts a storage once
    (views too) and a resized-to-0 one as 0; memory() counts what is allocated inside and still held, not an
    in-place op on an older tensor, its peak, reset() and track() of a storage that grows; kept_for_backward leaves
    parameters out and adds `inputs`; replays finds a deadlock and matches tags."""
    from tests import tools
    import torch
    import torch.nn.functional as F
    x = torch.zeros(10)                                              # 40 B
    assert tools.held_bytes([x, x[2:], x.view(2, 5), torch.zeros(3, dtype=torch.float64)]) == 40 + 24
    gone = torch.zeros(4)
    gone.untyped_storage().resize_(0)
    assert tools.held_bytes([gone, x]) == 40
    with tools.memory() as m:
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
    _, kept = tools.kept_for_backward(lambda: F.linear(x, w), [w])  # saves x and w: w is a parameter
    assert kept == x.nbytes, kept
    _, kept = tools.kept_for_backward(lambda: w * 2, [], inputs=(x,))  # saves nothing; x counted as asked
    assert kept == x.nbytes, kept
    assert tools.replays([[("send", 1, "a"), ("send", 1, "b")], [("recv", 0, "a"), ("recv", 0, "b")]])
    assert not tools.replays([[("send", 1, "a")], [("recv", 0, "b")]])        # tags differ
    assert not tools.replays([[("send", 1), ("recv", 1)], [("send", 0), ("recv", 0)]])  # both send first
    assert not tools.replays([[("send", 1)], [("recv", 0)], [("send", 0)]])  # rank 2's send never received


@pytest.mark.timeout(60)
def test_refused_wants_one_line_before_any_message():
    """tests.tools.refused: the message of the error asked for; an accepted call, another error, a message of two lines
    or a refusal that sent first all fail (the last on a 1-rank gloo group made in this process)."""
    from tests import tools
    import torch
    import torch.distributed as dist
    assert tools.refused(lambda: int("x")) == "invalid literal for int() with base 10: 'x'"
    assert tools.refused(lambda: [][0], IndexError) == "list index out of range"
    def two_lines():
        raise ValueError("one\ntwo")
    for call in (lambda: None, two_lines):
        with pytest.raises(AssertionError):
            tools.refused(call)
    with pytest.raises(KeyError):
        tools.refused(lambda: {}["k"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def sends_then_refuses():
            dist.all_reduce(torch.ones(1))
            raise ValueError("too late")
        with pytest.raises(AssertionError):
            tools.refused(sends_then_refuses)
    finally:
        dist.destroy_process_group()


def test_two_stuck_ranks_are_both_named(tmp_path):
    """A rank that never arrives is named by the others (monitored_barrier), within the timeout, not a hang; and the
    barrier at the end waits for every rank it can, naming all that never came, not only the first."""
    script_ = probe(tmp_path, """
        import time
        from common import finish, setup
        rank, world, device = setup()
        if rank in (1, 3):
            time.sleep(30)
        finish("unreachable")
    """)
    # 2 s, not 1: the timeout also bounds joining the group, which a loaded machine can slow down
    run_ = launch(script_, 4, extra_env={"PG_TIMEOUT": "2"}, deadline=60, real_exit=False, grace=2)
    assert not run_.timed_out and run_.codes[0] not in (0, None), run_.report()
    assert re.search(r"Ranks 1, 3 failed to pass monitoredBarrier", run_.errs[0]), run_.report()


def test_a_sub_group_times_out_like_the_world(tmp_path):
    """A collective on a group a demo makes (common.strided_groups, or new_group with common.pg_timeout()) that a
    rank never joins fails within PG_TIMEOUT, as on the world group; dist.new_group's own default is 30 min."""
    script_ = probe(tmp_path, """
        import time, torch, torch.distributed as dist
        from common import setup
        from tests.tools import strided_groups
        rank, world, device = setup()
        [(group, ranks)] = strided_groups(1)               # every rank, in a group of its own making
        if rank == 1:
            time.sleep(30)
        dist.all_reduce(torch.ones(1), group=group)
    """)
    run_ = launch(script_, 2, extra_env={"PG_TIMEOUT": "1"}, deadline=60, real_exit=False, grace=1)
    assert not run_.timed_out and run_.codes[0] == 1 and run_.seconds < 15, run_.report()
    assert re.search(r"[Tt]imed out", run_.errs[0]), run_.report()


def test_every_group_made_gets_pg_timeout(tmp_path):
    """The launcher requires every dist.new_group a lesson, check script or block makes to be given
    timeout=PG_TIMEOUT (so the test above holds for each of them, not only for strided_groups): one made without
    it, or with another, fails the run naming the line."""
    code = """
        import datetime, torch.distributed as dist
        from common import setup
        rank, world, device = setup()
        dist.barrier()
        dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))   # PG_TIMEOUT's default: accepted
        dist.barrier()  # rank 0 hosts the store: it must not leave while rank 1 is still joining that group
        dist.new_group([0, 1]{})
    """
    for extra in ("", ", timeout=datetime.timedelta(seconds=31)"):
        run_ = launch(probe(tmp_path, code.format(extra)), 2, real_exit=False)
        assert all(c == 1 for c in run_.codes), run_.report()
        assert all(re.search(r"dist.new_group at probe.py:9 was given timeout=.*, not PG_TIMEOUT's", e)
                   for e in run_.errs), run_.report()


def test_bad_nproc_is_one_line(tmp_path):
    """`python FILE` with an NPROC that is not a number of processes >= 1: one line naming it, exit 2, no torchrun
    (empty means the default, 4, as for BACKEND and PG_TIMEOUT). Run in one forked process, torchrun's variables
    removed, the relaunch (os.execv) recorded instead of run."""
    script_ = probe(tmp_path, """
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
    run_ = launch(script_, 1, real_exit=False)
    refused = [f"01_p2p.py: NPROC={v!r} is not a number of processes (a whole number >= 1)"
               for v in ["0", "-1", "two", "1.5"]]
    assert run_.codes == [0] and run_.errs[0].splitlines() == refused, run_.report()
    out = [ln for ln in run_.outs[0].splitlines() if not ln.startswith("not started by torchrun")]
    assert out == ["exit 2"] * 4 + ["execv -m torch.distributed.run --standalone --nproc-per-node=4",
                                    "execv -m torch.distributed.run --standalone --nproc-per-node=2"], run_.report()


def test_log_all_on_a_sub_group(tmp_path):
    """log_all(msg, group): each group's first rank prints its members' lines in group-rank order; no one else."""
    script_ = probe(tmp_path, """
        import torch.distributed as dist
        from common import finish, log_all, pg_timeout, setup
        rank, world, device = setup()
        groups = [dist.new_group([0, 2], timeout=pg_timeout()), dist.new_group([1, 3], timeout=pg_timeout())]
        log_all(f"parity {rank % 2}", group=groups[rank % 2])
        finish("log_all on sub-groups")
    """)
    run_ = launch(script_, 4, real_exit=False)
    check_passed(run_)
    assert run_.outs[0].splitlines()[:2] == ["[R0] parity 0", "[R2] parity 0"], run_.report()
    assert run_.outs[1] == "[R1] parity 1\n[R3] parity 1\n", run_.report()
    assert run_.outs[2] == run_.outs[3] == "", run_.report()


@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_bad_trace_directory_is_one_line_on_every_rank(tmp_path, where):
    (tmp_path / "file").write_text("")
    run_ = launch(LESSONS[0], 2, extra_env={"TRACE": str(tmp_path / where)}, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and "TRACE=" in e for e in run_.errs), run_.report()


