"""Shared test set-up.

Tests train tiny models: one intra-op thread is faster for them, and avoids thread
oversubscription when the suite shares a small machine with other work.
"""

import torch

torch.set_num_threads(1)
