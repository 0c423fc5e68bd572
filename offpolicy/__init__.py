"""offpolicy: asynchronous one-step-off-policy RL post-training for LLMs, built on message queues.

Kept import-light on purpose: `import offpolicy` loads nothing heavy; import submodules directly.
"""

__version__ = "0.1.0"
