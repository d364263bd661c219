"""The planned attention path, confirmed on every host's device before training, the same on every rank.

The run plan (pretrain/plan/run_plan.py) chooses each phase's attention path from the device's facts; before any
model exists, the driver (pretrain/train.py) hands the plan to `settle_attention`, which has one rank per host run
the self-tests (pretrain/device_check/host_check.py: both stages in one child on a GPU, the verdict cached in the
run folder), gathers every rank's plan and verdict, and settles: unpadded where every rank planned it and no
host's test failed, else padded (`auto`) or refused (an explicit `unpadded`); compiled layers where the compiled
layer's test passed too, else eager (`model.compile=true`: refused). config.resolved.json records the choice.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from pretrain.config.attention import PADDED_HINT
from pretrain.device_check.compiled_check import compiled_self_test
from pretrain.device_check.contained import SelfTest
from pretrain.device_check.host_check import HostCheck, Stage, checked_host
from pretrain.device_check.run_shape import RunShape, run_shape
from pretrain.device_check.unpadded_check import kernel_self_test
from pretrain.device_check.verdict import SelfTestResult
from pretrain.distributed.info import DistInfo
from pretrain.distributed.json_collectives import all_gather_json
from pretrain.errors import ConfigError
from pretrain.model.attention_plan import AttentionPlan
from pretrain.plan.run_plan import PhasePlan, RunPlan, head_dim

# host, planned unpadded per phase, its kernel self-test, its compiled layer's self-test
Verdict = tuple[str, tuple[bool, ...], SelfTestResult | None, SelfTestResult | None]


@dataclass(frozen=True)
class DeviceChecks:
    """The self-tests `settle_attention` runs and where this rank is: the tests' seams. `host`: the name the ranks
    elect by (None: this machine's, socket.gethostname())."""

    test: SelfTest = kernel_self_test
    compiled_test: SelfTest = compiled_self_test
    host: str | None = None
    in_child: bool | None = None  # HostCheck.in_child


def tested_shape(phases: list[PhasePlan]) -> RunShape:
    """The run's shapes the self-tests check (pretrain/device_check/run_shape.py); a stub's ds_config may lack the
    micro-batch."""
    return run_shape(phases[0].model_config, [(p.section.seq_len, int(p.ds_config.get(
        "train_micro_batch_size_per_gpu", 1))) for p in phases])


def gather(verdict: Verdict) -> list[Verdict]:
    """Every rank's verdict, on every rank (one all-gather at start-up, as JSON: a test's result travels as its
    fields, never as a pickle a peer could have written)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [verdict]
    host, planned, result, compiled = verdict
    sent = [host, list(planned), *(None if r is None else dataclasses.asdict(r) for r in (result, compiled))]
    return [(host, tuple(planned), *(None if r is None else SelfTestResult(**r) for r in results))
            for host, planned, *results in all_gather_json(sent)]


def elected(host: str) -> bool:
    """Whether this rank tests for its host: the lowest rank among those with its host name (one all-gather of the
    names). Not LOCAL_RANK: with one GPU per task (srun --gpus-per-task=1) every rank is local rank 0, and each
    would start its own test, all at once on one host."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return True
    return all_gather_json(host).index(host) == dist.get_rank()


def host_check(phases: list[PhasePlan], dist_info: DistInfo, checks: DeviceChecks) -> HostCheck | None:
    """What this host tests: the kernel where a phase plans the unpadded path, then the compiled layer where one
    also compiles (None: no phase runs unpadded)."""
    unpadded = [p for p in phases if p.attention.unpadded]
    if not unpadded:
        return None
    compiling = [p for p in unpadded if p.attention.compile]

    def stage(test: SelfTest, tested: list[PhasePlan]) -> Stage:
        return Stage(test, tested[0].precision, head_dim(tested[0].model_config),
                     max(p.section.seq_len for p in tested), tested_shape(tested))

    return HostCheck(dist_info.device, stage(checks.test, unpadded),
                     stage(checks.compiled_test, compiling) if compiling else None, checks.in_child)


def settle_attention(plan: RunPlan, dist_info: DistInfo, checks: DeviceChecks | None = None) -> RunPlan:
    """The planned attention path, confirmed on the device before training, the same on every rank.

    One rank per host (`elected`) runs the kernel self-test where a phase plans the unpadded path, and the
    compiled layer's where one also compiles, or reads the host's verdict from the run folder (host_check.py);
    every rank's plan and verdict are gathered. A phase runs unpadded only if every rank planned it and no test
    failed: otherwise `auto` runs padded (the line gives the numbers) and an explicit `unpadded` is refused
    (ConfigError on every rank). If the compiled layer's test fails anywhere, the layers run eager
    (`model.compile=true`: refused). Rank 0 says the choice and why; config.resolved.json records it."""
    checks = checks or DeviceChecks()
    phases = list(plan.phases.values())
    planned = tuple(p.attention.unpadded for p in phases)
    host = checks.host or socket.gethostname()
    check = host_check(phases, dist_info, checks)
    result = compiled = None
    tests_here = elected(host)  # a collective: every rank takes part, whether or not a phase runs unpadded
    if tests_here and check is not None:
        run_dir = getattr(plan.job, "run_dir", None)
        verdict = checked_host(check, None if run_dir is None else Path(run_dir), host)
        result, compiled = verdict.kernel, verdict.compiled
    verdicts = gather((host, planned, result, compiled))
    tests = [(f"{host} (rank {rank})", r) for rank, (host, _, r, _) in enumerate(verdicts) if r is not None]
    failed = next((f"{node}: {r.numbers()}" for node, r in tests if not r.passed), None)
    compile_failed = next((f"{host} (rank {rank}): {c.numbers()}" for rank, (host, _, _, c) in enumerate(verdicts)
                           if c is not None and not c.passed), None)
    settled = {}
    for index, phase in enumerate(phases):
        attention = phase.attention
        unable = [f"{host} (rank {rank})" for rank, (host, flags, _, _) in enumerate(verdicts) if not flags[index]]
        if attention.unpadded and failed is not None:
            attention = fall_back(attention, f"the unpadded kernel's self-test failed on {failed}")
        elif attention.unpadded and unable:
            attention = fall_back(attention, f"{unable[0]} cannot run the unpadded kernel")
        elif attention.unpadded and tests:  # the same words on every rank: the first host's numbers
            attention = dataclasses.replace(attention, why=f"{attention.why}; self-test passed ({counted(tests)}): "
                                            f"{tests[0][1].numbers()}")
        if attention.unpadded and attention.compile and compile_failed is not None:
            attention = eager_layers(attention, f"the compiled layer's self-test failed on {compile_failed}")
        settled[phase.name] = dataclasses.replace(
            phase, attention=attention, stream=dataclasses.replace(phase.stream, unpadded=attention.unpadded))
    announce(settled, dist_info.rank)
    resolved = {**plan.resolved["resolved"], "attention": {
        name: {"requested": p.attention.requested, "path": p.attention.path, "compile": p.attention.compile,
               "why": p.attention.why} for name, p in settled.items()}}
    return dataclasses.replace(plan, phases=settled, resolved={**plan.resolved, "resolved": resolved})


def counted(tests: list[tuple[str, SelfTestResult]]) -> str:
    """'2 hosts' (one test per host), and how many of the verdicts an earlier launch left in the run folder."""
    cached = sum(r.cached for _, r in tests)
    hosts = f"{len(tests)} host{'s' * (len(tests) > 1)}"
    return f"{hosts}, {'all' if cached == len(tests) else cached} from the run folder's cache" if cached else hosts


def eager_layers(attention: AttentionPlan, why: str) -> AttentionPlan:
    """The unpadded path with eager layers for `why`; model.compile=true is refused, in one line. The reason comes
    first in the line, before the path's own (a passed kernel test's numbers)."""
    if attention.compile_strict:
        raise ConfigError(f"model.compile=true: {why}; model.compile=null runs the layers eager with a warning")
    return dataclasses.replace(attention, compile=False, why=f"layers eager: {why}; {attention.why}")


def fall_back(attention: AttentionPlan, why: str) -> AttentionPlan:
    """`auto` runs padded for `why`; an explicit unpadded (or compile=true) is refused, in one line."""
    if attention.requested == "unpadded":
        raise ConfigError(f"model.attention=unpadded: {why}; {PADDED_HINT}")
    if attention.compile_strict:
        raise ConfigError(f"model.compile=true: compiles the unpadded encoder layers, and model.attention=auto runs "
                          f"padded SDPA here ({why}); set model.compile=false or null")
    return dataclasses.replace(attention, unpadded=False, compile=False, note=None,
                               why=f"model.attention=auto: {why}")


def announce(phases: dict[str, PhasePlan], rank: int) -> None:
    """Rank 0's line per distinct choice: the path, the phases and why."""
    if rank != 0:
        return
    choices: dict[tuple[str, str], list[str]] = {}
    for name, phase in phases.items():
        choices.setdefault((phase.attention.path, phase.attention.why), []).append(name)
    for (path, why), names in choices.items():
        kind = "unpadded (real tokens, varlen kernel)" if path == "unpadded" else "padded (transformers' SDPA)"
        print(f"attention: {kind} for {', '.join(names)}: {why}", flush=True)
