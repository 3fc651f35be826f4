"""The verifier's math child process: math-verify (sympy) behind a pipe, one request at a time.

Why a process: sympy can spend seconds (or, inside one C-level big-integer operation, minutes)
on a short answer, and a thread cannot be stopped. Here each request runs on this process's
main thread under a `setitimer` alarm, so ordinary sympy work ends at its budget and the process
answers "timeout" and stays warm; the parent (`math_pool.py`) kills the process when no reply
comes shortly after the budget (a C-level computation that no signal handler can interrupt).
The address space is capped, so a huge power fails with MemoryError here instead of taking the
machine's memory.

Protocol, one JSON object per line: request `{"op": "is_math" | "equal", "a": str, "b": str,
"budget_s": float}`; reply `{"result": bool}` or `{"timeout": true}`. The first line written is
`{"ready": true}` once math-verify is imported and warm.
"""

from __future__ import annotations

import json
import logging
import signal
import sys

MEMORY_LIMIT_BYTES = 2 << 30


class _OutOfTime(BaseException):
    """Raised by the alarm; a BaseException so that sympy's `except Exception` cannot swallow it."""


_armed = False


def _on_alarm(signum, frame):
    if _armed:
        raise _OutOfTime


def _limit_memory() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT_BYTES, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # not Linux, or a tighter limit already applies
        pass


def main() -> None:
    global _armed
    _limit_memory()
    # math-verify warns on every call made without its own (main-thread alarm) timeout: ours is here.
    logging.disable(logging.WARNING)
    import math_verify

    config = [math_verify.LatexExtractionConfig()]

    def parse(text: str) -> list:
        return math_verify.parse(f"${text}$", extraction_config=config, parsing_timeout=None)

    def is_math(text: str, _unused: str) -> bool:
        parsed = parse(text)
        return bool(parsed) and not isinstance(parsed[0], str)

    def equal(gold: str, answer: str) -> bool:
        gold_parsed, answer_parsed = parse(gold), parse(answer)
        if not gold_parsed or not answer_parsed:
            return False
        return bool(math_verify.verify(gold_parsed, answer_parsed, timeout_seconds=None))

    operations = {"is_math": is_math, "equal": equal}
    signal.signal(signal.SIGALRM, _on_alarm)
    equal("1", "1.0")  # first calls load sympy's lazy parts: pay that before saying ready
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        reply: dict = {"result": False}
        try:
            _armed = True
            signal.setitimer(signal.ITIMER_REAL, max(0.001, float(request["budget_s"])))
            reply = {"result": operations[request["op"]](request["a"], request.get("b", ""))}
        except _OutOfTime:
            reply = {"timeout": True}
        except Exception:  # noqa: BLE001 - an answer sympy cannot read is not equal / not math
            reply = {"result": False}
        finally:
            _armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
