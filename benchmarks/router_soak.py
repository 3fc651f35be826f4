"""The sglang-router alone, request after request: its resident memory per request routed.

A run's pools sit behind the real sglang-router, launched as the run launches it
(`launcher.router_command`: round robin, its metrics on a port of its own, warnings only, a health
check every second). This puts the same router in front of stand-in workers that answer at once
(benchmarks/fake_sglang.py) and sends it `/generate` requests as the run's pool client does
(`input_ids`, `sampling_params` with `n`, `return_logprob`), `--concurrency` at a time, reading the
router's RSS every `--every` requests. The least-squares slope after `--warmup` requests, in bytes
a request, tells memory the router keeps per request from the noise of its allocator.

    python benchmarks/router_soak.py                               # 60,000 requests, prompts of 500-2,000 ids
    python benchmarks/router_soak.py --requests 400000 --prompt-ids 5-20
    python benchmarks/router_soak.py --n 4                         # four completions a request
    python benchmarks/router_soak.py --median-ms 300 --concurrency 64 --requests 24000   # requests that last
    python benchmarks/router_soak.py --router-arg=--health-check-interval-secs=60   # a flag of the router's own
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402 (puts the repo root on sys.path)
from soak_figures import fitted_slope  # noqa: E402
from soak_probes import memory_kib  # noqa: E402

from slime_meta.backends.local.workers.launcher import router_command  # noqa: E402

FAKE_WORKER = Path(__file__).resolve().parent / "fake_sglang.py"


def request_bodies(count: int, shortest: int, longest: int, n: int, seed: int) -> list[bytes]:
    """`count` distinct /generate bodies, as the pool client sends them (prompt ids, n completions)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        ids = [rng.randrange(150_000) for _ in range(rng.randint(shortest, longest))]
        sampling = {"max_new_tokens": 192, "temperature": 1.0, "top_p": 1.0} | ({"n": n} if n > 1 else {})
        bodies.append(json.dumps({"input_ids": ids, "sampling_params": sampling, "return_logprob": True}).encode())
    return bodies


async def drive(url: str, router_pid: int, args: argparse.Namespace) -> tuple[list[dict], int]:
    """Send `args.requests` requests, `args.concurrency` at a time; the router's memory every `args.every`."""
    bodies = request_bodies(64, *args.prompt_ids, args.n, args.seed)
    samples = [{"requests": 0, **(memory_kib(router_pid) or {})}]
    sent = done = errors = 0
    started = time.monotonic()

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal sent, done, errors
        while sent < args.requests:
            body = bodies[sent % len(bodies)]
            sent += 1
            try:
                async with session.post(
                    url + "/generate", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    errors += r.status != 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1
            done += 1
            if done % args.every == 0:
                samples.append({"requests": done, "seconds": round(time.monotonic() - started, 2)})
                samples[-1].update(memory_kib(router_pid) or {})

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
    return samples, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60_000, help="requests to send through the router")
    parser.add_argument("--every", type=int, default=2_000, help="read the router's memory every this many")
    parser.add_argument("--warmup", type=int, default=4_000, help="requests left out before the slope")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--prompt-ids", default="500-2000", help="prompt length range in token ids, LO-HI")
    parser.add_argument("--n", type=int, default=1, help="completions a request (sampling_params.n)")
    parser.add_argument("--workers", type=int, default=2, help="stand-in workers behind the router")
    parser.add_argument(
        "--median-ms", type=float, default=2.0, help="the stand-in workers' median time a request (lognormal)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--router-arg", action="append", default=[], help="a flag added to the router's command (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args(argv)
    try:
        shortest, longest = (int(part) for part in args.prompt_ids.split("-"))
    except ValueError:
        parser.exit(2, f"error: --prompt-ids {args.prompt_ids}: give LO-HI, two counts such as 500-2000\n")
    if not 1 <= shortest <= longest:
        parser.exit(2, f"error: --prompt-ids {args.prompt_ids}: give 1 <= LO <= HI\n")
    if args.median_ms <= 0:
        parser.exit(2, f"error: --median-ms {args.median_ms:g}: give a time above 0 ms\n")
    if args.every < 1 or args.requests < args.warmup + 3 * args.every:
        parser.exit(2, "error: --requests must leave at least 3 readings (of --every) after --warmup\n")
    args.prompt_ids = (shortest, longest)

    with tempfile.TemporaryDirectory(prefix="router-soak-") as tmp, C.Children(Path(tmp)) as children:
        *worker_ports, router_port, metrics_port = C.free_ports(args.workers + 2)
        workers = [f"http://127.0.0.1:{port}" for port in worker_ports]
        fake = [sys.executable, str(FAKE_WORKER), "--role", "teacher", "--ports", *map(str, worker_ports)]
        children.start(
            "workers", [*fake, "--capacity", "64", "--median-ms", str(args.median_ms), "--sigma", "0.3", "--seed", "0"]
        )
        children.wait_ready([url + "/health" for url in workers])
        command = [*router_command("127.0.0.1", router_port, metrics_port, workers), *args.router_arg]
        router = children.start("router", command)
        url = f"http://127.0.0.1:{router_port}"
        children.wait_ready([url + "/readiness"])
        started = time.monotonic()
        samples, errors = asyncio.run(drive(url, router.pid, args))
        seconds = time.monotonic() - started

    measured = [s for s in samples if s["requests"] >= args.warmup and "rss_kib" in s]
    figures = {}
    for kind in ("rss", "anon"):
        slope_mib, noise_mib = fitted_slope([s["requests"] for s in measured], [s[f"{kind}_kib"] for s in measured])
        figures[kind] = {
            "mib_after_warmup": round(measured[0][f"{kind}_kib"] / 1024, 1),
            "mib_end": round(measured[-1][f"{kind}_kib"] / 1024, 1),
            "bytes_per_request": round(slope_mib * 2**20, 1),
            "noise_mib": round(noise_mib, 2),
        }
    settings = vars(args) | {"out": str(args.out) if args.out else None, "router_command": command[1:]}
    report = C.report_header("router_soak", settings)
    report.update(seconds=round(seconds, 1), errors=errors, figures=figures, samples=samples)
    out = args.out or C.REPO_ROOT / "benchmarks" / "results" / f"router_soak_cpu_{args.requests}requests.json"
    C.write_json(report, out)
    rss = figures["rss"]
    print(
        f"router soak: {args.requests} requests in {seconds:.0f} s ({errors} errors); router RSS "
        f"{rss['mib_after_warmup']} -> {rss['mib_end']} MiB after request {args.warmup}, "
        f"{rss['bytes_per_request']:+.1f} bytes a request (noise {rss['noise_mib']} MiB; anonymous "
        f"{figures['anon']['bytes_per_request']:+.1f})"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
