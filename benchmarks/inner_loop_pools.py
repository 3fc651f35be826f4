"""The stand-in pools of benchmarks/inner_loop.py (fake SGLang workers behind the real sglang-router, one
pool per role) and the grader clients it compares (the project's, and the same over the openai SDK)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import _common as C  # noqa: E402 (puts the repo root on sys.path)
from inner_loop_recording import ROLES  # noqa: E402

from slime_meta.backends.local.workers.launcher import router_command
from slime_meta.grading.graders import OpenAIGrader


@dataclass
class Pools:
    routers: dict[str, str]
    workers: dict[str, list[str]]


def start_pools(children: C.Children, args: argparse.Namespace) -> Pools:
    ports = C.free_ports(3 * (args.workers + 2))
    routers, workers, ready = {}, {}, []
    for i, role in enumerate(ROLES):
        block = ports[i * (args.workers + 2) : (i + 1) * (args.workers + 2)]
        worker_ports = block[: args.workers]
        children.start(
            f"fake-{role}",
            [
                sys.executable,
                str(Path(__file__).parent / "fake_sglang.py"),
                "--role",
                role,
                "--ports",
                *map(str, worker_ports),
                "--capacity",
                str(args.capacity_latency_bound),
                "--median-ms",
                str(args.median_ms),
                "--sigma",
                str(args.sigma),
                "--seed",
                str(args.seed),
            ],
        )
        workers[role] = [f"http://127.0.0.1:{p}" for p in worker_ports]
        ready += [u + "/health" for u in workers[role]]
    children.wait_ready(ready)
    for i, role in enumerate(ROLES):
        block = ports[i * (args.workers + 2) : (i + 1) * (args.workers + 2)]
        children.start(
            f"router-{role}", router_command("127.0.0.1", block[-2], block[-1], workers[role], args.router_policy)
        )
        routers[role] = f"http://127.0.0.1:{block[-2]}"
    children.wait_ready([u + "/readiness" for u in routers.values()], timeout_s=60)
    return Pools(routers=routers, workers=workers)


def reset_workers(pools: Pools, seed: int, capacity: int) -> None:
    for urls in pools.workers.values():
        for url in urls:
            C.http_json(url + "/bench/reset", {"seed": seed, "capacity": capacity})


def worker_stats(pools: Pools) -> dict[str, dict[str, float]]:
    out = {}
    for role, urls in pools.workers.items():
        stats = [C.http_json(url + "/bench/stats") for url in urls]
        out[role] = {
            "requests": sum(s["requests"] for s in stats),
            "http_requests": sum(s["http_requests"] for s in stats),
            "queue_s_mean": sum(s["queue_s"] for s in stats) / max(1, sum(s["requests"] for s in stats)),
            "max_in_flight_per_worker": max(s["max_in_flight"] for s in stats),
        }
    return out


class SdkChatGrader(OpenAIGrader):
    """The project's grader with its request sent through the openai SDK's default client.

    Only for the client-cost table: the grader sent its requests this way before
    `slime_meta/rollout/chat_api.py`; the retry policy is left out (the stand-in workers never fail).
    """

    def _resources(self):
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            import openai

            self._sdk = openai.AsyncOpenAI(
                api_key=os.environ.get(self.api_key_env) or "EMPTY",
                base_url=self.base_url,
                timeout=self.request_timeout,
                max_retries=0,
            )
            self._semaphore = asyncio.Semaphore(self.concurrency)
            self._loop = loop
        return self._sdk, self._semaphore

    async def _complete(self, client, messages):
        response = await client.chat.completions.create(
            model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens
        )
        return response.choices[0].message.content or ""

    async def aclose(self) -> None:
        if self._loop is asyncio.get_running_loop():
            await self._sdk.close()
        self._loop = self._semaphore = None


GRADER_CLIENTS = {"project": OpenAIGrader, "openai_sdk": SdkChatGrader}


def make_grader(kind: str, url: str, concurrency: int):
    """The project's OpenAIGrader ("project") or the same over the openai SDK ("openai_sdk")."""
    return GRADER_CLIENTS[kind](
        model="fake-grader",
        base_url=url + "/v1",
        concurrency=concurrency,
        max_tokens=64,
        api_key_env="SLIME_META_BENCH_NO_KEY",
    )
