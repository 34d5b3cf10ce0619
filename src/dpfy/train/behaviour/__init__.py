"""Checks of what the user's code does, not what its types are (guide §5.5.1, and beyond it).

Each example's contribution must depend on that example alone — probed in the collate path
(:mod:`dpfy.data.collate_probe`), the model (:mod:`.model_probe`) and the loss
(:mod:`.loss_probe`) — and nothing may change the model outside the private step
(:mod:`.state_watch`). :class:`.checks.BehaviourChecks` holds them for one run.
"""
