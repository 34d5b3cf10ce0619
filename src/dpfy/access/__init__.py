"""The guide's access models beyond full training (§3.2, table 1).

Label-only DP (the labels are private, the features public), prediction-level DP (only served
answers are released, the model never is) and input-level DP (the data is privatised before any
training). Full-training DP-SGD lives in :mod:`dpfy.train`.
"""
