"""The recipe scaler (`./launch.sh scale`, pretrain/launch/scale.py): the paper's arithmetic, its refusals, and a
written run config that the driver's own config code accepts for the given GPU count."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.config.deepspeed import phase_ds_config
from pretrain.config.load import load_config
from pretrain.errors import ConfigError
from pretrain.launch import scale
from tests.support.paths import REPO_ROOT

LARGE_64K = REPO_ROOT / "ds_configs" / "recipes" / "bert_large_64k.json"


def test_square_root_lr_same_samples_same_warmup_steps() -> None:
    # BERT-Large phase 1 at 64K (lr 6e-3, 7,038 steps, warmup 28.43 %) -> 8K on 32 GPUs
    s = scale.scale_phase("phase1", 65536, 6e-3, 7038, 0.2843, 64, 8192, gpus=32, gpu_memory_gb=80)
    assert s.lr == pytest.approx(6e-3 / math.sqrt(8))
    assert s.steps == 7038 * 8 and s.samples == s.samples0 == 65536 * 7038
    assert s.warmup * s.steps == pytest.approx(0.2843 * 7038)  # 2,001 warmup steps either way
    assert s.warmup == pytest.approx(0.2843 / 8)
    assert (s.micro, s.accumulation) == (64, 4) and s.micro * s.accumulation * s.gpus == 8192
    # larger than the reference: lr up by sqrt(2), half the steps, twice the warmup fraction
    up = scale.scale_phase("phase1", 65536, 6e-3, 7038, 0.2843, 64, 131072, gpus=256, gpu_memory_gb=80)
    assert (
        up.lr == pytest.approx(6e-3 * math.sqrt(2))
        and up.steps == 3519
        and up.warmup == pytest.approx(0.5686)
    )


def test_the_memory_hint_and_an_explicit_micro_batch() -> None:
    half = scale.scale_phase("phase2", 32768, 4e-3, 1563, 0.128, 16, 4096, gpus=32, gpu_memory_gb=40)
    assert (half.micro, half.accumulation) == (8, 16)
    small = scale.scale_phase("phase2", 32768, 4e-3, 1563, 0.128, 16, 4096, gpus=32, gpu_memory_gb=1)
    assert (small.micro, small.accumulation) == (1, 128)  # never below one sequence
    odd = scale.scale_phase("phase1", 65536, 6e-3, 7038, 0.2843, 64, 96 * 24, gpus=24, gpu_memory_gb=80)
    assert (odd.micro, odd.accumulation) == (48, 2)  # the largest divisor of 96 that fits 64
    fixed = scale.scale_phase(
        "phase1", 65536, 6e-3, 7038, 0.2843, 64, 8192, gpus=32, gpu_memory_gb=80, micro=16
    )
    assert (fixed.micro, fixed.accumulation) == (16, 16)
    assert [scale.largest_divisor_at_most(n, lim) for n, lim in ((96, 64), (97, 64), (8, 100), (12, 5))] == [
        48,
        1,
        8,
        4,
    ]


@pytest.mark.parametrize(
    ("batch", "gpus", "micro", "message"),
    [
        (1000, 32, None, "--phase1-batch 1000: not divisible by --gpus 32"),
        (0, 8, None, "--phase1-batch 0: must be > 0"),
        (262144, 8, None, "--phase1-batch 262144: too large for this phase"),
        (8192, 32, 48, "--phase1-micro 48: must divide the per-GPU batch 8192 / 32 = 256"),
    ],
)
def test_refusals_name_the_value(batch: int, gpus: int, micro: int | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        scale.scale_phase(
            "phase1", 65536, 6e-3, 7038, 0.2843, 64, batch, gpus=gpus, gpu_memory_gb=80, micro=micro
        )


@pytest.mark.parametrize(
    "shipped", ["bert_large_64k.json", "bert_large_32k.json", "bert_base.json"]
)
def test_the_driver_accepts_the_written_config(shipped: str, tmp_path: Path) -> None:
    source = REPO_ROOT / "ds_configs" / "recipes" / shipped
    out = tmp_path / "elsewhere" / "mine.json"  # another folder: the DeepSpeed JSON paths must follow
    assert (
        scale.main(
            [
                str(source),
                "--phase1-batch",
                "8192",
                "--phase2-batch",
                "4096",
                "--gpus",
                "32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    original, config = load_config(source), load_config(out)
    written = json.loads(out.read_text(encoding="utf-8"))
    for name, batch in (("phase1", 8192), ("phase2", 4096)):
        before, after = original.phase(name), config.phase(name)
        assert Path(after.ds_config).resolve() == Path(before.ds_config).resolve()
        assert not Path(written[name]["ds_config"]).is_absolute()
        ds0 = phase_ds_config(original, name, 32, "cuda", bf16_supported=True)
        ds = phase_ds_config(config, name, 32, "cuda", bf16_supported=True)  # the driver's batch arithmetic
        k = batch / ds0["train_batch_size"]
        assert ds["train_batch_size"] == batch
        assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 32 == batch
        assert ds["optimizer"]["params"]["lr"] == pytest.approx(
            ds0["optimizer"]["params"]["lr"] * math.sqrt(k), rel=1e-5
        )
        assert after.steps * batch == pytest.approx(before.steps * ds0["train_batch_size"], rel=1e-4)
        assert after.warmup_fraction * after.steps == pytest.approx(
            before.warmup_fraction * before.steps, rel=1e-4
        )
        assert ds["zero_optimization"] == ds0["zero_optimization"] and ds["bf16"] == ds0["bf16"]
        assert (after.seq_len, after.decay_power) == (before.seq_len, before.decay_power)
        # the accumulation is derived for the ranks that run it (elastic resume): the same global batch
        # on 16 GPUs, and a count that does not divide it is the driver's config error
        assert "gradient_accumulation_steps" not in written[name] and "ds_overrides" not in written[name]
        assert (written[name]["batch_size"], written[name]["micro_batch_size"]) == (
            batch, ds["train_micro_batch_size_per_gpu"])
        half = phase_ds_config(config, name, 16, "cuda", bf16_supported=True)
        assert half["train_batch_size"] == batch
        assert half["gradient_accumulation_steps"] == 2 * ds["gradient_accumulation_steps"]
        with pytest.raises(ConfigError, match="not divisible"):
            phase_ds_config(config, name, 24, "cuda", bf16_supported=True)
    assert config.run.dir.endswith("mine") and config.run.dir != original.run.dir
    assert (config.model, config.data, config.logging) == (original.model, original.data, original.logging)


def test_one_phase_only_and_errors_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p1.json"
    assert scale.main([str(LARGE_64K), "--phase1-batch", "16384", "--gpus", "64", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "phase1: global batch 65,536 -> 16,384" in printed and "phase2:" not in printed.split("Why:")[0]
    assert "F1 90.584" in printed and "batch 16,384: lr 0.00354" in printed  # the paper's reference points
    written = json.loads(out.read_text(encoding="utf-8"))
    assert written["phase2"]["steps"] == 1563 and "ds_overrides" not in written["phase2"]
    assert (written["phase2"]["batch_size"], written["phase2"]["lr"]) == (32768, 4e-3)  # phase 2 as shipped
    for argv, message in (
        ([str(LARGE_64K), "--out", str(out)], "give --phase1-batch and/or --phase2-batch"),
        (
            [str(LARGE_64K), "--phase1-batch", "4096", "--gpus", "0", "--out", str(out)],
            "--gpus 0: must be > 0",
        ),
        ([str(tmp_path / "none.json"), "--phase1-batch", "4096", "--out", str(out)], "none.json"),
    ):
        assert scale.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_launch_sh_scale(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    out = tmp_path / "large_4k.json"
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "launch.sh"), "scale", str(LARGE_64K), "--phase1-batch", "4096",
         "--phase2-batch", "2048", "--gpus", "8", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("+ ") and "-m pretrain.launch.scale" in proc.stdout.splitlines()[0]
    assert "0.006 -> 0.0015" in proc.stdout and "7,038 -> 112,608" in proc.stdout
    assert load_config(out).phase1.steps == 112608
    # the checkpoint interval for 8 GPUs, from the largest phase's checkpoint (BERT-Large, ZeRO, bf16) at 1 GB/s
    assert ("Checkpoints: save every 98.2 min (checkpoint.every_minutes; Young/Daly for a 4.71 s save and a failure "
            "every 1,024 h, one per 8,192 GPU-hours on 8 devices") in proc.stdout, proc.stdout
    bad = subprocess.run(
        ["bash", str(REPO_ROOT / "launch.sh"), "scale", str(LARGE_64K), "--phase1-batch", "4100",
         "--gpus", "8",
         "--out", str(tmp_path / "bad.json")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "--phase1-batch 4100: not divisible by --gpus 8" in bad.stderr
    assert not (tmp_path / "bad.json").exists()


def test_a_run_config_that_pins_the_accumulation(tmp_path: Path) -> None:
    """A phase with all three batch keys: the written config unpins the accumulation (drops the key) so the
    driver derives it; a phase without a global batch has nothing to scale from and is refused."""
    recipes = REPO_ROOT / "ds_configs" / "recipes"
    run = json.loads((recipes / "tiny_cpu.json").read_text(encoding="utf-8"))  # micro 4 x accumulation 2
    for name in ("phase1", "phase2"):
        run[name].update(ds_config=str(recipes / run[name]["ds_config"]), batch_size=16)
    (tmp_path / "run.json").write_text(json.dumps(run), encoding="utf-8")
    out = tmp_path / "out" / "scaled.json"
    argv = [str(tmp_path / "run.json"), "--phase1-batch", "64", "--gpus", "2", "--out", str(out)]
    assert scale.main(argv) == 0
    written = json.loads(out.read_text(encoding="utf-8"))
    assert (written["phase1"]["batch_size"], written["phase1"]["micro_batch_size"]) == (64, 4)
    assert "gradient_accumulation_steps" not in written["phase1"] and "ds_overrides" not in written["phase1"]
    assert written["phase1"]["lr"] == pytest.approx(5e-3 * 2) and written["phase1"]["steps"] == 10
    ds1 = phase_ds_config(load_config(out), "phase1", 2, "cpu")
    assert (ds1["train_batch_size"], ds1["gradient_accumulation_steps"]) == (64, 8)
    unscaled = tmp_path / "no_global.json"
    with pytest.raises(ConfigError, match="phase1.batch_size: not set, so no batch_size to scale from"):
        scale.run(scale.parse_args([str(recipes / "tiny_cpu.json"), "--phase1-batch", "64", "--out",
                                    str(unscaled)]))
