"""``SimEngine``: the engine protocol with no model, time from a latency model
(``latency``), for the cluster simulator and load tests."""
