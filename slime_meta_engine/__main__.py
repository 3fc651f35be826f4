"""`python -m slime_meta_engine ...` starts one worker; flags in `server.py`."""

from slime_meta_engine.server import main

if __name__ == "__main__":
    main()
