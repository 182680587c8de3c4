"""The sleep-only baseline's hand-written CUDA driver declarations
(bench.sleep_memory) against the interceptor's
interceptor/src/cuda_decls.h, which bench/gpu/check_decls.c checks against the
real cuda.h on the GPU machine: every struct's size, every field's offset and
size (nested fields included) and every constant's value, compiled and printed
by the C compiler. No GPU, no torch."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from bench import sleep_memory

HERE = os.path.dirname(os.path.abspath(__file__))
DECLS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "interceptor", "src")


def ctypes_layout(structs: dict[str, type], constants: dict[str, int]) -> dict[str, int]:
    """"S" -> sizeof, "S.f[.g]" -> offset and size of each field, "C" -> value."""
    out: dict[str, int] = {}

    def walk(name: str, cls: type, base: int) -> None:
        for fname, ftype, *_ in cls._fields_:
            f = getattr(cls, fname)
            key = f"{name}.{fname}"
            out[key + "@offset"], out[key + "@size"] = base + f.offset, f.size
            if isinstance(ftype, type) and issubclass(ftype, ctypes.Structure):
                walk(key, ftype, base + f.offset)

    for s, cls in structs.items():
        out[s + "@size"] = ctypes.sizeof(cls)
        walk(s, cls, 0)
    out.update({f"{c}@value": int(v) for c, v in constants.items()})
    return out


def c_layout(structs: dict[str, type], constants: dict[str, int], tmp) -> dict[str, int]:
    """The same figures, as the C compiler lays out cuda_decls.h."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc) to check the declarations against cuda_decls.h")
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "cuda_decls.h"', "int main(void) {"]

    def walk(s: str, path: str, cls: type) -> None:
        for fname, ftype, *_ in cls._fields_:
            member = f"{path}.{fname}" if path else fname
            key = f"{s}.{member}"
            lines.append(f'printf("%s@offset %zu\\n", "{key}", offsetof({s}, {member}));')
            lines.append(f'printf("%s@size %zu\\n", "{key}", sizeof(((({s} *)0)->{member})));')
            if isinstance(ftype, type) and issubclass(ftype, ctypes.Structure):
                walk(s, member, ftype)

    for s, cls in structs.items():
        lines.append(f'printf("%s@size %zu\\n", "{s}", sizeof({s}));')
        walk(s, "", cls)
    for c in constants:
        lines.append(f'printf("%s@value %lld\\n", "{c}", (long long){c});')
    lines += ["return 0;", "}"]
    src, exe = tmp / "layout.c", tmp / "layout"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", DECLS, "-o", str(exe), str(src)], check=True,
                   capture_output=True, text=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_sleep_memory_declarations_match_cuda_decls(tmp_path):
    want = c_layout(sleep_memory.CUDA_STRUCTS, sleep_memory.CUDA_CONSTANTS, tmp_path)
    got = ctypes_layout(sleep_memory.CUDA_STRUCTS, sleep_memory.CUDA_CONSTANTS)
    assert set(got) == set(want)
    assert {k: v for k, v in got.items() if want[k] != v} == {}
    # Every struct the module hands the driver is covered.
    assert set(sleep_memory.CUDA_STRUCTS) == {"CUmemLocation", "CUmemAllocationProp", "CUmemAccessDesc"}


def test_a_wrong_declaration_is_caught(tmp_path):
    """The check fails for a layout that differs from cuda_decls.h: allocFlags
    without its reserved bytes, and a constant off by one."""

    class Flags(ctypes.Structure):
        _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                    ("usage", ctypes.c_ushort)]

    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                    ("location", sleep_memory.CUDA_STRUCTS["CUmemLocation"]), ("win32HandleMetaData", ctypes.c_void_p),
                    ("allocFlags", Flags)]

    structs, consts = {"CUmemAllocationProp": Prop}, {"CU_MEM_ACCESS_FLAGS_PROT_READWRITE": 2}
    want, got = c_layout(structs, consts, tmp_path), ctypes_layout(structs, consts)
    wrong = {k for k in got if got[k] != want[k]}
    # (The struct's size still matches: padding to the pointer's alignment hides the 4 bytes.)
    assert wrong == {"CUmemAllocationProp.allocFlags@size", "CU_MEM_ACCESS_FLAGS_PROT_READWRITE@value"}
