"""Suite-wide settings. Tiny models train fastest on one thread, and CI machines are shared.
Fused-or-not decisions are measured in every test process (no user cache file read or written:
a decision cached by one test would change what another measures); the cache's own tests give
it a file."""

import os

import torch

torch.set_num_threads(1)
os.environ["TRIDENS_DECISION_CACHE"] = "off"
