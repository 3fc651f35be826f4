"""`--grader local`: an LLM grader the run serves itself, with no API key.

The grader's checkpoint (`--grader-checkpoint`, default the teacher's starting checkpoint) is
served by a frozen pool of the embedded engine behind its own sglang-router, and graded through
the same OpenAI chat route and `OpenAIGrader` request path as any self-hosted server: the grader
model's own chat template renders its prompt (the worker applies it), so rubric + chain-of-thought
grading needs nothing outside this machine. The pool stops with the run's other processes.
"""

from __future__ import annotations

from slime_meta.config.arguments import MetaConfig

POOL_NAME = "grader"


def grader_checkpoint(cfg: MetaConfig) -> str | None:
    """The local grader's model: --grader-checkpoint, else the teacher's starting --hf-checkpoint."""
    return cfg.grader.grader_checkpoint or cfg.pools.hf_checkpoint


def local_grader_line(cfg: MetaConfig) -> str:
    """The start line for --grader local: which model grades, where, and that it reads the rubrics."""
    g = cfg.grader
    source = "--grader-checkpoint" if g.grader_checkpoint else "the teacher's starting --hf-checkpoint, frozen"
    return (
        f"grader: LLM grader {grader_checkpoint(cfg)} ({source}) served by this run: {g.grader_num_workers} embedded "
        f"worker(s) behind their own router (--grader local, no API key); rubrics from column "
        f"'{cfg.data.rubric_key}' go into its prompt"
    )


def start_grader_pool(processes, cfg: MetaConfig, model_dir: str, log_dir: str, worker_args: list[str]) -> str:
    """Start the frozen grader pool; its OpenAI-compatible base URL (`http://HOST:PORT/v1`)."""
    endpoints = processes.start_pool(
        POOL_NAME,
        model_dir,
        cfg.grader.grader_num_workers,
        device=cfg.pools.device,
        gpu_ids=None,
        weights_root=None,
        log_dir=log_dir,
        worker_args=worker_args,
    )
    return endpoints.router_url.rstrip("/") + "/v1"
