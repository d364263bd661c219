"""Real cluster software on this one machine, for tests/test_cluster*.py and for rehearsing by hand.

* LocalSlurm: munged + slurmctld + slurmd with a private key, config, state and ports (SLURM_CONF
  points the client commands at it), one node of this machine's CPUs, no GPUs, task/affinity so
  that every srun task is pinned to the CPUs its allocation granted.
* LoopbackSsh: an sshd on a free 127.0.0.1 port with its own host key and authorized_keys, and an
  `ssh` wrapper (put first on PATH) that always passes its own client config (-F): DeepSpeed's
  hostfile launcher then reaches "127.0.0.1" and "localhost" as two nodes over pdsh + ssh.

Nothing here reads or writes ~/.ssh, /etc/ssh, /etc/slurm or /etc/munge: every key, config, log and
socket lives in a fresh temp folder, every daemon listens on loopback only (or a unix socket), runs
in the foreground as our child and is stopped by its pid in stop(). Where this machine cannot host
them (not root, packages missing, a daemon that does not come up) start() raises
ClusterUnavailable with the reason, which the tests turn into a skip.

By hand (prints the environment to use, runs until Ctrl-C, then stops everything):

    python -m tests.support.cluster.local_cluster slurm [--nodes 2]   # then: export SLURM_CONF=...; sbatch ...
    python -m tests.support.cluster.local_cluster ssh                 # then: export PATH=...; ./launch.sh ... --hostfile ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.support.cluster.processes import (
    ClusterUnavailable,
    find_programs,
    free_port,
    log_tail,
    wait_until,
)


class Daemons:
    """Foreground daemons started as children of this process, stopped by pid in reverse order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.children: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = self.root / f"{name}.out"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        self.children.append((name, proc, log))
        return proc

    def any_exited(self) -> bool:
        return any(proc.poll() is not None for _name, proc, _log in self.children)

    def require_running(self, what: str, extra_log: Path | None = None) -> None:
        """ClusterUnavailable with the daemons' own words when one of them has already exited."""
        for name, proc, log in self.children:
            if proc.poll() is not None:
                detail = log_tail(log) + (f"\n{log_tail(extra_log)}" if extra_log else "")
                raise ClusterUnavailable(f"{name} exited ({proc.returncode}) while {what}:\n{detail}")

    def stop_daemons(self) -> None:
        for _name, proc, _log in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)
        self.children.clear()


class LocalSlurm(Daemons):
    """munged + slurmctld + slurmd: a SLURM cluster of this machine (root only).

    One node by default. With `nodes=2` (or more) one slurmd per node, each started with `-N NAME` on its own
    port, named NAME-1, NAME-2, ... (NAME: this host): SLURM then places a job on several "nodes" that are all
    this machine, as the ssh "nodes" of LoopbackSsh are. They share its CPUs, so no task is pinned there
    (task/none); each node reports an equal part of the CPUs.
    """

    PROGRAMS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel",
                "sinfo")

    REQUEUE_DELAY_S = 5

    def __init__(self, nodes: int = 1) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="bert-slurm-")))
        self.cpus = len(os.sched_getaffinity(0))
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [self.host] if nodes == 1 else [f"{self.host}-{index}" for index in range(1, nodes + 1)]
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, and the job itself: sbatch exports it) needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> LocalSlurm:
        try:
            if os.geteuid() != 0:
                raise ClusterUnavailable("needs root: slurmd starts every job's processes as their user")
            if self.cpus < 2:
                raise ClusterUnavailable(f"needs 2 CPUs for 2 ranks of one CPU each; this process may use {self.cpus}")
            programs = find_programs(self.PROGRAMS)
            self._start_munge(programs)
            self._write_conf()
            env = {**os.environ, **self.env}
            self.spawn("slurmctld", [programs["slurmctld"], "-D", "-i"], env)
            for node in self.nodes:
                self.spawn(f"slurmd-{node}", [programs["slurmd"], "-D", "-N", node], env)
            wait_until(lambda: self.any_exited() or self._node_state() == "idle", timeout=40)
            self.require_running("coming up", self.root / "slurmctld.log")
            if self._node_state() != "idle":
                raise ClusterUnavailable(
                    f"the node did not become idle in 40 s (state {self._node_state()!r}):\n"
                    f"{log_tail(self.root / 'slurmctld.log')}\n{log_tail(self.root / f'slurmd-{self.nodes[0]}.log')}"
                )
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self, programs: dict[str, str]) -> None:
        # munged wants its key private and every folder above its socket traversable by all
        os.chmod(self.root, 0o755)
        folder = self.munge_socket.parent
        folder.mkdir(mode=0o755)
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.spawn("munged", [programs["munged"], "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                              f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}",
                              f"--seed-file={folder / 'munged.seed'}"])

        def credential_round_trip() -> bool:
            if not self.munge_socket.exists():
                return False
            proc = subprocess.run([programs["munge"], "-n", "-S", str(self.munge_socket)], capture_output=True)
            return proc.returncode == 0

        wait_until(lambda: self.any_exited() or credential_round_trip(), timeout=15)
        self.require_running("starting")
        if not credential_round_trip():
            raise ClusterUnavailable(f"munged gives no credential on {self.munge_socket}:\n"
                                     f"{log_tail(self.root / 'munged.out')}")

    def _write_conf(self) -> None:
        host, root = self.host, self.root
        (root / "state").mkdir()
        for node in self.nodes:
            (root / f"spool-{node}").mkdir()
        # A random first job id: launch.sh derives the rendezvous port from the job id (20000 + id % 20000),
        # so two of these clusters on one machine do not hand out the same ports.
        first_job_id = random.randrange(1000, 60000)
        lines = [
            "ClusterName=bertlocal",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={free_port()}",

            # bind to the addresses above (loopback), not to every interface
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire is also how long a requeued job waits before it may start again (default 120 s)
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.REQUEUE_DELAY_S}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool-%n'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd-%n.log'}",
            # no cgroups: processes tracked through /proc, tasks pinned with sched_setaffinity
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/affinity" if len(self.nodes) == 1 else "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",  # a requeued job starts within seconds of its begin time
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "MailProg=/bin/true",
            f"FirstJobId={first_job_id}",
            "GresTypes=gpu",  # so that the batch file's --gpus-per-node can be overridden with 0
            *(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
              f"CPUs={max(1, self.cpus // len(self.nodes))} State=UNKNOWN" for node in self.nodes),
            "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n", encoding="utf-8")

    def command(self, *args: str, check: bool = True) -> str:
        """A SLURM client command against this cluster; its stdout."""
        proc = subprocess.run(list(args), capture_output=True, text=True, env={**os.environ, **self.env},
                              timeout=60)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def _node_state(self) -> str:
        try:
            states = set(self.command("sinfo", "-h", "-N", "-o", "%T", check=False).split())
            return ",".join(sorted(states))  # "idle" once every node is
        except (OSError, subprocess.TimeoutExpired):
            return ""

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.command("scontrol", "show", "job", "-o", str(job_id))
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def jobs(self) -> list[int]:
        return [int(line) for line in self.command("squeue", "-h", "-o", "%i").split()]

    def stop(self) -> None:
        """Cancel every job of this cluster and wait for them, then stop the daemons; remove the folder."""
        running = {name for name, proc, _ in self.children if proc.poll() is None}
        if {"slurmctld", "slurmd"} <= running:
            try:
                jobs = self.jobs()
                if jobs:
                    self.command("scancel", *map(str, jobs), check=False)
                    wait_until(lambda: not self.jobs(), timeout=60, interval=0.5)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                pass
        self.stop_daemons()
        shutil.rmtree(self.root, ignore_errors=True)


class LoopbackSsh(Daemons):
    """sshd on 127.0.0.1 with throwaway keys, and an `ssh` wrapper that uses only our client config."""

    PROGRAMS = ("sshd", "ssh", "ssh-keygen", "pdsh")
    PRIVSEP_DIR = Path("/run/sshd")  # sshd (as root) refuses to start without it

    def __init__(self) -> None:
        super().__init__(Path(tempfile.mkdtemp(prefix="bert-ssh-")))
        self.port = free_port()
        self.bin = self.root / "bin"
        self.created_privsep = False

    @property
    def env(self) -> dict[str, str]:
        """PATH with our `ssh` first: DeepSpeed's ssh check and pdsh's ssh module both run `ssh` from PATH."""
        return {"PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}

    def start(self) -> LoopbackSsh:
        try:
            programs = find_programs(self.PROGRAMS)
            root = self.root
            for name in ("host_key", "client_key"):
                subprocess.run([programs["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-C", "bert-test",
                                "-f", str(root / name)], check=True, capture_output=True)
            shutil.copy(root / "client_key.pub", root / "authorized_keys")
            (root / "sshd_config").write_text("\n".join([
                f"Port {self.port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {root / 'host_key'}",
                f"AuthorizedKeysFile {root / 'authorized_keys'}",
                f"PidFile {root / 'sshd.pid'}",
                "StrictModes no",  # the temp folder's parents (/tmp) are world-writable
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "PermitRootLogin prohibit-password",
                "X11Forwarding no",
                "AllowTcpForwarding no",
                "PrintMotd no",
                "AcceptEnv TMPDIR",  # a test's planted node fault (planted_env)
            ]) + "\n", encoding="utf-8")
            (root / "ssh_config").write_text("\n".join([
                "Host *",
                f"  Port {self.port}",
                f"  User {os_user()}",
                f"  IdentityFile {root / 'client_key'}",
                "  IdentitiesOnly yes",
                "  IdentityAgent none",
                "  BatchMode yes",
                "  StrictHostKeyChecking no",
                f"  UserKnownHostsFile {root / 'known_hosts'}",
                "  GlobalKnownHostsFile /dev/null",
                "  AddressFamily inet",  # "localhost" must not try ::1, where nothing listens
                "  LogLevel ERROR",
            ]) + "\n", encoding="utf-8")
            self.bin.mkdir()
            wrapper = self.bin / "ssh"
            wrapper.write_text(f'#!/bin/sh\nexec {programs["ssh"]} -F {root / "ssh_config"} "$@"\n', encoding="utf-8")
            wrapper.chmod(0o755)
            if os.geteuid() == 0 and not self.PRIVSEP_DIR.exists():
                self.PRIVSEP_DIR.mkdir(mode=0o755, parents=True)
                self.created_privsep = True
            self.spawn("sshd", [programs["sshd"], "-D", "-e", "-f", str(root / "sshd_config")])
            for host in ("127.0.0.1", "localhost"):
                wait_until(lambda host=host: self.any_exited() or self.reaches(host), timeout=20, interval=0.3)
                self.require_running(f"logging in to {host}")
                if not self.reaches(host):
                    raise ClusterUnavailable(f"ssh to {host}:{self.port} with the test key fails:\n"
                                             f"{log_tail(root / 'sshd.out')}")
        except BaseException:
            self.stop()
            raise
        return self

    def reaches(self, host: str) -> bool:
        try:
            proc = subprocess.run([str(self.bin / "ssh"), host, "true"], capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0

    @contextlib.contextmanager
    def planted_env(self, host: str, name: str, value: str) -> Iterator[None]:
        """Sessions to `host` get NAME=VALUE for the duration (ssh's SetEnv; sshd accepts TMPDIR only): one "node"
        made unlike the other, as a node without a mount is."""
        config = self.root / "ssh_config"
        original = config.read_text(encoding="utf-8")
        config.write_text(f"{original}Host {host}\n  SetEnv {name}={value}\n", encoding="utf-8")
        try:
            yield
        finally:
            config.write_text(original, encoding="utf-8")

    def hostfile(self, path: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), slots: int = 1) -> Path:
        """Two "nodes" of this machine: the runner sees two host names, so it takes its multi-node path."""
        path.write_text("".join(f"{host} slots={slots}\n" for host in hosts), encoding="utf-8")
        return path

    def stop(self) -> None:
        self.stop_daemons()
        if self.created_privsep:
            try:
                self.PRIVSEP_DIR.rmdir()
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def running_or_skip(cluster: LocalSlurm | LoopbackSsh, what: str) -> Iterator[LocalSlurm | LoopbackSsh]:
    """A module fixture's body: the cluster started, or the module skipped naming why; stopped after."""
    import pytest  # the by-hand entry point below does not need pytest

    try:
        started = cluster.start()
    except ClusterUnavailable as err:
        pytest.skip(f"no {what}: {err}")
    yield started
    started.stop()


def os_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.cluster.local_cluster", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["slurm", "ssh"])
    parser.add_argument("--nodes", type=int, default=1, help="slurm: how many nodes (slurmd daemons) to run")
    args = parser.parse_args(argv)
    cluster: LocalSlurm | LoopbackSsh = LocalSlurm(args.nodes) if args.what == "slurm" else LoopbackSsh()
    try:
        cluster.start()
    except ClusterUnavailable as err:
        print(f"cannot start {args.what}: {err}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print("# up; in another shell:")
        for name, value in cluster.env.items():
            print(f"export {name}={value}")
        if isinstance(cluster, LoopbackSsh):
            print(f"# hostfile: {cluster.hostfile(cluster.root / 'hosts')}")
        print("# Ctrl-C stops it", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
