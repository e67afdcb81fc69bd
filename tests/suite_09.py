"""09's tests that need several launches: a resume in new processes, and README's training script as written."""
import textwrap

import pytest

from tests.launch import HERE, check_passed, launch, probe


def test_09_resumes_in_new_processes(tmp_path):
    """tests/check_09.py with CKPT_PHASE=save trains DDP, ZeRO-2 and ZeRO-3 two steps on the world and on sub-groups
    at 4 ranks and saves (the model's state_dict by group rank 0 after every rank gathered it, every rank its
    optimizer.state_dict()); new processes with CKPT_PHASE=load load it and train steps 3-4 bit-equal to the run that
    went on; 2 ranks are refused on every rank in one line."""
    ckpt = {"CKPT": str(tmp_path)}
    check_passed(launch("tests/check_09.py", 4, {**ckpt, "CKPT_PHASE": "save"}, real_exit=False))
    saved = sorted(f.name for f in tmp_path.glob("*.pt"))
    assert len(saved) == 1 + 3 * (1 + 4 + 2 * (1 + 2)), saved  # W; per wrapper: world and 2 sub-groups' files
    run_ = launch("tests/check_09.py", 4, {**ckpt, "CKPT_PHASE": "load"}, real_exit=False)
    check_passed(run_)
    assert "steps 3-4 bit-equal" in run_.outs[0], run_.report()
    run_ = launch("tests/check_09.py", 2, {**ckpt, "CKPT_PHASE": "load"}, real_exit=False)
    assert run_.codes == [2, 2] and not run_.timed_out, run_.report()
    assert all(len(e.strip().splitlines()) == 1 and "saved at 4 ranks, this run has 2" in e for e in run_.errs), \
        run_.report()


@pytest.mark.parametrize("wrapper", ["ZeRO3", "ZeRO2", "DDP"])
def test_09_readme_training_script_runs(tmp_path, wrapper):
    """README's "Using 09 in your training script" block at 2 ranks, as written (ZeRO-3) and with DDP or ZeRO-2 in
    its place: it trains, saves under `if master_process:` (every rank gathered first) and each rank its optimizer's
    state, resumes and asserts the resume bit-equal."""
    section = (HERE / "README.md").read_text().split("### Using 09 in your training script", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert code.count("ZeRO3") >= 2, "the block is written for ZeRO3"
    code = code.replace("ZeRO3", wrapper)
    script = probe(tmp_path, code + textwrap.dedent("""
        dist.destroy_process_group()
        print("[R0] all checks passed: README's training script" if rank == 0 else "", end="")
    """))
    check_passed(launch(script, 2, {"CKPT": str(tmp_path / "ckpt")}, real_exit=False))
    assert (tmp_path / "ckpt" / "optim.1.pt").exists() and (tmp_path / "ckpt" / "model.pt").exists()
