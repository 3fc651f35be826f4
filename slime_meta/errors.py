"""User-facing errors: one line, exit code 2, never a traceback."""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserInputError(Exception):
    """Bad input from the user (a flag, a file, a row, an unreachable server).

    The message is one line that names the flag, file, row or field and says what to do.
    `train.py` prints it as `error: <message>` and exits with code 2.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # one line, whatever the caller wrote


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm (`--max-skipped-steps`).

    Not the user's input but a run that cannot go on: `train.py` prints its one line and exits 1.
    """
