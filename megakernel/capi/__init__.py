"""The C API (megakernel.h): a decode engine behind a handle for engines that embed megakernel as a backend.

This first version embeds CPython (megakernel.c calls session.Session); the header is the interface a
Python-free build is to keep.  `python -m megakernel.capi build --out DIR` compiles libmegakernel.so and the
example program with the C compiler the running Python was built with.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_refusal() -> str | None:
    """Why this Python cannot build the library here, or None."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]
    if shutil.which(cc) is None:
        return f"no C compiler: {cc!r} (the compiler Python was built with) is not on PATH"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        return f"no Python.h in {include} (install this Python's development headers)"
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return "this Python has no shared libpython to embed (built without --enable-shared)"
    return None


def build(out: Path, python: str | None = None) -> tuple[Path, Path]:
    """Compiles libmegakernel.so and the example program into `out`; returns their paths.  `python`: the
    interpreter the library starts by default (this one)."""
    why = build_refusal()
    if why:
        raise RuntimeError(f"cannot build the C API: {why}")
    out.mkdir(parents=True, exist_ok=True)
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]
    libdir = sysconfig.get_config_var("LIBDIR")
    pylib = f"python{sysconfig.get_config_var('LDVERSION')}"
    default = python or sys.executable
    lib, example = out / "libmegakernel.so", out / "example"
    flags = ["-O2", "-Wall", "-Wextra", "-Werror", "-std=c11", "-D_GNU_SOURCE"]
    cmds = [
        [cc, *flags, "-shared", "-fPIC", "-o", str(lib), str(HERE / "megakernel.c"),
         f"-I{sysconfig.get_paths()['include']}", f"-DMK_DEFAULT_PYTHON=\"{default}\"", f"-L{libdir}", f"-l{pylib}",
         f"-Wl,-rpath,{libdir}", "-lpthread"],
        [cc, *flags, "-o", str(example), str(HERE / "example.c"), f"-I{HERE}", f"-L{out}", "-lmegakernel",
         f"-Wl,-rpath,{out.resolve()}"],
    ]
    for cmd in cmds:
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
        if done.returncode:
            raise RuntimeError(f"cannot build the C API: {shlex.join(cmd)} failed:\n{done.stderr}")
    return lib, example
