"""Weight push time per step: disk vs shared memory vs CUDA IPC, trainer and one worker on one host.

    python benchmarks/weight_sync.py --out benchmarks/results/weight_sync_h100.json    # GPU, 0.5B Qwen2 shape
    python benchmarks/weight_sync.py --shape tiny --device cpu                          # a toy model: the script runs

A random-init Qwen2-shaped model (bf16 on disk), the local trainer (fp32 master weights) and one
real worker (bf16 on CUDA, float32 on the CPU; CUDA graphs off: they do not change the copy) in
one LocalProcessGroup. Per mode: one warm-up push, then `--steps` timed pushes, each the whole
`push_weights` call of a train step (publish + every worker's in-place load + acknowledgement),
as `perf/weight_push_time` measures it. After each mode the worker scores a probe: every mode
must serve the same log-probs as the disk push. Table last, JSON with `--out`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import default_out, report_header, table, write_json  # noqa: E402
from trainer_memory import SHAPES  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5B")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default=None, help="comma-separated; default disk,shared-memory(,cuda-ipc on CUDA)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch
    from trainer import build_model_dir

    from slime_meta.backends.local.training.settings import TrainerSettings
    from slime_meta.backends.local.training.trainer import LocalTrainer
    from slime_meta.backends.local.workers.launcher import LocalProcessGroup
    from slime_meta.backends.local.workers.weight_sync import WeightSync, make_weight_sync, push_weights
    from slime_meta.errors import UserInputError
    from slime_meta.rollout.pools import post_json_sync

    modes = (
        args.modes.split(",")
        if args.modes
        else ["disk", "shared-memory"] + (["cuda-ipc"] if args.device == "cuda" else [])
    )
    shape = SHAPES[args.shape]
    probe = list(range(5, 69))
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp, LocalProcessGroup() as group:
        weights_root = Path(tmp) / "weights"
        # Inside the weights root, so that the worker can be put back on the start weights per mode.
        model_dir = build_model_dir(shape, weights_root / "start", torch.device(args.device))
        pool = group.start_pool(
            "teacher",
            str(model_dir),
            1,
            device=args.device,
            weights_root=str(weights_root),
            log_dir=str(Path(tmp) / "logs"),
            worker_args=["--cuda-graphs", "off", "--max-batch-size", "4"],
        )
        trainer = LocalTrainer(str(model_dir), TrainerSettings(lr=1e-6, device=args.device))
        parameters = sum(p.numel() for p in trainer.model.parameters())
        with torch.no_grad():  # the pushed weights differ from the start: a push that loads nothing shows
            for parameter in trainer.model.parameters():
                parameter.mul_(0.9)

        def score() -> list[float]:
            reply = post_json_sync(
                pool.router_url + "/generate",
                {
                    "input_ids": probe,
                    "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                },
            )
            return [entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]]

        start_logprobs = score()
        version = 0
        for mode in modes:
            group.update_weights("teacher", str(model_dir.resolve()), "start")
            try:
                sync = (
                    WeightSync("disk", weights_root)
                    if mode == "disk"
                    else make_weight_sync(mode, trainer, pool.worker_urls, weights_root, group.weight_buffer_prefix)
                )
            except UserInputError as error:  # e.g. a /dev/shm too small for the weights
                results[mode] = {"unavailable": str(error)}
                print(f"{mode}: unavailable: {error}", flush=True)
                continue
            assert sync.mode == mode, (mode, sync.mode)
            times = []
            try:
                for step in range(args.steps + 1):
                    version += 1
                    started = time.perf_counter()
                    push_weights(trainer, list(pool.worker_urls), weights_root, version, group, sync)
                    if step:  # the first push allocates and warms up
                        times.append(time.perf_counter() - started)
            except Exception as error:  # the other modes' figures still count
                results[mode] = {"unavailable": f"push failed: {error!r}"}
                print(f"{mode}: push failed: {error!r}", flush=True)
                sync.close()
                continue
            buffer_bytes = sync.buffer.size if sync.buffer is not None else None
            sync.close()
            logprobs = score()
            results[mode] = {
                "push_s": times,
                "median_s": statistics.median(times),
                "logprobs": logprobs,
                "changed_from_start": logprobs != start_logprobs,
            }
            if buffer_bytes is not None:
                results[mode]["buffer_bytes"] = buffer_bytes
        modes = [mode for mode in modes if "unavailable" not in results[mode]]
        for mode in modes:
            same = results[mode]["logprobs"] == results[modes[0]]["logprobs"]
            results[mode]["same_logprobs_as_" + modes[0]] = same
            times = results[mode]["push_s"]
            speed_up = results[modes[0]]["median_s"] / results[mode]["median_s"]
            rows.append(
                [
                    mode,
                    results[mode]["median_s"],
                    min(times),
                    max(times),
                    speed_up,
                    same and results[mode]["changed_from_start"],
                ]
            )
        for mode in modes:
            del results[mode]["logprobs"]
    settings = {
        "shape": args.shape,
        "device": args.device,
        "steps": args.steps,
        "parameters": parameters,
        "trainer_dtype": "float32",
        "worker_dtype": "bfloat16" if args.device == "cuda" else "float32",
    }
    report = {**report_header("weight_sync", settings), "results": results}
    text = table(rows, ["mode", "median push s", "min s", "max s", f"speed-up vs {modes[0]}", "served = " + modes[0]])
    report["table"] = text
    path = write_json(report, args.out or default_out("weight_sync"))
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
