"""The run's shards against its config: every phase's folder checked (data/shard_checks.py), one vocab and one
objective for the whole run, and the model's vocab and positions checked against them.

One function for the launch-time check (pretrain/launch/preflight.py) and the rank's plan (run_plan.py), so both
say the same thing in the same words, and each folder's manifest is read once per process (at 1,024 ranks on a
shared filesystem every extra read is a metadata storm). It walks the config's phases, so it sits on the plan's
floor: below it, data/ checks one folder on plain values and never sees a RunConfig.

Light: the standard library and the shard format's reader (pyarrow); no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data_prep.shard_format.shards import Manifest
from pretrain.config.sections import RunConfig
from pretrain.data.shard_checks import PhaseShards, check_one_objective, check_phase_shards, read_manifest
from pretrain.errors import ConfigError


def check_run_shards(config: RunConfig, verify_checksums: bool = False) -> dict[str, PhaseShards]:
    """check_phase_shards for every phase of the run, with one vocab for all of them; a folder two phases
    share is read once."""
    found: dict[str, PhaseShards] = {}
    manifests: dict[Path, Manifest] = {}
    vocab_sha = None
    keys: dict[str, str] = {}
    for name, phase in config.phases():
        key = f"{name}.shards" if phase.shards else "data.shards"
        folder = phase.shards or config.data.shards
        same = Path(folder).resolve()  # the cache key; messages name the folder as the user spelled it
        if same not in manifests:
            manifests[same] = read_manifest(folder, key)
        found[name] = check_phase_shards(manifests[same], phase.seq_len, phase.max_predictions, key,
                                         expected_vocab_sha256=vocab_sha, verify_checksums=verify_checksums,
                                         mask_probability=config.data.mask_probability)
        vocab_sha = found[name].vocab_sha256
        keys[name] = key
    check_one_objective(found, keys)
    first = found[config.run.phases[0]]
    wanted = config.data.objective
    if wanted is not None and wanted != ("mlm+nsp" if first.trains_nsp else "mlm"):
        built = first.manifest.segments
        rebuild = "--segments full-sentences (or doc-sentences)" if wanted == "mlm" else "--segments nsp"
        raise ConfigError(f"data.objective: {wanted}, but {keys[config.run.phases[0]]} ({first.manifest.root}) was built "
                          f"with --segments {built}, which trains {'MLM + NSP' if first.trains_nsp else 'MLM alone'}; "
                          f"build the shards with {rebuild}, or set data.objective=null to follow them")
    return found


def model_overrides(config: RunConfig, vocab_size: int) -> tuple[dict[str, Any], int]:
    """`model.overrides` without vocab_size and max_position_embeddings, and the position count, both checked
    against the shards (vocab size) and the longest phase (positions)."""
    overrides = dict(config.model.overrides)
    if overrides.get("vocab_size", vocab_size) != vocab_size:
        raise ConfigError(
            f"model.overrides.vocab_size: {overrides['vocab_size']} differs from the shards' vocab size {vocab_size}"
        )
    overrides.pop("vocab_size", None)
    max_len = max(phase.seq_len for _, phase in config.phases())
    max_positions = overrides.pop("max_position_embeddings", max(512, max_len))
    if max_positions < max_len:
        raise ConfigError(f"model.overrides.max_position_embeddings: {max_positions} < seq_len {max_len}")
    return overrides, max_positions
