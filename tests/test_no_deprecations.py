"""No library deprecation warning on the console: the model calls that decode with a KV cache (the
demo's model build, the embedded worker) name the cache as the installed transformers does (`cache`
from transformers 5 on, `past_key_values` before), so neither its FutureWarning nor its
"`past_key_values`/`cache_params` are deprecated" line appears.

Each check runs in a fresh process: transformers logs that line once per process, so a test
sharing the process with another that triggered it first would see nothing either way.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DECODE_BOTH_WAYS = """
import sys, threading
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from slime_meta.models.tiny.training import generate
from slime_meta_engine.engine import GenerationEngine
from slime_meta_engine.protocol import GenerationSpec, SamplingParams
from slime_meta_engine.rows import GenerationJob

path = sys.argv[1]
model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
print("build:", generate(model, tokenizer, ["ab", "cd", "efg"], 4, "cpu"))
engine = GenerationEngine(
    model,
    decode=lambda ids, skip: tokenizer.decode(list(ids), skip_special_tokens=skip),
    device=torch.device("cpu"),
    eos_token_ids=frozenset(),
    pad_token_id=tokenizer.pad_token_id,
)
engine.start()
done, outcomes = threading.Event(), []
spec = GenerationSpec("a", tuple(tokenizer.encode("hello")), SamplingParams(max_new_tokens=6, temperature=0))
engine.submit(GenerationJob(spec, on_done=lambda outcome: (outcomes.append(outcome), done.set())))
assert done.wait(60)
engine.stop()
print("worker:", outcomes[0].output_ids)
"""


def test_decoding_with_a_kv_cache_warns_about_nothing(tiny_checkpoint):
    result = subprocess.run(
        [sys.executable, "-c", DECODE_BOTH_WAYS, str(tiny_checkpoint)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "build:" in result.stdout and "worker:" in result.stdout
    console = result.stdout + result.stderr
    for word in ("deprecated", "DeprecationWarning", "FutureWarning"):
        assert word not in console, console[-3000:]
