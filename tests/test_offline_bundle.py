"""The offline bundle for GPU hosts without network (docs/cluster.md, "3. offline, from a bundle").

No network: the lock file is read as text, the bundle script runs with --dry-run, and the install
script installs a small bundle made here (two tiny wheels, an SGLang patch, slime and Megatron-LM
stand-ins) with the real pip, patch and sha256sum.
"""

import base64
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "scripts" / "offline" / "gpu-host-py312.lock"
BUNDLE_SH = REPO / "scripts" / "offline_bundle.sh"
INSTALL_SH = REPO / "scripts" / "offline_install.sh"

# What docs/cluster.md promises the bundle carries, at these versions.
PROMISED = {
    "sglang": "0.5.15.post1",
    "sglang-kernel": "0.4.4",
    "flashinfer-python": "0.6.12",
    "flashinfer-cubin": "0.6.12",
    "xgrammar": "0.2.1",
    "apache-tvm-ffi": "0.1.11",
    "transformers": "5.12.1",
    "tokenizers": "0.22.2",
    "openai": "2.6.1",
    "sglang-router": "0.3.2",
    "ray": "2.60.0",
    "torch-memory-saver": "0.0.10",
    "numpy": "1.26.4",
    "scipy": "1.17.1",
}


def lock_pins() -> list[tuple[str, str, list[str]]]:
    """(name, version, sha256 hashes) of every pin, in pip's hash format with `\\` continuations."""
    text = re.sub(r"\\\n", " ", LOCK.read_text())
    pins = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)((?:\s+--hash=sha256:\S+)+)", line)
        assert m, f"not a pinned line with hashes: {line!r}"
        pins.append((m.group(1), m.group(2), re.findall(r"--hash=sha256:(\S+)", m.group(3))))
    return pins


def test_lock_pins_each_package_once_with_a_sha256():
    pins = lock_pins()
    names = [re.sub(r"[-_.]+", "-", n).lower() for n, _, _ in pins]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for name, _, hashes in pins:
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), name
    # the host's torch is used: nothing in the lock may replace it
    assert not {"torch", "torchvision", "torchaudio", "triton"} & set(names)


def test_lock_has_the_promised_versions():
    versions = {n: v for n, v, _ in lock_pins()}
    assert {n: versions.get(n) for n in PROMISED} == PROMISED
    # what slime and slime-meta import on the training path and the host lacks
    for name in ("wandb", "pylatexenc", "math-verify", "fastapi", "uvicorn", "pydantic", "pyzmq", "ipython"):
        assert name in versions, name


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def test_dry_run_lists_every_pin_and_hopper_only_drops_the_cubins(tmp_path):
    out = run(["bash", str(BUNDLE_SH), str(tmp_path / "b"), "--dry-run"])
    assert out.returncode == 0, out.stderr
    listed = re.findall(r"^  (\S+==\S+)$", out.stdout, re.M)
    assert listed == [f"{n}=={v}" for n, v, _ in lock_pins()]
    assert "624b824a898ab0ec1fcb4d373004c7f3852bf515" in out.stdout
    assert "1dcf0dafa884ad52ffb243625717a3471643e087" in out.stdout
    assert not (tmp_path / "b").exists(), "--dry-run wrote something"

    hopper = run(["bash", str(BUNDLE_SH), str(tmp_path / "b"), "--dry-run", "--hopper-only"])
    assert hopper.returncode == 0, hopper.stderr
    assert "flashinfer-cubin==0.6.12" not in hopper.stdout
    assert "  sglang-kernel==0.4.4" in hopper.stdout and "flash_ops.abi3.so" in hopper.stdout


@pytest.mark.parametrize(
    "args, names",
    [
        (["--bogus"], "--bogus"),
        (["--python", "3.11"], "gpu-host-py311.lock"),
        (["--slime-src", "/nonexistent/slime.tar.gz"], "--slime-src"),
        ([], "OUT_DIR"),
    ],
)
def test_bundle_script_refuses_bad_input_in_one_line(tmp_path, args, names):
    out_dir = [] if args == [] else [str(tmp_path / "b")]
    out = run(["bash", str(BUNDLE_SH), *out_dir, *args, "--dry-run"])
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and names in out.stderr, out.stderr


# ---- the install script on a small bundle -------------------------------------------------------


def tiny_wheel(dest: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel with a correct RECORD, written with zipfile (what pip wheel would give)."""
    dist = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files[f"{dist}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        record.append(f"{path},sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    path = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def tiny_tar(path: Path, top: str, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


SGLANG_PATCH = """diff --git a/python/sglang/version.py b/python/sglang/version.py
--- a/python/sglang/version.py
+++ b/python/sglang/version.py
@@ -1 +1 @@
-patched = False
+patched = True
"""


@pytest.fixture
def bundle(tmp_path) -> Path:
    b = tmp_path / "bundle"
    (b / "wheels").mkdir(parents=True)
    (b / "src").mkdir()
    (b / "patches" / "sglang").mkdir(parents=True)
    tiny_wheel(
        b / "wheels", "sglang", "0.5.15.post1", {"sglang/__init__.py": "", "sglang/version.py": "patched = False\n"}
    )
    tiny_wheel(b / "wheels", "offline_probe", "1.0", {"offline_probe.py": "VALUE = 42\n"})
    (b / "patches" / "sglang" / "sglang.patch").write_text(SGLANG_PATCH)
    (b / "patches" / "sglang" / "series").write_text("sglang.patch\n")
    tiny_tar(b / "src" / "slime.tar.gz", "slime", {"slime/__init__.py": "", "train.py": ""})
    tiny_tar(b / "src" / "Megatron-LM.tar.gz", "Megatron-LM", {"megatron/__init__.py": ""})
    (b / "bundle.txt").write_text("python=%d.%d\n" % sys.version_info[:2])
    (b / "install.sh").write_text(INSTALL_SH.read_text())
    lines = []
    for f in sorted(p for p in b.rglob("*") if p.is_file()):
        lines.append(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.relative_to(b)}")
    (b / "MANIFEST.sha256").write_text("\n".join(lines) + "\n")
    return b


def install(bundle: Path, *args: str):
    env = dict(os.environ, PYTHON=sys.executable)
    return run(["bash", str(bundle / "install.sh"), str(bundle), *args], env=env)


def test_install_puts_wheels_patches_and_sources_under_the_prefix(bundle, tmp_path):
    prefix = tmp_path / "prefix"
    out = install(bundle, "--prefix", str(prefix))
    assert out.returncode == 0, out.stderr
    site = prefix / "site-packages"
    assert (site / "offline_probe.py").is_file()
    assert (site / "sglang" / "version.py").read_text() == "patched = True\n"  # slime's patch, applied
    assert (prefix / "src" / "slime" / "slime" / "__init__.py").is_file()
    assert (prefix / "src" / "Megatron-LM" / "megatron" / "__init__.py").is_file()

    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(f"export PYTHONPATH={site}:{prefix}/src/Megatron-LM:{prefix}/src/slime")
    assert line in (prefix / "env.sh").read_text()
    # the printed line makes the bundle importable, and only where it is sourced
    probe = f'{line}; "{sys.executable}" -c "import offline_probe, sglang.version, megatron, slime; '
    probe += 'print(offline_probe.VALUE, sglang.version.patched)"'
    shown = run(["bash", "-c", probe], env=dict(os.environ, PYTHONPATH=""))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split() == ["42", "True"]
    assert run([sys.executable, "-c", "import offline_probe"], env=dict(os.environ, PYTHONPATH="")).returncode != 0


def test_install_refuses_a_tampered_or_missing_file(bundle, tmp_path):
    wheel = next((bundle / "wheels").glob("offline_probe-*.whl"))
    wheel.write_bytes(wheel.read_bytes() + b"x")
    out = install(bundle, "--prefix", str(tmp_path / "p1"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"offline_install: {bundle}/wheels/{wheel.name} differs from MANIFEST.sha256 or is missing:"
        " copy the bundle again"
    ]
    assert not (tmp_path / "p1").exists(), "installed from a bundle that failed its check"

    wheel.unlink()
    missing = install(bundle, "--prefix", str(tmp_path / "p2"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert wheel.name in missing.stderr


def test_install_refuses_another_python_and_bad_flags(bundle, tmp_path):
    (bundle / "bundle.txt").write_text("python=3.1\n")
    lines = [line for line in (bundle / "MANIFEST.sha256").read_text().splitlines() if "bundle.txt" not in line]
    digest = hashlib.sha256((bundle / "bundle.txt").read_bytes()).hexdigest()
    (bundle / "MANIFEST.sha256").write_text("\n".join([*lines, f"{digest}  bundle.txt"]) + "\n")
    out = install(bundle, "--prefix", str(tmp_path / "p"))
    assert out.returncode == 2 and "set PYTHON=python3.1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1

    bad = install(bundle, "--target", "x")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "offline_install: unknown flag --target: use BUNDLE_DIR [--prefix DIR]"
    ]
