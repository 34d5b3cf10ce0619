"""Shared test set-up.

Tests train tiny models: one intra-op thread is faster for them, and avoids thread
oversubscription when the suite shares a small machine with other work.

Under CI (``CI`` set) hypothesis runs derandomized: the same examples every run, so a landing
never depends on the draw. Locally it explores new examples each run.
"""

import os

import torch
from hypothesis import settings

torch.set_num_threads(1)

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
