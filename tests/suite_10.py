"""10's runs that need settings: grids with middle stages and ZeRO-3, refused command-line values, README's example."""
import pytest

from tests.launch import HERE, REFUSED, check_passed, launch

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


