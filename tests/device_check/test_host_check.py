"""One self-test per host, remembered (pretrain/device_check/host_check.py, settle.py): the kernel stage and the
compiled layer's run in one child process, the verdict is cached in the run folder, and a restart reads it instead
of testing again; a changed key (the dtype, the code's version) tests again; a child that cannot open the device
("busy or unavailable": a GPU in exclusive-process mode) is answered by testing in the rank. Before, every launch and
every restart paid one child per stage and kept nothing. On the CPU, with the CPU reference kernel as the device's;
`in_child=True` gives the CPU the child a GPU gets (two real spawns in this file, the rest in this process)."""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import torch

from pretrain.device_check.compiled_check import compiled_self_test
from pretrain.device_check.host_check import HostCheck, Stage, run_check
from pretrain.device_check.run_shape import RunShape
from pretrain.device_check.settle import DeviceChecks, settle_attention
from pretrain.device_check.unpadded_check import kernel_self_test
from pretrain.device_check.verdict import SelfTestResult
from pretrain.plan.run_plan import RunPlan
from pretrain.run_folder import device_check_path
from tests.device_check.test_unpadded_check import raising
from tests.support.attention_plans import Place, run_plan_stub

CPU = torch.device("cpu")
ME = Place()


def recorded_kernel_test(device: torch.device, precision: str, head_dim: int, seq_len: int, shape: RunShape | None,
                         record: str) -> SelfTestResult:
    """The real kernel test, which first notes the process it runs in (module-level: a child imports it)."""
    with open(record, "a", encoding="utf-8") as handle:
        handle.write(f"kernel {os.getpid()}\n")
    return kernel_self_test(device, precision, head_dim, seq_len, shape)


def recorded_compiled_test(device: torch.device, precision: str, head_dim: int, seq_len: int,
                           shape: RunShape | None, record: str) -> SelfTestResult:
    """The real compiled-layer test (a backend with no code generation), which first notes its process."""
    with open(record, "a", encoding="utf-8") as handle:
        handle.write(f"compiled {os.getpid()}\n")
    return compiled_self_test(device, precision, head_dim, seq_len, shape, backend="eager")


def busy_in_a_child(device: torch.device, precision: str, head_dim: int, seq_len: int,
                    shape: RunShape | None) -> SelfTestResult:
    """What a child meets on a GPU in exclusive-process mode that its rank holds: torch's error at the first CUDA
    call; in the rank itself the test runs."""
    if multiprocessing.parent_process() is not None:
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable\nCUDA kernel errors might be "
                           "asynchronously reported at some other API call")
    return kernel_self_test(device, precision, head_dim, seq_len, shape)


def run_plan_in(run_dir: Path, compile: bool = False, precision: str = "fp32") -> RunPlan:
    """The tests' run plan, with a run folder (the cache's home), compiled layers and a dtype as asked."""
    plan = run_plan_stub("auto")
    phases = {name: dataclasses.replace(p, precision=precision,
                                        attention=dataclasses.replace(p.attention, compile=compile))
              for name, p in plan.phases.items()}
    return dataclasses.replace(plan, job=SimpleNamespace(run_dir=run_dir), phases=phases)  # type: ignore[arg-type]


def why(plan: RunPlan) -> str:
    return plan.resolved["resolved"]["attention"]["phase1"]["why"]


def test_one_child_tests_both_stages_and_a_restart_reads_the_verdict(tmp_path: Path) -> None:
    record = tmp_path / "processes.txt"
    checks = DeviceChecks(test=functools.partial(recorded_kernel_test, record=str(record)),
                          compiled_test=functools.partial(recorded_compiled_test, record=str(record)), in_child=True)
    first = settle_attention(run_plan_in(tmp_path / "run", compile=True), ME, checks)
    lines = record.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["kernel", "compiled"]
    assert len({line.split()[1] for line in lines}) == 1 and str(os.getpid()) not in record.read_text()  # one child
    assert all(p.attention.unpadded and p.attention.compile for p in first.phases.values()), why(first)
    assert "; self-test passed (1 host): cpu fp32: kernel error " in why(first)  # the verdict came back whole
    cached = json.loads(device_check_path(tmp_path / "run", socket.gethostname()).read_text())
    assert cached["kernel"]["passed"] and cached["compiled"]["passed"] and cached["key"]["kernel"]["precision"] == "fp32"

    restarted = settle_attention(run_plan_in(tmp_path / "run", compile=True), ME, checks)
    assert record.read_text().splitlines() == lines  # no child, no test: the run folder's verdict
    assert all(p.attention.unpadded and p.attention.compile for p in restarted.phases.values())
    assert why(restarted) == why(first).replace("(1 host)", "(1 host, all from the run folder's cache)")


def test_a_changed_key_or_an_untrusted_file_tests_again(tmp_path: Path) -> None:
    runs: list[str] = []
    verdicts: dict[str, SelfTestResult] = {}  # the real test's verdict per dtype, computed once (CI's time)

    def counted(device: torch.device, precision: str, head_dim: int, seq_len: int,
                shape: RunShape | None) -> SelfTestResult:
        runs.append(precision)
        if precision not in verdicts:
            verdicts[precision] = kernel_self_test(device, precision, head_dim, seq_len, shape)
        return verdicts[precision]

    checks, run_dir = DeviceChecks(test=counted), tmp_path / "run"
    settle_attention(run_plan_in(run_dir), ME, checks)
    settle_attention(run_plan_in(run_dir), ME, checks)
    assert runs == ["fp32"]  # tested once; the restart read it
    settle_attention(run_plan_in(run_dir, precision="bf16"), ME, checks)
    assert runs == ["fp32", "bf16"]  # another dtype: another verdict
    path = device_check_path(run_dir, socket.gethostname())
    record = json.loads(path.read_text())
    record["key"]["code"] = "0" * 16  # the verdict of an older version of the tests or the kernel
    path.write_text(json.dumps(record))
    settle_attention(run_plan_in(run_dir, precision="bf16"), ME, checks)
    assert runs == ["fp32", "bf16", "bf16"]
    path.chmod(0o664)  # group-writable: anyone in the group could have written "passed"
    settle_attention(run_plan_in(run_dir, precision="bf16"), ME, checks)
    assert runs == ["fp32", "bf16", "bf16", "bf16"]
    path.unlink()  # how a user forces a re-check
    settle_attention(run_plan_in(run_dir, precision="bf16"), ME, checks)
    assert len(runs) == 5 and path.exists()

    unfinished = DeviceChecks(test=functools.partial(kernel_self_test, kernel=raising))
    for _ in range(2):  # a test that could not finish is not kept: the next launch tests again
        settle_attention(run_plan_in(tmp_path / "other"), ME, unfinished)
        assert not device_check_path(tmp_path / "other", socket.gethostname()).exists()


def test_a_child_that_finds_the_device_busy_is_answered_in_the_rank() -> None:
    shape = RunShape(heads=2, hidden=32, intermediate=64, attention_dropout=0.1, hidden_dropout=0.1, lengths=(32, 9))
    verdict = run_check(HostCheck(CPU, Stage(busy_in_a_child, "fp32", 16, 32, shape), None, in_child=True))
    assert verdict.kernel.passed and verdict.kernel.failure is None, verdict.kernel.numbers()
    assert verdict.compiled is None
