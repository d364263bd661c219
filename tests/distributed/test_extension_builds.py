"""DeepSpeed's JIT ops build with the ninja of the driver's own environment, whatever PATH a rank was started
with: two ninjas (pip's in the environment, a system ninja-build) hash build commands differently, so a rank
started over ssh with a login PATH would recompile the op and the next ordinary launch recompile it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.distributed import extension_builds
from tests.support.launching import copy_machine_op_build, deepspeed_cpu_env
from tests.support.paths import REPO_ROOT

LOAD = """
import json, shutil
from pretrain.distributed.process_group import init_distributed
init_distributed()
print(json.dumps({"ninja": shutil.which("ninja")}))
"""


def test_the_environments_ninja_goes_first_on_path_once(monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "ninja").is_file():
        pytest.skip(f"no ninja beside {sys.executable} (DeepSpeed installs one into its environment)")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", str(bin_dir), "/bin"]))
    assert extension_builds.use_environment_ninja() == bin_dir / "ninja"
    assert os.environ["PATH"].split(os.pathsep) == [str(bin_dir), "/usr/bin", "/bin"]  # moved, not repeated
    extension_builds.use_environment_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [str(bin_dir), "/usr/bin", "/bin"]


def test_an_interpreter_without_a_ninja_beside_it_leaves_path_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python3"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert extension_builds.use_environment_ninja() is None and os.environ["PATH"] == "/usr/bin:/bin"


def test_a_rank_started_with_a_login_path_loads_the_op_without_rebuilding_it(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "ninja").is_file():
        pytest.skip(f"no ninja beside {sys.executable} (DeepSpeed installs one into its environment)")
    build = copy_machine_op_build(tmp_path / "extensions")
    env = deepspeed_cpu_env() | {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
                                 "MASTER_PORT": "0", "MASTER_ADDR": "127.0.0.1"}

    def load(path: str) -> dict[str, str]:
        done = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO_ROOT, env=env | {"PATH": path},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    load(os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]))  # as an activated environment runs it
    log = (build / ".ninja_log").read_text()  # what the build (or the machine's copied build) left
    seen = load("/usr/local/bin:/usr/bin:/bin")  # a login PATH: a system ninja (if any) comes first there
    assert seen["ninja"] == str(bin_dir / "ninja")
    assert (build / ".ninja_log").read_text() == log, "the op was rebuilt"
