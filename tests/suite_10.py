"""10's runs that need settings: refused values (the lesson's ZERO and TIED, the check script's GRID, the scale
calculator's key=value pairs) and README's scale example. Other grids, middle stages and ZeRO-3 are trained by
tests/check_10.py at every world size."""
import pytest

from tests.launch import HERE, REFUSED, check_passed, launch

TEN, CHECK, SCALE = "10_3d_parallel.py", "tests/check_10.py", "bench/10_scale.py"


@pytest.mark.parametrize("script, env, named", [
    (SCALE, {"SCALE": "tp=0"}, "tp=0"), (SCALE, {"SCALE": "pp=0"}, "pp=0"), (SCALE, {"SCALE": "pp=3"}, "pp=3"),
    (SCALE, {"SCALE": "bucket_mb=0"}, "bucket_mb=0"), (SCALE, {"SCALE": "nvlink_GBps=0"}, "nvlink_GBps=0"),
    (SCALE, {"SCALE": "m=0"}, "m=0"), (SCALE, {"SCALE": "hidden=4096.7"}, "hidden=4096.7"),
    (SCALE, {"SCALE": "tp=3"}, "tp=3"), (SCALE, {"SCALE": "tied=2"}, "tied=2"),
    (SCALE, {"SCALE": "hidden=4096 layers=32 ... tp=8 pp=4 dp=8"}, "'...'"), (SCALE, {"ZERO": "1"}, "ZERO='1'"),
    (SCALE, {"GPUS": "0"}, "GPUS='0'"), (SCALE, {"GPUS": "2.5"}, "GPUS='2.5'"), (SCALE, {"GPU_GB": "0"}, "GPU_GB='0'"),
    (SCALE, {"GPU_GB": "-8"}, "GPU_GB='-8'"), (SCALE, {"GPU_GB": "fast"}, "GPU_GB='fast'"),
    (CHECK, {"GRID": "-2x-1x1"}, "GRID='-2x-1x1'"), (CHECK, {"GRID": "1x1x3"}, "GRID=1x1x3"),
    (TEN, {"ZERO": "4"}, "ZERO='4'"), (TEN, {"TIED": "2"}, "TIED='2'")])
def test_10_bad_input_is_one_line_on_every_rank(script, env, named):
    """A bad setting (SCALE= reads the same key=value pairs as the command line): every rank says in one line which
    value and what would fit, exit 2, within seconds, before any work."""
    run_ = launch(script, 2, extra_env=env, real_exit=False)
    assert run_.codes == [2, 2] and run_.seconds < 10, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and REFUSED.match(e) and named in e for e in run_.errs), run_.report()
    assert not any(run_.outs), run_.report()                       # refused before any work: nothing printed


def test_10_settings_that_fit_run():
    """The last values that fit pass: the lesson untied on ZeRO-3, the check script on a grid of one's choice."""
    check_passed(launch(TEN, 2, extra_env={"ZERO": "3", "TIED": "0"}, real_exit=False))
    run_ = launch(CHECK, 2, extra_env={"GRID": "1x2x1"}, real_exit=False)
    check_passed(run_)
    assert "dp 1 x pp 2 x tp 1, ZeRO-2, tied head, float64" in run_.outs[0], run_.report()


def test_10_readme_example_sets_the_scale_tables():
    """README's command line for 10's scale tables, as written there, is accepted and the tables follow its values."""
    line = next(ln for ln in (HERE / "README.md").read_text().splitlines() if f"{SCALE} hidden=" in ln)
    args = line.split(SCALE, 1)[1].split("`")[0].split()
    run_ = launch(SCALE, 1, extra_env={"SCALE": " ".join(args)}, real_exit=False)
    check_passed(run_)
    shown = {"hidden": "hidden {}", "layers": "{} layers", "seq": "seq {}", "vocab": "vocab {}", "dp": "dp {}",
             "pp": "pp {}", "tp": "tp {}", "m": "{} micro-batches", "ffn": "ffn {}"}
    for key, value in (arg.split("=") for arg in args):              # each value shows in the tables' head
        assert key not in shown or shown[key].format(value) in run_.outs[0], (key, value, run_.outs[0])
    assert "Llama 3 70B: published 70.6B" in run_.outs[0], run_.outs[0]   # README calls it Llama 3 70B


def test_10_scale_names_the_grid_that_fits_the_gpus():
    """GPUS=512: for each 5D model the listed grids are 512 ranks (dp pp cp tp, ep dividing dp cp), hold at most
    GPU_GB, fastest first, and the first is named; GPU_GB=0.5 (less than any grid holds): none fits, said so."""
    import re
    grid = re.compile(r"dp (\d+) x pp (\d+) x cp (\d+) x tp (\d+), ep (\d+) +([\d.]+) s of traffic a step +([\d.]+) "
                      r"GB held")
    for gb, fitting in (("80", True), ("0.5", False)):
        run_ = launch(SCALE, 1, extra_env={"GPUS": "512", "GPU_GB": gb}, real_exit=False)
        check_passed(run_)
        tables = run_.outs[0].split("== 5D on 512 GPUs")[1:]
        assert len(tables) == 2, run_.outs[0]
        for table in tables:
            rows = [tuple(map(float, m.groups())) for m in grid.finditer(table)]
            assert rows and all(dp * pp * cp * tp == 512 and dp * cp % ep == 0 for dp, pp, cp, tp, ep, _, _ in rows)
            assert all((held <= float(gb)) == fitting for *_, held in rows), table
            assert [r[5] for r in rows] == sorted(r[5] for r in rows), table      # the fewest seconds first
            said = f"fits 512 GPUs best: {grid.search(table).group(0).split('  ')[0]}" if fitting else \
                f"no grid of 512 GPUs fits {gb} GB"
            assert said in table, (said, table)
