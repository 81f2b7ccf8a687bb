"""scripts/compile_check.py, which compiles every Triton kernel for sm_90 on a machine without a GPU: its cases must
match the kernels' signatures (a kernel that gained an argument would otherwise compile with it as an i32: its PSA
cases had gone stale that way), and every kernel must have a case. No compilation here (that takes minutes)."""
import importlib
import os
import pkgutil
import sys

import pytest

triton = pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import compile_check  # noqa: E402

import longreach.kernels  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

KERNEL_TYPES = (triton.runtime.JITFunction, InterpretedFunction)  # @triton.jit, compiled or under TRITON_INTERPRET=1


def test_every_case_names_each_pointer_and_constexpr():
    problems = {label: p for label, fn, ptrs, consts, floats in compile_check.all_cases()
                if (p := compile_check.signature_problems(fn, ptrs, consts, floats))}
    assert not problems


def test_every_kernel_has_a_case():
    from longreach.kernels import cascade_insert

    assert isinstance(cascade_insert._insert_kernel, KERNEL_TYPES)  # the scan below sees kernels in either mode
    covered = {id(c[1]) for c in compile_check.all_cases()}
    kernels = []
    for info in pkgutil.iter_modules(longreach.kernels.__path__):
        mod = importlib.import_module(f"longreach.kernels.{info.name}")
        kernels += [f"{info.name}.{name}" for name, obj in vars(mod).items()
                    if isinstance(obj, KERNEL_TYPES) and name.endswith("_kernel")
                    and id(obj) not in covered]
    assert not kernels, f"kernels without a compile_check case: {kernels}"


def test_a_stale_case_is_refused():
    from longreach.kernels import cascade_insert

    with pytest.raises(ValueError, match="constexpr BLOCK has no value.*|.*pointer Src has no type.*"):
        compile_check.compile_one(cascade_insert._insert_kernel, dict(Score="*fp32"), dict(FIELDS=12))
