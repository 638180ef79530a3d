"""A disk cache of compiled kernels: a process loads the cubin of a kernel any earlier process compiled.

Why: numba compiles each kernel specialization in every new process. A fresh 35B-A3B bench process spent over 100 s
compiling on the H200 before its first step (bench/cuda_notes.md, session 38); a restarted server paid it again, and
so did each GPU test worker and each device call of a measurement session.

Where: the directory NINFER_KERNEL_CACHE names ("off" turns the cache off), else $XDG_CACHE_HOME/ninfer/kernels
(~/.cache/ninfer/kernels). Entries go in a generation directory named by the compiler versions (numba, numba-cuda,
llvmlite, cuda-bindings), the Python version and FORMAT; the KEEP_GENERATIONS most recently used generations stay,
and an entry unused for STALE_DAYS goes.

What an entry is: one file per kernel specialization, named by the SHA-256 of its key, holding the key and the
kernel's cubin with what numba needs to launch it (no LLVM IR, no PTX). The key holds the NVVM build, the compute
capability, the argument types, the `cuda.jit` options, a fingerprint of the Python function and the bytes of every
source file it draws on. The fingerprint covers the function's code objects (bytecode, constants, names, nested
code), the values its closure holds and the globals its code names, each function, device function or intrinsic among
them fingerprinted the same way, recursively; the source files are those of every function so reached. So an edit to
a file changes the keys of the kernels that use something in it, and no others; kernels instantiated from templates
(same name, other literal sizes) and factory kernels (same code, other closure values or register caps) get keys of
their own. A load compares the stored key with the asked one. Files are written under a temporary name and renamed,
so concurrent processes (pytest-xdist workers, a bench beside a server) never read a partial file, and two writers
of one key write equivalent kernels.

numba's own cache (`cuda.jit(cache=True)`) does not fit: it finds entries by the defining file's path and modification
time (kernels made from templates have no file: it refuses them), keys a function on its bytecode without constants,
options or the functions it calls, and numbers data files per index, which concurrent writers can give to two
different keys.

Not cached (compiled as before): a kernel that reads through a module of its own (not a library) or holds a value
this module cannot fingerprint exactly (`UncacheableKernel`), a kernel numba refuses to serialise, and everything
under the CUDA simulator.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import attrs
import numpy as np

ENVIRONMENT = "NINFER_KERNEL_CACHE"
OFF_VALUES = frozenset({"", "0", "off", "no", "false", "none"})
KEEP_GENERATIONS = 3  # toolchains kept under the cache root (the most recently used)
STALE_DAYS = 30  # an entry neither loaded nor saved for this long is removed
FORMAT = 2  # of the keys and entries
GENERATION_NAME = re.compile(r"kernels-[0-9a-f]{32}")
_VERSIONED = ("numba", "numba-cuda", "llvmlite", "cuda-bindings")
# modules whose objects a kernel may name by qualified name alone (their versions are in the generation's name)
_LIBRARIES = ("numba", "llvmlite", "numpy", "math", "cmath", "operator", "builtins")


class UncacheableKernel(Exception):
    """A kernel's function refers to a value that has no exact fingerprint here: it is compiled, not cached."""


@attrs.define
class CacheCounts:
    """What this process's kernel compilations did with the cache."""

    loaded: int = 0  # specializations loaded from disk
    compiled: int = 0  # compiled here (and saved, where cacheable)
    uncacheable: int = 0  # compiled here and not saved: no fingerprint, or numba refused to serialise them
    failed: int = 0  # unreadable or mismatched entries, and saves that failed (each compiled here instead)

    def summary(self) -> str:
        return (f"{self.loaded} kernels loaded, {self.compiled} compiled, {self.uncacheable} not cacheable, "
                f"{self.failed} failed")


COUNTS = CacheCounts()


def cache_root() -> Path | None:
    """The cache's root directory, or None when NINFER_KERNEL_CACHE turns it off."""
    value = os.environ.get(ENVIRONMENT)
    if value is not None:
        return None if value.strip().lower() in OFF_VALUES else Path(value).expanduser()
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except (RuntimeError, KeyError):  # no home directory to find: no default cache
        return None
    return Path(base) / "ninfer" / "kernels"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.cache
def toolchain_digest() -> str:
    """SHA-256 of FORMAT, the Python version and the compilers' versions: the generation directory's name."""
    text = f"format {FORMAT} python {sys.version_info[:2]}\n" + "".join(
        f"{name} {_version(name)}\n" for name in _VERSIONED)
    return hashlib.sha256(text.encode()).hexdigest()


def _digest_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# The kernel sources' digests as this process imports them: a file edited while the process runs must not key the
# old code the process compiles (the kernels' modules are imported with this one; other files, such as a test's
# own kernels, are read when first keyed).
_PACKAGE = Path(__file__).resolve().parent
_IMPORTED_SOURCES = {str(path.resolve()): _digest_of(path) for root in (_PACKAGE, _PACKAGE.parent / "artifact")
                     for path in root.rglob("*.py")}


@functools.cache
def file_digest(path: str) -> str:
    """SHA-256 of a source file's bytes as this process first saw them."""
    known = _IMPORTED_SOURCES.get(path)
    return known if known is not None else _digest_of(Path(path))


def _source_file(function: types.FunctionType) -> str | None:
    """The source file a function's code comes from (a template's: the module that instantiated it), or None for a
    library's function (its version names the generation) or code with no file."""
    name = function.__module__ or ""
    if name.split(".")[0] in _LIBRARIES:
        return None
    module = sys.modules.get(name)
    for candidate in (getattr(module, "__file__", None), function.__code__.co_filename):
        if candidate and Path(candidate).is_file():
            return str(Path(candidate).resolve())
    return None


def device_identity() -> tuple[tuple[int, int], str]:
    """(compute capability of the current device, the NVVM build): what a cubin is compiled for and by."""
    from ninfer.kernels_numba.numba_setup import cuda

    return tuple(cuda.get_current_device().compute_capability), _nvvm_version()


@functools.cache
def _nvvm_version() -> str:
    """NVVM's API and IR versions, and the identity of the libnvvm that compiles (its size and the digest of its
    first and last MiB): the API version alone stays 2.0 across CUDA releases, whose code generation differs."""
    from numba.cuda.cudadrv import nvvm

    compiler = nvvm.NVVM()
    identity = f"api {compiler.get_version()} ir {compiler.get_ir_version()}"
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        library = Path(load_nvidia_dynamic_lib("nvvm").abs_path)
        size = library.stat().st_size
        with library.open("rb") as handle:
            head = handle.read(1 << 20)
            handle.seek(max(0, size - (1 << 20)))
            tail = handle.read(1 << 20)
        identity += f" lib {size} {hashlib.sha256(head + tail).hexdigest()[:32]}"
    except Exception:  # no pathfinder, or a library it cannot name: the versions alone
        pass
    return identity


class Fingerprints:
    """Exact text fingerprints of the values a kernel's code reaches (see the module docstring). Memoised per
    object; a function reached again while it is being fingerprinted (recursion) is named, not walked again."""

    def __init__(self) -> None:
        # id -> (the function, kept alive; its fingerprint; the source files it draws on)
        self._functions: dict[int, tuple[Any, str, frozenset[str]]] = {}
        self._collecting: list[set[str]] = []  # source files of the functions being walked, innermost last

    def of(self, value: Any) -> str:
        if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            return f"{type(value).__name__}:{value!r}"
        if isinstance(value, (tuple, list, frozenset, set)):
            items = [self.of(item) for item in value]
            return f"{type(value).__name__}(" + ",".join(sorted(items) if isinstance(value, (set, frozenset))
                                                          else items) + ")"
        if isinstance(value, dict):
            return "dict(" + ",".join(sorted(f"{self.of(k)}={self.of(v)}" for k, v in value.items())) + ")"
        if isinstance(value, np.ndarray):
            digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
            return f"ndarray:{value.dtype.str}:{value.shape}:{digest}"
        if isinstance(value, (np.generic, np.dtype)):
            return f"numpy:{type(value).__name__}:{value!r}"
        if isinstance(value, types.CodeType):
            return self.code(value)
        if isinstance(value, types.ModuleType):
            return self.module(value)
        if isinstance(value, types.FunctionType):
            return self.function(value)
        py_func = getattr(value, "py_func", None)
        if isinstance(py_func, types.FunctionType):  # a numba dispatcher (kernel or device function)
            options = getattr(value, "targetoptions", {})
            return f"dispatcher:{self.function(py_func)}:{self.of(dict(options))}"
        dispatcher = getattr(value, "dispatcher", None)
        if dispatcher is not None and getattr(dispatcher, "py_func", None) is not None:  # a FastKernel
            return self.of(dispatcher)
        definition = getattr(value, "_defn", None)
        if isinstance(definition, types.FunctionType):  # a numba @intrinsic: its typing and codegen functions
            return f"intrinsic:{self.function(definition)}"
        module = getattr(value, "__module__", None) or getattr(type(value), "__module__", "")
        if module.split(".")[0] in _LIBRARIES:
            from numba.core import types as numba_types

            if isinstance(value, numba_types.Type):
                return f"numba-type:{value.name}"
            name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
            if name is not None:  # a library function, class or builtin, by its qualified name
                return f"library:{module}.{name}"
        raise UncacheableKernel(f"no exact fingerprint for a {type(value).__module__}.{type(value).__qualname__}")

    @staticmethod
    def module(module: types.ModuleType) -> str:
        """A library module by its name (its version names the generation). Device code that reads through one of
        ninfer's modules would draw on attributes this walk does not follow: not cached."""
        if module.__name__.split(".")[0] not in _LIBRARIES:
            raise UncacheableKernel(f"reads through module {module.__name__}")
        return f"module:{module.__name__}"

    def code(self, code: types.CodeType) -> str:
        constants = ",".join(self.of(constant) for constant in code.co_consts)
        body = code.co_code + getattr(code, "co_exceptiontable", b"")
        return (f"code:{code.co_name}:{hashlib.sha256(body).hexdigest()}:[{constants}]:{','.join(code.co_names)}:"
                f"{','.join(code.co_varnames)}:{code.co_argcount},{code.co_kwonlyargcount},{code.co_flags}:"
                f"{','.join(code.co_freevars)}")

    def function(self, function: types.FunctionType) -> str:
        known = self._functions.get(id(function))
        if known is not None and known[0] is function:
            self._uses(known[2])
            return known[1]
        name = f"function:{function.__module__}.{function.__qualname__}"
        # while walking: a recursive reference is its name (its files join the enclosing walk's)
        self._functions[id(function)] = (function, name, frozenset())
        source = _source_file(function)
        self._collecting.append(set() if source is None else {source})
        try:
            parts = [name, self.code(function.__code__)]
            for cell in function.__closure__ or ():
                parts.append(self.of(cell.cell_contents))
            for global_name in sorted(_global_names(function.__code__)):
                if global_name in function.__globals__:
                    parts.append(f"{global_name}={self.of(function.__globals__[global_name])}")
            for default in function.__defaults__ or ():
                parts.append(self.of(default))
            parts.append(self.of(function.__kwdefaults__ or {}))
        except UncacheableKernel:
            del self._functions[id(function)]  # no fingerprint: not its name either
            raise
        finally:
            files = frozenset(self._collecting.pop())
        fingerprint = hashlib.sha256("\n".join(parts).encode()).hexdigest()
        self._functions[id(function)] = (function, fingerprint, files)
        self._uses(files)
        return fingerprint

    def sources(self, function: types.FunctionType) -> frozenset[str]:
        """The source files a function draws on (itself and everything its fingerprint reaches)."""
        self.function(function)
        return self._functions[id(function)][2]

    def _uses(self, files: frozenset[str]) -> None:
        if self._collecting:
            self._collecting[-1].update(files)


def _global_names(code: types.CodeType) -> set[str]:
    """Names the code (nested code objects included) may look up as globals."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names


def function_fingerprint(function: types.FunctionType) -> str:
    """The fingerprint of a kernel's Python function (raises UncacheableKernel)."""
    return Fingerprints().function(function)


def entry_key(function: types.FunctionType, options: dict[str, Any], argument_types: tuple, compute_capability: tuple,
              nvvm_version: str) -> str:
    """The key of one specialization (raises UncacheableKernel). Walked afresh each time, as numba reads the
    globals afresh for each specialization it compiles."""
    fingerprints = Fingerprints()
    fingerprint = fingerprints.function(function)
    sources = "sources " + ",".join(sorted(file_digest(path) for path in fingerprints.sources(function)))
    return "\n".join((f"ninfer kernel cache format {FORMAT}", f"nvvm {nvvm_version}",
                      f"cc {tuple(compute_capability)}", fingerprint, f"options {fingerprints.of(dict(options))}",
                      "arguments " + ",".join(t.name for t in argument_types), sources))


class KernelFiles:
    """The entries of one cache generation: `save(key, payload)` and `load(key)` by the key's SHA-256, each file
    holding its key."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._ready = False  # made and pruned (at this process's first save)
        self._used = False  # marked used (at this process's first load or save)

    def path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()}.kernel"

    def load(self, key: str) -> Any | None:
        """The payload saved under `key`, or None (no entry). Raises on an unreadable or mismatched entry."""
        entry = self.path(key)
        try:
            data = entry.read_bytes()
        except FileNotFoundError:
            return None
        stored_key, payload = pickle.loads(data)
        if stored_key != key:
            raise ValueError(f"{entry} holds another key")
        self._mark_used(entry)
        return payload

    def _mark_used(self, entry: Path) -> None:
        """The entry's and (once a process) the generation's modification time become now: what pruning reads as
        their last use."""
        try:
            os.utime(entry)
            if not self._used:
                os.utime(self.directory)
                self._used = True
        except OSError:  # a read-only cache still serves loads
            pass

    def save(self, key: str, data: bytes) -> None:
        """Store `data` (the pickled (key, payload) pair) under `key`: a temporary file, then a rename."""
        self._prepare()
        descriptor, temporary = tempfile.mkstemp(dir=self.directory, suffix=".partial")
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
            os.replace(temporary, self.path(key))
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def _prepare(self) -> None:
        """On the first save: create the generation's directory, drop the generations past KEEP_GENERATIONS and
        the entries unused for STALE_DAYS (kernels whose sources changed since), and partial files a crashed writer
        left."""
        if self._ready:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        os.utime(self.directory)
        self._used = True
        prune_generations(self.directory.parent, keep=KEEP_GENERATIONS)
        prune_entries(self.directory, older_than=time.time() - STALE_DAYS * 86400)
        self._ready = True


def prune_generations(root: Path, *, keep: int) -> list[Path]:
    """Remove all but the `keep` most recently used generation directories under `root` (named as `_generation`
    names them: nothing else there is touched, whatever directory NINFER_KERNEL_CACHE names); returns those
    removed."""
    generations = sorted((path for path in root.iterdir() if path.is_dir() and GENERATION_NAME.fullmatch(path.name)),
                         key=lambda p: p.stat().st_mtime, reverse=True)
    removed = generations[keep:]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune_entries(directory: Path, *, older_than: float) -> list[Path]:
    """Remove the entries last used before `older_than` (seconds since the epoch), and partial files over a day
    old; returns those removed."""
    removed = []
    partial_limit = time.time() - 86400
    for path in directory.iterdir():
        try:
            used = path.stat().st_mtime
            if (path.suffix == ".kernel" and used < older_than) or (path.suffix == ".partial" and used < partial_limit):
                path.unlink()
                removed.append(path)
        except OSError:  # another process removed or replaced it meanwhile
            pass
    return removed


@functools.cache
def _generation(root: Path) -> KernelFiles:
    """The current generation's files (one object a process, so pruning runs once)."""
    return KernelFiles(root / f"kernels-{toolchain_digest()[:32]}")


class KernelDiskCache:
    """The cache numba's CUDADispatcher consults (`dispatcher._cache`): `compile(sig)` asks `load_overload` before
    compiling a specialization and hands the kernel it compiled to `save_overload`. It duck-types numba's `Cache`
    (load_overload, save_overload, flush, cache_path); not being a numba CUDACache, it also keeps numba's
    launch-configuration-sensitive paths off, which no ninfer kernel uses."""

    def __init__(self, function: types.FunctionType, options: dict[str, Any], files: KernelFiles) -> None:
        self._function, self._options, self._files = function, dict(options), files

    @property
    def cache_path(self) -> str:
        return str(self._files.directory)

    def _key(self, sig: Any) -> str:
        from numba.cuda.core import sigutils

        argument_types, _ = sigutils.normalize_signature(sig)
        return entry_key(self._function, self._options, tuple(argument_types), *device_identity())

    def load_overload(self, sig: Any, target_context: Any) -> Any | None:
        # Any failure here means compiling, as without the cache: an unreadable or foreign entry is replaced by
        # the save that follows. The loaded kernel binds here (its cubin loaded into the context, as numba binds a
        # kernel it compiles), so a cubin the driver refuses is compiled over too, not found at the first launch.
        try:
            payload = self._files.load(self._key(sig))
            kernel = None if payload is None else _rebuild(payload)
            if kernel is not None:
                kernel.bind()
        except UncacheableKernel:
            return None
        except Exception:
            COUNTS.failed += 1
            return None
        if kernel is not None:
            COUNTS.loaded += 1
        return kernel

    def save_overload(self, sig: Any, kernel: Any) -> None:
        COUNTS.compiled += 1
        try:
            key = self._key(sig)
            data = _serialise(key, kernel)
        except Exception:  # UncacheableKernel, or numba refusing to serialise this kernel
            COUNTS.uncacheable += 1
            return
        try:
            self._files.save(key, data)
        except OSError:  # a read-only or full disk: the kernel is compiled, the next process compiles it again
            COUNTS.failed += 1

    def flush(self) -> None:
        """numba's `recompile` flushes its cache; entries here are exact, so nothing is dropped."""


def _serialise(key: str, kernel: Any) -> bytes:
    """The pickled (key, payload) of a compiled kernel: numba's own serialised states (what its cache stores), the
    code library's LLVM IR and PTX left out (a launch needs the cubin alone)."""
    from numba.cuda.serialize import dumps

    states = dict(kernel._reduce_states())
    library = dict(states.pop("codelibrary")._reduce_states())
    if not library["cubin_cache"]:
        raise ValueError("the kernel has no cubin yet")
    library.update(llvm_strs=[], ptx_cache={})
    return dumps((key, {"kernel": states, "library": library}))


def _rebuild(payload: dict) -> Any:
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel

    library = CUDACodeLibrary._rebuild(**payload["library"])
    return _Kernel._rebuild(codelibrary=library, **payload["kernel"])


def report() -> dict[str, Any]:
    """This process's cache directory (None: off) and counts, for the server's startup record."""
    root = cache_root()
    return {"directory": None if root is None else str(_generation(root).directory), **attrs.asdict(COUNTS)}


def attach(dispatcher: Any, function: types.FunctionType, options: dict[str, Any]) -> None:
    """Give a kernel dispatcher the disk cache, where the cache is on."""
    root = cache_root()
    if root is not None:
        dispatcher._cache = KernelDiskCache(function, options, _generation(root))
