"""A placeholder for `sgl_kernel`, SGLang's CUDA kernel package, for the sampler conformance tests on a CPU only.

SGLang imports `sgl_kernel` (and some of its submodules) at start-up even with its torch-native CPU attention, which
needs none of its kernels; the package on PyPI is CUDA-only and SGLang's CPU build of it needs a compiler setup
from its sources. tests/test_sampler_conformance.py puts this folder on the path when SGLang is installed without
the real package, and nowhere else. Every name in it is a placeholder that raises when called and records the call
in the file named by RLBENCH_SGL_KERNEL_CALLS (the scheduler runs in a process of its own): the tests fail if any
was called, so a test can pass only on code that never needed the kernels.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

__version__ = "0.4.10"  # the sglang-kernel release sglang 0.5.23 asks for


class Placeholder:
    """A name of the kernel package: its attributes are placeholders too; a call is recorded, then raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        with open(os.environ.get("RLBENCH_SGL_KERNEL_CALLS", os.devnull), "a") as calls:
            calls.write(self._name + "\n")
        raise RuntimeError(f"{self._name} is a placeholder of SGLang's CUDA kernel package (tests/sglang_cpu)")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return Placeholder(f"sgl_kernel.{name}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import sgl_kernel.<anything>`: a module of placeholders."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attribute(name: str, prefix: str = spec.name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Placeholder(f"{prefix}.{name}")

        module.__getattr__ = attribute
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
