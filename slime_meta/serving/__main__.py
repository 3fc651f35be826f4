"""`python -m slime_meta.serving ...` starts one worker; flags in `server.py`."""

from slime_meta.serving.server import main

if __name__ == "__main__":
    main()
