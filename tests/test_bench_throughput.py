"""`bench/throughput.py` on a CPU: each contestant trains in a process of its own, taking turns, and reports the page
faults and system time of its timed steps beside its step times (bench/README.md, "Page faults")."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import throughput  # noqa: E402


@pytest.fixture
def keep_torch_threads():
    threads = torch.get_num_threads()  # main() sets the process's thread count
    yield
    torch.set_num_threads(threads)


def test_each_contestant_runs_in_its_own_process_and_reports_its_faults(tmp_path, capsys, keep_torch_threads):
    out = tmp_path / "tp.json"
    argv = ["--archs", "llama", "--sizes", "5M", "--dtypes", "fp32", "--impls", "ours,hf", "--rounds", "2",
            "--steps", "1", "--warmup", "1", "--rewarm", "0", "--no-memory", "--threads", "1", "--out", str(out)]
    assert throughput.main(argv) == 0
    payload = json.loads(out.read_text())
    (rec,) = payload["records"]
    assert payload["complete"] is True
    assert rec["protocol"]["processes"] == "one per contestant"
    assert rec["params_match"] and rec["weights_copied_from_hf"]
    assert rec["equivalence_fp32"]["max_abs_logit_diff"] < 1e-4  # checked in this process before the contestants start
    for impl in ("ours", "hf"):
        c = rec["contestants"][impl]
        assert len(c["step_times_s"]) == 2 and c["tok_s"] > 0
        assert c["minor_faults_per_step"] >= 0 and c["system_s_per_step"] >= 0
    assert len(rec["throughput_ratios"]["ours/hf"]["per_round"]) == 2
    assert "round 2:" in capsys.readouterr().out


def test_a_contestant_that_dies_is_named():
    args = throughput.argparse.Namespace(threads=1, optimizer="fused", malloc="reuse", warmup=1, rewarm=0,
                                         compile=False)
    with pytest.raises(RuntimeError, match="contestant ours exited with code 1"):
        throughput.ContestantProcess("ours", "llama", "1T", "fp32", args)  # no such size: it dies building


def test_a_run_stopped_midway_keeps_the_cells_it_measured(tmp_path, monkeypatch, keep_torch_threads):
    """A lease's time limit can stop the benchmark between cells: the record on disk then holds every finished
    cell and says it is not complete."""
    class Stopped(BaseException):
        pass

    def measure(arch, size, dtype, args, gemm):
        if size == "20M":
            raise Stopped
        return {"arch": arch, "size": size, "dtype": dtype}

    monkeypatch.setattr(throughput, "measure", measure)
    monkeypatch.setattr(throughput, "machine_gemm", lambda dtypes, device: {"fp32": {64: 1.0}, "bf16": {64: 1.0}})
    out = tmp_path / "tp.json"
    with pytest.raises(Stopped):
        throughput.main(["--archs", "llama", "--sizes", "5M,20M", "--dtypes", "fp32", "--threads", "1",
                         "--out", str(out)])
    payload = json.loads(out.read_text())
    assert payload["complete"] is False
    assert [(r["size"], r["dtype"]) for r in payload["records"]] == [("5M", "fp32")]


def test_a_ratio_in_the_table_carries_the_range_of_its_rounds():
    """A cell's per-round ratios spread by up to 2x on a busy machine (1.21 / 1.73 / 2.32): the median alone
    read as if it were precise."""
    assert throughput._ratio_text({"median_of_rounds": 1.73, "per_round": [1.21, 1.73, 2.32]}) == "1.73x (1.21-2.32)"
    assert throughput._ratio_text({"median_of_rounds": 1.1, "per_round": [1.1]}) == "1.10x"
