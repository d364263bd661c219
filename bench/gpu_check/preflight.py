"""Preflight of bench/gpu_check/gpu_check.sh: which wheels the check loads, and stop (exit 2) if one is missing or
the recipe's engine configs cannot be built.

    python -m bench.gpu_check.preflight [--smoke] [--jsonl OUT.jsonl] [--recipe RUN.json] [--ds-config X.json]
                                        [--also-recipes A.json,B.json] [any other gpu_check flag]

Imports what bench/gpu_check/run.py imports (the module itself, so nothing is hand-listed, plus the
DeepSpeed modules the engine loads lazily for bf16 + ZeRO-1) in this interpreter, then names every
distribution that got loaded, from `sys.modules` (top-level names) and
`importlib.metadata.packages_distributions()`: the wheels to carry onto a bare GPU machine. Those in
torch's own requirement closure come with torch and are listed apart. An import that fails stops the
check in one line naming what is missing (plus every requirement the installed wheels declare and lack,
so one carry-in round is enough) before any work: exit 2. Then each phase's engine config is built
from --recipe (and --also-recipes) the way the check builds it (the driver's own config code): a recipe or DeepSpeed JSON the
driver refuses (e.g. one that still sets train_batch_size) stops here in one line, exit 2, not as a
failed row per model. Standard library only at import time, so it runs where nothing else is
installed. The record is also appended to --jsonl as {"kind": "preflight", ...}.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JSONL = "gpu_check.jsonl"
DEFAULT_RECIPE = REPO_ROOT / "ds_configs" / "recipes" / "bert_large_64k.json"  # bench/gpu_check/run.py's too
# What the check imports: bench.gpu_check itself (everything it imports at the top) and the DeepSpeed
# modules its engine loads lazily for bf16 + ZeRO-1.
ROOTS = ("torch", "deepspeed", "transformers", "bench.gpu_check.run",
         "deepspeed.runtime.bf16_optimizer", "deepspeed.runtime.zero.stage_1_and_2")
# Loaded on CUDA by torch.compile (the fused LAMB); missing = that row reports a failure, no stop.
SOFT_ROOTS_CUDA = ("triton",)


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _owns(dist: md.Distribution, top: str, loaded: set[str], shared: bool) -> bool:
    """Whether a loaded module file under top-level name `top` is one `dist` installed: not when `dist`
    is vendored inside another package (setuptools/_vendor/jaraco ships with setuptools); a namespace
    `shared` by several distributions (nvidia.*) is split by their files."""
    site = os.path.realpath(dist.locate_file(""))
    if any((parent / "__init__.py").exists() for parent in Path(site).parents[:3]):
        return False
    if not shared:
        inside = (os.path.join(site, top) + os.sep, os.path.join(site, top + "."))
        return any(p.startswith(inside) for p in loaded)
    files = [f for f in dist.files or () if f.parts[0] == top and f.suffix in (".py", ".so")]
    return any(os.path.realpath(dist.locate_file(f)) in loaded for f in files)


def loaded_distributions() -> dict[str, str]:
    """{distribution: version} of every installed distribution a module in sys.modules came from
    (this repository's own packages excluded: the repo is carried as files)."""
    owners = md.packages_distributions()
    files: dict[str, set[str]] = {}  # top-level name -> real paths of its loaded modules
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path:
            files.setdefault(name.partition(".")[0], set()).add(os.path.realpath(path))
    found: dict[str, str] = {}
    for top in sorted(set(files) - set(sys.stdlib_module_names)):
        own = (str(REPO_ROOT / top) + os.sep, str(REPO_ROOT / top) + ".")
        if any(p.startswith(own) for p in files[top]):  # this repository's pretrain/, bench/
            continue
        for dist_name in owners.get(top, []):
            try:
                dist = md.distribution(dist_name)
            except md.PackageNotFoundError:
                continue
            if _owns(dist, top, files[top], shared=len(owners[top]) > 1):
                found[dist.metadata["Name"]] = dist.version
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def _requirements(dist_name: str) -> list[str]:
    """Names of the requirements `dist_name` declares for this interpreter (no extras); [] when the
    `packaging` parser is not available (it is one of the wheels, or pip's vendored copy)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
        except ImportError:
            return []
    names = []
    for text in md.requires(dist_name) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def requirement_closure(starts: list[str], stop: frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
    """(installed, missing) normalized names reachable from `starts` through declared requirements;
    distributions in `stop` are not followed."""
    installed, missing, todo = set(), set(), list(starts)
    while todo:
        name = todo.pop()
        key = _norm(name)
        if key in installed or key in missing:
            continue
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            missing.add(key)
            continue
        installed.add(key)
        if key not in stop:
            todo.extend(_requirements(name))
    return installed, missing


def preflight(smoke: bool) -> dict[str, Any]:
    sys.path.insert(0, str(REPO_ROOT))
    failed: dict[str, str] = {}
    missing_modules: list[str] = []
    for root in ROOTS:
        try:
            importlib.import_module(root)
        except Exception as error:  # noqa: BLE001 - any import error stops the check, named
            failed[root] = f"{type(error).__name__}: {error}".splitlines()[0]
            name = error.name if isinstance(error, ModuleNotFoundError) and error.name else None
            if name and name.partition(".")[0] not in missing_modules:
                missing_modules.append(name.partition(".")[0])
    soft: dict[str, str] = {}
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and not smoke and torch.cuda.is_available())
    for root in SOFT_ROOTS_CUDA if cuda else ():
        try:
            importlib.import_module(root)
        except Exception as error:  # noqa: BLE001
            soft[root] = f"{type(error).__name__}: {error}".splitlines()[0]
    loaded = loaded_distributions()
    torch_stack, _ = requirement_closure(["torch"]) if "torch" in loaded else (set(), set())
    starts = [n for n in loaded if _norm(n) not in torch_stack]
    starts += [r.split(".")[0] for r in ROOTS if r.split(".")[0] not in ("bench", "pretrain")]
    declared, declared_missing = requirement_closure(starts, stop=frozenset({"torch"}))
    loaded_keys = {_norm(n) for n in loaded}
    declared_only = {}  # required by the metadata of what loaded, not imported: pip still wants them
    for key in sorted(declared - loaded_keys - torch_stack):
        dist = md.distribution(key)
        declared_only[dist.metadata["Name"]] = dist.version
    return {
        "kind": "preflight", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "python": platform.python_version(),
        "torch": getattr(torch, "__version__", None),
        "cuda": getattr(getattr(torch, "version", None), "cuda", None),
        "c_compiler": os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"),
        "python_headers": (Path(sysconfig.get_paths()["include"]) / "Python.h").exists(),
        "carry": {n: v for n, v in loaded.items() if _norm(n) not in torch_stack},
        "with_torch": {n: v for n, v in loaded.items() if _norm(n) in torch_stack},
        "failed_imports": failed, "missing_modules": missing_modules,
        "declared_only": declared_only, "declared_missing": sorted(declared_missing), "soft_failures": soft,
    }


def recipe_problem(recipe: Path, ds_config: Path | None) -> str | None:
    """None when every phase of `recipe` gives an engine config as the check builds it; else why not."""
    try:
        from bench.gpu_check.rows import engine_config

        for phase in ("phase1", "phase2"):
            engine_config(recipe, phase, 1, 1, ds_config)
    except Exception as error:  # noqa: BLE001 - any refusal stops the check, named
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--jsonl", type=Path, default=Path(DEFAULT_JSONL))
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--ds-config", type=Path, default=None)
    parser.add_argument("--also-recipes", default=str(DEFAULT_RECIPE.parent / "bert_base.json"))
    args, _ = parser.parse_known_args(argv)
    report = preflight(args.smoke)
    say = "gpu_check preflight:"
    if report["failed_imports"]:
        names = list(report["missing_modules"])
        names += [n for n in report["declared_missing"] if _norm(n) not in map(_norm, names)]
        detail = "; ".join(f"import {r}: {e}" for r, e in report["failed_imports"].items())
        named = " ".join(names) or "(see the import errors)"
        print(f"gpu_check: missing Python packages: {named} ({detail})", file=sys.stderr)
        print("gpu_check: this script installs nothing; carry the wheels in and "
              "'pip install --no-index --find-links DIR ...'", file=sys.stderr)
        return 2
    for flag, recipe in [("--recipe", args.recipe), *(("--also-recipes", Path(p)) for p in
                                                      args.also_recipes.split(",") if p)]:
        problem = recipe_problem(recipe, args.ds_config)
        if problem is not None:
            print(f"gpu_check: {flag} {recipe}: {problem}", file=sys.stderr)
            return 2
    report["recipe"] = str(args.recipe)
    fails = "the compiled fused LAMB step will fail; its row says so"
    print(f"{say} python {report['python']}, torch {report['torch']} (CUDA {report['cuda']}), "
          f"C compiler {report['c_compiler'] or f'none ({fails})'}, Python headers "
          f"{'found' if report['python_headers'] else f'not found (Triton needs them: {fails})'}")
    print(f"{say} wheels the check loads beyond torch's own ({len(report['carry'])}): "
          + " ".join(f"{n}=={v}" for n, v in report["carry"].items()))
    print(f"{say} loaded from torch's own requirements ({len(report['with_torch'])}): "
          + " ".join(f"{n}=={v}" for n, v in report["with_torch"].items()))
    if report["declared_only"]:
        print(f"{say} not imported but required by their metadata (pip install --no-index wants them too): "
              + " ".join(f"{n}=={v}" for n, v in report["declared_only"].items()))
    if report["declared_missing"]:
        print(f"{say} declared by installed wheels but absent (not imported by the check): "
              + " ".join(report["declared_missing"]))
    for root, error in report["soft_failures"].items():
        print(f"{say} import {root} failed ({error}): {fails}")
    with args.jsonl.open("a", encoding="utf-8") as out:
        out.write(json.dumps(report) + "\n")
        out.flush()
        os.fsync(out.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
