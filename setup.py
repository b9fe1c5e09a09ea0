"""Builds the wheel's native parts with the project's CMake: the native module
(nonstop._core) and the `nonstop` launcher, which the wheel carries as
nonstop/bin/nonstop behind the `nonstop` console script.

NONSTOP_BUILD_DIR names a CMake build tree to use (default: build-wheel/cmake,
configured here); NONSTOP_BUILD_JOBS the parallel jobs (2). Nothing is
downloaded: CMake finds what scripts/setup.sh installed."""

import os
import pathlib
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


def cmake_build() -> pathlib.Path:
    build = pathlib.Path(os.environ.get("NONSTOP_BUILD_DIR", ROOT / "build-wheel" / "cmake")).resolve()
    if not (build / "CMakeCache.txt").exists():
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                        "-DNONSTOP_BUILD_TESTS=OFF", "-DNONSTOP_BUILD_BENCH=OFF", "-DNONSTOP_BUILD_TRAIN=OFF"],
                       check=True)
    jobs = os.environ.get("NONSTOP_BUILD_JOBS", "2")
    print(f"setup.py: building nonstop and nonstop._core in {build}", flush=True)
    subprocess.run(["cmake", "--build", str(build), "--parallel", jobs, "--target", "nonstop", "nonstop_python"],
                   check=True)
    return build


class BuildWithCMake(build_py):
    def run(self) -> None:
        super().run()
        build = cmake_build()
        package = pathlib.Path(self.build_lib) / "nonstop"
        cores = sorted((build / "python" / "nonstop").glob("_core*.so"))
        if not cores:
            raise RuntimeError(f"no nonstop._core was built in {build / 'python' / 'nonstop'}")
        shutil.copy2(cores[0], package / cores[0].name)
        (package / "bin").mkdir(exist_ok=True)
        shutil.copy2(build / "bin" / "nonstop", package / "bin" / "nonstop")
        if shutil.which("strip"):  # debug info is most of their size
            for native in (package / cores[0].name, package / "bin" / "nonstop"):
                subprocess.run(["strip", "--strip-debug", str(native)], check=True)


class NativeDistribution(Distribution):
    def has_ext_modules(self) -> bool:  # a platform wheel: it carries native code
        return True


(ROOT / "build-wheel").mkdir(exist_ok=True)
setup(cmdclass={"build_py": BuildWithCMake}, distclass=NativeDistribution,
      options={"build": {"build_base": "build-wheel"}, "egg_info": {"egg_base": "build-wheel"}})
