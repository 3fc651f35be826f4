"""`--grader local` where it cannot run: the slime backend refuses it with what to do instead.

The local path itself runs with the real model in tests/test_real_model_loop.py.
"""

from __future__ import annotations

import pytest

from slime_meta.backends.slime.plan import translate
from slime_meta.errors import UserInputError


def test_grader_local_is_refused_on_the_slime_backend_with_what_to_do_instead(tmp_path):
    with pytest.raises(UserInputError) as refused:
        translate(["--colocate", "--hf-checkpoint", str(tmp_path), "--grader", "local"])
    assert "--grader-base-url" in str(refused.value) and "--grader local" in str(refused.value)
