"""Checkpoint flags: an HF directory is used as it is; a `.gguf` file is converted once into a cached HF directory.

Why convert rather than read the GGUF where it is needed: every consumer of a checkpoint (the embedded
workers, the trainer, the context-length and tokenizer reads, slime's SGLang and Megatron) reads an HF
directory. transformers reads a GGUF file (dequantising it to float on load) but refuses to save what it
loaded, and loading takes about 20 s for a 135M model. So the flag is resolved once, where each backend
starts (the local run's config in `backends/local/run.py`; the slime backend's argv in `plan.translate`): the
file is converted into `<cache>/checkpoints/<name>-<sha256 prefix>/` and every consumer sees that directory.
One line says where (no progress bars); later runs find the directory by the file's content and reuse it (one
line says so).

The cache root is `$SLIME_META_CACHE`, else `$XDG_CACHE_HOME/slime-meta`, else `~/.cache/slime-meta`
(on a multi-node cluster, point `SLIME_META_CACHE` at a filesystem every node sees).

Conversion: load with `from_pretrained(dir, gguf_file=name)`, build a plain model of the same config
with `quantization_config` removed, load the dequantised state dict into it (strict: no key may be
missing or left over) and save it as safetensors with the GGUF's tokenizer (its chat template included).
A conversion goes to a staging directory renamed into place at the end, so a killed conversion never
leaves a half checkpoint behind.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from slime_meta.config.arguments import MetaConfig
from slime_meta.config.command_line import rewrite_flag_values
from slime_meta.errors import UserInputError

# Bump when the recipe changes: a cached conversion of an older version is redone on its next use.
# 2: the tokenizer's EOS is the model's (transformers 5.12.1 read SmolLM2's GGUF EOS as <|im_start|>).
CONVERSION_VERSION = 2
MARKER = "conversion.json"  # written last: a directory that has it is complete
# The checkpoint flags of every backend, as written on the command line.
CHECKPOINT_FLAGS = ("--hf-checkpoint", "--student-checkpoint", "--grader-checkpoint")
PACKAGES_HINT = "pip install gguf accelerate (or pip install 'slime-meta[real]')"
Log = Callable[[str], None]


def _print(message: str) -> None:
    print(message, flush=True)


def cache_root() -> Path:
    configured = os.environ.get("SLIME_META_CACHE")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slime-meta"


def is_gguf(path: str | os.PathLike | None) -> bool:
    return bool(path) and str(path).lower().endswith(".gguf")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def converted_dir(gguf_name: str, sha256: str, root: Path | None = None) -> Path:
    """Where the conversion of a GGUF file with this name and content lives (complete once MARKER exists)."""
    stem = gguf_name[: -len(".gguf")] if is_gguf(gguf_name) else gguf_name
    return (root or cache_root()) / "checkpoints" / f"{stem}-{sha256[:12]}"


def is_converted(directory: Path) -> bool:
    """A whole conversion by the current recipe (an older one is converted again)."""
    try:
        marker = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("conversion_version", 1) >= CONVERSION_VERSION


# ----------------------------------------------------------------------------- resolving flags


def resolve_checkpoint(path: str | None, flag: str, *, root: Path | None = None, log: Log = _print) -> str | None:
    """An HF directory (or nothing) as given; a .gguf file as its converted, cached HF directory."""
    if not is_gguf(path):
        return path
    gguf_path = Path(str(path)).expanduser()
    if not gguf_path.is_file():
        raise UserInputError(f"{flag} {path}: no such file; give a .gguf file or a local HF checkpoint directory")
    sha256 = file_sha256(gguf_path)
    directory = converted_dir(gguf_path.name, sha256, root)
    if is_converted(directory):
        log(f"{flag} {path}: using its HF checkpoint directory {directory} (converted earlier)")
    else:
        require_gguf_packages(flag, path)  # a missing package is then the only line
        # Said before, not after: the conversion takes a while (about half a minute for 135M parameters).
        log(f"{flag} {path}: converting it once to the HF checkpoint directory {directory} (later runs reuse it)")
        ensure_converted(gguf_path, flag, root=root, sha256=sha256)
    return str(directory)


def with_converted_checkpoints(config: MetaConfig, *, log: Log = _print) -> MetaConfig:
    """The config with every .gguf checkpoint replaced by its HF directory (each file resolved once)."""
    resolved: dict[str, str | None] = {}

    def resolve(path: str | None, flag: str) -> str | None:
        if is_gguf(path) and path not in resolved:
            resolved[path] = resolve_checkpoint(path, flag, log=log)
        return resolved.get(path, path)

    pools, grader = config.pools, config.grader
    # In the order of the flags on the command line: the first bad one is the one reported.
    hf_checkpoint = resolve(pools.hf_checkpoint, "--hf-checkpoint")
    student_checkpoint = resolve(pools.student_checkpoint, "--student-checkpoint")
    grader_checkpoint = resolve(grader.grader_checkpoint, "--grader-checkpoint")
    if not resolved:
        return config
    return dataclasses.replace(
        config,
        pools=dataclasses.replace(pools, hf_checkpoint=hf_checkpoint, student_checkpoint=student_checkpoint),
        grader=dataclasses.replace(grader, grader_checkpoint=grader_checkpoint),
    )


def resolve_checkpoint_argv(argv: Sequence[str], *, log: Log = _print) -> list[str]:
    """`argv` with the value of each checkpoint flag that names a .gguf file replaced by its HF directory
    (both `--flag value` and `--flag=value`), for a backend whose own parser reads the command line."""
    flags = set(CHECKPOINT_FLAGS)
    resolved: dict[tuple[str, str], str] = {}

    def resolve(flag: str, value: str) -> str:
        if not is_gguf(value):
            return value
        if (flag, value) not in resolved:
            known = next((d for (_, v), d in resolved.items() if v == value), None)
            resolved[(flag, value)] = known or str(resolve_checkpoint(value, flag, log=log))
        return resolved[(flag, value)]

    return rewrite_flag_values(argv, flags, resolve)


# ----------------------------------------------------------------------------- conversion


def require_gguf_packages(flag: str, path: str | os.PathLike) -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserInputError(
            f"{flag} {path}: reading a .gguf file needs the package(s) {' and '.join(missing)}: {PACKAGES_HINT}"
        )


def ensure_converted(
    gguf_path: Path, flag: str = "checkpoint", *, root: Path | None = None, sha256: str | None = None
) -> tuple[Path, float | None]:
    """The cached HF directory of `gguf_path`, converted if missing; the conversion's seconds, None if reused."""
    sha256 = sha256 or file_sha256(gguf_path)
    final = converted_dir(gguf_path.name, sha256, root)
    if is_converted(final):
        return final, None
    require_gguf_packages(flag, gguf_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(final)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.converting-", dir=final.parent))
    staging.chmod(0o755)  # readable by others, as any checkpoint directory (a shared cache on a cluster)
    started = time.perf_counter()
    try:
        summary = convert_gguf(gguf_path, staging, flag)
        seconds = time.perf_counter() - started
        marker = {
            "source": str(gguf_path.resolve()),
            "sha256": sha256,
            "seconds": round(seconds, 1),
            "conversion_version": CONVERSION_VERSION,
            **summary,
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        if final.exists() and not is_converted(final):  # an older recipe's conversion: set aside, then removed
            retired = final.with_name(f".{final.name}.retired-{os.getpid()}")
            os.rename(final, retired)
            shutil.rmtree(retired, ignore_errors=True)
        try:
            os.rename(staging, final)  # atomic: the directory appears whole or not at all
        except OSError:
            if not is_converted(final):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final, seconds


def convert_gguf(gguf_path: Path, out_dir: Path, flag: str = "checkpoint") -> dict:
    """Dequantise `gguf_path` into a plain HF checkpoint (safetensors + tokenizer) in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(gguf_path.parent), gguf_path.name
    try:
        with _no_progress_bars():
            loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as error:
        raise UserInputError(
            f"{flag} {gguf_path}: transformers cannot read it as a GGUF model ({type(error).__name__}: {error})"
        ) from error
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised: a plain model that save_pretrained accepts
    with torch.device("cpu"):
        plain = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(loaded.generation_config)
    with _no_progress_bars():
        plain.save_pretrained(out_dir, safe_serialization=True)
    agree_on_eos(tokenizer, config.eos_token_id)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Some transformers versions read no pad token from a GGUF; every consumer pads with one, and
        # EOS is what the worker falls back to anyway: written once here, all readers agree.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(out_dir)
    return {
        "model_type": config.model_type,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in plain.parameters()),
    }


def agree_on_eos(tokenizer, eos_token_id) -> None:
    """Give the tokenizer the model's EOS (the GGUF's `tokenizer.ggml.eos_token_id`, as the config holds
    it) where its own reading differs: transformers 5.12.1 reads SmolLM2's as <|im_start|>, and every
    reader that stops at `tokenizer.eos_token_id` (the workers, the tests' references) then runs on
    past the end of each answer."""
    first = eos_token_id[0] if isinstance(eos_token_id, (list, tuple)) and eos_token_id else eos_token_id
    if isinstance(first, int) and tokenizer.eos_token_id != first:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(first)


@contextlib.contextmanager
def _no_progress_bars():
    """No progress bars while converting: the line said before it is the conversion's one line on the console.

    transformers draws its own bars (loading, saving) and a plain tqdm bar over the GGUF's tensors.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as transformers_logging

    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    tensor_bar = getattr(gguf_loading, "tqdm", None)
    if tensor_bar is not None:
        gguf_loading.tqdm = functools.partial(tensor_bar, disable=True)
    try:
        yield
    finally:
        if tensor_bar is not None:
            gguf_loading.tqdm = tensor_bar
        if bars_were_on:
            transformers_logging.enable_progress_bar()


def _remove_stale_staging(final: Path, older_than_s: float = 3600.0) -> None:
    """Delete what killed conversions left (a live conversion of a checkpoint this size never takes an hour)."""
    for leftover in final.parent.glob(f".{final.name}.converting-*"):
        if time.time() - leftover.stat().st_mtime > older_than_s:
            shutil.rmtree(leftover, ignore_errors=True)
