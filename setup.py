"""attnkit's build (setuptools; the metadata is in pyproject.toml): the package, and its C++
kernels compiled once into it, ``attnkit/backends/blocked/_kernels/<name>.so`` for each build
of ``builds.ALL`` (the AVX2 row-span, decode and gather kernels, the AVX-512 and AVX512-BF16
row-span kernels) with
``manifest.json`` (each file's source fingerprint, instruction set and flags).

Each kernel is an ``Extension`` that ``BuildKernels`` compiles with the same command as attnkit
compiles it with at run time (``builds.command``: the build's flags, ``-O3``, no debug
information, no run path), so a wheel and a fallback build are the same file for the same
source. The kernels are plain C ABI libraries (no Python or libtorch symbol): the wheel is
tagged ``py3-none-<platform>``, one wheel for every Python 3 and torch version the metadata
allows; the platform tag is ``manylinux_2_<N>_x86_64`` with N the newest glibc symbol version
the kernels need (read with objdump), else ``linux_x86_64``.

No kernel is built off x86-64 Linux or with ``ATTNKIT_BUILD_KERNELS=0`` (a pure wheel), and a
kernel that fails to compile (no compiler) is skipped with a warning: attnkit then compiles it
on first use where it can, or says why it runs without it (``attnkit doctor``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
PACKAGE = "attnkit.backends.blocked"


def _load_builds():  # builds.py by its path: the build environment has no torch
    path = HERE / "src" / "attnkit" / "backends" / "blocked" / "builds.py"
    spec = importlib.util.spec_from_file_location("_attnkit_builds", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


builds = _load_builds()
KERNELS = (
    sys.platform.startswith("linux")
    and platform.machine() in ("x86_64", "AMD64")
    and os.environ.get("ATTNKIT_BUILD_KERNELS", "1") != "0"
)
BY_NAME = {b.name: b for b in builds.ALL}


class BuildKernels(build_ext):
    """Compiles each kernel with ``builds.command`` (not Python's compiler flags), names it
    ``<name>.so`` and writes ``manifest.json`` beside the kernels it built."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = len(self.extensions) or None  # one compiler per kernel
        self.built: set[str] = set()  # the builds compiled in this run, for the manifest

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        build = BY_NAME[ext.name.rsplit(".", 1)[1]]
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(self.build_temp) / "attnkit-kernels"
        temp.mkdir(parents=True, exist_ok=True)
        source = temp / f"{build.name}.cpp"
        source.write_text(builds.source_text(build.csrc))
        try:
            cmd = builds.command(build, source.resolve(), out.resolve())
        except FileNotFoundError as e:
            self.warn(f"attnkit kernel {build.name} not built: {e}")
            return
        print(" ".join(cmd))
        run = subprocess.run(cmd, cwd=temp, check=False)
        if run.returncode != 0:
            out.unlink(missing_ok=True)
            self.warn(f"attnkit kernel {build.name} not built: the compiler failed")
            return
        self.built.add(build.name)

    def copy_extensions_to_source(self) -> None:
        """An editable install's copy of the kernels into the source tree (``_kernels`` is
        not a package, so its folder may not exist there yet)."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            package = ".".join(ext.name.split(".")[:-1])
            Path(build_py.get_package_dir(package)).mkdir(parents=True, exist_ok=True)
        super().copy_extensions_to_source()

    def run(self) -> None:
        super().run()  # where in place, the manifest below goes beside the copies
        if not self.extensions:
            return
        folder = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
        entries = {}
        for ext in self.extensions:
            build = BY_NAME[ext.name.rsplit(".", 1)[1]]
            if build.name not in self.built:
                # an older file of this build (an editable install's copy) is not this
                # source's: removed, so that neither the manifest nor the loader takes it
                (folder / f"{build.name}.so").unlink(missing_ok=True)
                continue
            if (folder / f"{build.name}.so").exists():
                entries[build.name] = {
                    "file": f"{build.name}.so",
                    "fingerprint": builds.fingerprint(build),
                    "isa": build.isa,
                    "flags": [*builds.COMMON, *build.flags],
                    "cpu": list(build.cpu),
                }
        manifest = {"abi": builds.ABI, "builds": entries}
        (folder / builds.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _glibc(paths: list[Path]) -> tuple[int, int] | None:
    """The newest ``GLIBC_2.N`` symbol version the files need, or ``None`` where objdump is
    missing."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    newest = (2, 17)
    for path in paths:
        text = subprocess.run([objdump, "-T", str(path)], capture_output=True, text=True).stdout
        for major, minor in re.findall(r"GLIBC_(\d+)\.(\d+)", text):
            newest = max(newest, (int(major), int(minor)))
    return newest


class PlatformWheel(bdist_wheel):
    """``py3-none-<platform>`` where kernels were built (they use no Python ABI), else
    ``py3-none-any``."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = not KERNELS

    def get_tag(self) -> tuple[str, str, str]:
        if not KERNELS:
            return "py3", "none", "any"
        lib = Path(self.bdist_dir or "") / PACKAGE.replace(".", os.sep) / builds.PREBUILT
        found = _glibc(sorted(lib.glob("*.so")))
        if found is None:
            return "py3", "none", "linux_x86_64"
        return "py3", "none", f"manylinux_{found[0]}_{found[1]}_x86_64"


EXTENSIONS = [
    Extension(f"{PACKAGE}.{builds.PREBUILT}.{b.name}", sources=[], optional=True)
    for b in builds.ALL
]

setup(
    ext_modules=EXTENSIONS if KERNELS else [],
    cmdclass={"build_ext": BuildKernels, "bdist_wheel": PlatformWheel},
)
