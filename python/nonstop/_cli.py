"""The `nonstop` command of an installed wheel: runs the launcher the wheel
carries (nonstop/bin/nonstop), with this interpreter's environment, so its
Python workers import this installed package."""

import os
import pathlib
import sys


def main() -> None:
    launcher = pathlib.Path(__file__).resolve().parent / "bin" / "nonstop"
    if not os.access(launcher, os.X_OK):
        sys.exit(f"nonstop: {launcher} is missing or not executable: reinstall the wheel "
                 "(python3 -m build --wheel --no-isolation; pip install dist/nonstop-*.whl)")
    os.execv(str(launcher), [str(launcher), *sys.argv[1:]])


if __name__ == "__main__":
    main()
