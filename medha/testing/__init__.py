"""What only the test suite (tests/) uses: how a test compares numbers (numerics: float32's
rounding bound per logit, greedy decisions with near-ties excepted) and the fixed reference CPU
every test plans on (reference_cpu). Nothing outside tests/ imports this package; what the
benchmarks in bench/ share with the tests lives in medha/benchmark/."""
