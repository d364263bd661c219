"""The kernel self-test before training: it passes on this device's kernel (the CPU reference), catches a planted
wrong kernel, and the run plan acts on its verdict: auto falls back to padded with one line giving the numbers,
an explicit unpadded is refused; config.resolved.json records the choice."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from pretrain.config.attention import AttentionPlan
from pretrain.config.sections import ConfigError
from pretrain.data.batches import StreamSettings
from pretrain.model.bert import bert_config
from pretrain.model.self_test import SelfTestResult, edge_case_lengths, kernel_self_test
from pretrain.model.varlen_attention import reference_varlen_attention
from pretrain.run_plan import PhasePlan, RunPlan, settle_attention
from pretrain.trainer import TrainerSettings

CPU = torch.device("cpu")


def across_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                    dropout: float, scale: float) -> torch.Tensor:
    """Wrong: every token attends to every token of the micro-batch (the segment bounds ignored)."""
    rows = [x.transpose(0, 1)[None] for x in (q, k, v)]
    return F.scaled_dot_product_attention(*rows, scale=scale)[0].transpose(0, 1)


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
            assert result.numbers().startswith(f"cpu {precision}: logits error ")
    failed = kernel_self_test(CPU, "bf16", 32, 64, kernel=raising)
    assert not failed.passed and failed.failure == "RuntimeError: FlashAttention only supports Ampere GPUs or newer."
    assert failed.numbers() == ("cpu bf16: the unpadded path raised RuntimeError: FlashAttention only supports Ampere "
                                "GPUs or newer.")
    state = torch.random.get_rng_state()
    kernel_self_test(CPU, "fp32", 32, 32)
    assert torch.equal(torch.random.get_rng_state(), state)  # the run's RNG is untouched


def phase(name: str, requested: str, unpadded: bool = True, compile_strict: bool = False) -> PhasePlan:
    """A phase plan with what settle_attention reads (the rest is not used)."""
    attention = AttentionPlan(unpadded=unpadded, compile=False, requested=requested, compile_strict=compile_strict,
                              why=f"model.attention={requested}" + (": the reference varlen kernel" if unpadded else ""))
    return PhasePlan(name=name, model_config=bert_config("tiny", 64, 64), ds_config={}, precision="fp32",
                     schedule=None, data=None, trainer=TrainerSettings(phase=name, steps=1, seq_len=32, seed=0),  # type: ignore[arg-type]
                     stream=StreamSettings(seed=0, unpadded=unpadded), throughput=None, attention=attention,  # type: ignore[arg-type]
                     seed=0, activation_checkpointing=False, init_from=None)


def run_plan(requested: str, compile_strict: bool = False) -> RunPlan:
    phases = {name: phase(name, requested, compile_strict=compile_strict) for name in ("phase1", "phase2")}
    return RunPlan(job=None, phases=phases, resolved={"run": {}, "resolved": {"world_size": 1}})  # type: ignore[arg-type]


ME = dataclasses.make_dataclass("Me", [("rank", int), ("local_rank", int), ("device", torch.device)])(0, 0, CPU)


def test_auto_falls_back_to_padded_on_every_phase_with_the_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    calls = []

    def wrong_kernel_test(device: torch.device, precision: str, head_dim: int, seq_len: int) -> SelfTestResult:
        calls.append((device, precision, head_dim, seq_len))
        return kernel_self_test(device, precision, head_dim, seq_len, kernel=across_segments)

    settled = settle_attention(run_plan("auto"), ME, test=wrong_kernel_test)  # type: ignore[arg-type]
    assert calls == [(CPU, "fp32", 32, 32)]  # once, at the run's head size and longest unpadded seq_len
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("attention: padded (transformers' SDPA) for phase1, phase2: model.attention=auto: the "
                           "unpadded kernel's self-test failed on ") and ": cpu fp32: logits error " in line
    for p in settled.phases.values():
        assert (p.attention.unpadded, p.attention.compile, p.stream.unpadded, p.attention.path) == (
            False, False, False, "padded")
    record = settled.resolved["resolved"]["attention"]["phase1"]
    assert record["requested"] == "auto" and record["path"] == "padded" and "logits error" in record["why"]
    assert settled.resolved["resolved"]["world_size"] == 1  # the rest of the record is kept


def test_an_explicit_unpadded_or_compile_is_refused_when_the_self_test_fails() -> None:
    wrong = functools.partial(kernel_self_test, kernel=blind_to_the_tail)
    with pytest.raises(ConfigError, match=r"^model.attention=unpadded: the unpadded kernel's self-test failed on .*: "
                                          r"cpu fp32: logits error .*; model.attention=padded runs there$"):
        settle_attention(run_plan("unpadded"), ME, test=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^model.compile=true: compiles the unpadded encoder layers, and "
                                          r"model.attention=auto runs padded SDPA here \(the unpadded kernel's"):
        settle_attention(run_plan("auto", compile_strict=True), ME, test=wrong)  # type: ignore[arg-type]


def test_a_passed_self_test_keeps_the_path_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    settled = settle_attention(run_plan("auto"), ME)  # type: ignore[arg-type]
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("attention: unpadded (real tokens, varlen kernel) for phase1, phase2: model.attention=auto:")
    assert "; self-test passed: cpu fp32: logits error" in line
    assert all(p.attention.unpadded and p.stream.unpadded for p in settled.phases.values())
    assert settled.resolved["resolved"]["attention"]["phase2"]["path"] == "unpadded"
    padded = {"phase1": phase("phase1", "padded", unpadded=False)}
    untested = settle_attention(RunPlan(None, padded, {"resolved": {}}), ME, test=raising)  # type: ignore[arg-type]
    assert untested.phases["phase1"].attention.why == "model.attention=padded"  # nothing to test: no test ran
