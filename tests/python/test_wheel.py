"""The installable package: a wheel built offline from the repository (its
native parts by the project's CMake), installed with pip into a fresh virtual
environment that sees Debian's torch, `import nonstop` from it with no
PYTHONPATH, and a 2-worker job started by the `nonstop` command it put on the
environment's PATH, a kill recovered."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert result.returncode == 0, f"{cmd}: exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def test_the_wheel_installs_into_a_virtual_environment_and_runs_a_job(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)], cwd=ROOT, env=env,
        timeout=1200)
    wheels = list(dist.glob("nonstop-*.whl"))
    assert len(wheels) == 1, list(dist.iterdir())
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], timeout=120)
    run([str(venv / "bin" / "pip"), "install", "--no-index", "--no-deps", str(wheels[0])], timeout=300)
    where = run([str(venv / "bin" / "python"), "-c", "import nonstop, nonstop.torch, nonstop.data; "
                 "print(nonstop.__file__)"], cwd=tmp_path, env=env, timeout=120).stdout.strip()
    assert where.startswith(str(venv)), f"imported from {where}, not from the virtual environment"
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    job = subprocess.run(["nonstop", "run", "--nproc", "2", "--spares", "1", "--inject", "kill:rank=1,step=60",
                          "--", str(venv / "bin" / "python"), str(ROOT / "examples" / "pytorch" / "minimal.py")],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-4000:]
    assert "training finished at step 99" in out, out[-4000:]
    assert "resuming at step 60" in out, "the kill was recovered\n" + out[-4000:]
