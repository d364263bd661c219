"""Expected phase wall-clock of the shipped recipes on N GPUs, from the rows measured on ONE GPU.

An estimate, not a measurement: no multi-GPU run stands behind it. Per optimizer step on N GPUs
(data parallel, ZeRO-1 as the shipped DeepSpeed JSON has it):

    A          = batch / (micro x N)              micro-batches per GPU per step (the driver derives it so)
    compute    = A x t_micro                      t_micro: one GPU's time per micro-batch, from the rows
    optimizer  = t_lamb / N + (t_boundary - t_lamb)
                 ZeRO-1 splits the LAMB update (the LAMB row's step) over the N ranks; the rest of the
                 boundary (gradient norm, clipping, bf16 copy of the weights, the trainer's bookkeeping)
                 is taken as measured on one GPU
    comm       = P x g x 2(N-1)/N / busbw         all-reduce of the gradient (g bytes per parameter: 2 in
               + P x 2 x (N-1)/N / busbw          bf16, 4 with communication_data_type fp32), then the
               + k x latency                      all-gather of the bf16 weights, not overlapped with compute
                                                  (the bf16 optimizer reduces at the accumulation boundary),
                                                  plus k small all-reduces (loss normalisation, statistics,
                                                  LAMB's norms, the gradient norm)
    busbw      = NCCL bus bandwidth: the intra-node figure up to one node, the inter-node figure beyond
    phase      = steps x (compute + optimizer + comm)

t_micro and t_boundary come from two rows of one engine that differ only in the micro-batches per step:
T_A (A of them) and T_1 (one): t_boundary = (A T_1 - T_A) / (A - 1), t_micro = (T_A - t_boundary) / A.
Left out: stragglers and NCCL efficiency at scale, data loading beyond what one GPU's row paid,
checkpoints, validation, start-up. Everything here is a pure function of the rows, unit-tested on made-up ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ESTIMATE_HEADER = ("| recipe | phase | GPUs | A | ms / micro | optimizer ms | comm ms | step s | steps | "
                   "phase wall-clock | seq/s |\n|---|---|---|---|---|---|---|---|---|---|---|")


@dataclass(frozen=True)
class Network:
    """The interconnect the estimate assumes (flags of bench/gpu_check/run.py); NCCL bus bandwidths in GB/s."""

    gpus_per_node: int = 8
    intra_node_busbw_gbs: float = 350.0  # NVLink / NVSwitch all-reduce, 8 GPUs in a node (est.)
    inter_node_busbw_gbs: float = 40.0  # per GPU across nodes, e.g. one 400 Gb/s NIC per GPU (est.)
    intra_node_latency_us: float = 20.0
    inter_node_latency_us: float = 60.0
    small_collectives: int = 4  # per step: loss normalisation, statistics, LAMB's norms, gradient norm

    def busbw(self, gpus: int) -> float:
        return 1e9 * (self.intra_node_busbw_gbs if gpus <= self.gpus_per_node else self.inter_node_busbw_gbs)

    def latency(self, gpus: int) -> float:
        return 1e-6 * (self.intra_node_latency_us if gpus <= self.gpus_per_node else self.inter_node_latency_us)

    def describe(self) -> str:
        return (f"NCCL bus bandwidth {self.intra_node_busbw_gbs:g} GB/s within a node of {self.gpus_per_node} GPUs, "
                f"{self.inter_node_busbw_gbs:g} GB/s per GPU across nodes; {self.small_collectives} small "
                f"all-reduces per step at {self.intra_node_latency_us:g} / {self.inter_node_latency_us:g} us")


@dataclass(frozen=True)
class PhaseRun:
    """One phase of a recipe to estimate, at the shape its rows were measured at."""

    recipe: str
    phase: str
    model: str
    seq_len: int
    micro_batch: int
    batch: int  # global batch (sequences per optimizer step)
    steps: int
    packing: bool
    grad_bytes: int  # bytes per gradient element in the all-reduce
    unpadded: bool = False  # model.attention=unpadded (then packing changes nothing)

    @property
    def layout(self) -> str:
        return layout_of(self.unpadded, self.packing)


def layout_of(unpadded: bool, packing: bool) -> str:
    """How a row's (or a recipe phase's) micro-batches are laid out: unpadded, packed or padded rows."""
    return "unpadded" if unpadded else "packed" if packing else "padded"


def row_layout(row: dict[str, Any]) -> str:
    return layout_of(bool(row.get("unpadded", False)), bool(row["packing"]))


@dataclass(frozen=True)
class StepTimes:
    """One GPU's times, from the rows."""

    micro_s: float
    boundary_s: float
    lamb_s: float  # the part of the boundary ZeRO-1 splits over the ranks (0: none assumed)
    params: int
    source: str  # which rows, and any caveat


def _ok_rows(rows: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("kind", kind) == kind and r.get("status") == "ok"]


def step_times(rows: list[dict[str, Any]], run: PhaseRun) -> StepTimes | str:
    """The times for `run` from the measured rows (timer off, the run's model and shape), or why there are none."""
    train = [r for r in _ok_rows(rows, "train") if (r["model"], r["seq_len"], r["micro_batch"]) ==
             (run.model, run.seq_len, run.micro_batch) and not r["tput_timer"]]
    main = [r for r in train if row_layout(r) == run.layout and (run.layout != "padded" or r["profile"] == "padded")
            and r["accumulation"] > 1]
    if not main:
        return f"no {run.layout} row of {run.model} at seq {run.seq_len} x micro {run.micro_batch}"
    row = main[0]
    # the boundary pair: the main row's layout and lengths at A and at 1 micro-batch per step, else padded rows
    pair = [r for r in train if row_layout(r) == row_layout(row) and r["profile"] == row["profile"]]
    if not any(r["accumulation"] == 1 for r in pair):
        pair = [r for r in train if r["profile"] == "padded" and row_layout(r) == "padded"]
    one = [r for r in pair if r["accumulation"] == 1]
    many = [r for r in pair if r["accumulation"] > 1]
    source = row["name"]
    if one and many:
        big, single = many[0], one[0]
        a = big["accumulation"]
        boundary = (a * single["step_s"] - big["step_s"]) / (a - 1)
        source += f", boundary from {big['name']} and {single['name']}"
        if boundary < 0:
            boundary, source = 0.0, source + " (measured < 0, taken as 0)"
        elif boundary >= row["step_s"]:  # noise: the pair contradicts the row
            boundary, source = 0.0, source + f" (measured {boundary:.3f} s >= the row's step: not separated)"
    else:
        boundary, source = 0.0, source + ", boundary not separated (inside ms / micro)"
    if row_layout(row) != "padded" or row["profile"] != "padded":
        source += f" ({row['profile']} lengths, {row_layout(row)})"
    micro = (row["step_s"] - boundary) / row["accumulation"]
    lamb = [r for r in _ok_rows(rows, "lamb") if r["model"] == run.model and r["variant"] == row["lamb_step"]]
    lamb_s = min(lamb[0]["step_ms"] / 1e3, boundary) if lamb else 0.0
    return StepTimes(micro, boundary, lamb_s, int(row["params"]), source)


def estimate_phase(run: PhaseRun, times: StepTimes, gpus: int, network: Network) -> dict[str, Any]:
    key = {"recipe": run.recipe, "phase": run.phase, "gpus": gpus}
    if run.batch % (run.micro_batch * gpus):
        return {**key, "status": f"batch {run.batch} is not divisible by micro {run.micro_batch} x {gpus} GPUs"}
    accumulation = run.batch // (run.micro_batch * gpus)
    compute = accumulation * times.micro_s
    optimizer = times.lamb_s / gpus + (times.boundary_s - times.lamb_s)
    comm = 0.0
    if gpus > 1:
        share = (gpus - 1) / gpus
        moved = times.params * run.grad_bytes * 2 * share + times.params * 2 * share
        comm = moved / network.busbw(gpus) + network.small_collectives * network.latency(gpus)
    step = compute + optimizer + comm
    return {**key, "status": "ok", "accumulation": accumulation, "micro_ms": times.micro_s * 1e3,
            "optimizer_ms": optimizer * 1e3, "comm_ms": comm * 1e3, "step_s": step, "steps": run.steps,
            "wall_s": run.steps * step, "seq_per_s": run.batch / step, "source": times.source}


def estimate(runs: list[PhaseRun], rows: list[dict[str, Any]], gpu_counts: list[int],
             network: Network) -> list[dict[str, Any]]:
    """One entry per (recipe phase, GPU count): the estimate, or status saying why there is none."""
    out = []
    for run in runs:
        times = step_times(rows, run)
        for gpus in gpu_counts:
            if isinstance(times, str):
                out.append({"recipe": run.recipe, "phase": run.phase, "gpus": gpus, "status": times})
            else:
                out.append(estimate_phase(run, times, gpus, network))
    return out


def wall_clock(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"


def estimate_markdown(estimates: list[dict[str, Any]], network: Network, caveat: str = "") -> str:
    lines = ["### ESTIMATE (not measured): phase wall-clock of the shipped recipes on N GPUs", "",
             "Assumptions: per-GPU time per micro-batch and the one-GPU optimizer boundary from the rows above "
             "(timer off); A = batch / (micro x GPUs); step = A x ms/micro + optimizer (LAMB update split over "
             "the ZeRO-1 ranks, the rest of the boundary as on one GPU) + comm (gradient all-reduce + bf16 "
             "weight all-gather at the boundary, not overlapped; " + network.describe() + "). No measured "
             "multi-GPU efficiency; checkpoints, validation, start-up and stragglers are not included."
             + (f" {caveat}" if caveat else ""), "", ESTIMATE_HEADER]
    for e in estimates:
        key = f"| {e['recipe']} | {e['phase']} | {e['gpus']} |"
        if e["status"] != "ok":
            lines.append(f"{key} {e['status']} |")
            continue
        lines.append(f"{key} {e['accumulation']} | {e['micro_ms']:.1f} | {e['optimizer_ms']:.1f} | "
                     f"{e['comm_ms']:.1f} | {e['step_s']:.3f} | {e['steps']} | {wall_clock(e['wall_s'])} | "
                     f"{e['seq_per_s']:.0f} |")
    sources = sorted({f"{e['recipe']} {e['phase']}: {e['source']}" for e in estimates if e["status"] == "ok"})
    lines += ["", *(f"- rows used, {s}" for s in sources)]
    return "\n".join(lines)


def _named(rows: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    found = [r for r in _ok_rows(rows, "train") if r["name"] == name]
    return found[0] if found else None


def comparisons(rows: list[dict[str, Any]]) -> list[str]:
    """Ratios between rows measured in this process (present only where both rows are)."""
    pairs = [
        ("p1", "p1-padded", "real_tokens_per_s", "phase 1 unpadded / padded rows, real tokens/s"),
        ("p2", "p2-padded", "real_tokens_per_s", "phase 2 unpadded / padded rows, real tokens/s"),
        ("p2", "p2-packed", "real_tokens_per_s", "phase 2 unpadded / packed rows, real tokens/s"),
        ("p1-timer-on", "p1", "step_s", "throughput timer on / off, time per optimizer step"),
        ("p1", "p1-full", "step_s", "10 % short rows (masked attention) / no padding, time per step"),
        ("p1-padded", "p1-full", "step_s", "10 % short rows (masked attention) / no padding, time per step"),
        ("p2-packed", "p2-varied", "inst_per_s", "packed / unpacked on the same instances, instances/s"),
        ("p2-packed", "p2-padded", "inst_per_s", "packed / unpacked on the same instances, instances/s"),
        ("p1-big", "p1", "seq_time_ms", "phase-1 big micro-batch / the recipe's, time per sequence"),
        ("p2-big", "p2", "seq_time_ms", "phase-2 big micro-batch / the recipe's, time per sequence"),
    ]
    out = []
    for first, second, field, label in pairs:
        a, b = _named(rows, first), _named(rows, second)
        if a is None or b is None or not b[field]:
            continue
        if "unpadded" not in label and row_layout(a) == "unpadded" != row_layout(b):
            continue  # the padded comparisons, where the recipe's own rows are unpadded
        out.append(f"{label}: {a[field] / b[field]:.3f} ({first} vs {second})")
    return out
