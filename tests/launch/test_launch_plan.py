"""pretrain/launch/plan.py, table-driven: the launch options, the launcher choice, pretrain's --config check,
the ranks' environment, the DeepSpeed env file, the --help text and the assignments launch.sh evals.

No GPU, SLURM or DeepSpeed needed. test_launch_sh.py checks the same rules through launch.sh itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.distributed.cluster import ClusterError, pdsh_quote
from pretrain.launch.plan import (
    VALUE_OPTIONS,
    LaunchOptions,
    choose_launcher,
    ds_env_lines,
    launch_values,
    main,
    parse_launch_options,
    pretrain_config,
    rank_env,
    usage,
)
from tests.support.paths import REPO_ROOT


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--gpus", "4", "--x.y=1", "--gpus=8"], LaunchOptions(gpus="8", module_args=["--x.y=1"])),
        (["--launcher=none", "--cpu", "--config", "c", "--", "--gpus", "2", "--"],
         LaunchOptions(launcher="none", cpu=True, module_args=["--config", "c", "--gpus", "2", "--"], verbatim_from=2)),
        (["--hostfile", "--nodes", "--master-addr=a=b"], LaunchOptions(hostfile="--nodes", master_addr="a=b")),
        (["--gpus=", "--gpusx=1", "-x", "--cpu=1"], LaunchOptions(module_args=["--gpusx=1", "-x", "--cpu=1"])),
        (["--"], LaunchOptions(verbatim_from=0)),
        (["--master-port", "6000", "--nodes", "2"], LaunchOptions(master_port="6000", nodes="2")),
    ],
)  # fmt: skip
def test_parse_launch_options(args: list[str], expected: LaunchOptions) -> None:
    assert parse_launch_options(args) == expected


@pytest.mark.parametrize("option", sorted(VALUE_OPTIONS))
def test_an_option_without_its_value_is_an_error(option: str) -> None:
    with pytest.raises(ClusterError, match=f"^{option} needs a value$"):
        parse_launch_options(["--config", "c", option])


@pytest.mark.parametrize(
    ("args", "env", "launcher"),
    [
        ([], {}, "local"),
        ([], {"SLURM_JOB_ID": "7"}, "slurm"),
        ([], {"SLURM_JOB_ID": ""}, "local"),
        (["--hostfile", "h"], {"SLURM_JOB_ID": "7"}, "hostfile"),
        (["--launcher", "local", "--gpus", "2"], {"SLURM_JOB_ID": "7"}, "local"),
        (["--launcher", "none", "--cpu", "--gpus", "1", "--nodes", "1"], {}, "none"),
        (["--cpu", "--gpus", "010", "--nodes", "01", "--master-port", "065535"], {}, "local"),  # decimal, not octal
        (["--hostfile", "h", "--nodes", "2:4"], {}, "hostfile"),  # pretrain carries on with 2 to 4 nodes
    ],
)
def test_choose_launcher(args: list[str], env: dict[str, str], launcher: str) -> None:
    assert choose_launcher(parse_launch_options(args), env) == launcher


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--launcher", "mpi", "--gpus", "x"], {}, "--launcher must be auto, local, hostfile, slurm or none, got 'mpi'"),
        (["--gpus", "two", "--nodes", "0"], {}, "--gpus must be a positive integer, got 'two'"),
        (["--gpus", "0"], {}, "--gpus must be a positive integer, got '0'"),
        (["--gpus", "２"], {}, "--gpus must be a positive integer, got '２'"),  # a digit, but not ASCII
        (["--nodes", "-1"], {}, "--nodes must be a positive integer, got '-1'"),
        (["--master-port", "65536"], {}, "--master-port must be a port number (1-65535), got '65536'"),
        (["--master-port", "0"], {}, "--master-port must be a port number (1-65535), got '0'"),
        (["--launcher", "hostfile"], {}, "--launcher hostfile needs --hostfile FILE"),
        (["--launcher", "slurm", "--hostfile", "h"], {"SLURM_JOB_ID": "7"},
         "--hostfile cannot be combined with --launcher slurm"),
        (["--launcher", "slurm"], {}, "--launcher slurm: not inside a SLURM allocation (SLURM_JOB_ID is unset)"),
        (["--launcher", "none", "--gpus", "2"], {}, "--launcher none runs one process; drop --gpus 2"),
        (["--nodes", "2", "--gpus", "1"], {}, "--nodes 2 needs --hostfile or a SLURM allocation"),
        (["--launcher", "none", "--nodes", "3"], {}, "--nodes 3 needs --hostfile"),
        (["--nodes", "3:2"], {"SLURM_JOB_ID": "7"}, "--nodes MIN:MAX needs 0 < MIN <= MAX, got '3:2'"),
        (["--nodes", "1:2"], {}, "--nodes 1:2 needs --hostfile or a SLURM allocation"),
        (["--cpu"], {}, "--cpu needs --gpus N (the number of CPU ranks per node)"),
        (["--cpu"], {"SLURM_JOB_ID": "7"}, "--cpu needs --gpus N"),
    ],
)  # fmt: skip
def test_choose_launcher_errors(args: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ClusterError) as raised:
        choose_launcher(parse_launch_options(args), env)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize(
    ("args", "config"),
    [
        (["--config", "run.json", "--phase1.steps=3", "--run.dir=a b"], "run.json"),
        (["--config=a.json", "--config", "b.json"], "b.json"),  # the last one wins
        (["--config", "--", "c.json"], "c.json"),  # the value may follow "--"
        (["--config", "c.json", "-x", "plain", "--", "--lr", "3"], "c.json"),  # after "--": not checked
        (["--config", "--a.b=1"], "--a.b=1"),
        (["--config.x=1", "--config", "c"], "c"),  # an override, not --config
    ],
)
def test_pretrain_config(args: list[str], config: str) -> None:
    assert pretrain_config(parse_launch_options(args)) == config


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "c", "--lr", "3"], "pretrain: unknown option '--lr' (overrides look like --section.key=value"),
        (["--config", "c", "--phase1.lr", "3"], "pretrain: unknown option '--phase1.lr'"),  # no "=": not an override
        (["--config", "c", "--a=b.c"], "pretrain: unknown option '--a=b.c'"),  # the "." must come before the "="
        (["--gpus", "2"], "pretrain needs --config RUN.json"),
        (["--config="], "pretrain needs --config RUN.json"),
        (["--", "--config", "c"], "pretrain needs --config RUN.json"),
    ],
)
def test_pretrain_config_errors(args: list[str], message: str) -> None:
    with pytest.raises(ClusterError) as raised:
        pretrain_config(parse_launch_options(args))
    assert str(raised.value).startswith(message)


# ---------------------------------------------------------------------------------------------- environment
def test_rank_env_defaults_and_the_users_own_values() -> None:
    assert rank_env({"PYTHONPATH": "/repo"}, ranks=4, cpu_count=64) == {
        "OMP_NUM_THREADS": "16", "TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "WARN", "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": "/repo", "PYTHONSAFEPATH": "1",  # no working folder on the ranks' import path
    }  # fmt: skip
    assert rank_env({}, ranks=8, cpu_count=4)["OMP_NUM_THREADS"] == "1"  # at least one thread
    assert rank_env({}, ranks=0, cpu_count=4)["OMP_NUM_THREADS"] == "4"
    assert rank_env({}, ranks=8, cpu_count=64, cpus_per_task="6")["OMP_NUM_THREADS"] == "6"  # SLURM's grant
    user = {"OMP_NUM_THREADS": "3", "TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "INFO", "PYTHONUNBUFFERED": ""}
    values = rank_env(user, ranks=2, cpu_count=8, cpus_per_task="6", cpu=True)
    assert values["OMP_NUM_THREADS"] == "3" and values["NCCL_DEBUG"] == "INFO"
    assert values["TOKENIZERS_PARALLELISM"] == "true" and values["PYTHONUNBUFFERED"] == "1"  # empty = unset
    assert values["DS_ACCELERATOR"] == "cpu" and "DS_ACCELERATOR" not in rank_env({}, 1, 1)
    # where the ranks build DeepSpeed's ops travels with them (pdsh forwards no TORCH_* variable)
    assert rank_env({"TORCH_EXTENSIONS_DIR": "/x/ext"}, 1, 1)["TORCH_EXTENSIONS_DIR"] == "/x/ext"
    assert "TORCH_EXTENSIONS_DIR" not in rank_env({}, 1, 1)


def test_ds_env_lines_keep_the_users_files_and_let_them_win(tmp_path: Path) -> None:
    home, here = tmp_path / "home_env", tmp_path / "here_env"
    home.write_bytes(b"OMP_NUM_THREADS=3\r\n# a comment\n\n  SPACED =1 \nRAW=\xff\xfe\nLAST=x")  # CRLF, no final newline
    here.write_bytes(b"NCCL_DEBUG=INFO\nA=b=c\n")
    for file in (home, here):
        file.chmod(0o600)
    ranks = {"OMP_NUM_THREADS": "8", "NCCL_DEBUG": "WARN", "PYTHONPATH": "/repo"}
    lines = ds_env_lines(ranks, [home, tmp_path / "missing", here])
    assert lines == ["OMP_NUM_THREADS=3\r", "SPACED=1 ", "RAW=\udcff\udcfe", "LAST=x", "NCCL_DEBUG=INFO", "A=b=c",
                     "PYTHONPATH=/repo"]  # fmt: skip
    assert ds_env_lines(ranks, []) == ["OMP_NUM_THREADS=8", "NCCL_DEBUG=WARN", "PYTHONPATH=/repo"]
    # a line that is not NAME=VALUE (the name ends up in an assignment on every node) is one line naming the line
    # and the name, never the value (a token)
    for bad, said in (("not a setting", "expected NAME=VALUE, got a line without '='"),
                      ("A B=hf_1", "'A B' is not a variable name"), ("1X=hf_2", "'1X' is not a variable name"),
                      ("X;id=hf_3", "'X;id' is not a variable name"), ("export X=hf_4", "'export X' is not a variable")):
        home.write_text(f"OK=1\n{bad}\n")
        with pytest.raises(ClusterError, match=f"^'{re.escape(str(home))}' line 2: {re.escape(said)}") as raised:
            ds_env_lines(ranks, [home])
        assert "hf_" not in str(raised.value)


# ---------------------------------------------------------------------------------------------- one launch
def test_launch_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi, no scontrol
    (tmp_path / "run.json").write_text("{}")
    (tmp_path / "hosts").write_text("w1 slots=2\nw2 slots=2\n")
    values = launch_values("finetune", ["--launcher", "none", "--cpu", "--model", "m"], {}, cpu_count=8)
    assert values["LAUNCHER"] == "none" and values["MODULE_ARGS"] == ["finetune", "--model", "m"]
    assert "OMP_NUM_THREADS=8" in values["RANK_ENV"] and "DS_ACCELERATOR=cpu" in values["RANK_ENV"]
    assert "DS_ENV" not in values
    args = ["--config", "run.json", "--hostfile", "hosts", '--run.phases=["p"]']
    values = launch_values("pretrain", args, {"SLURM_JOB_ID": "7"}, cpu_count=8)
    assert (values["LAUNCHER"], values["HOSTFILE"], values["CLUSTER_MASTER_ADDR"]) == ("hostfile", "hosts", "w1")
    assert values["MODULE_ARGS"] == ["--config", "run.json", pdsh_quote('--run.phases=["p"]')]
    assert "CLUSTER_MODULE_ARGS" not in values and values["DS_ENV"] == values["RANK_ENV"]
    assert "OMP_NUM_THREADS=4" in values["RANK_ENV"]
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": "3"}
    values = launch_values("pretrain", ["--config", "run.json", "--gpus", "4"], slurm, cpu_count=8)
    assert (values["LAUNCHER"], values["CLUSTER_WORLD_SIZE"], values["CLUSTER_MASTER_PORT"]) == ("slurm", "8", "24242")
    assert "OMP_NUM_THREADS=3" in values["RANK_ENV"] and values["MODULE_ARGS"] == ["--config", "run.json"]


def test_checks_run_in_order_and_a_dry_run_only_notes_a_missing_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["--config", "missing.json", "--hostfile", "nohosts"]
    with pytest.raises(ClusterError, match="--launcher must be auto"):
        launch_values("pretrain", [*args, "--launcher", "mpi", "--lr"], {}, cpu_count=1)
    with pytest.raises(ClusterError, match="unknown option '--lr'"):
        launch_values("pretrain", [*args, "--lr"], {}, cpu_count=1)
    with pytest.raises(ClusterError, match="^pretrain: config file 'missing.json' does not exist$"):
        launch_values("pretrain", args, {}, cpu_count=1)
    notes: list[str] = []
    with pytest.raises(ClusterError, match="hostfile 'nohosts' does not exist"):
        launch_values("pretrain", args, {}, cpu_count=1, dry_run=True, note=notes.append)
    assert notes == ["pretrain: config file 'missing.json' does not exist (continuing: --dry-run)"]


def test_usage_lists_every_option_the_parser_reads() -> None:
    text = usage()
    lines = text.splitlines()
    for option, (_, left, help_lines) in VALUE_OPTIONS.items():
        entry = next(index for index, line in enumerate(lines) if line.startswith(f"  {left} "))
        assert lines[entry].endswith(help_lines[0]) and option in left
        for offset, more in enumerate(help_lines[1:], start=1):
            assert lines[entry + offset] == " " * 19 + more
    for left in ("--cpu", "--", "SLURM", "local"):
        assert any(line.startswith(f"  {left:<16} ") for line in lines), left
    assert lines[0] == "Usage: ./launch.sh [--dry-run] SUBCOMMAND [options]" and text.endswith("(and group=1)\n")


# ---------------------------------------------------------------------------------------------- CLI
AWKWARD = ["it's", 'a "b"', "$HOME `id` $(id)", "%n {a,b}", "line\nbreak", "", "~", "*", "\\", "é ✓", "--"]


def test_cli_launch_is_evaluated_by_bash(tmp_path: Path) -> None:
    """The way launch.sh calls it: a separate interpreter, arguments after --, the output eval'd."""
    (tmp_path / "hosts").write_text("w1 slots=2\nw2 slots=2\n")
    (tmp_path / "run.json").write_text("{}")
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO_ROOT), HOME=str(tmp_path))
    call = f"{sys.executable} -m pretrain.launch.plan --prog launch.sh launch --cpu-count=4 pretrain -- \"$@\""
    show = 'printf "%s\\0" "$LAUNCHER" "$CLUSTER_RANKS" "${DS_ENV[0]}" "${MODULE_ARGS[@]}"'
    script = f'set -euo pipefail; out=$({call}); eval "$out"; {show}'
    args = ["--config", "run.json", "--hostfile=hosts", "--", *AWKWARD]
    proc = subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env, check=True)
    assert proc.stdout.split("\0")[:-1] == ["hostfile", "2", "OMP_NUM_THREADS=2", "--config", "run.json",
                                            *map(pdsh_quote, AWKWARD)]  # fmt: skip
    # An argument that is not UTF-8 comes back byte for byte (one node: no pdsh quoting).
    raw = b"--x.y=\xff\xfe"
    script = f'set -euo pipefail; out=$({call}); eval "$out"; printf "%s" "${{MODULE_ARGS[-1]}}"'
    proc = subprocess.run(["bash", "-c", script, "bash", "--config", "run.json", "--gpus", "1", raw],
                          capture_output=True, cwd=tmp_path, env=env, check=True)
    assert proc.stdout == raw


def test_cli_errors_exit_2_with_the_callers_name(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "run.json").write_text("{}")
    assert main(["--prog", "launch.sh", "launch", "pretrain", "--", "--config", "run.json", "--hostfile", "none"]) == 2
    assert capsys.readouterr() == ("", "launch.sh: error: hostfile 'none' does not exist\n")
    assert main(["--prog", "launch.sh", "launch", "--dry-run", "pretrain", "--", "--config", "x.json", "--gpus", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == "launch.sh: note: pretrain: config file 'x.json' does not exist (continuing: --dry-run)\n"
    assert "LAUNCHER=local\n" in out
    assert main(["usage"]) == 0 and capsys.readouterr().out == usage()
