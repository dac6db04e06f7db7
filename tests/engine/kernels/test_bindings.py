"""The ctypes bindings (engine.kernels.cpu.ops) against the header they bind
(engine/kernels/cpu/include/tessera_kernels.h): every prototype has a binding with the same
arguments and return type and every binding a prototype, the exported variables and the
shared constants agree, and the ctypes.Structure mirrors in the same table (ops.STRUCTS, the
decode plan's) have their C struct's fields, in order and type. The header is parsed here with a small parser for the types it uses; the parser must
consume the whole header, and it is shown to catch deliberately wrong bindings."""

from __future__ import annotations

import ast
import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine.kernels.cpu import build, ops
from engine.kernels.cpu import w4 as cpu_w4

# C scalar types -> ctypes; every pointer is a c_void_p in the bindings
_SCALARS: dict[str, Any] = {
    "int64_t": ctypes.c_int64,
    "int32_t": ctypes.c_int32,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "void": None,
}


def _ctype(decl_type: str) -> Any:
    """'const uint16_t*' -> c_void_p, 'int64_t' -> c_int64, 'void' -> None."""
    if "*" in decl_type:
        return ctypes.c_void_p
    base = decl_type.replace("const", "").strip()
    if base not in _SCALARS:
        raise ValueError(f"the binding test does not know the C type {base!r}")
    return _SCALARS[base]


def _param(text: str) -> Any:
    """'const uint16_t* x' -> c_void_p (the name is dropped)."""
    m = re.fullmatch(r"(.*?)\s*\b(\w+)", text.strip())
    assert m and m[1], f"cannot parse the parameter {text!r}"
    return _ctype(m[1])


def parse_header(text: str) -> dict[str, dict]:
    """{"functions": {name: (argtypes, restype)}, "variables": {name: ctype},
    "structs": {name: [(field, ctype or ("array", ctype, n))]}, "constants": {name: int}}.
    Raises if anything in the header is left unread."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    constants = {
        m[1]: int(m[2]) for m in re.finditer(r"^\s*#define\s+(\w+)\s+(\d+)\s*$", text, re.M)
    }
    text = re.sub(r"^\s*#[^\n]*", " ", text, flags=re.M)

    structs: dict[str, list] = {}

    def struct(m: re.Match) -> str:
        fields = []
        for decl in filter(str.strip, m[1].split(";")):
            d = re.fullmatch(r"\s*((?:const\s+)?\w+)\s*(.*?)\s*", decl, re.S)
            assert d, f"cannot parse the field declaration {decl!r}"
            for declarator in d[2].split(","):
                f = re.fullmatch(r"\s*(\**)\s*(\w+)\s*(?:\[(\d+)\])?\s*", declarator)
                assert f, f"cannot parse the declarator {declarator!r}"
                t = _ctype(d[1] + f[1])
                fields.append((f[2], ("array", t, int(f[3])) if f[3] else t))
        structs[m[2]] = fields
        return " "

    text = re.sub(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", struct, text, flags=re.S)

    variables: dict[str, Any] = {}

    def variable(m: re.Match) -> str:
        variables[m[2]] = _ctype(m[1])
        return " "

    text = re.sub(r"\bextern\s+([\w\s\*]+?)\s*\b(\w+)\s*;", variable, text)

    functions: dict[str, tuple] = {}

    def function(m: re.Match) -> str:
        params = m[3].strip()
        args = [] if params in ("", "void") else [_param(p) for p in params.split(",")]
        assert m[2] not in functions, f"{m[2]} is declared twice"
        functions[m[2]] = (args, _ctype(m[1]))
        return " "

    text = re.sub(r"([\w\s\*]+?)\s*\b(\w+)\s*\(([^()]*)\)\s*;", function, text)
    assert not text.strip(), (
        f"the header has declarations the parser did not read: {text.strip()!r}"
    )
    return {
        "functions": functions,
        "variables": variables,
        "structs": structs,
        "constants": constants,
    }


def signature_mismatches(functions: dict[str, tuple], signatures: dict[str, tuple]) -> list[str]:
    """What differs between the header's prototypes and a ctypes table (empty: they agree)."""
    out = [f"{n}: in the header, not bound" for n in functions if n not in signatures]
    out += [f"{n}: bound, not in the header" for n in signatures if n not in functions]
    for name in functions.keys() & signatures.keys():
        (want_args, want_ret), (args, ret) = functions[name], signatures[name]
        if len(args) != len(want_args):
            out.append(f"{name}: {len(args)} argtypes, the header has {len(want_args)}")
        else:
            out += [
                f"{name}: argument {i} is {a.__name__}, the header's is {w.__name__}"
                for i, (a, w) in enumerate(zip(args, want_args, strict=True))
                if a is not w
            ]
        if ret is not want_ret:
            out.append(f"{name}: restype {ret}, the header returns {want_ret}")
    return out


def _field_type(t: Any) -> Any:
    """A ctypes field type as _ctype / parse_header describe it."""
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return ("array", t._type_, t._length_)
    return t


def struct_mismatches(c_fields: list, mirror: type[ctypes.Structure]) -> list[str]:
    got = [(n, _field_type(t)) for n, t in mirror._fields_]
    out = [f"{mirror.__name__}: {len(got)} fields, the C struct has {len(c_fields)}"]
    out = out if len(got) != len(c_fields) else []
    return out + [
        f"{mirror.__name__} field {i}: {g}, the C struct's is {c}"
        for i, (g, c) in enumerate(zip(got, c_fields, strict=False))  # counts checked above
        if g != c
    ]


@pytest.fixture(scope="module")
def header() -> dict[str, dict]:
    return parse_header(build.header_text())


def test_every_prototype_has_its_binding_and_every_binding_a_prototype(header):
    assert len(header["functions"]) >= 30  # the parser found the prototypes
    assert signature_mismatches(header["functions"], ops.SIGNATURES) == []
    assert ops.SIGNATURES.keys() >= ops.OPTIONAL


def test_the_exported_variables_and_constants_agree(header):
    assert header["variables"] == ops.VARIABLES
    assert header["constants"] == ops.CONSTANTS
    # constants Python derives itself
    assert cpu_w4.GROUP_BYTES == ops.W4_GROUP_BYTES and cpu_w4.TILE == ops.W4_TILE


def test_the_struct_mirrors_match_the_c_structs(header):
    assert header["structs"].keys() == ops.STRUCTS.keys()
    for name, mirror in ops.STRUCTS.items():
        assert struct_mismatches(header["structs"][name], mirror) == []


def test_no_struct_mirror_outside_the_signature_table():
    """A ctypes.Structure elsewhere in engine/ would be a mirror the header check never sees."""
    engine = Path(ops.__file__).resolve().parents[2]
    for path in engine.rglob("*.py"):
        if path == Path(ops.__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not bases & {"ctypes.Structure", "Structure", "ctypes.Union"}, (
                    f"{path}: {node.name} mirrors a C struct outside engine/kernels/cpu/ops.py"
                )


def test_the_checks_catch_a_wrong_binding(header):
    """The comparison fails on each kind of mistake it exists for."""
    good = dict(ops.SIGNATURES)
    args, ret = good["linear_q4_bf16"]

    def wrong(**change) -> list[str]:
        return signature_mismatches(header["functions"], good | change)

    assert wrong(linear_q4_bf16=(args[:-1], ret))  # an argument missing
    assert wrong(linear_q4_bf16=([*args, ctypes.c_int], ret))  # one too many
    swapped = [ctypes.c_int64 if a is ctypes.c_void_p else a for a in args]
    assert wrong(linear_q4_bf16=(swapped, ret))  # a pointer bound as an integer
    assert wrong(linear_q4_bf16=(args, None))  # the return type
    assert wrong(rmsnorm_bf16=(good["rmsnorm_bf16"][0][:-2] + [ctypes.c_int64, ctypes.c_int], None))
    assert wrong(not_in_the_header=([], None))  # a binding without a prototype
    missing = dict(good)
    del missing["rope_bf16"]
    assert signature_mismatches(header["functions"], missing)  # a prototype without a binding

    class ShapeWrong(ctypes.Structure):  # eps and scale swapped: same types, wrong order
        _fields_ = ops.Shape._fields_[:-2] + [
            ("scale", ctypes.c_float),
            ("eps", ctypes.c_float),
        ]

    assert struct_mismatches(header["structs"]["Shape"], ShapeWrong)


def test_the_parser_reads_what_the_header_writes():
    parsed = parse_header(
        "#define A_CONST 12\n/* note */ int f(const uint16_t* x, int64_t n, float e);\n"
        "void g(void);\nextern int flag;\n"
        "typedef struct { int64_t a, b; const float *p, *q[2]; int c; } S;\n"
    )
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    assert parsed["functions"] == {
        "f": ([p, i64, ctypes.c_float], ctypes.c_int),
        "g": ([], None),
    }
    assert parsed["variables"] == {"flag": ctypes.c_int}
    assert parsed["constants"] == {"A_CONST": 12}
    assert parsed["structs"]["S"] == [
        ("a", i64), ("b", i64), ("p", p), ("q", ("array", p, 2)), ("c", ctypes.c_int),
    ]  # fmt: skip
    with pytest.raises(AssertionError, match="did not read"):
        parse_header("int f(int x)\n")  # no semicolon: left unread
    with pytest.raises(ValueError, match="does not know"):
        parse_header("int f(double x);")


def test_the_library_exports_exactly_the_header():
    """The built library's dynamic symbols are the header's functions and variables (the
    optional ones where this CPU builds them), and ops binds each one."""
    lib = ops.library()
    if lib is None:
        pytest.skip("the CPU kernels are not built here (no compiler or disabled)")
    header = parse_header(build.header_text())
    for name in header["functions"]:
        assert (ops.function(name) is not None) or name in ops.OPTIONAL, name
        if ops.function(name) is not None:
            assert ops.function(name).argtypes == ops.SIGNATURES[name][0]
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the library's symbols")
    listing = subprocess.run(
        [nm, "-D", "--defined-only", lib._name], capture_output=True, text=True
    )
    rows = [line.split() for line in listing.stdout.splitlines()]
    # functions and data; names starting with _ are the toolchain's own
    exported = {r[2] for r in rows if len(r) == 3 and r[1] in {"T", "D", "B"} and r[2][0] != "_"}
    declared = header["functions"].keys() | header["variables"].keys()
    assert exported <= declared, f"exported, not in the header: {sorted(exported - declared)}"
    assert declared - exported <= ops.OPTIONAL | {"use_amx"}
