"""Inner-loop orchestration: one outer step's rollout against its lower bound and two baselines.

    python benchmarks/inner_loop.py            # N=32 prompts, G=4, K=3, m=4 (about 2 minutes)
    python benchmarks/inner_loop.py --quick    # a small step, for the test suite (a few seconds)

What runs: the real `MetaLearningRollout` with the real student and teacher roles over the real
`SGLangPool` client, the real `OpenAIGrader`, and the real sglang-router in front of each pool.
Only the workers are stand-ins (`fake_sglang.py`): each holds a request for a latency drawn from a
lognormal (median 50 ms, heavy right tail, as generation lengths are) and serves at most
`capacity` requests at once, queueing the rest. Three pools: student, teacher, grader.

What it reports, per scenario (ample capacity: latency bound; little capacity: capacity bound):
- ours: wall time of one rollout, and the lower bound for that very run,
      bound = max(critical path, max over pools of work / capacity),
  where the critical path is the longest chain given the service times the workers really
  applied (per chain: sum over K iterations of [max over its attempts of (generate + grade) +
  teach], plus max over its holdout attempts of (generate + grade); the no-info control counts
  as a chain of one stage), and work is the sum of service times sent to a pool (row-seconds:
  an `n = m` request is m rows). This bound treats every attempt as free to be graded the
  moment its own generation ends; the loop sends the m attempts at one problem as one request
  with `n = m`, whose reply comes when the slowest of the m is done, so it is also given
  against its own schedule's bound (`bound_n_s`: per problem max generate + max grade).
  The rollout is instrumented by a subclass that only records which chain and problem each
  request belongs to (context variables), and a pool subclass that reads the service time
  from each reply: the orchestration code itself is the project's.
- stage_synchronous: the published slime meta-learning module's schedule over the same roles
  and pools: per inner iteration all generations, barrier, all grades, barrier, all teacher
  calls, barrier; then all holdout generations, barrier, all holdout grades.
- sequential: one request at a time. It is slow (the sum of all latencies), so by default it
  runs a few chains and is scaled by the request count (marked `extrapolated`).
- client CPU per request: this process's CPU time over the step / requests sent. The routers'
  and fake workers' CPU is reported beside it (they share this machine's cores). A second table
  gives it per call, with the grader's request also sent through the openai SDK: the client the
  grader used before `slime_meta/rollout/chat_api.py`, kept here as the baseline that shows why.
Each design runs `--repeats` times with the same latency seeds (the workers restart their
random streams before each run); medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import _common as C  # noqa: E402 (puts the repo root on sys.path)
from inner_loop_baselines import Roles, sequential, stage_synchronous  # noqa: E402
from inner_loop_pools import Pools, make_grader, reset_workers, start_pools, worker_stats  # noqa: E402
from inner_loop_recording import ROLES, InstrumentedRollout, Ledger, RecordingGrader, RecordingPool  # noqa: E402

from slime_meta.prompt_templates import GeneratorPromptTemplate, TeacherPromptTemplate
from slime_meta.rollout.meta_rollout import InnerLoopSettings
from slime_meta.rollout.pools import SGLangPool
from slime_meta.rollout.roles import PromptRenderer, StudentRole, TeacherRole
from slime_meta.types import Episode, GradedAttempt, Problem

TARGETS = {"latency_bound_ratio": 0.9, "capacity_bound_ratio": 0.85, "client_cpu_ms_per_request": 0.5}

# ----------------------------------------------------------------------------- the step


def make_episode(prompts: int, per_prompt: int, holdout: int) -> Episode:
    rows = [r for r in _read_rows(C.REPO_ROOT / "data" / "math_word_problems.jsonl")]
    problems = [
        Problem(uid=f"p{i:04d}", prompt=r["prompt"], label=r["label"], rubric=r.get("rubric", ""))
        for i, r in enumerate(rows[i % len(rows)] for i in range(prompts * per_prompt + holdout))
    ]
    train = tuple(tuple(problems[p * per_prompt : (p + 1) * per_prompt]) for p in range(prompts))
    return Episode(train_chunks_P=train, holdout=tuple(problems[prompts * per_prompt :]))


def _read_rows(path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def expected_requests(args: argparse.Namespace, one_request_per_attempt: bool = False) -> dict[str, int]:
    """Requests per pool in one step: ours sends one student request per problem (`n` = its
    attempts); the baselines one per attempt."""
    chains = args.prompts * args.samples
    attempts = chains * (args.iterations * args.per_prompt * args.attempts + args.holdout) + args.holdout
    problems = chains * (args.iterations * args.per_prompt + args.holdout) + args.holdout
    student = attempts if one_request_per_attempt else problems
    return {"student": student, "grader": attempts, "teacher": chains * args.iterations}


_TOKENIZER: list[Any] = []


def char_tokenizer() -> Any:
    """The demo model's kind of tokenizer (one token a character), built once."""
    if not _TOKENIZER:
        from slime_meta.models.tiny.tokenizer import train_char_tokenizer

        tokenizer = train_char_tokenizer([])
        tokenizer.model_max_length = 10**9  # prompts here are longer than the tiny model's context
        _TOKENIZER.append(tokenizer)
    return _TOKENIZER[0]


async def build_roles(
    pools: Pools, args: argparse.Namespace, ledger: Ledger, grader_kind: str = "project"
) -> tuple[Roles, list[SGLangPool]]:
    tokenizer = char_tokenizer()
    renderer = PromptRenderer(tokenizer, apply_chat_template=False)
    concurrency = args.workers * args.capacity_latency_bound  # the client never binds before the pool
    student_pool = RecordingPool(name="student", base_url=pools.routers["student"], concurrency=concurrency)
    teacher_pool = RecordingPool(name="teacher", base_url=pools.routers["teacher"], concurrency=concurrency)
    for pool in (student_pool, teacher_pool):
        pool.ledger = ledger
    grader = RecordingGrader(make_grader(grader_kind, pools.routers["grader"], concurrency))
    grader.ledger = ledger
    settings = InnerLoopSettings(
        num_inner_iterations=args.iterations,
        n_samples_per_inner_prompt=args.attempts,
        n_samples_per_prompt=args.samples,
        train_all_inner_steps=False,
        holdout_advantage="mean-then-normalize",
        std_normalize=True,
        trace_sample_rate=0.0,
        show_progress=False,
    )
    student = StudentRole(
        pool=student_pool,
        template=GeneratorPromptTemplate(),
        renderer=renderer,
        info_position="prefix",
        temperature=1.0,
        max_new_tokens=256,
    )
    teacher = TeacherRole(
        pool=teacher_pool, template=TeacherPromptTemplate(), renderer=renderer, temperature=1.0, max_new_tokens=128
    )
    return Roles(student, teacher, grader, settings), [student_pool, teacher_pool]


DESIGNS = {"ours": "ours", "stage_synchronous": "stage_synchronous", "sequential": "sequential"}  # name: orchestration


async def run_design(design: str, roles: Roles, episode: Episode, ledger: Ledger, max_chains: int | None) -> dict:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    chains_run = None
    orchestration = DESIGNS[design]
    if orchestration == "ours":
        rollout = InstrumentedRollout(roles.student, roles.grader, roles.teacher, roles.settings)
        rollout.ledger = ledger
        await rollout.run([episode], rollout_id=0)
    elif orchestration == "stage_synchronous":
        await stage_synchronous(roles, episode)
    else:
        chains_run = await sequential(roles, episode, max_chains)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    requests = sum(ledger.requests.values())
    return {"wall_s": wall, "client_cpu_s": cpu, "requests": requests, "chains_run": chains_run}


async def close_roles(roles: Roles, client_pools: list[SGLangPool]) -> None:
    for pool in client_pools:
        await pool.close()
    await roles.grader.inner.aclose()


async def scenario(
    name: str, capacity: int, pools: Pools, children: C.Children, args: argparse.Namespace, warm_up: bool = True
) -> dict:
    episode = make_episode(args.prompts, args.per_prompt, args.holdout)
    total_chains = args.prompts * args.samples
    results: dict[str, Any] = {
        "capacity_per_worker": capacity,
        "workers_per_pool": args.workers,
        "capacity_per_pool": capacity * args.workers,
    }
    runs: dict[str, list[dict]] = {d: [] for d in DESIGNS}
    # One set of clients for the whole scenario, as a training process keeps its pools from one
    # outer step to the next: each run sees warm connections (the warm-up opens them).
    roles, client_pools = await build_roles(pools, args, Ledger())
    if warm_up:  # not recorded: imports, connections, caches
        reset_workers(pools, args.seed, capacity)
        await run_design("stage_synchronous", roles, episode, Ledger(), None)
    for repeat in range(args.repeats):
        for design, orchestration in DESIGNS.items():
            if orchestration == "sequential" and repeat > 0:
                continue  # slow, and its wall time is the sum of the latencies: one run
            reset_workers(pools, args.seed + repeat, capacity)
            ledger = Ledger()
            for recorder in (*client_pools, roles.grader):
                recorder.ledger = ledger
            cpu_children0 = children.cpu_seconds()
            max_chains = None if args.full_sequential else args.sequential_chains
            outcome = await run_design(design, roles, episode, ledger, max_chains)
            cpu_children = {k: v - cpu_children0[k] for k, v in children.cpu_seconds().items()}
            outcome["worker_stats"] = worker_stats(pools)
            outcome["requests_by_pool"] = dict(ledger.requests)
            outcome["router_cpu_s"] = sum(v for k, v in cpu_children.items() if k.startswith("router"))
            outcome["fake_worker_cpu_s"] = sum(v for k, v in cpu_children.items() if k.startswith("fake"))
            if orchestration == "ours":
                critical = max(c.path() for c in ledger.chains)
                critical_n = max(c.path(shared_reply=True) for c in ledger.chains)
                work_bounds = {r: ledger.work_s[r] / (capacity * args.workers) for r in ROLES}
                outcome.update(
                    critical_path_s=critical,
                    critical_path_n_s=critical_n,
                    work_bound_s=work_bounds,
                    bound_s=max(critical, *work_bounds.values()),
                    bound_n_s=max(critical_n, *work_bounds.values()),
                    work_s=dict(ledger.work_s),
                    chains_recorded=len(ledger.chains),
                )
                outcome["bound_over_achieved"] = outcome["bound_s"] / outcome["wall_s"]
                outcome["bound_n_over_achieved"] = outcome["bound_n_s"] / outcome["wall_s"]
                # What this machine allows: every process of the benchmark (client, routers, stand-in
                # workers) shares its cores, so the step cannot take less than their CPU / cores.
                cpu_total = outcome["client_cpu_s"] + outcome["router_cpu_s"] + outcome["fake_worker_cpu_s"]
                outcome["cpu_floor_s"] = cpu_total / (os.cpu_count() or 1)
                outcome["machine_bound_over_achieved"] = (
                    max(outcome["bound_s"], outcome["cpu_floor_s"]) / outcome["wall_s"]
                )
                expected = expected_requests(args)
                if ledger.requests != expected:
                    raise RuntimeError(f"{design} sent {ledger.requests} requests, expected {expected}")
                received = outcome["worker_stats"]["student"]["http_requests"]
                if received != expected["student"]:  # counted where they arrive, behind the router
                    raise RuntimeError(f"student workers received {received} requests, expected {expected['student']}")
            if orchestration == "sequential" and outcome["chains_run"] < total_chains:
                scale = sum(expected_requests(args, one_request_per_attempt=True).values()) / outcome["requests"]
                outcome.update(extrapolated=True, measured_wall_s=outcome["wall_s"], wall_s=outcome["wall_s"] * scale)
            runs[design].append(outcome)
            print(
                f"  [{name}] {design:20s} run {repeat}: {outcome['wall_s']:.3f} s"
                + (f"  bound {outcome['bound_s']:.3f} s" if "bound_s" in outcome else "")
                + f"  client CPU {1000 * outcome['client_cpu_s'] / max(1, outcome['requests']):.2f} ms/req",
                file=sys.stderr,
                flush=True,
            )
    await close_roles(roles, client_pools)
    for design, outcomes in runs.items():
        best = sorted(outcomes, key=lambda o: o["wall_s"])[len(outcomes) // 2]  # the median run
        summary = dict(best)
        summary["wall_s_runs"] = [o["wall_s"] for o in outcomes]
        summary["wall_s"] = statistics.median(summary["wall_s_runs"])
        summary["client_cpu_ms_per_request"] = 1000.0 * best["client_cpu_s"] / max(1, best["requests"])
        summary["router_cpu_ms_per_request"] = 1000.0 * best["router_cpu_s"] / max(1, best["requests"])
        summary["fake_worker_cpu_ms_per_request"] = 1000.0 * best["fake_worker_cpu_s"] / max(1, best["requests"])
        if "bound_s" in best:
            for key in ("bound_over_achieved", "bound_n_over_achieved", "machine_bound_over_achieved"):
                summary[key + "_runs"] = [o[key] for o in outcomes]
                summary[key] = statistics.median(summary[key + "_runs"])
        results[design] = summary
    ours = results["ours"]["wall_s"]
    for design in DESIGNS:
        results[design]["wall_over_ours"] = results[design]["wall_s"] / ours
    results["speedup_vs_stage_synchronous"] = results["stage_synchronous"]["wall_s"] / ours
    results["speedup_vs_sequential"] = results["sequential"]["wall_s"] / ours
    return results


async def client_costs(pools: Pools, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Client CPU per request of each call the loop makes, `requests` of them `in_flight` at a time."""
    reset_workers(pools, args.seed, args.capacity_latency_bound)
    episode = make_episode(args.prompts, args.per_prompt, args.holdout)
    problems = [p for chunk in episode.train_chunks_P for p in chunk]
    solution = "Reasoning xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\nAnswer: 42"
    out = {}
    for label, grader_kind, call in (
        ("student.solve (SGLangPool, text)", "project", "solve"),
        ("student.solve_n, n=m (SGLangPool, text; per request of m attempts)", "project", "solve_n"),
        ("teacher.write_info (SGLangPool, ids + log-probs)", "project", "teach"),
        ("OpenAIGrader.grade (chat_api, aiohttp)", "project", "grade"),
        ("OpenAIGrader.grade over the openai SDK (baseline)", "openai_sdk", "grade"),
    ):
        roles, client_pools = await build_roles(pools, args, Ledger(), grader_kind)
        from slime_meta.types import Grade

        attempt = GradedAttempt(problem=problems[0], solution=solution, grade=Grade(0.5, "fake"))
        attempts = [[attempt] * args.attempts]

        def one(i: int, call=call, roles=roles, attempts=attempts):
            p = problems[i % len(problems)]
            if call == "solve":
                return roles.student.solve(p, "Check the units.")
            if call == "solve_n":
                return roles.student.solve_n(p, "Check the units.", args.attempts)
            if call == "teach":
                return roles.teacher.write_info([p], attempts, "Check the units.")
            return roles.grader.grade(p, solution)

        gate = asyncio.Semaphore(args.cost_in_flight)

        async def gated(i: int, gate=gate, one=one):
            async with gate:
                return await one(i)

        await asyncio.gather(*[gated(i) for i in range(max(16, args.cost_requests // 10))])  # warm-up
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*[gated(i) for i in range(args.cost_requests)])
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        await close_roles(roles, client_pools)
        out[label] = {
            "cpu_ms_per_request": 1000.0 * cpu / args.cost_requests,
            "wall_s": wall,
            "requests": args.cost_requests,
            "in_flight": args.cost_in_flight,
        }
        print(f"  [client cost] {label}: {out[label]['cpu_ms_per_request']:.3f} ms/req", file=sys.stderr, flush=True)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small step (the test suite runs this)")
    p.add_argument("--prompts", type=int, default=32, help="N: teacher prompts (GRPO groups)")
    p.add_argument("--samples", type=int, default=4, help="G: infos per teacher prompt")
    p.add_argument("--iterations", type=int, default=3, help="K: inner iterations")
    p.add_argument("--attempts", type=int, default=4, help="m: student attempts per problem per iteration")
    p.add_argument("--per-prompt", type=int, default=1, help="k: train problems per teacher prompt")
    p.add_argument("--holdout", type=int, default=4, help="holdout problems")
    p.add_argument("--median-ms", type=float, default=50.0)
    p.add_argument("--sigma", type=float, default=0.6, help="lognormal shape of the latency")
    p.add_argument("--workers", type=int, default=4, help="workers per pool")
    p.add_argument(
        "--capacity-latency-bound",
        type=int,
        default=None,
        help="requests at once per worker, latency-bound scenario (default: no queueing at all)",
    )
    p.add_argument("--capacity-bound", type=int, default=8, help="requests at once per worker, capacity-bound scenario")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sequential-chains", type=int, default=4, help="chains the sequential baseline runs (then scaled)")
    p.add_argument("--full-sequential", action="store_true", help="run the sequential baseline over the whole step")
    p.add_argument("--cost-requests", type=int, default=2000, help="requests per client in the client-cost table")
    p.add_argument("--cost-in-flight", type=int, default=256, help="requests in flight in the client-cost table")
    p.add_argument("--router-policy", default="round_robin", help="sglang-router --policy for the three routers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default runs/benchmarks/inner_loop.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.iterations, args.attempts, args.holdout = 4, 2, 2, 2, 2
        args.workers, args.median_ms, args.repeats, args.sequential_chains = 2, 10.0, 1, 1
        args.capacity_bound, args.cost_requests, args.cost_in_flight = 2, 40, 8
    if args.capacity_latency_bound is None:  # every request of the widest stage in service at once
        widest = args.prompts * args.samples * max(args.per_prompt * args.attempts, args.holdout) + args.holdout
        args.capacity_latency_bound = -(-widest // args.workers)
    return args


async def main_async(args: argparse.Namespace) -> dict:
    import tempfile

    report = C.report_header("inner_loop", {k: v for k, v in vars(args).items() if k != "out"})
    with tempfile.TemporaryDirectory(prefix="bench-inner-") as logs, C.Children(Path(logs)) as children:
        started = time.perf_counter()
        pools = start_pools(children, args)
        report["startup_s"] = time.perf_counter() - started
        report["latency_bound"] = await scenario("latency bound", args.capacity_latency_bound, pools, children, args)
        report["capacity_bound"] = await scenario(
            "capacity bound", args.capacity_bound, pools, children, args, warm_up=not args.quick
        )
        report["client_cost"] = await client_costs(pools, args)
    lat, cap = report["latency_bound"], report["capacity_bound"]
    report["targets"] = TARGETS
    report["meets"] = {
        "latency_bound_ratio": lat["ours"]["bound_over_achieved"] >= TARGETS["latency_bound_ratio"],
        "capacity_bound_ratio": cap["ours"]["bound_over_achieved"] >= TARGETS["capacity_bound_ratio"],
        "faster_than_stage_synchronous": all(s["speedup_vs_stage_synchronous"] > 1 for s in (lat, cap)),
        "client_cpu_ms_per_request": max(
            lat["ours"]["client_cpu_ms_per_request"], cap["ours"]["client_cpu_ms_per_request"]
        )
        <= TARGETS["client_cpu_ms_per_request"],
    }
    return report


def print_table(report: dict) -> None:
    rows = []
    for key in ("latency_bound", "capacity_bound"):
        s = report[key]
        bound = s["ours"]["bound_s"]
        for i, design in enumerate(DESIGNS):
            d = s[design]
            name = design + (" (extrapolated)" if d.get("extrapolated") else "")
            rows.append(
                [
                    f"{key} ({s['capacity_per_pool']}/pool)" if i == 0 else "",
                    name,
                    d["wall_s"],
                    d.get("bound_s"),
                    d.get("bound_over_achieved", bound / d["wall_s"]),
                    d.get("bound_n_s"),
                    d.get("bound_n_over_achieved"),
                    d.get("cpu_floor_s"),
                    d.get("machine_bound_over_achieved"),
                    d["wall_over_ours"],
                    d["client_cpu_ms_per_request"],
                    d["router_cpu_ms_per_request"] + d["fake_worker_cpu_ms_per_request"],
                ]
            )
    st = report["settings"]
    print(f"\nclient CPU per request, {st['cost_requests']} requests, {st['cost_in_flight']} in flight:")
    print(C.table([[k, v["cpu_ms_per_request"]] for k, v in report["client_cost"].items()], ["call", "CPU ms/req"]))
    print(
        f"\ninner loop: N={st['prompts']} G={st['samples']} K={st['iterations']} m={st['attempts']} "
        f"k={st['per_prompt']} holdout={st['holdout']}, "
        f"latency lognormal median {st['median_ms']} ms sigma {st['sigma']}, "
        f"{st['workers']} workers/pool, median of {st['repeats']} run(s); baselines' bound/wall: ours' bound"
    )
    print(
        C.table(
            rows,
            [
                "scenario (capacity)",
                "design",
                "wall s",
                "bound s",
                "bound/wall",
                "n bound s",
                "n bound/wall",
                "CPU floor s",
                "max(bound, CPU floor)/wall",
                "wall/ours",
                "client CPU ms/req",
                "router+workers CPU ms/req",
            ],
        )
    )
    print("meets: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in report["meets"].items()))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    path = C.write_json(report, args.out or C.default_out("inner_loop" + ("_quick" if args.quick else "")))
    print_table(report)
    print(f"json: {path}")
    return report


if __name__ == "__main__":
    main()
