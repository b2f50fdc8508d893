"""Distributed TF1 training: AfterAggregation and local ps/worker clusters."""
