"""A seeded random-graph fuzzer: a grammar of user-written models and a harness that runs each through mqbench."""
