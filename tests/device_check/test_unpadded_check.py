"""The kernel self-test before training: it passes on this device's kernel (the CPU reference), catches a planted
wrong kernel, and the run plan acts on its verdict: auto falls back to padded with one line giving the numbers,
an explicit unpadded is refused; config.resolved.json records the choice."""

from __future__ import annotations

import functools

import pytest
import torch

from pretrain.device_check.run_shape import RunShape
from pretrain.device_check.settle import DeviceChecks, settle_attention
from pretrain.device_check.unpadded_check import edge_case_lengths, kernel_self_test
from pretrain.device_check.verdict import SelfTestResult
from pretrain.errors import ConfigError
from pretrain.model.varlen_attention import reference_varlen_attention
from pretrain.plan.run_plan import RunPlan
from tests.support.attention_plans import Place, across_segments, phase_stub, run_plan_stub

CPU = torch.device("cpu")


def blind_to_the_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                      dropout: float, scale: float) -> torch.Tensor:
    """Wrong only where the bucket tail is not empty: the last instance's segment runs on into the padding."""
    return reference_varlen_attention(q, k, v, torch.cat([cu_seqlens[:-2], cu_seqlens[-1:]]), 2 * max_seqlen, dropout,
                                      scale)


def raising(*_args: object) -> torch.Tensor:
    raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.\n(a second line)")


def test_the_batches_hold_the_edge_cases() -> None:
    for seq in (32, 128, 512):
        lengths = edge_case_lengths(seq)
        assert [seq] in lengths and sum(lengths[2]) == seq  # one segment filling a row; an exact bucket: empty tail
        assert max(map(max, lengths)) == seq and sum(lengths[0]) % min(64, seq) and sum(lengths[3]) < seq


def test_the_reference_kernel_passes_and_planted_wrong_kernels_fail() -> None:
    for precision in ("fp32", "bf16"):
        result = kernel_self_test(CPU, precision, 32, 64)
        assert result.passed, result.numbers()
        assert result.logits_error <= result.logits_limit and result.grads_error <= result.grads_limit
    assert kernel_self_test(CPU, "fp32", 32, 64).logits_error < 1e-6  # CPU: the padded path row for row
    for wrong in (across_segments, blind_to_the_tail):
        for precision in ("fp32", "bf16"):
            result = kernel_self_test(CPU, precision, 32, 64, kernel=wrong)
            assert not result.passed and result.logits_error > 2 * result.logits_limit, (wrong, result)
            assert result.numbers().startswith(f"cpu {precision}: kernel error ")
    failed = kernel_self_test(CPU, "bf16", 32, 64, kernel=raising)
    assert not failed.passed and failed.failure == "RuntimeError: FlashAttention only supports Ampere GPUs or newer."
    assert failed.numbers() == ("cpu bf16: the unpadded path raised RuntimeError: FlashAttention only supports Ampere "
                                "GPUs or newer.")
    state = torch.random.get_rng_state()
    kernel_self_test(CPU, "fp32", 32, 32)
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's RNG is untouched


ME = Place()


def test_auto_falls_back_to_padded_on_every_phase_with_the_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    calls = []

    def wrong_kernel_test(device: torch.device, precision: str, head_dim: int, seq_len: int,
                          shape: RunShape | None) -> SelfTestResult:
        calls.append((device, precision, head_dim, seq_len, shape and (shape.heads, shape.hidden, len(shape.lengths))))
        return kernel_self_test(device, precision, head_dim, seq_len, shape, kernel=across_segments)

    settled = settle_attention(run_plan_stub("auto"), ME, DeviceChecks(test=wrong_kernel_test))  # type: ignore[arg-type]
    # once, at the run's head size and longest unpadded seq_len, with the run's heads, width and micro-batch
    assert calls == [(CPU, "fp32", 32, 32, (2, 64, 1))]
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("attention: padded (transformers' SDPA) for phase1, phase2: model.attention=auto: the "
                           "unpadded kernel's self-test failed on ") and ": cpu fp32: kernel error " in line
    for p in settled.phases.values():
        assert (p.attention.unpadded, p.attention.compile, p.stream.unpadded, p.attention.path) == (
            False, False, False, "padded")
    record = settled.resolved["resolved"]["attention"]["phase1"]
    assert record["requested"] == "auto" and record["path"] == "padded" and "logits error" in record["why"]
    assert settled.resolved["resolved"]["world_size"] == 1  # the rest of the record is kept


def test_an_explicit_unpadded_or_compile_is_refused_when_the_self_test_fails() -> None:
    wrong = functools.partial(kernel_self_test, kernel=blind_to_the_tail)
    with pytest.raises(ConfigError, match=r"^model.attention=unpadded: the unpadded kernel's self-test failed on .*: "
                                          r"cpu fp32: kernel error .*, logits error .*; model.attention=padded runs there$"):
        settle_attention(run_plan_stub("unpadded"), ME, DeviceChecks(test=wrong))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^model.compile=true: compiles the unpadded encoder layers, and "
                                          r"model.attention=auto runs padded SDPA here \(the unpadded kernel's"):
        settle_attention(run_plan_stub("auto", compile_strict=True), ME, DeviceChecks(test=wrong))  # type: ignore[arg-type]


def test_a_passed_self_test_keeps_the_path_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    settled = settle_attention(run_plan_stub("auto"), ME)  # type: ignore[arg-type]
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("attention: unpadded (real tokens, varlen kernel) for phase1, phase2: model.attention=auto:")
    assert "; self-test passed (1 host): cpu fp32: kernel error 0.00e+00 (output; limit 1.00e-05), logits error" in line
    assert all(p.attention.unpadded and p.stream.unpadded for p in settled.phases.values())
    assert settled.resolved["resolved"]["attention"]["phase2"]["path"] == "unpadded"
    padded = {"phase1": phase_stub("phase1", "padded", unpadded=False)}
    untested = settle_attention(RunPlan(None, padded, {"resolved": {}}), ME,  # type: ignore[arg-type]
                                DeviceChecks(test=raising))
    assert untested.phases["phase1"].attention.why == "model.attention=padded"  # nothing to test: no test ran


@pytest.mark.multirank
def test_every_rank_takes_the_path_the_worst_host_allows_and_one_rank_per_host_tests(tmp_path) -> None:
    """Two ranks, both LOCAL_RANK 0 (one GPU per task). As two hosts: a self-test that fails on one makes auto padded
    on both and refuses an explicit unpadded on both (the same line); a host that cannot run the kernel at all does
    too. As one host: one rank tests, the line counts one host, and a restart tests on neither (before, every local
    rank 0 tested: two tests on one host, a line counting two, and each restart again)."""
    import json

    from tests.support.launching import run_ranks
    from tests.support.paths import REPO_ROOT

    run_ranks(REPO_ROOT / "tests" / "scripts" / "attention_agreement.py", [str(tmp_path)], num_ranks=2, timeout=300)
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    shared = [{k: v for k, v in o.items() if ": tests on rank" not in k} for o in outcomes]
    assert shared[0] == shared[1]
    padded, unpadded = {"phase1": "padded", "phase2": "padded"}, {"phase1": "unpadded", "phase2": "unpadded"}
    outcome = outcomes[0]
    assert outcome["auto, the test fails on rank 1"] == padded
    assert outcome["unpadded, the test fails on rank 1"].startswith(
        "model.attention=unpadded: the unpadded kernel's self-test failed on node1 (rank 1): ")
    assert outcome["auto, rank 1 plans padded"] == padded
    assert outcome["auto, every test passes"] == unpadded
    tests = {name: [outcomes[rank][f"{name}: tests on rank {rank}"] for rank in (0, 1)] for name in (
        "two hosts", "one host", "one host, a launch with a run folder", "one host, its restart")}
    assert tests == {"two hosts": [1, 1], "one host": [1, 0], "one host, a launch with a run folder": [1, 0],
                     "one host, its restart": [0, 0]}
    assert outcome["two hosts: line"] == "self-test passed (2 hosts)"
    assert outcome["one host: line"] == outcome["one host, a launch with a run folder: line"] == \
        "self-test passed (1 host)"
    assert outcome["one host, its restart: line"] == "self-test passed (1 host, all from the run folder's cache)"
