"""Comparing arms (heads and losses) on cached features of a base: what `bench/evidence*.py` and `causalqwen compare`
share, so both give the same numbers for the same data. One concern per module: `arms` (the arms and their losses),
`training` (one run), `metrics` (what a run is scored on), `splits` (seeded splits and label noise), `stats` (paired
tests, Holm, the rate choice), `features` (the base's features, cached), `verdicts` (the paired table), `plots`
(compare's plots, from its result dict)."""
