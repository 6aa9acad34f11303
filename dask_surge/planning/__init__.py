"""What to run: the two-threshold policy, thresholds, the cost model, partition sizes, token samples and the run's input identity. Pure where it can be; needs no cluster."""
