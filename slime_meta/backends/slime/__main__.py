"""`python -m slime_meta.backends.slime ...`: the same as `python train.py --backend slime ...`."""

import sys

from slime_meta.backends.slime.cli import main

if __name__ == "__main__":
    sys.exit(main())
