"""launch.sh: the exact commands it prints (--dry-run) for local GPUs, a hostfile and a SLURM
allocation (fake SLURM_* variables), the per-task SLURM wrapper run for real, and clear errors."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from pretrain.launch.rendezvous import this_machine
from tests.support.launching import FAKE_PYTHON, clean_env
from tests.support.paths import REPO_ROOT

LAUNCH = REPO_ROOT / "launch.sh"


def launch(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(LAUNCH), *args], cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=60
    )


def printed_commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def exported(commands: list[list[str]]) -> dict[str, str]:
    values: dict[str, str] = {}
    for command in commands:
        if command[0] == "export":
            values.update(item.split("=", 1) for item in command[1:])
    return values


@pytest.fixture
def run_json(tmp_path: Path) -> Path:
    path = tmp_path / "run.json"
    path.write_text("{}\n")
    return path


def test_local_gpus_dry_run_prints_the_elastic_agent_command(tmp_path: Path, run_json: Path) -> None:
    """pretrain on this machine runs under our elastic agent (pretrain/launch/agent.py), which is handed the
    command that resumes (for its error line) and the driver's arguments as typed."""
    args = ["--config", "run.json", "--gpus", "4", "--phase1.steps=3", "--run.dir=out dir"]
    proc = launch(["--dry-run", "pretrain", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    resume = commands[-1][10]
    assert shlex.split(resume) == ["./launch.sh", "pretrain", *args], resume  # bash's quoting, read back
    assert commands[-1] == [
        FAKE_PYTHON, "-m", "pretrain.launch.agent", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
        "--master-port", "29500", "--resume-command", resume, "--",
        "--config", "run.json", "--phase1.steps=3", "--run.dir=out dir",
    ]  # fmt: skip
    env = exported(commands)
    assert env["TOKENIZERS_PARALLELISM"] == "false" and env["NCCL_DEBUG"] == "WARN"
    assert env["PYTHONPATH"].split(":")[0] == str(REPO_ROOT)
    assert int(env["OMP_NUM_THREADS"]) == max(1, (os.cpu_count() or 1) // 4)
    assert "DS_ACCELERATOR" not in env


def test_local_respects_visible_devices_and_user_env(tmp_path: Path, run_json: Path) -> None:
    proc = launch(
        ["pretrain", "--dry-run", "--config", "run.json", "--gpus", "2"],
        tmp_path,
        CUDA_VISIBLE_DEVICES="3,5,6",
        OMP_NUM_THREADS="7",
    )
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    # the agent's 2 ranks open local devices 0 and 1 of CUDA_VISIBLE_DEVICES (3 and 5), which it passes on as is
    assert commands[-1][3:5] == ["--nproc-per-node", "2"]
    assert "CUDA_VISIBLE_DEVICES" not in exported(commands)
    assert exported(commands)["OMP_NUM_THREADS"] == "7"
    proc = launch(["squad", "finetune", "--dry-run", "--gpus", "2", "--model", "m", "--dev", "d", "--out", "o"],
                  tmp_path, CUDA_VISIBLE_DEVICES="3,5,6")
    assert printed_commands(proc.stdout)[-1][3:5] == ["--include", "localhost:3,5"]  # the DeepSpeed launcher's way


def test_cpu_ranks_and_single_process(tmp_path: Path, run_json: Path) -> None:
    proc = launch(["--dry-run", "pretrain", "--cpu", "--gpus", "2", "--config", "run.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    assert exported(commands)["DS_ACCELERATOR"] == "cpu"
    assert commands[-1][3:5] == ["--nproc-per-node", "2"]
    proc = launch(
        ["--dry-run", "squad", "finetune", "--cpu", "--launcher", "none", "--model", "m", "--dev", "d", "--out", "o"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert printed_commands(proc.stdout)[-1] == [
        FAKE_PYTHON, "-u", "-m", "pretrain.finetune.squad", "finetune", "--model", "m", "--dev", "d", "--out", "o",
    ]  # fmt: skip


def test_hostfile_dry_run(tmp_path: Path, run_json: Path) -> None:
    (tmp_path / "hosts").write_text("# two nodes\nworker-1 slots=8\n\nworker-2 slots=8  # second\n")
    proc = launch(
        ["--dry-run", "pretrain", "--config", "run.json", "--hostfile", "hosts", "--gpus", "8",
         "--master-port", "6000", "--", "--not-checked"],
        tmp_path,
        NCCL_SOCKET_IFNAME="ib0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    # pretrain: our node starter runs the elastic agent on every node through pdsh (pretrain/launch/nodes.py), and
    # serves their rendezvous store on this machine, as the nodes reach it (here: no node resolves, its name)
    assert commands[-1][:10] == [
        FAKE_PYTHON, "-m", "pretrain.launch.nodes", "--hostfile", "hosts", "--args-quoted", "--nproc-per-node", "8",
        "--rdzv-endpoint", f"{this_machine(['worker-1', 'worker-2'])}:6000",
    ]  # fmt: skip
    assert commands[-1][10] == "--resume-command" and commands[-1][-4:] == [
        "--", "--config", "run.json", "--not-checked"]
    # Variables pdsh would not carry travel in an env file, exported on every node; --dry-run names them only.
    env_file_note = next(line for line in proc.stdout.splitlines() if line.startswith("# DS_ENV_FILE"))
    assert env_file_note.split(": ", 1)[1].split() == [
        "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "PYTHONUNBUFFERED", "PYTHONPATH", "PYTHONSAFEPATH"]
    # A user's own ~/.deepspeed_env keeps working and wins over our defaults; its values (tokens) are never printed.
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("OMP_NUM_THREADS=3\nNCCL_IB_HCA=mlx5\nHF_TOKEN=hf_secret_value\n")
    proc = launch(["--dry-run", "pretrain", "--config", "run.json", "--hostfile", "hosts"], tmp_path, HOME=str(home))
    env_file_note = next(line for line in proc.stdout.splitlines() if line.startswith("# DS_ENV_FILE"))
    assert env_file_note.split(": ", 1)[1].split()[:3] == ["OMP_NUM_THREADS", "NCCL_IB_HCA", "HF_TOKEN"]
    assert env_file_note.count("OMP_NUM_THREADS") == 1 and "TOKENIZERS_PARALLELISM" in env_file_note
    assert "hf_secret_value" not in proc.stdout + proc.stderr and "mlx5" not in proc.stdout + proc.stderr


def slurm_env(nodelist: str, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": "2", **extra}


def which_starts(stdout: str) -> list[str]:
    """The command nodes.py would start on the nodes (launch.sh prints it under --dry-run as '# which starts: ...')."""
    line = next(line for line in stdout.splitlines() if line.startswith("# which starts: "))
    return shlex.split(line.removeprefix("# which starts: "))


def test_slurm_dry_run(tmp_path: Path, run_json: Path) -> None:
    """pretrain: one srun task per node runs our elastic agent (pretrain/launch/nodes.py, transports.py), which
    starts the node's ranks; the agents meet on the allocation's first node."""
    proc = launch(
        ["--dry-run", "pretrain", "--config", "run.json", "--phase2.steps=9"],
        tmp_path,
        **slurm_env("gpu-[007-008]", SLURM_GPUS_ON_NODE="4"),
    )
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    assert commands[-1][:11] == [
        FAKE_PYTHON, "-m", "pretrain.launch.nodes", "--slurm", "--nodes", "2", "--gpus", "--nproc-per-node", "4",
        "--rdzv-endpoint", f"{this_machine(['gpu-007', 'gpu-008'])}:24242",
    ]  # fmt: skip
    assert commands[-1][-4:] == ["--", "--config", "run.json", "--phase2.steps=9"]
    srun = which_starts(proc.stdout)
    assert srun[:srun.index(FAKE_PYTHON)] == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", f"--job-name={srun[4].split('=')[1]}",
        "--kill-on-bad-exit=0", "--export=ALL", "--cpus-per-task=4", "--gpus-per-node=4",
    ]  # fmt: skip
    agent = srun[srun.index(FAKE_PYTHON):]
    assert agent[:6] == [FAKE_PYTHON, "-u", "-m", "pretrain.launch.agent", "--nproc-per-node", "4"]
    assert "--slurm" in agent and agent[-4:] == ["--", "--config", "run.json", "--phase2.steps=9"]
    # --nodes MIN:MAX: the step survives a node (--no-kill), the agents' rendezvous takes 1 to 2 nodes
    proc = launch(["--dry-run", "pretrain", "--config", "run.json", "--nodes", "1:2"], tmp_path,
                  **slurm_env("gpu-[007-008]", SLURM_GPUS_ON_NODE="4"))
    srun = which_starts(proc.stdout)
    assert "--no-kill" in srun and srun[srun.index("--nnodes") + 1] == "1:2"


def test_slurm_finetune_runs_one_task_per_rank(tmp_path: Path) -> None:
    proc = launch(["--dry-run", "squad", "finetune", "--model", "m", "--dev", "d", "--out", "o"], tmp_path,
                  **slurm_env("gpu-[007-008]", SLURM_GPUS_ON_NODE="4"))
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    env = exported(commands)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) == ("gpu-007", "24242", "8")
    assert commands[-1] == [
        "srun", "--nodes=2", "--ntasks-per-node=4", "--ntasks=8", "--kill-on-bad-exit=1", "--export=ALL",
        "bash", str(REPO_ROOT / "slurm" / "slurm_rank.sh"),
        FAKE_PYTHON, "-u", "-m", "pretrain.finetune.squad", "finetune", "--model", "m", "--dev", "d", "--out", "o",
    ]  # fmt: skip


def test_slurm_passes_cpus_per_task_to_srun_and_omp(tmp_path: Path, run_json: Path) -> None:
    # Since Slurm 22.05 srun does not inherit the batch job's --cpus-per-task: launch.sh passes it on, for the
    # node's one task as ranks x cpus-per-task (each rank then takes its share: pretrain/launch/pin.py).
    env = slurm_env("gpu-[007-008]", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="6")
    proc = launch(["--dry-run", "pretrain", "--config", "run.json"], tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    commands = printed_commands(proc.stdout)
    assert "--cpus-per-task=24" in which_starts(proc.stdout)
    assert exported(commands)["OMP_NUM_THREADS"] == "6"
    proc = launch(["--dry-run", "pretrain", "--config", "run.json"], tmp_path, OMP_NUM_THREADS="3", **env)
    commands = printed_commands(proc.stdout)
    assert "--cpus-per-task=24" in which_starts(proc.stdout)
    assert exported(commands)["OMP_NUM_THREADS"] == "3"  # the user's own setting wins


@pytest.mark.parametrize(
    ("nodelist", "gpus_env", "master", "per_node"),
    [
        ("node1,node2", {"SLURM_GPUS_PER_NODE": "a100:8"}, "node1", "8"),
        ("a[1-3]", {"SLURM_GPUS_PER_NODE": "2"}, "a1", "2"),
        ("gpu[003,010-011],cpu1", {"SLURM_GPUS_ON_NODE": "4"}, "gpu003", "4"),
        ("rack[1-2]-n[05-06]", {"SLURM_GPUS_ON_NODE": "1"}, "rack1-n05", "1"),
    ],
)
def test_slurm_master_address_and_gpus(
    tmp_path: Path, run_json: Path, nodelist: str, gpus_env: dict[str, str], master: str, per_node: str
) -> None:
    """A fine-tune's ranks meet on the allocation's first node (rank 0's); pretrain's agents on this machine's store,
    or where --master-addr / --rdzv-endpoint say."""
    env = slurm_env(nodelist, **gpus_env)
    proc = launch(["--dry-run", "squad", "finetune", "--model", "m", "--dev", "d", "--out", "o"], tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    assert exported(printed_commands(proc.stdout))["MASTER_ADDR"] == master
    for options, endpoint in (([], f"{this_machine([master])}:24242"), (["--master-addr", "10.1.2.3"], "10.1.2.3:24242"),
                              (["--rdzv-endpoint", "login1:7000"], "login1:7000")):
        proc = launch(["--dry-run", "pretrain", "--config", "run.json", *options], tmp_path, **env)
        assert proc.returncode == 0, proc.stderr
        command = printed_commands(proc.stdout)[-1]
        assert command[command.index("--rdzv-endpoint") + 1] == endpoint
        assert command[command.index("--nproc-per-node") + 1] == per_node
        assert f"--gpus-per-node={per_node}" in which_starts(proc.stdout)


def test_slurm_rank_wrapper_maps_slurm_variables(tmp_path: Path) -> None:
    env = clean_env(
        SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NTASKS="8", SLURM_NODEID="2", SLURM_TASKS_PER_NODE="4(x2)",
        MASTER_ADDR="gpu-007", MASTER_PORT="24242",
    )  # fmt: skip
    probe = "import os; print(*(os.environ[k] for k in ('RANK','LOCAL_RANK','WORLD_SIZE','NODE_RANK','LOCAL_WORLD_SIZE')))"
    wrapper = REPO_ROOT / "slurm" / "slurm_rank.sh"
    proc = subprocess.run(["bash", str(wrapper), "python3", "-c", probe], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["5", "1", "8", "2", "4"]
    # One GPU bound per task (--gpus-per-task=1): the task's only device is index 0, not SLURM_LOCALID.
    for visible, local_rank in (("3", "0"), ("GPU-6f1c", "0"), ("0,1,2,3", "1"), ("", "1")):
        bound = {**env, "CUDA_VISIBLE_DEVICES": visible}
        command = ["bash", str(wrapper), "python3", "-c", probe]
        proc = subprocess.run(command, env=bound, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split()[1] == local_rank, (visible, proc.stdout)
    del env["MASTER_ADDR"]
    proc = subprocess.run(["bash", str(wrapper), "true"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "MASTER_ADDR is unset" in proc.stderr


@pytest.mark.parametrize(
    ("args", "extra_env", "message"),
    [
        ([], {}, "Usage"),
        (["frobnicate"], {}, "unknown subcommand 'frobnicate'"),
        (["pretrain", "--gpus", "2"], {}, "pretrain needs --config RUN.json"),
        (["pretrain", "--config", "missing.json", "--gpus", "2"], {}, "config file 'missing.json' does not exist"),
        (["pretrain", "--config", "run.json", "--gpus", "two"], {}, "--gpus must be a positive integer, got 'two'"),
        (["pretrain", "--config", "run.json", "--gpus", "1", "--master-port", "70000"], {}, "got '70000'"),
        (["pretrain", "--config", "run.json", "--gpus", "1", "--lr", "3"], {}, "unknown option '--lr'"),
        (["pretrain", "--config", "run.json", "--gpus", "1", "--phase1.lr", "3"], {}, "unknown option '--phase1.lr'"),
        (["pretrain", "--config", "run.json", "--cpu"], {}, "--cpu needs --gpus N"),
        (["pretrain", "--config", "run.json", "--gpus"], {}, "--gpus needs a value"),
        (["pretrain", "--config", "run.json", "--hostfile", "nohosts"], {}, "hostfile 'nohosts' does not exist"),
        (["pretrain", "--config", "run.json", "--hostfile", "badhosts"], {}, "badhosts' line 2: expected 'HOSTNAME slots=N'"),
        (["pretrain", "--config", "run.json", "--launcher", "slurm"], {}, "not inside a SLURM allocation"),
        (["pretrain", "--config", "run.json", "--launcher", "mpi"], {}, "--launcher must be auto"),
        (["pretrain", "--config", "run.json", "--nodes", "2", "--gpus", "1"], {}, "--nodes 2 needs --hostfile"),
        (["pretrain", "--config", "run.json", "--gpus", "4"], {"SLURM_JOB_ID": "7"}, "SLURM_JOB_NODELIST is unset"),
        (["pretrain", "--config", "run.json"], {"SLURM_JOB_ID": "7"}, "how many GPUs each node of SLURM job 7"),
        (["pretrain", "--config", "run.json", "--gpus", "4"],
         {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_CPUS_PER_TASK": "all"},
         "SLURM_CPUS_PER_TASK must be a positive integer, got 'all'"),
        (["pretrain", "--config", "run.json", "--hostfile", "hosts", "--nodes", "3"], {}, "lists 2 host(s)"),
        (["pretrain", "--config", "run.json", "--nodes", "3", "--gpus", "1"], {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2",
         "SLURM_JOB_NODELIST": "n[1-2]"}, "--nodes 3 but SLURM job 7 has 2 node(s)"),
        (["pretrain", "--config", "run.json", "--hostfile", "hosts", "--rdzv-endpoint", "login1"], {},
         "--rdzv-endpoint must be HOST:PORT with a port number 1-65535 (e.g. login1:29500), got 'login1'"),
        (["pretrain", "--config", "run.json", "--gpus", "1", "--rdzv-endpoint", "login1:7"], {},
         "--rdzv-endpoint is for pretrain on several nodes: it needs --hostfile or a SLURM allocation"),
        (["pretrain", "--config", "run.json", "--hostfile", "hosts", "--rdzv-endpoint", "a:7", "--master-port", "9"], {},
         "give --rdzv-endpoint HOST:PORT or --master-addr/--master-port, not both"),
        (["squad", "train"], {}, "unknown action 'train'"),
        (["squad", "evaluate", "dev.json"], {}, "usage: ./launch.sh squad evaluate"),
        (["export", "ckpt"], {}, "usage: ./launch.sh export CHECKPOINT OUT [--tag TAG]"),
        (["export", "ckpt", "out", "--tags", "t"], {}, "usage: ./launch.sh export CHECKPOINT OUT [--tag TAG]"),
        (["export", "no-ckpt", "out"], {}, "checkpoint 'no-ckpt' does not exist"),
        (["tensorboard", "no-run"], {}, "run folder 'no-run' does not exist"),
    ],
)
def test_bad_arguments_fail_clearly_before_running(
    tmp_path: Path, run_json: Path, args: list[str], extra_env: dict[str, str], message: str
) -> None:
    (tmp_path / "badhosts").write_text("worker-1 slots=4\nworker-2 4\n")
    (tmp_path / "hosts").write_text("worker-1 slots=4\nworker-2 slots=4\n")
    proc = launch(args, tmp_path, **extra_env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr + proc.stdout
    assert not any(line.startswith("+ ") and "deepspeed" in line for line in proc.stdout.splitlines())


def test_help_lists_every_subcommand(tmp_path: Path) -> None:
    proc = launch(["--help"], tmp_path)
    assert proc.returncode == 0
    for word in ("prep", "pretrain", "squad", "export", "tensorboard", "demo", "--dry-run", "--hostfile", "SLURM"):
        assert word in proc.stdout
    for option in ("--launcher", "--gpus N", "--nodes N|MIN:MAX", "--master-addr A", "--master-port P", "--cpu",
                   "--rdzv-endpoint HOST:PORT"):
        assert f"\n  {option} " in proc.stdout  # the LAUNCH OPTIONS launch/plan.py parses
    assert launch([], tmp_path).stdout == proc.stdout  # no subcommand: the same text, exit 2


def test_export_passes_its_tag_and_its_help_to_the_module(tmp_path: Path) -> None:
    """`./launch.sh export CHECKPOINT OUT --tag TAG` exports that tag (not `latest`); `export --help` is the module's."""
    (tmp_path / "ckpt").mkdir()
    tagged = launch(["--dry-run", "export", "ckpt", "out", "--tag", "phase1-step0000010"], tmp_path)
    assert tagged.returncode == 0, tagged.stderr
    assert printed_commands(tagged.stdout)[-1] == [FAKE_PYTHON, "-m", "pretrain.export", "ckpt", "out", "--tag",
                                                   "phase1-step0000010"]
    helped = launch(["--dry-run", "export", "--help"], tmp_path)
    assert helped.returncode == 0 and printed_commands(helped.stdout)[-1] == [FAKE_PYTHON, "-m", "pretrain.export",
                                                                               "--help"]
