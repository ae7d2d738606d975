"""nanorl: a single-node, hackable, minimal trainer for reinforcement learning on language models.

One concept per file; see README.md for the layout and docs/tour.md for a guided tour.
"""
__version__ = "0.1.0"
