"""`gyre bench gpu` on the CPU (`--device cpu`): the very code a GPU session runs, with the fp32 parity asserted for
real; each part's bound and the budget hold, and a part that outlives its bound does not stop the parts after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.benchmarks.gpu import FP32_ATOL, PARTS, run_bench, summary_lines


def test_the_check_runs_on_the_cpu_and_fp32_parity_holds(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "gyre.benchmarks.gpu", "--device", "cpu", "--json", "--out", str(out),
         "--parts", "parity:tiny-tied,transfer", "--repeats", "1"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report == json.loads((out / "gpu_report.json").read_text())
    assert (out / "gpu_child_stderr.log").is_file()
    assert report["ok"] and report["device"] == "cpu" and list(report["parts"]) == ["parity:tiny-tied", "transfer"]
    parity = report["parts"]["parity:tiny-tied"]
    assert parity["fp32_max_abs_diff"] < FP32_ATOL  # the trainer against transformers on the same directory
    assert parity["reference_logprob_std"] > 0.3  # not near-uniform: the comparison means something
    # bf16 is reported with its own bound: twice transformers' own bf16 error, plus 0.01.
    assert 0 < parity["bf16_max_abs_diff"] <= 2 * parity["transformers_bf16_max_abs_diff"] + 0.01
    assert all(parity[f"{who}_{p}_tokens_per_s"] > 0 for who in ("trainer", "transformers") for p in ("fp32", "bf16"))
    transfer = report["parts"]["transfer"]
    assert (transfer["auto"]["path"], transfer["stage"]["path"]) == ("in place", "staged")
    assert transfer["stage"]["chunks_staged"] >= 1 and transfer["auto"]["gb_per_s"] > 0
    assert "all passed" in done.stderr and "fp32 trainer vs transformers" in done.stderr


def test_a_part_past_its_bound_is_cut_and_the_next_part_still_runs() -> None:
    pytest.importorskip("mooncake.engine")
    # The environment part imports megatron-core (seconds): a bound of a fraction of one cuts it; the transfer part
    # runs after it in a fresh child process.
    report = run_bench("cpu", ("environment", "transfer"), bounds={"environment": 0.3}, repeats=1)
    environment, transfer = report["parts"]["environment"], report["parts"]["transfer"]
    assert not environment["ok"] and "timed out" in environment["error"] and "bound 0 s" in environment["error"]
    assert transfer["ok"] and not report["ok"]
    assert any(line.startswith("FAIL environment") for line in summary_lines(report))


def test_nothing_starts_past_the_budget_and_unknown_parts_are_refused() -> None:
    report = run_bench("cpu", PARTS, budget_s=0.0)
    assert not report["ok"] and all(p["skipped"] and "budget" in p["error"] for p in report["parts"].values())
    with pytest.raises(ValueError, match="unknown parts"):
        run_bench("cpu", ("parity:small",))


@pytest.mark.slow
def test_the_other_parts_pass_on_the_cpu() -> None:
    report = run_bench("cpu", ("environment", "parity:tiny-moe", "train_step", "engine"), repeats=1)
    assert report["ok"], summary_lines(report)
    assert report["parts"]["environment"]["megatron-core"]
    assert report["parts"]["parity:tiny-moe"]["fp32_max_abs_diff"] < FP32_ATOL
    train = report["parts"]["train_step"]
    assert train["fp32"]["model_param_dtypes"] == ["torch.float32"] and train["fp32"]["version"] == 3
    assert train["bf16"]["master_dtype"] == "torch.float32" and train["bf16"]["model_param_dtypes"] == ["torch.bfloat16"]
    assert train["update_cosine_bf16_vs_fp32"] >= 0.9
    engine = report["parts"]["engine"]
    assert engine["engine_device"] == "cpu" and engine["prompt_logprobs_max_abs_diff"] < FP32_ATOL
