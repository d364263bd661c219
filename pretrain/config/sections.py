"""The run config: one section per JSON object of RUN.json, composed of the keys each component declares.

A key is declared once, with `setting(default, doc)` (pretrain/keys.py), by the component that reads it: the lr,
batch and masking schedules (pretrain/schedules/), the checkpoint cadence (pretrain/checkpointing/cadence.py), the
quality marks (pretrain/metrics/quality.py), the slow-rank rule (pretrain/metrics/slow_rank_rule.py), the phase
loop (pretrain/loop_sections.py). A section here inherits its components' declarations and declares the keys that
only the config and the plan read (run.dir, model.preset, phaseN.ds_config, ...). The run plan
(pretrain/plan/run_plan.py) hands each component its section: this config's instance, typed as the component's
declaration. `python -m pretrain.train --help` and the configuration table of docs/pretraining.md are generated
from these declarations (pretrain/config/doc.py); how a RUN.json and command-line overrides become a checked
`RunConfig` is pretrain/config/load.py.

Above the loop and below the plan (docs/architecture.md), but torch-free: every declaration it inherits sits in a
module that loads no torch, so reading a config (the launcher, `--help`) stays instant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.checkpointing.cadence import CadenceSection
from pretrain.data.stream_sections import PackingSection, PartSection
from pretrain.errors import ConfigError
from pretrain.keys import PHASE_NAMES, setting
from pretrain.loop_sections import (
    FailureSection,
    FeedSection,
    LoopPhaseSection,
    LoopRunSection,
    ValidationSection,
)
from pretrain.metrics.quality import QualitySection
from pretrain.metrics.slow_rank_rule import SlowRankSection
from pretrain.run_folder import CHECKPOINTS
from pretrain.schedules.batch import BatchWarmupSettings
from pretrain.schedules.lr import ScheduleSettings
from pretrain.schedules.masking import MaskingSettings

__all__ = ["PLUGINS_FIELD", "RunConfig"]

PLUGINS_FIELD = "plugins"  # RunConfig's field with the plug-ins' sections by name (not a section itself)
# Rank 0 alone hashes every shard before training and exports at each phase end while the other ranks
# wait in a collective; DeepSpeed's default process-group timeout (10 minutes) would abort a job whose
# rank 0 is merely busy. The one home of this default (pretrain/engine.py's init_distributed reads it).
DIST_TIMEOUT_MINUTES = 120


@dataclass
class RunSection(SlowRankSection, LoopRunSection):
    """Where the run lives, which phases it runs, its seed and its numeric precision."""

    about: str = setting(
        "",
        "what this run config is for and where its numbers come from (free text; the shipped recipes say "
        "it; config.resolved.json keeps it with the run)",
    )
    dir: str = setting(
        "runs/bert",
        "run folder: config.resolved.json, checkpoints/ (unless checkpoint.dir), export/, tensorboard/",
    )
    phases: list[str] = setting(
        list(PHASE_NAMES),
        'which phases to run, in order: ["phase1", "phase2"] or one of them (phase2 alone needs '
        "phase2.init_from or a phase-1 checkpoint)",
    )
    precision: str = setting(
        "auto",
        "auto | fp32 | bf16 | fp16. auto: fp32 on CPU, bf16 on a GPU that has it, else fp16 (dynamic loss "
        "scaling). The one home of precision: a DeepSpeed JSON that sets bf16.enabled or fp16.enabled is "
        "refused; its fp16 loss-scale knobs and data_types stay there",
    )
    dist_timeout_minutes: int = setting(
        DIST_TIMEOUT_MINUTES,
        "how long a collective waits for a busy rank before the job fails. Rank 0 alone hashes every shard "
        "at start-up and exports at each phase end while the other ranks wait; DeepSpeed's default (10) "
        "fails a large run that is only slow there. A hung rank is found sooner: run.hang_timeout_minutes",
    )
    max_restarts: int = setting(
        3,
        "./launch.sh pretrain restarts the whole job when a rank dies (a signal, a non-zero exit, a lost node, "
        "a hang), each time from the newest whole checkpoint, up to this many times between two checkpoints: "
        "the count is of the faults since the checkpoint the job restarts from, and a newer checkpoint (progress) "
        "starts it again, so a long job outlives any number of faults that each leave progress behind; 0: none. "
        "Config errors and the same failure again (same step, no newer checkpoint) are not restarted "
        "(docs/faults.md)",
    )
    survivor_stacks: bool = setting(
        True,
        "after a fault, the ranks still running write their Python stacks (on GPUs also NCCL's recent collectives) to "
        "their logs before they are killed: about 1 s (4 s on GPUs) added to each fault restart; false: killed at once",
    )
    last_call_seconds: float = setting(
        30.0,
        "with --nodes MIN:MAX: how long a rendezvous that already has MIN nodes waits for more before it starts. A "
        "node slow to start (a cold shared file system) that misses it joins later, at the cost of a restart of the "
        "running nodes (not charged to run.max_restarts)",
    )
    host_fault_limit: int = setting(
        3,
        "with --nodes MIN:MAX and a node to spare: a host whose own ranks (not a victim's, that lost its peer) fail this "
        "many times within run.host_fault_hours, progress or not, leaves the job with one line, and the others "
        "restart without it (a flaky link or GPU that would cost a recovery every hour); 0: never (docs/faults.md)",
    )
    host_fault_hours: float = setting(
        6.0, "the window of run.host_fault_limit, in hours",
    )
    hang_timeout_minutes: float = setting(
        10.0,
        "a rank that makes no progress for this long is named and the job is restarted: timed from one optimizer "
        "step to the next (the step, validation, checkpoint; each checkpoint file written is progress), from the "
        "second step of each launch and phase on (before: run.startup_timeout_minutes; docs/faults.md)",
    )
    startup_timeout_minutes: float = setting(
        30.0,
        "the same for start-up, after every launch and restart: a rank that makes no progress for this long while it "
        "imports, joins the job, checks the shards or the checkpoint it resumes from, builds a phase's engine, or runs "
        "its first step (compilation) is named and the job is restarted (docs/faults.md)",
    )

@dataclass
class ModelSection:
    """Which BERT to train."""

    preset: str = setting(
        "bert-large",
        "bert-large | bert-base | bert-mini | tiny (sizes: pretrain/model/bert.py)",
    )
    overrides: dict[str, Any] = setting(
        {},
        'BertConfig fields over the preset, e.g. {"hidden_dropout_prob": 0.0}; vocab_size comes from the '
        "shards, max_position_embeddings defaults to max(512, the longest seq_len)",
    )
    activation_checkpointing: bool = setting(
        False,
        "recompute each encoder layer in backward: about 1/3 more compute for activation memory of "
        "O(layers) less",
    )
    attention: str = setting(
        "auto",
        "auto | unpadded | padded. unpadded: the encoder runs on the real tokens of each micro-batch only, "
        "attention kept inside each instance by a variable-length kernel (CUDA: flash, bf16/fp16 on sm80+ with a "
        "torch build that has it; elsewhere a reference kernel, padded SDPA row for row); padded: transformers' "
        "SDPA on rows of seq_len, the reference (phaseN.packing lays out its rows). auto: unpadded where its kernel "
        "runs, else padded; before training a kernel self-test on each node compares unpadded with padded, and "
        "auto runs padded on every rank if it fails (an explicit unpadded is refused). Rank 0 says the choice and "
        "why; config.resolved.json records it. Same instances, masks and losses (docs/performance.md)",
    )
    compile: bool | None = setting(
        None,
        "torch.compile the encoder layer as one graph (regional: one compile serves every layer; the unpadded "
        "path only). null: on with CUDA (not under ZeRO-3), off on CPU, where compiling costs more than it "
        "saves in short runs; a layer that does not compile runs eager with one line (compile/fallback). true: "
        "a layer that does not compile stops the run at the first step (exit 2); refused with ZeRO-3",
    )


@dataclass
class DataSection(PartSection, FeedSection):
    """The shards the phases read and how they are loaded."""

    shards: str = setting(
        "",
        "a data_prep output folder (with manifest.json); a phase may name its own (phaseN.shards)",
    )
    objective: str | None = setting(
        None,
        "mlm+nsp | mlm: what the run must train. The shards decide (data_prep --segments): sentence pairs (nsp) "
        "train MLM + NSP, packed sentences (full-sentences, doc-sentences) MLM alone, exported as "
        "BertForMaskedLM; set this to have shards of the other kind refused at launch. null: what the shards are",
    )
    mask_probability: float | None = setting(
        None,
        "share of each instance's tokens masked for MLM (BERT: 0.15; MosaicBERT and the budget recipe: 0.30), "
        "80% [MASK], 10% a random token, 10% unchanged; the prediction slots grow to fit. Dynamic shards are "
        "masked at this rate as they are read; static shards hold masks made at their build's --mask-prob and "
        "refuse another rate. null: the shards' own rate",
    )
    verify_checksums: bool = setting(
        True,
        "rank 0 checks the sha256 of every shard before training (once per run start)",
    )

@dataclass
class PhaseSection(BatchWarmupSettings, MaskingSettings, ScheduleSettings, PackingSection, LoopPhaseSection):
    """One pretraining phase (phase1: seq 128, phase2: seq 512): its data, what it tunes (steps, lr schedule,
    batch) and its DeepSpeed JSON of engine mechanics.

    One home per setting: lr and the batch sizes live here (and precision in run.precision), never in
    the DeepSpeed JSON, which pretrain/config/deepspeed.py refuses when it sets them. The lr schedule's keys
    (lr_schedule, warmup_fraction, ...) are inherited from pretrain/schedules/lr.py, where each schedule declares
    what it reads, so a new schedule adds its keys there; the masking-rate schedule's (masking_schedule,
    mask_rate_end, ...) and the batch warmup's likewise from pretrain/schedules/, and `steps` from the loop's.
    """

    seq_len: int = setting(128, "sequence length; the shards must have been built for it")
    ds_config: str = setting(
        "",
        "DeepSpeed JSON of engine mechanics: optimizer type and its other params (ExactLamb), ZeRO stage and "
        "buckets, clipping, offload, fp16 loss scaling, data_types. It must not set lr, batch sizes, "
        "bf16/fp16.enabled or a scheduler (this section and run.precision own them; refused, naming where "
        "to move them). A relative path resolves against the RUN.json's folder",
    )
    ds_overrides: dict[str, Any] = setting(
        {},
        'deep-merged into ds_config, e.g. {"zero_optimization": {"stage": 2}}; the keys ds_config must not '
        "set are refused here too",
    )
    lr: float | None = setting(
        None,
        "peak learning rate, reached at the end of warmup (required, > 0)",
    )
    batch_size: int | None = setting(
        None,
        "global batch: sequences per optimizer step over all data-parallel ranks (of one group under "
        "codistillation). Set two of batch_size, micro_batch_size, gradient_accumulation_steps; the third "
        "is derived for the ranks that run the job. batch_size + micro_batch_size lets the accumulation "
        "follow the GPU count, so the same config runs, and resumes, on any number of GPUs",
    )
    micro_batch_size: int | None = setting(
        None,
        "sequences per rank per forward/backward (DeepSpeed's train_micro_batch_size_per_gpu); see batch_size",
    )
    gradient_accumulation_steps: int | None = setting(
        None,
        "micro-batches per rank per optimizer step; see batch_size (unset: derived)",
    )
    max_predictions: int | None = setting(
        None,
        "MLM prediction slots per sequence; default: the manifest's masking.max_predictions for seq_len",
    )
    shards: str | None = setting(None, "this phase's data_prep folder; default: data.shards")
    init_from: str | None = setting(
        None,
        "initial weights: a checkpoint folder or tag folder, or a Hugging Face export of this toolkit; "
        "default: the previous phase's end (phase1: fresh weights)",
    )

@dataclass
class CheckpointSection(CadenceSection):
    """When checkpoints are written, how many are kept, and the Hugging Face export."""

    dir: str | None = setting(None, "checkpoint folder; default: <run.dir>/checkpoints")
    adopt: bool = setting(
        False,
        "take over a checkpoint.dir that another run's record (run_owner.json) names: this run then resumes "
        "from and prunes its checkpoints. Without it such a folder is refused in one line",
    )
    keep_last: int = setting(3, "step checkpoints kept (>= 1); every phase-end checkpoint is kept besides")
    export_at_phase_end: bool = setting(
        True,
        "export a Hugging Face model to <run.dir>/export/<phase> at each phase end (verified against the "
        "checkpoint)",
    )


@dataclass
class LoggingSection(QualitySection, ValidationSection):
    """What rank 0 reports: TensorBoard, the progress bar, validation, MFU."""

    tensorboard: bool = setting(True, "TensorBoard events and metrics.jsonl in <run.dir>/tensorboard")
    peak_tflops: float | None = setting(
        None,
        "peak TFLOP/s per device for MFU; null: looked up from the GPU name (CPU: none, no MFU)",
    )
@dataclass
class RunConfig:
    """The whole run: one typed section per JSON object of RUN.json."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    phase1: PhaseSection = field(default_factory=PhaseSection)
    phase2: PhaseSection = field(default_factory=lambda: PhaseSection(seq_len=512))
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    failures: FailureSection = field(default_factory=FailureSection)
    # Optional features' sections by RUN.json name (pretrain/plugin.py), e.g. "codistill"; each is present only
    # when the RUN.json or an override names it, and serialises back under its own top-level key.
    plugins: dict[str, Any] = field(default_factory=dict)

    def phase(self, name: str) -> PhaseSection:
        if name not in PHASE_NAMES:
            raise ConfigError(f"run.phases: unknown phase {name!r}; expected names from {list(PHASE_NAMES)}")
        return getattr(self, name)

    def phases(self) -> list[tuple[str, PhaseSection]]:
        """run.phases with their sections, in run order: what a check of every phase walks."""
        return [(name, self.phase(name)) for name in self.run.phases]

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.run.dir) / CHECKPOINTS

    def to_dict(self) -> dict[str, Any]:
        """The RUN.json form: core sections, then each plug-in's section under its own name."""
        data = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name != PLUGINS_FIELD}
        return {**data, **{name: dataclasses.asdict(section) for name, section in self.plugins.items()}}
