"""Checks of the parsed flags that argparse cannot express: each failure is one line naming the flag
and the fix (UserInputError, exit code 2). Called once, by `build_config`."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from slime_meta.config.objectives import validate_objective_flags
from slime_meta.data.batch_split import plan_batch
from slime_meta.data.problems import check_group_column
from slime_meta.errors import UserInputError


def validate_flags(ns: argparse.Namespace) -> None:
    def fail(message: str) -> None:
        raise UserInputError(message)

    if not ns.prompt_data:
        # Every missing required flag in one message, not one per attempt.
        required = (
            (ns.prompt_data, "--prompt-data (a .parquet, .jsonl or .json dataset, e.g. data/math_word_problems.jsonl)"),
            (ns.hf_checkpoint, "--hf-checkpoint (the teacher model: an HF checkpoint directory or a .gguf file)"),
        )
        missing = [flag for given, flag in required if not given]
        fail(f"{'these flags are' if len(missing) > 1 else 'this flag is'} required: " + "; ".join(missing))
    if not 0.0 < ns.inner_loop_train_ratio < 1.0:
        fail(f"--inner-loop-train-ratio {ns.inner_loop_train_ratio}: must be strictly between 0 and 1 (e.g. 0.75)")
    try:
        plan_batch(
            rollout_batch_size=ns.rollout_batch_size,
            train_ratio=ns.inner_loop_train_ratio,
            heldout_ipb=ns.heldout_ipb,
            problems_per_prompt=ns.n_problems_per_prompt,
            per_family=ns.group_key is not None,
        )
    except UserInputError:
        if ns.group_key is not None:
            # The split's advice counts --group-key's families: a column that is not there is the first
            # thing to fix (the data is read only here, where the split failed: config building stays cheap).
            check_group_column(ns.prompt_data, ns.group_key)
        raise
    validate_eval_flags(ns)
    if not 0.0 <= ns.trace_sample_rate <= 1.0:
        fail(f"--trace-sample-rate {ns.trace_sample_rate}: must be between 0 and 1")
    for flag in ("teacher_temperature", "rollout_temperature", "grader_temperature"):
        if getattr(ns, flag) < 0:
            fail(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: must be >= 0")
    validate_pool_flags(ns)
    if not _is_host(ns.host):
        fail(f"--host {ns.host!r}: not an IP address or host name; use 127.0.0.1 (default) or this machine's address")
    if ns.request_retries < 0:
        fail(f"--request-retries {ns.request_retries}: must be >= 0")
    for flag in ("eval_baseline_problems", "eval_baseline_attempts"):
        if getattr(ns, flag) < 1:
            fail(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: must be >= 1")
    if ns.max_async_level < 0:
        fail(f"--max-async-level {ns.max_async_level}: must be >= 0")
    if ns.lr <= 0:
        fail(f"--lr {ns.lr}: must be > 0")
    if ns.eps_clip <= 0:
        fail(f"--eps-clip {ns.eps_clip}: must be > 0")
    if ns.load and not Path(ns.load).exists():
        fail(f"--load {ns.load}: no such directory; give a --save directory of an earlier run")
    if ns.save_interval and not ns.save:
        fail("--save-interval needs --save DIR (where checkpoints go)")
    if ns.save_retain_interval and not (ns.save_interval and ns.save_retain_interval % ns.save_interval == 0):
        fail(
            f"--save-retain-interval {ns.save_retain_interval}: must be a multiple of --save-interval "
            f"({ns.save_interval or 'not given'}); give --save-interval N and a multiple of N"
        )
    validate_objective_flags(ns)
    if ns.wandb_mode == "online" and ns.use_wandb:
        import os

        if not os.environ.get("WANDB_API_KEY"):
            fail("--wandb-mode online needs WANDB_API_KEY in the environment (or use --wandb-mode offline)")


def validate_eval_flags(ns: argparse.Namespace) -> None:
    values = list(ns.eval_prompt_data or ())
    if len(values) % 2:
        raise UserInputError(
            "--eval-prompt-data takes NAME PATH pairs (e.g. --eval-prompt-data held data/held.jsonl); got "
            f"{len(values)} values"
        )
    names = values[0::2]
    for name, path in zip(names, values[1::2]):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or names.count(name) > 1:
            raise UserInputError(
                f"--eval-prompt-data {name} {path}: NAME must be unique and of letters, digits, '_', '.', '-'"
            )
        if not Path(path).is_file():
            raise UserInputError(
                f"--eval-prompt-data {name} {path}: no such file; give a .parquet, .jsonl or .json dataset"
            )
    if ns.eval_interval is not None and not values:
        raise UserInputError("--eval-interval needs --eval-prompt-data NAME PATH (the fixed evaluation set)")
    if getattr(ns, "num_rollout", 1) == 0 and not values and not getattr(ns, "eval_baseline", False):
        raise UserInputError(
            "--num-rollout 0 evaluates only, and nothing is asked to be evaluated: give --eval-prompt-data NAME PATH "
            "and/or --eval-baseline, or a number of steps >= 1"
        )


def validate_pool_flags(ns: argparse.Namespace) -> None:
    """The pool flags: ports, and one way to get the student (shared, a pool we start, or a running server)."""
    for flag in ("teacher_port", "student_router_port"):
        port = getattr(ns, flag)
        if port is not None and not 1 <= port <= 65535:
            raise UserInputError(f"--{flag.replace('_', '-')} {port}: must be a port between 1 and 65535")
    starts_student = bool(ns.student_checkpoint or ns.student_num_gpus)
    if ns.external_student_url:
        if not re.fullmatch(r"https?://[^\s/]+(:\d+)?/?", ns.external_student_url):
            raise UserInputError(
                f"--external-student-url {ns.external_student_url}: give the server as http://HOST:PORT"
            )
        if starts_student or ns.student_router_port is not None or ns.student_router_ip is not None:
            raise UserInputError(
                "--external-student-url uses a running student server; --student-checkpoint, --student-num-gpus and "
                "--student-router-ip/--student-router-port describe a student pool this run starts: give one or the "
                "other"
            )
    if ns.backend == "local":
        if ns.student_router_ip is not None and ns.student_router_ip != ns.host:
            raise UserInputError(
                f"--student-router-ip {ns.student_router_ip}: the local backend starts the student router on --host "
                f"({ns.host}); leave it out, or use --external-student-url for a server that runs elsewhere"
            )
        if ns.student_router_port is not None and not starts_student:
            raise UserInputError(
                f"--student-router-port {ns.student_router_port}: no student router is started (the student shares the "
                "teacher's pool); add --student-num-gpus or --student-checkpoint for a separate pool, or use "
                "--external-student-url for a running server"
            )


def student_pool_defaults(ns: argparse.Namespace) -> dict[str, Any]:
    """The student flags as resolved: a separate pool's checkpoint and engine size default to the teacher's;
    --external-student-url without a trailing slash."""
    checkpoint = ns.student_checkpoint
    if ns.student_num_gpus and not checkpoint:
        checkpoint = ns.hf_checkpoint  # a frozen student from the teacher's starting weights (also after a resume)
    per_engine = ns.student_num_gpus_per_engine
    url = getattr(ns, "external_student_url", None)
    return {
        "student_checkpoint": checkpoint,
        "student_num_gpus_per_engine": ns.rollout_num_gpus_per_engine if per_engine is None else per_engine,
        "external_student_url": url.rstrip("/") if url else None,  # read as the server's root everywhere
    }


def _is_host(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*", host))
