"""scripts/test_gpu.sh runs every test file with a case that needs a CUDA device, and no other; what it
leaves out (the Triton-interpreter cases) is checked on the GPU by a twin that runs the same kernels compiled."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/test_gpu.sh"

# Each interpreted case -> the CUDA case that checks the same kernels against the same reference.
CUDA_TWINS = {
    "test_fused_ops.py::test_kernels_match_torch_interpreted": "test_kernels_match_torch_on_cuda",
    "test_fused_ops.py::test_decoder_with_kernels_gives_the_same_tokens_interpreted": (
        "test_static_decoder_graphs_give_the_same_tokens_on_cuda"
    ),
    "test_fused_ops.py::test_paged_decoder_with_kernels_gives_the_same_tokens_interpreted": (
        "test_paged_decoder_with_kernels_gives_the_same_tokens_on_cuda"
    ),
    "test_paged_attention.py::test_kernel_matches_float64_reference_interpreted": (
        "test_kernel_matches_float64_reference_on_cuda"
    ),
    "test_paged_attention.py::test_paged_decoder_kernel_equals_gather_interpreted": (
        "test_paged_decoder_kernel_equals_gather_on_cuda"
    ),
    "test_sampling_kernel.py::test_kernel_choice_matches_torch_interpreted": "test_kernel_choice_matches_torch_on_cuda",
}


def selected_files() -> set[str]:
    text = SCRIPT.read_text()
    block = re.search(r"GPU_TEST_FILES=\((.*?)\)", text, re.S).group(1)
    return {Path(word).name for word in block.split()}


# A file needs the GPU run when one of its cases depends on CUDA being there: it skips or branches on
# torch.cuda.is_available(), or carries the `gpu` mark or the helpers' `needs_cuda` skip. A file that
# merely names CUDA (a CPU test of `--weight-sync cuda-ipc`'s refusal, a cache key) is a CPU test and
# stays in scripts/test.sh only.
NEEDS_CUDA = re.compile(r"torch\.cuda\.is_available\(\)|pytest\.mark\.gpu\b|^@needs_cuda\b", re.M)


def test_the_gpu_run_is_exactly_the_files_with_a_case_that_needs_cuda():
    needs_cuda = {
        path.name
        for path in (ROOT / "tests").glob("test_*.py")
        if path.name != Path(__file__).name and NEEDS_CUDA.search(path.read_text())
    }
    assert needs_cuda == selected_files(), sorted(needs_cuda ^ selected_files())
    assert all((ROOT / "tests" / name).is_file() for name in selected_files())


def test_every_interpreter_case_has_a_cuda_twin_that_the_gpu_run_keeps():
    interpreted = {
        f"{path.name}::{name}"
        for path in (ROOT / "tests").glob("test_*.py")
        for name in re.findall(r"^def (test_\w*interpreted\w*)\(", path.read_text(), re.M)
    }
    assert interpreted == set(CUDA_TWINS), sorted(interpreted ^ set(CUDA_TWINS))
    for case, twin in CUDA_TWINS.items():
        file_name = case.split("::")[0]
        assert "interpreted" not in twin
        assert re.search(rf"^def {twin}\(", (ROOT / "tests" / file_name).read_text(), re.M), (case, twin)
        assert file_name in selected_files()


def test_without_a_gpu_it_exits_2_with_one_line(tmp_path):
    # A python whose torch sees no CUDA device (this machine's, or a stand-in where torch has CUDA).
    stand_in = tmp_path / "python3"
    stand_in.write_text("#!/usr/bin/env bash\nexit 1\n")
    stand_in.chmod(0o755)
    result = subprocess.run(
        ["bash", str(SCRIPT)], env={"PATH": "/usr/bin:/bin", "PYTHON": str(stand_in)}, capture_output=True, text=True
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "no CUDA device" in line and "scripts/test.sh" in line
