"""slime-meta: train LLM teachers with reinforcement learning.

A teacher writes `additional_info` for problems; its reward is how well a student solves
held-out problems with that info. See README.md and docs/architecture.md.
"""

__version__ = "0.1.0"
