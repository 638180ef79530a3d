"""Kernel sources instantiated per shape: numba needs register-array and shared-array sizes as literals (closure
constants are not literal enough for `cuda.local.array` / `cuda.shared.array`), so such kernels are written as
format templates and compiled once per size."""

from __future__ import annotations

import re
from typing import Any

from ninfer.kernels_numba.numba_setup import kernel

_UNROLLED = re.compile(r"( *)for (\w+) in unrolled\(([\d +*()-]+)\):")


def unroll(source: str) -> str:
    """Writes out each `for NAME in unrolled(COUNT):` loop COUNT times with NAME a literal (nested ones too; COUNT may
    be literal arithmetic once the enclosing loops' names are substituted; the substitution is textual, so a loop
    variable must not appear in a string). LLVM leaves some loops rolled, and an accumulator array indexed by a
    rolled loop's variable lands in local memory instead of registers."""
    lines, out, i = source.split("\n"), [], 0
    while i < len(lines):
        head = _UNROLLED.fullmatch(lines[i])
        if head is None:
            out.append(lines[i])
            i += 1
            continue
        indent, name = len(head.group(1)), head.group(2)
        count = int(eval(head.group(3), {"__builtins__": {}}))  # noqa: S307  (digits and + - * ( ) only)
        body = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i][4:])
            i += 1
        for value in range(count):
            out.append(unroll(re.sub(rf"\b{name}\b", str(value), "\n".join(body))))
    return "\n".join(out)


def instantiate(source: str, name: str, signature: tuple, namespace: dict[str, Any], sizes: dict[str, Any],
                constants: dict[str, int] | None = None, options: dict[str, Any] | None = None) -> Any:
    """Compile function `name` of `source` formatted with `sizes` and unrolled, in a copy of `namespace` (the
    defining module's globals) plus `constants` (numba folds globals), and register it as a kernel of `signature`
    with `options` (cuda.jit's, e.g. max_registers)."""
    scope = dict(namespace)
    scope.update(constants or {})
    exec(compile(unroll(source.format(**sizes)), f"<{name}>", "exec"), scope)  # noqa: S102  (our own templates)
    function = scope[name]
    function.__module__ = namespace["__name__"]
    return kernel(signature, **(options or {}))(function)
