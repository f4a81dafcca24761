"""The distribution as a user installs it: build the wheel, install it into a fresh venv, and run the
reference trainer, ``ingest``, ``report`` and ``stack`` from there, outside the checkout.

The wheel goes into an empty venv, outside the checkout. Only then does the venv get this interpreter's
site-packages appended to its path (a ``.pth``), for the dependencies: torch and the others are
gigabytes, already installed, and nothing may be downloaded here. Those directories come after the
venv's own, and their ``.pth`` files are not run, so an editable meshscope there is never what the venv
imports. The scan below checks that what the product imports is declared."""

from __future__ import annotations

import ast
import json
import os
import re
import site
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("agent", "trainer", "dashboard", "grafana", "meshscope")
# import name -> distribution, where they differ
DIST_OF = {"yaml": "PyYAML", "pynvml": "nvidia-ml-py", "prometheus_client": "prometheus-client",
           "opentelemetry": "opentelemetry-sdk"}


def _third_party_imports() -> set[str]:
    names = set()
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            if "tools" in path.parts:
                continue  # the generators of shipped files run from a checkout
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "meshscope"}


def test_every_third_party_import_of_the_product_is_a_declared_dependency():
    # the runtime dependencies and the optional extras (not the test extra)
    declared = {re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in metadata.requires("meshscope")
                if "extra == \"test\"" not in r}
    missing = sorted(n for n in _third_party_imports() if DIST_OF.get(n, n).lower() not in declared)
    assert missing == [], f"imported by meshscope but not in pyproject's dependencies: {missing}"


@pytest.mark.gloo
@pytest.mark.packaging
def test_the_wheel_in_a_fresh_venv_trains_ingests_reports_and_runs_the_stack(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("meshscope-*.whl")
    import zipfile

    # the product only: the test fixtures (tests/support: moto, torch.testing._internal) stay in the checkout
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("tests/", "meshscope/testing/"))], names
    assert "meshscope/agent/zerocode/bootstrap/sitecustomize.py" in names
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    outer = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
    (Path(purelib) / "zz_dependencies.pth").write_text("\n".join(outer) + "\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}")

    def run(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
        out = subprocess.run(list(argv), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(argv)} -> {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        return out

    where = json.loads(run(str(py), "-c", (
        "import importlib.util, json, meshscope, meshscope.agent, meshscope.grafana\n"
        "print(json.dumps({'meshscope': meshscope.agent.__file__, 'grafana': meshscope.grafana.__file__,\n"
        "  'agent': getattr(importlib.util.find_spec('agent'), 'origin', None)}))")).stdout)
    venv_dir = str(env_dir)
    assert where["meshscope"].startswith(venv_dir) and where["grafana"].startswith(venv_dir), where
    assert where["agent"] is None or str(ROOT) not in where["agent"], where  # `import agent` is not meshscope
    # the dispatcher kernels' sources are package data: `make install` builds them where the wheel is installed
    instrument = Path(where["meshscope"]).parent / "instrument"
    assert all((instrument / name).is_file() for name in ("_funcol_kernels.cpp", "_ddp_kernel.h")), instrument

    meshscope = str(env_dir / "bin" / "meshscope")
    store = work / "runs"
    run(meshscope, "train", "--nproc", "2", "--steps", "2", "--store", str(store), "--run", "wheel")
    run(meshscope, "ingest", "--store", str(store))
    report = json.loads(run(meshscope, "report", "--store", str(store), "--run", "wheel", "--json").stdout)
    assert (report["run"], report["world_size"], report["steps"]) == ("wheel", 2, [0, 1]), report
    # zero-code from the wheel: the bootstrap is package data, and the job's python finds meshscope
    loop = ("import torch\nm = torch.nn.Linear(4, 4)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "for _ in range(3):\n    m(torch.randn(2, 4)).sum().backward()\n    opt.step()\n    opt.zero_grad()\n")
    run(meshscope, "run", "--store", str(store), "--run", "zc", "--", str(py), "-c", loop)
    report = json.loads(run(meshscope, "report", "--store", str(store), "--run", "zc", "--json").stdout)
    assert (report["world_size"], report["steps"]) == (1, [0, 2]), report
    assert "Prometheus" in run(meshscope, "stack", "--help").stdout
    # the stack's shipped configs are package data: rendering them works from the wheel
    assert (Path(where["grafana"]).parent / "prometheus" / "prometheus.yml").is_file()
