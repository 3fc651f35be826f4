"""Latency-controlled workers that speak the subset of SGLang's API the inner loop uses.

Why: the inner-loop benchmark measures orchestration (how close one outer step comes to its lower
bound), so the workers must take a known time per request and nothing else. Each virtual worker
listens on its own port (the router sees one worker per port), serves at most `capacity` requests
at once and queues the rest in arrival order, and holds each request for a latency drawn from a
lognormal distribution (median `median_ms`, shape `sigma`): generation time is proportional to
the number of tokens generated, and generation lengths are heavy-tailed, so latencies are too.

    python benchmarks/fake_sglang.py --ports 4001 4002 --role student --capacity 8 \
        --median-ms 50 --sigma 0.6 --seed 0

Endpoints: GET /health, /health_generate, /get_model_info (/model_info), /get_server_info
(/server_info); POST /generate (SGLang native), POST /v1/chat/completions (OpenAI style, for the
grader); GET /bench/stats and POST /bench/reset {"seed": s, "capacity": c} (benchmark bookkeeping:
restart the random stream, resize the queue, zero the counters).

What a reply holds, by role: `student` answers "... Answer: 42 (gen_ms=...)"; `teacher` a short
info text with one output id and log-prob per character; `grader` "GRADE: g\nEXPLANATION: ...".
Every reply carries the service time the worker applied (without queueing): in
`meta_info.e2e_latency` (seconds) for /generate, as `gen_ms=...` at the end of a student's text
(the grader passes it on to the benchmark with the solution) and as `service_ms=...` at the end
of the grader's explanation, so the benchmark can compute each chain's critical path from what
really happened.

`sampling_params.n = k` is served as SGLang serves it: k rows, each holding a slot for its own
drawn latency (k generations of different lengths decoding side by side), and one reply, a list
of k result objects, once the last row is done.

Several ports in one process share the process's CPU but each has its own queue and its own
random stream (seeded by `seed` and the port's index), so a run with the same number of
requests per worker draws the same latencies whatever the order requests arrive in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field

from aiohttp import web

ROLES = ("student", "teacher", "grader")


@dataclass
class VirtualWorker:
    index: int
    port: int
    capacity: int
    median_s: float
    sigma: float
    max_factor: float
    seed: int
    rng: random.Random = field(init=False)
    slots: asyncio.Semaphore = field(init=False)
    requests: int = 0  # rows served (an `n = k` request is k rows)
    http_requests: int = 0  # /generate and chat requests received
    busy_s: float = 0.0  # sum of service times
    queue_s: float = 0.0  # sum of waits for a free slot
    max_in_flight: int = 0
    in_flight: int = 0

    def __post_init__(self) -> None:
        self.reset(self.seed)

    def reset(self, seed: int, capacity: int | None = None) -> None:
        if capacity is not None:
            self.capacity = capacity
        self.rng = random.Random(f"{seed}:{self.index}")
        self.slots = asyncio.Semaphore(self.capacity)
        self.requests = self.http_requests = 0
        self.busy_s = self.queue_s = 0.0
        self.max_in_flight = self.in_flight = 0

    def draw_latency(self) -> float:
        if self.sigma <= 0:
            return self.median_s
        factor = math.exp(self.sigma * self.rng.gauss(0.0, 1.0))
        return self.median_s * min(factor, self.max_factor)

    async def serve_one(self, latency: float | None = None) -> tuple[float, float]:
        """Wait for a slot, hold it for one drawn latency: (service s, queue s)."""
        if latency is None:
            latency = self.draw_latency()  # drawn in arrival order, before queueing
        arrived = time.perf_counter()
        async with self.slots:
            started = time.perf_counter()
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(latency)
            finally:
                self.in_flight -= 1
        self.requests += 1
        self.busy_s += latency
        self.queue_s += started - arrived
        return latency, started - arrived


def _student_text(rng: random.Random, tokens: int) -> str:
    return "Reasoning " + "x" * min(tokens, 64) + f"\nAnswer: {rng.randint(0, 99)}"


def _teacher_text(rng: random.Random) -> str:
    return f"Hint {rng.randrange(10**6):06d}: check units; subtract the discount before the tax."


def build_app(worker: VirtualWorker, role: str, per_token_ms: float) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(request: web.Request) -> web.Response:
        # No model_path: the router would try to fetch a tokenizer for it from the hub.
        return web.json_response(
            {"is_generation": True, "weight_version": "default", "preferred_sampling_params": None}
        )

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"role": role, "capacity": worker.capacity, "weight_version": "default"})

    async def generate(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        worker.http_requests += 1
        samples = int((body.get("sampling_params") or {}).get("n") or 1)
        latencies = [worker.draw_latency() for _ in range(samples)]  # in arrival order, before queueing
        served = await asyncio.gather(*[worker.serve_one(latency) for latency in latencies])
        results = [one_result(body, latency, queued) for latency, queued in served]
        return web.json_response(results if samples > 1 else results[0])

    def one_result(body: dict, latency: float, queued: float) -> dict:
        tokens = max(1, round(latency * 1000.0 / per_token_ms))
        rng = worker.rng
        if role == "teacher":
            text = _teacher_text(rng)
            output_ids = [ord(c) % 250 + 4 for c in text]
        else:
            text = _student_text(rng, tokens) + f" (gen_ms={latency * 1000.0:.3f})"
            output_ids = []  # the student's ids are never read by the loop
        meta = {
            "id": body.get("rid") or "r",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": len(body.get("input_ids") or ()) or len(body.get("text") or ""),
            "completion_tokens": tokens,
            "cached_tokens": 0,
            "weight_version": "default",
            "e2e_latency": latency,
            "queue_time": queued,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, i, None] for i in output_ids]
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        worker.http_requests += 1
        latency, queued = await worker.serve_one()
        grade = worker.rng.choice((0.0, 0.25, 0.5, 1.0))
        content = f"GRADE: {grade}\nEXPLANATION: fake grader reply. service_ms={latency * 1000.0:.3f}"
        return web.json_response(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "fake-grader",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def stats(request: web.Request) -> web.Response:
        cpu = os.times()
        return web.json_response(
            {
                "port": worker.port,
                "requests": worker.requests,
                "http_requests": worker.http_requests,
                "busy_s": worker.busy_s,
                "queue_s": worker.queue_s,
                "max_in_flight": worker.max_in_flight,
                "capacity": worker.capacity,
                "process_cpu_s": cpu.user + cpu.system,
            }
        )

    async def reset(request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        capacity = body.get("capacity")
        worker.reset(int(body.get("seed", worker.seed)), int(capacity) if capacity else None)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, server_info)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/bench/stats", stats)
    app.router.add_post("/bench/reset", reset)
    return app


async def serve(args: argparse.Namespace) -> None:
    runners = []
    for index, port in enumerate(args.ports):
        worker = VirtualWorker(
            index=index,
            port=port,
            capacity=args.capacity,
            median_s=args.median_ms / 1000.0,
            sigma=args.sigma,
            max_factor=args.max_factor,
            seed=args.seed,
        )
        runner = web.AppRunner(build_app(worker, args.role, args.per_token_ms), access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, args.host, port, backlog=4096).start()
        runners.append(runner)
    print(f"fake {args.role} workers ready on ports {' '.join(map(str, args.ports))}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", type=int, nargs="+", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--capacity", type=int, default=64, help="requests served at once per worker")
    parser.add_argument("--median-ms", type=float, default=50.0)
    parser.add_argument("--sigma", type=float, default=0.6, help="lognormal shape; 0 = fixed latency")
    parser.add_argument("--max-factor", type=float, default=20.0, help="latency cap, in medians")
    parser.add_argument("--per-token-ms", type=float, default=1.0, help="only sets completion_tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(serve(args))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
