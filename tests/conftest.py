"""Suite-wide settings. Tiny models train fastest on one thread, and CI machines are shared."""

import torch

torch.set_num_threads(1)
