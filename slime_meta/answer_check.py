"""How the built-in verifier reads and checks a solution: kept for the names other modules import.

The verifier lives in `slime_meta.verifier` (reading the final answer, the label's forms, the
verdict, bounded math); this module re-exports what callers outside it use: `extract_answer` and
`normalize_answer` (replay voting), `stated_answers`, and `check` (one verdict).
"""

from __future__ import annotations

from slime_meta.verifier import (  # noqa: F401 - re-exported
    DEFAULT_TIMEOUT_S,
    CheckTimeout,
    MathPool,
    Verdict,
    check,
    extract_answer,
    normalize_answer,
    stated_answers,
)
