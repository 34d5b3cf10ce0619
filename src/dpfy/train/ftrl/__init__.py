"""DP-FTRL: private training with no sampling assumption (Kairouz et al. 2021; guide §4.3, tab. 3).

- :mod:`dpfy.train.noise.tree` — online tree-aggregation noise for prefix sums (plain and Honaker's
  efficient estimator), O(log T) tensors per parameter, restarts;
- :mod:`dpfy.plan.tree_events` — which steps release a node an example can sit in, and the run's
  events (``TreeAggregationEvent`` per epoch, or one ``GaussianEvent`` per node);
- :mod:`dpfy.train.ftrl.optim` — :class:`DPFTRLOptimizer`, FTRL (with optional momentum) on the
noisy
  prefix sums of clipped gradient sums from dpfy's per-example engines;
- :mod:`dpfy.data.ordered_sampling` — batches in shuffled or fixed order, recorded as "no sampling
  assumption";
- :mod:`dpfy.train.ftrl.session` — :func:`make_private_ftrl` (also
``make_private(algorithm="dp-ftrl")``).
"""

from dpfy.data.ordered_sampling import OrderedSampler
from dpfy.plan.tree_events import (
    charged_nodes,
    ftrl_step_events,
    ftrl_tree_events,
    new_tree_nodes,
    resolve_restart,
)
from dpfy.train.ftrl.optim import DPFTRLOptimizer
from dpfy.train.ftrl.session import make_private_ftrl
from dpfy.train.noise.tree import TREE_VARIANTS, TreeNoise, node_variance, prefix_variance

__all__ = [
    "TREE_VARIANTS",
    "DPFTRLOptimizer",
    "OrderedSampler",
    "TreeNoise",
    "charged_nodes",
    "ftrl_step_events",
    "ftrl_tree_events",
    "make_private_ftrl",
    "new_tree_nodes",
    "node_variance",
    "prefix_variance",
    "resolve_restart",
]
