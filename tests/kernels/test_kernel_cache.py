"""kernel_cache.py: a kernel compiled in one process is loaded, not compiled, by the next; an entry is found only by
the exact kernel it was made from (code, constants, closure, globals, options, argument types, device, sources);
anything that cannot be keyed exactly, or read back, is compiled as without the cache.

CPU tests compile a tiny kernel for sm_90 without a driver (its cubin through nvJitLink) to round-trip real entries;
the GPU test at the end runs two processes against one cache directory."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("numba.cuda")

from numba import float32, int32  # noqa: E402

from ninfer.kernels_numba import kernel_cache  # noqa: E402
from ninfer.kernels_numba.numba_setup import COMPUTE_CAPABILITY, cuda  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[2]
FAKE_DEVICE = (COMPUTE_CAPABILITY, "(2, 0)")  # device_identity() on a machine without a GPU


@contextlib.contextmanager
def compiled_without_a_gpu():
    """numba-cuda asks the driver for the device's compute capability while it builds a kernel: answer sm_90."""
    from numba.cuda import codegen, dispatcher

    current_device, ensure_cc = dispatcher.get_current_device, codegen.CUDACodeLibrary._ensure_cc
    dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=COMPUTE_CAPABILITY)
    codegen.CUDACodeLibrary._ensure_cc = lambda self, cc: cc or COMPUTE_CAPABILITY
    try:
        yield
    finally:
        dispatcher.get_current_device, codegen.CUDACodeLibrary._ensure_cc = current_device, ensure_cc


def _add(x, y):
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += y[i]


ADD_ARGUMENTS = (float32[::1], float32[::1])


def _compiled_add():
    from numba.cuda.dispatcher import _Kernel

    with compiled_without_a_gpu():
        compiled = _Kernel(_add, ADD_ARGUMENTS)
        compiled._codelibrary.get_cubin()  # what numba's compile leaves after binding the kernel
    return compiled


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(kernel_cache, "device_identity", lambda: FAKE_DEVICE)
    monkeypatch.setattr(kernel_cache, "COUNTS", kernel_cache.CacheCounts())


def _cache(tmp_path: Path, function=_add, options=None) -> kernel_cache.KernelDiskCache:
    return kernel_cache.KernelDiskCache(function, options or {}, kernel_cache.KernelFiles(tmp_path / "generation"))


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", reason="the simulator compiles nothing")
def test_a_saved_kernel_is_loaded_by_another_cache_with_its_cubin_and_types(tmp_path, fake_device, monkeypatch):
    from numba.cuda.dispatcher import _Kernel

    bound = []
    monkeypatch.setattr(_Kernel, "bind", lambda self: bound.append(self.entry_name))  # no driver to load it into
    compiled = _compiled_add()
    _cache(tmp_path).save_overload(ADD_ARGUMENTS, compiled)
    assert kernel_cache.COUNTS == kernel_cache.CacheCounts(compiled=1)
    entries = list((tmp_path / "generation").iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".kernel"
    assert entries[0].stat().st_size < 64 * 1024  # the cubin alone: no LLVM IR, no PTX

    loaded = _cache(tmp_path).load_overload(ADD_ARGUMENTS, None)  # as a later process's dispatcher asks
    assert loaded.entry_name == compiled.entry_name and loaded.argument_types == compiled.argument_types
    assert bound == [compiled.entry_name]  # bound on load: a cubin the driver refuses is compiled over
    cubin = [bytes(k._codelibrary.get_cubin(COMPUTE_CAPABILITY).code) for k in (loaded, compiled)]
    assert cubin[0] == cubin[1]
    assert kernel_cache.COUNTS == kernel_cache.CacheCounts(loaded=1, compiled=1)

    assert _cache(tmp_path).load_overload((int32[::1], int32[::1]), None) is None  # other argument types
    assert _cache(tmp_path, options={"max_registers": 64}).load_overload(ADD_ARGUMENTS, None) is None
    assert kernel_cache.COUNTS.loaded == 1 and kernel_cache.COUNTS.failed == 0

    def refused(self):
        raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")

    monkeypatch.setattr(_Kernel, "bind", refused)
    assert _cache(tmp_path).load_overload(ADD_ARGUMENTS, None) is None  # compiled over
    assert kernel_cache.COUNTS.loaded == 1 and kernel_cache.COUNTS.failed == 1


def test_an_unreadable_or_foreign_entry_is_compiled_over(tmp_path, fake_device):
    cache = _cache(tmp_path)
    key = cache._key(ADD_ARGUMENTS)
    files = kernel_cache.KernelFiles(tmp_path / "generation")
    files.save(key, b"not a pickle")
    assert cache.load_overload(ADD_ARGUMENTS, None) is None
    files.save(key, __import__("pickle").dumps(("another key", {})))  # a hash collision, or a tampered file
    assert cache.load_overload(ADD_ARGUMENTS, None) is None
    assert kernel_cache.COUNTS == kernel_cache.CacheCounts(failed=2)


def test_a_kernel_without_an_exact_fingerprint_is_compiled_and_not_saved(tmp_path, fake_device):
    opaque = object()

    def kernel(x):
        if opaque is not None:
            x[0] = 1

    cache = _cache(tmp_path, function=kernel)
    assert cache.load_overload(ADD_ARGUMENTS[:1], None) is None
    cache.save_overload(ADD_ARGUMENTS[:1], None)  # numba hands over what it compiled; the key fails first
    assert kernel_cache.COUNTS == kernel_cache.CacheCounts(compiled=1, uncacheable=1)
    assert not (tmp_path / "generation").exists()
    with pytest.raises(kernel_cache.UncacheableKernel):
        kernel_cache.function_fingerprint(kernel)
    # device code reading through a module of ninfer: its attributes are not followed
    from ninfer.backends.cpu import ops

    reads_ops = types.FunctionType(compile("def f(x):\n    x[0] = ops.EPS\n", "<f>", "exec").co_consts[0],
                                   {"ops": ops}, "f")
    with pytest.raises(kernel_cache.UncacheableKernel, match="reads through module"):
        kernel_cache.function_fingerprint(reads_ops)


def _factory(width):
    def kernel(x):
        x[0] = width

    return kernel


SCALE = 2


def _scaled(x):
    x[0] = SCALE


def test_keys_tell_apart_closures_globals_constants_options_types_and_devices():
    fingerprint = kernel_cache.function_fingerprint
    assert fingerprint(_factory(4)) == fingerprint(_factory(4))
    assert fingerprint(_factory(4)) != fingerprint(_factory(8))
    # a global the code names, wherever it is defined (a changed constant of another module changes the key)
    before = fingerprint(_scaled)
    other = types.FunctionType(_scaled.__code__, {**_scaled.__globals__, "SCALE": 3}, "_scaled")
    other.__qualname__ = _scaled.__qualname__
    assert kernel_cache.function_fingerprint(other) != before
    assert kernel_cache.function_fingerprint(_scaled) == before
    # template instantiations: the same bytecode, other literal sizes
    source = "def sized(x):\n    x[0] = {size}\n"
    made = []
    for size in (16, 32):
        scope: dict = {}
        exec(compile(source.format(size=size), "<sized>", "exec"), scope)  # noqa: S102  (test source)
        made.append(scope["sized"])
    assert made[0].__code__.co_code == made[1].__code__.co_code
    assert fingerprint(made[0]) != fingerprint(made[1])

    def key(options=None, arguments=ADD_ARGUMENTS, device=FAKE_DEVICE):
        return kernel_cache.entry_key(_add, options or {}, arguments, *device)

    assert key() == key()
    assert len({key(), key({"max_registers": 64}), key({"fastmath": True}), key(arguments=(int32[::1],) * 2),
                key(device=((9, 0), "(2, 1)")), key(device=((10, 0), "(2, 0)"))}) == 6


_REGISTRY_FINGERPRINTS = textwrap.dedent("""
    import hashlib, importlib, pkgutil, sys
    import ninfer.kernels_numba as package
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__))
    for name in (reversed(names) if sys.argv[1] == "reversed" else names):
        importlib.import_module("ninfer.kernels_numba." + name)
    from ninfer.kernels_numba.kernel_cache import Fingerprints
    from ninfer.kernels_numba.numba_setup import REGISTRY
    fingerprints = Fingerprints()
    keys = sorted(fingerprints.function(r.function) + repr(sorted(r.options.items())) for r in REGISTRY)
    print(len(keys), len(set(keys)), hashlib.sha256("|".join(keys).encode()).hexdigest())
""")


def test_every_registered_kernel_has_one_key_of_its_own_the_same_in_every_process():
    """Every kernel (factory variants and template instantiations included) is cacheable, no two share a key, and
    a process that imports the modules in another order, with another hash seed, computes the same keys."""
    runs = []
    for order, seed in (("sorted", "0"), ("reversed", "12345")):
        result = subprocess.run([sys.executable, "-c", _REGISTRY_FINGERPRINTS, order], capture_output=True,
                                text=True, cwd=REPOSITORY, env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        runs.append(result.stdout.split())
    assert runs[0] == runs[1]
    count, distinct, _ = runs[0]
    assert int(count) > 150 and count == distinct


def test_a_kernels_key_follows_the_source_files_it_draws_on_and_no_others(tmp_path, monkeypatch):
    """An edit to a file changes the keys of the kernels that use something in it (through any depth of device
    functions), not the keys of the others."""
    from ninfer.kernels_numba.numba_setup import device_function

    (tmp_path / "cache_helpers.py").write_text("def one(x):\n    return x + 1\n")
    (tmp_path / "cache_kernels.py").write_text(textwrap.dedent("""
        from cache_helpers import one

        def uses_helper(x):
            x[0] = one(x[0])

        def alone(x):
            x[0] = 2
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import cache_helpers

    cache_helpers.one = device_function(cache_helpers.one)  # as kernel modules decorate their helpers
    import cache_kernels

    cache_kernels.one = cache_helpers.one

    def keys():
        kernel_cache.file_digest.cache_clear()
        return [kernel_cache.entry_key(getattr(cache_kernels, name), {}, ADD_ARGUMENTS[:1], *FAKE_DEVICE)
                for name in ("uses_helper", "alone")]

    before = keys()
    assert kernel_cache.Fingerprints().sources(cache_kernels.uses_helper) == {
        str(tmp_path / "cache_helpers.py"), str(tmp_path / "cache_kernels.py")}
    (tmp_path / "cache_helpers.py").write_text("def one(x):\n    return x + 1  # edited\n")
    after = keys()
    assert after[0] != before[0] and after[1] == before[1]
    kernel_cache.file_digest.cache_clear()


def test_the_cache_root_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_cache.ENVIRONMENT, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.cache_root() == tmp_path / "ninfer" / "kernels"
    monkeypatch.setenv(kernel_cache.ENVIRONMENT, str(tmp_path / "elsewhere"))
    assert kernel_cache.cache_root() == tmp_path / "elsewhere"
    for off in ("off", "0", "", "OFF"):
        monkeypatch.setenv(kernel_cache.ENVIRONMENT, off)
        assert kernel_cache.cache_root() is None


def _generation_name(n: int) -> str:
    return f"kernels-{n:032x}"


def test_old_generations_are_pruned_by_last_use_and_nothing_else_is_touched(tmp_path):
    for age in range(5):
        (tmp_path / _generation_name(age)).mkdir()
        stamp = time.time() - 100 * age
        os.utime(tmp_path / _generation_name(age), (stamp, stamp))
    (tmp_path / "someone-elses").mkdir()  # the cache pointed at a shared directory
    stamp = time.time() - 10_000
    os.utime(tmp_path / "someone-elses", (stamp, stamp))
    removed = kernel_cache.prune_generations(tmp_path, keep=3)
    assert sorted(p.name for p in removed) == [_generation_name(3), _generation_name(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([_generation_name(0), _generation_name(1),
                                                                  _generation_name(2), "someone-elses"])


def test_the_first_save_makes_its_generation_the_newest_and_prunes(tmp_path):
    for age in range(4):
        (tmp_path / _generation_name(age + 1)).mkdir()
        stamp = time.time() - 1000 - age
        os.utime(tmp_path / _generation_name(age + 1), (stamp, stamp))
    current = tmp_path / _generation_name(0)
    current.mkdir()
    stale, crashed, recent = current / "stale.kernel", current / "crashed.partial", current / "recent.kernel"
    for path, days in ((stale, kernel_cache.STALE_DAYS + 1), (crashed, 2), (recent, kernel_cache.STALE_DAYS - 1)):
        path.write_bytes(b"")
        stamp = time.time() - days * 86400
        os.utime(path, (stamp, stamp))
    files = kernel_cache.KernelFiles(current)
    files.save("key", __import__("pickle").dumps(("key", {"payload": 1})))
    assert files.load("key") == {"payload": 1} and files.load("other") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [_generation_name(n) for n in range(3)]
    assert sorted(p.name for p in current.iterdir()) == sorted([files.path("key").name, "recent.kernel"])


def test_a_load_marks_its_entry_used(tmp_path):
    files = kernel_cache.KernelFiles(tmp_path)
    files.save("key", __import__("pickle").dumps(("key", 1)))
    old = time.time() - 10 * 86400
    os.utime(files.path("key"), (old, old))
    assert files.load("key") == 1
    assert files.path("key").stat().st_mtime > time.time() - 60


_TWO_PROCESSES = textwrap.dedent("""
    import hashlib, json
    import numpy as np
    from ninfer.kernels_numba import elementwise, kernel_cache
    from ninfer.kernels_numba.numba_setup import cuda

    x = cuda.to_device(np.linspace(-3, 3, 4 * 256, dtype=np.float32).reshape(4, 256))
    out = cuda.device_array((4, 256), np.uint16)
    elementwise.to_bf16_rows(x, out, stream=0)
    print(json.dumps({"counts": kernel_cache.COUNTS.summary(), "loaded": kernel_cache.COUNTS.loaded,
                      "compiled": kernel_cache.COUNTS.compiled,
                      "out": hashlib.sha256(out.copy_to_host().tobytes()).hexdigest()}))
""")


@pytest.mark.gpu
def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    import json

    environment = {**os.environ, kernel_cache.ENVIRONMENT: str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _TWO_PROCESSES], capture_output=True, text=True,
                                      cwd=REPOSITORY, env=environment, check=True).stdout.splitlines()[-1])
            for _ in range(2)]
    assert runs[0]["compiled"] >= 1 and runs[0]["loaded"] == 0
    assert runs[1]["compiled"] == 0 and runs[1]["loaded"] == runs[0]["compiled"]
    assert runs[0]["out"] == runs[1]["out"]
