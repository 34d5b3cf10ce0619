"""Published per-feature ranges of the bundled tabular datasets: the constants their fixed
scaling uses, so that nothing is computed from the private training split (guide §5.5.1, tab. 5).

Each range is public and comes from the dataset's own documentation, not from the rows a run
trains on:

- breast-cancer: the minimum and maximum scikit-learn's description of the dataset lists for each
  feature (``load_breast_cancer().DESCR``, "Summary Statistics", over all 569 rows). They are
  statistics the dataset's publisher released with it; a run uses them as given and so
  releases nothing new about its training rows.
- adult: bounds from the census coding that ``adult.names`` documents — the extraction kept
  ages above 16, weights above 1 and positive hours; the Census Bureau top-codes age at 90,
  hours at 99 and capital gains and losses at the five-digit 99999; education-num counts the 16
  listed education levels. The final weight has no published maximum: 10⁷ bounds every weight
  of the 1994 survey's population of about 2·10⁸ people only loosely, which is all a log scale
  needs.
"""

from __future__ import annotations

#: (min, max) of each breast-cancer feature, in the dataset's column order.
BREAST_CANCER_RANGES: tuple[tuple[float, float], ...] = (
    (6.981, 28.11),  # radius (mean)
    (9.71, 39.28),  # texture (mean)
    (43.79, 188.5),  # perimeter (mean)
    (143.5, 2501.0),  # area (mean)
    (0.053, 0.163),  # smoothness (mean)
    (0.019, 0.345),  # compactness (mean)
    (0.0, 0.427),  # concavity (mean)
    (0.0, 0.201),  # concave points (mean)
    (0.106, 0.304),  # symmetry (mean)
    (0.05, 0.097),  # fractal dimension (mean)
    (0.112, 2.873),  # radius (standard error)
    (0.36, 4.885),  # texture (standard error)
    (0.757, 21.98),  # perimeter (standard error)
    (6.802, 542.2),  # area (standard error)
    (0.002, 0.031),  # smoothness (standard error)
    (0.002, 0.135),  # compactness (standard error)
    (0.0, 0.396),  # concavity (standard error)
    (0.0, 0.053),  # concave points (standard error)
    (0.008, 0.079),  # symmetry (standard error)
    (0.001, 0.03),  # fractal dimension (standard error)
    (7.93, 36.04),  # radius (worst)
    (12.02, 49.54),  # texture (worst)
    (50.41, 251.2),  # perimeter (worst)
    (185.2, 4254.0),  # area (worst)
    (0.071, 0.223),  # smoothness (worst)
    (0.027, 1.058),  # compactness (worst)
    (0.0, 1.252),  # concavity (worst)
    (0.0, 0.291),  # concave points (worst)
    (0.156, 0.664),  # symmetry (worst)
    (0.055, 0.208),  # fractal dimension (worst)
)

#: (low, high) of each numeric Adult column, in :data:`dpfy.data.adult.NUMERIC` order.
ADULT_RANGES: tuple[tuple[float, float], ...] = (
    (17.0, 90.0),  # age: extracted above 16, top-coded at 90
    (1.0, 1e7),  # fnlwgt: extracted above 1; no published maximum (see above)
    (1.0, 16.0),  # education-num: the 16 education levels
    (0.0, 99999.0),  # capital-gain: five-digit top code
    (0.0, 99999.0),  # capital-loss: five-digit top code
    (1.0, 99.0),  # hours-per-week: positive, top-coded at 99
)
