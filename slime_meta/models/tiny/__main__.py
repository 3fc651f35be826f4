"""`python -m slime_meta.models.tiny ...` builds (or finds in the cache) the tiny model; flags in `build.py`."""

from slime_meta.models.tiny.build import main

if __name__ == "__main__":
    main()
