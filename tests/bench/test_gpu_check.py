"""bench/gpu_check/gpu_check.sh --smoke: the prepared GPU check runs end to end on CPU (CI has no GPU), through the
production step (PhaseTrainer.train_step with accumulation over the real DataLoader) on the production
engine (bf16 + ZeRO-1 + fp32 grad accumulation = BF16_Optimizer), rows saved as measured, failures
reported as rows, the estimate printed even after a kill, and a preflight that names every wheel the check
loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.launching import child_env
from tests.support.pretrain_fixtures import REPO_ROOT

SCRIPT = str(REPO_ROOT / "bench" / "gpu_check" / "gpu_check.sh")
SHIPPED = REPO_ROOT / "ds_configs" / "deepspeed" / "lamb_zero1.json"
RECIPE = REPO_ROOT / "ds_configs" / "recipes" / "bert_large_64k.json"


def smoke_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in child_env().items() if k != "DS_ACCELERATOR"}
    env.update(PYTHON=sys.executable, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), **extra)
    return env


def run_smoke(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([SCRIPT, "--smoke", "--jsonl", str(out), *flags], cwd=tmp_path,
                          env=smoke_env(tmp_path), capture_output=True, text=True, timeout=400)
    return done, read_records(out)


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def table_rows(stdout: str, first_cell: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(f"| {first_cell}")]


def test_engine_config_is_the_shipped_recipe_with_only_the_sizes_shrunk() -> None:
    from bench.gpu_check.rows import engine_config

    shipped = json.loads(SHIPPED.read_text())
    config = engine_config(RECIPE, "phase1", 4, 1)
    sizes = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    assert [config.pop(key) for key in sizes] == [4, 1, 4]
    optimizer = config.pop("optimizer")
    assert optimizer["params"].pop("lr") == 6e-3  # the recipe's phase-1 lr
    assert optimizer == shipped.pop("optimizer") and config.pop("fp16") == {"enabled": False}
    assert config == {**shipped, "bf16": {"enabled": True}}  # everything else exactly as shipped:
    assert config["bf16"] == {"enabled": True} and config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["zero_optimization"]["stage"] == 1 and config["gradient_clipping"] == 1.0
    assert engine_config(RECIPE, "phase2", 4, 1)["optimizer"]["params"]["lr"] == 4e-3


def test_preflight_stops_on_a_recipe_the_driver_refuses(tmp_path: Path) -> None:
    old = tmp_path / "old_layout.json"  # a DeepSpeed JSON of the previous layout: the batch in the file
    old.write_text(json.dumps({**json.loads(SHIPPED.read_text()), "train_batch_size": 65536}))
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "gpu_check" / "preflight.py"), "--smoke",
                           "--ds-config", str(old)], cwd=tmp_path, env=smoke_env(tmp_path, DS_ACCELERATOR="cpu"),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("gpu_check: --recipe")]
    assert f"phase1.ds_config ({old}): train_batch_size belongs to the run config: set phase1.batch_size=65536" in line
    assert not (tmp_path / "gpu_check.jsonl").exists()


def test_gpu_check_smoke_runs_the_production_step_and_saves_every_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process (the script's preflight and time limit are tested below): every row of the plan, with a spy
    # that counts the real PhaseTrainer.train_step calls and passes them through.
    from bench.gpu_check import run as gpu_check
    from pretrain.trainer import PhaseTrainer

    steps: list[tuple[int, int, bool]] = []  # (micro-batch, micro-batches per step, packing) of each call
    original = PhaseTrainer.train_step

    def counted(trainer: PhaseTrainer) -> Any:
        steps.append((trainer.train_batches.micro_batch, trainer.accumulation, trainer.train_batches.collate.packing))
        return original(trainer)

    monkeypatch.setattr(PhaseTrainer, "train_step", counted)
    previous = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "rows.jsonl"
    try:
        code = gpu_check.main(["--smoke", "--comparisons", "--jsonl", str(out), "--work-dir", str(tmp_path / "work")])
    finally:
        signal.signal(signal.SIGTERM, previous)
    printed = capsys.readouterr().out
    records = read_records(out)
    assert code == 0, printed[-3000:]
    kinds = [r["kind"] for r in records if r["kind"] != "part"]
    assert kinds == ["run", *["selftest"] * 4, *["train"] * 4, "attention", *["train"] * 4, "attention", "lamb",
                     "lamb", *["train"] * 3, "estimate", "end"]
    # each part's time saved (budgets: none under --smoke), none stopped; nothing skipped that a recipe runs
    parts = [r for r in records if r["kind"] == "part"]
    assert [r["part"] for r in parts] == ["selftest", "p1", "p2", "lamb", "p1-timer-on", "p1-big", "p2-big"]
    assert all(r["budget_s"] is None and not r["overran"] and r["seconds"] > 0 for r in parts), parts
    assert (records[-1]["stopped"], records[-1]["overran"], records[-1]["not_run"]) == (0, [], 0)
    # the file says what each throughput key measures: device MFU (padding included) is not a run's perf/mfu
    assert set(records[0]["columns"]) == {"device_tflops", "device_mfu", "model_mfu"}
    # first, the kernel self-test's verdict table: the CPU's precisions x the recipe's head size and seq_lens
    selftests = [r for r in records if r["kind"] == "selftest"]
    assert [r["name"] for r in selftests] == ["selftest-fp32-h32-s32", "selftest-fp32-h32-s64", "selftest-bf16-h32-s32",
                                              "selftest-bf16-h32-s64"]
    assert all(r["status"] == "ok" and r["verdict"] == "PASS" and r["grads_error"] <= r["grads_limit"]
               for r in selftests), selftests
    # a run on CPU compiles no layers: the compiled layer's check is skipped without --compiled-selftest
    assert {(r["compiled_verdict"], r["compiled_skip"]) for r in selftests} == {
        (None, "skipped: a run on cpu compiles no layers (--compiled-selftest runs it)")}
    assert printed.index("| self-test | device |") < printed.index("| row | model |")
    assert "| selftest-bf16-h32-s64 | cpu | bf16 | 32 | 64 | the reference varlen kernel on cpu" in printed
    assert len(table_rows(printed, "selftest-")) == 4 and "PASS (auto runs unpadded) |" in printed
    train = {r["name"]: r for r in records if r["kind"] == "train"}
    assert list(train) == ["p1", "p1-padded", "p1-full", "p1-opt", "p2", "p2-padded", "p2-packed", "p2-opt",
                           "p1-timer-on", "p1-big", "p2-big"]
    # the recipe's own rows run unpadded (its attention), the reference and packing comparisons padded rows
    assert [name for name, r in train.items() if r["unpadded"]] == ["p1", "p1-opt", "p2", "p2-opt", "p1-timer-on",
                                                                     "p1-big", "p2-big"]
    # every row ran warm-up + timed steps of the trainer, each with its own accumulation
    assert len(steps) == 2 * len(train)
    expected = [(r["micro_batch"], r["accumulation"], r["packing"]) for r in train.values() for _ in range(2)]
    assert steps == expected and {a for _, a, _ in steps} == {1, 2}
    for name, r in train.items():
        assert r["status"] == "ok", r
        # the shipped config's engine on CPU too: bf16 + ZeRO-1 + grad_accum_dtype fp32 -> BF16_Optimizer
        assert (r["precision"], r["wrapper"], r["lamb_step"]) == ("bf16", "BF16_Optimizer", "reference")
        assert r["ds_config"] == str(SHIPPED) and r["recipe"] == str(RECIPE) and r["num_workers"] == 1
        assert r["tput_timer"] == (name == "p1-timer-on")  # read back from the engine
        assert r["peak_alloc_gb"] is None and r["fits_80gb"] is None  # CPU: n/a
        if not r["packing"] and not r["unpadded"]:  # the trainer's own counts: A micro-batches of `micro` rows
            assert r["rows_per_step"] == r["micro_batch"] * r["accumulation"]
        if r["unpadded"]:  # the real tokens (rounded up to a bucket) in fewer device rows than instances
            assert r["rows_per_step"] <= r["micro_batch"] * r["accumulation"] and r["model_mfu"] is None
        assert r["inst_per_s"] == pytest.approx(r["micro_batch"] * r["accumulation"] / r["step_s"])
        assert {"device_tflops", "device_mfu", "model_mfu"} <= set(r) and not {"mfu", "tflops"} & set(r)
    assert train["p1-padded"]["data/padding_fraction"] > 0 and train["p1-full"]["data/padding_fraction"] == 0
    assert train["p2"]["rows_per_step"] < train["p2-padded"]["rows_per_step"]  # the same instances, less padding
    for check in (r for r in records if r["kind"] == "attention"):  # CPU: the reference kernel, the same loss
        assert check["status"] == "ok" and check["flash_ran"] is None and check["agree"], check
    packed, unpacked = train["p2-packed"], train["p2-padded"]  # the same instances
    assert packed["data/packing_factor"] > 1 and packed["rows_per_step"] < unpacked["rows_per_step"]
    assert packed["data/padding_fraction"] < unpacked["data/padding_fraction"]
    assert (train["p1"]["micro_batch"], train["p2"]["micro_batch"], train["p1-big"]["micro_batch"]) == (4, 4, 8)
    # printed as measured: headers first, one markdown row per saved row, the estimate labelled as one
    assert printed.index("| row | model |") < printed.index("| p1 | tiny | 32 | 4 x 2 | padded unpadded | off |")
    assert len(table_rows(printed, "p")) == len(train) + 2 and "| n/a / n/a | n/a |" in printed
    # the compile column: CPU runs the unpadded layers eager; the padded rows have no layer function to compile
    assert table_rows(printed, "p1 | ")[0].endswith("| n/a / n/a | n/a | eager |")
    assert table_rows(printed, "p1-padded | ")[0].endswith("| n/a | n/a (padded rows) |")
    assert not any(key.startswith("compile") for r in train.values() for key in r)
    assert "| p1-attention | tiny | 32 | 4 | n/a (CPU: reference kernel) |" in printed
    assert "### ESTIMATE (not measured)" in printed and "SMOKE RUN" in printed
    (estimated,) = [r for r in records if r["kind"] == "estimate"]
    table = estimated["estimates"]
    assert len(table) == 3 * 2 * 3 and all(e["status"] == "ok" for e in table)  # 3 recipes, 2 phases, 3 counts
    e = next(e for e in table if (e["recipe"], e["phase"], e["gpus"]) == ("bert_large_64k", "phase1", 8))
    assert e["accumulation"] == 65536 // (4 * 8) and e["steps"] == 7038
    reference, fused = (r for r in records if r["kind"] == "lamb")
    assert reference["status"] == "ok" and reference["step_ms"] > 0 and reference["floor_ms"] > 0
    assert fused["status"] == "skipped" and "| tiny fused | fused: skipped:" in printed


def test_failing_rows_are_reported_and_every_other_row_is_still_measured(tmp_path: Path) -> None:
    # Two real failures in one run (CPU time is shared): micro-batch 0 at phase 2 is an impossible
    # shape (the driver's config code refuses it), and torch.compile gets a C++ compiler that does not
    # exist, so the fused LAMB step cannot build.
    done, records = run_smoke(tmp_path, "--rows", "p1,p2,lamb", "--phase2", "64:0", "--fused-on-cpu",
                              "--inductor-cxx", "/nonexistent/c++")
    assert done.returncode == 1, done.stderr[-3000:]
    train = [r for r in records if r["kind"] == "train"]
    assert [(r["name"], r["status"]) for r in train] == [("p1", "ok"), ("p2", "failed")]
    assert "phase2.batch_size: must be a positive integer, got 0" in train[1]["reason"]
    (ok_row,) = table_rows(done.stdout, "p1 | tiny | 32 | 4 x 2 | padded unpadded | off | BF16_Optimizer")
    assert ok_row.split("|")[8].strip() == f"{train[0]['step_s']:.3f}"
    assert "| p2 | tiny | 64 | 0 x 2 | varied unpadded | off | failed: ConfigError:" in done.stdout
    # the reference LAMB step is measured; the fused one is one row saying why it failed
    reference, fused = (r for r in records if r["kind"] == "lamb")
    assert reference["status"] == "ok" and reference["step_ms"] > 0
    assert fused["status"] == "failed" and "/nonexistent/c++" in fused["reason"]
    (fused_row,) = table_rows(done.stdout, "tiny fused | fused: failed: ")
    assert "C++ compiler" in fused_row
    # the estimate still comes, from what was measured: phase 1 without the boundary row, phase 2 none
    (estimated,) = [r for r in records if r["kind"] == "estimate"]
    by_phase = {(e["recipe"], e["phase"]): e for e in estimated["estimates"] if e["gpus"] == 8}
    assert by_phase[("bert_large_64k", "phase1")]["source"] == ("p1, boundary not separated (inside ms / micro) "
                                                                "(padded lengths, unpadded)")
    assert by_phase[("bert_large_64k", "phase2")]["status"] == "no unpadded row of tiny at seq 64 x micro 0"
    assert records[-1]["kind"] == "end" and records[-1]["failed"] == 2
    # the preflight named the wheels; what the run loaded later is torch's own (nothing else to carry)
    from bench.gpu_check.preflight import requirement_closure

    preflight, end = records[0], records[-1]
    assert {"deepspeed", "transformers", "tokenizers", "safetensors", "numpy", "pyarrow"} <= set(preflight["carry"])
    assert "torch" in preflight["with_torch"] and "gpu_check preflight: wheels the check loads" in done.stdout
    torch_stack, _ = requirement_closure(["torch"])
    # pyarrow imports pandas when one is installed (writing the synthetic shards) and works without it
    optional, _ = requirement_closure(["pandas"]) if "pandas" in end["loaded_lazily"] else (set(), None)
    missed = set(end["distributions"]) - set(preflight["carry"]) - set(preflight["with_torch"])
    assert {name.lower().replace("_", "-") for name in missed} <= torch_stack | optional, missed


def test_a_killed_run_keeps_the_rows_measured_before_the_kill(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    proc = subprocess.Popen([SCRIPT, "--smoke", "--jsonl", str(out), "--rows", "p1,p1-opt", "--steps", "4"],
                            cwd=tmp_path, env=smoke_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    printed = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("| p1 |"):
                printed.append(line.strip())
                os.killpg(proc.pid, signal.SIGTERM)  # what `timeout` sends at the time limit
                break
        rest = proc.stdout.read()
        returncode = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert printed and returncode != 0
    records = read_records(out)
    saved = [r for r in records if r["kind"] == "train"]
    assert 1 <= len(saved) <= 2 and saved[0]["name"] == "p1" and saved[0]["status"] == "ok"
    assert printed[0].startswith("| p1 | tiny | 32 | 4 x 2 | padded unpadded | off | BF16_Optimizer")
    # the estimate from the rows so far, then the end record saying why it stopped
    assert [r["kind"] for r in records[-2:]] == ["estimate", "end"]
    assert records[-1]["status"].startswith("killed by signal 15") and "Stopped at the time limit" in rest


def test_gpu_check_names_missing_wheels_and_installs_nothing(tmp_path: Path) -> None:
    fake = tmp_path / "python3"
    # a "python" without the packages: the script must stop with the list, before any work
    fake.write_text("#!/bin/sh\nexec /usr/bin/env python3 -S -I \"$@\"\n")
    fake.chmod(0o755)
    done = subprocess.run([SCRIPT, "--smoke"], cwd=tmp_path,
                          env=child_env(PYTHON=str(fake)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "missing Python packages" in done.stderr and "deepspeed" in done.stderr
    assert not (tmp_path / "gpu_check.jsonl").exists() and "| model |" not in done.stdout


def test_preflight_names_every_missing_wheel_in_one_line(tmp_path: Path) -> None:
    # this interpreter's site-packages without hjson and py-cpuinfo (two of deepspeed's requirements)
    site = Path(next(p for p in sys.path if p.endswith("site-packages") and (Path(p) / "deepspeed").is_dir()))
    partial = tmp_path / "site"
    partial.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(("hjson", "cpuinfo", "py_cpuinfo")):
            (partial / entry.name).symlink_to(entry)
    preflight = str(REPO_ROOT / "bench" / "gpu_check" / "preflight.py")
    done = subprocess.run([sys.executable, "-S", preflight, "--smoke"],
                          cwd=tmp_path, env=child_env(PYTHONPATH=str(partial), DS_ACCELERATOR="cpu"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    (line,) = [line for line in done.stderr.splitlines() if "missing Python packages" in line]
    assert "hjson" in line and "py-cpuinfo" in line


def _cache_seen(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], Path | None]:
    """The script up to its preflight, with a "python" that records the TORCHINDUCTOR_CACHE_DIR the check would
    get and stops (exit 3): the cache's setup, tested without a GPU or a real check."""
    seen = tmp_path / "seen.txt"
    fake = tmp_path / "python3"
    fake.write_text(f'#!/bin/sh\nprintf %s "$TORCHINDUCTOR_CACHE_DIR" > {seen}\nexit 3\n')
    fake.chmod(0o755)
    base = {k: v for k, v in child_env().items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run([SCRIPT, "--smoke"], cwd=tmp_path, env={**base, "PYTHON": str(fake), **env},
                          capture_output=True, text=True, timeout=60)
    return done, Path(seen.read_text()) if seen.exists() else None


def _foreign_folder(path: Path) -> Path:
    """A folder another user owns: made and given away as root; else one root owns already."""
    if os.geteuid() != 0:
        return Path("/usr/share")
    path.mkdir(mode=0o755)
    os.chown(path, 65534, 65534)
    return path


def test_the_inductor_cache_is_a_private_folder_of_this_user(tmp_path: Path) -> None:
    # unset: torch's per-user default in the temp folder, made 0700
    temp = tmp_path / "tmp"
    temp.mkdir()
    done, cache = _cache_seen(tmp_path, TMPDIR=str(temp))
    assert done.returncode == 3, done.stderr
    assert cache is not None and cache.parent == temp and cache.name.startswith("torchinductor_")
    assert cache.stat().st_uid == os.geteuid() and cache.stat().st_mode & 0o777 == 0o700
    # someone else made that default first (mode 0777, the attack): a fresh mktemp -d folder instead, said in a line
    os.chmod(cache, 0o777)
    done, fresh = _cache_seen(tmp_path, TMPDIR=str(temp))
    assert done.returncode == 3 and fresh is not None and fresh != cache and fresh.parent == temp
    assert fresh.stat().st_mode & 0o777 == 0o700 and not any(fresh.iterdir())
    assert f"{cache} is writable by group or others (mode 777)" in done.stderr
    # given and absent: made 0700 and used
    wanted = tmp_path / "mine" / "inductor"
    done, given = _cache_seen(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(wanted))
    assert done.returncode == 3 and given == wanted and wanted.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("kind", ["world-writable", "group-writable", "foreign", "link"])
def test_an_inductor_cache_others_can_write_is_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "shared_cache"
    if kind == "foreign":
        folder = _foreign_folder(folder)
    elif kind == "link":
        (tmp_path / "real").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "real")
    else:
        folder.mkdir()
        os.chmod(folder, 0o777 if kind == "world-writable" else 0o770)
    done, cache = _cache_seen(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(folder))
    assert done.returncode == 2 and cache is None, "refused before any Python ran"
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"gpu_check: TORCHINDUCTOR_CACHE_DIR={folder} ") and "only you can write" in line
