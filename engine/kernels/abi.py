"""The native kernels' ABI: every entry point the Python side calls, with its argument and return types, and the
check that the library agrees before anything is called.

ctypes trusts the declared argument types: a library built from a source whose entry points changed would read
garbage and corrupt memory. So the library reports its ABI version and, for every entry point, its argument types as
the compiler sees them (``ss_abi_version``, ``ss_abi_table`` in csrc/cpu_kernels.cpp), and ``check_abi`` refuses one
that disagrees with ``ENTRY_POINTS``.
"""

from __future__ import annotations

import ctypes

from splitserve.engine.kernels.build import KernelsUnavailable

ABI_VERSION = 7  # kAbiVersion in csrc/cpu_kernels.cpp: bump both when an entry point changes

_i64, _ptr, _int, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float

# Every entry point the Python side calls: argument types, return type. The library's own table must agree.
ENTRY_POINTS: dict[str, tuple[list, type | None]] = {
    "ss_vector_bits": ([], _int),
    "ss_linear": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int], None),
    "ss_quant_linear": ([_ptr, _i64, _i64, _ptr, _int, _i64, _i64, _ptr, _ptr, _i64, _int], None),
    "ss_quant_rows": ([_ptr, _int, _i64, _ptr, _i64, _ptr, _int], None),
    "ss_paged_decode_attention": (
        [_ptr, _ptr, _ptr, _int, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _float, _ptr, _int], None),
    "ss_prefill_attention": (
        [_ptr, _i64, _ptr, _ptr, _int, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _float, _ptr, _i64, _int],
        None),
    "ss_attention_input": (
        [_ptr, _i64, _i64, _ptr, _float, _ptr, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr,
         _ptr, _ptr, _int, _ptr, _int], None),
    "ss_attention_output_and_mlp": (
        [_ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _ptr, _float, _ptr, _int, _ptr, _int, _i64, _int], None),
    "ss_decode_layers": (
        [_ptr, _i64, _i64, _i64, _ptr, _int, _float, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64,
         _ptr, _ptr, _i64, _float, _int], None),
    # The bf16 prefill (csrc/bf16_kernels.cpp; engine/kernels/bf16_kernels.py): each returns 0, or -1 when asked for
    # an ISA this CPU does not run.
    "ss_bf16_isa_ready": ([_int], _int),
    "ss_bf16_linear": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int, _int], _int),
    "ss_bf16_attention_input": (
        [_ptr, _i64, _i64, _ptr, _float, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr,
         _ptr, _int, _ptr, _int, _int], _int),
    "ss_bf16_prefill_attention": (
        [_ptr, _i64, _ptr, _ptr, _int, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _float, _ptr, _i64, _int,
         _int], _int),
    "ss_bf16_output_and_mlp": (
        [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _float, _ptr, _ptr, _i64, _int, _int], _int),
}

# How the library spells an argument's type in its table (type_code in the source).
_TYPE_CODES = {_ptr: "p", _i64: "q", _int: "i", _float: "f"}


class KernelABIError(KernelsUnavailable):
    """The library's entry points are not the ones declared here."""


class _AbiEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("arg_types", ctypes.c_char_p)]  # AbiEntry in the source


def check_abi(version: int, table: dict[str, str]) -> None:
    """Raise ``KernelABIError`` unless the library's ABI version and its table (entry point -> argument type codes)
    are those of ``ENTRY_POINTS``."""
    if version != ABI_VERSION:
        raise KernelABIError(f"the kernels' library has ABI version {version}, this code needs {ABI_VERSION}")
    declared = {name: "".join(_TYPE_CODES[t] for t in args) for name, (args, _) in ENTRY_POINTS.items()}
    problems = [f"{name}: library takes ({table.get(name, 'absent')}), declared ({codes})"
                for name, codes in declared.items() if table.get(name) != codes]
    problems += [f"{name}: in the library, not declared" for name in sorted(set(table) - set(declared))]
    if problems:
        raise KernelABIError("the kernels' library disagrees with its declarations (p pointer, q int64, i int, "
                             "f float): " + "; ".join(problems))


def library_abi(lib: ctypes.CDLL) -> tuple[int, dict[str, str]]:
    try:
        version_fn, table_fn = lib.ss_abi_version, lib.ss_abi_table
    except AttributeError as e:
        raise KernelABIError(f"the kernels' library reports no ABI ({e})") from e
    version_fn.restype, version_fn.argtypes = _int, []
    table_fn.restype, table_fn.argtypes = _i64, [ctypes.POINTER(ctypes.POINTER(_AbiEntry))]
    entries = ctypes.POINTER(_AbiEntry)()
    count = table_fn(ctypes.byref(entries))
    return version_fn(), {entries[i].name.decode(): entries[i].arg_types.decode() for i in range(count)}
